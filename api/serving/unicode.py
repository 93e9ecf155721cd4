"""Lone surrogates: JSON may carry them ("\\ud800"), and no tokenizer, response or UTF-8 file
can hold one. One test of them for every door, and the one way to write them out."""

from __future__ import annotations

import json
import re

LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def first_lone_surrogate(texts: list[str]) -> int | None:
    """The index of the first text holding a lone surrogate, or None."""
    for index, text in enumerate(texts):
        if LONE_SURROGATE.search(text) is not None:
            return index
    return None


def has_lone_surrogate(value: object) -> bool:
    """Whether a JSON value holds a lone surrogate, in a string at any depth."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return LONE_SURROGATE.search(text) is not None


def valid_unicode(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD: text UTF-8 can hold."""
    return LONE_SURROGATE.sub("\ufffd", text)
