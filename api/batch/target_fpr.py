"""Where a decision threshold must fall for a two-label model to call at most a target share
of the negative rows (ham) positive (spam) on one file: the cut that keeps the best recall,
and a value to write as `decision_threshold` that makes the same cut.

A row is positive when its score is above the threshold, strictly. The lowest threshold
that lets at most k of the n negatives above it is the (k+1)-th highest negative score:
every threshold from there up to the next higher score makes the same cut.
"""

from __future__ import annotations

import bisect
import math
from array import array

# At least as many decimals as the models file's thresholds are written with.
MIN_DECIMALS = 6
# Past this many decimals a double's decimal form changes no more (17 significant digits).
MAX_DECIMALS = 17


def allowed_false_positives(negatives: int, target: float) -> int:
    """The most of `negatives` rows that may be positive for a rate of at most `target`:
    the largest k with k / negatives <= target, as the reported rate divides (in floats:
    0.29 × 100 is 28.999…, yet 29 / 100 is 0.29)."""
    if negatives == 0:
        return 0
    allowed = min(negatives, math.floor(target * negatives))
    while allowed < negatives and (allowed + 1) / negatives <= target:
        allowed += 1
    while allowed > 0 and allowed / negatives > target:
        allowed -= 1
    return allowed


def negatives_needed(target: float) -> int:
    """The fewest negative rows on which a rate of at most `target` allows one false
    positive: with fewer, only a threshold above every negative meets it, and the file
    cannot tell that rate from 0."""
    needed = max(1, math.ceil(1.0 / target))
    while needed > 1 and 1.0 / (needed - 1) <= target:
        needed -= 1
    while 1.0 / needed > target:
        needed += 1
    return needed


def lowest_cut(
    negatives: array[float], positives: array[float], allowed: int
) -> tuple[float, float | None]:
    """The highest score the lowest threshold letting at most `allowed` of the ascending
    `negatives` above it leaves negative, and the lowest score of either ascending array
    above that (None: no row scores above it). Needs allowed < len(negatives)."""
    cut = negatives[len(negatives) - allowed - 1]
    above = [
        scores[index]
        for scores in (negatives, positives)
        if (index := bisect.bisect_right(scores, cut)) < len(scores)
    ]
    return cut, min(above, default=None)


def shortest_between(low: float, high: float) -> float | None:
    """A value strictly between `low` and `high` with the fewest decimals, MIN_DECIMALS at
    least, so that written with them it still makes the cut between those two scores
    (the midpoint rounded to 6 decimals can land on one of them); None when no double lies
    between them."""
    middle = (low + high) / 2
    for decimals in range(MIN_DECIMALS, MAX_DECIMALS + 1):
        value = round(middle, decimals)
        if low < value < high:
            return value
    return None
