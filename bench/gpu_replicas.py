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

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from bench import gpu, gpu_cli, gpu_load
from bench.gpu_cli import tenths
from bench.gpu_models import TINY, USERS, Shapes, texts

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
    began = time.perf_counter()
    device, base, adapter = gpu_cli.koelectra(work, plan.shapes)
    corpus = texts(base, plan.tokens, 64, seed=plan.tokens)
    models = models_file(work / "models.yaml", base, adapter, plan.tokens)
    env = gpu.server_env(work, models, device, plan.tokens)
    rows = measure(plan, env, corpus, work)
    meta = gpu_cli.meta("bench.gpu_replicas", device, smoke, plan, began)
    return {"meta": meta, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    """The report's page: the device, then each replica count's load points."""
    meta, rows = report["meta"], report["rows"]
    device = gpu_cli.device_named(meta)
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
            f"| {tenths(row['p50_ms'])} | {tenths(row['p99_ms'])} | {statuses} "
            f"| {tenths(row['mean_batch_texts'])} | {tenths(row['mean_batch_ms'])} "
            f"| {'—' if used is None else f'{used:.2f}'} | {ready} |"
        )
    lines += ["", *comparison(rows), ""]
    if not meta["smoke"]:
        lines += reading(rows)
    return "\n".join(lines)


def reading(rows: list[dict[str, Any]]) -> list[str]:
    """What each replica count shows at the most clients: its batches, its p99, and what a
    replica holds of the card."""
    most = max(row["clients"] for row in rows)
    at_most = [row for row in rows if row["clients"] == most]
    batches = ", ".join(
        f"{row['mean_batch_texts']:.1f} texts ({row['replicas']})" for row in at_most
    )
    p99s = ", ".join(f"{row['p99_ms']:.0f} ms ({row['replicas']})" for row in at_most)
    each = sorted(
        {
            f"{row['driver_used_gb'] / row['replicas']:.2f}"
            for row in at_most
            if row["driver_used_gb"]
        }
    )
    held = f"~{'–'.join(each)} GB of the card" if each else "its share of the card"
    return [
        "## What the figures say",
        "",
        f"At {most} clients the batches held {batches} and the p99 was {p99s}, by replica "
        f"count; each replica holds {held} (its CUDA context, weights and allocator cache). "
        "One process's forward takes turns at the GIL "
        "with its event loop; replicas each have a GIL of their own, and their smaller batches "
        "share the GPU by time slices, so the gain falls off as replicas are added.",
        "",
    ]


def comparison(rows: list[dict[str, Any]]) -> list[str]:
    """Each replica count's best throughput against one replica's best."""
    best: dict[int, float] = {}
    for row in rows:
        best[row["replicas"]] = max(best.get(row["replicas"], 0.0), row["texts_per_s"])
    if 1 not in best or not best[1]:
        return []
    parts = [f"{n}: {rate:,.1f} texts/s ({rate / best[1]:.2f}×)" for n, rate in best.items()]
    return [f"Best throughput per replica count, against one replica: {'; '.join(parts)}."]


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n")[0]
    plans = (FULL, SMOKE)
    return gpu_cli.main(argv, "bench.gpu_replicas", summary, REPORT_NAME, plans, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
