"""How the rows waiting for a model will be cut into batches, for admission: how many
forwards they need and the tokens those compute (padding counted unless packed), as an
upper bound that costs no more than a pass over the distinct lengths."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from api.serving.batching import BatchLimits


@dataclass(frozen=True)
class Work:
    """Forwards to run: how many, and the tokens they compute in all."""

    batches: int = 0
    tokens: int = 0


def planned_work(lengths: Counter[int], limits: BatchLimits) -> Work:
    """At most what the batcher computes to run rows of these lengths (length: count).

    The bound follows the batcher's way of choosing (api.serving.batching):
    - packed: the real tokens exactly; batches as first-fit can leave them
      (see `_packed_batches`);
    - grouped by the cost model (`overhead_tokens` set): the longest rows first, each batch
      filled while it fits and padded to its first row. The batcher's dynamic programme
      picks, among such runs of sorted rows, the cut that costs least in overhead plus padded
      tokens, and re-plans what is left after each batch, so what it runs costs no more than
      this cut (measured in its own overhead);
    - rows closest in length to the oldest: every row padded to the longest queued, in
      batches as many as that padding allows. Its batches can mix lengths freely, so no
      tighter bound holds for every order the rows may arrive in.
    """
    rows = sum(lengths.values())
    if rows == 0:
        return Work()
    if limits.packed:
        return _packed(lengths, rows, limits)
    if limits.overhead_tokens is not None:
        return _longest_first(lengths, limits)
    longest = max(lengths)
    per_batch = _rows_that_fit(longest, limits)
    return Work(math.ceil(rows / per_batch), rows * longest)


def _packed(lengths: Counter[int], rows: int, limits: BatchLimits) -> Work:
    """A packed batch holds the oldest rows that fit, so every batch but the last is full
    by rows or has no room for one more row: over max_batch_tokens - longest tokens."""
    tokens = sum(length * count for length, count in lengths.items())
    room = limits.max_batch_tokens - max(lengths) + 1
    if room <= 0:  # rows longer than a batch each run alone
        return Work(rows, tokens)
    return Work(1 + math.floor(rows / limits.max_batch_size + tokens / room), tokens)


def _longest_first(lengths: Counter[int], limits: BatchLimits) -> Work:
    batches = tokens = 0
    taken = room = padded_to = 0
    for length in sorted(lengths, reverse=True):
        left = lengths[length]
        while left:
            if taken == room:  # a new batch, padded to this (its longest) row
                batches, taken, padded_to = batches + 1, 0, length
                room = _rows_that_fit(length, limits)
            joined = min(left, room - taken)
            taken, left, tokens = taken + joined, left - joined, tokens + joined * padded_to
    return Work(batches, tokens)


def _rows_that_fit(longest: int, limits: BatchLimits) -> int:
    """Rows a padded batch of this longest row may hold (one always does)."""
    return max(1, min(limits.max_batch_size, limits.max_batch_tokens // longest))
