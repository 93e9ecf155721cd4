"""Replicas on one CPU host: torch's threads per replica, against the raw model run alike.

torch runs a CPU forward on every core by default, in an OpenMP team whose threads spin while
they wait for each other. Two replicas on one host, each with a team as large as the host,
take the cores from each other's teams, and every parallel region then waits for a thread
that is not running (docs/configuration.md, "Threads on a shared CPU"). The same holds, on a
smaller scale, for one replica's own event loop: each time it runs, it takes a core from its
forward's team.

`python -m bench.replica_threads` serves the embedded encoder (spam-minilm, caches off,
admission off) from one replica, then from two replicas started together on this host, each
first with torch's default threads (every core) and then with TORCH_NUM_THREADS at half the
host's cores. wrk's connections (one wrk process a replica, on the same host), spread evenly
over the replicas, send one SMS a request. Beside each configuration, the raw model
(bench.raw_model: no HTTP, batches of 32, packed as the server packs) runs in as many
processes with as many threads each, all at once; served and raw take turns, the order
alternating each round, after a warm-up. The report gives the median round, served against
its own raw, and both against the raw model of one process on every core (the raw model
bench.throughput compares with). It writes bench/reports/replica_threads.{md,json}. For
this, compose's `scale` profile sets its replicas' threads (REPLICA_TORCH_NUM_THREADS).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import yaml

from bench.gpu_load import replicas
from bench.harness import (
    OUT,
    REPO,
    REPORTS,
    machine,
    machine_line,
    run_head,
    run_wrk,
    sample_texts,
    wait_for_quiet,
    write_bodies,
    write_report,
)
from bench.throughput import RawModel, raw_model_process

WORK = OUT / "replica-threads"
MODEL = "spam-minilm"
CLIENTS = 32


def encoder_models_file(folder: Path) -> Path:
    """The embedded default's encoder alone, its relative paths made absolute."""
    declared = yaml.safe_load((REPO / "artifacts" / "models.yaml").read_text(encoding="utf-8"))
    (spec,) = [model for model in declared["models"] if model["name"] == MODEL]
    for adapter in spec["adapters"]:
        adapter["path"] = str(REPO / "artifacts" / adapter["path"])
    path = folder / "models.yaml"
    path.write_text(yaml.safe_dump({"models": [spec]}, sort_keys=False), encoding="utf-8")
    return path


def configurations(cores: int) -> list[tuple[int, int | None]]:
    """(replicas, TORCH_NUM_THREADS; None: torch's default, every core): one and two
    replicas, each with every core and with half of them, so that what splitting the cores
    does apart from adding a replica shows too."""
    half = max(1, cores // 2)
    return [(1, None), (1, half), (2, None), (2, half)]


def run(seconds: float, rounds: int, warmup: float) -> dict[str, Any]:
    WORK.mkdir(parents=True, exist_ok=True)
    load_average = round(wait_for_quiet(300.0)["at_start"], 2)
    cores = len(os.sched_getaffinity(0))
    env = {
        "MODELS_FILE": str(encoder_models_file(WORK)),
        "MODEL_CACHE_DIR": str(WORK / "model-cache"),
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        # Every request queued and answered: the comparison is of throughput, not of refusals.
        "ADMISSION_CONTROL": "false",
        "OFFLINE": "true",
    }
    bodies = write_bodies(sample_texts(2000), WORK / "bodies.txt")
    rows = []
    for count, threads in configurations(cores):
        settings = env if threads is None else {**env, "TORCH_NUM_THREADS": str(threads)}
        each = cores if threads is None else threads
        with (
            replicas(count, settings, WORK) as servers,
            raw_models(count, each, bodies, env) as models,
        ):
            urls = [server.url for server in servers]
            together(urls, warmup, bodies)
            raw_together(models, warmup)
            points, raw_rates = [], []
            for number in range(rounds):
                # Served first in even rounds, raw first in odd ones: neither always follows.
                if number % 2:
                    raw_rates.append(raw_together(models, seconds))
                points.append(together(urls, seconds, bodies))
                if not number % 2:
                    raw_rates.append(raw_together(models, seconds))
        rates = [point["texts_per_s"] for point in points]
        ratios = [served / raw for served, raw in zip(rates, raw_rates, strict=True)]
        rows.append(
            {
                "replicas": count,
                "torch_num_threads": threads,
                "texts_per_s_rounds": rates,
                **points[rates.index(statistics.median_low(rates))],
                "texts_per_s": statistics.median(rates),
                "raw_texts_per_s_rounds": raw_rates,
                "raw_texts_per_s": statistics.median(raw_rates),
                "served_over_raw_rounds": ratios,
                "served_over_raw": statistics.median(ratios),
            }
        )
    return {
        **run_head(machine(), load_average),
        "cores": cores,
        "clients": CLIENTS,
        "seconds": seconds,
        "rounds": rounds,
        "rows": rows,
    }


@contextmanager
def raw_models(
    count: int, threads: int, bodies: Path, env: dict[str, str]
) -> Iterator[list[RawModel]]:
    """`count` raw models of `threads` torch threads each, loaded one after another (as
    their loading is not what is measured), stopped when the block ends."""
    with ExitStack() as stack:
        yield [
            stack.enter_context(
                raw_model_process(threads, bodies, WORK / f"raw-{count}-{i}.log", env)
            )
            for i in range(count)
        ]


def raw_together(models: list[RawModel], seconds: float) -> float:
    """Batches of 32 in every raw model at once for `seconds`: their texts/s summed."""
    for model in models:
        model.ask(seconds, ["batch32"])
    return sum(model.answer()["batch32"] for model in models)


def together(urls: list[str], seconds: float, bodies: Path) -> dict[str, Any]:
    """One wrk a replica, CLIENTS connections in all, run at once: texts/s of them all, the
    slowest replica's p50 and p99, and every status."""
    with ThreadPoolExecutor(max_workers=len(urls)) as pool:
        runs = list(pool.map(lambda url: run_wrk(url, CLIENTS // len(urls), seconds, bodies), urls))
    statuses: Counter[str] = Counter()
    for summary in runs:
        statuses.update({str(code): int(n) for code, n in summary["statuses"].items()})
    return {
        "texts_per_s": sum(r["requests"] / (r["duration_us"] / 1e6) for r in runs),
        "p50_ms": max(r["latency_us"]["p50"] for r in runs) / 1000,
        "p99_ms": max(r["latency_us"]["p99"] for r in runs) / 1000,
        "statuses": dict(sorted(statuses.items())),
    }


def markdown(report: dict[str, Any]) -> str:
    one = report["rows"][0]["texts_per_s"]
    raw_one = report["rows"][0]["raw_texts_per_s"]
    lines = [
        "# Replicas on one CPU host: torch's threads per replica",
        "",
        machine_line(report, "`python -m bench.replica_threads`."),
        "",
        f"The embedded encoder ({MODEL}), caches and admission off, served by one replica, then "
        f"by two started together on this host, each with torch's default threads and with "
        f"half the cores; {report['clients']} wrk connections in all (one wrk a replica, on "
        "this host too) spread evenly over the replicas, one SMS a request. Raw: the model "
        "alone (bench.raw_model, no HTTP, batches of 32, packed as the server packs) in as many "
        "processes as replicas, with as many threads each, all at once. Served and raw take "
        f"turns in {report['rounds']} rounds of {report['seconds']:g} s after a warm-up, the "
        "order alternating; the median round (p50 and p99: the slowest replica's). One raw: "
        "the first row's raw model, one process on every core (what bench.throughput's "
        "served / raw divides by).",
        "",
        "| replicas | TORCH_NUM_THREADS | served texts/s | against the first row | raw texts/s "
        "| served / its raw | served / one raw | p50 ms | p99 ms | rounds served / raw "
        "| statuses |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for row in report["rows"]:
        threads = row["torch_num_threads"]
        rounds = ", ".join(
            f"{served:.0f} / {raw:.0f}"
            for served, raw in zip(
                row["texts_per_s_rounds"], row["raw_texts_per_s_rounds"], strict=True
            )
        )
        statuses = ", ".join(f"{code}: {n}" for code, n in row["statuses"].items())
        lines.append(
            f"| {row['replicas']} | {'unset (every core)' if threads is None else threads} "
            f"| {row['texts_per_s']:.1f} | {row['texts_per_s'] / one:.2f} "
            f"| {row['raw_texts_per_s']:.1f} | {row['served_over_raw']:.2f} "
            f"| {row['texts_per_s'] / raw_one:.2f} "
            f"| {row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {rounds} | {statuses} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.replica_threads", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="seconds a round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each round")
    parser.add_argument("--out", type=Path, default=REPORTS)
    args = parser.parse_args(argv)
    report = run(args.seconds, args.rounds, args.warmup)
    write_report(args.out, "replica_threads", report, markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
