"""What one request did, for its log lines and its span: set by the routes' lifecycle as it
learns it, read by the access line and by every line logged while the request runs."""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestRecord:
    """The request-scoped fields; None (or empty) until known. Never the texts themselves."""

    request_id: str
    method: str
    path: str
    route: str  # the metrics' label of the path
    model: str | None = None
    adapter: str | None = None
    texts: int | None = None
    cache: dict[str, int] = field(default_factory=dict)  # texts answered per tier
    status: int | None = None
    duration_ms: float | None = None
    trace_id: str | None = None  # a sampled trace's id (for exemplars)

    def fields(self) -> dict[str, Any]:
        """The fields known so far, by name; a log line carries these."""
        known = {
            "request_id": self.request_id,
            "method": self.method,
            "path": self.path,
            "route": self.route,
            "model": self.model,
            "adapter": self.adapter,
            "texts": self.texts,
            "cache": self.cache or None,
            "status": self.status,
            "duration_ms": self.duration_ms,
            "trace_id": self.trace_id,
        }
        return {name: value for name, value in known.items() if value is not None}


CURRENT: ContextVar[RequestRecord | None] = ContextVar("request_record", default=None)


def note_call(model: str, adapter: str | None, texts: int) -> None:
    """The model (or cascade), adapter and number of texts of the current request."""
    record = CURRENT.get()
    if record is not None:
        record.model, record.adapter, record.texts = model, adapter, texts


def note_cache(tiers: Sequence[str], names: Sequence[str]) -> None:
    """Which tier (or the model) answered each text of the current request, counted by the
    tiers `names` (X-Cache's)."""
    record = CURRENT.get()
    if record is not None:
        record.cache = {name: tiers.count(name) for name in names}
