"""The routes of an app, also those inside included routers (FastAPI keeps those nested)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from starlette.routing import BaseRoute, Route


def walk(routes: Iterable[BaseRoute]) -> Iterator[Route]:
    """Every route, also inside included routers (FastAPI keeps those nested)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from walk(inner.routes)
        elif isinstance(route, Route):
            yield route
