"""Served throughput and latency under 1–64 clients, against a naive server and the raw model.

Run: `python -m bench.throughput` (or `make bench-throughput`). Writes bench/reports/
throughput.{md,json,png}. In one run, with the same texts and thread count:

- served: the real server process (cache off, default batching), one text per request;
- naive:  the same server with MAX_BATCH_SIZE=1 — one forward per request, no batching;
- raw:    the model alone in this process, batches of 32 in a loop, no HTTP: its own limit;
- cache hit: the server with the LRU on, one text repeated, timed at the server.

The load comes from `wrk` (a compiled client: a Python client would take a good part of one
of the two cores from the server), on loopback only. Served and naive alternate at each
concurrency, so drift on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "bench" / "reports"
WORK = REPO / "bench" / "out"
LUA = REPO / "bench" / "wrk" / "predict.lua"
DATA = REPO / "data" / "sms_spam_collection.tsv"
CACHE_OFF = {"LRU_CACHE_ENTRIES": "0", "DISK_CACHE_MAX_BYTES": "0"}


@dataclass
class Point:
    system: str
    clients: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    non_2xx: int
    socket_errors: int


def texts(count: int) -> list[str]:
    """The first `count` distinct texts of the collection, the same for every system."""
    seen: dict[str, None] = {}
    for line in DATA.read_text(encoding="utf-8").splitlines():
        seen.setdefault(line.split("\t", 1)[1], None)
        if len(seen) == count:
            break
    return list(seen)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@contextmanager
def server(env: dict[str, str], threads: int) -> Iterator[str]:
    """The real server process on a free loopback port, until the block ends."""
    port = free_port()
    full = {**os.environ, **env, "HOST": "127.0.0.1", "PORT": str(port)}
    full["TORCH_NUM_THREADS"] = str(threads)
    full["DISK_CACHE_DIR"] = str(WORK / "cache")
    log = (WORK / f"server-{port}.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "api.cli"], cwd=REPO, env=full, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not get ready; see {log.name}")
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
        log.close()


def wrk(url: str, clients: int, seconds: float, bodies: Path) -> dict[str, Any]:
    """One wrk run; its Lua script prints a JSON summary line."""
    result = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{clients}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            str(LUA),
            url,
        ],
        env={**os.environ, "BODIES": str(bodies)},
        capture_output=True,
        text=True,
        check=True,
    )
    line = next(x for x in result.stdout.splitlines() if x.startswith("{"))
    summary: dict[str, Any] = json.loads(line)
    return summary


def point(system: str, clients: int, summary: dict[str, Any]) -> Point:
    return Point(
        system=system,
        clients=clients,
        requests_per_s=round(summary["requests"] / (summary["duration_us"] / 1e6), 1),
        p50_ms=round(summary["p50_us"] / 1000, 1),
        p99_ms=round(summary["p99_us"] / 1000, 1),
        non_2xx=summary["non_2xx"],
        socket_errors=summary["socket_errors"],
    )


def raw_model(sample: list[str], threads: int, seconds: float) -> float:
    """Texts per second of the model alone: forwards of 32 in a loop, no HTTP."""
    import torch

    from api.cli import quiet_libraries
    from api.models.loader import load_model
    from api.models.predictor import Predictor
    from api.models.spec import load_models_file
    from api.settings import Settings

    quiet_libraries()
    torch.set_num_threads(threads)
    (spec,) = load_models_file(None)[:1]
    predictor = Predictor(load_model(spec, Settings(_env_file=None)))  # type: ignore[call-arg]
    rows = predictor.encode(sample)
    batches = [rows[i : i + 32] for i in range(0, len(rows) - 31, 32)]
    predictor.forward(batches[0], [None] * 32)  # warm-up
    done, index, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        batch = batches[index % len(batches)]
        predictor.forward(batch, [None] * len(batch))
        done, index = done + len(batch), index + 1
    return done / (time.perf_counter() - start)


def cache_hit_ms(url: str, text: str, repeats: int) -> tuple[float, float]:
    """Server-side mean (from its own histogram) and client p50 of repeated cache hits."""
    body = {"inputs": text}
    with httpx.Client(timeout=10) as client:
        client.post(f"{url}/predict", json=body)  # fills the cache
        before = server_seconds(client, url)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            response = client.post(f"{url}/predict", json=body)
            times.append(time.perf_counter() - start)
            assert response.headers["X-Cache"].startswith("lru=1"), response.headers
        after = server_seconds(client, url)
    mean = (after[0] - before[0]) / (after[1] - before[1]) * 1000
    return round(mean, 3), round(statistics.median(times) * 1000, 3)


def server_seconds(client: httpx.Client, url: str) -> tuple[float, float]:
    """(sum, count) of /predict's request-duration histogram, 200s only."""
    values = {"sum": 0.0, "count": 0.0}
    for line in client.get(f"{url}/metrics").text.splitlines():
        for kind in values:
            prefix = f'loraserve_request_duration_seconds_{kind}{{route="/predict",status="200"}}'
            if line.startswith(prefix):
                values[kind] = float(line.split()[-1])
    return values["sum"], values["count"]


def machine() -> str:
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import torch

    return f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, torch {torch.__version__}"


def report(points: list[Point], raw: float, hit: tuple[float, float], meta: dict[str, Any]) -> str:
    served = {p.clients: p for p in points if p.system == "served"}
    naive = {p.clients: p for p in points if p.system == "naive"}
    lines = [
        "# Throughput: the served model vs. a naive server and the raw model",
        "",
        f"Machine: {meta['machine']}. Date: {meta['date']}. Load average before: "
        f"{meta['load_average']}. Client: wrk 4.1 (1 thread, N connections, {meta['seconds']} s "
        f"per point after a {meta['warmup_seconds']} s warm-up), loopback. Model: the embedded "
        f"default ({meta['model']}), {meta['threads']} torch threads, cache off, one text per "
        f"request, {meta['texts']} distinct SMS texts.",
        "",
        "| clients | served req/s | served p50 (ms) | served p99 (ms) | naive req/s | "
        "naive p50 (ms) | naive p99 (ms) | served / naive | served / raw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for clients in sorted(served):
        s, n = served[clients], naive[clients]
        lines.append(
            f"| {clients} | {s.requests_per_s} | {s.p50_ms} | {s.p99_ms} | {n.requests_per_s} | "
            f"{n.p50_ms} | {n.p99_ms} | {s.requests_per_s / n.requests_per_s:.2f} | "
            f"{s.requests_per_s / raw:.2f} |"
        )
    errors = sum(p.non_2xx + p.socket_errors for p in points)
    lines += [
        "",
        f"Raw model (batches of 32 in a loop, no HTTP): **{raw:.1f} texts/s**.",
        f"Cache hit (LRU): **{hit[0]} ms** mean at the server (its own request histogram), "
        f"{hit[1]} ms median at the client.",
        f"Non-2xx responses and socket errors over the whole run: {errors}.",
    ]
    return "\n".join(lines) + "\n"


def plot(points: list[Point], raw: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for system, style in (("served", "o-"), ("naive", "s--")):
        mine = sorted((p for p in points if p.system == system), key=lambda p: p.clients)
        xs = [p.clients for p in mine]
        left.plot(xs, [p.requests_per_s for p in mine], style, label=system)
        right.plot(xs, [p.p99_ms for p in mine], style, label=f"{system} p99")
        right.plot(xs, [p.p50_ms for p in mine], style, alpha=0.4, label=f"{system} p50")
    left.axhline(raw, color="grey", linestyle=":", label="raw model (batch 32)")
    left.set(xscale="log", xlabel="concurrent clients", ylabel="texts per second")
    right.axhline(2000, color="red", linestyle=":", label="2 s target")
    right.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="latency (ms)")
    for axis in (left, right):
        axis.set_xticks([1, 4, 16, 32, 64], labels=["1", "4", "16", "32", "64"])
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle("loraserve on 2 CPU cores: all-MiniLM-L6-v2 + spam LoRA, one text a request")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup-seconds", type=float, default=2.0)
    parser.add_argument("--clients", default="1,4,16,32,64")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--texts", type=int, default=2000)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed: apt-get install -y wrk")
    WORK.mkdir(parents=True, exist_ok=True)
    REPORTS.mkdir(parents=True, exist_ok=True)
    sample = texts(args.texts)
    bodies = WORK / "bodies.jsonl"
    bodies.write_text("".join(json.dumps({"inputs": t}) + "\n" for t in sample), encoding="utf-8")
    load_average = Path("/proc/loadavg").read_text().split(" ")[0]

    points: list[Point] = []
    systems = {"served": CACHE_OFF, "naive": {**CACHE_OFF, "MAX_BATCH_SIZE": "1"}}
    with (
        server(systems["served"], args.threads) as served_url,
        server(systems["naive"], args.threads) as naive_url,
    ):
        urls = {"served": served_url, "naive": naive_url}
        for clients in (int(c) for c in args.clients.split(",")):
            for system, url in urls.items():  # A B at each point, the other server idle
                wrk(url, clients, args.warmup_seconds, bodies)
                result = point(system, clients, wrk(url, clients, args.seconds, bodies))
                print(json.dumps(asdict(result)), flush=True)
                points.append(result)
    raw = raw_model(sample[:512], args.threads, args.seconds)
    print(json.dumps({"raw_texts_per_s": raw}), flush=True)
    with server({}, args.threads) as url:
        hit = cache_hit_ms(url, sample[0], 300)
    meta = {
        "machine": machine(),
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d}",
        "load_average": load_average,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup_seconds,
        "threads": args.threads,
        "texts": len(sample),
        "model": "all-MiniLM-L6-v2 + spam LoRA, dynamic int8",
    }
    text = report(points, raw, hit, meta)
    (REPORTS / "throughput.md").write_text(text, encoding="utf-8")
    (REPORTS / "throughput.json").write_text(
        json.dumps(
            {"meta": meta, "points": [asdict(p) for p in points], "raw": raw, "cache_hit": hit},
            indent=2,
        ),
        encoding="utf-8",
    )
    plot(points, raw, REPORTS / "throughput.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
