"""Reading a byte-length header strictly: ASCII digits only, and not too many of them.

`str.isdigit()` also accepts '²' or '٣', which `int()` then refuses; `int()` refuses more
than 4,300 digits outright. Whatever a client sends, a length is either these digits or
not a length, so a malformed header is the client's error (400), never the server's (500).
"""

from __future__ import annotations

import re

# 19 digits hold every length a 64-bit size can (and far more than any body limit).
_ASCII_LENGTH = re.compile(rb"[0-9]{1,19}")


def parse_length(value: str | bytes) -> int | None:
    """The length `value` states, or None when it is not one (empty, signed, spaced,
    non-ASCII digits, too long)."""
    raw = value.encode("latin-1", errors="replace") if isinstance(value, str) else value
    if _ASCII_LENGTH.fullmatch(raw) is None:
        return None
    return int(raw)
