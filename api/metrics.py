"""Every Prometheus metric of the service, declared once, in its own registry per app."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

PREFIX = "loraserve"
# Request latency buckets: fine below the 100 ms batch target, and one at the 2 s target.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
BATCH_TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768)
ADAPTER_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ADAPTER_LOAD_RESULTS = ("loaded", "swapped", "unchanged", "reloaded", "refused", "cancelled")
# A score or a score difference, in twentieths: an answer's P(positive), a candidate's minus
# its served adapter's.
SCORE_BUCKETS = tuple(round(i / 20, 2) for i in range(1, 21))
SCORE_DIFFERENCE_BUCKETS = tuple(round(i / 10, 1) for i in range(-9, 11))
# Why a shadow row was not scored: the model was busy when it came, the shadow queue was
# full, no batch had room for it before its time ran out, the service stopped, its forward
# (or its adapter's attach) failed.
SHADOW_DROP_REASONS = ("busy", "queue_full", "no_room", "stopped", "failed")
# Every refused request is counted under the reason its status code stands for.
REJECTION_REASON_BY_STATUS = {
    400: "invalid",
    401: "unauthorized",
    404: "not_found",
    413: "too_large",
    422: "invalid",
    429: "queue_full",
    503: "unavailable",
    504: "deadline",
}

# The families each HTTP request fills (api.http.middleware.observe). A front end of the split
# answers every request, so its own are the true ones; the rest are the model side's.
REQUEST_FAMILIES = frozenset(
    f"{PREFIX}_{name}"
    for name in (
        "request_duration_seconds",
        "requests",
        "requests_over_target",
        "requests_in_flight",
        "rejections",
    )
)


class GpuMemoryCollector(Collector):
    """GPU memory per device from torch; yields nothing where CUDA is absent."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        import torch

        if not torch.cuda.is_available():
            return
        allocated = GaugeMetricFamily(
            f"{PREFIX}_gpu_memory_allocated_bytes", "GPU memory held by tensors", labels=["device"]
        )
        reserved = GaugeMetricFamily(
            f"{PREFIX}_gpu_memory_reserved_bytes",
            "GPU memory reserved by torch's caching allocator",
            labels=["device"],
        )
        for index in range(torch.cuda.device_count()):
            allocated.add_metric([str(index)], torch.cuda.memory_allocated(index))
            reserved.add_metric([str(index)], torch.cuda.memory_reserved(index))
        yield allocated
        yield reserved


class ForwardProcessMemoryCollector(Collector):
    """Resident memory of each model's forward processes (FORWARD_PROCESSES), read from /proc
    at each scrape: `process_resident_memory_bytes` is the serving process's alone. Yields
    nothing where no model has any."""

    def __init__(self, pids_by_model: Callable[[], dict[str, list[int]]]) -> None:
        self._pids_by_model = pids_by_model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            f"{PREFIX}_forward_process_resident_memory_bytes",
            "Resident memory of each forward process of a model",
            labels=["model", "process"],
        )
        for model, pids in self._pids_by_model().items():
            for index, pid in enumerate(pids):
                resident = resident_bytes(pid)
                if resident is not None:
                    family.add_metric([model, str(index)], resident)
        if family.samples:
            yield family


def resident_bytes(pid: int) -> int | None:
    """A process's resident memory (/proc/<pid>/statm); None once it is gone."""
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


class Metrics:
    """The service's metrics. One instance per app, so tests can build many apps."""

    def __init__(self, latency_target_seconds: float) -> None:
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes and more
        PlatformCollector(registry=self.registry)
        self.registry.register(GpuMemoryCollector())
        r = self.registry
        p = PREFIX

        self.model_load_seconds = Gauge(
            f"{p}_model_load_seconds",
            "Seconds spent per load phase",
            ["model", "phase"],
            registry=r,
        )
        self.model_info = Gauge(
            f"{p}_model_info",
            "Loaded model and adapter (value 1)",
            ["model", "base", "revision", "adapter", "quantization", "dtype", "device"],
            registry=r,
        )
        self.model_weight_bytes = Gauge(
            f"{p}_model_weight_bytes", "Bytes of weights in memory", ["model"], registry=r
        )
        self.ready = Gauge(f"{p}_ready", "1 when every model is loaded and warm", registry=r)
        self.latency_target_seconds = Gauge(
            f"{p}_latency_target_seconds", "The response-time target", registry=r
        )
        self.latency_target_seconds.set(latency_target_seconds)

        self.request_duration_seconds = Histogram(
            f"{p}_request_duration_seconds",
            "Time from request to response, at the server",
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            f"{p}_requests", "Requests answered", ["route", "status"], registry=r
        )
        self.requests_over_target = Counter(
            f"{p}_requests_over_target", "Requests slower than the target", ["route"], registry=r
        )
        # Where several front ends share their metrics (FRONT_ENDS), the live ones' summed.
        self.requests_in_flight = Gauge(
            f"{p}_requests_in_flight",
            "Requests being handled now",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.rejections = Counter(
            f"{p}_rejections", "Requests refused, by reason", ["reason"], registry=r
        )
        self.predictions = Counter(
            f"{p}_predictions", "Texts classified (all tiers)", ["model", "adapter"], registry=r
        )

        self.queue_depth = Gauge(
            f"{p}_queue_depth", "Texts waiting for a batch", ["model"], registry=r
        )
        self.queue_wait_seconds = Histogram(
            f"{p}_queue_wait_seconds",
            "Time a text waited before its batch ran",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_inference_seconds = Histogram(
            f"{p}_batch_inference_seconds",
            "Forward time of one batch",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            f"{p}_batch_size", "Texts per batch", ["model"], buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            f"{p}_batch_tokens",
            "Tokens per batch, padding counted",
            ["model"],
            buckets=BATCH_TOKEN_BUCKETS,
            registry=r,
        )
        self.batch_dropped = Counter(
            f"{p}_batch_dropped", "Texts dropped unrun", ["model", "reason"], registry=r
        )
        self.admission_refusals = Counter(
            f"{p}_admission_refusals",
            "Requests refused (429) because they would finish past the latency target, judged "
            "on their texts' lengths estimated from their characters, or on their tokens",
            ["model", "judged_on"],
            registry=r,
        )
        self.non_finite_rows = Counter(
            f"{p}_non_finite_rows",
            "Texts the model scored NaN or infinity (failed alone, never cached)",
            ["model"],
            registry=r,
        )

        self.cache_lookups = Counter(
            f"{p}_cache_lookups", "Cache lookups", ["tier", "result"], registry=r
        )
        self.cache_errors = Counter(
            f"{p}_cache_errors", "Cache faults served from the model", ["tier", "op"], registry=r
        )
        self.cache_rejected = Counter(
            f"{p}_cache_rejected",
            "Cache values read but not served, computed again and overwritten: format (not a "
            "value this service writes, a pickle included), mac (not written with the "
            "tier's secret for this key: REDIS_CACHE_SECRET, or the disk tier's), labels, "
            "non_finite, range, softmax (not an "
            "answer of the model it was read for)",
            ["tier", "reason"],
            registry=r,
        )
        self.cache_not_admitted = Counter(
            f"{p}_cache_not_admitted",
            "Answers a tier did not write: under DISK_CACHE_ADMISSION=repeated, the disk "
            "tier's of texts this process had not stored before",
            ["tier"],
            registry=r,
        )
        self.cache_entries = Gauge(f"{p}_cache_entries", "Entries held", ["tier"], registry=r)
        self.cache_bytes = Gauge(f"{p}_cache_bytes", "Bytes held on disk", ["tier"], registry=r)
        self.cache_tier_up = Gauge(
            f"{p}_cache_tier_up",
            "1 while a shared cache tier answers; 0 while it is skipped after a fault",
            ["tier"],
            registry=r,
        )

        self.cascade_escalations = Counter(
            f"{p}_cascade_escalations", "Texts the cascade sent on to its second model", registry=r
        )
        self.language_texts = Counter(
            f"{p}_language_texts",
            "Texts to a model that declares languages, by detected language and what was done",
            ["model", "language", "outcome"],
            registry=r,
        )

        self.adapter_loads = Counter(
            f"{p}_adapter_loads",
            "Run-time adapter loads by result: loaded, swapped, unchanged, reloaded (after an "
            "eviction), refused, cancelled (its caller went; what it attached is detached)",
            ["model", "result"],
            registry=r,
        )
        self.adapter_load_seconds = Histogram(
            f"{p}_adapter_load_seconds",
            "Time to check and attach a run-time adapter read from its folder",
            ["model"],
            buckets=ADAPTER_LOAD_BUCKETS,
            registry=r,
        )
        self.adapters_resident = Gauge(
            f"{p}_adapters_resident",
            "Run-time adapters attached to the model (evicted ones wait in CPU memory)",
            ["model"],
            registry=r,
        )
        self.adapter_evictions = Counter(
            f"{p}_adapter_evictions",
            "Run-time adapters evicted, least recently used first, past MAX_ADAPTERS_PER_MODEL",
            ["model"],
            registry=r,
        )

        # What each adapter answers (drift): labels, and the positive class's probability
        # (two-label models: the second label, as decision_threshold re-centres it on 0.5).
        self.answer_labels = Counter(
            f"{p}_answer_labels",
            "Texts answered, by the label given (the best score)",
            ["model", "adapter", "label"],
            registry=r,
        )
        self.answer_positive_score = Histogram(
            f"{p}_answer_positive_score",
            "Two-label models: the probability of the second label in each answer",
            ["model", "adapter"],
            buckets=SCORE_BUCKETS,
            registry=r,
        )

        # A candidate adapter beside the served one (api.serving.rollout): both adapters'
        # answers to the same texts, compared without storing them.
        self.candidate_share = Gauge(
            f"{p}_candidate_share",
            "The share of the served adapter's texts its candidate scores (shadow) or "
            "answers (canary); 0 once it is stopped, promoted or rolled back",
            ["model", "adapter", "candidate", "mode"],
            registry=r,
        )
        self.candidate_texts = Counter(
            f"{p}_candidate_texts",
            "Texts scored by both the served adapter and its candidate",
            ["model", "adapter", "candidate"],
            registry=r,
        )
        self.candidate_agreements = Counter(
            f"{p}_candidate_agreements",
            "Compared texts given the same label by both",
            ["model", "adapter", "candidate"],
            registry=r,
        )
        self.candidate_flips = Counter(
            f"{p}_candidate_flips",
            "Compared texts the candidate labels otherwise: from the served adapter's label "
            "to the candidate's",
            ["model", "adapter", "candidate", "from_label", "to_label"],
            registry=r,
        )
        self.candidate_labels = Counter(
            f"{p}_candidate_labels",
            "Compared texts by the label each side gave (side: served or candidate)",
            ["model", "adapter", "candidate", "side", "label"],
            registry=r,
        )
        self.candidate_score_difference = Histogram(
            f"{p}_candidate_score_difference",
            "Two-label models: the candidate's probability of the second label minus the "
            "served adapter's, per compared text",
            ["model", "adapter", "candidate"],
            buckets=SCORE_DIFFERENCE_BUCKETS,
            registry=r,
        )
        self.candidate_rollbacks = Counter(
            f"{p}_candidate_rollbacks",
            "Candidates rolled back: by a guard (max_flip_rate) or through the admin route",
            ["model", "reason"],
            registry=r,
        )
        self.candidate_promotions = Counter(
            f"{p}_candidate_promotions",
            "Candidates made the model's default",
            ["model"],
            registry=r,
        )
        self.shadow_rows_dropped = Counter(
            f"{p}_shadow_rows_dropped",
            "Texts a candidate (or, in a canary, the served adapter) was to score in shadow "
            "but did not: busy, queue_full, no_room, stopped, failed",
            ["model", "reason"],
            registry=r,
        )

        # Series that exist from the start, at 0, so rates and ratios are defined at once.
        self.requests_over_target.labels("/predict")
        for reason in set(REJECTION_REASON_BY_STATUS.values()):
            self.rejections.labels(reason)

    def labelled(self, metric: MetricWrapperBase, *values: str) -> Any:
        """`metric.labels(*values)`, looked up once per label values: `labels()` takes a lock
        and builds its key on every call, and the request path counts several series a
        request. (No series of this service is ever removed, so none goes stale here.)"""
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child


# The names dashboards and alerts use; tests pin them so a rename cannot pass unnoticed.
DASHBOARD_METRICS = (
    "loraserve_model_load_seconds",
    "loraserve_model_info",
    "loraserve_model_weight_bytes",
    "loraserve_ready",
    "loraserve_latency_target_seconds",
    "loraserve_request_duration_seconds_bucket",
    "loraserve_request_duration_seconds_count",
    "loraserve_requests_total",
    "loraserve_requests_over_target_total",
    "loraserve_requests_in_flight",
    "loraserve_rejections_total",
    "loraserve_predictions_total",
    "loraserve_queue_depth",
    "loraserve_queue_wait_seconds_bucket",
    "loraserve_batch_inference_seconds_bucket",
    "loraserve_batch_size_bucket",
    "loraserve_batch_tokens_bucket",
    "loraserve_cache_lookups_total",
    "loraserve_cache_entries",
    "loraserve_cache_bytes",
    "loraserve_cascade_escalations_total",
    "loraserve_adapter_loads_total",
    "loraserve_adapter_load_seconds_sum",
    "loraserve_adapter_load_seconds_count",
    "loraserve_adapters_resident",
    "loraserve_adapter_evictions_total",
    "loraserve_answer_labels_total",
    "loraserve_answer_positive_score_bucket",
    "loraserve_candidate_share",
    "loraserve_candidate_texts_total",
    "loraserve_candidate_agreements_total",
    "loraserve_candidate_flips_total",
    "loraserve_candidate_labels_total",
    "loraserve_candidate_score_difference_bucket",
    "loraserve_candidate_rollbacks_total",
    "loraserve_shadow_rows_dropped_total",
    "process_resident_memory_bytes",
)
GPU_METRICS = ("loraserve_gpu_memory_allocated_bytes", "loraserve_gpu_memory_reserved_bytes")
