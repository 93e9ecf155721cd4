"""Two revisions of the code, served side by side on the real embedded model, each taking its
turn with the raw model in every round: how far a change moved served / raw.

Run: `python -m bench.revisions --base <revision>` (or `make bench-revisions BASE=<revision>`).
It checks the base revision out into a git worktree under bench/out/ (git-ignored) and starts
the raw model (bench.raw_model) in its own process. Each round starts that checkout's server
and this checkout's afresh (`python -m api.cli`, caches off, as bench.throughput's "served")
and measures the three at 32 clients, one text a request, in an order that rotates; the
report gives each round's texts/s, each revision's served / raw, head / base, and the event
loop's CPU per request of each server. After the rounds each revision's server is started
once more and profiled by stage at 32 and at 64 clients (bench.stages, `--profile-seconds`;
0 leaves it out): where each revision's CPU goes, before and after, in the same run.

Why not two runs of bench.throughput: on a shared machine the raw model's own rate moves by
a quarter between rounds minutes apart (measured here: 658 to 830 texts/s in one run), which
is as much as the changes measured. Here every figure of a round is taken within a minute of
the others, and the medians of several rounds are compared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.harness import (
    FRESH_LUA,
    REPO,
    REPORTS,
    WORK,
    RunningServer,
    fresh_env,
    in_turn,
    machine_bullet,
    run_meta,
    run_wrk,
    sample_texts,
    server,
    shown,
    stop_on_sigterm,
    wait_for_quiet,
    warm_up,
    write_bodies,
    write_literals,
    write_report,
)
from bench.stages import STAGES, profile
from bench.threads import PY_SPY, per_thread_us, thread_cpu_seconds, thread_names
from bench.throughput import CACHE_OFF, TARGET_CLIENTS, Config, RawModel, measure, raw_model

ROUNDS = 5
# Where the CPU goes, by stage, in each revision: profiled at these clients once the rounds
# are done (bench.stages; profiled, a server runs slower, so the rounds give the rates).
PROFILED_CLIENTS = (TARGET_CLIENTS, 64)
CHECKOUTS = REPO / "bench" / "out" / "revisions"


@dataclass(frozen=True)
class Round:
    """One round: each revision's served texts/s and the raw model's, within a minute."""

    order: list[str]
    base: float
    head: float
    raw: float
    raw_other_cores: float
    # The event loop's CPU (the main thread's, from /proc) per request, µs: the front end's
    # own work, which a forward shares the cores with; None when a point was measured twice.
    base_loop_us: float | None
    head_loop_us: float | None

    @property
    def base_vs_raw(self) -> float:
        return self.base / self.raw

    @property
    def head_vs_raw(self) -> float:
        return self.head / self.raw

    @property
    def head_vs_base(self) -> float:
        return self.head / self.base


def git(*args: str) -> str:
    found = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    return found.stdout.strip()


def checkout(revision: str) -> tuple[Path, str]:
    """A worktree of `revision` (made once per commit) and that commit's short id."""
    commit = git("rev-parse", "--verify", f"{revision}^{{commit}}")
    folder = CHECKOUTS / commit
    if not (folder / "api").is_dir():
        shutil.rmtree(folder, ignore_errors=True)
        git("worktree", "prune")
        git("worktree", "add", "--detach", "--force", str(folder), commit)
    return folder, commit[:7]


# What the server runs: a change elsewhere (docs, tests, benchmarks) changes no figure.
SERVED_PATHS = ("api", "artifacts", "pyproject.toml", "requirements")


def head_description() -> str:
    """This checkout's commit, and whether what the server runs differs from it."""
    commit = git("rev-parse", "--short=7", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *SERVED_PATHS)
    return f"{commit} with uncommitted changes to the served code" if dirty else commit


def rounds(
    config: Config, code: dict[str, Path], raw: RawModel, bodies: Path, count: int
) -> list[Round]:
    """`count` rounds of base, head and raw, the order rotating, each round with both
    servers started afresh: one server process kept its rate ~10 % above or below the other
    for its whole life (three runs with the same two processes each gave head / base 0.92,
    1.01 and 1.11, every round of a run on the same side), so a run of long-lived processes
    measures their placement as much as their code."""
    found: list[Round] = []
    for number in range(count):
        with ExitStack() as stack:
            servers = {
                name: stack.enter_context(server(name, CACHE_OFF, config.threads, folder))
                for name, folder in code.items()
            }
            found.append(one_round(config, servers, raw, bodies, number))
        print(json.dumps({"round": asdict(found[-1])}), flush=True)
    return found


def one_round(
    config: Config, servers: dict[str, RunningServer], raw: RawModel, bodies: Path, number: int
) -> Round:
    """Base, head and raw, in the order of round `number`."""
    names = ["base", "head", "raw"]
    threads = {name: thread_names(target.pid) for name, target in servers.items()}
    timed_only = replace(config, warmup=0.0)  # warmed up here, outside the CPU reading
    order = in_turn(names, number)
    rate: dict[str, float] = {}
    loop_us: dict[str, float | None] = {}
    other_cores = 0.0
    for name in order:
        if name == "raw":
            measured = raw.measure(config.duration, ["batch32"])
            rate["raw"], other_cores = measured["batch32"], measured["other_cores"]
            continue
        target = servers[name]
        run_wrk(target.url, TARGET_CLIENTS, config.warmup, bodies)
        before = thread_cpu_seconds(target.pid)
        point = measure(name, target, TARGET_CLIENTS, timed_only, bodies)
        after = thread_cpu_seconds(target.pid)
        rate[name] = point.requests_per_s
        spent = per_thread_us(before, after, threads[name], point.requests)
        loop_us[name] = spent.get("MainThread") if point.attempts == 1 else None
    return Round(
        order,
        rate["base"],
        rate["head"],
        round(rate["raw"], 1),
        other_cores,
        loop_us["base"],
        loop_us["head"],
    )


def profiles(
    config: Config, code: dict[str, Path], texts: Path, seconds: float
) -> dict[str, dict[str, Any]]:
    """Each revision's server, started afresh, profiled by stage (bench.stages) over
    `seconds` at each of PROFILED_CLIENTS, one fresh text a request; by `<name>@<clients>`."""
    found: dict[str, dict[str, Any]] = {}
    for name, folder in code.items():
        with server(f"profile-{name}", CACHE_OFF, config.threads, folder) as target:
            for clients in PROFILED_CLIENTS:
                warm_up(target.url, clients, [("", FRESH_LUA, fresh_env(texts))])
                raw = WORK / f"profile-{name}-{clients}"
                processes = {"": target.pid}
                found[f"{name}@{clients}"] = profile(
                    target.url, processes, seconds, texts, raw, clients
                )
        print(json.dumps({"profiled": name}), flush=True)
    return found


def stage_table(profiled: dict[str, dict[str, Any]]) -> list[str]:
    """The CPU µs a request by stage of each profiled run, base beside head."""
    keys = [f"{name}@{clients}" for clients in PROFILED_CLIENTS for name in ("base", "head")]
    heads = [key.replace("@", ", ") + " clients" for key in keys]
    lines = [
        "| stage (CPU µs a request) | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * len(keys),
    ]
    for stage in STAGES:
        cells = [profiled[key]["stages"].get(stage, {}).get("cpu_us_per_request") for key in keys]
        if any(cells):
            lines.append(f"| {stage} | " + " | ".join(shown_us(c) for c in cells) + " |")
    total = [profiled[key]["server_cpu_us_per_request"] for key in keys]
    rates = [profiled[key]["requests_per_s"] for key in keys]
    lines.append("| **all** | " + " | ".join(f"**{shown_us(t)}**" for t in total) + " |")
    lines.append("| requests/s, profiled | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    return lines


def markdown(
    meta: dict[str, Any],
    found: list[Round],
    base: str,
    head: str,
    profiled: dict[str, dict[str, Any]] | None = None,
) -> str:
    m = meta["machine"]
    median = {
        name: statistics.median(getattr(r, name) for r in found)
        for name in ("base_vs_raw", "head_vs_raw", "head_vs_base")
    }
    lines = [
        "# Served / raw of two revisions, side by side",
        "",
        f"Written by `{meta['command']}` on {meta['date']}: base {base}, head {head}.",
        "",
        f"{machine_bullet(m, meta['config']['threads'])} everywhere; load average at the start "
        f"{meta['load_average']['at_start']:.2f}.",
        f"- Client: {m['client']}, 1 thread, {TARGET_CLIENTS} connections, each request one "
        f"text cycling through {meta['config']['texts']} distinct SMS texts; "
        f"{meta['config']['duration']:g} s per measurement after a "
        f"{meta['config']['warmup']:g} s warm-up.",
        f"- Model: {meta['model']}. Both servers `python -m api.cli` with "
        "LRU_CACHE_ENTRIES=0, DISK_CACHE_MAX_BYTES=0 (every other setting as each revision "
        "ships it), both started afresh in every round; the raw model (bench.raw_model, "
        "batch 32) in its own process. An idle one costs the others nothing.",
        "",
        "| round | order | base texts/s | head texts/s | raw texts/s | base / raw "
        "| head / raw | head / base | base loop µs/request | head loop µs/request |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for number, r in enumerate(found, start=1):
        lines.append(
            f"| {number} | {', '.join(r.order)} | {r.base:.1f} | {r.head:.1f} | {r.raw:.1f} "
            f"| {r.base_vs_raw:.2f} | {r.head_vs_raw:.2f} | {r.head_vs_base:.2f} "
            f"| {shown_us(r.base_loop_us)} | {shown_us(r.head_loop_us)} |"
        )
    loops = {
        name: [us for r in found if (us := getattr(r, f"{name}_loop_us")) is not None]
        for name in ("base", "head")
    }
    lines += [
        "",
        f"Medians of the rounds: served / raw **{median['base_vs_raw']:.2f}** (base) and "
        f"**{median['head_vs_raw']:.2f}** (head); head / base **{median['head_vs_base']:.2f}**.",
        "The event loop's CPU a request (its thread's time in /proc over each timed run): "
        f"**{shown_us(median_of(loops['base']))}** µs (base) and "
        f"**{shown_us(median_of(loops['head']))}** µs (head), medians of the rounds. At "
        f"{TARGET_CLIENTS} clients every client waits in the same batch, so the device waits "
        "while the loop answers them and reads their next requests: that time is the gap "
        "between batches.",
        "",
    ]
    if profiled:
        lines += [
            "## Where the CPU goes, by stage",
            "",
            f"Each revision's server started afresh after the rounds and profiled by "
            f"`py-spy record` ({meta['config']['profile_seconds']:g} s at each of "
            f"{' and '.join(map(str, PROFILED_CLIENTS))} clients, one fresh text a request): "
            "each thread's CPU time from /proc, shared out by its samples' stages "
            "(bench/stages.py). The forward is `predictor` (its Python thread) and "
            "`native threads` (torch's OpenMP team). Profiled, a server runs slower: the "
            "rounds above give the rates.",
            "",
            *stage_table(profiled),
            "",
        ]
    return "\n".join(lines)


def shown_us(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def median_of(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def parse_args(argv: list[str] | None) -> tuple[Config, str, int, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"default {ROUNDS}")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds a measurement")
    parser.add_argument("--warmup", type=float, default=2.0, help="warm-up seconds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads everywhere")
    parser.add_argument("--load-wait", type=float, default=900.0, help="seconds to wait")
    parser.add_argument("--out", type=Path, default=REPORTS, help="report folder")
    parser.add_argument(
        "--profile-seconds",
        type=float,
        default=10.0,
        help="seconds each revision is profiled at each of "
        f"{' and '.join(map(str, PROFILED_CLIENTS))} clients (0: none)",
    )
    args = parser.parse_args(argv)
    config = Config(
        concurrency=[TARGET_CLIENTS],
        duration=args.duration,
        warmup=args.warmup,
        threads=args.threads,
        texts=2000,
        cache_seconds=0.0,
        load_wait=args.load_wait,
        out=args.out,
    )
    return config, args.base, args.rounds, args.profile_seconds


def main(argv: list[str] | None = None) -> int:
    config, base_revision, count, profile_seconds = parse_args(argv)
    if shutil.which("wrk") is None or shutil.which(PY_SPY) is None:
        print("wrk and py-spy are needed: `make bench-revisions` installs both", file=sys.stderr)
        return 2
    stop_on_sigterm()
    WORK.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    base_code, base = checkout(base_revision)
    head = head_description()
    load = wait_for_quiet(config.load_wait)
    bodies = write_bodies(sample_texts(config.texts), WORK / "bodies.jsonl")
    code = {"base": base_code, "head": REPO}
    with raw_model(config, bodies) as model:
        found = rounds(config, code, model, bodies, count)
        described = model.described
    profiled: dict[str, dict[str, Any]] = {}
    if profile_seconds > 0:
        texts = write_literals(sample_texts(config.texts), WORK / "profile-texts.txt")
        profiled = profiles(config, code, texts, profile_seconds)
    meta = run_meta(
        "bench.revisions", argv, load, "spam-minilm (as each revision ships it)", config, started
    )
    meta["config"]["profile_seconds"] = profile_seconds
    text = markdown(meta, found, base, head, profiled)
    data = {
        "meta": meta,
        "base": base,
        "head": head,
        "raw_model": described,
        "rounds": [{**asdict(r), "head_vs_base": r.head_vs_base} for r in found],
        "profiles": profiled,
    }
    write_report(config.out, "revisions", data, text)
    print(f"written to {shown(config.out)}/ in {meta['run_seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
