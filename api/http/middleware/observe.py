"""The request metrics: every request timed and counted by route and status."""

from __future__ import annotations

from api.metrics import REJECTION_REASON_BY_STATUS
from api.service.contract import Classifier

# Labels stay few: unknown paths (scanners, typos) are all "other".
ROUTES = frozenset(
    {
        "/",
        "/predict",
        "/models",
        "/health",
        "/ready",
        "/info",
        "/metrics",
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/v1/adapters",
    }
)
# The Open Inference Protocol's per-model paths, by what follows `/v2/models/{name}`: one
# fixed label each, never the model's name (any name a client sends would be a new series).
MODEL_ROUTES = {
    "": "/v2/models/metadata",
    "/ready": "/v2/models/ready",
    "/infer": "/v2/models/infer",
}
PROBES = frozenset({"/ready", "/v2/health/ready", "/v2/models/ready"})


def route_label(path: str) -> str:
    """The `route` label of a request for `path`: a known route, or "other"."""
    if path in ROUTES:
        return path
    if path.startswith("/v2/models/"):
        name, _, rest = path[len("/v2/models/") :].partition("/")
        label = MODEL_ROUTES.get(f"/{rest}" if rest else "")
        if name and label is not None:
            return label
    return "other"


class RequestMetrics:
    """Duration, status, in-flight and over-target counts for each HTTP request, and the
    count of requests the drain waits for. Called by the one outer middleware
    (api.http.middleware.observer) as each request begins and ends: one layer, one wrapped
    `send`, for both the request's id and its metrics."""

    def __init__(self, service: Classifier) -> None:
        self.service = service
        self.metrics = service.metrics
        self.target_seconds = service.settings.latency_target_seconds

    def began(self) -> bool:
        """Counts a request in flight; True when the drain is to wait for it (it waits for
        the requests accepted before it began: Lifecycle.hold_drain)."""
        self.metrics.requests_in_flight.inc()
        return self.service.hold_drain()

    def ended(
        self, route: str, status: int, seconds: float, holds_drain: bool, trace_id: str | None
    ) -> None:
        """Counts a finished request (`began` said whether the drain waited for it)."""
        self.metrics.requests_in_flight.dec()
        self.service.release_drain(holds_drain)
        metrics, code = self.metrics, str(status)
        duration = metrics.labelled(metrics.request_duration_seconds, route, code)
        # A sampled trace's id as the exemplar: a slow bucket leads to a slow request.
        if trace_id is not None:
            duration.observe(seconds, {"trace_id": trace_id})
        else:
            duration.observe(seconds)
        metrics.labelled(metrics.requests, route, code).inc()
        if seconds > self.target_seconds:
            metrics.labelled(metrics.requests_over_target, route).inc()
        if (reason := REJECTION_REASON_BY_STATUS.get(status)) is not None and route not in PROBES:
            metrics.labelled(metrics.rejections, reason).inc()
