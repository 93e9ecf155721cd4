"""What every route module shares: the state dependency and retry hints."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.http.state import ServiceState

RETRY_AFTER_LOADING_SECONDS = "5"


async def service_state(request: Request) -> ServiceState:
    """The app's state object, set up by the lifespan.

    `async` although it awaits nothing: FastAPI runs a plain `def` dependency in a worker
    thread, so every request would hop threads, and under load each of those threads grew
    its own malloc arena (resident memory climbed with the number of clients).
    """
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(service_state)]
