"""The service's own work per request on the model path, at one text a request, with a device
fast enough never to be the limit: what caps the service whatever the GPU can do, in one
process and split in two.

Run: `python -m bench.frontend` (or `make bench-frontend`); `--quick` is a smoke run of about
a minute that writes into bench/out/frontend-quick/ instead. It needs `wrk` and `py-spy`
(the project's `bench` extra; `make bench-frontend` installs both). Writes
bench/reports/frontend.{md,json}. In one run:

- the real server (default settings but LOG_LEVEL=warning: no access line a request) with a
  models file holding only a simulated model (`simulated:` in the models file: the embedded
  base's tokenizer, no weights, each batch answered after sleeping SIMULATED's 0.5 ms + 0.1 µs
  a token), in four layouts: **one process** (`python -m api.cli`), **the split**
  (`python -m api.cli` with SPLIT_SOCKET, the model side, and `python -m api.cli front-end` on
  the same socket: HTTP and /predict's lifecycle apart from the model path, api/http/split),
  **the split, pinned**: the same with FRONT_END_CPUS on the machine's first CPU and
  MODEL_CPUS on the others (`pinned_cpus`), and **the split, pinned, batches of 16**: the
  pinned split with MAX_BATCH_SIZE=16 (SMALL_BATCHES);
- `/health` and fresh one-text `/predict` requests (texts never sent before, so no cache tier
  answers: bench/wrk/fresh.lua) from 64 wrk connections, alternating for a few rounds: the
  requests/s of each, the ratio (median of the rounds'), and /predict's p50 and p99;
- in the same rounds, `/predict` of one text the in-process cache holds (one body,
  bench/wrk/predict.lua): the route, the lifecycle and the cache without the model path;
- CPU time and waits (voluntary context switches) per request of each of the server's
  threads, all its processes' (/proc/<pid>/task/*/stat and status, named through
  `py-spy dump`), in the same runs;
- a profile of one more /predict run by `py-spy record` (raw folded stacks, threads on a
  CPU), one recorder a process (bench.stages): each sample goes to the stage of its innermost
  frame that names one, and each thread's CPU time in that run (/proc) is shared out by its
  samples. Profiled, the server runs slower; the shares, not that run's rate, are the point.

Each round starts each server afresh (one process kept its rates ~10 % above or below
another's for its whole life). With `--base <revision>` that revision's servers (a git worktree
under bench/out/; one process only, for a revision without the split) take turns with this
checkout's in every round, and each is profiled: the report adds both, before and after, as
measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

from api.cpus import format_cpu_list
from bench.harness import (
    FRESH_LUA,
    HEALTH_LUA,
    LUA,
    REPO,
    WORK,
    add_out,
    children_cpu_seconds,
    fresh_env,
    in_turns,
    machine,
    machine_line,
    out_folder,
    process_cpu_seconds,
    run_head,
    sample_texts,
    server,
    wait_for_quiet,
    warm_up,
    write_bodies,
    write_literals,
    write_report,
    wrk,
)
from bench.revisions import checkout, head_description
from bench.stages import Processes, profile, thread_labels, threads_cpu
from bench.threads import (
    PY_SPY,
    per_thread_us,
    thread_waits,
    waits_per_request,
)
from bench.throughput import scrape

CLIENTS = 64
# Small enough never to be the limit: at the example cost (2 ms a batch + 1 µs a
# padded token) a batch of 32 SMS slept ~4.3 ms, and two such batches in turn held the 64
# clients' requests as long as the loop took to serve them. The report gives the share of
# each /predict run that the declared device was busy.
SIMULATED = {"seconds_per_batch": 0.0005, "seconds_per_token": 0.0000001}
# What the issue asks of one process: /predict at this share of /health's rate, p99 below.
TARGET_RATIO = 0.6
TARGET_P99_MS = 50.0
LOAD_WAIT_SECONDS = 900  # at most, for the 1-min load average to come down to 1
FRONT_END = ("api.cli", "front-end")
# How the service is laid out: in one process, or split into a front end (HTTP and the
# request's lifecycle) and a model side (everything else) on one Unix socket.
ONE_PROCESS, SPLIT, SPLIT_PINNED = "one process", "split", "split, pinned"
SPLIT_PINNED_SMALL_BATCHES = "split, pinned, batches of 16"
SPLITS = (SPLIT, SPLIT_PINNED, SPLIT_PINNED_SMALL_BATCHES)
# A quarter of CLIENTS: with a device this much faster than the front end, four batches in
# flight kept each pinned process's core busier than two of 32 did (the A/B runs of
# bench/reports/measured_in_tests.md).
SMALL_BATCHES = {"MAX_BATCH_SIZE": "16"}
CACHED_ROUTE = "/predict, cached"


@dataclass(frozen=True)
class LoadPoint:
    """One wrk run against one route, and the server's CPU time in it."""

    route: str
    seconds: float
    requests: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    statuses: dict[str, int]
    socket_errors: int
    server_cpu_us_per_request: float
    server_cores: float  # the server's CPU seconds a second of the run
    client_cpu_us_per_request: float  # wrk's own
    thread_cpu_us_per_request: dict[str, float]
    # Voluntary context switches a request (all threads, and by thread): each is a thread
    # giving up its core to wait, for the GIL among others.
    waits_per_request: float
    thread_waits_per_request: dict[str, float]
    batch_rows: float = 0.0  # texts a batch, on average (0: no batch ran)
    # Shares of the run: the declared device's sleeps, and the batch worker's forwards (the
    # sleeps, the scores, and its waits for the GIL).
    device_busy: float = 0.0
    worker_busy: float = 0.0


# --- load ----------------------------------------------------------------------------------


def load_point(
    route: str, url: str, processes: Processes, seconds: float, script: Path, env: dict[str, str]
) -> LoadPoint:
    """One wrk run of `CLIENTS` connections, with the server's CPU by thread around it (all
    its processes': the split's two)."""
    names = thread_labels(processes)
    server_url = url.removesuffix("/health")
    batches_before = scrape(server_url)
    threads_before, cpu_before = threads_cpu(processes), cpu_seconds(processes)
    waits_before = threads_waits(processes)
    client_before = children_cpu_seconds()
    summary = wrk(url, CLIENTS, seconds, script, env)
    threads_after, cpu_after = threads_cpu(processes), cpu_seconds(processes)
    waits = waits_per_request(waits_before, threads_waits(processes), names, summary["requests"])
    client_used = children_cpu_seconds() - client_before
    batches = {k: v - batches_before[k] for k, v in scrape(server_url).items()}
    requests, duration = summary["requests"], summary["duration_us"] / 1e6
    count = batches["loraserve_batch_size_count"]
    slept = (
        count * SIMULATED["seconds_per_batch"]
        + batches["loraserve_batch_tokens_sum"] * SIMULATED["seconds_per_token"]
    )
    latency = summary["latency_us"]
    return LoadPoint(
        route=route,
        seconds=round(duration, 2),
        requests=requests,
        requests_per_s=round(requests / duration, 1),
        p50_ms=round(latency["p50"] / 1000, 2),
        p99_ms=round(latency["p99"] / 1000, 2),
        statuses={str(k): int(v) for k, v in summary["statuses"].items()},
        socket_errors=sum(summary["socket_errors"].values()),
        server_cpu_us_per_request=round(1e6 * (cpu_after - cpu_before) / max(requests, 1), 1),
        server_cores=round((cpu_after - cpu_before) / duration, 2),
        client_cpu_us_per_request=round(1e6 * client_used / max(requests, 1), 1),
        thread_cpu_us_per_request=per_thread_us(threads_before, threads_after, names, requests),
        waits_per_request=round(sum(waits.values()), 3),
        thread_waits_per_request=waits,
        batch_rows=round(batches["loraserve_batch_size_sum"] / count, 1) if count else 0.0,
        device_busy=round(slept / duration, 3),
        worker_busy=round(batches["loraserve_batch_inference_seconds_sum"] / duration, 3),
    )


def warm_ups(texts: Path) -> list[tuple[str, Path, dict[str, str]]]:
    """A fresh server's warm-up loads, for `warm_up`: fresh one-text /predict, then /health."""
    return [("", FRESH_LUA, fresh_env(texts)), ("/health", HEALTH_LUA, {})]


def threads_waits(processes: Processes) -> dict[int, int]:
    """Every thread of the server's processes: its voluntary context switches."""
    return {tid: count for pid in processes.values() for tid, count in thread_waits(pid).items()}


def cpu_seconds(processes: Processes) -> float:
    """The server's processes' CPU seconds, together."""
    return sum(process_cpu_seconds(pid) for pid in processes.values())


# --- the run -------------------------------------------------------------------------------


def write_models_file(folder: Path) -> Path:
    path = folder / "frontend-models.yaml"
    model = {"name": "sim", "simulated": SIMULATED, "labels": ["ham", "spam"], "max_length": 128}
    path.write_text(json.dumps({"models": [model]}, indent=2), encoding="utf-8")
    return path


@dataclass(frozen=True)
class Served:
    """A server of one layout, up: where to ask it, and its processes."""

    url: str
    processes: Processes


@contextmanager
def served(
    split: bool, name: str, env: dict[str, str], model_env: dict[str, str], code: Path = REPO
) -> Iterator[Served]:
    """The server from the checkout `code`, split or in one process, `model_env` added to the
    settings of the process that serves the model. Its processes come front end first."""
    if split:
        with split_server(name, env, model_env, code) as (url, front_end, model_side):
            yield Served(url, {"front end": front_end, "model side": model_side})
    else:
        with server(name, {**env, **model_env}, threads=1, code=code) as target:
            yield Served(target.url, {"": target.pid})


@contextmanager
def split_server(
    name: str, env: dict[str, str], model_env: dict[str, str], code: Path = REPO
) -> Iterator[tuple[str, int, int]]:
    """The split as the service runs it: the model side (`loraserve` with SPLIT_SOCKET,
    `model_env` added to its settings), then its front end (`loraserve front-end` on the same
    socket), each a server as bench.harness starts one; the front end's URL and the two
    processes' ids."""
    with tempfile.TemporaryDirectory() as folder:
        socket = {"SPLIT_SOCKET": str(Path(folder) / "model.sock")}
        with (
            server(
                f"{name}-model", {**env, **model_env, **socket}, threads=1, code=code
            ) as model_side,
            server(
                f"{name}-front", {**env, **socket}, threads=1, code=code, module=FRONT_END
            ) as front_end,
        ):
            yield front_end.url, front_end.pid, model_side.pid


def layouts_of(code: Path) -> tuple[str, ...]:
    """The layouts a checkout can run: the split, and the split pinned, from the revisions
    that have them."""
    has_split = (code / "api" / "http" / "split" / "front_end.py").is_file()
    pins = (code / "api" / "cpus.py").is_file()
    pinned = (SPLIT_PINNED, SPLIT_PINNED_SMALL_BATCHES) if pins else ()
    return (ONE_PROCESS, *((SPLIT,) if has_split else ()), *pinned)


def pinned_cpus() -> dict[str, str]:
    """The pinned split's settings: its front end on the first CPU this process may use, its
    model side on the others (on one CPU, both on it)."""
    cpus = sorted(os.sched_getaffinity(0))
    model_side = cpus[1:] or cpus
    return {"FRONT_END_CPUS": str(cpus[0]), "MODEL_CPUS": format_cpu_list(model_side)}


def layout_env(layout: str) -> dict[str, str]:
    """The settings a layout adds to both of its processes."""
    if layout == SPLIT_PINNED_SMALL_BATCHES:
        return {**pinned_cpus(), **SMALL_BATCHES}
    return pinned_cpus() if layout == SPLIT_PINNED else {}


def run(
    seconds: float, rounds: int, profile_seconds: float, out: Path, base: str | None = None
) -> dict[str, Any]:
    """The measurements of this checkout's server ("head") in each layout, and with `base`,
    of that revision's too, up beside it: each round runs each server's /health and /predict,
    the servers' order rotating, so that a drift of the machine hits all alike."""
    for tool in ("wrk", PY_SPY):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: `make bench-frontend` installs it")
    out.mkdir(parents=True, exist_ok=True)
    # The texts, the models file and py-spy's raw stacks are scratch: git-ignored, beside
    # the servers' logs, not in the report folder.
    scratch = WORK / "frontend"
    scratch.mkdir(parents=True, exist_ok=True)
    sampled = sample_texts(2000)
    texts = write_literals(sampled, scratch / "frontend-texts.txt")
    # The cached route asks for one text of the fresh ones' median length, again and again.
    median_text = sorted(sampled, key=len)[len(sampled) // 2]
    cached_env = {"BODIES": str(write_bodies([median_text], scratch / "frontend-cached.txt"))}
    env = {"MODELS_FILE": str(write_models_file(scratch))}
    code = {"head": REPO}
    base_commit = None
    if base is not None:
        code["base"], base_commit = checkout(base)
    servers = [(name, layout) for name in code for layout in layouts_of(code[name])]
    load_at_start = wait_for_quiet(LOAD_WAIT_SECONDS)["at_start"]  # the last runs' tail
    health: dict[tuple[str, str], list[LoadPoint]] = {key: [] for key in servers}
    predict: dict[tuple[str, str], list[LoadPoint]] = {key: [] for key in servers}
    cached: dict[tuple[str, str], list[LoadPoint]] = {key: [] for key in servers}
    profiled: dict[tuple[str, str], dict[str, Any]] = {}
    # Each server is started afresh in every round: one server process kept its rates ~10 %
    # above or below another's for its whole life.
    for number, key in in_turns(servers, rounds):
        name, layout = key
        split, pins = layout in SPLITS, layout_env(layout)
        with served(split, f"frontend-{name}", {**env, **pins}, {}, code[name]) as target:
            url, processes = target.url, target.processes
            # The cached route's first request fills the cache.
            warm_up(url, CLIENTS, [*warm_ups(texts), ("", LUA, cached_env)])
            health[key].append(
                load_point("/health", f"{url}/health", processes, seconds, HEALTH_LUA, {})
            )
            predict[key].append(
                load_point("/predict", url, processes, seconds, FRESH_LUA, fresh_env(texts))
            )
            cached[key].append(load_point(CACHED_ROUTE, url, processes, seconds, LUA, cached_env))
            if number == rounds - 1:
                raw = scratch / f"profile-{name}-{layout.replace(' ', '-')}"
                profiled[key] = profile(url, processes, profile_seconds, texts, raw, CLIENTS)

    def of(key: tuple[str, str]) -> dict[str, Any]:
        return summary(health[key], predict[key], cached[key], profiled[key])

    def layout_summaries(name: str) -> dict[str, Any]:
        """A revision's one process at the top, its splits (where it has them) under their
        layouts' names."""
        found = of((name, ONE_PROCESS))
        for layout in SPLITS:
            if (name, layout) in profiled:
                found[layout] = of((name, layout))
        return found

    result = {
        **run_head({**machine(), "py_spy": version("py-spy")}, load_at_start),
        "clients": CLIENTS,
        "seconds_per_run": seconds,
        "simulated": SIMULATED,
        **layout_summaries("head"),
        **({"pinned_cpus": pinned_cpus()} if SPLIT_PINNED in layouts_of(REPO) else {}),
        "targets": {"ratio": TARGET_RATIO, "p99_ms": TARGET_P99_MS},
    }
    if base_commit is not None:
        result["base"] = {
            "revision": base_commit,
            "head": head_description(),
            **layout_summaries("base"),
        }
    return result


def summary(
    health: list[LoadPoint],
    predict: list[LoadPoint],
    cached: list[LoadPoint],
    profiled: dict[str, Any],
) -> dict[str, Any]:
    """One server's rounds: the ratio of each (fresh and cached /predict to /health), the
    median round's points (by the fresh ratio), its profile."""
    ratios = [p.requests_per_s / h.requests_per_s for h, p in zip(health, predict, strict=True)]
    cached_ratios = [
        c.requests_per_s / h.requests_per_s for h, c in zip(health, cached, strict=True)
    ]
    median = sorted(range(len(ratios)), key=ratios.__getitem__)[len(ratios) // 2]
    return {
        "ratio": rounded_median(ratios, 3),
        "ratios": [round(ratio, 3) for ratio in ratios],
        "cached_ratio": rounded_median(cached_ratios, 3),
        "cached_ratios": [round(ratio, 3) for ratio in cached_ratios],
        "predict_cpu_us_median": rounded_median(p.server_cpu_us_per_request for p in predict),
        "cached_cpu_us_median": rounded_median(c.server_cpu_us_per_request for c in cached),
        "median_round": {
            "health": asdict(health[median]),
            "predict": asdict(predict[median]),
            "cached": asdict(cached[median]),
        },
        "health": [asdict(point) for point in health],
        "predict": [asdict(point) for point in predict],
        "cached": [asdict(point) for point in cached],
        "profile": profiled,
    }


LAYOUT_TITLES = {
    ONE_PROCESS: "One process",
    SPLIT: "The split: the front end and the model side apart",
    SPLIT_PINNED: "The split, pinned: each process on its own CPUs",
    SPLIT_PINNED_SMALL_BATCHES: "The split, pinned, batches of 16",
}
LAYOUT_COUNTS = {2: "Two", 3: "Three", 4: "Four"}


def described(layouts: Iterable[str], pinned: dict[str, str] | None) -> str:
    """The report's words for each layout of a run, as a list: `a, b, and c`."""
    words = {
        ONE_PROCESS: "**one process** (`loraserve`)",
        SPLIT: "**the split** (`loraserve` with `SPLIT_SOCKET`, the model side, and `loraserve "
        "front-end` on the same socket, which serves HTTP and runs /predict's lifecycle up to "
        "the model side's `classify`)",
        SPLIT_PINNED: f"**the split, pinned**: the same with {settings_named(pinned or {})}, "
        "each process on CPUs of its own (wrk on any)",
        SPLIT_PINNED_SMALL_BATCHES: "**the split, pinned, batches of 16**: the pinned split "
        f"with {settings_named(SMALL_BATCHES)}",
    }
    *others, last = (words[layout] for layout in layouts)
    return ", ".join([*others, f"and {last}"])


def settings_named(settings: dict[str, str]) -> str:
    """`NAME=value` and `NAME=value`, as the report names settings."""
    return " and ".join(f"`{name}={value}`" for name, value in settings.items())


def report(result: dict[str, Any]) -> str:
    """The Markdown report of one run."""
    m = result["machine"]
    layouts = layouts_of_run(result)
    target = result["targets"]
    written_by = "`make bench-frontend` (bench/frontend.py)."
    lines = [
        "# Front end: one text a request on a simulated device",
        "",
        machine_line(result, written_by, tools=[m["client"], f"py-spy {m['py_spy']}"]),
        "",
        f"The real server with one simulated model ({result['simulated']['seconds_per_batch']} s "
        f"a batch + {result['simulated']['seconds_per_token']} s a token, never the limit), "
        f"{result['clients']} wrk connections, {result['seconds_per_run']} s a run, /health, "
        "/predict and the cached /predict in turn; /predict sends one text never sent before "
        "a request, the cached one the same text every time (of the fresh ones' median "
        f"length), which the in-process cache holds. {LAYOUT_COUNTS[len(layouts)]} "
        "layouts, each started afresh in each round, in turns: "
        f"{described(layouts, result.get('pinned_cpus'))}. A layout's server CPU is all its "
        "processes'.",
        "",
        "## Against the target",
        "",
        f"/predict's rate at ≥ {target['ratio']} of /health's in the same round (the median "
        f"of the rounds), p99 < {target['p99_ms']} ms (the median round's).",
        "",
        "| layout | /health req/s | /predict req/s | ratio | ratio of each round | p99 ms "
        "| server CPU µs a /predict | meets the target |",
        "|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for layout, found in layouts.items():
        h, p = found["median_round"]["health"], found["median_round"]["predict"]
        met = found["ratio"] >= target["ratio"] and p["p99_ms"] < target["p99_ms"]
        lines.append(
            f"| {layout} | {h['requests_per_s']:,.0f} | {p['requests_per_s']:,.0f} "
            f"| **{found['ratio']}** | {found['ratios']} | {p['p99_ms']} "
            f"| {found['predict_cpu_us_median']} | {'yes' if met else 'no'} |"
        )
    lines += reading(layouts, target["ratio"], m["cores"])
    for layout, found in layouts.items():
        lines += layout_section(LAYOUT_TITLES[layout], found)
    if "base" in result:
        lines += comparison(result)
    return "\n".join(lines) + "\n"


# Why a layout stands where it does, after the figures that show it (the report's reading).
WHY = {
    SPLIT_PINNED: "Pinned, each event loop keeps a core of its own; unpinned, a batch's answers "
    "wake the model side, the front end and wrk at once, and the loops then wait for a core "
    "(`make bench-split-waits`).",
    SPLIT_PINNED_SMALL_BATCHES: "With 64 clients, batches of 16 keep four in flight, most "
    "likely so that each process's core more often has a batch's requests to work on.",
}
NAMED = {
    SPLIT: "the split",
    SPLIT_PINNED: "the pinned split",
    SPLIT_PINNED_SMALL_BATCHES: "the pinned split with batches of 16",
}
# Each layout against the one it adds to.
BEFORE = {SPLIT: ONE_PROCESS, SPLIT_PINNED: SPLIT, SPLIT_PINNED_SMALL_BATCHES: SPLIT_PINNED}


def reading(layouts: dict[str, dict[str, Any]], target: float, cores: int) -> list[str]:
    """What the run's figures say: each layout against the one before it, in the same
    rounds, and what bounds one process."""
    one = layouts[ONE_PROCESS]
    h, p = one["median_round"]["health"], one["median_round"]["predict"]
    lines = [
        "",
        "## What the figures say",
        "",
        "Each round starts every layout afresh, with an empty disk tier, in turns: one server "
        "process kept its rate above or below another's for its whole life, and a disk tier "
        "grown over earlier runs writes slower "
        "([Measured in tests](measured_in_tests.md#the-benchmarks-method)). So only figures "
        "of the same run compare, and each layout is set against another in the same rounds.",
        "",
        f"- **One process** is bound by its Python work, which the GIL runs one thread at a "
        f"time: its threads used {p['server_cores']} cores for /predict ({h['server_cores']} "
        f"for /health) and wrk {cores_of(p)}, of the machine's {cores}. A /health took "
        f"{h['server_cpu_us_per_request']} µs of server CPU and a fresh /predict "
        f"{p['server_cpu_us_per_request']}: to reach {target} of /health's rate on that core, "
        f"a /predict would have to take {h['server_cpu_us_per_request'] / target:.0f} µs in "
        "all.",
    ]
    for layout, found in layouts.items():
        if layout not in BEFORE or BEFORE[layout] not in layouts:
            continue
        before = BEFORE[layout]
        base = layouts[before]
        above = sum(a > b for a, b in zip(found["ratios"], base["ratios"], strict=True))
        why = f" {WHY[layout]}" if layout in WHY else ""
        named = the(layout)
        lines.append(
            f"- **{named[0].upper()}{named[1:]}** served {more(found, base)} more /predict "
            f"requests a second than {the(before)} (medians of the rounds), its ratio above "
            f"{the(before)}'s in {above} of {len(found['ratios'])} rounds, at "
            f"{found['predict_cpu_us_median']} µs of server CPU a /predict against "
            f"{base['predict_cpu_us_median']}.{why}"
        )
    return lines


def the(layout: str) -> str:
    """A layout as a sentence names it: "one process", "the pinned split"."""
    return NAMED.get(layout, layout)


def cores_of(point: dict[str, Any]) -> float:
    """wrk's cores over a run: its CPU a request times the requests a second."""
    return round(point["client_cpu_us_per_request"] * point["requests_per_s"] / 1e6, 2)


def more(found: dict[str, Any], base: dict[str, Any]) -> str:
    """How much more /predict a layout served than `base`: a share, the medians of the
    rounds' rates."""
    rates = [rounded_median(p["requests_per_s"] for p in each["predict"]) for each in (found, base)]
    return f"{rates[0] / rates[1] - 1:.0%}"


def layouts_of_run(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A revision's figures by layout: its one process's at the top of `found`, its splits'
    (where it has them) under their layouts' names."""
    return {ONE_PROCESS: found, **{layout: found[layout] for layout in SPLITS if layout in found}}


def layout_section(title: str, found: dict[str, Any]) -> list[str]:
    """One layout's median round by route, its cached /predict, its device, its CPU by stage
    and by thread."""
    h, p, c = (found["median_round"][route] for route in ("health", "predict", "cached"))
    prof = found["profile"]
    lines = [
        "",
        f"## {title}",
        "",
        "| route | req/s | p50 ms | p99 ms | statuses | server CPU µs/request | server cores "
        "| server waits/request | wrk CPU µs/request |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for point in (h, p, c):
        lines.append(
            f"| {point['route']} | {point['requests_per_s']:,.0f} | {point['p50_ms']} | "
            f"{point['p99_ms']} | {point['statuses']} | {point['server_cpu_us_per_request']} | "
            f"{point['server_cores']} | {point.get('waits_per_request', '—')} | "
            f"{point['client_cpu_us_per_request']} |"
        )
    lines += [
        "",
        "Server waits: the kernel's voluntary context switches of the server's threads a "
        "request, each a thread giving up its core to wait (for the GIL, a lock, a sleep).",
        "",
        f"{CACHED_ROUTE} at **{found['cached_ratio']}** of /health's rate (median of the "
        f"rounds {found['cached_ratios']}; {found['cached_cpu_us_median']} µs of server CPU "
        f"a request against {found['predict_cpu_us_median']} for a fresh one): the HTTP "
        "server, the route, the lifecycle and the cache, without the model path (tokenizing, "
        "admission, the batcher, the batch worker, the disk tier).",
        "",
        f"In the median round's /predict run the declared device slept {p['device_busy']:.0%} "
        f"of the time (batches of {p['batch_rows']} texts on average), and the batch worker "
        f"took {p['worker_busy']:.0%} of it for its forwards: the sleeps, the scores, and its "
        "waits for the GIL, which the event loop holds while it works.",
        "",
        "### CPU per /predict request by stage",
        "",
        f"py-spy, {prof['samples']} samples over a profiled run ({prof['requests_per_s']:,.0f} "
        f"req/s while profiled; {prof['server_cpu_us_per_request']} µs of server CPU a "
        "request): each thread's CPU time from /proc, shared out by its samples' stages.",
        "",
    ]
    processes: dict[str, dict[str, Any]] = prof.get("processes", {})
    headers = "".join(f" {label} µs |" for label in processes)
    lines += [
        f"| stage | share | CPU µs/request |{headers}",
        "|---|---|---|" + "---|" * len(processes),
    ]
    for stage, values in sorted(prof["stages"].items(), key=lambda item: -item[1]["share"]):
        cells = "".join(
            f" {each['stages'].get(stage, {}).get('cpu_us_per_request', 0.0)} |"
            for each in processes.values()
        )
        lines.append(f"| {stage} | {values['share']:.1%} | {values['cpu_us_per_request']} |{cells}")
    if processes:
        cells = "".join(f" {each['server_cpu_us_per_request']} |" for each in processes.values())
        lines.append(f"| all | 100% | {prof['server_cpu_us_per_request']} |{cells}")
    lines += [
        "",
        "### CPU per request by thread (/proc, the median round)",
        "",
        "| thread | /health µs | /predict µs |",
        "|---|---|---|",
    ]
    names = dict.fromkeys([*p["thread_cpu_us_per_request"], *h["thread_cpu_us_per_request"]])
    for name in names:
        lines.append(
            f"| {name} | {h['thread_cpu_us_per_request'].get(name, 0.0)} | "
            f"{p['thread_cpu_us_per_request'].get(name, 0.0)} |"
        )
    return lines


def comparison(result: dict[str, Any]) -> list[str]:
    """The base revision against this checkout, measured in the same run."""
    base = result["base"]
    lines = [
        "",
        f"## Before and after: {base['revision']} and {base['head']}, in this run",
        "",
        f"Each revision's servers started afresh in each of the {len(base['ratios'])} rounds, "
        "all taking turns (the median round's rates and p99; the ratio and the server CPU "
        "a /predict are medians of the rounds; each server's own profiled run, in the last "
        "round, for the stages). A revision without the split runs in one process only.",
        "",
        "| revision | layout | /health req/s | /predict req/s | ratio | ratio of each round "
        "| /predict p99 ms | server CPU µs a /predict | cached ratio |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, found in ((base["revision"], base), (base["head"], result)):
        for layout, each in layouts_of_run(found).items():
            h, p = each["median_round"]["health"], each["median_round"]["predict"]
            lines.append(
                f"| {name} | {layout} | {h['requests_per_s']:,.0f} | {p['requests_per_s']:,.0f} "
                f"| {each['ratio']} | {each['ratios']} | {p['p99_ms']} "
                f"| {each['predict_cpu_us_median']} | {each['cached_ratio']} |"
            )
    lines += [
        "",
        "One process, CPU µs a /predict by thread (/proc, medians of the rounds):",
        "",
        f"| thread | {base['revision']} | {base['head']} |",
        "|---|---:|---:|",
    ]
    medians = [thread_medians(found["predict"]) for found in (base, result)]
    for thread in dict.fromkeys([*medians[0], *medians[1]]):
        was, now = (found.get(thread, 0.0) for found in medians)
        lines.append(f"| {thread} | {was} | {now} |")
    before, after = base["profile"]["stages"], result["profile"]["stages"]
    lines += [
        "",
        "One process, CPU µs a /predict by stage (each revision's profiled run):",
        "",
        "| stage | before µs/request | after µs/request |",
        "|---|---:|---:|",
    ]
    for stage in sorted(
        set(before) | set(after), key=lambda s: -before.get(s, {}).get("cpu_us_per_request", 0)
    ):
        was = before.get(stage, {}).get("cpu_us_per_request", 0.0)
        now = after.get(stage, {}).get("cpu_us_per_request", 0.0)
        lines.append(f"| {stage} | {was} | {now} |")
    lines.append(
        f"| all | {base['profile']['server_cpu_us_per_request']} "
        f"| {result['profile']['server_cpu_us_per_request']} |"
    )
    return lines


def thread_medians(points: list[dict[str, Any]]) -> dict[str, float]:
    """Each thread's CPU µs a request, the median of the rounds (0 where a round lacks it)."""
    threads = dict.fromkeys(name for point in points for name in point["thread_cpu_us_per_request"])
    return {
        name: rounded_median(p["thread_cpu_us_per_request"].get(name, 0.0) for p in points)
        for name in threads
    }


def rounded_median(values: Iterable[float], digits: int = 1) -> float:
    """The median, rounded: with an even number of rounds it is the mean of two."""
    return round(statistics.median(values), digits)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out(parser, quick_help="smoke run: 2 s runs, one round")
    parser.add_argument("--seconds", type=float, help="seconds a run (default 10)")
    parser.add_argument("--rounds", type=int, help="/health + /predict rounds (default 3)")
    parser.add_argument("--base", help="a revision to measure beside this checkout, in turns")
    args = parser.parse_args()
    quick = args.quick
    seconds = args.seconds or (2.0 if quick else 10.0)
    rounds = args.rounds or (1 if quick else 3)
    out = out_folder(args.out, quick, "frontend")
    result = run(seconds, rounds, seconds, out, args.base)
    write_report(out, "frontend", result, report(result))


if __name__ == "__main__":
    main()
