"""W3C trace context for a test's requests, as a client that traces sends it."""

from __future__ import annotations

import uuid


def traceparent(trace_id: str, sampled: bool = True) -> str:
    """A W3C traceparent in trace `trace_id`, from a new client span."""
    return f"00-{trace_id}-{uuid.uuid4().hex[:16]}-{'01' if sampled else '00'}"
