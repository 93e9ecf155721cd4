"""bench.frontend's profile folding: each py-spy stack goes to the stage of the code that
called the library at its leaf, and samples are counted by stage and by thread."""

from __future__ import annotations

import pytest

from bench.frontend import ASGI, NATIVE, QUEUE, cpu_by_stage, fold, stage_of

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
