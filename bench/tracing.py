"""What following requests costs: the served model with tracing off, on (sampling 1.0 and
0.1), and with JSON access lines at info, in one run.

Run: `python -m bench.tracing` (or `make bench-tracing`); `--quick` is a smoke run that writes
into bench/out/tracing-quick/. Needs `wrk`, as bench.throughput, whose measurements it uses.
Writes bench/reports/tracing.{md,json}.

Four servers of the embedded default run side by side (the idle ones cost nothing):

- off:       as shipped: no OTEL_* set, LOG_LEVEL=warning (no access lines), so no tracer at
  all;
- traced:    OTLP/HTTP export to a receiver in this process that answers and drops the spans,
  every trace sampled (OTEL_TRACES_SAMPLER=always_on);
- traced 10%: the same with OTEL_TRACES_SAMPLER=traceidratio, OTEL_TRACES_SAMPLER_ARG=0.1;
- json logs: tracing off, LOG_FORMAT=json at LOG_LEVEL=info: one JSON access line a request.

Two loads, each in ROUNDS rounds in which the four take turns (the order reversed every other
round, as the machine's speed drifts): the model's (cache off, TARGET_CLIENTS clients, one
SMS text a request: the forward dominates) and the front end's (one text repeated, answered
by the LRU: the per-request work is all there is, where a span or a log line weighs most).
Each system's figure is the median of its rounds; the cost is its ratio to off's.
"""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

from bench.harness import (
    WORK,
    RunningServer,
    machine,
    machine_words,
    sample_texts,
    server,
    wait_for_quiet,
    write_bodies,
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
TRACED = {"OTEL_TRACES_SAMPLER": "always_on"}
SAMPLED = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.1"}
JSON_LOGS = {"LOG_FORMAT": "json", "LOG_LEVEL": "info"}
LOADS = ("model", "front end")


@dataclass(frozen=True)
class Figure:
    """One system under one load: the median of its rounds, and its ratio to off's."""

    system: str
    load: str
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    server_cores: float
    vs_off: float
    rounds: list[float]  # requests/s of each round


@contextmanager
def span_sink() -> Iterator[tuple[str, list[int]]]:
    """An OTLP/HTTP endpoint that answers 200 and drops what it gets; yields its URL and a
    one-item list counting the bytes received (the spans did go out)."""
    received = [0]

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            received[0] += len(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=sink.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sink.server_address[1]}", received
    finally:
        sink.shutdown()
        sink.server_close()


def systems(endpoint: str) -> dict[str, dict[str, str]]:
    """Each system's settings beyond the shipped defaults."""
    otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "loraserve-bench"}
    return {
        "off": {},
        "traced": {**otlp, **TRACED},
        "traced 10%": {**otlp, **SAMPLED},
        "json logs": JSON_LOGS,
    }


def rounds(
    config: Config, targets: dict[str, RunningServer], load: str, bodies: Path
) -> dict[str, list[Point]]:
    """ROUNDS rounds of every system under one load, the order reversed every other round."""
    points: dict[str, list[Point]] = {name: [] for name in targets}
    order = list(targets)
    for turn in range(ROUNDS):
        for name in order if turn % 2 == 0 else order[::-1]:
            point = measure(name, targets[name], TARGET_CLIENTS, config, bodies)
            if point.non_200 or point.socket_errors:
                raise RuntimeError(f"{name} under the {load} load: {point.statuses}")
            print(json.dumps({"load": load, "round": turn, **asdict(point)}), flush=True)
            points[name].append(point)
    return points


def figures(load: str, points: dict[str, list[Point]]) -> list[Figure]:
    off = statistics.median(p.requests_per_s for p in points["off"])
    result = []
    for name, runs in points.items():
        rate = statistics.median(p.requests_per_s for p in runs)
        result.append(
            Figure(
                system=name,
                load=load,
                requests_per_s=rate,
                p50_ms=statistics.median(p.p50_ms for p in runs),
                p99_ms=statistics.median(p.p99_ms for p in runs),
                server_cores=statistics.median(p.server_cores for p in runs),
                vs_off=round(rate / off, 3),
                rounds=[p.requests_per_s for p in runs],
            )
        )
    return result


def markdown(results: list[Figure], config: Config, info: dict[str, object]) -> str:
    m = info["machine"]
    assert isinstance(m, dict)
    lines = [
        "# The cost of following requests: tracing and JSON access lines",
        "",
        f"Run {info['date']} on {machine_words(m)}; {m['client']}; {TARGET_CLIENTS} clients, "
        f"{config.duration:g} s a point, median of {ROUNDS} rounds (`python -m bench.tracing`).",
        "",
        "| load | system | requests/s | vs off | p50 ms | p99 ms | server cores |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for f in results:
        lines.append(
            f"| {f.load} | {f.system} | {f.requests_per_s:g} | {f.vs_off:.3f} | "
            f"{f.p50_ms:g} | {f.p99_ms:g} | {f.server_cores:g} |"
        )
    lines += ["", f"Span bytes received by the sink: {info['span_bytes']}.", ""]
    return "\n".join(lines + reading(results))


def reading(results: list[Figure]) -> list[str]:
    """What each way of following requests cost each load, as a share of off's rate."""
    lines = ["## What the figures say", ""]
    for load in LOADS:
        costs = {f.system: f"{1 - f.vs_off:.0%}" for f in results if f.load == load}
        lines.append(
            f"- The {load}'s load: tracing every request cost {costs['traced']} of its "
            f"requests a second, a tenth of them {costs['traced 10%']}, JSON access lines "
            f"{costs['json logs']}."
        )
    lines += [
        "",
        "A span's work shares the cores with the forward, and weighs most where a request "
        "does least (the front end's). Off, no tracer is set up at all; what the hooks cost "
        "then is measured per hook ([Measured in tests](measured_in_tests.md#tracing-off)).",
        "",
    ]
    return lines


def run(config: Config) -> list[Figure]:
    WORK.mkdir(parents=True, exist_ok=True)
    config.out.mkdir(parents=True, exist_ok=True)
    quiet = wait_for_quiet(config.load_wait)
    texts = sample_texts(config.texts)
    fresh = WORK / "tracing-bodies.jsonl"
    fresh.write_text("".join(json.dumps({"inputs": t, "cache": False}) + "\n" for t in texts))
    repeated = write_bodies(texts[:1], WORK / "tracing-one-body.jsonl")
    results: list[Figure] = []
    with span_sink() as (endpoint, received), ExitStack() as stack:
        targets = {
            name: stack.enter_context(server(f"tracing-{name}", env, config.threads))
            for name, env in systems(endpoint).items()
        }
        # The model's load first, cache off per request; then the one text, cached after
        # its first answer.
        results += figures(LOADS[0], rounds(config, targets, LOADS[0], fresh))
        for target in targets.values():
            httpx.post(f"{target.url}/predict", json={"inputs": texts[0]}, timeout=30)
        results += figures(LOADS[1], rounds(config, targets, LOADS[1], repeated))
        span_bytes = received[0]
    info: dict[str, object] = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": quiet,
        "span_bytes": span_bytes,
        "settings": systems("<sink>"),
        "cache_off": CACHE_OFF,
    }
    found = {**info, "figures": [asdict(f) for f in results]}
    write_report(config.out, "tracing", found, markdown(results, config, info))
    return results


def main() -> None:
    config = rounds_config(__doc__.split("\n")[0], "tracing", (64, 512))
    for figure in run(config):
        print(json.dumps(asdict(figure)), flush=True)


if __name__ == "__main__":
    main()
