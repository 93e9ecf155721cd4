"""The layers every request of an app (the service's, or a front end's) goes through, in
their order."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter, FastAPI

from api.http.middleware.auth import ApiKeyGuard
from api.http.middleware.body_limit import BodySizeLimit
from api.http.middleware.direct import DirectRoutes
from api.http.middleware.observer import RequestObserver
from api.http.routes.common import OwnBodyRoute
from api.service.contract import Classifier


def install_middleware(app: FastAPI, service: Classifier, routers: Iterable[APIRouter]) -> None:
    """The layers of `app`; `routers`: those it includes, whose OwnBodyRoutes are answered
    without FastAPI's router."""
    settings = service.settings
    # Added last = runs first. Innermost: the hot routes, answered without FastAPI's router.
    # (Taken from the routers: the app's own list holds what inclusion wrapped them in.)
    direct = [
        route for router in routers for route in router.routes if isinstance(route, OwnBodyRoute)
    ]
    app.add_middleware(DirectRoutes, routes=direct, handlers=app.exception_handlers)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    # Always: without ADMIN_API_KEY it keeps the adapter routes closed.
    api_key, admin_key = (
        None if key is None else key.get_secret_value()
        for key in (settings.api_key, settings.admin_api_key)
    )
    app.add_middleware(ApiKeyGuard, api_key=api_key, admin_key=admin_key)
    # Outermost: every answer carries the request's id, and its metrics, access line and span
    # see every answer, 401s and 413s included.
    app.add_middleware(RequestObserver, service=service)
