"""Which answers the disk tier writes under `DISK_CACHE_ADMISSION=repeated`: a text's answer
from the second time this process stores it, never one stored once.

Most texts a spam filter sees come once (a personal message); its repeats (a campaign sent to
thousands) are what a cache is for, and the LRU tier in front holds them while they are hot.
Writing every one-off answer to disk cost the model's process ~13 µs of CPU a fresh text and
wrote 7.75 KiB to storage for each (a random key's page of sqlite's index, in the write-ahead
log, then again at the checkpoint; bench/reports/split_served.md), and pushed older answers
out of the bounded tier. A filter that remembers which keys were offered once is TinyLFU's
"doorkeeper"; CacheLib admits to flash for the same reasons.
"""

from __future__ import annotations

# 4 MiB a generation. A new one starts once this many keys are marked in it, a sixteenth of
# its bits: the two generations read then have at most an eighth of the bits set between
# them, so at most 12.5 % of first offers pass for repeats (and are written, as under
# `every`). They remember the last 2-4 million keys, about what the default 1 GiB tier holds:
# a text repeated less often would have left the tier before its repeat anyway.
GENERATION_BITS = 1 << 25
GENERATION_MARKS = GENERATION_BITS // 16


class Doorkeeper:
    """Remembers the keys offered lately, in two generations of a bitmap (the current one,
    marked, and the one before it, read), one bit a key. A key is admitted when either
    generation has its bit: offered before, or sharing a bit with a key that was (a false
    positive, which only writes what `every` would). Each offer marks the key in the current
    generation, so that a key offered again within a generation of its last offer is always
    admitted. Only the event loop calls it."""

    def __init__(self, bits: int = GENERATION_BITS, marks: int = GENERATION_MARKS) -> None:
        self._bits = bits
        self._marks_per_generation = marks
        self._current = bytearray(bits // 8)
        self._previous = bytearray(bits // 8)
        self._marks = 0

    def admit(self, key: str) -> bool:
        """True if `key` was offered lately (see the class); every offer marks it."""
        # A str keeps its hash once computed: the LRU tier's lookup has, when it is on.
        index = hash(key) % self._bits
        byte, bit = index >> 3, 1 << (index & 7)
        if self._current[byte] & bit:
            return True
        seen = bool(self._previous[byte] & bit)
        self._current[byte] |= bit
        self._marks += 1
        if self._marks >= self._marks_per_generation:
            self._previous, self._current = self._current, bytearray(self._bits // 8)
            self._marks = 0
        return seen
