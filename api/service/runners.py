"""Each served model's runner: its admission, its batcher on its device's thread and slot,
its adapter set, and its series of the metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from prometheus_client import Counter

from api.metrics import SHADOW_DROP_REASONS, Metrics
from api.models.faults import is_fatal_device_error
from api.models.predictor import NonFiniteScores, Scores
from api.models.registry import Registry, ServedModel
from api.serving.adapters import AdapterSet
from api.serving.admission import ON_ESTIMATE, ON_TOKENS, Admission
from api.serving.batch_limits import BatchLimits
from api.serving.batching import Batcher, BatchStats
from api.serving.classify import ModelRunner
from api.settings import Settings


def start_runners(
    settings: Settings,
    registry: Registry,
    metrics: Metrics,
    on_device_failed: Callable[[str], None],
) -> dict[str, ModelRunner]:
    """A started runner for each loaded model, by name, in the models file's order.
    `on_device_failed` is called, on a device thread, when a forward leaves its device lost."""
    runners: dict[str, ModelRunner] = {}
    slots: dict[str, asyncio.Semaphore] = {}
    for served in registry.in_order():
        # One thread and one slot per device: one batch at a time on each device.
        executor = registry.device_thread(served.loaded.device)
        slot = slots.setdefault(str(served.loaded.device), asyncio.Semaphore(1))
        refused = {
            judged_on: metrics.admission_refusals.labels(served.name, judged_on)
            for judged_on in (ON_ESTIMATE, ON_TOKENS)
        }
        admission = Admission(
            settings.latency_target_seconds,
            on_refuse=partial(_count_refusal, refused),
            enabled=settings.admission_control,
        )
        admission.cost.start_from(served.probe_costs)
        batcher = _batcher(settings, metrics, served, executor, slot, admission, on_device_failed)
        adapters = AdapterSet(
            served,
            executor,
            slot,
            settings.max_adapters_per_model,
            settings.max_adapter_rank,
            metrics,
        )
        runners[served.name] = ModelRunner(served, batcher, admission, adapters)
        _report_model(metrics, served)
    return runners


def _batcher(
    settings: Settings,
    metrics: Metrics,
    served: ServedModel,
    executor: ThreadPoolExecutor,
    slot: asyncio.Semaphore,
    admission: Admission,
    on_device_failed: Callable[[str], None],
) -> Batcher[Scores]:
    name = served.name

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

    for reason in SHADOW_DROP_REASONS:  # at 0 from the start: rates defined at once
        metrics.shadow_rows_dropped.labels(name, reason)

    def on_shadow_drop(reason: str, rows: int) -> None:
        metrics.labelled(metrics.shadow_rows_dropped, name, reason).inc(rows)

    batcher: Batcher[Scores] = Batcher(
        predict_batch,
        limits,
        executor,
        device_slot=slot,
        on_batch=on_batch,
        on_drop=lambda reason: metrics.batch_dropped.labels(name, reason).inc(),
        on_out_of_memory=served.predictor.release_memory,
        max_shadow_rows=settings.shadow_max_queued_rows,
        max_shadow_tokens=max(1, int(served.max_batch_tokens * settings.shadow_batch_share)),
        on_shadow_drop=on_shadow_drop,
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


def _count_refusal(counters: dict[str, Counter], judged_on: str) -> None:
    counters[judged_on].inc()
