"""A light load client for the real server on loopback, and readers for its /metrics.

The client: Python on raw asyncio streams (uvloop when installed), HTTP/1.1 keep-alive, one
connection per client. Not wrk or hey: the checks need each response's status, its
`Retry-After` header and the latency of the 200s alone, but wrk's Lua API reports latency
over every response (fast 429s included) and hey sends one fixed body, which the batcher
would compute once for every client in flight. Not httpx either: it costs several times the
CPU per request of a bare stream. The client's CPU time is reported with the figures, so its
share of the 2 cores is known.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from scripts.spam_data import read_collection

REQUEST_TIMEOUT_SECONDS = 30.0


@dataclass
class LoadResult:
    """What one load run saw, at the client."""

    clients: int
    seconds: float
    statuses: Counter[int] = field(default_factory=Counter)
    ok_latencies: list[float] = field(default_factory=list)
    missing_retry_after: int = 0
    transport_errors: int = 0
    client_cpu_seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def percentile_ms(self, fraction: float) -> float:
        """Nearest-rank percentile of the 200s' latencies, in milliseconds."""
        ordered = sorted(self.ok_latencies)
        if not ordered:
            return 0.0
        return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)] * 1000

    def summary(self) -> dict[str, object]:
        return {
            "clients": self.clients,
            "seconds": self.seconds,
            "requests": self.requests,
            "requests_per_s": round(self.requests / self.seconds, 1),
            "statuses": dict(sorted(self.statuses.items())),
            "p50_ms_200": round(self.percentile_ms(0.50), 1),
            "p99_ms_200": round(self.percentile_ms(0.99), 1),
            "max_ms_200": round(max(self.ok_latencies, default=0.0) * 1000, 1),
            "missing_retry_after": self.missing_retry_after,
            "transport_errors": self.transport_errors,
            "client_cpu_cores": round(self.client_cpu_seconds / self.seconds, 3),
        }


def sms_texts(count: int = 2000) -> list[str]:
    """Real SMS texts to send, distinct, in file order."""
    return list(dict.fromkeys(row.text for row in read_collection()))[:count]


def predict_request(host: str, texts: str | list[str], model: str | None = None) -> bytes:
    """A whole `POST /predict` for one text or a list (to `model`, else the default), as
    bytes on the wire."""
    body = json.dumps({"inputs": texts} | ({"model": model} if model else {})).encode()
    head = (
        f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Status and headers (names lower-cased) of one response; its body is read and dropped.

    The service's answers all carry a Content-Length.
    """
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head.split("\r\n")
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if sep:
            headers[name.strip().lower()] = value.strip()
    await reader.readexactly(int(headers.get("content-length", "0")))
    return int(status_line.split(" ", 2)[1]), headers


async def _client(
    url: str,
    requests: list[bytes],
    offset: int,
    step: int,
    deadline: float,
    result: LoadResult,
    honour_retry_after: bool,
) -> None:
    """One client: a request at a time on its own connection until the deadline.

    Told 429, it waits as long as `Retry-After` says, as a well-behaved client does, or, with
    `honour_retry_after` false, sends its next request at once, as wrk and careless clients do.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    index = offset
    while time.monotonic() < deadline:
        index += step
        try:
            if streams is None:
                streams = await asyncio.open_connection(host, port)
            reader, writer = streams
            started = time.monotonic()
            writer.write(requests[index % len(requests)])
            status, headers = await asyncio.wait_for(read_response(reader), REQUEST_TIMEOUT_SECONDS)
        except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            result.transport_errors += 1
            if streams is not None:
                streams[1].close()
            streams = None
            await asyncio.sleep(0.1)  # a dead server must not turn this into a busy loop
            continue
        result.statuses[status] += 1
        if status == 200:
            result.ok_latencies.append(time.monotonic() - started)
        elif status == 429:
            retry_after = headers.get("retry-after")
            if retry_after is None:
                result.missing_retry_after += 1
            elif honour_retry_after:
                await asyncio.sleep(min(float(retry_after), deadline - time.monotonic()))
        if headers.get("connection", "").lower() == "close":
            streams[1].close()
            streams = None
    if streams is not None:
        streams[1].close()


def _run(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop
    except ImportError:  # uvicorn[standard] brings it; plain asyncio also works
        asyncio.run(main)
    else:
        uvloop.run(main)


def run_load(
    url: str,
    clients: int,
    seconds: float,
    texts: list[str],
    per_request: int = 1,
    honour_retry_after: bool = True,
    model: str | None = None,
) -> LoadResult:
    """`clients` connections sending `per_request` texts per request (one: a bare string)
    to `model` (None: the default), for `seconds`; then what was seen.

    Every client waits for its last answer, so nothing is in flight when this returns.
    """
    host = urlsplit(url).netloc
    if per_request == 1:
        requests = [predict_request(host, text, model) for text in texts]
    else:
        groups = [texts[i : i + per_request] for i in range(0, len(texts), per_request)]
        requests = [predict_request(host, group, model) for group in groups]
    result = LoadResult(clients=clients, seconds=seconds)

    async def main() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(
                _client(url, requests, i, clients, deadline, result, honour_retry_after)
                for i in range(clients)
            )
        )

    cpu_before = time.process_time()
    _run(main())
    result.client_cpu_seconds = time.process_time() - cpu_before
    return result


# --- the server's side: /metrics and /proc ---


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples called exactly `name` whose labels include the given ones."""
    return exposition_sum(httpx.get(f"{url}/metrics", timeout=10).text, name, **labels)


def exposition_sum(text: str, name: str, **labels: str) -> float:
    """`metric`, over an exposition already read (0 when no sample matches)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def histogram_quantile_bound(url: str, name: str, fraction: float, **labels: str) -> float:
    """The upper bound of the histogram bucket holding the given quantile (Prometheus's
    `le`), from the server's own /metrics: what the server measured, without the client."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    buckets = sorted(
        (float(sample.labels["le"]), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"{name}_bucket"
        and all(sample.labels.get(k) == v for k, v in labels.items())
    )
    total = buckets[-1][1] if buckets else 0.0
    return next((bound for bound, count in buckets if count >= fraction * total), math.inf)


def rss_kib(pid: int) -> int:
    """Resident memory of a process (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
