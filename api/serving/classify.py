"""One classification request: cache first, then the model's batcher, then the cache again."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from api.models.predictor import Scores
from api.models.registry import ServedModel
from api.observability import tracing
from api.serving.adapters import AdapterSet, Lease
from api.serving.admission import ON_ESTIMATE, Admission
from api.serving.batching import Batcher
from api.serving.cache import Entry, ResultCache, cache_key
from api.serving.cache.tiers import DEFAULT_TIER_NAMES, Lookup
from api.serving.cache.verify import AnswerShape
from api.serving.errors import DeadlineExceeded
from api.serving.gathered_encoding import GatheredEncoder
from api.serving.identity import AnswerIdentity
from api.serving.token_estimate import TokenEstimate


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

    @cached_property
    def _encoder(self) -> GatheredEncoder:
        return GatheredEncoder(self.served.predictor.encode_many)

    @property
    def answer_shape(self) -> AnswerShape:
        """What every answer of this model looks like, for the cache to check what it reads."""
        loaded = self.served.loaded
        multi_label = loaded.problem_type == "multi_label_classification"
        return AnswerShape(len(loaded.labels), multi_label)

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
        model only for those no cache tier holds, all before `deadline` (monotonic clock).
        The caches are asked first: a request they answer whole attaches nothing, not even
        an evicted run-time adapter."""
        name = self.served.adapter_for(adapter)
        identity = self.adapters.answer_identity(name)
        if cache is None or not cache.enabled:
            lease = await self.adapters.lease(name, deadline)
            try:
                scores = await self._compute(texts, lease.adapter, truncate, deadline)
            finally:
                self.adapters.release(lease)
            return Classified(scores, ["model"] * len(texts))
        found = await self._look_up(texts, identity, truncate, cache)
        if None not in found.entries:
            return Classified([Scores(*entry) for entry in found.entries if entry], found.tiers)
        # Held until answered: a swap or unload meanwhile leaves this request's weights be.
        lease = await self.adapters.lease(name, deadline)
        try:
            if lease.identity.digest != identity.digest:  # swapped since: that version's answers
                found = await self._look_up(texts, lease.identity, truncate, cache)
            return await self._fill(texts, found, lease, truncate, cache, deadline)
        finally:
            self.adapters.release(lease)

    async def shadow(
        self, texts: list[str], adapter: str | None, truncate: bool, wait: float
    ) -> list[Scores | None]:
        """Scores the texts with `adapter` for nobody waiting (the side of a rollout that did
        not answer them), as shadow rows, the first the batcher drops when short of room (see
        `Batcher.shadow`); None for each text dropped. The caches are neither read nor
        written: the clients' hit ratio and the entries they hold stay as they would be
        without a candidate."""
        if self.batcher.busy():  # dropped before any tokenizing
            self.batcher.count_shadow_dropped("busy", len(texts))
            return [None] * len(texts)
        deadline = time.monotonic() + wait
        lease = await self.adapters.lease(adapter, deadline)
        try:
            rows = await self._encoder.encode(texts, truncate)
            left = max(0.0, deadline - time.monotonic())
            return await self.batcher.shadow(rows, [lease.adapter] * len(rows), left)
        finally:
            self.adapters.release(lease)

    async def _look_up(
        self, texts: list[str], identity: AnswerIdentity, truncate: bool, cache: ResultCache
    ) -> Lookup:
        keys = [cache_key(identity.digest, truncate, text) for text in texts]
        return await cache.lookup(keys, self.answer_shape)

    async def _fill(
        self,
        texts: list[str],
        found: Lookup,
        lease: Lease,
        truncate: bool,
        cache: ResultCache,
        deadline: float,
    ) -> Classified:
        """The cached answers, and the model's for the texts no tier held (then stored)."""
        missing = [index for index, entry in enumerate(found.entries) if entry is None]
        results: list[Scores | None] = [
            None if entry is None else Scores(*entry) for entry in found.entries
        ]
        if missing:
            computed = await self._compute(
                [texts[i] for i in missing], lease.adapter, truncate, deadline
            )
            for index, one in zip(missing, computed, strict=True):
                results[index] = one
            entries: list[Entry] = [(s.probabilities, s.logits) for s in computed]
            cache.store([found.keys[i] for i in missing], entries)
        return Classified([r for r in results if r is not None], found.tiers)

    @cached_property
    def _token_estimate(self) -> TokenEstimate:
        return TokenEstimate(self.served.predictor.max_length)

    async def _compute(
        self, texts: list[str], adapter: str | None, truncate: bool, deadline: float
    ) -> list[Scores]:
        # Judged first on the texts' lengths as estimated from their characters: under
        # overload most requests are refused, and tokenizing them took CPU from the forward
        # (bench/reports/overload.md). One that passes is judged again once tokenized.
        estimated = self._token_estimate.lengths(texts)
        if estimated is not None:
            backlog = self.batcher.backlog_of_lengths(estimated)
            # With nothing queued ahead only its real length tells: a request over the
            # target on its own is run alone, not refused.
            if backlog.ahead.batches:
                self.admission.check(backlog, seconds_left(deadline), ON_ESTIMATE)
        with tracing.span("tokenize"):
            rows = await self._encoder.encode(texts, truncate)
        self._token_estimate.observe(texts, rows)
        left = seconds_left(deadline)
        adapters = [adapter] * len(rows)
        with tracing.span("admission"):
            estimate = self.admission.check(self.batcher.backlog(rows, adapters), left)
        queued = time.monotonic()
        scores = await self.batcher.submit(rows, adapters, left)
        if estimate is not None:
            self.admission.waited(estimate, time.monotonic() - queued)
        return scores
