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
from api.http.errors import NotFound, install_error_handlers
from api.http.middleware.direct import DirectRoutes
from api.http.routes.common import OwnBodyRoute, read_body
from tests.conftest import make_settings


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
    """Counts the requests that reach the app inside DirectRoutes (FastAPI's routing)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths.append(scope["path"])
        await self.app(scope, receive, send)


def make_app(direct: bool, calls: list[RouterCalls]) -> FastAPI:
    """A small app with one OwnBodyRoute and the service's error handlers; with `direct`,
    DirectRoutes answers that route."""
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=OwnBodyRoute)
    router.post("/echo")(echo)
    app.include_router(router)

    def counted(app: ASGIApp) -> RouterCalls:
        calls.append(RouterCalls(app))
        return calls[-1]

    app.add_middleware(counted)  # type: ignore[arg-type]
    if direct:
        app.add_middleware(DirectRoutes, routes=router.routes, handlers=app.exception_handlers)
    return app


CALLS: dict[str, Callable[[TestClient], httpx.Response]] = {
    "answer": lambda c: c.post("/echo", json={"text": "hello"}),
    "service error": lambda c: c.post("/echo", json={"text": "missing"}),
    "HTTP exception": lambda c: c.post("/echo", json={"text": "teapot"}),
    "unexpected error": lambda c: c.post("/echo", json={"text": "boom"}),
    "invalid body": lambda c: c.post("/echo", json={"text": 3}),
    "not JSON": lambda c: c.post(
        "/echo", content=b"{", headers={"content-type": "application/json"}
    ),
    "not a JSON type": lambda c: c.post(
        "/echo", content=b"hi", headers={"content-type": "text/plain"}
    ),
}
# Requests no hot route matches: FastAPI's router answers them, whichever app.
NOT_HOT: dict[str, Callable[[TestClient], httpx.Response]] = {
    "another method": lambda c: c.get("/echo"),
    "a trailing slash": lambda c: c.post("/echo/", json={"text": "x"}, follow_redirects=False),
    "another path": lambda c: c.post("/nowhere", json={"text": "x"}),
}


def comparable(response: httpx.Response) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body."""
    return response.status_code, dict(response.headers), response.content


@pytest.fixture(scope="module")
def clients() -> dict[bool, tuple[TestClient, list[RouterCalls]]]:
    made: dict[bool, tuple[TestClient, list[RouterCalls]]] = {}
    for direct in (False, True):
        calls: list[RouterCalls] = []
        made[direct] = (TestClient(make_app(direct, calls), raise_server_exceptions=False), calls)
    return made


@pytest.mark.parametrize("case", list(CALLS))
def test_a_hot_route_answers_as_fastapis_routing_does_without_reaching_it(
    clients: dict[bool, tuple[TestClient, list[RouterCalls]]], case: str
) -> None:
    routed, _ = clients[False]
    direct, calls = clients[True]
    expected = comparable(CALLS[case](routed))
    assert comparable(CALLS[case](direct)) == expected
    assert expected[0] in (200, 404, 418, 422, 500)  # each case is the answer it names
    (inner,) = calls
    assert inner.paths == []  # answered by DirectRoutes, never by the router


@pytest.mark.parametrize("case", list(NOT_HOT))
def test_other_requests_go_on_to_fastapis_routing(
    clients: dict[bool, tuple[TestClient, list[RouterCalls]]], case: str
) -> None:
    routed, _ = clients[False]
    direct, calls = clients[True]
    (inner,) = calls
    before = len(inner.paths)
    expected = comparable(NOT_HOT[case](routed))
    assert comparable(NOT_HOT[case](direct)) == expected
    assert expected[0] in (307, 404, 405)
    assert len(inner.paths) == before + 1


def test_a_root_path_is_matched_as_the_router_matches_it() -> None:
    # Mounted under a prefix (uvicorn's --root-path), the route is matched on the path past it.
    for direct in (False, True):
        calls: list[RouterCalls] = []
        client = TestClient(make_app(direct, calls), root_path="/api")
        answer = client.post("/api/echo", json={"text": "hi"})
        assert answer.status_code == 200
        assert answer.json() == {"echo": "hi", "path": "/api/echo"}
        assert calls[0].paths == ([] if direct else ["/api/echo"])


def test_the_service_answers_predict_directly() -> None:
    app = create_app(make_settings(disk_cache_max_bytes=0))
    (declared,) = [m for m in app.user_middleware if cast(object, m.cls) is DirectRoutes]
    routes = cast(list[OwnBodyRoute], declared.kwargs["routes"])
    assert sorted(route.path for route in routes) == ["/", "/predict"]
    assert declared.kwargs["handlers"] is app.exception_handlers
