"""Where a server's CPU goes, by stage: `py-spy record` of its processes under a wrk load,
each sample given to the stage of its innermost frame that names one (see RULES), and each
thread's CPU time from /proc shared out by its samples. bench.frontend profiles the simulated
device with it, bench.revisions the real model, before and after a change."""

from __future__ import annotations

import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import FRESH_LUA, fresh_env, wrk
from bench.threads import PY_SPY, thread_cpu_seconds, thread_names

PROFILE_RATE = 250  # samples a second per thread on a CPU
# A layout's processes by label: "" for the one process (its threads need no prefix), or the
# split's "front end" and "model side".
Processes = dict[str, int]


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
    Rule("predictor", "api/service/runners.py", ("predict_batch",)),
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
    Rule("response", "api/http/classifying.py", ("answer_headers",)),
    Rule("metrics", "prometheus_client/"),
    Rule("metrics", "api/http/middleware/observe.py"),
    Rule(ASGI, "api/http/middleware/"),
    Rule("route and lifecycle", "api/http/"),
    Rule("route and lifecycle", "api/serving/"),
    Rule("route and lifecycle", "api/service/"),
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


def thread_labels(processes: Processes) -> dict[int, str]:
    """Native thread id -> its row in the report: the Python thread's name (the kernel's,
    marked native, for a thread that runs no Python), after its process's label in the
    split, whose two processes have threads of the same names."""
    labels: dict[int, str] = {}
    for label, pid in processes.items():
        python = thread_names(pid)
        for tid, (comm, _) in thread_cpu_seconds(pid).items():
            name = python.get(tid) or f"{comm} (native)"
            labels[tid] = f"{label}: {name}" if label else name
    return labels


def threads_cpu(processes: Processes) -> dict[int, tuple[str, float]]:
    """Every thread of the server's processes: its command name and CPU seconds (thread ids
    are the system's, never shared between processes)."""
    return {tid: cpu for pid in processes.values() for tid, cpu in thread_cpu_seconds(pid).items()}


def profile(
    url: str, processes: Processes, seconds: float, texts: Path, raw: Path, clients: int
) -> dict[str, Any]:
    """A /predict run of fresh one-text requests (the texts of `texts`) from `clients` wrk
    connections under `py-spy record`, one recorder a process (raw stacks written to
    `raw`-<label>.txt); the server's CPU by stage, all its processes' together and, in the
    split, each one's; its samples by thread."""
    recorders = {
        label: record(pid, seconds, raw.with_name(f"{raw.name}{label_suffix(label)}.txt"))
        for label, pid in processes.items()
    }
    time.sleep(0.5)  # attached before the load starts
    names = thread_labels(processes)
    before = {label: thread_cpu_seconds(pid) for label, pid in processes.items()}
    summary = wrk(url, clients, seconds, FRESH_LUA, fresh_env(texts))
    after = {label: thread_cpu_seconds(pid) for label, pid in processes.items()}
    requests = summary["requests"]
    all_stages: Counter[str] = Counter()
    each: dict[str, dict[str, Any]] = {}
    thread_samples: Counter[str] = Counter()  # threads of one name together
    for label, (recorder, raw_path) in recorders.items():
        _, errors = recorder.communicate(timeout=seconds + 60)
        if recorder.returncode != 0 or not raw_path.exists():
            raise RuntimeError(f"py-spy record failed ({recorder.returncode}): {errors.decode()}")
        samples = fold(raw_path.read_text(encoding="utf-8"))
        used = {
            tid: spent - before[label].get(tid, ("", 0.0))[1]
            for tid, (_, spent) in after[label].items()
        }
        stages = cpu_by_stage(samples, {tid: cpu for tid, cpu in used.items() if cpu > 0})
        all_stages.update(stages)
        each[label] = stage_figures(stages, requests)
        for tid, counts in samples.items():
            thread_samples[names.get(tid, str(tid))] += sum(counts.values())
    found = {
        "requests": requests,
        "requests_per_s": round(requests / (summary["duration_us"] / 1e6), 1),
        "samples": sum(thread_samples.values()),
        **stage_figures(all_stages, requests),
        "thread_samples": dict(thread_samples),
    }
    if len(processes) > 1:
        found["processes"] = each
    return found


def label_suffix(label: str) -> str:
    """What a process's label adds to its file names: "-front-end", or nothing."""
    return f"-{label.replace(' ', '-')}" if label else ""


def record(pid: int, seconds: float, raw_path: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """`py-spy record` of one process over the next `seconds` (and one more), started."""
    command = [PY_SPY, "record", "--pid", str(pid), "--duration", str(round(seconds) + 1)]
    command += ["--rate", str(PROFILE_RATE), "--format", "raw", "--threads"]
    command += ["--full-filenames", "--nonblocking", "--output", str(raw_path)]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return recorder, raw_path


def stage_figures(stages: Counter[str], requests: int) -> dict[str, Any]:
    """CPU seconds by stage as the report gives them: each stage's share and µs a request,
    and the µs a request of all of them."""
    total = sum(stages.values()) or 1.0
    return {
        "server_cpu_us_per_request": round(1e6 * total / max(requests, 1), 1),
        "stages": {
            stage: {
                "share": round(stages[stage] / total, 4),
                "cpu_us_per_request": round(1e6 * stages[stage] / max(requests, 1), 1),
            }
            for stage in STAGES
            if stages[stage]
        },
    }
