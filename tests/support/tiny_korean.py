"""A tiny Korean classifier on disk: a 2-layer ELECTRA with a random head whose WordPiece
vocabulary is Hangul syllables (each alone and as a word's continuation), labels ham, spam."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tests.support.tiny_models import SPECIALS, build_encoder_classifier


def hangul_vocab(texts: Iterable[str]) -> dict[str, int]:
    """The specials, then every character of `texts` alone and as ##continuation."""
    chars = sorted({char for text in texts for char in text if not char.isspace()})
    tokens = SPECIALS + chars + [f"##{char}" for char in chars]
    return {token: index for index, token in enumerate(dict.fromkeys(tokens))}


def build_korean_classifier(folder: Path, texts: Iterable[str], seed: int = 0) -> Path:
    """The classifier in `folder`, its vocabulary the characters of `texts`."""
    return build_encoder_classifier(folder, "electra", seed, hangul_vocab(texts))
