"""The HTTP door's app factory: its lifespan starts a service core (and the split's socket
door on it, where SPLIT_SOCKET is set), and drains and stops it at shutdown."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from api import __version__
from api.http.errors import install_error_handlers
from api.http.layers import install_middleware
from api.http.routes import ROUTERS
from api.http.split.model_side import ModelSide
from api.models.spec import ModelSpec
from api.service.core import FatalHandler, Service
from api.settings import Settings


def create_app(
    settings: Settings,
    specs: list[ModelSpec] | None = None,
    on_fatal: FatalHandler | None = None,
) -> FastAPI:
    """Builds the app on a new service core; its models load in the background once the app
    starts (see /ready). `on_fatal`: the core's (api.service.core.Service); the CLI uses it
    to stop the server with a non-zero exit. With SPLIT_SOCKET set, the socket is claimed
    here (api.http.split.socket_claim.SocketInUse when another process holds it)."""
    service = Service(settings, specs, on_fatal)
    model_side: ModelSide | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await service.start()
        # The split's front ends call in from the start: refused 503 until the models are in.
        if model_side is not None:
            await model_side.start()
        try:
            yield
        finally:
            service.begin_drain()
            if model_side is not None:
                await model_side.close()
            await service.close()

    app = FastAPI(
        title="loraserve",
        version=__version__,
        description="Text classification with LoRA adapters (text-embeddings-inference API).",
        lifespan=lifespan,
        # The service traces, counts and logs its requests itself (api.observability):
        # FastAPI's own OpenTelemetry, on wherever a global provider is set (as
        # `opentelemetry-instrument` sets one), would add a second span and set of metrics to
        # each request, and its check for a provider costs every request a few µs.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    app.state.service = service
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    install_middleware(app, service, ROUTERS)
    if settings.split_socket is not None:
        # Claimed now, before the server starts: SocketInUse if another process holds it.
        model_side = ModelSide(app, service, settings.split_socket)
    return app
