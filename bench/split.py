"""The two budgets of a front-end/model split (HTTP in one process, the model path in
another), each measured apart: what a hop to another process costs the front end a request,
and how fast the model side alone serves one-text requests on an event loop of its own.

Run: `python -m bench.split` (or `make bench-split`); `--quick` is a smoke run of a few
seconds that writes into bench/out/split-quick/ instead. Writes bench/reports/split.{md,json}.

**The hop.** No server and no model: one uvloop event loop in this process plays the front
end, with `clients` coroutines each asking for one text's answer and waiting for it, as the
service's requests do. The texts a turn of the loop gathers go out together, as the service's
turns are tokenized together (api/serving/gathered_encoding.py):

- **local**: the turn's texts are written as the message would be and its answers read from
  the reply the other process would send, in the same process, without a socket: the
  gathering, the futures and the JSON, which the front end pays in any design;
- **hop**: the turn's texts go as one length-prefixed JSON message over a Unix stream socket
  to another process, which answers each text at once with a fixed answer of the service's
  shape (two probabilities, two logits); one reader task settles the futures in order.

The difference between the two is what the hop costs the front end a request (this process's
CPU time); the other process's own CPU a request is read from /proc. Fewer clients make
smaller turns (at one client, a round trip a request), so the hop's cost is given per client
count.

**The model side alone.** The service's own app and lifespan, started in this process as
`loraserve score` starts them (api.batch.local.started_service), with its settings' defaults
and the simulated model of `make bench-frontend`, and 64 coroutines on its event loop calling
the model's `ModelRunner.classify` as `/predict` does, one fresh text each time, with no HTTP:
the LRU and disk tiers, tokenizing, admission, the batcher, the batch worker and the
simulated device, all the work a model process would keep (the LRU tier would stay in the
front end, a few µs). This process's CPU a request (every thread) and the rate, with the disk
tier on (the default) and off, each on a service of its own.

Each figure is the median of several runs after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import uvloop

from api.batch.local import started_service
from api.serving.admission import NotAdmitted
from api.serving.cache import ResultCache
from api.serving.classify import ModelRunner
from api.settings import load_settings
from bench.frontend import write_models_file
from bench.harness import (
    REPO,
    add_out,
    host,
    machine_line,
    out_folder,
    process_cpu_seconds,
    quiet_start,
    run_head,
    sample_texts,
    write_report,
)
from bench.threads import thread_waits

CLIENT_COUNTS = (1, 4, 16, 64)
MODEL_SIDE_CLIENTS = 64
REFUSED_PAUSE_SECONDS = 0.01  # a refused client's wait before it asks again, as after a 429
ANSWER = [0.25, 0.75, -0.55, 0.55]  # P(ham), P(spam) and their logits: the service's shape
LENGTH = struct.Struct("!I")
LOAD_WAIT_SECONDS = 600


# --- the other process ---------------------------------------------------------------------


def answers_for(count: int) -> bytes:
    """The reply to a message of `count` texts."""
    return json.dumps([ANSWER] * count).encode()


async def answer_forever(socket_path: str) -> None:
    """The model side: for each message of texts, one answer a text, at once."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                size = LENGTH.unpack(await reader.readexactly(LENGTH.size))[0]
                texts = json.loads(await reader.readexactly(size))
            except asyncio.IncompleteReadError:  # the front end closed its end
                writer.close()
                return
            body = answers_for(len(texts))
            writer.write(LENGTH.pack(len(body)) + body)

    server = await asyncio.start_unix_server(serve, socket_path)
    async with server:
        await server.serve_forever()


# --- the front end -------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One run of `requests` answers to `clients` coroutines."""

    mode: str  # "local" or "hop"
    clients: int
    requests: int
    turns: int  # messages sent (hop) or turns settled (local)
    cpu_us: float  # this process's CPU a request
    wall_us: float  # elapsed a request
    other_cpu_us: float  # the other process's CPU a request (0 for local)


async def run_clients(
    mode: str, clients: int, requests: int, texts: list[str], socket_path: str, other: int
) -> Run:
    """`requests` answers to `clients` coroutines, a turn's texts sent together."""
    loop = asyncio.get_running_loop()
    pending: list[tuple[str, asyncio.Future[list[float]]]] = []
    in_flight: deque[list[asyncio.Future[list[float]]]] = deque()
    turns = 0
    send: Callable[[bytes, int], None]
    reader_task: asyncio.Task[None] | None = None
    if mode == "hop":
        reader, writer = await asyncio.open_unix_connection(socket_path)

        def send(body: bytes, count: int) -> None:
            writer.write(LENGTH.pack(len(body)) + body)

        async def settle_replies() -> None:
            while True:
                size = LENGTH.unpack(await reader.readexactly(LENGTH.size))[0]
                answers = json.loads(await reader.readexactly(size))
                for future, answer in zip(in_flight.popleft(), answers, strict=True):
                    future.set_result(answer)

        reader_task = loop.create_task(settle_replies())
    else:
        replies = {count: answers_for(count) for count in range(1, clients + 1)}

        def send(body: bytes, count: int) -> None:
            answers = json.loads(replies[count])
            for future, answer in zip(in_flight.popleft(), answers, strict=True):
                future.set_result(answer)

    def flush() -> None:
        nonlocal pending, turns
        group, pending = pending, []
        body = json.dumps([text for text, _ in group]).encode()
        in_flight.append([future for _, future in group])
        turns += 1
        send(body, len(group))

    asked = 0

    async def client() -> None:
        nonlocal asked
        while asked < requests:
            text = texts[asked % len(texts)]
            asked += 1
            future: asyncio.Future[list[float]] = loop.create_future()
            if not pending:  # the first of this turn: the rest of the turn joins it
                loop.call_soon(flush)
            pending.append((text, future))
            answer = await future
            assert len(answer) == len(ANSWER)

    other_before = process_cpu_seconds(other) if mode == "hop" else 0.0
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    cpu, wall = time.process_time() - cpu_before, time.perf_counter() - wall_before
    other_cpu = process_cpu_seconds(other) - other_before if mode == "hop" else 0.0
    if reader_task is not None:
        reader_task.cancel()
        writer.close()
    return Run(
        mode=mode,
        clients=clients,
        requests=asked,
        turns=turns,
        cpu_us=round(1e6 * cpu / asked, 2),
        wall_us=round(1e6 * wall / asked, 2),
        other_cpu_us=round(1e6 * other_cpu / asked, 2),
    )


def measure_hop(texts: list[str], requests: int, repeats: int) -> list[dict[str, Any]]:
    """Per client count: local and hop runs taking turns, medians of `repeats` after a
    warm-up of each."""
    with tempfile.TemporaryDirectory() as folder:
        socket_path = str(Path(folder) / "hop.sock")
        other = subprocess.Popen(
            [sys.executable, "-m", "bench.split", "--answer", socket_path], cwd=REPO
        )
        try:
            wait_for_socket(socket_path, other)
            rows = []
            for clients in CLIENT_COUNTS:
                runs: dict[str, list[Run]] = {"local": [], "hop": []}
                for attempt in range(repeats + 1):
                    for mode in ("local", "hop"):
                        found = uvloop.run(
                            run_clients(mode, clients, requests, texts, socket_path, other.pid)
                        )
                        if attempt:  # the first of each is the warm-up
                            runs[mode].append(found)
                rows.append(row(clients, runs))
                print(json.dumps(rows[-1]), flush=True)
            return rows
        finally:
            other.terminate()
            other.wait(timeout=10)


def wait_for_socket(path: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120  # its imports (the service's, torch's) come first
    while not Path(path).exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the answering process did not open {path}")
        time.sleep(0.05)


def row(clients: int, runs: dict[str, list[Run]]) -> dict[str, Any]:
    """One client count's medians."""

    def median(mode: str, field: str) -> float:
        return round(statistics.median(getattr(run, field) for run in runs[mode]), 2)

    local, hop = median("local", "cpu_us"), median("hop", "cpu_us")
    return {
        "clients": clients,
        "texts_a_turn": round(
            statistics.median(run.requests / run.turns for run in runs["hop"]), 1
        ),
        "local_cpu_us": local,
        "hop_cpu_us": hop,
        "hop_costs_front_end_us": round(hop - local, 2),
        "other_process_cpu_us": median("hop", "other_cpu_us"),
        "local_wall_us": median("local", "wall_us"),
        "hop_wall_us": median("hop", "wall_us"),
        "runs": [asdict(run) for mode in runs for run in runs[mode]],
    }


# --- the model side alone -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelSideRun:
    """One run of `requests` fresh one-text classifications on the model's runner."""

    requests: int  # answered
    refused: int  # admission's refusals; after one, the client waits, then asks the next
    cpu_us: float  # this process's CPU a request, every thread
    requests_per_s: float
    cores: float  # CPU seconds a second
    waits: float  # voluntary context switches a request, every thread (the GIL's hand-offs)


async def classify_fresh(
    runner: ModelRunner, cache: ResultCache, texts: list[str], requests: int, run: str
) -> ModelSideRun:
    """`requests` texts never asked before, from MODEL_SIDE_CLIENTS coroutines."""
    asked = refused = 0

    async def client() -> None:
        nonlocal asked, refused
        while asked < requests:
            text = f"{run}.{asked}.1 {texts[asked % len(texts)]}"
            asked += 1
            try:
                found = await runner.classify([text], None, True, cache, time.monotonic() + 10)
            except NotAdmitted:  # /predict's 429: the client waits, then asks the next
                refused += 1
                await asyncio.sleep(REFUSED_PAUSE_SECONDS)
                continue
            assert found.tiers == ["model"], found.tiers  # fresh: no tier holds it

    waits_before = sum(thread_waits(os.getpid()).values())
    cpu_before, wall_before = time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(MODEL_SIDE_CLIENTS)))
    cpu, wall = time.process_time() - cpu_before, time.perf_counter() - wall_before
    waits = sum(thread_waits(os.getpid()).values()) - waits_before
    answered = asked - refused
    return ModelSideRun(
        requests=answered,
        refused=refused,
        cpu_us=round(1e6 * cpu / answered, 1),
        requests_per_s=round(answered / wall, 1),
        cores=round(cpu / wall, 2),
        waits=round(waits / answered, 3),
    )


async def model_side(
    texts: list[str], requests: int, repeats: int, disk_tier: bool
) -> list[ModelSideRun]:
    """The service's app with the simulated model, its runner driven without HTTP: a warm-up
    run, then `repeats` runs, all on one service (its caches grow as a server's do); the
    disk tier on (the default) or off."""
    with tempfile.TemporaryDirectory() as folder:
        changes: dict[str, Any] = {} if disk_tier else {"disk_cache_max_bytes": 0}
        settings = load_settings(
            _env_file=None,
            models_file=write_models_file(Path(folder)),
            disk_cache_dir=Path(folder) / "disk",  # empty, as each bench-frontend server's
            torch_num_threads=1,  # as bench-frontend's server
            **changes,
        )
        async with started_service(settings) as state:
            (runner,) = state.runners.values()
            runs = []
            for attempt in range(repeats + 1):
                found = await classify_fresh(runner, state.cache, texts, requests, str(attempt))
                print(json.dumps(asdict(found)), flush=True)
                if attempt:  # the first is the warm-up
                    runs.append(found)
            return runs


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Splitting HTTP from the model: the hop and the model side, measured apart",
        "",
        machine_line(result, "`make bench-split` (bench/split.py)."),
        "",
        "## The hop: what it costs the front end a request",
        "",
        f"One uvloop event loop, `clients` coroutines each asking for one SMS's answer "
        f"{result['requests']:,} times in all; a turn's texts go out together as one "
        "length-prefixed JSON message over a Unix stream socket to another process that "
        "answers each at once (hop), or come back in the same process with the same JSON "
        f"work (local). Medians of {result['repeats']} runs of each after a warm-up.",
        "",
        "| clients | texts a turn | local µs CPU a request | hop µs CPU a request | the hop "
        "costs the front end | the other process's µs CPU a request | local µs elapsed | "
        "hop µs elapsed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["hop"]:
        lines.append(
            f"| {r['clients']} | {r['texts_a_turn']} | {r['local_cpu_us']} | {r['hop_cpu_us']} "
            f"| {r['hop_costs_front_end_us']} | {r['other_process_cpu_us']} "
            f"| {r['local_wall_us']} | {r['hop_wall_us']} |"
        )
    lines += [
        "",
        "With many clients a turn gathers many texts and the hop's cost is shared between "
        "them; at one client it is a whole round trip a request.",
        "",
        "## The model side alone",
        "",
        f"The service's app with `make bench-frontend`'s simulated model, "
        f"{MODEL_SIDE_CLIENTS} coroutines on its event loop calling the model's runner as "
        f"`/predict` does (no HTTP), one fresh text each, {result['model_side_requests']:,} "
        "texts a run on one service, after a warm-up run: caches, tokenizing, admission, the "
        "batcher, the batch worker, the simulated device. This process's CPU, every thread; "
        "waits: its threads' voluntary context switches (each a thread giving up its core to "
        "wait: for the GIL, a lock, a sleep).",
        "",
        "| disk tier | run | µs CPU a request | requests/s | cores | waits a request "
        "| refused by admission |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tier, runs in result["model_side"].items():
        for number, run in enumerate(runs, start=1):
            lines.append(
                f"| {tier} | {number} | {run['cpu_us']} | {run['requests_per_s']:,.0f} "
                f"| {run['cores']} | {run['waits']} | {run['refused']} |"
            )
    lines.append("")
    for tier, runs in result["model_side"].items():
        lines.append(
            f"- Disk tier {tier}, medians: {statistics.median(r['cpu_us'] for r in runs)} µs "
            f"of CPU a request, {statistics.median(r['requests_per_s'] for r in runs):,.0f} "
            f"requests/s, {statistics.median(r['waits'] for r in runs)} waits a request."
        )
    lines += [
        "",
        "The split as the service runs it, measured whole: "
        "[A split served end to end](split_served.md).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out(parser, quick_help="smoke run of a few seconds")
    parser.add_argument("--answer", metavar="SOCKET", help=argparse.SUPPRESS)  # the other side
    args = parser.parse_args()
    if args.answer:
        uvloop.run(answer_forever(args.answer))
        return
    quick = args.quick
    requests, model_requests, repeats = (2_000, 500, 1) if quick else (100_000, 30_000, 5)
    out = out_folder(args.out, quick, "split")
    load_at_start = quiet_start(quick, LOAD_WAIT_SECONDS)
    texts = sample_texts(2000)
    hop = measure_hop([f"{i}.1 {text}" for i, text in enumerate(texts)], requests, repeats)
    model_runs = {
        name: uvloop.run(model_side(texts, model_requests, repeats, disk_tier))
        for name, disk_tier in (("on", True), ("off", False))
    }
    result = {
        **run_head(host(), load_at_start),
        "requests": requests,
        "repeats": repeats,
        "hop": hop,
        "model_side_requests": model_requests,
        "model_side": {name: [asdict(run) for run in runs] for name, runs in model_runs.items()},
    }
    write_report(out, "split", result, report(result))


if __name__ == "__main__":
    main()
