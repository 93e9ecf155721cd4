"""Where fresh one-text requests wait at 64 clients: the machine's idle share, each server
process's event loop (the CPU it ran, and how long it was ready to run but waited for a core)
and its other threads, in one process and in the split, in the same rounds.

Run: `python -m bench.split_waits` (or `make bench-split-waits`); `--quick` is a smoke run of
one short round that writes into bench/out/split-waits-quick/ instead. It needs `wrk`. Writes
bench/reports/split_waits.{md,json}.

Each round starts, in turns, with `make bench-frontend`'s simulated model and the default
caches: one process and the split as `make bench-split-served` starts them, and the split
with `MAX_BATCH_SIZE=16` on its model side (batches of half the clients). In each: a /health
run, then fresh one-text /predict from 64 wrk connections, over which it reads:

- /proc/stat: the share of the machine's cores idle over the run;
- /proc/<pid>/task/<pid>/stat and schedstat, for each server process's main thread (its event
  loop): the cores it ran on average, and the share of the run it was runnable but waiting
  for a core (the kernel's run-queue time);
- /proc/<pid>/stat: the process's other threads together (the batch worker, the disk
  writer), in cores.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.frontend import CLIENTS
from bench.harness import (
    FRESH_LUA,
    busy_cpu_seconds,
    fresh_env,
    per_second,
    process_cpu_seconds,
    wrk,
)
from bench.split_served import (
    SEE_SCALING,
    Layouts,
    layouts_report_head,
    main_of,
    run_layouts,
    warmed_health_rate,
)

CORES = os.cpu_count() or 1  # /proc/stat's first line counts every online core
BOUND_LOOP_CORES = 0.9  # a loop that runs this much of a core is what bounds its process

LAYOUTS: Layouts = {
    "one process": (False, {}),
    "split": (True, {}),
    "split, MAX_BATCH_SIZE=16": (True, {"MAX_BATCH_SIZE": "16"}),
}


@dataclass(frozen=True)
class Reading:
    """Cumulative seconds at one moment: every core's time not idle; per server process, its
    event loop's time on a core and waiting for one, and all its threads' CPU."""

    busy: float
    loops: tuple[tuple[float, float], ...]
    processes: tuple[float, ...]


def read(pids: tuple[int, ...]) -> Reading:
    loops = []
    for pid in pids:
        ran_ns, waited_ns, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
        loops.append((int(ran_ns) / 1e9, int(waited_ns) / 1e9))
    return Reading(
        busy=busy_cpu_seconds(),
        loops=tuple(loops),
        processes=tuple(process_cpu_seconds(pid) for pid in pids),
    )


@dataclass(frozen=True)
class Round:
    """One layout's /health and fresh /predict in one round; per server process (the one
    process, or the split's front end then its model side): its loop's cores and share of
    the run waiting for a core, and its other threads' cores."""

    health_rps: float
    predict_rps: float
    ratio: float
    statuses: dict[str, int]
    machine_idle: float
    loop_cores: list[float]
    loop_waiting: list[float]
    other_threads_cores: list[float]


def measure(url: str, pids: tuple[int, ...], seconds: float, texts: Path) -> Round:
    """Warm-ups, then a /health run and a fresh /predict run, read over the latter."""
    health_rps = warmed_health_rate(url, seconds, texts)
    before, started = read(pids), time.monotonic()
    predict = wrk(url, CLIENTS, seconds, FRESH_LUA, fresh_env(texts))
    after, wall = read(pids), time.monotonic() - started
    predict_rps = per_second(predict)
    ran = [(a[0] - b[0]) / wall for a, b in zip(after.loops, before.loops, strict=True)]
    waited = [(a[1] - b[1]) / wall for a, b in zip(after.loops, before.loops, strict=True)]
    process = [(a - b) / wall for a, b in zip(after.processes, before.processes, strict=True)]
    return Round(
        health_rps=round(health_rps, 1),
        predict_rps=round(predict_rps, 1),
        ratio=round(predict_rps / health_rps, 3),
        statuses=predict["statuses"],
        # /proc/stat counts in ticks: a fully busy run can read a tick over its wall time.
        machine_idle=round(max(0.0, 1 - (after.busy - before.busy) / (wall * CORES)), 3),
        loop_cores=[round(r, 3) for r in ran],
        loop_waiting=[round(w, 3) for w in waited],
        # A process's stat counts in clock ticks, its loop's schedstat in ns: never below 0.
        other_threads_cores=[round(max(0.0, p - r), 3) for p, r in zip(process, ran, strict=True)],
    )


def run(seconds: float, rounds: int, quick: bool) -> dict[str, Any]:
    return run_layouts("split-waits", LAYOUTS, measure, medians, seconds, rounds, quick)


def medians(runs: list[Round]) -> dict[str, Any]:
    def median(values: list[float]) -> float:
        return round(statistics.median(values), 3)

    processes = len(runs[0].loop_cores)
    return {
        "ratio": median([r.ratio for r in runs]),
        "predict_rps": median([r.predict_rps for r in runs]),
        "machine_idle": median([r.machine_idle for r in runs]),
        "loop_cores": [median([r.loop_cores[i] for r in runs]) for i in range(processes)],
        "loop_waiting": [median([r.loop_waiting[i] for r in runs]) for i in range(processes)],
        "other_threads_cores": [
            median([r.other_threads_cores[i] for r in runs]) for i in range(processes)
        ],
    }


def per_process(values: list[float]) -> str:
    """One value (one process), or the front end's / the model side's."""
    return " / ".join(str(v) for v in values)


def report(result: dict[str, Any]) -> str:
    lines = layouts_report_head(
        result,
        "Where one-text requests wait: one process and the split",
        "`make bench-split-waits` (bench/split_waits.py), which says what each figure reads.",
        f"`make bench-frontend`'s simulated model, default caches; {result['clients']} wrk "
        f"connections, {result['seconds_per_run']} s a run; /health, then fresh one-text "
        "/predict, over which the figures are read; the layouts started afresh in each round, "
        "in turns. Per server process (the one process, or the split's front end / model "
        "side): its event loop's cores, the share of the run its loop was ready to run but "
        "waited for a core, and its other threads' cores.",
        [
            ("machine idle", lambda r: r["machine_idle"]),
            ("loop cores", lambda r: per_process(r["loop_cores"])),
            ("loop waiting for a core", lambda r: per_process(r["loop_waiting"])),
            ("other threads' cores", lambda r: per_process(r["other_threads_cores"])),
        ],
    )
    lines += [
        "",
        "Medians of the rounds:",
        "",
        "| layout | ratio | /predict req/s | machine idle | loop cores | loop waiting for a core "
        "| other threads' cores |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for layout, md in result["medians"].items():
        lines.append(
            f"| {layout} | **{md['ratio']}** | {md['predict_rps']:,.0f} | {md['machine_idle']} "
            f"| {per_process(md['loop_cores'])} | {per_process(md['loop_waiting'])} "
            f"| {per_process(md['other_threads_cores'])} |"
        )
    return "\n".join(lines + reading(result["medians"]) + SEE_SCALING) + "\n"


def reading(medians: dict[str, dict[str, Any]]) -> list[str]:
    """What the medians say of each layout: whether its loop is the limit, how much of the
    machine idles, how long its loops waited for a core."""
    lines = ["", "## What the figures say", ""]
    for layout, md in medians.items():
        idle = f"{md['machine_idle']:.0%} of the machine idled"
        if len(md["loop_cores"]) == 1:
            bound = ": its loop is the limit" if md["loop_cores"][0] >= BOUND_LOOP_CORES else ""
            lines.append(
                f"- **{layout}**: its event loop ran {md['loop_cores'][0]} of a core and waited "
                f"for one {md['loop_waiting'][0]:.0%} of the time, while {idle}{bound}."
            )
            continue
        front, model = md["loop_cores"]
        front_waits, model_waits = (f"{w:.0%}" for w in md["loop_waiting"])
        lines.append(
            f"- **{layout}**: the front end's loop ran {front} of a core and the model side's "
            f"{model}, {idle}, and yet the loops waited for a core {front_waits} and "
            f"{model_waits} of the time."
        )
    lines += [
        "",
        "Where loops wait for a core while cores idle, the work comes in bursts: most likely a "
        "batch's answers wake the model side, the front end and wrk at once, which then wait "
        "together for the next batch.",
    ]
    return lines


def main() -> None:
    main_of("split_waits", __doc__.split("\n\n")[0], run, report, seconds=8.0)


if __name__ == "__main__":
    main()
