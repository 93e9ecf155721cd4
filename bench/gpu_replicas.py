"""Replicas on one GPU: does a second server process feed the device more texts a second than
one, at one text a request?

One server process answers one-text requests as fast as its event loop and the GIL let it
(bench/reports/frontend.md): on an H200 KoELECTRA-small's forward of 32 texts takes ~13 ms,
about 2,400 texts/s, while one process served 1,972 at 128 clients (bench/reports/gpu.md).
A GPU machine has cores to spare, so the plain way to feed the device more is more processes,
each with its own copy of the model (KoELECTRA's weights are 0.03 GB) behind a load balancer.
Whether that pays depends on the device: kernels of separate processes share one GPU by time
slices unless MPS is running, and every process holds a CUDA context of its own.

Run on a machine with one NVIDIA GPU, from the repository root: `python -m bench.gpu_replicas`
builds KoELECTRA-small-v3-discriminator's shapes with a LoRA adapter (random weights, as
bench.gpu does), then for 1, 2 and 4 replicas starts that many real servers (`python -m
api.cli`, the users' settings, MAX_MEMORY_GB split between them, caches off) together, and
drives them with closed-loop clients spread evenly over the replicas (as a round-robin
balancer would), one 128-token text a request. It writes bench/reports/gpu-replicas.{md,json}.
`--smoke` runs the same code on tiny shapes on whatever device there is, into bench/out.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import yaml

from bench import gpu, gpu_load
from bench.gpu_models import TINY, USERS, Shapes, build_koelectra, texts
from bench.report_files import write_report

REPORT_NAME = "gpu-replicas"
MODEL = gpu.KOELECTRA
# The users' GPU budget, split evenly between the replicas.
BUDGET_GB = 16.0
BATCH_METRICS = {
    "loraserve_batch_size_count",
    "loraserve_batch_size_sum",
    "loraserve_batch_inference_seconds_sum",
}


@dataclass(frozen=True)
class Plan:
    shapes: Shapes
    tokens: int
    replicas: tuple[int, ...]
    clients: tuple[int, ...]
    seconds: float
    warmup: float


FULL = Plan(USERS, tokens=128, replicas=(1, 2, 4), clients=(64, 128, 256), seconds=8.0, warmup=2.0)
SMOKE = Plan(TINY, tokens=32, replicas=(1, 2), clients=(4,), seconds=1.0, warmup=0.2)


def models_file(path: Path, base: Path, adapter: Path, max_length: int) -> Path:
    """KoELECTRA as the users declare it, alone."""
    entries = [gpu.koelectra_entry(base, adapter, max_length)]
    path.write_text(yaml.safe_dump({"models": entries}, sort_keys=False), encoding="utf-8")
    return path


def batches(urls: list[str]) -> list[dict[str, float]]:
    """Each replica's batch counters."""
    return [gpu_load.metric_sums(url, BATCH_METRICS, model=MODEL) for url in urls]


def measure(plan: Plan, env: dict[str, str], corpus: list[str], work: Path) -> list[dict[str, Any]]:
    """Every replica count's start and load points."""
    rows: list[dict[str, Any]] = []
    for count in plan.replicas:
        budget = {**env, "MAX_MEMORY_GB": f"{BUDGET_GB / count:g}"}
        with gpu_load.replicas(count, budget, work) as servers:
            urls = [server.url for server in servers]
            points = []
            for clients in plan.clients:
                before = batches(urls)
                point = gpu_load.load(urls, MODEL, corpus, clients, plan.seconds, plan.warmup)
                ran = [
                    {name: value - earlier[name] for name, value in later.items()}
                    for earlier, later in zip(before, batches(urls), strict=True)
                ]
                points.append((point, ran))
            # Once the load has run: the activations and the allocators' caches are in.
            used = gpu_load.gpu_memory(urls[0])["driver_used_gb"]
        for point, ran in points:
            forwards = [replica["loraserve_batch_size_count"] for replica in ran]
            batches_run = sum(forwards)
            texts_run = sum(replica["loraserve_batch_size_sum"] for replica in ran)
            seconds = sum(replica["loraserve_batch_inference_seconds_sum"] for replica in ran)
            rows.append(
                {
                    "replicas": count,
                    "ready_s": [server.ready_s for server in servers],
                    "driver_used_gb": used,
                    **point,
                    "batches_per_replica": forwards,
                    "mean_batch_texts": texts_run / batches_run if batches_run else None,
                    "mean_batch_ms": 1000 * seconds / batches_run if batches_run else None,
                }
            )
    return rows


def run(plan: Plan, work: Path, smoke: bool) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    began = time.perf_counter()
    base, adapter = work / "models" / "koelectra", work / "models" / "koelectra-spam"
    build_koelectra(base, adapter, plan.shapes, seed=0)
    corpus = texts(base, plan.tokens, 64, seed=plan.tokens)
    models = models_file(work / "models.yaml", base, adapter, plan.tokens)
    env = gpu.server_env(work, models, device, plan.tokens)
    rows = measure(plan, env, corpus, work)
    meta = {
        **gpu.environment(device),
        "smoke": smoke,
        "plan": {**asdict(plan), "shapes": plan.shapes.koelectra},
        "wall_s": time.perf_counter() - began,
        "command": " ".join(["python -m bench.gpu_replicas", *sys.argv[1:]]),
    }
    return {"meta": meta, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    """The report's page: the device, then each replica count's load points."""
    meta, rows = report["meta"], report["rows"]
    gpu_info = meta["gpu"]
    device = (
        f"**{gpu_info['name']}** (CUDA {gpu_info['cuda']}, driver {gpu_info['driver']})"
        if gpu_info
        else f"**{meta['device']}** (smoke run: not a GPU's figures)"
    )
    plan = meta["plan"]
    lines = [
        "# Replicas on one GPU: KoELECTRA, one text a request",
        "",
        f"Device: {device}; Python {meta['python']}; torch {meta['versions']['torch']}, "
        f"transformers {meta['versions']['transformers']}. {meta['date']}. Made by "
        f"`{meta['command']}` in {meta['wall_s'] / 60:.1f} min; raw figures in "
        f"{REPORT_NAME}.json.",
        "",
        f"Each replica is the real server (`python -m api.cli`) with KoELECTRA-small's shapes "
        f"in bf16 and a LoRA adapter (random weights), MAX_MEMORY_GB={BUDGET_GB:g} split "
        f"evenly, caches off, ADMISSION_CONTROL=false; the replicas of a row started together "
        f"and share the GPU. Closed-loop clients (in processes of at most 16), spread evenly "
        f"over the replicas, send one {plan['tokens']}-token text a request; "
        f"{plan['seconds']:g} s a point after {plan['warmup']:g} s of warm-up. batch: the "
        f"replicas' mean batch (texts, and its forward in ms) over the point. GPU used: "
        f"nvidia-smi's, every process on the card, once the row's points have run.",
        "",
        "| replicas | clients | texts/s | p50 ms | p99 ms | statuses | batch texts | batch ms "
        "| GPU used GB, after | ready s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        statuses = ", ".join(f"{code}: {n}" for code, n in row["statuses"].items())
        ready = ", ".join(f"{seconds:.1f}" for seconds in row["ready_s"])
        used = row["driver_used_gb"]
        lines.append(
            f"| {row['replicas']} | {row['clients']} | {row['texts_per_s']:,.1f} "
            f"| {_tenths(row['p50_ms'])} | {_tenths(row['p99_ms'])} | {statuses} "
            f"| {_tenths(row['mean_batch_texts'])} | {_tenths(row['mean_batch_ms'])} "
            f"| {'—' if used is None else f'{used:.2f}'} | {ready} |"
        )
    lines += ["", *comparison(rows), ""]
    return "\n".join(lines)


def comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Each replica count's best throughput against one replica's best."""
    best: dict[int, float] = {}
    for row in rows:
        best[row["replicas"]] = max(best.get(row["replicas"], 0.0), row["texts_per_s"])
    if 1 not in best or not best[1]:
        return []
    parts = [f"{n}: {rate:,.1f} texts/s ({rate / best[1]:.2f}×)" for n, rate in best.items()]
    return [f"Best throughput per replica count, against one replica: {'; '.join(parts)}."]


def _tenths(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu_replicas", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--work", type=Path, help="models and server logs (default bench/out)")
    parser.add_argument("--out", type=Path, help="report folder (default bench/reports)")
    parser.add_argument("--seconds", type=float, help="seconds per load point")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no GPU is visible to torch here; `--smoke` runs the same code", file=sys.stderr)
        return 2
    plan = SMOKE if args.smoke else FULL
    if args.seconds is not None:
        plan = replace(plan, seconds=args.seconds)
    work = args.work or gpu.OUT / (f"{REPORT_NAME}-smoke" if args.smoke else REPORT_NAME)
    out = args.out or (work if args.smoke else gpu.REPORTS)
    if args.smoke and out.resolve() == gpu.REPORTS.resolve():
        print("--smoke figures are not a GPU's: they never go into bench/reports", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    report = run(plan, work, args.smoke)
    write_report(out, REPORT_NAME, report, markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
