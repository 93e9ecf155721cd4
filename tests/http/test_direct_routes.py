"""The hot routes answered by DirectRoutes, beside FastAPI's own routing as the reference: the
same answers, errors and refusals, and a request that is not theirs goes on unchanged."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import httpx
import pytest
from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from pydantic import BaseModel, StrictStr
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from api.http.app import create_app
from api.http.errors import install_error_handlers
from api.http.middleware.direct import DirectRoutes
from api.http.routes.common import OwnBodyRoute, read_body
from api.serving.errors import NotFound
from tests.support.in_process import make_settings


class Echo(BaseModel):
    text: StrictStr


async def echo(request: Request) -> Response:
    """Answers, or fails in each way a hot route can, as its text says."""
    text = (await read_body(request, Echo)).text
    if text == "missing":
        raise NotFound("no such thing")
    if text == "teapot":
        raise HTTPException(418, "short and stout", headers={"X-Why": "tea"})
    if text == "boom":
        raise RuntimeError("a bug")
    return JSONResponse({"echo": text, "path": request.url.path}, headers={"X-Echo": text})


class RouterCalls:
    """Notes the path of each request that reaches the app inside DirectRoutes (FastAPI's
    routing) in `paths`."""

    def __init__(self, app: ASGIApp, paths: list[str]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def make_app(direct: bool, routed: list[str]) -> FastAPI:
    """A small app with one OwnBodyRoute and the service's error handlers; with `direct`,
    DirectRoutes answers that route. The paths FastAPI's routing sees go into `routed`."""
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=OwnBodyRoute)
    router.post("/echo")(echo)
    app.include_router(router)
    app.add_middleware(RouterCalls, paths=routed)
    if direct:
        app.add_middleware(DirectRoutes, routes=router.routes, handlers=app.exception_handlers)
    return app


Sender = Callable[[TestClient], httpx.Response]
# Each request, the status FastAPI's routing answers it with, and whether it is the router's
# (no hot route matches it) rather than DirectRoutes'.
CASES: dict[str, tuple[Sender, int, bool]] = {
    "answer": (lambda c: c.post("/echo", json={"text": "hello"}), 200, False),
    "service error": (lambda c: c.post("/echo", json={"text": "missing"}), 404, False),
    "HTTP exception": (lambda c: c.post("/echo", json={"text": "teapot"}), 418, False),
    "unexpected error": (lambda c: c.post("/echo", json={"text": "boom"}), 500, False),
    "invalid body": (lambda c: c.post("/echo", json={"text": 3}), 422, False),
    "not JSON": (
        lambda c: c.post("/echo", content=b"{", headers={"content-type": "application/json"}),
        422,
        False,
    ),
    "not a JSON type": (
        lambda c: c.post("/echo", content=b"hi", headers={"content-type": "text/plain"}),
        422,
        False,
    ),
    "another method": (lambda c: c.get("/echo"), 405, True),
    "a trailing slash": (
        lambda c: c.post("/echo/", json={"text": "x"}, follow_redirects=False),
        307,
        True,
    ),
    "another path": (lambda c: c.post("/nowhere", json={"text": "x"}), 404, True),
}


def comparable(response: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body."""
    return response.status_code, dict(response.headers), response.content


@pytest.fixture(scope="module")
def clients() -> dict[bool, tuple[TestClient, list[str]]]:
    made: dict[bool, tuple[TestClient, list[str]]] = {}
    for direct in (False, True):
        routed: list[str] = []
        made[direct] = (TestClient(make_app(direct, routed), raise_server_exceptions=False), routed)
    return made


@pytest.mark.parametrize("case", list(CASES))
def test_each_request_is_answered_as_fastapis_routing_answers_it(
    clients: dict[bool, tuple[TestClient, list[str]]], case: str
) -> None:
    send, status, routers = CASES[case]
    reference, _ = clients[False]
    direct, routed = clients[True]
    before = len(routed)
    expected = comparable(send(reference))
    assert expected[0] == status
    assert comparable(send(direct)) == expected
    # A hot route's request never reaches FastAPI's router; any other one does.
    assert len(routed) - before == (1 if routers else 0)


def test_a_root_path_is_matched_as_the_router_matches_it() -> None:
    # Mounted under a prefix (uvicorn's --root-path), the route is matched on the path past it.
    for direct in (False, True):
        routed: list[str] = []
        client = TestClient(make_app(direct, routed), root_path="/api")
        answer = client.post("/api/echo", json={"text": "hi"})
        assert answer.status_code == 200
        assert answer.json() == {"echo": "hi", "path": "/api/echo"}
        assert routed == ([] if direct else ["/api/echo"])


def test_the_service_answers_predict_directly() -> None:
    app = create_app(make_settings(disk_cache_max_bytes=0))
    (declared,) = [m for m in app.user_middleware if cast(object, m.cls) is DirectRoutes]
    routes = cast(list[OwnBodyRoute], declared.kwargs["routes"])
    assert sorted(route.path for route in routes) == ["/", "/predict"]
    assert declared.kwargs["handlers"] is app.exception_handlers
