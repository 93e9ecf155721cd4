"""Scale-out figures for docs/scaling.md: what a replica costs, a cross-replica hit
through Redis, and the queue wait the autoscaler reads as the load grows.

Run: `python -m bench.scale_out` (or `make bench-scale`); needs Debian's redis-server and
haproxy (`make test` installs them). Writes bench/reports/scale_out.{md,json}. On loopback:

- replica cost: two replicas of the embedded default (`python -m api.cli`, REDIS_URL set,
  their own disk caches), started one after the other: seconds from process start to
  /ready 200, resident memory once ready and after the traffic below;
- cross-replica hit: TEXTS distinct SMS texts, one request each from one client (httpx,
  keep-alive), sent to replica A (computed by the model), then the same to replica B
  (answered by Redis), then through HAProxy running docker/haproxy/haproxy.cfg (answered by
  each replica's LRU); per phase the tiers that answered, median and p90 latency at the
  client, and whether B's answers are A's to the last bit;
- Redis: bytes per entry as Redis counts them (MEMORY USAGE) and the value's own size;
- queue wait under load: replica A under 1 to 64 clients of texts it has not seen
  (tests/support/load_client.py), SECONDS each: requests/s, the share refused with 429, and the mean
  queue wait of the texts run, from A's own /metrics: what the autoscaler is given.
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import tempfile
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    REPORTS,
    host,
    load_average,
    machine_words,
    now,
    wait_for_quiet,
    write_report,
)
from tests.support.haproxy_process import load_balancer
from tests.support.load_client import metric, rss_kib, run_load, sms_texts
from tests.support.redis_server import RedisServer
from tests.support.server_process import ServerProcess, run_server

TEXTS = 200
SECONDS = 8.0
CLIENTS = (1, 4, 16, 64)
# Each point's texts: the collection this many times over, each made new by a number.
UNSEEN_ROUNDS = 4


def start_replica(stack: ExitStack, env: dict[str, str], folder: Path) -> dict[str, Any]:
    started = time.monotonic()
    server = stack.enter_context(run_server(env, folder))
    server.wait_ready(timeout=900)
    return {
        "server": server,
        "ready_s": round(time.monotonic() - started, 1),
        "rss_ready_mib": round(rss_kib(server.process.pid) / 1024),
    }


def one_by_one(url: str, texts: list[str]) -> dict[str, Any]:
    """Each text in its own request, one at a time: answers, tiers and latencies (of the
    200s; a 429 is waited out as its Retry-After says, and counted)."""
    answers, tiers, latencies = [], [], []
    refused = 0
    with httpx.Client(timeout=30) as client:
        for text in texts:
            while True:
                started = time.perf_counter()
                response = client.post(f"{url}/predict", json={"inputs": text})
                if response.status_code != 429 or refused > 100:
                    break
                refused += 1
                time.sleep(float(response.headers["Retry-After"]))
            latencies.append(time.perf_counter() - started)
            response.raise_for_status()
            answers.append(response.json())
            tiers.append(response.headers["X-Cache"])
    ordered = sorted(latencies)
    return {
        "answers": answers,
        "tiers": dict(Counter(tiers)),
        "refused_429": refused,
        "p50_ms": round(statistics.median(ordered) * 1000, 2),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1000, 2),
    }


def queue_wait_under_load(server: ServerProcess, texts: list[str]) -> list[dict[str, Any]]:
    points = []
    for clients in CLIENTS:
        total = metric(server.url, "loraserve_queue_wait_seconds_sum")
        count = metric(server.url, "loraserve_queue_wait_seconds_count")
        # Texts no point has sent before: the collection's, each with the point's own number
        # (a quiet machine answers more requests in a point than the collection holds).
        fresh = [f"{text} {clients}.{n}" for n, text in enumerate(texts * UNSEEN_ROUNDS)]
        result = run_load(server.url, clients, SECONDS, fresh)
        waited = metric(server.url, "loraserve_queue_wait_seconds_sum") - total
        ran = metric(server.url, "loraserve_queue_wait_seconds_count") - count
        points.append(
            {
                "clients": clients,
                "requests_per_s": round(result.requests / SECONDS, 1),
                "refused_429": round(result.statuses[429] / max(1, result.requests), 3),
                "other_statuses": {s: n for s, n in result.statuses.items() if s not in (200, 429)},
                "mean_queue_wait_s": round(waited / ran, 4) if ran else 0.0,
                "p99_ms_200": round(result.percentile_ms(0.99), 1),
            }
        )
    return points


def replica_env(redis_url: str, secret: str, disk: Path, threads: int) -> dict[str, str]:
    """A replica's settings beside the defaults: the shared Redis, the secret the replicas
    sign what they share with (the service refuses a Redis without it), its own disk tier, and
    its share of this host's cores."""
    return {
        "REDIS_URL": redis_url,
        "REDIS_CACHE_SECRET": secret,
        "DISK_CACHE_DIR": str(disk),
        "TORCH_NUM_THREADS": str(threads),
    }


def run(folder: Path) -> dict[str, Any]:
    secret = secrets.token_hex(32)
    # Both replicas run on this host and split its cores, as compose's replicas do
    # (REPLICA_TORCH_NUM_THREADS): each with every core, they collapse when both are busy.
    threads = max(1, len(os.sched_getaffinity(0)) // 2)
    texts = sms_texts(5000)
    cross, rest = texts[:TEXTS], texts[TEXTS:]
    redis = RedisServer(folder)
    with ExitStack() as stack:
        redis.start()
        stack.callback(redis.kill)
        replicas = []
        for name in ("a", "b"):
            env = replica_env(redis.url, secret, folder / f"disk-{name}", threads)
            replicas.append(start_replica(stack, env, folder))
        a, b = (replica["server"] for replica in replicas)
        computed = one_by_one(a.url, cross)
        deadline = time.monotonic() + 30  # the writes to Redis are in the background
        while redis.client().dbsize() < len(cross) and time.monotonic() < deadline:
            time.sleep(0.05)
        shared = one_by_one(b.url, cross)
        balancer = stack.enter_context(load_balancer(folder, [a, b]))
        balanced = one_by_one(balancer.url, cross)
        client = redis.client()
        sizes = [client.memory_usage(key) or 0 for key in client.scan_iter(count=1000)]
        value = client.get(next(client.scan_iter(count=10)))
        load = queue_wait_under_load(a, rest)
        for replica in replicas:
            replica["rss_after_mib"] = round(rss_kib(replica.pop("server").process.pid) / 1024)
    same = sum(x == y for x, y in zip(computed["answers"], shared["answers"], strict=True))
    for phase in (computed, shared, balanced):
        del phase["answers"]
    return {
        "replicas": replicas,
        "torch_num_threads": threads,
        "cross_replica": {
            "texts": len(cross),
            "computed_on_a": computed,
            "redis_hit_on_b": shared,
            "through_haproxy": balanced,
            "b_answers_identical_to_a": same,
        },
        "redis": {
            "entries": len(sizes),
            "bytes_per_entry_median": statistics.median(sizes),
            "value_bytes": len(value or b""),
        },
        "queue_wait_under_load": load,
    }


def markdown(report: dict[str, Any]) -> str:
    meta, cross = report["meta"], report["cross_replica"]
    lines = [
        "# Scale-out: replica cost, cross-replica hit, queue wait under load",
        "",
        f"Written by `python -m bench.scale_out` on {meta['date']}; {machine_of(meta)}, load "
        f"average {meta['load']['at_start']} at the start, {meta['load_end']} at the end. The "
        "embedded default (spam-minilm and spam-smollm2), default settings, REDIS_URL and "
        f"REDIS_CACHE_SECRET set, TORCH_NUM_THREADS={report['torch_num_threads']} in each "
        "replica (the two share this host's cores, as compose's replicas do).",
        "",
        "## What a replica costs",
        "",
        "| replica | start to /ready 200 | resident once ready | resident after the traffic |",
        "|---|---:|---:|---:|",
    ]
    for name, replica in zip("AB", report["replicas"], strict=True):
        lines.append(
            f"| {name} | {replica['ready_s']} s | {replica['rss_ready_mib']} MiB | "
            f"{replica['rss_after_mib']} MiB |"
        )
    lines += [
        "",
        f"## A text computed by one replica, asked of another ({cross['texts']} texts, "
        "one request each, one client)",
        "",
        "| phase | X-Cache (requests) | p50 ms | p90 ms |",
        "|---|---|---:|---:|",
    ]
    for phase, title in (
        ("computed_on_a", "replica A (first time)"),
        ("redis_hit_on_b", "replica B (same texts)"),
        ("through_haproxy", "HAProxy (same texts)"),
    ):
        data = cross[phase]
        tiers = "; ".join(f"`{tier}` ({n})" for tier, n in data["tiers"].items())
        lines.append(f"| {title} | {tiers} | {data['p50_ms']} | {data['p90_ms']} |")
    redis = report["redis"]
    lines += [
        "",
        f"B's answers identical to A's: {cross['b_answers_identical_to_a']} of "
        f"{cross['texts']}. Redis holds {redis['entries']} entries at a median "
        f"{redis['bytes_per_entry_median']} bytes each (MEMORY USAGE: key, value and "
        f"Redis's own overhead); the value itself is {redis['value_bytes']} bytes.",
        "",
        f"## Replica A under load ({SECONDS:g} s per point, texts it has not seen)",
        "",
        "| clients | req/s | refused (429) | mean queue wait | p99 of the 200s |",
        "|---:|---:|---:|---:|---:|",
    ]
    for point in report["queue_wait_under_load"]:
        lines.append(
            f"| {point['clients']} | {point['requests_per_s']} | "
            f"{point['refused_429']:.1%} | {point['mean_queue_wait_s'] * 1000:.0f} ms | "
            f"{point['p99_ms_200']:.0f} ms |"
        )
    return "\n".join(lines) + "\n"


def machine_of(meta: dict[str, Any]) -> str:
    """The machine as the report names it; a run that did not record its machine (the first
    ones) was on a 2-core CPU."""
    return machine_words(meta["machine"]) if "machine" in meta else "2-core CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPORTS, help="report folder")
    parser.add_argument(
        "--wait", type=float, default=900, help="seconds to wait for a quiet machine (900)"
    )
    args = parser.parse_args(argv)
    load = wait_for_quiet(args.wait)
    with tempfile.TemporaryDirectory(prefix="scale-out-") as folder:
        report = run(Path(folder))
    report["meta"] = {
        "date": now(),
        "machine": host(),
        "load": load,
        "load_end": load_average(),
    }
    write_report(args.out, "scale_out", report, markdown(report), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
