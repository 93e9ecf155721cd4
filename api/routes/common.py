"""What every route module shares: the state dependency and retry hints."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from api.state import ServiceState

RETRY_AFTER_LOADING_SECONDS = "5"


def service_state(request: Request) -> ServiceState:
    """The app's state object, set up by the lifespan."""
    state: ServiceState = request.app.state.service
    return state


State = Annotated[ServiceState, Depends(service_state)]
