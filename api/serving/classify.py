"""One classification request: cache first, then the model's batcher, then the cache again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from api.models.predictor import Scores
from api.models.registry import ServedModel
from api.serving.adapters import AdapterSet, Lease
from api.serving.admission import Admission
from api.serving.batching import Batcher, DeadlineExceeded
from api.serving.cache import Entry, ResultCache, cache_key
from api.serving.cache.tiers import DEFAULT_TIER_NAMES
from api.serving.identity import AnswerIdentity

INLINE_TOKENIZE_MAX_CHARS = 4096


@dataclass
class Classified:
    """The scores per text and which tier answered each (lru, disk or model)."""

    scores: list[Scores]
    tiers: list[str]

    def cache_header(self, names: Sequence[str] = DEFAULT_TIER_NAMES) -> str:
        """`lru=1,disk=0,model=2`: how many texts each of the tiers `names` answered."""
        return ",".join(f"{tier}={self.tiers.count(tier)}" for tier in names)


def seconds_left(deadline: float) -> float:
    """Seconds until `deadline` (on `time.monotonic`'s clock); past it, DeadlineExceeded."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded("the request's deadline passed before its texts were queued")
    return left


@dataclass
class ModelRunner:
    """A served model with its batcher and adapters: what a route calls to classify texts."""

    served: ServedModel
    batcher: Batcher[Scores]
    admission: Admission
    adapters: AdapterSet

    @property
    def identities(self) -> dict[str | None, AnswerIdentity]:
        """Per adapter (None: a model without adapters), what identifies its answers."""
        return self.adapters.identities()

    async def classify(
        self,
        texts: list[str],
        adapter: str | None,
        truncate: bool,
        cache: ResultCache | None,
        deadline: float,
    ) -> Classified:
        """Scores the texts with the adapter named (None: the model's default), asking the
        model only for those no cache tier holds, all before `deadline` (monotonic clock)."""
        # Held until answered: a swap or unload meanwhile leaves this request's weights be.
        lease = await self.adapters.lease(self.served.adapter_for(adapter), deadline)
        try:
            return await self._classify(texts, lease, truncate, cache, deadline)
        finally:
            self.adapters.release(lease)

    async def _classify(
        self,
        texts: list[str],
        lease: Lease,
        truncate: bool,
        cache: ResultCache | None,
        deadline: float,
    ) -> Classified:
        adapter = lease.adapter
        if cache is None or not cache.enabled:
            scores = await self._compute(texts, adapter, truncate, deadline)
            return Classified(scores, ["model"] * len(texts))
        identity = lease.identity.digest
        keys = [cache_key(identity, truncate, text) for text in texts]
        found = await cache.lookup(keys)
        missing = [index for index, entry in enumerate(found.entries) if entry is None]
        results: list[Scores | None] = [
            None if entry is None else Scores(*entry) for entry in found.entries
        ]
        if missing:
            computed = await self._compute([texts[i] for i in missing], adapter, truncate, deadline)
            for index, one in zip(missing, computed, strict=True):
                results[index] = one
            entries: list[Entry] = [(s.probabilities, s.logits) for s in computed]
            cache.store([keys[i] for i in missing], entries)
        return Classified([r for r in results if r is not None], found.tiers)

    async def _compute(
        self, texts: list[str], adapter: str | None, truncate: bool, deadline: float
    ) -> list[Scores]:
        # A few SMS tokenize in tens of microseconds, less than a hand-off to a thread costs;
        # long inputs go to a thread so the event loop keeps serving. Either way this runs
        # while the current batch computes (torch releases the GIL).
        encode = self.served.predictor.encode
        if sum(map(len, texts)) <= INLINE_TOKENIZE_MAX_CHARS:
            rows = encode(texts, truncate)
        else:
            rows = await asyncio.to_thread(encode, texts, truncate)
        left = seconds_left(deadline)
        adapters = [adapter] * len(rows)
        estimate = self.admission.check(self.batcher.backlog(rows, adapters), left)
        queued = time.monotonic()
        scores = await self.batcher.submit(rows, adapters, left)
        if estimate is not None:
            self.admission.waited(estimate, time.monotonic() - queued)
        return scores
