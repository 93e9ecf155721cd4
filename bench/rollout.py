"""What a candidate in shadow costs the clients: the served rate without a candidate, with a
shadow at share 0.1 and at 1.0, at TARGET_CLIENTS clients and at overload, in one run.

Run: `python -m bench.rollout` (or `make bench-rollout`); `--quick` is a smoke run that writes
into bench/out/rollout-quick/. Needs `wrk`, as bench.throughput, whose measurements it uses.
Writes bench/reports/rollout.{md,json}.

Three servers of `artifacts/rollout.yaml` (the embedded encoder unmerged, with its two
adapters) run side by side, the idle ones costing nothing: `none` (no candidate), `shadow 0.1`
and `shadow 1.0` (spam-v2 beside spam-v1). Caches off, one fresh SMS a request (the forward
dominates). Each load runs in ROUNDS rounds in which the three take turns (the order reversed
every other round); each figure is the median of its rounds, and its ratio to `none`'s.

- `TARGET_CLIENTS` clients: the served rate and latency, and what share of the texts the
  shadow compared (the rest were dropped, counted by reason);
- `OVERLOAD_CLIENTS` clients: 429s against `none`'s, and the shadow rows dropped.

What a shadow row costs is read from the server's CPU: at `LIGHT_CLIENTS` (the model not
saturated, so every shadow row is scored), the CPU seconds the shadow at 1.0 adds per
compared text.
"""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import (
    REPO,
    WORK,
    RunningServer,
    machine,
    machine_words,
    sample_texts,
    server,
    wait_for_quiet,
    write_report,
)
from bench.throughput import (
    CACHE_OFF,
    TARGET_CLIENTS,
    Config,
    Point,
    measure,
    rounds_config,
)

ROUNDS = 3
LIGHT_CLIENTS = 4
OVERLOAD_CLIENTS = 128
SHARES = {"none": None, "shadow 0.1": 0.1, "shadow 1.0": 1.0}
ROLLOUT_FILE = REPO / "artifacts" / "rollout.yaml"
COUNTED = (
    "loraserve_candidate_texts_total",
    "loraserve_shadow_rows_dropped_total",
    "loraserve_admission_refusals_total",
    "loraserve_predictions_total",
)


@dataclass(frozen=True)
class Figure:
    """One system under one load: medians of its rounds, and its rate's ratio to none's."""

    system: str
    clients: int
    requests_per_s: float
    vs_none: float
    p50_ms: float
    p99_ms: float
    server_cores: float
    non_200: int  # summed over the rounds (429s at overload)
    compared: float  # shadow: texts compared per answered text
    dropped: dict[str, float]  # shadow rows dropped per answered text, by reason
    rounds: list[float]


def models_file(share: float | None, folder: Path) -> Path:
    """artifacts/rollout.yaml with the candidate at `share` (None: no candidate), its
    relative paths made absolute."""
    declared = yaml.safe_load(ROLLOUT_FILE.read_text(encoding="utf-8"))
    model = declared["models"][0]
    for adapter in model["adapters"]:
        adapter["path"] = str((ROLLOUT_FILE.parent / adapter["path"]).resolve())
    candidate = model.pop("candidate")
    if share is not None:
        model["candidate"] = {**candidate, "mode": "shadow", "share": share}
    name = "none" if share is None else f"shadow-{share:g}"
    path = folder / f"rollout-{name}.yaml"
    path.write_text(yaml.safe_dump(declared, sort_keys=False), encoding="utf-8")
    return path


def counted(url: str) -> dict[str, float]:
    """The rollout's counters, by name (and reason for the drops)."""
    values: dict[str, float] = {}
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTED:
                key = sample.name
                if "reason" in sample.labels and "shadow" in key:
                    key = f"{key}:{sample.labels['reason']}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


def rounds(
    config: Config, targets: dict[str, RunningServer], clients: int, bodies: Path
) -> dict[str, list[tuple[Point, dict[str, float]]]]:
    found: dict[str, list[tuple[Point, dict[str, float]]]] = {name: [] for name in targets}
    order = list(targets)
    for turn in range(ROUNDS):
        for name in order if turn % 2 == 0 else order[::-1]:
            before = counted(targets[name].url)
            point = measure(name, targets[name], clients, config, bodies)
            after = counted(targets[name].url)
            delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
            print(json.dumps({"round": turn, **asdict(point), "counted": delta}), flush=True)
            found[name].append((point, delta))
    return found


def figures(clients: int, found: dict[str, list[tuple[Point, dict[str, float]]]]) -> list[Figure]:
    base = statistics.median(p.requests_per_s for p, _ in found["none"])
    result = []
    for name, runs in found.items():
        rate = statistics.median(p.requests_per_s for p, _ in runs)
        answered = [max(d.get("loraserve_predictions_total", 0.0), 1.0) for _, d in runs]
        compared = statistics.median(
            d.get("loraserve_candidate_texts_total", 0.0) / n
            for (_, d), n in zip(runs, answered, strict=True)
        )
        reasons = sorted(
            {k.split(":")[1] for _, d in runs for k in d if k.startswith("loraserve_shadow")}
        )
        dropped = {
            reason: round(
                statistics.median(
                    d.get(f"loraserve_shadow_rows_dropped_total:{reason}", 0.0) / n
                    for (_, d), n in zip(runs, answered, strict=True)
                ),
                4,
            )
            for reason in reasons
        }
        result.append(
            Figure(
                system=name,
                clients=clients,
                requests_per_s=rate,
                vs_none=round(rate / base, 3),
                p50_ms=statistics.median(p.p50_ms for p, _ in runs),
                p99_ms=statistics.median(p.p99_ms for p, _ in runs),
                server_cores=statistics.median(p.server_cores for p, _ in runs),
                non_200=sum(p.non_200 for p, _ in runs),
                compared=round(compared, 4),
                dropped={k: v for k, v in dropped.items() if v},
                rounds=[p.requests_per_s for p, _ in runs],
            )
        )
    return result


def shadow_row_cost(light: list[Figure]) -> dict[str, float]:
    """CPU milliseconds the shadow at 1.0 adds per compared text, at the light load (the
    server's cores over its rate, against none's)."""
    by_name = {f.system: f for f in light}
    none, full = by_name["none"], by_name["shadow 1.0"]
    per_text_none = none.server_cores / none.requests_per_s
    per_text_full = full.server_cores / full.requests_per_s
    added = per_text_full - per_text_none
    return {
        "cpu_ms_per_text_none": round(1000 * per_text_none, 3),
        "cpu_ms_per_text_shadow": round(1000 * per_text_full, 3),
        "cpu_ms_per_shadow_row": round(1000 * added / max(full.compared, 1e-9), 3),
    }


def markdown(
    results: list[Figure], cost: dict[str, float], config: Config, info: dict[str, Any]
) -> str:
    m = info["machine"]
    lines = [
        "# A candidate in shadow: what it costs the clients",
        "",
        f"Run {info['date']} on {machine_words(m)}; {m['client']}; {config.duration:g} s a "
        f"point, median of {ROUNDS} rounds (`python -m bench.rollout`). The embedded encoder "
        "unmerged (`artifacts/rollout.yaml`), caches off, one fresh SMS a request.",
        "",
        "| clients | system | requests/s | vs none | p50 ms | p99 ms | server cores | "
        "non-200 | compared per text | dropped per text |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for f in results:
        drops = ", ".join(f"{k} {v:g}" for k, v in f.dropped.items()) or "none"
        lines.append(
            f"| {f.clients} | {f.system} | {f.requests_per_s:g} | {f.vs_none:.3f} | "
            f"{f.p50_ms:g} | {f.p99_ms:g} | {f.server_cores:g} | {f.non_200} | "
            f"{f.compared:g} | {drops} |"
        )
    lines += [
        "",
        f"A shadow row's cost, at {LIGHT_CLIENTS} clients (every shadow row scored): "
        f"{cost['cpu_ms_per_text_none']:g} ms of server CPU per text without a candidate, "
        f"{cost['cpu_ms_per_text_shadow']:g} ms with a shadow at 1.0, so "
        f"{cost['cpu_ms_per_shadow_row']:g} ms per compared text.",
        "",
        "Shadow rows run in batches of their own, only once the device has stood idle as "
        "long as its last client batch took, and are dropped first when the model is busy: "
        "the busier the model, the fewer texts the shadow compares.",
        "",
    ]
    return "\n".join(lines)


def run(config: Config) -> list[Figure]:
    WORK.mkdir(parents=True, exist_ok=True)
    config.out.mkdir(parents=True, exist_ok=True)
    quiet = wait_for_quiet(config.load_wait)
    texts = sample_texts(config.texts)
    fresh = WORK / "rollout-bodies.jsonl"
    fresh.write_text("".join(json.dumps({"inputs": t, "cache": False}) + "\n" for t in texts))
    results: list[Figure] = []
    with ExitStack() as stack:
        targets = {
            name: stack.enter_context(
                server(
                    f"rollout-{name.replace(' ', '-')}",
                    {**CACHE_OFF, "MODELS_FILE": str(models_file(share, WORK))},
                    config.threads,
                )
            )
            for name, share in SHARES.items()
        }
        light = figures(LIGHT_CLIENTS, rounds(config, targets, LIGHT_CLIENTS, fresh))
        results += light
        for clients in (TARGET_CLIENTS, OVERLOAD_CLIENTS):
            results += figures(clients, rounds(config, targets, clients, fresh))
    cost = shadow_row_cost(light)
    info: dict[str, Any] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": quiet,
        "cache_off": CACHE_OFF,
        "shadow_row_cost": cost,
    }
    found = {**info, "figures": [asdict(f) for f in results]}
    write_report(config.out, "rollout", found, markdown(results, cost, config, info))
    return results


def main() -> None:
    config = rounds_config(__doc__.split("\n")[0], "rollout", (256, 4096))
    for figure in run(config):
        print(json.dumps(asdict(figure)), flush=True)


if __name__ == "__main__":
    main()
