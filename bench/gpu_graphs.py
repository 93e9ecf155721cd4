"""CUDA graphs on one GPU: KoELECTRA's forward and one-text requests, eager against graphed.

KoELECTRA-small's forward is bound by launching its kernels from Python: 7.3-9.0 ms on an H200
at every shape from 1 x 128 to 32 x 512 tokens (bench/reports/gpu.md), and longer in the
server, where the batch worker waits for the GIL between launches while the event loop holds
it. CUDA_GRAPHS records each bucket's forward once and replays it in one launch
(api/models/cuda_graphs.py). This measures what that gives, both ways in one run:

1. `Predictor.forward` (what the batch worker calls: ids from the host, scores back) in this
   process, eager and graphed, at 1/8/32 texts of 128 and 512 tokens, with the largest logit
   difference between the two;
2. the real server (`python -m api.cli`, the users' settings, caches off) started with
   CUDA_GRAPHS=false, then true, driven by closed-loop clients that send one 128-token text a
   request at 1-128 clients: texts/s, p50/p99, the mean batch and its forward time.

Run on a machine with one NVIDIA GPU, from the repository root: `python -m bench.gpu_graphs`
writes bench/reports/gpu-graphs.{md,json}. `--smoke` runs the same code on tiny shapes on
whatever device there is (on a CPU no model records graphs: both ways run eagerly), into
bench/out; the test suite runs it so that this path cannot rot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from api.models.loader import load_model
from api.models.predictor import Predictor, Scores
from api.models.spec import load_models_file
from api.settings import load_settings
from bench import gpu, gpu_cli, gpu_forward, gpu_load, gpu_replicas
from bench.gpu_cli import tenths
from bench.gpu_models import TINY, USERS, Shapes, texts

REPORT_NAME = "gpu-graphs"
MODEL = gpu.KOELECTRA
BATCH_SIZES = (1, 8, 32)


@dataclass(frozen=True)
class Plan:
    shapes: Shapes
    lengths: tuple[int, int]  # tokens a text: the load's, and the longest the forward runs
    clients: tuple[int, ...]
    seconds: float
    warmup: float
    repeats: int


FULL = Plan(USERS, (128, 512), clients=(1, 32, 64, 128), seconds=6.0, warmup=2.0, repeats=20)
SMOKE = Plan(TINY, (32, 64), clients=(4,), seconds=1.0, warmup=0.2, repeats=3)


def forward_rows(
    models: Path, env: dict[str, str], corpus: dict[int, list[str]], repeats: int
) -> dict[str, Any]:
    """`Predictor.forward`'s median milliseconds, eager and graphed, at each (tokens, texts),
    and the largest logit difference between the two ways."""
    (spec,) = load_models_file(models)
    settings = load_settings(_env_file=None, **{name.lower(): v for name, v in env.items()})
    eager = Predictor(load_model(spec, settings))
    graphed = Predictor(load_model(spec, settings))
    graphs_on = graphed.enable_cuda_graphs(max(BATCH_SIZES))
    adapter = spec.adapters[0].name
    rows = []
    for tokens, made in corpus.items():
        for size in BATCH_SIZES:
            ids = eager.encode(made[:size])
            adapters: list[str | None] = [adapter] * size
            eager_ms = gpu_forward.timed(partial(eager.forward, ids, list(adapters)), repeats)
            graphed_ms = gpu_forward.timed(partial(graphed.forward, ids, list(adapters)), repeats)
            rows.append(
                {
                    "tokens": tokens,
                    "texts": size,
                    "eager_ms": eager_ms,
                    "graphed_ms": graphed_ms,
                    "max_logit_difference": _difference(
                        eager.forward(ids, list(adapters)), graphed.forward(ids, list(adapters))
                    ),
                }
            )
    graphs = graphed.cuda_graphs
    return {
        "enabled": graphs_on,
        "recorded": graphs.recorded if graphs else 0,
        "failure": graphs.failure if graphs else None,
        "rows": rows,
    }


def _difference(eager: list[Any], graphed: list[Any]) -> float:
    """The largest logit difference of the same rows scored both ways; NaN where a row has
    no finite scores."""
    pairs = list(zip(eager, graphed, strict=True))
    if not all(isinstance(a, Scores) and isinstance(b, Scores) for a, b in pairs):
        return float("nan")
    return max(abs(x - y) for a, b in pairs for x, y in zip(a.logits, b.logits, strict=True))


def served_rows(
    plan: Plan, env: dict[str, str], corpus: list[str], work: Path
) -> list[dict[str, Any]]:
    """One server with CUDA_GRAPHS=false, then one with true: each client count's load."""
    rows: list[dict[str, Any]] = []
    for graphs in (False, True):
        log = work / f"server-graphs-{str(graphs).lower()}.log"
        with gpu_load.server({**env, "CUDA_GRAPHS": str(graphs).lower()}, log) as started:
            listed = started.models[MODEL]
            for clients in plan.clients:
                (before,) = gpu_replicas.batches([started.url])
                point = gpu_load.load(
                    started.url, MODEL, corpus, clients, plan.seconds, plan.warmup
                )
                (after,) = gpu_replicas.batches([started.url])
                ran = {name: after[name] - before[name] for name in after}
                count = ran["loraserve_batch_size_count"]
                rows.append(
                    {
                        "cuda_graphs": graphs,
                        "listed_cuda_graphs": listed["cuda_graphs"],
                        "ready_s": started.ready_s,
                        **point,
                        "mean_batch_texts": ran["loraserve_batch_size_sum"] / count
                        if count
                        else None,
                        "mean_batch_ms": 1000 * ran["loraserve_batch_inference_seconds_sum"] / count
                        if count
                        else None,
                    }
                )
            memory = gpu_load.gpu_memory(started.url)
        warnings = [line for line in log.read_text().splitlines() if "CUDA graphs off" in line]
        for row in rows:
            if row["cuda_graphs"] is graphs:
                row.update(memory=memory, graph_warnings=warnings)
    return rows


def run(plan: Plan, work: Path, smoke: bool) -> dict[str, Any]:
    began = time.perf_counter()
    device, base, adapter = gpu_cli.koelectra(work, plan.shapes)
    short, longest = plan.lengths
    corpus = {tokens: texts(base, tokens, 64, seed=tokens) for tokens in plan.lengths}
    models = gpu_replicas.models_file(work / "models.yaml", base, adapter, longest)
    env = gpu.server_env(work, models, device, longest)
    forward = forward_rows(models, env, corpus, plan.repeats)
    if device == "cuda":
        torch.cuda.empty_cache()
    served = served_rows(plan, env, corpus[short], work)
    meta = gpu_cli.meta("bench.gpu_graphs", device, smoke, plan, began)
    return {"meta": meta, "forward": forward, "served": served}


def markdown(report: dict[str, Any]) -> str:
    """The report's page: the device, the forward both ways, then the served load."""
    meta, forward, served = report["meta"], report["forward"], report["served"]
    device = gpu_cli.device_named(meta)
    plan = meta["plan"]
    short = plan["lengths"][0]
    lines = [
        "# CUDA graphs on one GPU: KoELECTRA",
        "",
        f"Device: {device}; Python {meta['python']}; torch {meta['versions']['torch']}, "
        f"transformers {meta['versions']['transformers']}. {meta['date']}. Made by "
        f"`{meta['command']}` in {meta['wall_s'] / 60:.1f} min; raw figures in "
        f"{REPORT_NAME}.json.",
        "",
        "KoELECTRA-small-v3-discriminator's shapes in bf16 with a LoRA adapter (random "
        "weights, merged at load as the server does), as the users declare it.",
        "",
        "## The forward",
        "",
        f"`Predictor.forward` in the benchmark's own process (ids from the host, scores back), "
        f"median of {plan['repeats']} after two warm-ups, the device synchronized after each. "
        f"graphed: CUDA graphs on (the batch padded to its bucket and replayed; the first call "
        f"of a bucket records it and is a warm-up). Graphs recorded: {forward['recorded']}"
        + (f"; recording failed: {forward['failure']}" if forward["failure"] else "")
        + ("" if forward["enabled"] else "; not enabled on this device")
        + ".",
        "",
        "| tokens | texts | eager ms | graphed ms | eager / graphed | max logit difference |",
        "|---|---|---|---|---|---|",
    ]
    for row in forward["rows"]:
        lines.append(
            f"| {row['tokens']} | {row['texts']} | {row['eager_ms']:.2f} "
            f"| {row['graphed_ms']:.2f} | {row['eager_ms'] / row['graphed_ms']:.1f}× "
            f"| {row['max_logit_difference']:.3g} |"
        )
    lines += [
        "",
        "## Served, one text a request",
        "",
        f"The real server, MAX_MEMORY_GB=16, caches off, ADMISSION_CONTROL=false, started "
        f"once with CUDA_GRAPHS=false and once with true (in brackets: what `/models` said of "
        f"`cuda_graphs`). Closed-loop clients (in processes of at most 16) send one "
        f"{short}-token text a request; {plan['seconds']:g} s a point after "
        f"{plan['warmup']:g} s of warm-up. "
        f"batch: the mean batch over the point (texts, and its forward in ms, as "
        f"`loraserve_batch_inference_seconds` times it). GPU reserved: torch's, after the "
        f"points.",
        "",
        "| CUDA_GRAPHS (/models) | clients | texts/s | p50 ms | p99 ms | statuses | batch texts "
        "| batch ms | GPU reserved GB | ready s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in served:
        statuses = ", ".join(f"{code}: {n}" for code, n in row["statuses"].items())
        reserved = row["memory"]["reserved_gb"]
        lines.append(
            f"| {str(row['cuda_graphs']).lower()} "
            f"({'on' if row['listed_cuda_graphs'] else 'off'}) | {row['clients']} "
            f"| {row['texts_per_s']:,.1f} | {tenths(row['p50_ms'])} | {tenths(row['p99_ms'])} "
            f"| {statuses} | {tenths(row['mean_batch_texts'])} "
            f"| {tenths(row['mean_batch_ms'])} "
            f"| {'—' if reserved is None else f'{reserved:.2f}'} | {row['ready_s']:.1f} |"
        )
    lines += ["", *comparison(served)]
    warnings = {w for row in served for w in row["graph_warnings"]}
    lines += [f"- server log: `{warning}`" for warning in sorted(warnings)]
    if not meta["smoke"]:
        lines += ([""] if lines[-1] else []) + reading(forward["rows"], served, short)
    return "\n".join([*lines, ""])


def reading(rows: list[dict[str, Any]], served: list[dict[str, Any]], short: int) -> list[str]:
    """What the run says: the logits both ways, the served batch against the forward alone,
    the batches' size, and the memory graphs take."""
    largest = max(abs(row["max_logit_difference"]) for row in rows)
    same = "the same to the bit" if largest == 0 else f"at most {largest:.3g} apart"
    alone = {
        way: [row[f"{way}_ms"] for row in rows if row["tokens"] == short]
        for way in ("eager", "graphed")
    }
    loaded = {
        graphs: [row for row in served if row["cuda_graphs"] is graphs and row["clients"] > 1]
        for graphs in (False, True)
    }

    def spread(values: list[float]) -> str:
        return f"{min(values):.1f}–{max(values):.1f}"

    batch_ms = {graphs: [row["mean_batch_ms"] for row in loaded[graphs]] for graphs in loaded}
    first = {graphs: loaded[graphs][0] for graphs in loaded}
    reserved = {
        graphs: max(row["memory"]["reserved_gb"] or 0.0 for row in loaded[graphs])
        for graphs in loaded
    }
    return [
        "## What the figures say",
        "",
        f"- The logits were {same} both ways, at every shape.",
        f"- Under load the served batch took {spread(batch_ms[False])} ms eagerly, against "
        f"{spread(alone['eager'])} ms for the forward alone: between its kernel launches the "
        "inference thread waits for the GIL. Graphed, "
        f"{spread(batch_ms[True])} ms against {spread(alone['graphed'])}.",
        f"- With graphs the batches are smaller at the same clients "
        f"({first[True]['mean_batch_texts']:.1f} texts at {first[True]['clients']} clients, "
        f"against {first[False]['mean_batch_texts']:.1f}), as each client's next text comes "
        "sooner: the event loop, not the device, is the limit again.",
        f"- Graphs cost {reserved[True] - reserved[False]:.2f} GB more of torch's reserve "
        f"({reserved[True]:.2f} against {reserved[False]:.2f} GB).",
    ]


def comparison(served: list[dict[str, Any]]) -> list[str]:
    """Graphed texts/s over eager at each client count."""
    rates: dict[tuple[bool, int], float] = {
        (row["cuda_graphs"], row["clients"]): row["texts_per_s"] for row in served
    }
    parts = [
        f"{clients} clients {rates[True, clients] / rates[False, clients]:.2f}×"
        for (graphs, clients) in rates
        if graphs and rates.get((False, clients))
    ]
    return [f"Texts/s with CUDA graphs on, against off: {', '.join(parts)}.", ""] if parts else []


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n")[0]
    plans = (FULL, SMOKE)
    return gpu_cli.main(argv, "bench.gpu_graphs", summary, REPORT_NAME, plans, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
