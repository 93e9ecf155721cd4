"""Load on the real server with the embedded default model: steady, overload, recovery.

Bounded in time, loopback only; both caches off, so every text really runs through the model.
The client is tests/support/load_client.py (raw asyncio streams; why not wrk or hey is said
there). Each test prints one JSON line of figures, for bench/reports/measured_in_tests.md
(`pytest -s tests/service/test_load.py`); run it on an idle machine (`cat /proc/loadavg`),
since every figure shares the 2 cores.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx

from tests.support.load_client import (
    cpu_seconds,
    histogram_quantile_bound,
    metric,
    rss_kib,
    run_load,
    sms_texts,
)
from tests.support.server_process import run_server

CACHE_OFF = {"LRU_CACHE_ENTRIES": "0", "DISK_CACHE_MAX_BYTES": "0"}
# glibc's heap settles into the mix of batch shapes within ~25 s at ~100 req/s (measured on
# 2 cores: +64 MiB in the first 25 s, then +10 MiB over the next 25 s); RSS is compared from
# then on, so that what is measured is growth under steady traffic, the sign of a leak.
WARMUP_SECONDS = 25
LOAD_SECONDS = 30
MAX_RSS_GROWTH = 0.10
P99_LIMIT_MS = 2000.0
RECOVERY_LIMIT_SECONDS = 2.0


def test_steady_load_answers_every_request_and_memory_stays_flat(tmp_path: Path) -> None:
    texts = sms_texts()
    env = {**CACHE_OFF, "DISK_CACHE_DIR": str(tmp_path / "cache")}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        pid = server.process.pid
        run_load(server.url, 16, WARMUP_SECONDS, texts)
        rss_before, cpu_before = rss_kib(pid), cpu_seconds(pid)
        result = run_load(server.url, 16, LOAD_SECONDS, texts)
        rss_after, cpu_after = rss_kib(pid), cpu_seconds(pid)
    growth = rss_after / rss_before - 1
    figures = {
        "test": "steady",
        **result.summary(),
        "server_cpu_cores": round((cpu_after - cpu_before) / LOAD_SECONDS, 2),
        "rss_before_mib": round(rss_before / 1024, 1),
        "rss_after_mib": round(rss_after / 1024, 1),
        "rss_growth_pct": round(100 * growth, 2),
    }
    print(json.dumps(figures))
    assert result.requests > 0 and result.transport_errors == 0, figures
    assert set(result.statuses) == {200}, figures
    assert growth < MAX_RSS_GROWTH, figures


def test_overload_answers_only_200_or_429_and_then_recovers(tmp_path: Path) -> None:
    texts = sms_texts()
    env = {**CACHE_OFF, "DISK_CACHE_DIR": str(tmp_path / "cache"), "MAX_QUEUE_SIZE": "8"}
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        result = run_load(server.url, 128, LOAD_SECONDS, texts)
        overloaded = time.monotonic()
        figures = {
            "test": "overload",
            **result.summary(),
            "p99_ms_200_at_server_le": 1000
            * histogram_quantile_bound(
                server.url,
                "loraserve_request_duration_seconds",
                0.99,
                route="/predict",
                status="200",
            ),
            "server_200": metric(
                server.url, "loraserve_requests_total", route="/predict", status="200"
            ),
            "server_429": metric(server.url, "loraserve_rejections_total", reason="queue_full"),
        }
        print(json.dumps(figures))
        assert set(result.statuses) == {200, 429}, figures  # both seen, nothing else
        assert result.missing_retry_after == 0 and result.transport_errors == 0, figures
        assert result.percentile_ms(0.99) < P99_LIMIT_MS, figures
        # The server counted what the client saw: no answer lost on either side.
        assert figures["server_200"] == result.statuses[200], figures
        assert figures["server_429"] == result.statuses[429], figures

        # Recovery: every client has had its answer; the queue is empty and a new request is
        # answered at once.
        depth = metric(server.url, "loraserve_queue_depth")
        started = time.monotonic()
        response = httpx.post(
            f"{server.url}/predict", json={"inputs": "are you coming tonight?"}, timeout=10
        )
        answered = time.monotonic()
        recovery = {
            "test": "recovery",
            "queue_depth": depth,
            "status": response.status_code,
            "request_seconds": round(answered - started, 3),
            "seconds_since_overload": round(answered - overloaded, 3),
        }
        print(json.dumps(recovery))
        assert depth == 0, recovery
        assert response.status_code == 200, recovery
        assert answered - overloaded < RECOVERY_LIMIT_SECONDS, recovery
