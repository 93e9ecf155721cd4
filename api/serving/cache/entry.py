"""What every cache tier holds and keys by: an answer's scores, under its identity's key."""

from __future__ import annotations

import hashlib
import math

Entry = tuple[tuple[float, ...], tuple[float, ...]]  # probabilities, logits


def cache_key(identity: str, truncate: bool, text: str) -> str:
    """Everything that changes the answer: the servable's identity (weights, adapter,
    numerics, versions: api.serving.identity), truncation, and the text."""
    digest = hashlib.sha256()
    for part in (identity, "t" if truncate else "f", text):
        digest.update(part.encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def is_finite(entry: Entry) -> bool:
    """No NaN or infinity among its scores: only such entries are ever stored or served."""
    return all(map(math.isfinite, entry[0] + entry[1]))
