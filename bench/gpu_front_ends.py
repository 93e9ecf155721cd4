"""Front ends on one GPU: do more `loraserve front-end` processes before one model side feed
the device more one-text requests a second, and how close do they come to the forward's own
rate?

One process serves a one-text request on one event loop, which also runs the batches: on an
H200 KoELECTRA-small's forward of 32 texts takes ~13 ms, so the loop, not the GPU, sets the
pace (bench/reports/gpu-replicas.md). The split (docs/scaling.md) moves HTTP into front-end
processes of their own, and FRONT_ENDS of them may answer one port before one model side:
the model side keeps one copy of the model and makes the batches, while the front ends
share the HTTP work between them.

Run on a machine with one NVIDIA GPU, from the repository root: `python -m bench.gpu_front_ends`
builds KoELECTRA-small-v3-discriminator's shapes with a LoRA adapter (random weights, as
bench.gpu does), then, in turns:

- **one process**: the real server (`python -m api.cli`), the users' settings, caches off;
- **split, n front ends** (1, 2, 4): the same command with SPLIT_FRONT_END=true and
  FRONT_ENDS=n: the model side, and n `loraserve front-end` children on its port;

and drives each with closed-loop clients, one 128-token text a request, at 64 and 256
clients. Over each point's counted seconds it reads the model side's batches from /metrics
and each process's CPU from /proc. Once the servers are stopped, it times the forward of a
full batch in its own process (`Predictor.forward`, as the batch worker calls it): the rate
no server can pass. It writes bench/reports/gpu-front-ends.{md,json}. `--smoke` runs the
same code on tiny shapes on whatever device there is, into bench/out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from api.models.spec import load_models_file
from api.settings import load_settings
from bench import gpu, gpu_cli, gpu_forward, gpu_load, gpu_replicas
from bench.gpu_cli import tenths
from bench.gpu_models import TINY, USERS, Shapes, texts
from bench.harness import process_cpu_seconds

REPORT_NAME = "gpu-front-ends"
MODEL = gpu.KOELECTRA
ONE_PROCESS = 0  # a layout's front-end count that means the service in one process, no split


@dataclass(frozen=True)
class Plan:
    shapes: Shapes
    tokens: int
    front_ends: tuple[int, ...]  # ONE_PROCESS: no split
    clients: tuple[int, ...]
    seconds: float
    warmup: float
    forward_repeats: int


FULL = Plan(
    USERS,
    tokens=128,
    front_ends=(ONE_PROCESS, 1, 2, 4),
    clients=(64, 256),
    seconds=8.0,
    warmup=2.0,
    forward_repeats=20,
)
SMOKE = Plan(
    TINY,
    tokens=32,
    front_ends=(ONE_PROCESS, 2),
    clients=(4,),
    seconds=1.0,
    warmup=0.2,
    forward_repeats=2,
)


@dataclass
class Layout:
    """The URL the clients ask, the pid of the process holding the model, and the front
    ends' pids (none for one process)."""

    url: str
    model_pid: int
    front_end_pids: list[int]


@contextmanager
def layout(front_ends: int, env: dict[str, str], work: Path) -> Iterator[Layout]:
    """One process, or the split with one command (SPLIT_FRONT_END=true) and FRONT_ENDS
    front ends on its port, started and ready; stopped at the end."""
    if front_ends == ONE_PROCESS:
        with gpu_load.server(env, work / "one-process.log") as one:
            yield Layout(one.url, one.pid, [])
        return
    split_env = {**env, "SPLIT_FRONT_END": "true", "FRONT_ENDS": str(front_ends)}
    with gpu_load.server(split_env, work / f"split-{front_ends}.log") as split:
        children = Path(f"/proc/{split.pid}/task/{split.pid}/children").read_text().split()
        yield Layout(split.url, split.pid, [int(pid) for pid in children])


def sample(where: Layout) -> dict[str, Any]:
    """The model side's batch counters and every process's CPU seconds, now."""
    return {
        "at": time.perf_counter(),
        # The model side's families, through a front end's /metrics where there are some.
        "batches": gpu_load.metric_sums(where.url, gpu_replicas.BATCH_METRICS, model=MODEL),
        "model_cpu_s": process_cpu_seconds(where.model_pid),
        "front_end_cpu_s": [process_cpu_seconds(pid) for pid in where.front_end_pids],
    }


class CountedWindow:
    """Two samples, at the start and the end of a load point's counted seconds, taken in a
    thread while the point runs (so its spawn and warm-up are not in them)."""

    def __init__(self, take: Callable[[], dict[str, Any]], starts_in: float, lasts: float):
        self.samples: list[dict[str, Any]] = []
        self.thread = threading.Thread(target=self._run, args=(take, starts_in, lasts))
        self.thread.start()

    def _run(self, take: Callable[[], dict[str, Any]], starts_in: float, lasts: float) -> None:
        time.sleep(starts_in)
        self.samples.append(take())
        time.sleep(lasts)
        self.samples.append(take())

    def figures(self) -> dict[str, Any]:
        """Over the window: the model side's batches, its share of the time in forwards,
        and each process's cores (CPU seconds a second)."""
        self.thread.join()
        first, last = self.samples
        wall = last["at"] - first["at"]
        ran = {name: last["batches"][name] - first["batches"][name] for name in first["batches"]}
        batches = ran["loraserve_batch_size_count"]
        forward_s = ran["loraserve_batch_inference_seconds_sum"]
        return {
            "window_s": wall,
            "mean_batch_texts": ran["loraserve_batch_size_sum"] / batches if batches else None,
            "mean_batch_ms": 1000 * forward_s / batches if batches else None,
            "device_busy": forward_s / wall,
            "model_cores": (last["model_cpu_s"] - first["model_cpu_s"]) / wall,
            "front_end_cores": [
                (after - before) / wall
                for before, after in zip(
                    first["front_end_cpu_s"], last["front_end_cpu_s"], strict=True
                )
            ],
        }


def measure(plan: Plan, env: dict[str, str], corpus: list[str], work: Path) -> list[dict[str, Any]]:
    """Every layout's load points, the layouts in turn."""
    rows: list[dict[str, Any]] = []
    for front_ends in plan.front_ends:
        with layout(front_ends, env, work) as where:
            for clients in plan.clients:
                window = CountedWindow(
                    lambda: sample(where), gpu_load.SPAWN_S + plan.warmup, plan.seconds
                )
                point = gpu_load.load(where.url, MODEL, corpus, clients, plan.seconds, plan.warmup)
                rows.append({"front_ends": front_ends, **point, **window.figures()})
    return rows


def forward_rate(
    plan: Plan, env: dict[str, str], models: Path, corpus: list[str]
) -> dict[str, Any]:
    """A full batch's `Predictor.forward` in this process, as the server's batch worker runs
    it (CUDA graphs where it would replay them): its median time and texts a second."""
    settings = load_settings(_env_file=None, **{name.lower(): v for name, v in env.items()})
    (spec,) = load_models_file(models)
    size = settings.max_batch_size
    (row,) = gpu_forward.model_times(
        spec, settings, {plan.tokens: corpus}, (size,), plan.forward_repeats
    )
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {
        "texts": size,
        "predictor_ms": row["predictor_ms"],
        "model_ms": row["model_ms"],
        "graphed": row["predictor_graphed"],
        "texts_per_s": size * 1000 / row["predictor_ms"],
    }


def run(plan: Plan, work: Path, smoke: bool) -> dict[str, Any]:
    began = time.perf_counter()
    device, base, adapter = gpu_cli.koelectra(work, plan.shapes)
    corpus = texts(base, plan.tokens, 64, seed=plan.tokens)
    models = gpu_replicas.models_file(work / "models.yaml", base, adapter, plan.tokens)
    env = gpu.server_env(work, models, device, plan.tokens)
    rows = measure(plan, env, corpus, work)
    forward = forward_rate(plan, env, models, corpus)  # the servers have stopped
    meta = gpu_cli.meta("bench.gpu_front_ends", device, smoke, plan, began)
    return {"meta": meta, "cpus": os.cpu_count(), "forward": forward, "rows": rows}


def layout_name(front_ends: int) -> str:
    if front_ends == ONE_PROCESS:
        return "one process"
    return f"split, {front_ends} front end{'s' if front_ends > 1 else ''}"


def markdown(report: dict[str, Any]) -> str:
    """The report's page: the device, the forward's own rate, then each layout's points."""
    meta, rows, forward = report["meta"], report["rows"], report["forward"]
    device = gpu_cli.device_named(meta)
    plan = meta["plan"]
    rate = forward["texts_per_s"]
    lines = [
        "# Front ends on one GPU: KoELECTRA, one text a request",
        "",
        f"Device: {device}; {report['cpus']} CPUs; Python {meta['python']}; torch "
        f"{meta['versions']['torch']}, transformers {meta['versions']['transformers']}. "
        f"{meta['date']}. Made by `{meta['command']}` in {meta['wall_s'] / 60:.1f} min; raw "
        f"figures in {REPORT_NAME}.json.",
        "",
        f"The forward's own rate: `Predictor.forward` of {forward['texts']} texts of "
        f"{plan['tokens']} tokens (the server's largest batch) in the benchmark's own process, "
        f"{'replayed as a CUDA graph, ' if forward['graphed'] else ''}median of "
        f"{plan['forward_repeats']}: {forward['predictor_ms']:.1f} ms, **{rate:,.0f} texts/s**. "
        f"No server can pass it.",
        "",
        f"Each layout is the real server with KoELECTRA-small's shapes in bf16 and a LoRA "
        f"adapter (random weights), the users' settings, caches off, ADMISSION_CONTROL=false: "
        f"one process, or the split with one command (SPLIT_FRONT_END=true, FRONT_ENDS=n): the "
        f"model side and n front ends on one port, the kernel spreading the connections over "
        f"them. Closed-loop clients (in processes of at most 16, on the same machine) send one "
        f"{plan['tokens']}-token text a request; {plan['seconds']:g} s a point after "
        f"{plan['warmup']:g} s of warm-up. "
        f"of forward: texts/s against the forward's own rate. busy: the model side's time in "
        f"forwards over the point. batch: its mean batch (texts, ms). cores: CPU seconds a "
        f"second, from /proc, of the process holding the model and of each front end.",
        "",
        "| layout | clients | texts/s | of forward | p50 ms | p99 ms | statuses | busy "
        "| batch texts | batch ms | model process cores | front-end cores |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        statuses = ", ".join(f"{code}: {n}" for code, n in row["statuses"].items())
        fronts = ", ".join(f"{cores:.2f}" for cores in row["front_end_cores"]) or "—"
        lines.append(
            f"| {layout_name(row['front_ends'])} | {row['clients']} "
            f"| {row['texts_per_s']:,.1f} | {row['texts_per_s'] / rate:.2f} "
            f"| {tenths(row['p50_ms'])} | {tenths(row['p99_ms'])} | {statuses} "
            f"| {row['device_busy']:.2f} | {tenths(row['mean_batch_texts'])} "
            f"| {tenths(row['mean_batch_ms'])} | {row['model_cores']:.2f} | {fronts} |"
        )
    lines += ["", *comparison(rows, rate), ""]
    if not meta["smoke"]:
        lines += reading(rows)
    return "\n".join(lines)


def reading(rows: list[dict[str, Any]]) -> list[str]:
    """What the most and the fewest clients show: where one process and one front end stand
    against a core, and the best layout's gain."""
    most, fewest = max(r["clients"] for r in rows), min(r["clients"] for r in rows)
    at = {(r["front_ends"], r["clients"]): r for r in rows}
    one, split_one = at[(ONE_PROCESS, most)], at[(1, most)]
    best = max((r for r in rows if r["clients"] == most), key=lambda r: r["texts_per_s"])
    few = [r["texts_per_s"] for r in rows if r["clients"] == fewest]
    split_cores = max(
        max([r["model_cores"], *r["front_end_cores"]])
        for r in rows
        if r["clients"] == fewest and r["front_ends"] != ONE_PROCESS
    )
    return [
        "## What the figures say",
        "",
        f"At {most} clients one process served {one['texts_per_s']:,.0f} texts/s at "
        f"{one['model_cores']:.2f} cores: its one event loop reads the requests and makes the "
        f"batches. With its HTTP in a front end of its own the split served "
        f"{split_one['texts_per_s']:,.0f} ({split_one['texts_per_s'] / one['texts_per_s']:.2f}×), "
        f"that front end at {max(split_one['front_end_cores']):.2f} cores, near the one core a "
        f"Python process has; {layout_name(best['front_ends'])} served the most, "
        f"{best['texts_per_s']:,.0f} ({best['texts_per_s'] / one['texts_per_s']:.2f}×), the "
        f"device busy {best['device_busy']:.2f} of the time.",
        "",
        f"At {fewest} clients every layout served {min(few):,.0f}–{max(few):,.0f} texts/s, and "
        f"none of the split's processes passed {split_cores:.2f} cores: there the client "
        f"processes, not the split, set the pace.",
        "",
    ]


def comparison(rows: list[dict[str, Any]], rate: float) -> list[str]:
    """Each layout's best throughput, against one process's and the forward's."""
    best: dict[int, float] = {}
    for row in rows:
        best[row["front_ends"]] = max(best.get(row["front_ends"], 0.0), row["texts_per_s"])
    one = best.get(ONE_PROCESS)
    if not one:
        return []
    parts = [
        f"{layout_name(n)}: {served:,.1f} texts/s ({served / one:.2f}× one process, "
        f"{served / rate:.2f} of the forward)"
        for n, served in best.items()
    ]
    return [f"Best throughput by layout: {'; '.join(parts)}."]


def main(argv: list[str] | None = None) -> int:
    summary = (__doc__ or "").split("\n")[0]
    plans = (FULL, SMOKE)
    return gpu_cli.main(argv, "bench.gpu_front_ends", summary, REPORT_NAME, plans, run, markdown)


if __name__ == "__main__":
    raise SystemExit(main())
