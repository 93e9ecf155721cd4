"""`loraserve score` against the server: texts/s of scoring a file in process (no HTTP)
beside the served throughput of the same model, in the same run.

Run: `python -m bench.score` (or `make bench-score`); `--quick` is a smoke run that writes
into bench/out/score-quick/ instead. It needs `wrk`, as bench/throughput.py does. Writes
bench/reports/score.{md,json}. In one run, with the same distinct texts, the cache off and
the same torch thread count:

- served: the real server process (`python -m api.cli`, cache off, default batching), one
  text per request from 32 clients (wrk, bench/wrk/predict.lua), after a warm-up;
- score: `python -m api.cli score texts.jsonl --no-cache` over the same texts, its own
  texts/s over the scoring (the last progress line: from the first chunk to the last line
  written, the model's load and warm-up left out), and its wall time with the load.

They alternate for a number of rounds (served first in even rounds, score first in odd
ones), so a drift of the machine's speed hits both alike; score/served is the median of the
rounds' ratios. The target: score at least as fast as served (no HTTP in the way).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.harness import (
    OUT,
    REPO,
    add_out,
    out_folder,
    per_second,
    run_meta,
    run_wrk,
    sample_texts,
    server,
    shown,
    stop_on_sigterm,
    wait_for_quiet,
    write_bodies,
    write_report,
)
from bench.harness import (
    WORK as SERVER_WORK,
)
from bench.throughput import CACHE_OFF

WORK = OUT / "score"  # git-ignored: the texts and the scored output
CLIENTS = 32
TARGET_VS_SERVED = 1.0
PROGRESS = re.compile(r"^score: (\d+)/(\d+) texts\s+([0-9.]+) texts/s", re.MULTILINE)


@dataclass(frozen=True)
class Config:
    texts: int
    rounds: int
    duration: float
    warmup: float
    threads: int
    batch_size: int
    load_wait: float
    out: Path


@dataclass(frozen=True)
class Round:
    """Served and score, measured one after the other."""

    first: str
    served_texts_per_s: float
    score_texts_per_s: float
    score_wall_s: float  # the whole command: start, load, warm-up, scoring, exit

    @property
    def ratio(self) -> float:
        return self.score_texts_per_s / self.served_texts_per_s


def model_name() -> str:
    """The model both score, as the report names it: MODELS_FILE's first, else the
    embedded default's."""
    from api.models.spec import load_models_file

    declared = os.environ.get("MODELS_FILE")
    spec = load_models_file(Path(declared) if declared else None)[0]
    adapters = "+".join(a.name for a in spec.adapters) or "no adapter"
    return f"{spec.name} ({Path(spec.base).name}, adapter {adapters}, {spec.quantization})"


def served(url: str, config: Config, bodies: Path) -> float:
    """Texts/s of the server at CLIENTS clients, one text a request, after a warm-up."""
    if config.warmup > 0:
        run_wrk(url, CLIENTS, config.warmup, bodies)
    summary = run_wrk(url, CLIENTS, config.duration, bodies)
    bad = {k: v for k, v in summary["statuses"].items() if str(k) != "200"}
    if bad:
        raise RuntimeError(f"served: answers other than 200: {bad}")
    return per_second(summary)


def score(config: Config, texts: Path, env: dict[str, str]) -> tuple[float, float]:
    """(texts/s of the scoring, wall seconds of the command) of one `loraserve score` run."""
    output = WORK / "scored.jsonl"
    command = [sys.executable, "-m", "api.cli", "score", str(texts), "--no-cache"]
    command += ["--batch-size", str(config.batch_size), "-o", str(output)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.monotonic() - started
    found = PROGRESS.findall(done.stderr)
    if done.returncode != 0 or not found:
        raise RuntimeError(f"score failed ({done.returncode}):\n{done.stderr[-2000:]}")
    scored, total, rate = found[-1]
    lines = output.read_text(encoding="utf-8").count("\n")
    if scored != total or lines != int(total) + 1:
        raise RuntimeError(f"score wrote {lines} lines for {total} texts")
    return float(rate), wall


def markdown(rounds: list[Round], meta: dict[str, Any], ratio: float) -> str:
    served_median = statistics.median(r.served_texts_per_s for r in rounds)
    score_median = statistics.median(r.score_texts_per_s for r in rounds)
    verdict = "met" if ratio >= TARGET_VS_SERVED else "missed"
    lines = [
        "# `loraserve score` against the server",
        "",
        f"Model: {meta['model']}. Machine: {meta['machine']['cpu']}, "
        f"{meta['machine']['cores']} cores, torch {meta['machine']['torch']}; "
        f"{meta['config']['threads']} torch threads. {meta['date']}, "
        f"load average {meta['load_average']['at_start']} at the start.",
        f"Command: `{meta['command']}`.",
        "",
        f"{meta['config']['texts']} distinct SMS texts, cache off. Served: {CLIENTS} clients, "
        f"one text a request, {meta['config']['duration']:g} s after a "
        f"{meta['config']['warmup']:g} s warm-up. Score: the texts as a JSONL file, "
        f"`--batch-size {meta['config']['batch_size']}`, in process.",
        "",
        "| Round | First | Served texts/s | Score texts/s | Score / served | Score wall s |",
        "|---|---|---|---|---|---|",
    ]
    for index, r in enumerate(rounds, start=1):
        lines.append(
            f"| {index} | {r.first} | {r.served_texts_per_s:.1f} | {r.score_texts_per_s:.1f} "
            f"| {r.ratio:.2f} | {r.score_wall_s:.1f} |"
        )
    lines += [
        "",
        f"Median: served {served_median:.1f} texts/s, score {score_median:.1f} texts/s; "
        f"score/served {ratio:.2f} (median of the rounds' ratios). Target: at least "
        f"{TARGET_VS_SERVED:.1f}: **{verdict}**.",
        "",
        "Score's wall time includes starting Python, loading and warming up the models; its "
        "texts/s is the scoring alone, as its progress line reports it.",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> Config:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, help="distinct texts (default 4000)")
    parser.add_argument("--rounds", type=int, help="rounds of served then score (default 3)")
    parser.add_argument("--duration", type=float, help="timed seconds of served (default 10)")
    parser.add_argument("--warmup", type=float, help="warm-up seconds of served (default 2)")
    parser.add_argument("--batch-size", type=int, default=32, help="score's --batch-size")
    parser.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads of both (default: every core)",
    )
    parser.add_argument(
        "--load-wait", type=float, help="most seconds to wait for a quiet machine (default 900)"
    )
    add_out(parser, quick_help="smoke run: 300 texts, 1 round")
    args = parser.parse_args(argv)
    quick = args.quick
    return Config(
        texts=args.texts or (300 if quick else 4000),
        rounds=args.rounds or (1 if quick else 3),
        duration=args.duration or (3.0 if quick else 10.0),
        warmup=args.warmup if args.warmup is not None else (0.5 if quick else 2.0),
        threads=args.threads,
        batch_size=args.batch_size,
        load_wait=args.load_wait if args.load_wait is not None else (0.0 if quick else 900.0),
        out=out_folder(args.out, quick, "score"),
    )


def main(argv: list[str] | None = None) -> int:
    config = parse_args(argv)
    stop_on_sigterm()
    for folder in (WORK, SERVER_WORK):  # the server's log goes where bench.harness keeps it
        folder.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    load = wait_for_quiet(config.load_wait)
    texts = sample_texts(config.texts)
    bodies = write_bodies(texts, WORK / "bodies.jsonl")
    file = WORK / "texts.jsonl"
    file.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    env = {
        **os.environ,
        **CACHE_OFF,
        "DISK_CACHE_DIR": str(WORK / "cache"),
        "TORCH_NUM_THREADS": str(config.threads),
    }
    rounds: list[Round] = []
    with server("served", {**CACHE_OFF}, config.threads) as running:
        for index in range(config.rounds):
            if index % 2 == 0:
                rate = served(running.url, config, bodies)
                own, wall = score(config, file, env)
            else:
                own, wall = score(config, file, env)
                rate = served(running.url, config, bodies)
            first = "served" if index % 2 == 0 else "score"
            rounds.append(Round(first, round(rate, 1), round(own, 1), round(wall, 1)))
            print(f"round {index + 1}: served {rate:.1f}, score {own:.1f} texts/s", flush=True)
    ratio = statistics.median(r.ratio for r in rounds)
    meta = run_meta("bench.score", argv, load, model_name(), config, started)
    data = {
        "meta": meta,
        "rounds": [{**asdict(r), "ratio": round(r.ratio, 3)} for r in rounds],
        "score_vs_served": round(ratio, 3),
        "target": TARGET_VS_SERVED,
    }
    write_report(config.out, "score", data, markdown(rounds, meta, ratio))
    print(f"score/served {ratio:.2f}; report in {shown(config.out)}/score.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
