"""bench.stages' profile folding (each py-spy stack goes to the stage of the code that
called the library at its leaf, and samples are counted by stage and by thread), and
bench.frontend's summary of the rounds (each route's rate against the same round's /health)
and the waits (voluntary context switches) it reads from /proc."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import pytest

from bench.frontend import (
    CACHED_ROUTE,
    SPLIT,
    SPLIT_PINNED,
    SPLIT_PINNED_SMALL_BATCHES,
    TARGET_P99_MS,
    TARGET_RATIO,
    LoadPoint,
    report,
    summary,
)
from bench.stages import ASGI, NATIVE, QUEUE, cpu_by_stage, fold, stage_of
from bench.threads import thread_waits, waits_per_request

SITE = "/venv/lib/python3.11/site-packages"
LOOP = [
    f"Server.run ({SITE}/uvicorn/server.py:67)",
    "Runner.run (/usr/lib/python3.11/asyncio/runners.py:118)",
]
MIDDLEWARE = [
    *LOOP,
    "RequestMetrics.__call__ (/app/api/http/middleware/observe.py:98)",
    "BodySizeLimit.__call__ (/app/api/http/middleware/body_limit.py:52)",
    f"Router.__call__ ({SITE}/starlette/routing.py:683)",
]
ROUTE = [*MIDDLEWARE, "predict (/app/api/http/routes/tei.py:40)"]


def test_a_library_call_counts_for_the_stage_that_made_it() -> None:
    json_dump = [*ROUTE, f"JSONResponse.render ({SITE}/starlette/responses.py:190)"]
    assert stage_of([*json_dump, "dumps (/usr/lib/python3.11/json/__init__.py:238)"]) == (
        "response"
    )
    body = [*ROUTE, "read_body (/app/api/http/routes/common.py:60)"]
    assert stage_of([*body, f"BaseModel.model_validate ({SITE}/pydantic/main.py:700)"]) == (
        "body parse and validation"
    )
    routing = f"APIRouter.matches ({SITE}/fastapi/routing.py:3025)"
    assert stage_of([*MIDDLEWARE, routing]) == ASGI
    encode = "TextEncoder.encode (/app/api/models/tokenizing.py:70)"
    compute = "ModelRunner._compute (/app/api/serving/classify.py:110)"
    assert stage_of([*ROUTE, compute, encode]) == "tokenizing"
    wait = "wait (/usr/lib/python3.11/asyncio/tasks.py:418)"
    submit = "Batcher.submit (/app/api/serving/batching.py:230)"
    assert stage_of([*ROUTE, compute, submit, wait]) == QUEUE
    assert stage_of([*LOOP]) == "event loop"
    assert stage_of([*ROUTE, compute, submit]) == QUEUE
    assert stage_of(["main (/elsewhere/tool.py:1)"]) == "other"


def test_each_threads_cpu_time_is_shared_out_by_its_samples() -> None:
    forward = "SimulatedPredictor._scores (/app/api/models/simulated.py:120)"
    wait = "_worker (/usr/lib/python3.11/concurrent/futures/thread.py:81)"
    raw = "\n".join(
        [
            f"thread (11): MainThread;{';'.join(LOOP)} 6",
            f"thread (12): infer-meta_0;{forward} 1",
            f"thread (12): infer-meta_0;{wait} 3",
            f"thread (11): MainThread;{';'.join(ROUTE)} 2",
        ]
    )
    samples = fold(raw + "\n")
    main, device = {"event loop": 6, "route and lifecycle": 2}, {"predictor": 1, QUEUE: 3}
    assert samples == {11: main, 12: device}
    # Thread 13 ran native code only: no Python sample.
    stages = cpu_by_stage(samples, {11: 0.8, 12: 0.2, 13: 0.1})
    assert stages == pytest.approx(
        {"event loop": 0.6, "route and lifecycle": 0.2, "predictor": 0.05, QUEUE: 0.15, NATIVE: 0.1}
    )


def load_point(route: str, rate: float, cpu_us: float, p99_ms: float = 2.0) -> LoadPoint:
    return LoadPoint(
        route=route,
        seconds=10.0,
        requests=int(rate * 10),
        requests_per_s=rate,
        p50_ms=1.0,
        p99_ms=p99_ms,
        statuses={"200": int(rate * 10)},
        socket_errors=0,
        server_cpu_us_per_request=cpu_us,
        server_cores=1.0,
        client_cpu_us_per_request=20.0,
        thread_cpu_us_per_request={"MainThread": cpu_us},
        waits_per_request=0.0,
        thread_waits_per_request={},
    )


def test_each_round_compares_fresh_and_cached_predict_with_its_own_health() -> None:
    health = [load_point("/health", rate, 100.0) for rate in (1000.0, 2000.0, 1000.0)]
    fresh = [
        load_point("/predict", rate, cpu) for rate, cpu in ((300, 330), (800, 300), (350, 310))
    ]
    cached = [load_point(CACHED_ROUTE, rate, 120.0) for rate in (800.0, 1000.0, 900.0)]
    found = summary(health, fresh, cached, {})
    # Rounds' ratios 0.3, 0.4, 0.35 (fresh) and 0.8, 0.5, 0.9 (cached): medians 0.35 and 0.8.
    assert found["ratios"] == [0.3, 0.4, 0.35]
    assert (found["ratio"], found["cached_ratio"]) == (0.35, 0.8)
    assert found["cached_ratios"] == [0.8, 0.5, 0.9]
    # The median round is the one whose fresh ratio is the median: the third.
    assert found["median_round"]["predict"]["requests_per_s"] == 350
    assert found["median_round"]["cached"]["requests_per_s"] == 900.0
    assert (found["predict_cpu_us_median"], found["cached_cpu_us_median"]) == (310, 120.0)


def test_waits_are_counted_per_request_by_thread_from_proc() -> None:
    own = thread_waits(os.getpid())
    assert threading.get_native_id() in own  # this very thread, read from /proc
    time.sleep(0.01)  # a sleep gives up the core: one voluntary switch at least
    assert thread_waits(os.getpid())[threading.get_native_id()] > own[threading.get_native_id()]
    before, after = {11: 5, 12: 3}, {11: 9, 12: 3, 13: 2}
    found = waits_per_request(before, after, {11: "MainThread"}, requests=2)
    assert found == {"MainThread": 2.0, "13 (native)": 1.0}  # thread 12 made none


def profiled(stages: dict[str, float], processes: dict[str, dict[str, float]]) -> dict[str, Any]:
    """A profile as bench.frontend.profile gives one: CPU µs a request by stage."""

    def figures(each: dict[str, float]) -> dict[str, Any]:
        total = sum(each.values())
        return {
            "server_cpu_us_per_request": total,
            "stages": {
                stage: {"share": us / total, "cpu_us_per_request": us} for stage, us in each.items()
            },
        }

    found = {"requests": 1000, "requests_per_s": 1000.0, "samples": 500, **figures(stages)}
    if processes:
        found["processes"] = {label: figures(each) for label, each in processes.items()}
    return found


def layout(ratios: list[float], p99_ms: float, profile: dict[str, Any]) -> dict[str, Any]:
    health = [load_point("/health", 1000.0, 100.0) for _ in ratios]
    fresh = [load_point("/predict", 1000.0 * ratio, 300.0, p99_ms) for ratio in ratios]
    cached = [load_point(CACHED_ROUTE, 900.0, 120.0) for _ in ratios]
    return summary(health, fresh, cached, profile)


def verdicts(text: str) -> dict[str, str]:
    """Each layout's 'meets the target' cell in the report's first table."""
    rows = text.split("## Against the target")[1].split("\n## ")[0].splitlines()
    cells = [row.strip("|").split("|") for row in rows if row.startswith("| ")]
    return {cell[0].strip(): cell[-1].strip() for cell in cells[1:]}


def test_each_layout_is_judged_against_the_target_and_the_split_by_process() -> None:
    assert (TARGET_RATIO, TARGET_P99_MS) == (0.6, 50.0)
    one = profiled({"tokenizing": 60.0, "HTTP server (uvicorn)": 40.0}, {})
    split = profiled(
        {"tokenizing": 60.0, "HTTP server (uvicorn)": 45.0},
        {"front end": {"HTTP server (uvicorn)": 45.0}, "model side": {"tokenizing": 60.0}},
    )
    result: dict[str, Any] = {
        "date": "2026-11-29T00:00:00+00:00",
        "machine": {"cpu": "cpu", "cores": 2, "ram_gib": 24, "python": "3.11", "client": "wrk"},
        "load_average_at_start": 0.1,
        "clients": 64,
        "seconds_per_run": 10.0,
        "simulated": {"seconds_per_batch": 0.0005, "seconds_per_token": 1e-07},
        "targets": {"ratio": TARGET_RATIO, "p99_ms": TARGET_P99_MS},
    }
    result["machine"]["py_spy"] = "0.4"
    # One process short of the ratio; the split past it in the median round, not in all.
    result.update(layout([0.45, 0.5, 0.48], 30.0, one))
    result[SPLIT] = layout([0.58, 0.62, 0.61], 30.0, split)
    text = report(result)
    assert verdicts(text) == {"one process": "no", "split": "yes"}
    # The split's stages come by process: the model side's tokenizing, the front end's HTTP.
    assert "| stage | share | CPU µs/request | front end µs | model side µs |" in text
    assert "| tokenizing | 57.1% | 60.0 | 0.0 | 60.0 |" in text
    assert "| all | 100% | 105.0 | 45.0 | 60.0 |" in text
    # Past the ratio but not under the p99 target: not met.
    result[SPLIT] = layout([0.62, 0.63, 0.61], 55.0, split)
    assert verdicts(report(result)) == {"one process": "no", "split": "no"}
    # The pinned split is a layout of its own, its CPUs named.
    result[SPLIT_PINNED] = layout([0.66, 0.64, 0.65], 20.0, split)
    result["pinned_cpus"] = {"FRONT_END_CPUS": "0", "MODEL_CPUS": "1"}
    text = report(result)
    assert verdicts(text) == {"one process": "no", "split": "no", "split, pinned": "yes"}
    assert "the split, pinned**: the same with `FRONT_END_CPUS=0` and `MODEL_CPUS=1`" in text
    assert "## The split, pinned: each process on its own CPUs" in text
    assert "Three layouts" in text and "batches of 16" not in text
    # So is the pinned split with batches of 16, its setting named.
    result[SPLIT_PINNED_SMALL_BATCHES] = layout([0.59, 0.58, 0.57], 20.0, split)
    text = report(result)
    assert verdicts(text) == {
        "one process": "no",
        "split": "no",
        "split, pinned": "yes",
        "split, pinned, batches of 16": "no",
    }
    assert "Four layouts" in text
    assert (
        "own (wrk on any), and **the split, pinned, batches of 16**: the pinned split with "
        "`MAX_BATCH_SIZE=16`. A layout's server CPU"
    ) in text
    assert "## The split, pinned, batches of 16" in text
