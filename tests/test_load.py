"""Load on the real server with the embedded default model: steady, overload, recovery.

Bounded in time, loopback only. Each test prints its figures (run with `-s` to see them):
the README's Reliability section quotes them.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx

from tests.load_client import run_load, sms_texts
from tests.server_process import ServerProcess, run_server

CACHE_OFF = {"LRU_CACHE_ENTRIES": "0", "DISK_CACHE_MAX_BYTES": "0"}


def rss_kib(server: ServerProcess) -> int:
    status = Path(f"/proc/{server.process.pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def server_p99_ms(server: ServerProcess, status: str = "200") -> float:
    """The p99 of /predict at the server, from its histogram: the upper bound of the bucket
    holding the 99th percentile (the client's own figure includes its share of 2 cores)."""
    buckets: list[tuple[float, float]] = []
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("loraserve_request_duration_seconds_bucket{") and (
            'route="/predict"' in line and f'status="{status}"' in line
        ):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    buckets.sort()
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= 0.99 * total) * 1000


def queue_depth(server: ServerProcess) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("loraserve_queue_depth{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no queue depth in /metrics")


def test_steady_load_all_200_and_memory_flat(tmp_path: Path) -> None:
    texts = sms_texts()
    with run_server(CACHE_OFF, tmp_path) as server:
        server.wait_ready()
        # Warm-up: the allocator settles after every text length has been seen (~15 s here).
        asyncio.run(run_load(server.url, 16, 15, texts))
        before = rss_kib(server)
        result = asyncio.run(run_load(server.url, 16, 30, texts))
        after = rss_kib(server)
    figures = {**result.summary(), "rss_before_mib": before // 1024, "rss_after_mib": after // 1024}
    print("steady:", json.dumps(figures))
    assert result.statuses == {200: result.requests} and result.transport_errors == 0
    assert after < before * 1.10, figures


def test_overload_only_200_and_429_then_recovery(tmp_path: Path) -> None:
    texts = sms_texts()
    with run_server({**CACHE_OFF, "MAX_QUEUE_SIZE": "8"}, tmp_path) as server:
        server.wait_ready()
        result = asyncio.run(run_load(server.url, 128, 30, texts))
        p99_at_server = server_p99_ms(server)
        print("overload:", json.dumps({**result.summary(), "p99_ms_200_at_server": p99_at_server}))
        assert set(result.statuses) <= {200, 429}, result.statuses
        assert result.statuses.get(429, 0) > 0 and result.statuses.get(200, 0) > 0
        assert result.missing_retry_after == 0 and result.transport_errors == 0
        assert p99_at_server <= 2000, result.summary()

        # Recovery: the queue empties and a request is answered normally within 2 s.
        deadline = time.monotonic() + 5
        while queue_depth(server) > 0:
            assert time.monotonic() < deadline, "the queue did not drain"
            time.sleep(0.05)
        started = time.monotonic()
        response = httpx.post(f"{server.url}/predict", json={"inputs": "are you coming tonight?"})
        recovery = time.monotonic() - started
        print("recovery:", json.dumps({"status": response.status_code, "seconds": recovery}))
        assert response.status_code == 200 and recovery < 2
