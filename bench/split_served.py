"""A front-end/model split served end to end, as a measured prototype, beside the service in
one process in the same rounds: would the split reach `/predict` at 0.6 of `/health` here?

Run: `python -m bench.split_served` (or `make bench-split-served`); `--quick` is a smoke run
of one short round that writes into bench/out/split-served-quick/ instead. It needs `wrk`.
Writes bench/reports/split_served.{md,json}.

Each round starts, in turns, with the simulated model of `make bench-frontend` and its
settings (bench/frontend.py):

- **one process**: the real server (`python -m api.cli`), as `make bench-frontend` runs it;
- **split**: two processes.
  - *The model side* (`--model-side SOCKET`): the service's app and lifespan, started as
    `loraserve score` starts them (api.batch.local.started_service), serving a Unix stream
    socket. A message holds the calls of one turn of the front end's event loop; each call
    runs through the lifecycle's own `classify` (which model, the cache tiers, tokenizing,
    admission, the batcher, the device, the refusals as the HTTP errors they become), and
    the answers of one turn of this side's loop go back as one message (length-prefixed
    JSON, as `make bench-split` measures the hop).
  - *The front end* (`--front-end SOCKET`): the real server (`loraserve`: uvicorn, the app,
    its middleware, `/predict`'s route and the lifecycle), whose lifecycle's `classify` is
    replaced by the hop: a turn's calls go out as one message and a reader task settles each
    request's future from the replies. Its own cache tiers are off: the model side's serve.
    It still loads the simulated model (a tokenizer, no weights) and never calls it, so its
    `/health` and `/ready` are its own.

Each layout runs with the disk tier on (the default) and off (`DISK_CACHE_MAX_BYTES=0` for
the process that serves the model), four in all, in an order that rotates each round. In
each: `/health`, then fresh one-text `/predict` (texts never sent before), 64 wrk
connections; the ratio of the two rates, `/predict`'s p99, and the CPU a request of the
front end (or of the one process) and of the model side, from /proc.

A prototype, not a mode of the service: only `classify` crosses the socket. `/models`,
run-time adapters, the model side's metrics, request ids and traces do not; a client's
disconnect does not cancel its call on the model side; if the model side dies, the requests
waiting on it are never answered.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import uvloop

from api.serving.per_turn import PerTurn
from bench.frontend import CLIENTS, HEALTH_LUA, TARGET_RATIO, fresh_env, write_models_file
from bench.report_files import write_report
from bench.throughput import (
    FRESH_LUA,
    REPORTS,
    WORK,
    empty_disk_cache,
    host,
    process_cpu_seconds,
    sample_texts,
    server,
    stop,
    wait_for_quiet,
    write_literals,
    wrk,
)

REPO = Path(__file__).resolve().parents[1]
LENGTH = struct.Struct("!I")
LOAD_WAIT_SECONDS = 900
FRONT_END_CACHES_OFF = {"LRU_CACHE_ENTRIES": "0", "DISK_CACHE_MAX_BYTES": "0"}
DISK_TIER_OFF = {"DISK_CACHE_MAX_BYTES": "0"}
# Each layout: split or not, and the settings of the process that serves the model.
LAYOUTS: dict[str, tuple[bool, dict[str, str]]] = {
    "one process": (False, {}),
    "split": (True, {}),
    "one process, disk tier off": (False, DISK_TIER_OFF),
    "split, disk tier off": (True, DISK_TIER_OFF),
}


# --- the wire: length-prefixed JSON, one message a turn ----------------------------------


def framed(items: list[Any]) -> bytes:
    body = json.dumps(items).encode()
    return LENGTH.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> list[Any]:
    size = LENGTH.unpack(await reader.readexactly(LENGTH.size))[0]
    items: list[Any] = json.loads(await reader.readexactly(size))
    return items


class _NeverGone:
    """The request the lifecycle's disconnect watcher reads on the model side: its client
    (the front end's) never goes. (The prototype does not carry disconnects.)"""

    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


# --- the model side -----------------------------------------------------------------------


async def serve_model_side(socket_path: str) -> None:
    """The service's state, started as `loraserve score` starts it, answering calls on
    `socket_path` until the process is stopped."""
    from api.batch.local import started_service
    from api.http import lifecycle
    from api.http.errors import ServiceError
    from api.settings import load_settings

    async with started_service(load_settings()) as state:
        never_gone: Any = _NeverGone()

        async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            replies: PerTurn[list[Any]] = PerTurn(lambda turn: writer.write(framed(turn)))

            async def answer(call: list[Any]) -> None:
                number, model, adapter, texts, truncate, use_cache, deadline = call
                cache = state.cache if use_cache else None
                try:
                    done = await lifecycle.classify(
                        never_gone, state, model, adapter, texts, truncate, cache, deadline
                    )
                except ServiceError as exc:
                    replies.add([number, "error", type(exc).__name__, exc.message, exc.headers])
                    return
                except Exception as exc:  # a 500 in one process: the front end's too
                    replies.add([number, "unexpected", f"{type(exc).__name__}: {exc}"])
                    return
                result = done.result
                scores = [[list(s.probabilities), list(s.logits)] for s in result.scores]
                answered = [number, "ok", scores, result.tiers, done.answered_by, done.labels]
                replies.add([*answered, done.adapter, done.cascade, list(done.cache_tiers)])

            running: set[asyncio.Task[None]] = set()
            while True:
                try:
                    calls = await read_message(reader)
                except asyncio.IncompleteReadError:  # the front end closed its end
                    writer.close()
                    return
                for call in calls:
                    task = asyncio.create_task(answer(call))
                    running.add(task)
                    task.add_done_callback(running.discard)

        listening = await asyncio.start_unix_server(connection, socket_path)
        async with listening:
            await listening.serve_forever()


# --- the front end ------------------------------------------------------------------------


class Hop:
    """The lifecycle's `classify`, run on the model side: a turn's calls as one message."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.numbers = itertools.count()
        self.waiting: dict[int, asyncio.Future[list[Any]]] = {}
        self.writer: asyncio.StreamWriter | None = None
        self.reading: asyncio.Task[None] | None = None
        self.connecting = asyncio.Lock()
        self.turn: PerTurn[list[Any]] = PerTurn(self._send)

    async def classify(
        self,
        request: Any,
        state: Any,
        model: str | None,
        adapter: str | None,
        texts: list[str],
        truncate: bool,
        cache: Any,
        deadline: float,
    ) -> Any:
        from api.http import errors
        from api.http.lifecycle import Done
        from api.models.predictor import Scores
        from api.serving.classify import Classified

        if self.writer is None:
            await self._connect()
        number = next(self.numbers)
        reply = asyncio.get_running_loop().create_future()
        self.waiting[number] = reply
        # time.monotonic() is the system's CLOCK_MONOTONIC: the same clock in both processes.
        self.turn.add([number, model, adapter, texts, truncate, cache is not None, deadline])
        found = await reply
        if found[1] == "error":
            raise getattr(errors, found[2])(found[3], found[4])
        if found[1] == "unexpected":
            raise RuntimeError(f"the model side failed: {found[2]}")
        scores, tiers, answered_by, labels, adapter, cascade, cache_tiers = found[2:]
        classified = Classified([Scores(tuple(p), tuple(raw)) for p, raw in scores], tiers)
        return Done(classified, answered_by, labels, adapter, cascade, cache_tiers)

    async def _connect(self) -> None:
        async with self.connecting:  # the first requests all wait for the one connection
            if self.writer is None:
                reader, self.writer = await asyncio.open_unix_connection(self.socket_path)
                self.reading = asyncio.get_running_loop().create_task(self._settle(reader))

    def _send(self, calls: list[list[Any]]) -> None:
        assert self.writer is not None  # connected before any call is added
        self.writer.write(framed(calls))

    async def _settle(self, reader: asyncio.StreamReader) -> None:
        while True:
            for reply in await read_message(reader):
                future = self.waiting.pop(reply[0])
                if not future.done():  # its request was cancelled (its client went)
                    future.set_result(reply)


def serve_front_end(socket_path: str) -> int:
    """The real server, its lifecycle's `classify` replaced by the hop."""
    from api import cli
    from api.http import lifecycle

    hop = Hop(socket_path)
    lifecycle.classify = hop.classify
    return cli.main([])


@contextmanager
def split_server(
    name: str, env: dict[str, str], model_env: dict[str, str]
) -> Iterator[tuple[str, int, int]]:
    """The model side (`model_env` added to its settings), then the front end, a server as
    bench.throughput starts one; their URL and the two processes' ids."""
    with tempfile.TemporaryDirectory() as folder:
        socket_path = str(Path(folder) / "model.sock")
        model_side_env = {
            **os.environ,
            "LOG_LEVEL": "warning",
            "TORCH_NUM_THREADS": "1",
            **env,
            "DISK_CACHE_DIR": str(empty_disk_cache(name)),
            **model_env,
        }
        with (WORK / f"server-{name}-model.log").open("w") as log:
            model_side = subprocess.Popen(
                [sys.executable, "-m", "bench.split_served", "--model-side", socket_path],
                cwd=REPO,
                env=model_side_env,
                stdout=log,
                stderr=log,
            )
            try:
                wait_for_socket(socket_path, model_side)
                front = ("bench.split_served", "--front-end", socket_path)
                front_env = {**env, **FRONT_END_CACHES_OFF}
                with server(f"{name}-front", front_env, threads=1, module=front) as front_end:
                    yield front_end.url, front_end.pid, model_side.pid
            finally:
                stop(model_side)


def wait_for_socket(path: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 180  # imports and the model's load come first
    while not Path(path).exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the model side did not open its socket; see {WORK}")
        time.sleep(0.05)


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


def measure(url: str, pids: tuple[int, int | None], seconds: float, texts: Path) -> Round:
    """Warm-ups, then a /health run and a fresh /predict run."""
    wrk(url, CLIENTS, 1, FRESH_LUA, fresh_env(texts))
    wrk(f"{url}/health", CLIENTS, 1, HEALTH_LUA, {})
    health = wrk(f"{url}/health", CLIENTS, seconds, HEALTH_LUA, {})
    before = [process_cpu_seconds(pid) if pid else 0.0 for pid in pids]
    predict = wrk(url, CLIENTS, seconds, FRESH_LUA, fresh_env(texts))
    after = [process_cpu_seconds(pid) if pid else 0.0 for pid in pids]
    requests = max(1, predict["requests"])
    health_rps = health["requests"] / (health["duration_us"] / 1e6)
    predict_rps = predict["requests"] / (predict["duration_us"] / 1e6)
    front_us, model_us = (1e6 * (a - b) / requests for a, b in zip(after, before, strict=True))
    return Round(
        health_rps=round(health_rps, 1),
        predict_rps=round(predict_rps, 1),
        ratio=round(predict_rps / health_rps, 3),
        p99_ms=round(predict["latency_us"]["p99"] / 1000, 2),
        statuses=predict["statuses"],
        front_cpu_us=round(front_us, 1),
        model_side_cpu_us=round(model_us, 1),
    )


def run(seconds: float, rounds: int, quick: bool) -> dict[str, Any]:
    scratch = WORK / "split-served"
    scratch.mkdir(parents=True, exist_ok=True)
    texts = write_literals(sample_texts(2000), scratch / "texts.txt")
    env = {"MODELS_FILE": str(write_models_file(scratch))}
    load_at_start = 0.0 if quick else wait_for_quiet(LOAD_WAIT_SECONDS)["at_start"]
    found: dict[str, list[Round]] = {layout: [] for layout in LAYOUTS}
    names = list(LAYOUTS)
    for number in range(rounds):
        # A rotating order, so that a drift of the machine hits every layout alike.
        for layout in names[number % len(names) :] + names[: number % len(names)]:
            split, model_env = LAYOUTS[layout]
            if split:
                with split_server("split-served", env, model_env) as (url, front, model_side):
                    found[layout].append(measure(url, (front, model_side), seconds, texts))
            else:
                with server("split-served-one", {**env, **model_env}, threads=1) as target:
                    found[layout].append(measure(target.url, (target.pid, None), seconds, texts))
            print(layout, json.dumps(asdict(found[layout][-1])), flush=True)
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": host(),
        "load_average_at_start": load_at_start,
        "clients": CLIENTS,
        "seconds_per_run": seconds,
        "rounds": {layout: [asdict(r) for r in runs] for layout, runs in found.items()},
        "medians": {layout: medians(runs) for layout, runs in found.items()},
        "target_ratio": TARGET_RATIO,
    }


def medians(runs: list[Round]) -> dict[str, float]:
    fields = ("health_rps", "predict_rps", "ratio", "p99_ms", "front_cpu_us", "model_side_cpu_us")
    return {f: round(statistics.median(getattr(r, f) for r in runs), 3) for f in fields}


def report(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# A front-end/model split served end to end, beside one process",
        "",
        f"{result['date']}; {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB; Python "
        f"{m['python']}; load average at start {result['load_average_at_start']}. Written by "
        "`make bench-split-served` (bench/split_served.py), which says how the prototype is "
        "built and what it leaves out.",
        "",
        f"`make bench-frontend`'s simulated model; {result['clients']} wrk connections, "
        f"{result['seconds_per_run']} s a run; /health, then fresh one-text /predict; the "
        "two layouts started afresh in each round, in turns. CPU µs a /predict from /proc: "
        "the one process's, or the split's front end's and model side's.",
        "",
        "| layout | round | /health req/s | /predict req/s | ratio | p99 ms | front end µs "
        "| model side µs | statuses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for layout, runs in result["rounds"].items():
        for number, r in enumerate(runs, start=1):
            lines.append(
                f"| {layout} | {number} | {r['health_rps']:,.0f} | {r['predict_rps']:,.0f} "
                f"| {r['ratio']} | {r['p99_ms']} | {r['front_cpu_us']} "
                f"| {r['model_side_cpu_us']} | {r['statuses']} |"
            )
    lines.append("")
    for layout, m in result["medians"].items():
        split = LAYOUTS[layout][0]
        model_side = f" and {m['model_side_cpu_us']} on the model side" if split else ""
        lines.append(
            f"- **{layout}**, medians: /predict at **{m['ratio']}** of /health's rate "
            f"(target ≥ {result['target_ratio']}), {m['predict_rps']:,.0f} req/s, p99 "
            f"{m['p99_ms']} ms, {m['front_cpu_us']} µs of CPU a request in the "
            f"{'front end' if split else 'process'}{model_side}."
        )
    lines += [
        "",
        "What this says about the split is in [Benchmarks]"
        "(../../benchmarks.md#front-end-one-text-requests).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: one round of 2 s")
    parser.add_argument("--rounds", type=int, help="rounds (default 5)")
    parser.add_argument("--seconds", type=float, help="seconds a run (default 10)")
    parser.add_argument("--out", type=Path, help="report folder (default bench/reports)")
    parser.add_argument("--model-side", metavar="SOCKET", help=argparse.SUPPRESS)
    parser.add_argument("--front-end", metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.model_side:
        from api.models.tokenizing import keep_tokenizers_serial

        keep_tokenizers_serial()  # as `loraserve` does before it loads a model
        uvloop.run(serve_model_side(args.model_side))
        return
    if args.front_end:
        raise SystemExit(serve_front_end(args.front_end))
    quick = args.quick
    rounds = args.rounds or (1 if quick else 5)
    seconds = args.seconds or (2.0 if quick else 10.0)
    out = args.out or (REPO / "bench" / "out" / "split-served-quick" if quick else REPORTS)
    result = run(seconds, rounds, quick)
    write_report(out, "split_served", result, report(result))


if __name__ == "__main__":
    main()
