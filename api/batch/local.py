"""Scoring in this process: the models file, loader, batcher, predictor and cache tiers the
server runs, started by the server's own lifespan, with no HTTP in the way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from api.batch.scoring import Outcome, Refused, Servable, Target, refusal_of
from api.http.app import create_app
from api.http.errors import ServiceError
from api.http.lifecycle import check_lengths, pick_cascade, pick_runner, service_error
from api.http.state import Phase, ServiceState
from api.models.spec import ModelSpec
from api.serving.cascade import CASCADE_NAME
from api.serving.classify import ModelRunner
from api.serving.ranking import rank
from api.settings import Settings

# No client waits on a file's texts: the batcher's queue, not a deadline, paces them.
NO_DEADLINE_SECONDS = 24 * 3600.0


class StartFailed(RuntimeError):
    """The models did not load."""


@asynccontextmanager
async def started_service(
    settings: Settings, specs: list[ModelSpec] | None = None
) -> AsyncIterator[ServiceState]:
    """The service's state once its own lifespan has loaded and warmed every model (`specs`,
    or the models file's), until the block ends; StartFailed if they did not load."""
    app = create_app(settings, specs)
    state: ServiceState = app.state.service
    async with app.router.lifespan_context(app):
        while state.phase is Phase.LOADING:
            await asyncio.sleep(0.05)
        if state.phase is not Phase.READY:
            raise StartFailed(state.error or f"service is {state.phase.value}")
        yield state


@asynccontextmanager
async def local_service(
    settings: Settings, specs: list[ModelSpec], use_cache: bool = True
) -> AsyncIterator[LocalSource]:
    """The models loaded and warmed as the server does it, until the block ends.

    Admission by time is off: it keeps a live client's wait under the latency target by
    refusing what would queue too long, and here the only client is the file, whose next
    chunk queueing behind the running one is what keeps the device busy."""
    no_admission = settings.model_copy(update={"admission_control": False})
    async with started_service(no_admission, specs) as state:
        yield LocalSource(state, use_cache)


class LocalSource:
    """Scores with the runners of a started service state."""

    def __init__(self, state: ServiceState, use_cache: bool = True) -> None:
        self.state = state
        self.use_cache = use_cache

    async def describe(self, target: Target) -> Servable:
        try:
            if target.cascade:
                cascade = pick_cascade(self.state, target.adapter)
                runners: tuple[ModelRunner, ...] = cascade.runners
                adapters = [r.served.adapter_for(None) for r in runners]
                name, adapter = CASCADE_NAME, None
            else:
                runner, adapter = pick_runner(self.state, target.model, target.adapter)
                runners, adapters, name = (runner,), [adapter], runner.served.name
        except ServiceError as exc:
            raise Refused(exc.code, exc.message) from None
        first = runners[0].served.loaded
        return Servable(
            model=name,
            adapter=adapter,
            labels=list(first.labels),
            decision_threshold=None if target.cascade else first.spec.decision_threshold,
            identities={
                r.served.name: r.identities[a].digest
                for r, a in zip(runners, adapters, strict=True)
            },
        )

    async def score(self, target: Target, texts: list[str], truncate: bool) -> list[Outcome]:
        state = self.state
        cache = state.cache if self.use_cache else None
        deadline = time.monotonic() + NO_DEADLINE_SECONDS
        try:
            check_lengths(texts, state.settings)
            if target.cascade:
                cascade = pick_cascade(state, target.adapter)
                labels = cascade.first.served.loaded.labels
                result, answered_by = await cascade.classify(texts, truncate, cache, deadline)
            else:
                runner, adapter = pick_runner(state, target.model, target.adapter)
                labels = runner.served.loaded.labels
                result = await runner.classify(texts, adapter, truncate, cache, deadline)
                answered_by = [runner.served.name] * len(texts)
        except ServiceError as exc:
            raise refusal_of(exc) from None
        except Exception as exc:
            error = service_error(exc)
            if error is None:
                raise
            raise refusal_of(error) from None
        return [
            Outcome(rank(labels, scores, "softmax", None), by)
            for scores, by in zip(result.scores, answered_by, strict=True)
        ]
