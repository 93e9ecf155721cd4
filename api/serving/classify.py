"""One classification request: cache first, then the model's batcher, then the cache again."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from api.models.predictor import Scores
from api.models.registry import ServedModel
from api.serving.batching import Batcher
from api.serving.cache import Entry, ResultCache, cache_key

INLINE_TOKENIZE_MAX_CHARS = 4096


@dataclass
class Classified:
    """The scores per text and which tier answered each (lru, disk or model)."""

    scores: list[Scores]
    tiers: list[str]

    def cache_header(self) -> str:
        """`lru=1,disk=0,model=2`: how many texts each tier answered."""
        return ",".join(f"{tier}={self.tiers.count(tier)}" for tier in ("lru", "disk", "model"))


@dataclass
class ModelRunner:
    """A served model with its batcher: what a route calls to classify texts."""

    served: ServedModel
    batcher: Batcher[Scores]

    async def classify(
        self,
        texts: list[str],
        adapter: str | None,
        truncate: bool,
        cache: ResultCache | None,
        timeout: float,
    ) -> Classified:
        """Scores the texts, asking the model only for those no cache tier holds."""
        spec = self.served.loaded.spec
        if cache is None or not cache.enabled:
            scores = await self._compute(texts, adapter, truncate, timeout)
            return Classified(scores, ["model"] * len(texts))
        fingerprint = self.served.fingerprint(adapter)
        keys = [cache_key(fingerprint, spec.max_length, truncate, text) for text in texts]
        found = cache.lookup(keys)
        missing = [index for index, entry in enumerate(found.entries) if entry is None]
        results: list[Scores | None] = [
            None if entry is None else Scores(*entry) for entry in found.entries
        ]
        if missing:
            computed = await self._compute([texts[i] for i in missing], adapter, truncate, timeout)
            for index, one in zip(missing, computed, strict=True):
                results[index] = one
            entries: list[Entry] = [(s.probabilities, s.logits) for s in computed]
            cache.store([keys[i] for i in missing], entries)
        return Classified([r for r in results if r is not None], found.tiers)

    async def _compute(
        self, texts: list[str], adapter: str | None, truncate: bool, timeout: float
    ) -> list[Scores]:
        # A few SMS tokenize in tens of microseconds, less than a hand-off to a thread costs;
        # long inputs go to a thread so the event loop keeps serving. Either way this runs
        # while the current batch computes (torch releases the GIL).
        encode = self.served.predictor.encode
        if sum(map(len, texts)) <= INLINE_TOKENIZE_MAX_CHARS:
            rows = encode(texts, truncate)
        else:
            rows = await asyncio.to_thread(encode, texts, truncate)
        return await self.batcher.submit(rows, [adapter] * len(rows), timeout)
