"""A bounded asyncio load client for the real server on loopback.

Python, not wrk: the reliability checks need every response's status and its Retry-After
header, which wrk does not give per response. It costs the 2 cores more than wrk would, so
its latencies are an upper bound.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx

from scripts.spam_data import read_collection


@dataclass
class LoadResult:
    """What a load run saw."""

    seconds: float
    statuses: dict[int, int] = field(default_factory=dict)
    ok_latencies: list[float] = field(default_factory=list)
    missing_retry_after: int = 0
    transport_errors: int = 0

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.ok_latencies)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] * 1000

    def summary(self) -> dict[str, object]:
        return {
            "seconds": self.seconds,
            "requests": self.requests,
            "requests_per_s": round(self.requests / self.seconds, 1),
            "statuses": self.statuses,
            "p50_ms_200": round(self.percentile_ms(0.5), 1),
            "p99_ms_200": round(self.percentile_ms(0.99), 1),
            "missing_retry_after": self.missing_retry_after,
            "transport_errors": self.transport_errors,
        }


def sms_texts(count: int = 2000) -> list[str]:
    """Real SMS texts to send, distinct, in file order."""
    texts = list(dict.fromkeys(row.text for row in read_collection()))
    return texts[:count]


async def run_load(url: str, clients: int, seconds: float, texts: list[str]) -> LoadResult:
    """`clients` loops sending one text per request until `seconds` have passed.

    A client told 429 waits as long as `Retry-After` says, as a well-behaved client does;
    without that, refused clients retry in a tight loop that measures the loop, not the
    service.
    """
    result = LoadResult(seconds=seconds)
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:

        async def loop(offset: int) -> None:
            index = offset
            while time.monotonic() < deadline:
                index += clients
                started = time.monotonic()
                try:
                    response = await client.post(
                        "/predict", json={"inputs": texts[index % len(texts)]}
                    )
                except httpx.TransportError:
                    result.transport_errors += 1
                    continue
                status = response.status_code
                result.statuses[status] = result.statuses.get(status, 0) + 1
                if status == 200:
                    result.ok_latencies.append(time.monotonic() - started)
                elif status == 429:
                    retry_after = response.headers.get("retry-after")
                    if retry_after is None:
                        result.missing_retry_after += 1
                    else:
                        await asyncio.sleep(float(retry_after))

        await asyncio.gather(*(loop(offset) for offset in range(clients)))
    return result
