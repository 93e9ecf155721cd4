"""Served throughput and latency under 1–64 clients, against a naive server and the raw model.

Run: `python -m bench.throughput` (or `make bench-throughput`); `--quick` is a smoke run of
about a minute that writes into bench/out/throughput-quick/ instead. It needs `wrk`
(`apt-get install -y wrk`) and, for the plot, matplotlib (`pip install matplotlib`, or the
project's `bench` extra). Writes bench/reports/throughput.{md,json,png}. In one run, with the
same texts and the same torch thread count (TORCH_NUM_THREADS, default: every core):

- served: the real server process (`python -m api.cli`, cache off, default batching), one
  text per request;
- naive:  the same server with MAX_BATCH_SIZE=1 — one forward per request, no batching;
- raw:    the model alone (bench/raw_model.py, its own process, no HTTP): forwards of 32
  pre-tokenized texts in a loop — the model's own limit. It stays loaded beside the servers
  and is measured in turn with served at 32 clients, in 3 rounds whose order alternates:
  served/raw is the median of the rounds' ratios, as the machine's speed drifts by 10-30 %
  between two moments minutes apart;
- long texts: served and raw again at 32 clients on texts of the model's max length (SMS
  texts joined), where the forward dominates and the per-request work matters least;
- cache hit: the server with default settings (LRU on), one text repeated, timed by the
  server's own request histogram with one client, and its ceiling in requests/s at 32.

Overload (8× the saturating clients) has a benchmark of its own, bench/overload.py.
The load comes from `wrk` with bench/wrk/predict.lua, on 127.0.0.1 only: a compiled client,
because a Python client would take a good part of one of the two cores from the server.
Served and naive run side by side (the idle one costs nothing) and alternate at each
concurrency, so a drift on the machine hits both alike. Per point the report also keeps what
explains the numbers: the mean batch size and how busy the model was (from the server's
/metrics), and the cores used by the server, by wrk, and by anything else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import (
    BUSY_LOAD,
    REPO,
    WORK,
    RunningServer,
    add_out,
    busy_cpu_seconds,
    children_cpu_seconds,
    in_turn,
    machine_bullet,
    out_folder,
    process_cpu_seconds,
    run_meta,
    run_wrk,
    sample_texts,
    server,
    shown,
    stop,
    stop_on_sigterm,
    targets_table,
    tree_cpu_seconds,
    wait_for_quiet,
    write_bodies,
    write_report,
)

CACHE_OFF = {"LRU_CACHE_ENTRIES": "0", "DISK_CACHE_MAX_BYTES": "0"}
NAIVE = {"MAX_BATCH_SIZE": "1"}
# A third system beside served and naive, "variant": by default the same server with padded
# batches (cut by the batch cost model), what packing replaced; --no-variant leaves it out.
VARIANT = {"PACK_BATCHES": "false"}
# The targets this report is judged on.
TARGET_CLIENTS = 32
TARGET_VS_NAIVE = 3.0
TARGET_VS_RAW = 0.6  # at least; 0.8 is the aim, shown beside it
AIM_VS_RAW = 0.8
TARGET_P99_MS = 2000.0
TARGET_CACHE_HIT_MS = 2.0
TARGET_CACHE_HIT_RPS = 4000.0
# Likewise served (at TARGET_CLIENTS) and the raw model: served/raw is the median of these.
RAW_ROUNDS = 3
LONG_TEXT_CHARS = 600  # SMS texts joined up to this: past the embedded model's 128 tokens
# Cores taken by other processes during a point above which it is measured again (once): the
# machine is shared, and a test run or a training job starting mid-run skews one point.
OTHER_CORES_MAX = 0.25


@dataclass(frozen=True)
class Config:
    """What one run measures and for how long."""

    concurrency: list[int]
    duration: float
    warmup: float
    threads: int
    texts: int
    cache_seconds: float
    load_wait: float
    out: Path
    variant_env: dict[str, str] = field(default_factory=dict)  # empty: no variant system
    # Settings of every server of the run (the variant's own go over them); empty: as shipped.
    env: dict[str, str] = field(default_factory=dict)


def rounds_config(description: str, name: str, texts: tuple[int, int]) -> Config:
    """The command line of a bench that runs servers in rounds at TARGET_CLIENTS (tracing,
    rollout): --quick (1 s points, `texts[0]` texts, into bench/out/<name>-quick/),
    --duration, --threads, --out; `texts[1]` texts in a full run."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 s points")
    parser.add_argument("--duration", type=float, default=None, help="seconds a point")
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TORCH_NUM_THREADS") or len(os.sched_getaffinity(0))),
        help="torch threads of every server (default TORCH_NUM_THREADS, else every core)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    quick = args.quick
    return Config(
        concurrency=[TARGET_CLIENTS],
        duration=args.duration or (1.0 if quick else 10.0),
        warmup=0.5 if quick else 2.0,
        threads=args.threads,
        texts=texts[0] if quick else texts[1],
        cache_seconds=0.0,
        load_wait=0.0 if quick else 900.0,
        out=out_folder(args.out, quick, name),
    )


@dataclass
class Point:
    """One system under one concurrency: what wrk saw, and what the server said about it."""

    system: str
    clients: int
    seconds: float
    requests: int
    requests_per_s: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    statuses: dict[str, int]
    non_200: int
    socket_errors: int
    server_mean_ms: float  # the server's own request histogram, Δsum/Δcount
    mean_batch: float  # texts per forward
    model_busy: float  # share of the wall time a forward was running
    tokens_per_text: float
    server_cores: float  # CPU seconds per second of the server process
    client_cores: float  # … of wrk
    other_cores: float  # … of everything else on the machine
    attempts: int = 1  # 2 when the first try was disturbed by other processes


@dataclass(frozen=True)
class CacheHit:
    requests: int
    lru_hits: int
    server_mean_ms: float
    client_p50_ms: float
    client_p99_ms: float
    non_200: int
    ceiling_clients: int  # the ceiling run: one text repeated by this many clients
    ceiling_requests_per_s: float
    ceiling_lru_hits: int


@dataclass(frozen=True)
class RawRound:
    """Served at TARGET_CLIENTS and the raw model at batch 32, measured one after the other."""

    served_texts_per_s: float
    raw_texts_per_s: float
    raw_other_cores: float

    @property
    def ratio(self) -> float:
        return self.served_texts_per_s / self.raw_texts_per_s


# --- texts and what a server says ---------------------------------------------------------


def joined_texts(texts: list[str], chars: int) -> list[str]:
    """Consecutive texts joined (with a space) until each is at least `chars` long."""
    joined: list[str] = []
    current = ""
    for text in texts:
        current = f"{current} {text}" if current else text
        if len(current) >= chars:
            joined.append(current)
            current = ""
    return joined


def scrape(url: str) -> dict[str, float]:
    """The /metrics series this bench reads, each summed over its labels."""
    wanted = {
        "loraserve_request_duration_seconds_sum",
        "loraserve_request_duration_seconds_count",
        "loraserve_batch_size_sum",
        "loraserve_batch_size_count",
        "loraserve_batch_inference_seconds_sum",
        "loraserve_batch_tokens_sum",
    }
    values = dict.fromkeys(wanted, 0.0)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in wanted:
                continue
            route, status = sample.labels.get("route"), sample.labels.get("status")
            if sample.name.startswith("loraserve_request_") and (route, status) != (
                "/predict",
                "200",
            ):
                continue  # /ready and /metrics polls, and failures, are not the point
            values[sample.name] += sample.value
    return values


# --- load ----------------------------------------------------------------------------------


def measure(
    system: str, target: RunningServer, clients: int, config: Config, bodies: Path
) -> Point:
    """One point, measured again once if other processes took cores meanwhile."""
    point = measure_once(system, target, clients, config, bodies)
    if point.other_cores > OTHER_CORES_MAX:
        print(f"other processes took {point.other_cores} cores: measuring again", flush=True)
        point = measure_once(system, target, clients, config, bodies)
        point.attempts = 2
    return point


def measure_once(
    system: str, target: RunningServer, clients: int, config: Config, bodies: Path
) -> Point:
    """A warm-up run, then the timed one, with the server's counters read around it."""
    if config.warmup > 0:
        run_wrk(target.url, clients, config.warmup, bodies)
    before = scrape(target.url)
    cpu = (tree_cpu_seconds(target.pid), children_cpu_seconds(), busy_cpu_seconds())
    summary = run_wrk(target.url, clients, config.duration, bodies)
    cpu_after = (tree_cpu_seconds(target.pid), children_cpu_seconds(), busy_cpu_seconds())
    after = scrape(target.url)
    return to_point(system, clients, summary, before, after, cpu, cpu_after)


def to_point(
    system: str,
    clients: int,
    summary: dict[str, Any],
    before: dict[str, float],
    after: dict[str, float],
    cpu: tuple[float, float, float],
    cpu_after: tuple[float, float, float],
) -> Point:
    seconds = summary["duration_us"] / 1e6
    delta = {name: after[name] - before[name] for name in after}
    answered = delta["loraserve_request_duration_seconds_count"]
    batches = delta["loraserve_batch_size_count"]
    texts = delta["loraserve_batch_size_sum"]
    server_s, client_s, total_s = (b - a for a, b in zip(cpu, cpu_after, strict=True))
    latency = summary["latency_us"]
    statuses = {str(k): int(v) for k, v in summary["statuses"].items()}
    return Point(
        system=system,
        clients=clients,
        seconds=round(seconds, 2),
        requests=summary["requests"],
        requests_per_s=round(summary["requests"] / seconds, 1),
        p50_ms=round(latency["p50"] / 1000, 1),
        p90_ms=round(latency["p90"] / 1000, 1),
        p99_ms=round(latency["p99"] / 1000, 1),
        max_ms=round(latency["max"] / 1000, 1),
        statuses=statuses,
        non_200=sum(count for status, count in statuses.items() if status != "200"),
        socket_errors=sum(summary["socket_errors"].values()),
        server_mean_ms=round(
            1000 * delta["loraserve_request_duration_seconds_sum"] / max(answered, 1), 1
        ),
        mean_batch=round(texts / max(batches, 1), 2),
        model_busy=round(delta["loraserve_batch_inference_seconds_sum"] / seconds, 3),
        tokens_per_text=round(delta["loraserve_batch_tokens_sum"] / max(texts, 1), 1),
        server_cores=round(server_s / seconds, 2),
        client_cores=round(client_s / seconds, 2),
        other_cores=round(max(0.0, total_s - server_s - client_s) / seconds, 2),
    )


def served_and_naive(
    config: Config, bodies: Path, raw: RawModel
) -> tuple[list[Point], list[RawRound]]:
    """The servers up side by side; at each concurrency each runs, the order rotating. Then
    served and the raw model take turns (`raw_rounds`)."""
    envs = {"served": {**CACHE_OFF, **config.env}, "naive": {**CACHE_OFF, **config.env, **NAIVE}}
    if config.variant_env:
        envs["variant"] = {**CACHE_OFF, **config.env, **config.variant_env}
    points: list[Point] = []
    with ExitStack() as stack:
        systems = [
            (name, stack.enter_context(server(name, env, config.threads)))
            for name, env in envs.items()
        ]
        for index, clients in enumerate(config.concurrency):
            for system, target in in_turn(systems, index):
                point = measure(system, target, clients, config, bodies)
                print(json.dumps(asdict(point)), flush=True)
                points.append(point)
        rounds = raw_rounds(config, systems[0][1], raw, bodies)
    return points, rounds


class RawModel:
    """bench.raw_model --serve: the model alone, loaded once in a process of its own, timed on
    request. Idle between requests (blocked on its stdin), it costs the servers nothing."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self._process = process
        self.described: dict[str, float] = self._read()  # mean tokens, packed, threads

    def _read(self) -> dict[str, float]:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith("{"):
                found: dict[str, float] = json.loads(line)
                return found
        raise RuntimeError(f"bench.raw_model exited with {self._process.wait()}")

    def measure(self, seconds: float, batchings: list[str]) -> dict[str, float]:
        """Texts/s of each batching named, measured again once if other processes took cores
        meanwhile."""
        found = self._measure_once(seconds, batchings)
        if found["other_cores"] > OTHER_CORES_MAX:
            print(f"other processes took {found['other_cores']} cores: again", flush=True)
            found = {**self._measure_once(seconds, batchings), "attempts": 2}
        return found

    def ask(self, seconds: float, batchings: list[str]) -> None:
        """Starts a measurement of each batching named; `answer` waits for its texts/s. Raw
        models asked together run at once (one a replica, as replicas share a host)."""
        assert self._process.stdin is not None
        asked = {"seconds": seconds, "batchings": batchings}
        self._process.stdin.write(json.dumps(asked) + "\n")
        self._process.stdin.flush()

    def answer(self) -> dict[str, float]:
        """Texts/s of each batching of the measurement `ask` started."""
        return self._read()

    def _measure_once(self, seconds: float, batchings: list[str]) -> dict[str, float]:
        cpu, busy = process_cpu_seconds(self._process.pid), busy_cpu_seconds()
        start = time.monotonic()
        self.ask(seconds, batchings)
        found = self.answer()
        wall = time.monotonic() - start
        mine = process_cpu_seconds(self._process.pid) - cpu
        found["other_cores"] = round(max(0.0, busy_cpu_seconds() - busy - mine) / wall, 2)
        found["attempts"] = 1
        print(json.dumps({"raw": found}), flush=True)
        return found


@contextmanager
def raw_model(config: Config, bodies: Path) -> Iterator[RawModel]:
    """The raw model on the texts of `bodies`, loaded and ready, stopped when the block ends."""
    with raw_model_process(config.threads, bodies, WORK / "raw-model.log") as model:
        yield model


@contextmanager
def raw_model_process(
    threads: int, bodies: Path, log: Path, env: dict[str, str] | None = None
) -> Iterator[RawModel]:
    """bench.raw_model with `threads` torch threads (and `env` over this one) on the texts of
    `bodies`, loaded and ready, its errors in `log`, stopped when the block ends."""
    full = {
        **os.environ,
        **(env or {}),
        "TORCH_NUM_THREADS": str(threads),
        "LOG_LEVEL": "warning",
    }
    command = [sys.executable, "-m", "bench.raw_model", str(bodies), "--serve"]
    command += ["--threads", str(threads)]
    with log.open("w") as sink:
        process = subprocess.Popen(
            command,
            cwd=REPO,
            env=full,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
        )
        try:
            yield RawModel(process)
        finally:
            assert process.stdin is not None
            process.stdin.close()  # its loop ends; then it exits
            stop(process)


def raw_rounds(
    config: Config, served: RunningServer, raw: RawModel, bodies: Path
) -> list[RawRound]:
    """Served at TARGET_CLIENTS and raw at batch 32, in RAW_ROUNDS rounds whose order
    alternates."""
    rounds: list[RawRound] = []
    for number in range(RAW_ROUNDS):
        found: dict[str, Any] = {}
        for which in ("served", "raw") if number % 2 == 0 else ("raw", "served"):
            if which == "served":
                found["served"] = measure("served", served, TARGET_CLIENTS, config, bodies)
            else:
                found["raw"] = raw.measure(config.duration, ["batch32"])
        rounds.append(
            RawRound(
                served_texts_per_s=found["served"].requests_per_s,
                raw_texts_per_s=round(found["raw"]["batch32"], 1),
                raw_other_cores=found["raw"]["other_cores"],
            )
        )
        print(json.dumps({"raw_round": asdict(rounds[-1])}), flush=True)
    return rounds


def cache_hit(config: Config, text: str) -> CacheHit:
    """The server as shipped (LRU on); one text sent once, then repeated: by one client for
    the time of a hit, then by TARGET_CLIENTS for the most hits a second."""
    single = write_bodies([text], WORK / "one-body.jsonl")
    with server("cache", config.env, config.threads) as target:
        filled = httpx.post(f"{target.url}/predict", json={"inputs": text}, timeout=10)
        filled.raise_for_status()
        before = scrape(target.url)
        summary = run_wrk(target.url, 1, config.cache_seconds, single)
        after = scrape(target.url)
        run_wrk(target.url, TARGET_CLIENTS, config.warmup, single)
        ceiling = run_wrk(target.url, TARGET_CLIENTS, config.cache_seconds, single)
    total, answered = (
        after[f"loraserve_request_duration_seconds_{kind}"]
        - before[f"loraserve_request_duration_seconds_{kind}"]
        for kind in ("sum", "count")
    )
    failed = (
        sum(int(n) for s, n in run["statuses"].items() if s != "200") for run in (summary, ceiling)
    )
    hit = CacheHit(
        requests=summary["requests"],
        lru_hits=summary["lru_hits"],
        server_mean_ms=round(1000 * total / max(answered, 1), 3),
        client_p50_ms=round(summary["latency_us"]["p50"] / 1000, 3),
        client_p99_ms=round(summary["latency_us"]["p99"] / 1000, 3),
        non_200=sum(failed),
        ceiling_clients=TARGET_CLIENTS,
        ceiling_requests_per_s=round(ceiling["requests"] / (ceiling["duration_us"] / 1e6), 1),
        ceiling_lru_hits=ceiling["lru_hits"],
    )
    print(json.dumps({"cache_hit": asdict(hit)}), flush=True)
    return hit


def long_texts(config: Config, bodies: Path) -> Point:
    """Served at TARGET_CLIENTS on long texts (cache off), the server to itself."""
    with server("long", {**CACHE_OFF, **config.env}, config.threads) as target:
        point = measure("served-long", target, TARGET_CLIENTS, config, bodies)
    print(json.dumps(asdict(point)), flush=True)
    return point


# --- the report ----------------------------------------------------------------------------


def by_clients(points: list[Point], system: str) -> dict[int, Point]:
    return {p.clients: p for p in points if p.system == system}


def served_vs_raw(rounds: list[RawRound]) -> float:
    """Served at TARGET_CLIENTS over the raw model at batch 32: the median of the rounds'."""
    return statistics.median(round_.ratio for round_ in rounds)


def targets(
    points: list[Point],
    raw: dict[str, float],
    rounds: list[RawRound],
    hit: CacheHit,
) -> list[dict[str, Any]]:
    """Each target with the measured value and whether it is met.

    The targets are judged on "served" (the shipped settings); "variant", when measured, is
    checked against the same throughput and latency targets for comparison. Served/raw is
    the median of the rounds in which the two took turns; the variant's, its one run at
    TARGET_CLIENTS over the raw model's median.
    """
    naive = by_clients(points, "naive")
    found: list[dict[str, Any]] = []
    for system in ("served", "variant"):
        mine = by_clients(points, system)
        if not mine:
            continue
        if TARGET_CLIENTS in mine and TARGET_CLIENTS in naive:
            at = mine[TARGET_CLIENTS].requests_per_s
            vs_naive = at / naive[TARGET_CLIENTS].requests_per_s
            vs_raw = served_vs_raw(rounds) if system == "served" else at / raw["batch32"]
            name = f"at {TARGET_CLIENTS} clients"
            found.append(
                target(f"{system} ≥ {TARGET_VS_NAIVE:g}× naive {name}", vs_naive, TARGET_VS_NAIVE)
            )
            found.append(target(f"{system} ≥ {TARGET_VS_RAW:g}× raw {name}", vs_raw, TARGET_VS_RAW))
            found.append(target(f"{system} ≥ {AIM_VS_RAW:g}× raw {name} (aim)", vs_raw, AIM_VS_RAW))
        worst = max(p.p99_ms for p in mine.values())
        found.append(
            {
                "target": f"{system} p99 < {TARGET_P99_MS / 1000:g} s at every concurrency",
                "measured": f"worst {worst:.0f} ms",
                "met": worst < TARGET_P99_MS,
            }
        )
    failed = sum(p.non_200 + p.socket_errors for p in points) + hit.non_200
    found += [
        {
            "target": f"cache hit < {TARGET_CACHE_HIT_MS:g} ms at the server",
            "measured": f"{hit.server_mean_ms:.3f} ms",
            "met": hit.server_mean_ms < TARGET_CACHE_HIT_MS,
        },
        {
            "target": f"cache hits ≥ {TARGET_CACHE_HIT_RPS:g} req/s "
            f"at {hit.ceiling_clients} clients",
            "measured": f"{hit.ceiling_requests_per_s:.0f} req/s",
            "met": hit.ceiling_requests_per_s >= TARGET_CACHE_HIT_RPS,
        },
        {
            "target": "no failed request (non-200, socket error)",
            "measured": str(failed),
            "met": failed == 0,
        },
    ]
    return found


def target(name: str, ratio: float, at_least: float) -> dict[str, Any]:
    return {"target": name, "measured": f"{ratio:.2f}×", "met": ratio >= at_least}


def table(points: list[Point], raw: dict[str, float]) -> list[str]:
    served = {p.clients: p for p in points if p.system == "served"}
    naive = {p.clients: p for p in points if p.system == "naive"}
    lines = [
        "| clients | served req/s | served p50 ms | served p99 ms | naive req/s | naive p50 ms "
        "| naive p99 ms | served / naive | served / raw |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for clients in sorted(set(served) & set(naive)):
        s, n = served[clients], naive[clients]
        lines.append(
            f"| {clients} | {s.requests_per_s:.1f} | {s.p50_ms:.1f} | {s.p99_ms:.1f} "
            f"| {n.requests_per_s:.1f} | {n.p50_ms:.1f} | {n.p99_ms:.1f} "
            f"| {s.requests_per_s / n.requests_per_s:.2f} "
            f"| {s.requests_per_s / raw['batch32']:.2f} |"
        )
    return lines


def variant_table(points: list[Point], raw: dict[str, float]) -> list[str]:
    served, naive, variant = (by_clients(points, s) for s in ("served", "naive", "variant"))
    lines = [
        "| clients | variant req/s | variant p50 ms | variant p99 ms | variant / served "
        "| variant / naive | variant / raw |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for clients in sorted(set(variant) & set(served) & set(naive)):
        t, rps = variant[clients], variant[clients].requests_per_s
        lines.append(
            f"| {clients} | {rps:.1f} | {t.p50_ms:.1f} | {t.p99_ms:.1f} "
            f"| {rps / served[clients].requests_per_s:.2f} "
            f"| {rps / naive[clients].requests_per_s:.2f} | {rps / raw['batch32']:.2f} |"
        )
    return lines


def diagnostics(points: list[Point]) -> list[str]:
    lines = [
        "| system | clients | mean batch | model busy | tokens computed / text | server cores "
        "| wrk cores | other cores | server mean ms | statuses | socket errors | tries |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    order = {"served": 0, "variant": 1, "naive": 2}
    for p in sorted(points, key=lambda p: (order.get(p.system, 3), p.clients)):
        statuses = ", ".join(f"{s}: {n}" for s, n in sorted(p.statuses.items()))
        lines.append(
            f"| {p.system} | {p.clients} | {p.mean_batch:.1f} | {p.model_busy:.0%} "
            f"| {p.tokens_per_text:.1f} | {p.server_cores:.2f} | {p.client_cores:.2f} "
            f"| {p.other_cores:.2f} | {p.server_mean_ms:.1f} | {statuses} | {p.socket_errors} "
            f"| {p.attempts} |"
        )
    return lines


def ceilings(points: list[Point], raw: dict[str, float]) -> list[str]:
    """What the measurements themselves say bounds the ratios the targets ask for."""
    served = {p.clients: p for p in points if p.system == "served"}
    naive = {p.clients: p for p in points if p.system == "naive"}
    if TARGET_CLIENTS not in served or TARGET_CLIENTS not in naive:
        return []
    s, n = served[TARGET_CLIENTS], naive[TARGET_CLIENTS]
    return [
        f"Bounds at {TARGET_CLIENTS} clients, from this run: even with no HTTP cost and every "
        f"batch full, a server of one-text requests would reach "
        f"{raw['batch32'] / n.requests_per_s:.2f}× naive (raw batch 32 "
        f"{raw['batch32']:.0f} / naive {n.requests_per_s:.0f} texts/s): batching buys "
        f"{raw['batch32'] / raw['batch1']:.2f}× over one text a forward (raw batch 32 / raw "
        f"batch 1). Padding in the texts' order would cost "
        f"{raw['batch32'] / raw['batch32_padded']:.2f}× (raw batch 32 as served / padded). "
        f"The served batches computed {s.tokens_per_text:.1f} tokens per text for "
        f"{raw['mean_tokens']:.1f} real ones.",
        "",
    ]


def env_text(env: dict[str, str]) -> str:
    return ", ".join(f"{key}={value}" for key, value in env.items())


def raw_rounds_table(rounds: list[RawRound]) -> list[str]:
    lines = [
        f"| round | served texts/s ({TARGET_CLIENTS} clients) | raw texts/s (batch 32) "
        "| served / raw | other cores during raw |",
        "|---:|---:|---:|---:|---:|",
    ]
    for number, round_ in enumerate(rounds, start=1):
        lines.append(
            f"| {number} | {round_.served_texts_per_s:.1f} | {round_.raw_texts_per_s:.1f} "
            f"| {round_.ratio:.2f} | {round_.raw_other_cores:.2f} |"
        )
    return lines


def markdown(
    points: list[Point],
    raw: dict[str, float],
    rounds: list[RawRound],
    hit: CacheHit,
    found: list[dict[str, Any]],
    meta: dict[str, Any],
    long: tuple[Point, dict[str, float]],
) -> str:
    m, config = meta["machine"], meta["config"]
    load = meta["load_average"]
    lines = [
        "# Throughput: the served model vs. a naive server and the raw model",
        "",
        f"Written by `{meta['command']}` on {meta['date']}.",
        "",
        f"{machine_bullet(m, config['threads'])} everywhere.",
        f"- Load average (1 min) before the run: {load['first']:.2f}; at the start "
        f"{load['at_start']:.2f} after waiting {load['waited_s']} s (the run waits, up to "
        f"{config['load_wait']:.0f} s, for it to be ≤ {BUSY_LOAD}).",
        f"- Client: {m['client']}, 1 thread, N connections (= clients), each request one text "
        f'`{{"inputs": "…"}}` cycling through {config["texts"]} distinct SMS texts; '
        f"{config['duration']:g} s per point after a {config['warmup']:g} s warm-up; "
        "127.0.0.1 only.",
        f"- Model: {meta['model']}. Every server: `python -m api.cli` with "
        "LRU_CACHE_ENTRIES=0, DISK_CACHE_MAX_BYTES=0"
        + (f" and {env_text(config['env'])}" if config["env"] else "")
        + "; served keeps every other setting as "
        f"shipped; naive adds {env_text(NAIVE)}"
        + (f"; variant adds {env_text(config['variant_env'])}" if config["variant_env"] else "")
        + ". They run side by side (an idle one costs nothing) and take turns at each "
        "concurrency, the order rotating.",
        "",
        "## Throughput and latency",
        "",
        "Requests/s = texts/s (one text a request). Latency is wrk's, at the client.",
        "",
        *table(points, raw),
        "",
        *(
            [
                f"The same with the variant's settings ({env_text(config['variant_env'])}), "
                "in the same run:",
                "",
                *variant_table(points, raw),
                "",
            ]
            if config["variant_env"]
            else []
        ),
        f"Raw model (no HTTP, one process, pre-tokenized, {config['duration']:g} s each): "
        f"**{raw['batch32']:.1f} texts/s** at batch 32 in the texts' order, run as the server "
        f"runs it ({'packed' if raw['packed'] else 'padded'}; the 'raw' above: the median of "
        f"its {len(rounds)} runs in turn with served, below); "
        f"{raw['batch32_sorted']:.1f} texts/s with the texts sorted by length first; "
        f"{raw['batch32_padded']:.1f} texts/s padded in the texts' order; "
        f"{raw['batch1']:.1f} texts/s at batch 1 (the most a server without batching could "
        f"do). Mean text length {raw['mean_tokens']:.1f} tokens.",
        "",
        f"Served at {TARGET_CLIENTS} clients and the raw model at batch 32 taking turns, in "
        f"{len(rounds)} rounds whose order alternates (the raw model stays loaded in its own "
        "process beside the idle servers): served / raw is the median of the rounds' ratios, "
        f"**{served_vs_raw(rounds):.2f}**. The table above divides by the raw median.",
        "",
        *raw_rounds_table(rounds),
        "",
        f"Long texts (SMS texts joined to ≥ {LONG_TEXT_CHARS} characters, cut to the model's "
        f"max length; {long[1]['mean_tokens']:.1f} tokens a text): served "
        f"**{long[0].requests_per_s:.1f} texts/s** at {long[0].clients} clients (p99 "
        f"{long[0].p99_ms:.0f} ms, mean batch {long[0].mean_batch:.1f}), raw "
        f"{long[1]['batch32']:.1f} texts/s at batch 32: served / raw "
        f"**{long[0].requests_per_s / long[1]['batch32']:.2f}**.",
        "",
        f"Cache hit (server as shipped, LRU on; one text sent once, then repeated by one wrk "
        f"connection for {config['cache_seconds']:g} s, {hit.requests} requests, "
        f"{hit.lru_hits} answered by the LRU): **{hit.server_mean_ms:.3f} ms** mean at the "
        f"server (Δsum/Δcount of `loraserve_request_duration_seconds`), client p50 "
        f"{hit.client_p50_ms:.3f} ms, p99 {hit.client_p99_ms:.3f} ms. Its ceiling, the same "
        f"text from {hit.ceiling_clients} connections: **{hit.ceiling_requests_per_s:.0f} "
        f"req/s** ({hit.ceiling_lru_hits} LRU hits).",
        "",
        *targets_table(found),
        "",
        *reading(points),
        "## What the server did (from its /metrics, and CPU time from /proc)",
        "",
        "Mean batch: texts per forward. Model busy: the share of the wall time a forward was "
        "running. Cores: CPU seconds per second of the server process, of wrk, and of "
        f"everything else (of {m['cores']}).",
        "",
        *diagnostics(points),
        "",
        *ceilings(points, raw),
        "Plot: [throughput.png](throughput.png) (needs matplotlib: `pip install matplotlib`).",
    ]
    return "\n".join(lines) + "\n"


def reading(points: list[Point]) -> list[str]:
    """What keeps served below the raw model, from how busy the model was."""
    served = by_clients(points, "served")
    if TARGET_CLIENTS not in served:
        return []
    most, at = served[max(served)], served[TARGET_CLIENTS]
    return [
        "## What the figures say",
        "",
        f"At {most.clients} clients the batches held {most.mean_batch:.1f} texts and the model "
        f"was busy {most.model_busy:.0%} of the time, yet served stays below raw: the event "
        "loop's work for the next requests runs beside the forward on the same cores, and a "
        "torch thread descheduled for it holds up the other at each parallel region "
        "([threads on a shared CPU](../../loading.md#speed-and-memory-on-this-cpu)). At "
        f"{TARGET_CLIENTS} clients the model was busy {at.model_busy:.0%} of the time: it waits "
        "while the event loop answers a whole batch's clients and reads their next requests.",
        "",
    ]


def plot(points: list[Point], raw: dict[str, float], path: Path) -> bool:
    """Throughput, latency and padding against clients; False when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: skipping the plot (pip install matplotlib)", file=sys.stderr)
        return False
    figure, (left, middle, right) = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = (("served", "o-", "C0"), ("variant", "^-.", "C2"), ("naive", "s--", "C1"))
    for system, style, color in styles:
        mine = sorted((p for p in points if p.system == system), key=lambda p: p.clients)
        if not mine:
            continue
        xs = [p.clients for p in mine]
        left.plot(xs, [p.requests_per_s for p in mine], style, color=color, label=system)
        middle.plot(xs, [p.p99_ms for p in mine], style, color=color, label=f"{system} p99")
        middle.plot(
            xs, [p.p50_ms for p in mine], style, color=color, alpha=0.4, label=f"{system} p50"
        )
        right.plot(xs, [p.tokens_per_text for p in mine], style, color=color, label=system)
    left.axhline(raw["batch32"], color="grey", linestyle=":", label="raw, batch 32")
    left.axhline(raw["batch32_sorted"], color="olive", linestyle=":", label="raw, 32 by length")
    left.axhline(raw["batch1"], color="brown", linestyle=":", label="raw, batch 1")
    left.set(xlabel="concurrent clients", ylabel="texts per second", ylim=(0, None))
    middle.axhline(TARGET_P99_MS, color="red", linestyle=":", label="2 s target")
    middle.set(yscale="log", xlabel="concurrent clients", ylabel="latency at the client (ms)")
    right.axhline(raw["mean_tokens"], color="grey", linestyle=":", label="real tokens / text")
    right.set(
        xlabel="concurrent clients",
        ylabel="tokens computed per text (padding counted unless packed)",
        ylim=(0, None),
    )
    clients = sorted({p.clients for p in points})
    for axis in (left, middle, right):
        axis.set_xscale("log")
        axis.set_xticks(clients, labels=[str(c) for c in clients])
        axis.minorticks_off()
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
    figure.suptitle("loraserve, one text a request: served (dynamic batching) vs. naive vs. raw")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return True


def model_name() -> str:
    """The embedded default as the report names it, read from its declaration."""
    from api.models.spec import load_models_file

    spec = load_models_file(None)[0]
    adapters = "+".join(a.name for a in spec.adapters) or "no adapter"
    return f"{spec.name} ({Path(spec.base).name}, adapter {adapters}, {spec.quantization})"


def write(out: Path, text: str, data: dict[str, Any], points: list[Point], raw: Any) -> None:
    write_report(out, "throughput", data, text)
    plot(points, raw, out / "throughput.png")


# --- the run -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, help="timed seconds per point (default 10)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds per point (default 2)")
    parser.add_argument("--concurrency", help="comma-separated clients (default 1,4,16,32,64)")
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("TORCH_NUM_THREADS") or len(os.sched_getaffinity(0))),
        help="torch threads for every system (default TORCH_NUM_THREADS, else every core)",
    )
    parser.add_argument("--texts", type=int, default=2000, help="distinct texts (default 2000)")
    parser.add_argument(
        "--load-wait", type=float, help="most seconds to wait for a quiet machine (default 900)"
    )
    parser.add_argument(
        "--variant-env",
        action="append",
        metavar="KEY=VALUE",
        help=f"settings of the variant server (default {env_text(VARIANT)}); repeatable",
    )
    parser.add_argument("--no-variant", action="store_true", help="leave the variant server out")
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of every server of the run (the variant's own go over it); repeatable",
    )
    add_out(parser, quick_help="smoke run: 2 s points, 1 and 32 clients")
    args = parser.parse_args(argv)
    quick = args.quick
    clients = args.concurrency or ("1,32" if quick else "1,4,16,32,64")
    return Config(
        concurrency=[int(c) for c in clients.split(",")],
        duration=args.duration or (2.0 if quick else 10.0),
        warmup=args.warmup if args.warmup is not None else (0.5 if quick else 2.0),
        threads=args.threads,
        texts=args.texts,
        cache_seconds=1.0 if quick else 3.0,
        load_wait=args.load_wait if args.load_wait is not None else (0.0 if quick else 900.0),
        out=out_folder(args.out, quick, "throughput"),
        variant_env={}
        if args.no_variant
        else dict(item.split("=", 1) for item in args.variant_env)
        if args.variant_env
        else VARIANT,
        env=dict(item.split("=", 1) for item in args.env),
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is needed: apt-get install -y wrk", file=sys.stderr)
        return 2
    stop_on_sigterm()
    WORK.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load = wait_for_quiet(config.load_wait)
    texts = sample_texts(config.texts)
    bodies = write_bodies(texts, WORK / "bodies.jsonl")

    long_bodies = write_bodies(joined_texts(texts, LONG_TEXT_CHARS), WORK / "long-bodies.jsonl")

    with raw_model(config, bodies) as model:
        points, rounds = served_and_naive(config, bodies, model)
        others = model.measure(config.duration, ["batch32_sorted", "batch32_padded", "batch1"])
    # The model's own limit is the median of its runs beside the served ones; one run each
    # gives the other batchings.
    batch32 = statistics.median(round_.raw_texts_per_s for round_ in rounds)
    raw = {"batch32": batch32, **others, **model.described}
    long_point = long_texts(config, long_bodies)
    with raw_model(config, long_bodies) as model:
        long = (long_point, {**model.measure(config.duration, ["batch32"]), **model.described})
    hit = cache_hit(config, texts[0])

    found = targets(points, raw, rounds, hit)
    meta = run_meta("bench.throughput", argv, load, model_name(), config, started)
    text = markdown(points, raw, rounds, hit, found, meta, long)
    data = {
        "meta": meta,
        "points": [asdict(p) for p in points],
        "raw_texts_per_s": raw,
        "served_vs_raw_rounds": [asdict(round_) for round_ in rounds],
        "long_texts": {"served": asdict(long[0]), "raw_texts_per_s": long[1]},
        "cache_hit": asdict(hit),
        "targets": found,
    }
    write(config.out, text, data, points, raw)
    print(f"written to {shown(config.out)}/ in {meta['run_seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
