"""The benchmarks' shared harness: the machine and a quiet start, the texts, a server started and
stopped, wrk's load and its warm-ups, rounds in turns, and a report's files and machine line."""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any, TypeVar

import httpx

REPO = Path(__file__).resolve().parents[1]
REPORTS = REPO / "bench" / "reports"
OUT = REPO / "bench" / "out"  # git-ignored: quick runs' reports, scratch files
WORK = OUT / "throughput"  # the servers' logs and disk tiers
WRK_SCRIPTS = REPO / "bench" / "wrk"
LUA = WRK_SCRIPTS / "predict.lua"  # request bodies, one a line, in a cycle
FRESH_LUA = WRK_SCRIPTS / "fresh.lua"  # texts never sent before
HEALTH_LUA = WRK_SCRIPTS / "health.lua"  # GET /health, counted as the others are
DATA = REPO / "data" / "sms_spam_collection.tsv"
BUSY_LOAD = 1.0  # a 1-min load average above this means someone else is using the cores
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
READY_TIMEOUT_S = 180.0
Item = TypeVar("Item")


# --- the machine ---------------------------------------------------------------------------


def load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def wait_for_quiet(limit_s: float, poll_s: float = 30.0) -> dict[str, float]:
    """Waits (up to `limit_s`) until the 1-min load average is at most BUSY_LOAD.

    The bench itself is what should load the cores; another process (a training run) would
    make every number lower and noisier. Returns what it saw, for the report.
    """
    first = load_average()
    start = time.monotonic()
    now = first
    while now > BUSY_LOAD and time.monotonic() - start < limit_s:
        print(f"load average {now:.2f} > {BUSY_LOAD}: waiting {poll_s:.0f} s", flush=True)
        time.sleep(poll_s)
        now = load_average()
    return {"first": first, "at_start": now, "waited_s": round(time.monotonic() - start)}


def quiet_start(quick: bool, limit_s: float) -> float:
    """The load average a run starts at, after waiting for a quiet machine; 0.0 for a quick
    run, which does not wait."""
    return 0.0 if quick else wait_for_quiet(limit_s)["at_start"]


def host() -> dict[str, Any]:
    """CPU, cores, memory, torch and Python of this machine."""
    cpu = "unknown CPU"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    kib = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal:")
    )
    return {
        "cpu": cpu,
        "cores": len(os.sched_getaffinity(0)),
        "ram_gib": round(kib / 2**20, 1),
        "torch": version("torch"),
        "python": sys.version.split()[0],
    }


def machine() -> dict[str, Any]:
    """The host, and the load client (wrk) the benchmark drives it with."""
    wrk_version = subprocess.run(["wrk", "-v"], capture_output=True, text=True).stdout
    client = wrk_version.splitlines()[0].split(" Copyright")[0] if wrk_version else "wrk"
    return {**host(), "client": client}


def busy_cpu_seconds() -> float:
    """CPU seconds every core has spent not idle since boot (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process, its threads included."""
    # The command name (field 2) may hold spaces; the fields after it start past ")".
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(after_name[11]) + int(after_name[12])) / CLOCK_TICKS


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process and of every live process it started, and
    they in turn (a server's forward processes: FORWARD_PROCESSES)."""
    try:
        total = process_cpu_seconds(pid)
        # A child is listed under the thread that started it, which need not be the main one.
        listed = [path.read_text() for path in Path(f"/proc/{pid}/task").glob("*/children")]
    except (FileNotFoundError, ProcessLookupError):
        return 0.0  # gone meanwhile
    return total + sum(tree_cpu_seconds(int(child)) for text in listed for child in text.split())


def children_cpu_seconds() -> float:
    """CPU seconds of every finished child process (the wrk runs)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# --- texts ---------------------------------------------------------------------------------


def sample_texts(count: int) -> list[str]:
    """The first `count` distinct texts of the collection, the same for every system."""
    seen: dict[str, None] = {}
    for line in DATA.read_text(encoding="utf-8").splitlines():
        seen.setdefault(line.split("\t", 1)[1], None)
        if len(seen) == count:
            break
    return list(seen)


def write_literals(texts: list[str], path: Path) -> Path:
    """One JSON string literal a line, for fresh.lua."""
    path.write_text("".join(json.dumps(text) + "\n" for text in texts), encoding="utf-8")
    return path


def write_bodies(texts: list[str], path: Path, **fields: str) -> Path:
    """One request body a line (`inputs` plus `fields`), for wrk's Lua script and the raw
    model alike."""
    lines = (json.dumps({"inputs": text, **fields}) + "\n" for text in texts)
    path.write_text("".join(lines), encoding="utf-8")
    return path


def fresh_env(texts: Path) -> dict[str, str]:
    """fresh.lua's settings: one text a request, prefixed so that no run repeats one."""
    return {"TEXTS": str(texts), "TEXTS_PER": "1", "RUN": uuid.uuid4().hex[:8]}


# --- servers -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunningServer:
    url: str
    pid: int
    log: Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def empty_disk_cache(name: str) -> Path:
    """The disk tier's folder of the server `name`, emptied. Each server's disk tier starts
    empty: in a folder grown over earlier runs to a million entries a write costs ~40 µs of
    CPU against ~23 µs in a new one, so runs on one machine would not compare."""
    disk_cache = WORK / "caches" / name  # never the repository's own .cache
    shutil.rmtree(disk_cache, ignore_errors=True)
    WORK.mkdir(parents=True, exist_ok=True)  # for the logs: a fresh checkout has no bench/out
    return disk_cache


@contextmanager
def server(
    name: str,
    env: dict[str, str],
    threads: int,
    code: Path = REPO,
    module: Sequence[str] = ("api.cli",),
) -> Iterator[RunningServer]:
    """The real server process on a free loopback port, stopped when the block ends; `code`:
    the checkout whose `api` it runs (`python -m` imports from its working folder); `module`:
    what `python -m` runs, with its arguments."""
    port = free_port()
    full = {
        **os.environ,
        "DISK_CACHE_DIR": str(empty_disk_cache(name)),
        "LOG_LEVEL": "warning",
        **env,
        "HOST": "127.0.0.1",
        "PORT": str(port),
        "TORCH_NUM_THREADS": str(threads),
    }
    log = WORK / f"server-{name}.log"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", *module], cwd=code, env=full, stdout=sink, stderr=sink
        )
        try:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process, log)
            yield RunningServer(url, process.pid, log)
        finally:
            stop(process)


def wait_ready(
    url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = READY_TIMEOUT_S
) -> float:
    """Polls /ready until it answers 200; when (`time.perf_counter`) the server first
    answered at all (its port opens once its imports are done and its app is built)."""
    deadline = time.monotonic() + timeout
    listening: float | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"server exited with {process.returncode}:\n{log.read_text()[-3000:]}"
            )
        with suppress(httpx.TransportError):
            status = httpx.get(f"{url}/ready", timeout=2).status_code
            listening = listening or time.perf_counter()
            if status == 200:
                return listening
        time.sleep(0.1)
    raise RuntimeError(f"server not ready after {timeout:.0f} s; see {log}")


def stop(process: subprocess.Popen[Any]) -> None:
    """SIGTERM (the server drains, then exits), SIGKILL if it takes too long."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def stop_on_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C does, so every `finally` stops its server."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


# --- load ----------------------------------------------------------------------------------


def wrk(
    url: str, clients: int, seconds: float, script: Path, script_env: dict[str, str]
) -> dict[str, Any]:
    """One wrk run (1 thread, `clients` connections); the Lua script's JSON summary."""
    command = ["wrk", "-t1", f"-c{clients}", f"-d{max(1, round(seconds))}s", "--latency"]
    command += ["--timeout", "10s", "-s", str(script), url]
    result = subprocess.run(
        command, env={**os.environ, **script_env}, capture_output=True, text=True
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"wrk failed ({result.returncode}): {result.stderr or result.stdout}")
    summary: dict[str, Any] = json.loads(lines[-1])
    return summary


def run_wrk(url: str, clients: int, seconds: float, bodies: Path) -> dict[str, Any]:
    """predict.lua, cycling through the request bodies in `bodies` (one a line)."""
    return wrk(url, clients, seconds, LUA, {"BODIES": str(bodies)})


def per_second(summary: dict[str, Any]) -> float:
    """A wrk run's requests a second."""
    return float(summary["requests"] / (summary["duration_us"] / 1e6))


def warm_up(url: str, clients: int, loads: Iterable[tuple[str, Path, dict[str, str]]]) -> None:
    """A second of each load (a path under `url`, a wrk script and its settings), untimed:
    the first requests of a fresh server pay for what later ones find ready."""
    for path, script, script_env in loads:
        wrk(f"{url}{path}", clients, 1, script, script_env)


# --- rounds --------------------------------------------------------------------------------


def in_turn(items: list[Item], number: int) -> list[Item]:
    """`items` in the order of round `number`: A B C, then B C A, then C A B, …"""
    turn = number % len(items)
    return items[turn:] + items[:turn]


def in_turns(items: Sequence[Item], rounds: int) -> Iterator[tuple[int, Item]]:
    """Each round's number and each item in it, the order rotating each round, so that a
    drift of the machine's speed hits every item alike."""
    for number in range(rounds):
        for item in in_turn(list(items), number):
            yield number, item


def median_ms(run: Callable[[], object], repeats: int, warmups: int = 1) -> float:
    """Median wall time of `run()` in milliseconds, after `warmups` untimed calls."""
    for _ in range(warmups):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


# --- the report ----------------------------------------------------------------------------


def now() -> str:
    """The moment a report is dated with (UTC, to the second)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def run_head(found_machine: dict[str, Any], load_at_start: float) -> dict[str, Any]:
    """The first figures of a report: its date, its machine and the load it started at."""
    return {"date": now(), "machine": found_machine, "load_average_at_start": load_at_start}


def machine_line(figures: dict[str, Any], written_by: str, tools: Sequence[str] = ()) -> str:
    """A report's line under its title, from `run_head`'s figures: when, on what machine
    (and with which `tools`), at what load, and `written_by` what."""
    return "; ".join(
        [
            figures["date"],
            machine_words(figures["machine"]),
            *tools,
            f"load average at start {figures['load_average_at_start']}. Written by {written_by}",
        ]
    )


def machine_words(m: dict[str, Any]) -> str:
    """A machine as a report names it: CPU, cores, memory and Python."""
    return f"{m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB; Python {m['python']}"


def run_meta(
    module: str,
    argv: list[str] | None,
    load: dict[str, float],
    model: str,
    config: Any,
    started: float,
) -> dict[str, Any]:
    """What a report says of its run: command, date, machine, load, model, configuration
    (a dataclass with an `out` folder) and how long it took."""
    given = sys.argv[1:] if argv is None else argv
    return {
        "command": " ".join([f"python -m {module}", *given]),
        "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC",
        "machine": machine(),
        "load_average": load,
        "model": model,
        "config": {**asdict(config), "out": shown(config.out)},
        "run_seconds": round(time.monotonic() - started),
    }


def machine_bullet(m: dict[str, Any], threads: int) -> str:
    """The report's machine as a list item: CPU, memory, Python, torch and its threads."""
    return (
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, Python "
        f"{m['python']}, torch {m['torch']}; {threads} torch threads"
    )


def shown(path: Path) -> str:
    """A path as the report shows it: relative to the repository when inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def add_out(parser: argparse.ArgumentParser, quick_help: str | None = None) -> None:
    """The report folder's option, and `--quick` (a smoke run, `quick_help`) where given."""
    if quick_help is not None:
        parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, help="report folder (default bench/reports)")


def out_folder(out: Path | None, quick: bool, name: str) -> Path:
    """Where a run's report goes: `out` if given, bench/out/<name>-quick/ for a quick run,
    else bench/reports."""
    return out or (OUT / f"{name}-quick" if quick else REPORTS)


def targets_table(found: Sequence[dict[str, Any]]) -> list[str]:
    """A report's "Targets" section: each target, what was measured, and whether it is met."""
    return [
        "## Targets",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(
            f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else '**no**'} |"
            for t in found
        ),
    ]


def write_report(out: Path, name: str, figures: dict[str, Any], page: str, indent: int = 2) -> None:
    """`out/name.json` (the figures) and `out/name.md` (the page), then the page printed."""
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(figures, indent=indent) + "\n"
    (out / f"{name}.json").write_text(text, encoding="utf-8")
    (out / f"{name}.md").write_text(page, encoding="utf-8")
    print(page)
