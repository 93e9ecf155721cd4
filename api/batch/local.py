"""Scoring in this process: the service core the server runs (the models file, loader,
batcher, predictor and cache tiers), with no HTTP, no socket and no watched folder."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from api.batch.scoring import MULTI_LABEL, Outcome, Servable, Target, refusal_of
from api.models.spec import ModelSpec
from api.service.contract import ClassifyRequest
from api.service.core import Service
from api.serving.cascade import CASCADE_NAME
from api.serving.classify import ModelRunner
from api.serving.errors import ServiceError
from api.serving.ranking import rank
from api.settings import Settings

# No client waits on a file's texts: the batcher's queue, not a deadline, paces them.
NO_DEADLINE_SECONDS = 24 * 3600.0


@asynccontextmanager
async def started_service(
    settings: Settings,
    specs: list[ModelSpec] | None = None,
    follow_adapters_dir: bool = True,
    run_candidates: bool = True,
) -> AsyncIterator[Service]:
    """A service core with every model (`specs`, or the models file's) loaded and warmed, until
    the block ends; StartFailed if they did not load."""
    service = Service(
        settings, specs, follow_adapters_dir=follow_adapters_dir, run_candidates=run_candidates
    )
    await service.start()
    try:
        await service.started()
        yield service
    finally:
        await service.close()


@asynccontextmanager
async def local_service(
    settings: Settings, specs: list[ModelSpec], batch_size: int, use_cache: bool = True
) -> AsyncIterator[LocalSource]:
    """The models loaded and warmed as the server does it, until the block ends, for a file
    scored `batch_size` texts a request.

    Set for a file, not for live clients: admission by time is off (it keeps a live client's
    wait under the latency target by refusing what would queue too long, and here the only
    client is the file, whose next chunk queueing behind the running one is what keeps the
    device busy); no deadline; ADAPTERS_DIR is read at the start and not followed (the file
    is scored with the adapters the run began with); no socket is bound, SPLIT_SOCKET or not
    (the split's socket is a door of the server's, not the core's)."""
    for_a_file = settings.model_copy(
        update={
            "admission_control": False,
            "request_timeout_seconds": NO_DEADLINE_SECONDS,
            "max_texts_per_request": max(batch_size, settings.max_texts_per_request),
        }
    )
    # No candidate runs for a file: each text is answered by its model's default adapter.
    started = started_service(for_a_file, specs, follow_adapters_dir=False, run_candidates=False)
    async with started as service:
        yield LocalSource(service, use_cache)


class LocalSource:
    """Scores with a started service core."""

    def __init__(self, service: Service, use_cache: bool = True) -> None:
        self.service = service
        self.use_cache = use_cache

    async def describe(self, target: Target) -> Servable:
        try:
            if target.cascade:
                cascade = self.service.pick_cascade(target.adapter)
                runners: tuple[ModelRunner, ...] = cascade.runners
                adapters = [r.served.adapter_for(None) for r in runners]
                name, adapter = CASCADE_NAME, None
            else:
                runner, adapter = self.service.pick_runner(target.model, target.adapter)
                runners, adapters, name = (runner,), [adapter], runner.served.name
        except ServiceError as exc:
            raise refusal_of(exc) from None
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
            multi_label=first.problem_type == MULTI_LABEL,
        )

    async def score(self, target: Target, texts: list[str], truncate: bool) -> list[Outcome]:
        model = CASCADE_NAME if target.cascade else target.model
        request = ClassifyRequest(texts, model, target.adapter, truncate, self.use_cache)
        try:
            answer = await self.service.classify(request)
        except ServiceError as exc:
            raise refusal_of(exc) from None
        return [
            Outcome(rank(answer.labels, scores, "softmax", None), by)
            for scores, by in zip(answer.result.scores, answer.answered_by, strict=True)
        ]
