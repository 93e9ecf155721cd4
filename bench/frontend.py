"""The service's own work per request on the model path, at one text a request, with a device
fast enough never to be the limit: what caps one process whatever the GPU can do.

Run: `python -m bench.frontend` (or `make bench-frontend`); `--quick` is a smoke run of about
half a minute that writes into bench/out/frontend-quick/ instead. It needs `wrk` and `py-spy`
(the project's `bench` extra; `make bench-frontend` installs both). Writes
bench/reports/frontend.{md,json}. In one run:

- the real server process (`python -m api.cli`, default settings but LOG_LEVEL=warning: no
  access line a request) with a models file holding only a simulated model (`simulated:` in
  the models file: the embedded base's tokenizer, no weights, each batch answered after
  sleeping SIMULATED's 0.5 ms + 0.1 µs a token);
- `/health` and fresh one-text `/predict` requests (texts never sent before, so no cache tier
  answers: bench/wrk/fresh.lua) from 64 wrk connections, alternating for a few rounds: the
  requests/s of each, the ratio (median of the rounds'), and /predict's p50 and p99;
- in the same rounds, `/predict` of one text the in-process cache holds (one body,
  bench/wrk/predict.lua): the route, the lifecycle and the cache without the model path,
  which is what a front-end process apart from the model would keep of a fresh `/predict`;
- CPU time and waits (voluntary context switches) per request of each of the server's
  threads (/proc/<pid>/task/*/stat and status, named through `py-spy dump`), in the same runs;
- a profile of one more /predict run by `py-spy record` (raw folded stacks, threads on a
  CPU): each sample goes to the stage of its innermost frame that names one (see RULES), and
  each thread's CPU time in that run (/proc) is shared out by its samples. Profiled, the
  server runs slower; the shares, not that run's rate, are the point.

Each round starts the server afresh (one process kept its rates ~10 % above or below another's
for its whole life). With `--base <revision>` that revision's server (a git worktree under
bench/out/) takes turns with this checkout's in every round, and each is profiled: the report
adds both, before and after, as measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path
from typing import Any

from bench.revisions import checkout, head_description
from bench.threads import (
    PY_SPY,
    per_thread_us,
    thread_cpu_seconds,
    thread_names,
    thread_waits,
    waits_per_request,
)
from bench.throughput import (
    FRESH_LUA,
    LUA,
    REPORTS,
    WORK,
    children_cpu_seconds,
    in_turn,
    machine,
    process_cpu_seconds,
    sample_texts,
    scrape,
    server,
    wait_for_quiet,
    write_bodies,
    write_literals,
    wrk,
)

REPO = Path(__file__).resolve().parents[1]
HEALTH_LUA = REPO / "bench" / "wrk" / "health.lua"
CLIENTS = 64
# Small enough never to be the limit: at the example cost (2 ms a batch + 1 µs a
# padded token) a batch of 32 SMS slept ~4.3 ms, and two such batches in turn held the 64
# clients' requests as long as the loop took to serve them. The report gives the share of
# each /predict run that the declared device was busy.
SIMULATED = {"seconds_per_batch": 0.0005, "seconds_per_token": 0.0000001}
# What the issue asks of one process: /predict at this share of /health's rate, p99 below.
TARGET_RATIO = 0.6
TARGET_P99_MS = 50.0
PROFILE_RATE = 250  # samples a second per thread on a CPU
LOAD_WAIT_SECONDS = 900  # at most, for the 1-min load average to come down to 1


@dataclass(frozen=True)
class Rule:
    """A frame whose file path holds `path` (and, when given, whose function is one of
    `functions`) belongs to `stage`."""

    stage: str
    path: str
    functions: tuple[str, ...] = ()

    def matches(self, function: str, filename: str) -> bool:
        if self.path not in filename:
            return False
        return not self.functions or function.rsplit(".", 1)[-1] in self.functions


CACHED_ROUTE = "/predict, cached"
QUEUE = "queue, futures, device hand-off"
ASGI = "ASGI layers (starlette, fastapi, middleware)"
# A sample's stage is that of its innermost frame that one of these rules matches, trying
# the rules in this order on each frame: a library's work goes to the stage of the code that
# called it (json under a response, pydantic under the body's read), the service's own
# frames to theirs, and what is left to the layer it runs in.
RULES = (
    Rule("tokenizing", "api/models/tokenizing.py"),
    Rule("tokenizing", "api/serving/gathered_encoding.py"),
    Rule(
        "tokenizing",
        "api/models/predictor.py",
        ("encode", "encode_many", "_refusal", "_encode_prompted", "_encode_prompted_request"),
    ),
    Rule("predictor", "api/models/"),
    Rule("predictor", "api/http/app.py", ("predict_batch",)),
    Rule("cache lookup and store", "api/serving/cache/"),
    Rule("admission", "api/serving/admission.py"),
    Rule(QUEUE, "api/serving/batching.py", ("submit", "_run_rows", "_deliver", "_fail")),
    Rule(QUEUE, "api/serving/batching.py", ("_settle", "settled", "_expire")),
    Rule(QUEUE, "api/serving/batching.py", ("_retrieve",)),
    Rule("batch assembly", "api/serving/batching.py"),
    Rule("body parse and validation", "api/http/routes/common.py", ("read_body",)),
    Rule("response", "starlette/responses.py"),
    Rule("response", "fastapi/routing.py", ("serialize_response",)),
    Rule("response", "api/serving/ranking.py"),
    Rule("response", "api/http/lifecycle.py", ("headers",)),
    Rule("metrics", "prometheus_client/"),
    Rule("metrics", "api/http/middleware/observe.py"),
    Rule(ASGI, "api/http/middleware/"),
    Rule("route and lifecycle", "api/http/"),
    Rule("route and lifecycle", "api/serving/"),
    Rule(QUEUE, "concurrent/futures/"),
    Rule(QUEUE, "asyncio/futures.py"),
    Rule(QUEUE, "asyncio/tasks.py", ("wait", "_wait", "_release_waiter", "_on_completion")),
    Rule("body parse and validation", "pydantic"),
    Rule("body parse and validation", "json/decoder.py"),
    Rule("HTTP server (uvicorn)", "uvicorn/"),
    Rule("HTTP server (uvicorn)", "h11/"),
    Rule("HTTP server (uvicorn)", "httptools"),
    Rule(ASGI, "starlette/"),
    Rule(ASGI, "fastapi/"),
    Rule(ASGI, "anyio/"),
    # The loop's own work in C (uvloop: sockets, callbacks) shows as its Python caller.
    Rule("event loop", "asyncio/"),
    Rule("event loop", "uvloop"),
)
OTHER = "other"
NATIVE = "native threads"
STAGES = tuple(dict.fromkeys([rule.stage for rule in RULES] + [OTHER, NATIVE]))


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


# --- profile -------------------------------------------------------------------------------


def split_frame(frame: str) -> tuple[str, str]:
    """`function (path:line)` as py-spy writes it -> (function, path)."""
    function, _, where = frame.partition(" (")
    return function, where.rsplit(":", 1)[0]


def stage_of(frames: list[str]) -> str:
    """The stage of one stack (outermost frame first)."""
    for frame in reversed(frames):
        function, path = split_frame(frame)
        for rule in RULES:
            if rule.matches(function, path):
                return rule.stage
    return OTHER


def fold(raw: str) -> dict[int, Counter[str]]:
    """py-spy's raw output (`thread (tid): name;frame;...;frame count` a line) as samples per
    stage, by native thread id."""
    threads: dict[int, Counter[str]] = {}
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        tid = int(thread.partition("(")[2].partition(")")[0])
        threads.setdefault(tid, Counter())[stage_of(frames)] += int(count)
    return threads


def cpu_by_stage(samples: dict[int, Counter[str]], cpu: dict[int, float]) -> Counter[str]:
    """Each thread's CPU seconds (`cpu`, from /proc) shared out by its samples' stages.

    py-spy marks a thread on a CPU or not from its kernel state at the sample, which under
    load also counts threads just woken or about to wait (the device thread in its sleep, an
    executor's worker at its queue); /proc's count is exact per thread, so the samples only
    split each thread's time. A thread without a sample (native, not Python) is NATIVE.
    """
    stages: Counter[str] = Counter()
    for tid, seconds in cpu.items():
        counts = samples.get(tid)
        if not counts:
            stages[NATIVE] += seconds
            continue
        total = sum(counts.values())
        for stage, count in counts.items():
            stages[stage] += seconds * count / total
    return stages


# --- load ----------------------------------------------------------------------------------


def load_point(
    route: str, url: str, pid: int, seconds: float, script: Path, env: dict[str, str]
) -> LoadPoint:
    """One wrk run of `CLIENTS` connections, with the server's CPU by thread around it."""
    names = thread_names(pid)
    server_url = url.removesuffix("/health")
    batches_before = scrape(server_url)
    threads_before, cpu_before = thread_cpu_seconds(pid), process_cpu_seconds(pid)
    waits_before = thread_waits(pid)
    client_before = children_cpu_seconds()
    summary = wrk(url, CLIENTS, seconds, script, env)
    threads_after, cpu_after = thread_cpu_seconds(pid), process_cpu_seconds(pid)
    waits = waits_per_request(waits_before, thread_waits(pid), names, summary["requests"])
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


def fresh_env(texts: Path) -> dict[str, str]:
    """fresh.lua's settings: one text a request, prefixed so that no run repeats one."""
    return {"TEXTS": str(texts), "TEXTS_PER": "1", "RUN": uuid.uuid4().hex[:8]}


def profile(url: str, pid: int, seconds: float, texts: Path, raw_path: Path) -> dict[str, Any]:
    """A /predict run under `py-spy record` (its raw stacks written to `raw_path`); the
    server's CPU by stage and by thread."""
    command = [PY_SPY, "record", "--pid", str(pid), "--duration", str(round(seconds) + 1)]
    command += ["--rate", str(PROFILE_RATE), "--format", "raw", "--threads"]
    command += ["--full-filenames", "--nonblocking", "--output", str(raw_path)]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # attached before the load starts
    names = thread_names(pid)
    before = thread_cpu_seconds(pid)
    summary = wrk(url, CLIENTS, seconds, FRESH_LUA, fresh_env(texts))
    after = thread_cpu_seconds(pid)
    _, errors = recorder.communicate(timeout=seconds + 60)
    if recorder.returncode != 0 or not raw_path.exists():
        raise RuntimeError(f"py-spy record failed ({recorder.returncode}): {errors.decode()}")
    samples = fold(raw_path.read_text(encoding="utf-8"))
    cpu = {tid: seconds - before.get(tid, ("", 0.0))[1] for tid, (_, seconds) in after.items()}
    stages = cpu_by_stage(samples, {tid: used for tid, used in cpu.items() if used > 0})
    requests = summary["requests"]
    total = sum(stages.values()) or 1.0
    return {
        "requests": requests,
        "requests_per_s": round(requests / (summary["duration_us"] / 1e6), 1),
        "samples": sum(sum(counts.values()) for counts in samples.values()),
        "server_cpu_us_per_request": round(1e6 * total / max(requests, 1), 1),
        "stages": {
            stage: {
                "share": round(stages[stage] / total, 4),
                "cpu_us_per_request": round(1e6 * stages[stage] / max(requests, 1), 1),
            }
            for stage in STAGES
            if stages[stage]
        },
        "thread_samples": {
            names.get(tid, str(tid)): sum(counts.values()) for tid, counts in samples.items()
        },
    }


# --- the run -------------------------------------------------------------------------------


def write_models_file(folder: Path) -> Path:
    path = folder / "frontend-models.yaml"
    model = {"name": "sim", "simulated": SIMULATED, "labels": ["ham", "spam"], "max_length": 128}
    path.write_text(json.dumps({"models": [model]}, indent=2), encoding="utf-8")
    return path


def run(
    seconds: float, rounds: int, profile_seconds: float, out: Path, base: str | None = None
) -> dict[str, Any]:
    """The measurements of this checkout's server ("head"), and with `base`, of that
    revision's server too, up beside it: each round runs each server's /health and /predict,
    the servers' order alternating, so that a drift of the machine hits both alike."""
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
    load_at_start = wait_for_quiet(LOAD_WAIT_SECONDS)["at_start"]  # the last runs' tail
    health: dict[str, list[LoadPoint]] = {name: [] for name in code}
    predict: dict[str, list[LoadPoint]] = {name: [] for name in code}
    cached: dict[str, list[LoadPoint]] = {name: [] for name in code}
    profiled: dict[str, dict[str, Any]] = {}
    names = list(code)
    for number in range(rounds):
        # Each revision's server is started afresh in every round: one server process kept
        # its rates ~10 % above or below another's for its whole life.
        for name in in_turn(names, number):
            with server(f"frontend-{name}", env, threads=1, code=code[name]) as target:
                url, pid = target.url, target.pid
                wrk(url, CLIENTS, 1, FRESH_LUA, fresh_env(texts))  # warm-ups
                wrk(f"{url}/health", CLIENTS, 1, HEALTH_LUA, {})
                wrk(url, CLIENTS, 1, LUA, cached_env)  # its first request fills the cache
                health[name].append(
                    load_point("/health", f"{url}/health", pid, seconds, HEALTH_LUA, {})
                )
                predict[name].append(
                    load_point("/predict", url, pid, seconds, FRESH_LUA, fresh_env(texts))
                )
                cached[name].append(load_point(CACHED_ROUTE, url, pid, seconds, LUA, cached_env))
                if number == rounds - 1:
                    raw_path = scratch / f"profile-{name}.txt"
                    profiled[name] = profile(url, pid, profile_seconds, texts, raw_path)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {**machine(), "py_spy": version("py-spy")},
        "load_average_at_start": load_at_start,
        "clients": CLIENTS,
        "seconds_per_run": seconds,
        "simulated": SIMULATED,
        **summary(health["head"], predict["head"], cached["head"], profiled["head"]),
        "targets": {"ratio": TARGET_RATIO, "p99_ms": TARGET_P99_MS},
    }
    if base_commit is not None:
        result["base"] = {
            "revision": base_commit,
            "head": head_description(),
            **summary(health["base"], predict["base"], cached["base"], profiled["base"]),
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


def report(result: dict[str, Any]) -> str:
    """The Markdown report of one run."""
    m, h, p = result["machine"], result["median_round"]["health"], result["median_round"]["predict"]
    c = result["median_round"]["cached"]
    prof = result["profile"]
    lines = [
        "# Front end: one text a request on a simulated device",
        "",
        f"{result['date']}; {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB; Python "
        f"{m['python']}; {m['client']}; py-spy {m['py_spy']}; load average at start "
        f"{result['load_average_at_start']}. Written by `make bench-frontend` (bench/frontend.py).",
        "",
        f"The real server with one simulated model ({result['simulated']['seconds_per_batch']} s "
        f"a batch + {result['simulated']['seconds_per_token']} s a token, never the limit), "
        f"{result['clients']} wrk connections, {result['seconds_per_run']} s a run, /health, "
        "/predict and the cached /predict in turn; /predict sends one text never sent before "
        "a request, the cached one the same text every time (of the fresh ones' median "
        "length), which the in-process cache holds.",
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
    ]
    target = result["targets"]
    lines += [
        "",
        f"/predict at **{result['ratio']}** of /health's rate (median of the rounds "
        f"{result['ratios']}; target ≥ {target['ratio']}), p99 {p['p99_ms']} ms (target < "
        f"{target['p99_ms']} ms).",
        "",
        f"{CACHED_ROUTE} at **{result['cached_ratio']}** of /health's rate (median of the "
        f"rounds {result['cached_ratios']}; {result['cached_cpu_us_median']} µs of server CPU "
        f"a request against {result['predict_cpu_us_median']} for a fresh one): the HTTP "
        "server, the route, the lifecycle and the cache, without the model path (tokenizing, "
        "admission, the batcher, the batch worker, the disk tier), which is what a front-end "
        "process apart from the model would keep of a /predict, before its hop to the model.",
        "",
        f"In that /predict run the declared device slept {p['device_busy']:.0%} of the time "
        f"(batches of {p['batch_rows']} texts on average), and the batch worker took "
        f"{p['worker_busy']:.0%} of it for its forwards: the sleeps, the scores, and its waits "
        "for the GIL, which the event loop holds while it works.",
        "",
        "## CPU per /predict request by stage",
        "",
        f"py-spy, {prof['samples']} samples over a profiled run ({prof['requests_per_s']:,.0f} "
        f"req/s while profiled; {prof['server_cpu_us_per_request']} µs of server CPU a "
        "request): each thread's CPU time from /proc, shared out by its samples' stages.",
        "",
        "| stage | share | CPU µs/request |",
        "|---|---|---|",
    ]
    for stage, values in sorted(prof["stages"].items(), key=lambda item: -item[1]["share"]):
        lines.append(f"| {stage} | {values['share']:.1%} | {values['cpu_us_per_request']} |")
    lines += [
        "",
        "## CPU per request by thread (/proc, the median round)",
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
    if "base" in result:
        lines += comparison(result)
    return "\n".join(lines) + "\n"


def comparison(result: dict[str, Any]) -> list[str]:
    """The base revision against this checkout, measured in the same run."""
    base = result["base"]
    lines = [
        "",
        f"## Before and after: {base['revision']} and {base['head']}, in this run",
        "",
        f"Each revision's server started afresh in each of the {len(base['ratios'])} rounds, "
        "the two taking turns (the median round's rates and p99; the ratio and the server CPU "
        "a /predict are medians of the rounds; each revision's own profiled run, in the last "
        "round, for the stages).",
        "",
        "| | /health req/s | /predict req/s | ratio | ratio of each round | /predict p99 ms "
        "| server CPU µs a /predict | cached ratio |",
        "|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for name, found in ((base["revision"], base), (base["head"], result)):
        h, p = found["median_round"]["health"], found["median_round"]["predict"]
        lines.append(
            f"| {name} | {h['requests_per_s']:,.0f} | {p['requests_per_s']:,.0f} "
            f"| {found['ratio']} | {found['ratios']} | {p['p99_ms']} "
            f"| {found['predict_cpu_us_median']} | {found['cached_ratio']} |"
        )
    lines += [
        "",
        "CPU µs a /predict by thread (/proc, medians of the rounds):",
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
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 s runs, one round")
    parser.add_argument("--seconds", type=float, help="seconds a run (default 10)")
    parser.add_argument("--rounds", type=int, help="/health + /predict rounds (default 3)")
    parser.add_argument("--out", type=Path, help="report folder (default bench/reports)")
    parser.add_argument("--base", help="a revision to measure beside this checkout, in turns")
    args = parser.parse_args()
    quick = args.quick
    seconds = args.seconds or (2.0 if quick else 10.0)
    rounds = args.rounds or (1 if quick else 3)
    out = args.out or (REPO / "bench" / "out" / "frontend-quick" if quick else REPORTS)
    result = run(seconds, rounds, seconds, out, args.base)
    (out / "frontend.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "frontend.md").write_text(report(result), encoding="utf-8")
    print(report(result))


if __name__ == "__main__":
    main()
