"""The command line of the GPU benchmarks of one model (bench.gpu_replicas, bench.gpu_graphs):
the full plan on a GPU into bench/reports, or `--smoke`, tiny shapes on any device, into
bench/out."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench import gpu
from bench.gpu_models import Shapes, build_koelectra
from bench.harness import write_report

PlanT = TypeVar("PlanT")


def main(
    argv: list[str] | None,
    module: str,
    description: str,
    report_name: str,
    plans: tuple[PlanT, PlanT],
    run: Callable[[PlanT, Path, bool], dict[str, Any]],
    markdown: Callable[[dict[str, Any]], str],
) -> int:
    """Parses `argv` for `python -m <module>` (`description`: its help's), runs the full plan
    or the smoke one (`plans`), and writes `<report_name>.{md,json}`; 2 where the run would
    not be a GPU's figures."""
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=description)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, any device")
    parser.add_argument("--work", type=Path, help="models and server logs (default bench/out)")
    parser.add_argument("--out", type=Path, help="report folder (default bench/reports)")
    parser.add_argument("--seconds", type=float, help="seconds per load point")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("no GPU is visible to torch here; `--smoke` runs the same code", file=sys.stderr)
        return 2
    full, smoke = plans
    plan = smoke if args.smoke else full
    if args.seconds is not None:
        plan = replace(plan, seconds=args.seconds)  # type: ignore[type-var]
    work = args.work or gpu.OUT / (f"{report_name}-smoke" if args.smoke else report_name)
    out = args.out or (work if args.smoke else gpu.REPORTS)
    if args.smoke and out.resolve() == gpu.REPORTS.resolve():
        print("--smoke figures are not a GPU's: they never go into bench/reports", file=sys.stderr)
        return 2
    work.mkdir(parents=True, exist_ok=True)
    report = run(plan, work, args.smoke)
    write_report(out, report_name, report, markdown(report))
    return 0


def tenths(value: float | None) -> str:
    """A figure to a tenth; a dash for none."""
    return "—" if value is None else f"{value:.1f}"


def device_named(meta: dict[str, Any]) -> str:
    """The device a run's `meta` names, for its page: the GPU with its CUDA and driver, or
    the device of a smoke run, said to be no GPU's figures."""
    gpu_info = meta["gpu"]
    if gpu_info:
        return f"**{gpu_info['name']}** (CUDA {gpu_info['cuda']}, driver {gpu_info['driver']})"
    return f"**{meta['device']}** (smoke run: not a GPU's figures)"


def koelectra(work: Path, shapes: Shapes) -> tuple[str, Path, Path]:
    """The device to run on, and KoELECTRA's base and adapter built in `work` (random
    weights in `shapes`)."""
    base, adapter = work / "models" / "koelectra", work / "models" / "koelectra-spam"
    build_koelectra(base, adapter, shapes, seed=0)
    return ("cuda" if torch.cuda.is_available() else "cpu"), base, adapter


def meta(module: str, device: str, smoke: bool, plan: Any, began: float) -> dict[str, Any]:
    """The device, the software, the plan (a dataclass with `shapes`) and the command of a
    run that began at `began` (`time.perf_counter`)."""
    return {
        **gpu.environment(device),
        "smoke": smoke,
        "plan": {**asdict(plan), "shapes": plan.shapes.koelectra},
        "wall_s": time.perf_counter() - began,
        "command": " ".join([f"python -m {module}", *sys.argv[1:]]),
    }
