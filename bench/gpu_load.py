"""What bench.gpu measures on the real server process: its start (one server, or several
started together), a batch's latency, load from many clients, the cascade, and GPU memory,
all over HTTP and /metrics."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import REPO, free_port, stop, wait_ready
from bench.load_clients import CLIENTS_PER_PROCESS, Job, Result

READY_TIMEOUT_S = 900.0  # a first start converts and quantizes 2.4 B parameters
# Time for the client processes to start (Python and httpx imported) before the warm-up.
SPAWN_S = 2.0


@dataclass
class Started:
    """A running server, how long it took to answer at all (its imports: the port opens once
    the app is built) and to answer /ready 200, and what /models said then."""

    url: str
    pid: int
    listening_s: float
    ready_s: float
    models: dict[str, dict[str, Any]]


@contextmanager
def server(env: dict[str, str], log: Path) -> Iterator[Started]:
    """`python -m api.cli` with `env` on a free loopback port; timed from the spawn to /ready
    200 (imports, CUDA's start, every load phase and the warm-up); stopped when done."""
    port = free_port()
    full = {**os.environ, **env, "HOST": "127.0.0.1", "PORT": str(port), "LOG_LEVEL": "info"}
    with log.open("w") as sink:
        started = time.perf_counter()
        process = subprocess.Popen(
            [sys.executable, "-m", "api.cli"], cwd=REPO, env=full, stdout=sink, stderr=sink
        )
        try:
            url = f"http://127.0.0.1:{port}"
            listening = wait_ready(url, process, log, READY_TIMEOUT_S)
            ready_s = time.perf_counter() - started
            models = httpx.get(f"{url}/models", timeout=30).json()["models"]
            yield Started(
                url=url,
                pid=process.pid,
                listening_s=listening - started,
                ready_s=ready_s,
                models={m["name"]: m for m in models},
            )
        finally:
            stop(process)


@contextmanager
def replicas(count: int, env: dict[str, str], work: Path) -> Iterator[list[Started]]:
    """`count` servers started together; every one that started is stopped at the end, and
    the first failure to start is raised once the others are in."""
    with ExitStack() as stack, ThreadPoolExecutor(max_workers=count) as pool:
        managers = [server(env, work / f"server-{count}-{i}.log") for i in range(count)]
        futures = [pool.submit(manager.__enter__) for manager in managers]
        started, failure = [], None
        for manager, future in zip(managers, futures, strict=True):
            error = future.exception()
            if error is None:
                stack.push(manager.__exit__)
                started.append(future.result())
            elif failure is None:
                failure = error
        if failure is not None:
            raise failure
        yield started


def metric_sums(url: str, names: set[str], **labels: str) -> dict[str, float]:
    """Each named /metrics series summed over the samples carrying `labels`."""
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in names and all(sample.labels.get(k) == v for k, v in labels.items()):
                values[sample.name] += sample.value
    return values


def gpu_memory(url: str) -> dict[str, float | None]:
    """GPU 0's memory in GB as the service reports it (torch's allocated and reserved), and
    as the driver does (nvidia-smi's used, every process counted); None where absent."""
    names = {"loraserve_gpu_memory_allocated_bytes", "loraserve_gpu_memory_reserved_bytes"}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in names and sample.labels.get("device") == "0":
                found[sample.name] = sample.value / 1e9
    used_mib = nvidia_smi_field("memory.used")
    return {
        "allocated_gb": found.get("loraserve_gpu_memory_allocated_bytes"),
        "reserved_gb": found.get("loraserve_gpu_memory_reserved_bytes"),
        "driver_used_gb": None if used_mib is None else float(used_mib) * 2**20 / 1e9,
    }


def nvidia_smi_field(name: str) -> str | None:
    """One of nvidia-smi's --query-gpu fields for GPU 0, None without nvidia-smi."""
    with suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={name}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return done.stdout.strip() or None
    return None


def batch_latency(
    url: str, model: str, texts: list[str], size: int, repeats: int
) -> dict[str, Any]:
    """`repeats` requests of `size` texts (each a new slice of `texts`), cache off: the
    client's time per request and the server's forward time per batch, medians."""
    total, count = (
        "loraserve_batch_inference_seconds_sum",
        "loraserve_batch_inference_seconds_count",
    )
    client_ms, forward_ms, batches = [], [], []
    with httpx.Client(base_url=url, timeout=120) as client:
        for repeat in range(repeats + 1):  # the first is a warm-up, not counted
            start = (repeat * size) % max(1, len(texts) - size + 1)
            body = {"inputs": texts[start : start + size], "model": model, "cache": False}
            before = metric_sums(url, {total, count}, model=model)
            began = time.perf_counter()
            response = client.post("/predict", json=body)
            elapsed = time.perf_counter() - began
            response.raise_for_status()
            after = metric_sums(url, {total, count}, model=model)
            ran = after[count] - before[count]
            if repeat:
                client_ms.append(elapsed * 1000)
                forward_ms.append((after[total] - before[total]) * 1000 / max(ran, 1))
                batches.append(ran)
    return {
        "texts": size,
        "client_ms": statistics.median(client_ms),
        "forward_ms": statistics.median(forward_ms),
        "batches_per_request": statistics.median(batches),
        "repeats": repeats,
    }


def threshold_for_share(url: str, model: str, texts: list[str], share: float) -> float:
    """The cascade threshold below which `share` of `texts` fall: `model`'s top probability
    of each text, served, and the value `share` of the way up (at least 0.5, as allowed)."""
    tops: list[float] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, len(texts), 32):
            body = {"inputs": texts[start : start + 32], "model": model, "cache": False}
            response = client.post("/predict", json=body)
            response.raise_for_status()
            tops += [ranked[0]["score"] for ranked in response.json()]
    ordered = sorted(tops)
    return max(0.5, ordered[min(len(ordered) - 1, math.ceil(share * len(ordered)))])


@dataclass
class LoadPoint:
    """Closed-loop clients, one text a request, for a while: what came back."""

    model: str
    clients: int
    seconds: float
    statuses: dict[int, int] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    answered_by: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        ok = len(self.latencies_ms)
        ordered = sorted(self.latencies_ms)
        return {
            "model": self.model,
            "clients": self.clients,
            "seconds": self.seconds,
            "texts_per_s": ok / self.seconds,
            "texts_per_hour": ok / self.seconds * 3600,
            "p50_ms": _quantile(ordered, 0.50),
            "p99_ms": _quantile(ordered, 0.99),
            "statuses": {str(code): count for code, count in sorted(self.statuses.items())},
            "answered_by": dict(self.answered_by),
        }


def _quantile(ordered: list[float], fraction: float) -> float | None:
    """Nearest-rank quantile; None without data."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


def load(
    url: str | Sequence[str],
    model: str,
    texts: list[str],
    clients: int,
    seconds: float,
    warmup: float,
) -> dict[str, Any]:
    """`clients` clients, each sending one text and waiting for the answer, for `warmup`
    seconds (not counted) then `seconds`: texts/s of 200s, their p50/p99, every status. The
    clients run in processes of at most CLIENTS_PER_PROCESS each (bench/load_clients.py);
    given several servers' URLs, as many clients ask each (as a round-robin balancer would
    spread them), give or take one."""
    urls = [url] if isinstance(url, str) else list(url)
    begin = time.time() + SPAWN_S
    counted_from = begin + warmup
    jobs, first = [], 0
    for index, share in enumerate(client_shares(clients, len(urls))):
        jobs.append(
            Job(
                url=urls[index % len(urls)],
                model=model,
                texts=texts,
                first=first,
                clients=share,
                total=clients,
                begin=begin,
                counted_from=counted_from,
                until=counted_from + seconds,
            )
        )
        first += share
    point = LoadPoint(model, clients, seconds)
    for result in _run_client_processes(jobs):
        for code, count in result["statuses"].items():
            point.statuses[int(code)] = point.statuses.get(int(code), 0) + count
        point.latencies_ms += result["latencies_ms"]
        for who, count in result["answered_by"].items():
            point.answered_by[who] = point.answered_by.get(who, 0) + count
        # Requests sent before the end finish after it: count the time they took too.
        point.seconds = max(point.seconds, result["ended"] - counted_from)
    return point.summary()


def client_shares(clients: int, servers: int = 1) -> list[int]:
    """How many of `clients` each client process runs: as few processes as hold at most
    CLIENTS_PER_PROCESS each, a multiple of `servers` (process i asks server i mod
    `servers`), the clients spread evenly over them."""
    processes = math.ceil(clients / CLIENTS_PER_PROCESS)
    processes = min(clients, math.ceil(processes / servers) * servers)
    return [clients // processes + (index < clients % processes) for index in range(processes)]


def _run_client_processes(jobs: list[Job]) -> list[Result]:
    command = [sys.executable, "-m", "bench.load_clients"]
    running = [
        subprocess.Popen(
            command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for _ in jobs
    ]
    for process, job in zip(running, jobs, strict=True):
        assert process.stdin is not None
        process.stdin.write(json.dumps(job))
        process.stdin.close()
    results = []
    for process in running:
        assert process.stdout is not None
        output = process.stdout.read()
        if process.wait() != 0:
            raise RuntimeError(f"a client process exited with {process.returncode}")
        results.append(cast(Result, json.loads(output)))
    return results
