"""The innermost middleware: the hot routes answered here, the rest passed on to FastAPI."""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from api.http.routes.common import OwnBodyRoute

ErrorHandler = Callable[[Request, Exception], Response | Awaitable[Response]]


class DirectRoutes:
    """A request that one of `routes` matches fully (path and method, as the router matches
    it) is answered here by that route's endpoint, its errors by the app's own handlers;
    every other request goes on to FastAPI unchanged.

    Between the middlewares and an endpoint FastAPI puts its exception middleware, an
    exit-stack middleware, its router (which tries the docs' routes, then each included
    router's) and the route's request and error wrappers: measured in process, ~50 µs of
    the event loop's CPU a one-text /predict, a sixth of the request. An OwnBodyRoute uses
    none of what they set up (no dependencies, no exit stack, no response model), so this
    is the same endpoint called with the same Request, and its errors meet the same
    handlers. The routes stay FastAPI's: registered, documented in the OpenAPI schema, and
    what a request with another method or path finds (405, redirects, 404) is the router's.
    """

    def __init__(
        self,
        app: ASGIApp,
        routes: Sequence[OwnBodyRoute],
        handlers: Mapping[Any, ErrorHandler],
    ) -> None:
        self.app = app
        self.routes = tuple(routes)
        # Most requests of other routes (probes, scrapes: GETs) are passed on at this check.
        self.methods = frozenset(method for route in routes for method in route.methods or ())
        # The app's handlers, read when an error comes (the mapping may still grow after
        # this middleware is declared); those of 500 and Exception are the server-error
        # middleware's, outside this one, as in Starlette's own stack.
        self.handlers = handlers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in self.methods:
            for route in self.routes:
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.update(child_scope)
                    await self._answer(route, scope, receive, send)
                    return
        await self.app(scope, receive, send)

    async def _answer(
        self, route: OwnBodyRoute, scope: Scope, receive: Receive, send: Send
    ) -> None:
        request = Request(scope, receive, send)
        try:
            response: Response = await route.endpoint(request)
        except Exception as exc:
            handler = self._handler_of(exc)
            if handler is None:
                raise
            answered = handler(request, exc)
            response = await answered if inspect.isawaitable(answered) else answered
            exc.__traceback__ = None  # a reused exception would gather tracebacks
        await response(scope, receive, send)

    def _handler_of(self, exc: Exception) -> ErrorHandler | None:
        """The handler Starlette's exception middleware would pick: an HTTPException's status
        first, then the nearest class in the exception's MRO."""
        if isinstance(exc, HTTPException) and exc.status_code in self.handlers:
            return self.handlers[exc.status_code]
        for cls in type(exc).__mro__:
            if cls is Exception:
                return None
            if cls in self.handlers:
                return self.handlers[cls]
        return None
