"""The app factory and its lifespan: preload, warm up, report ready, drain."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from api import __version__
from api.http.errors import install_error_handlers
from api.http.middleware.auth import ApiKeyGuard
from api.http.middleware.body_limit import BodySizeLimit
from api.http.middleware.direct import DirectRoutes
from api.http.routes import ROUTERS
from api.http.routes.common import OwnBodyRoute
from api.http.split.model_side import ModelSide
from api.http.state import Phase, ServiceState
from api.metrics import Metrics
from api.models.faults import is_fatal_device_error
from api.models.predictor import NonFiniteScores, Scores
from api.models.registry import Registry, ServedModel
from api.models.spec import ModelSpec, load_models_file
from api.observability.middleware import RequestObserver
from api.serving.adapter_folder import AdapterFolder
from api.serving.adapters import AdapterSet
from api.serving.admission import Admission
from api.serving.batching import Batcher, BatchLimits, BatchStats
from api.serving.cache import ResultCache
from api.serving.cascade import Cascade, cascade_models, cascade_threshold
from api.serving.classify import ModelRunner
from api.serving.heap import ServingHeap
from api.settings import Settings

logger = logging.getLogger(__name__)

FatalHandler = Callable[[BaseException], None]


class DeviceFailed(RuntimeError):
    """A forward pass failed in a way that leaves its device unusable (a CUDA device-side
    assert, an illegal memory access): every later batch would fail; a new process recovers."""


def create_app(
    settings: Settings,
    specs: list[ModelSpec] | None = None,
    on_fatal: FatalHandler | None = None,
) -> FastAPI:
    """Builds the app; models load in the background once it starts (see /ready).

    `on_fatal` is called, on the event loop, when a model fails to load, or with a
    DeviceFailed when a forward pass leaves its device unusable (the service is then failed:
    /ready 503); the CLI uses it to stop the server with a non-zero exit.
    """
    if settings.transformers_cache is not None:
        logger.warning(
            "TRANSFORMERS_CACHE is deprecated (transformers reads HF_HOME, whose hub/ folder "
            "is the cache); honoured here: hub ids resolve from %s",
            settings.transformers_cache,
        )
    if specs is None:
        specs = load_models_file(settings.models_file, settings.adapter_dirs)
    cascade = cascade_models(settings, specs)
    metrics = Metrics(settings.latency_target_seconds)
    registry = Registry(specs, settings)
    state = ServiceState(settings=settings, registry=registry, metrics=metrics)

    heap = ServingHeap(settings.gc_gen0_threshold)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.cache = ResultCache.from_settings(settings, metrics)
        loading = asyncio.create_task(_load(state, cascade, heap, on_fatal))
        # The split's front ends call in from the start: refused 503 until the models are in.
        model_side = None
        if settings.split_socket is not None:
            model_side = ModelSide(app, state, settings.split_socket)
            await model_side.start()
        try:
            yield
        finally:
            if state.phase is not Phase.FAILED:
                state.phase = Phase.DRAINING
            metrics.ready.set(0)
            if model_side is not None:
                await model_side.close()
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await asyncio.gather(*(r.batcher.stop() for r in state.runners.values()))
            await asyncio.gather(*(r.adapters.close() for r in state.runners.values()))
            registry.close()
            await state.cache.close()
            heap.release()  # what start-up built may be garbage now: collectable again

    app = FastAPI(
        title="loraserve",
        version=__version__,
        description="Text classification with LoRA adapters (text-embeddings-inference API).",
        lifespan=lifespan,
        # The service traces, counts and logs its requests itself (api.observability):
        # FastAPI's own OpenTelemetry, on wherever a global provider is set (as
        # `opentelemetry-instrument` sets one), would add a second span and set of metrics to
        # each request, and its check for a provider costs every request a few µs.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = state
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_middleware(app, state, ROUTERS)
    return app


def install_middleware(app: FastAPI, state: ServiceState, routers: Iterable[APIRouter]) -> None:
    """The layers every request of `app` (the service's, or a front end's) goes through;
    `routers`: those it includes, whose OwnBodyRoutes are answered without FastAPI's router."""
    settings = state.settings
    # Added last = runs first. Innermost: the hot routes, answered without FastAPI's router.
    # (Taken from the routers: the app's own list holds what inclusion wrapped them in.)
    direct = [
        route for router in routers for route in router.routes if isinstance(route, OwnBodyRoute)
    ]
    app.add_middleware(DirectRoutes, routes=direct, handlers=app.exception_handlers)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Always: without ADMIN_API_KEY it keeps the adapter routes closed.
    api_key, admin_key = (
        None if key is None else key.get_secret_value()
        for key in (settings.api_key, settings.admin_api_key)
    )
    app.add_middleware(ApiKeyGuard, api_key=api_key, admin_key=admin_key)
    # Outermost: every answer carries the request's id, and its metrics, access line and span
    # see every answer, 401s and 413s included.
    app.add_middleware(RequestObserver, state=state)


async def _load(
    state: ServiceState,
    cascade: tuple[str, str] | None,
    heap: ServingHeap,
    on_fatal: FatalHandler | None,
) -> None:
    try:
        await asyncio.to_thread(state.registry.load_all)
        loop = asyncio.get_running_loop()

        def device_failed(reason: str) -> None:  # called on a device thread
            loop.call_soon_threadsafe(_fail_device, state, on_fatal, reason)

        _start_runners(state, device_failed)
        if cascade is not None:
            first, second = (state.runners[name] for name in cascade)
            threshold, source = cascade_threshold(state.settings, first.served.loaded.spec)
            state.cascade = Cascade(first, second, threshold, state.metrics, source)
        adapters_dir = await _read_adapters_dir(state)
    except Exception as exc:
        state.phase, state.error = Phase.FAILED, str(exc)
        logger.error("start-up failed: %s", exc)
        if on_fatal is not None:
            on_fatal(exc)
        return
    if state.phase is Phase.LOADING:
        heap.settle()
        state.phase = Phase.READY
        state.metrics.ready.set(1)
        logger.info("ready: %s", ", ".join(state.registry.models))
    if adapters_dir is not None:
        await adapters_dir.run()  # until the lifespan cancels loading, at shutdown


async def _read_adapters_dir(state: ServiceState) -> AdapterFolder | None:
    """Loads what ADAPTERS_DIR holds, before the service turns ready: a restart serves the
    same set. The folder is then followed until shutdown (None: no ADAPTERS_DIR)."""
    root = state.settings.adapters_dir
    if root is None:
        return None
    adapter_sets = {name: runner.adapters for name, runner in state.runners.items()}
    folder = AdapterFolder(root, adapter_sets, state.settings.adapters_poll_seconds)
    await folder.sync(settle=False)
    return folder


def _fail_device(state: ServiceState, on_fatal: FatalHandler | None, reason: str) -> None:
    """The service after a fatal device error: failed, not ready, and told to stop."""
    if state.phase is Phase.FAILED:
        return
    state.phase, state.error = Phase.FAILED, reason
    state.metrics.ready.set(0)
    logger.critical("fatal device error, the service stops: %s", reason)
    if on_fatal is not None:
        on_fatal(DeviceFailed(reason))


def _start_runners(state: ServiceState, on_device_failed: Callable[[str], None]) -> None:
    slots: dict[str, asyncio.Semaphore] = {}
    for served in state.registry.in_order():
        # One thread and one slot per device: one batch at a time on each device.
        executor = state.registry.device_thread(served.loaded.device)
        slot = slots.setdefault(str(served.loaded.device), asyncio.Semaphore(1))
        refused = state.metrics.admission_refusals.labels(served.name)
        admission = Admission(
            state.settings.latency_target_seconds,
            on_refuse=refused.inc,
            enabled=state.settings.admission_control,
        )
        admission.cost.start_from(served.probe_costs)
        batcher = _batcher(state, served, executor, slot, admission, on_device_failed)
        adapters = AdapterSet(
            served,
            executor,
            slot,
            state.settings.max_adapters_per_model,
            state.settings.max_adapter_rank,
            state.metrics,
        )
        state.runners[served.name] = ModelRunner(served, batcher, admission, adapters)
        _report_model(state.metrics, served)


def _batcher(
    state: ServiceState,
    served: ServedModel,
    executor: ThreadPoolExecutor,
    slot: asyncio.Semaphore,
    admission: Admission,
    on_device_failed: Callable[[str], None],
) -> Batcher[Scores]:
    settings, metrics, name = state.settings, state.metrics, served.name

    # This model's series, looked up once (see Metrics.labelled).
    batch_size, batch_tokens, batch_seconds, queue_wait = (
        metric.labels(name)
        for metric in (
            metrics.batch_size,
            metrics.batch_tokens,
            metrics.batch_inference_seconds,
            metrics.queue_wait_seconds,
        )
    )

    def on_batch(stats: BatchStats) -> None:
        admission.batch_ran(stats)
        batch_size.observe(stats.rows)
        batch_tokens.observe(stats.tokens)
        batch_seconds.observe(stats.run_seconds)
        for seconds in stats.queue_seconds:
            queue_wait.observe(seconds)

    limits = BatchLimits(
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=served.max_batch_tokens,
        max_wait_seconds=settings.max_batch_wait_seconds,
        max_queue_requests=settings.max_queue_size,
        overhead_tokens=served.overhead_tokens,
        packed=served.predictor.packs_batches,
        refill_wait_seconds=settings.batch_refill_wait_seconds,
    )

    def predict_batch(
        rows: list[list[int]], adapters: list[str | None]
    ) -> list[Scores | NonFiniteScores]:
        try:
            results = served.predictor.forward(rows, adapters)
        except Exception as exc:
            # Its batch fails as any other; the device, though, is lost for every later one.
            if is_fatal_device_error(exc):
                first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                on_device_failed(f"model {name!r}: {first_line}")
            raise
        failed = sum(isinstance(result, NonFiniteScores) for result in results)
        if failed:
            metrics.non_finite_rows.labels(name).inc(failed)
        return results

    batcher: Batcher[Scores] = Batcher(
        predict_batch,
        limits,
        executor,
        device_slot=slot,
        on_batch=on_batch,
        on_drop=lambda reason: metrics.batch_dropped.labels(name, reason).inc(),
        on_out_of_memory=served.predictor.release_memory,
    )
    metrics.queue_depth.labels(name).set_function(lambda: batcher.queued_rows)
    batcher.start()
    return batcher


def _report_model(metrics: Metrics, served: ServedModel) -> None:
    loaded, spec = served.loaded, served.loaded.spec
    for phase, seconds in loaded.phases.items():
        metrics.model_load_seconds.labels(spec.name, phase).set(seconds)
    metrics.model_weight_bytes.labels(spec.name).set(loaded.weight_bytes)
    for adapter in loaded.adapters or ["none"]:
        metrics.model_info.labels(
            spec.name,
            spec.base or "",
            loaded.revision or "",
            adapter,
            spec.quantization,
            loaded.dtype,
            str(loaded.device),
        ).set(1)
