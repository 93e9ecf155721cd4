"""The service's front-end/model split served end to end, beside the service in one process
in the same rounds: does the split reach `/predict` at 0.6 of `/health` here?

Run: `python -m bench.split_served` (or `make bench-split-served`); `--quick` is a smoke run
of one short round that writes into bench/out/split-served-quick/ instead. It needs `wrk`.
Writes bench/reports/split_served.{md,json}.

Each round starts, in turns, with the simulated model of `make bench-frontend` and its
settings (bench/frontend.py):

- **one process**: the real server (`python -m api.cli`), as `make bench-frontend` runs it;
- **split**: the split as the service runs it (api/http/split): `loraserve` with SPLIT_SOCKET
  (the model side: the models, the cache tiers, admission, the batcher, and every route but
  /predict and /health) and `loraserve front-end` on the same socket (HTTP, and /predict's
  lifecycle up to `classify`, which the model side does).

Each layout runs with the disk tier on (the default: it writes repeated texts alone) and off
(`DISK_CACHE_MAX_BYTES=0` for the process that serves the model), and the split also with the
disk tier writing every text (`DISK_CACHE_ADMISSION=every`), five in all, in an order that
rotates each round. In each: `/health`, then fresh one-text `/predict` (texts never sent
before), 64 wrk connections; the ratio of the two rates, `/predict`'s p99, the CPU a request
of the front end (or of the one process) and of the model side, and the bytes the process
that serves the model wrote to storage a request, from /proc.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from bench.frontend import CLIENTS, TARGET_RATIO, served, warm_ups, write_models_file
from bench.harness import (
    FRESH_LUA,
    HEALTH_LUA,
    WORK,
    add_out,
    fresh_env,
    host,
    in_turns,
    machine_line,
    out_folder,
    per_second,
    process_cpu_seconds,
    quiet_start,
    run_head,
    sample_texts,
    warm_up,
    write_literals,
    write_report,
    wrk,
)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

LOAD_WAIT_SECONDS = 900
DISK_TIER_OFF = {"DISK_CACHE_MAX_BYTES": "0"}
EVERY_TEXT = {"DISK_CACHE_ADMISSION": "every"}
# Each layout: split or not, and the settings of the process that serves the model.
Layouts = dict[str, tuple[bool, dict[str, str]]]
Measured = TypeVar("Measured", bound="DataclassInstance")
LAYOUTS: Layouts = {
    "one process": (False, {}),
    "split": (True, {}),
    "one process, disk tier off": (False, DISK_TIER_OFF),
    "split, disk tier off": (True, DISK_TIER_OFF),
    "split, disk tier writes every text": (True, EVERY_TEXT),
}


# --- the measurement ----------------------------------------------------------------------


@dataclass(frozen=True)
class Round:
    """One layout's /health and fresh /predict in one round."""

    health_rps: float
    predict_rps: float
    ratio: float
    p99_ms: float
    statuses: dict[str, int]
    front_cpu_us: float  # a /predict: the one process, or the split's front end
    model_side_cpu_us: float  # a /predict: the split's model side (0 in one process)
    disk_write_kib: float  # a /predict: written to storage by the process serving the model


def written_bytes(pid: int) -> int:
    """Bytes a process has written to storage, through the page cache included."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "write_bytes":
            return int(value)
    raise LookupError(f"/proc/{pid}/io has no write_bytes")


def measure(url: str, pids: tuple[int, ...], seconds: float, texts: Path) -> Round:
    """Warm-ups, then a /health run and a fresh /predict run; `pids`: the one process, or the
    split's front end and model side."""
    health_rps = warmed_health_rate(url, seconds, texts)
    serving_model = pids[-1]
    before = [process_cpu_seconds(pid) for pid in pids]
    written_before = written_bytes(serving_model)
    predict = wrk(url, CLIENTS, seconds, FRESH_LUA, fresh_env(texts))
    after = [process_cpu_seconds(pid) for pid in pids]
    written = written_bytes(serving_model) - written_before
    requests = max(1, predict["requests"])
    predict_rps = per_second(predict)
    cpu_us = [1e6 * (a - b) / requests for a, b in zip(after, before, strict=True)]
    front_us, model_us = cpu_us[0], cpu_us[1] if len(cpu_us) == 2 else 0.0
    return Round(
        health_rps=round(health_rps, 1),
        predict_rps=round(predict_rps, 1),
        ratio=round(predict_rps / health_rps, 3),
        p99_ms=round(predict["latency_us"]["p99"] / 1000, 2),
        statuses=predict["statuses"],
        front_cpu_us=round(front_us, 1),
        model_side_cpu_us=round(model_us, 1),
        disk_write_kib=round(written / requests / 1024, 2),
    )


def run(seconds: float, rounds: int, quick: bool) -> dict[str, Any]:
    figures = run_layouts("split-served", LAYOUTS, measure, medians, seconds, rounds, quick)
    return {**figures, "target_ratio": TARGET_RATIO}


def medians(runs: list[Round]) -> dict[str, float]:
    fields = (
        "health_rps",
        "predict_rps",
        "ratio",
        "p99_ms",
        "front_cpu_us",
        "model_side_cpu_us",
        "disk_write_kib",
    )
    return {f: round(statistics.median(getattr(r, f) for r in runs), 3) for f in fields}


def report(result: dict[str, Any]) -> str:
    lines = layouts_report_head(
        result,
        "A front-end/model split served end to end, beside one process",
        "`make bench-split-served` (bench/split_served.py), which says how each layout is started.",
        f"`make bench-frontend`'s simulated model; {result['clients']} wrk connections, "
        f"{result['seconds_per_run']} s a run; /health, then fresh one-text /predict; the "
        "layouts started afresh in each round, in turns. CPU µs a /predict from /proc: "
        "the one process's, or the split's front end's and model side's; KiB written to "
        "storage a /predict by the process that serves the model.",
        [
            ("p99 ms", lambda r: r["p99_ms"]),
            ("front end µs", lambda r: r["front_cpu_us"]),
            ("model side µs", lambda r: r["model_side_cpu_us"]),
            ("disk KiB", lambda r: r["disk_write_kib"]),
        ],
    )
    lines.append("")
    for layout, m in result["medians"].items():
        split = layout.startswith("split")
        model_side = f" and {m['model_side_cpu_us']} on the model side" if split else ""
        lines.append(
            f"- **{layout}**, medians: /predict at **{m['ratio']}** of /health's rate "
            f"(target ≥ {result['target_ratio']}), {m['predict_rps']:,.0f} req/s, p99 "
            f"{m['p99_ms']} ms, {m['front_cpu_us']} µs of CPU a request in the "
            f"{'front end' if split else 'process'}{model_side}, {m['disk_write_kib']} KiB "
            "written to storage."
        )
    return "\n".join(lines + reading(result) + SEE_SCALING) + "\n"


# Each layout of one process, the split's with the same settings, and what they share.
PAIRS = {
    "one process": ("split", "the same caches"),
    "one process, disk tier off": ("split, disk tier off", "the disk tier off"),
}


def reading(result: dict[str, Any]) -> list[str]:
    """What the run's figures say: the split against one process with the same settings, in
    the same rounds; what the disk tier costs the model side; what each layout wrote."""
    medians, rounds = result["medians"], result["rounds"]
    lines = ["", "## What the figures say", ""]
    for one, (split, shared) in PAIRS.items():
        if one in medians and split in medians:
            above = sum(
                s["ratio"] > o["ratio"] for s, o in zip(rounds[split], rounds[one], strict=True)
            )
            more = medians[split]["predict_rps"] / medians[one]["predict_rps"] - 1
            lines.append(
                f"- With {shared}, the split served {more:.0%} more fresh one-text requests a "
                f"second than one process (medians), its ratio above one process's in {above} "
                f"of {len(rounds[split])} rounds."
            )
    if "split" in medians and "split, disk tier off" in medians:
        on, off = medians["split"], medians["split, disk tier off"]
        lines.append(
            f"- The model side's CPU a request is what the disk tier costs it: "
            f"{on['model_side_cpu_us']} µs with the tier against {off['model_side_cpu_us']} "
            "without. Each fresh text is looked up on disk before the model answers it, which "
            "no admission rule can skip: the tier holds what earlier processes wrote."
        )
    written = "; ".join(f"{layout} {m['disk_write_kib']}" for layout, m in medians.items())
    lines.append(
        f"- Storage written a fresh text, in KiB, by the process that serves the model: "
        f"{written}. A tier that writes every fresh answer dirties a page of sqlite's key "
        "index for each new random key, written to its write-ahead log and again at each "
        "checkpoint."
    )
    return lines


def main() -> None:
    main_of("split_served", __doc__.split("\n\n")[0], run, report, seconds=10.0)


# --- the report's shared parts, for this bench and bench.split_waits ----------------------

# A round's figure in a report: its column's header, and how a round (its JSON) gives it.
Column = tuple[str, Callable[[dict[str, Any]], object]]

SEE_SCALING = [
    "",
    "How the split runs, and when it pays: [Scaling out]"
    "(../../scaling.md#http-apart-from-the-models-the-split).",
]


def layouts_report_head(
    result: dict[str, Any], title: str, written_by: str, runs: str, columns: list[Column]
) -> list[str]:
    """The opening of a report of `run_layouts`' figures: its title; the date, machine and
    load; what wrote it (`written_by`) and what it ran (`runs`); then a row a layout a round:
    its /health and /predict rates and their ratio, `columns`, its statuses."""
    headers = " | ".join(header for header, _ in columns)
    lines = [
        f"# {title}",
        "",
        machine_line(result, written_by),
        "",
        runs,
        "",
        f"| layout | round | /health req/s | /predict req/s | ratio | {headers} | statuses |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(columns) + "---|",
    ]
    for layout, rounds in result["rounds"].items():
        for number, r in enumerate(rounds, start=1):
            cells = " | ".join(str(cell(r)) for _, cell in columns)
            lines.append(
                f"| {layout} | {number} | {r['health_rps']:,.0f} | {r['predict_rps']:,.0f} "
                f"| {r['ratio']} | {cells} | {r['statuses']} |"
            )
    return lines


# --- the rounds, for this bench and bench.split_waits -------------------------------------


def run_layouts(
    name: str,
    layouts: Layouts,
    measure: Callable[[str, tuple[int, ...], float, Path], Measured],
    medians: Callable[[list[Measured]], dict[str, Any]],
    seconds: float,
    rounds: int,
    quick: bool,
) -> dict[str, Any]:
    """Each round starts each layout afresh with `make bench-frontend`'s simulated model and
    measures it: `measure(url, pids, seconds, texts)`, the pids being the one process's, or
    the split's front end's and model side's. The figures: each round's, and `medians`."""
    scratch = WORK / name
    scratch.mkdir(parents=True, exist_ok=True)
    texts = write_literals(sample_texts(2000), scratch / "texts.txt")
    env = {"MODELS_FILE": str(write_models_file(scratch))}
    load_at_start = quiet_start(quick, LOAD_WAIT_SECONDS)
    found: dict[str, list[Measured]] = {layout: [] for layout in layouts}
    for _, layout in in_turns(list(layouts), rounds):
        split, model_env = layouts[layout]
        with served(split, name, env, model_env) as target:
            pids = tuple(target.processes.values())
            found[layout].append(measure(target.url, pids, seconds, texts))
        print(layout, json.dumps(asdict(found[layout][-1])), flush=True)
    return {
        **run_head(host(), load_at_start),
        "clients": CLIENTS,
        "seconds_per_run": seconds,
        "rounds": {layout: [asdict(r) for r in runs] for layout, runs in found.items()},
        "medians": {layout: medians(runs) for layout, runs in found.items()},
    }


def warmed_health_rate(url: str, seconds: float, texts: Path) -> float:
    """Warm-ups (a second of fresh /predict, then one of /health), then /health's requests a
    second over a run of `seconds`."""
    warm_up(url, CLIENTS, warm_ups(texts))
    return per_second(wrk(f"{url}/health", CLIENTS, seconds, HEALTH_LUA, {}))


def main_of(
    name: str,
    description: str,
    run: Callable[[float, int, bool], dict[str, Any]],
    report: Callable[[dict[str, Any]], str],
    seconds: float,
) -> None:
    """A bench's command line: `--quick` (one round of 2 s, into bench/out/<name>-quick/),
    `--rounds` (5), `--seconds` (`seconds` a run), `--out` (bench/reports); then its report,
    `<name>.md` and `.json`."""
    parser = argparse.ArgumentParser(description=description)
    add_out(parser, quick_help="smoke run: one round of 2 s")
    parser.add_argument("--rounds", type=int, help="rounds (default 5)")
    parser.add_argument("--seconds", type=float, help=f"seconds a run (default {seconds:g})")
    args = parser.parse_args()
    quick = args.quick
    rounds = args.rounds or (1 if quick else 5)
    seconds = args.seconds or (2.0 if quick else seconds)
    out = out_folder(args.out, quick, name.replace("_", "-"))
    result = run(seconds, rounds, quick)
    write_report(out, name, result, report(result))


if __name__ == "__main__":
    main()
