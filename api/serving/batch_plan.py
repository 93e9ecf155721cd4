"""How the rows waiting for a model will be cut into batches, for admission: how many
forwards they need and the tokens those compute (padding counted unless packed), as an
upper bound that costs no more than a pass over the distinct lengths."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from api.serving.batch_limits import BatchLimits


@dataclass(frozen=True)
class Work:
    """Forwards to run: how many, and the tokens they compute in all."""

    batches: int = 0
    tokens: int = 0


def planned_work(lengths: Mapping[int, int], limits: BatchLimits) -> Work:
    """At most what the batcher computes to run rows of these lengths (length: count; a
    count of 0 or less counts no row, as in a Counter after subtractions).

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
    if limits.overhead_tokens is not None and not limits.packed:
        return _longest_first(lengths, limits)
    lengths = {length: count for length, count in lengths.items() if count > 0}
    rows = sum(lengths.values())
    if rows == 0:
        return Work()
    if limits.packed:
        return _packed(lengths, rows, limits)
    longest = max(lengths)
    per_batch = _rows_that_fit(longest, limits)
    return Work(math.ceil(rows / per_batch), rows * longest)


def _packed(lengths: Mapping[int, int], rows: int, limits: BatchLimits) -> Work:
    """A packed batch holds the oldest rows that fit, so every batch but the last is full
    by rows or has no room for one more row: over max_batch_tokens - longest tokens."""
    tokens = sum(length * count for length, count in lengths.items())
    room = limits.max_batch_tokens - max(lengths) + 1
    if room <= 0:  # rows longer than a batch each run alone
        return Work(rows, tokens)
    return Work(1 + math.floor(rows / limits.max_batch_size + tokens / room), tokens)


def _longest_first(lengths: Mapping[int, int], limits: BatchLimits) -> Work:
    """Each length's rows first fill what room the open batch has left (padded to its first
    row), then open as many batches of this length as they need. Arithmetic per distinct
    length, not a step per batch: admission plans the queue for every request it judges."""
    batches = tokens = 0
    room = padded_to = 0  # the open batch: rows it can still take, and its padded length
    for length in sorted(lengths, reverse=True):
        left = lengths[length]
        if left <= 0:
            continue
        joined = min(left, room)
        tokens += joined * padded_to
        room -= joined
        left -= joined
        if left:
            fit = _rows_that_fit(length, limits)
            opened = -(-left // fit)
            batches += opened
            tokens += left * length
            room, padded_to = opened * fit - left, length
    return Work(batches, tokens)


def _rows_that_fit(longest: int, limits: BatchLimits) -> int:
    """Rows a padded batch of this longest row may hold (one always does)."""
    return max(1, min(limits.max_batch_size, limits.max_batch_tokens // longest))
