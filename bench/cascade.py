"""The confidence cascade against each of its two models alone, as the service serves them.

    python -m bench.cascade            # writes bench/reports/cascade.{md,json}

One real server process with the embedded default (spam-minilm, then spam-smollm2 in
bitsandbytes nf4), both result caches off, on loopback:

1. Held-out quality: every text of both test splits (the training scripts' own: the SMS
   Spam Collection's held-out split and the PH set's newest months, seed 13) is sent to
   `spam-minilm`, to `spam-smollm2` and to `cascade`, 32 texts a request; the answers give
   accuracy, spam precision/recall/F1 and the ham false-positive rate, and `X-Answered-By`
   gives the share of texts the cascade escalated. Unlike the model cards, whose cascade
   rows score the LLM in fp32, this is the LLM as served (4-bit).
2. Throughput: wrk with 32 connections, one text a request (the same 2,000 SMS texts as
   bench/throughput.py), for each of the three in turn; rounds interleaved (a b c a b c …)
   so that drift in the machine's load spreads over all three; the median of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.harness import (
    REPORTS,
    WORK,
    machine,
    machine_bullet,
    now,
    run_wrk,
    sample_texts,
    server,
    wait_for_quiet,
    write_bodies,
    write_report,
)
from bench.throughput import CACHE_OFF
from scripts.spam_data import LABELS, LabelledText, load_corpora
from scripts.spam_eval import EVALUATIONS, compute_metrics, scored_test_splits

TARGETS = ("spam-minilm", "spam-smollm2", "cascade")
CLIENTS = 32
REQUEST_TEXTS = 32
THREADS = 2


def score(url: str, model: str, rows: list[LabelledText]) -> dict[str, Any]:
    """Sends every row to `model` and compares the top label with the truth."""
    predicted: list[int] = []
    answered_by: list[str] = []
    with httpx.Client(base_url=url, timeout=120) as client:
        for start in range(0, len(rows), REQUEST_TEXTS):
            chunk = rows[start : start + REQUEST_TEXTS]
            body = {"inputs": [row.text for row in chunk], "model": model, "cache": False}
            response = client.post("/predict", json=body)
            response.raise_for_status()
            predicted += [LABELS.index(ranked[0]["label"]) for ranked in response.json()]
            answered_by += response.headers["X-Answered-By"].split(",")
    quality = asdict(compute_metrics([row.label for row in rows], predicted))
    quality["escalated"] = sum(name != TARGETS[0] for name in answered_by)
    quality["escalated_share"] = quality["escalated"] / len(rows)
    return quality


def throughput(url: str, texts: list[str], rounds: int, seconds: float) -> dict[str, Any]:
    """Requests/s and latency per target at CLIENTS connections, rounds interleaved."""
    bodies = {
        model: write_bodies(texts, WORK / f"cascade-{model}.jsonl", model=model)
        for model in TARGETS
    }
    for model in TARGETS:  # warm-up: every text length once through each batcher
        run_wrk(url, CLIENTS, 3, bodies[model])
    runs: dict[str, list[dict[str, Any]]] = {model: [] for model in TARGETS}
    for round_number in range(rounds):
        for model in TARGETS:
            summary = run_wrk(url, CLIENTS, seconds, bodies[model])
            statuses = {int(code): count for code, count in summary["statuses"].items()}
            runs[model].append(
                {
                    "requests_per_s": summary["requests"] / (summary["duration_us"] / 1e6),
                    "p50_ms": summary["latency_us"]["p50"] / 1000,
                    "p99_ms": summary["latency_us"]["p99"] / 1000,
                    "statuses": statuses,
                    "socket_errors": sum(summary["socket_errors"].values()),
                }
            )
            print(f"round {round_number + 1}: {model}: {runs[model][-1]}", flush=True)
    return {
        model: {
            "requests_per_s": statistics.median(r["requests_per_s"] for r in model_runs),
            "p50_ms": statistics.median(r["p50_ms"] for r in model_runs),
            "p99_ms": statistics.median(r["p99_ms"] for r in model_runs),
            "runs": model_runs,
        }
        for model, model_runs in runs.items()
    }


def markdown(report: dict[str, Any]) -> str:
    quality, speed, meta = report["quality"], report["throughput"], report["meta"]
    encoder_rps = speed[TARGETS[0]]["requests_per_s"]
    lines = [
        "# The cascade against its two models alone, as served",
        "",
        f"Written by `python -m bench.cascade` on {meta['date']}.",
        "",
        f"{machine_bullet(meta['machine'], THREADS)}; client {meta['machine']['client']}; "
        f"load average {meta['load']['at_start']:.2f} at the start.",
        "- Server: `python -m api.cli` with the embedded default (spam-minilm merged + dynamic "
        "int8; spam-smollm2 bitsandbytes nf4 with its adapter), LRU and disk cache off, "
        f"CASCADE_THRESHOLD {meta['threshold']}.",
    ]
    for split, by_model in quality.items():
        first = by_model[TARGETS[0]]
        lines += [
            "",
            f"## {EVALUATIONS[split]} ({first['n']} distinct messages, "
            f"{first['true_spam'] + first['false_ham']} spam)",
            "",
            "| served as | accuracy | spam precision | spam recall | spam F1 | ham FPR "
            "| wrong | escalated |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for model in TARGETS:
            q = by_model[model]
            escalated = (
                f"{q['escalated']} ({q['escalated_share']:.1%})" if model == "cascade" else ""
            )
            wrong = q["false_spam"] + q["false_ham"]
            lines.append(
                f"| {model} | {q['accuracy']:.2%} | {q['spam_precision']:.4f} "
                f"| {q['spam_recall']:.4f} | {q['spam_f1']:.4f} "
                f"| {q['ham_false_positive_rate']:.2%} | {wrong} | {escalated} |"
            )
    lines += [
        "",
        f"## Throughput at {CLIENTS} clients (one text a request, cache off)",
        "",
        f"Median of {meta['rounds']} interleaved rounds of {meta['seconds']:g} s after a "
        "warm-up; latency at the client (wrk).",
        "",
        "| target | req/s | × spam-minilm | p50 ms | p99 ms | every round's req/s |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for model in TARGETS:
        s = speed[model]
        each = ", ".join(f"{r['requests_per_s']:.1f}" for r in s["runs"])
        lines.append(
            f"| {model} | {s['requests_per_s']:.1f} | {s['requests_per_s'] / encoder_rps:.2f} "
            f"| {s['p50_ms']:.0f} | {s['p99_ms']:.0f} | {each} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--seconds", type=float, default=10, help="seconds per run (default 10)")
    parser.add_argument("--out", type=Path, default=REPORTS, help="report folder")
    args = parser.parse_args(argv)
    WORK.mkdir(parents=True, exist_ok=True)
    load = wait_for_quiet(900)
    tests = scored_test_splits(load_corpora())
    with server("cascade", CACHE_OFF, THREADS) as target:
        threshold = httpx.get(f"{target.url}/info", timeout=10).json()["cascade"]["threshold"]
        quality = {
            split: {model: score(target.url, model, rows) for model in TARGETS}
            for split, rows in tests.items()
        }
        speed = throughput(target.url, sample_texts(2000), args.rounds, args.seconds)
    report = {
        "meta": {
            "date": now(),
            "machine": machine(),
            "load": load,
            "rounds": args.rounds,
            "seconds": args.seconds,
            "threshold": threshold,
        },
        "quality": quality,
        "throughput": speed,
    }
    write_report(args.out, "cascade", report, markdown(report), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
