"""What every route module shares: the service they answer from, body reading, the JSON
answer of scores."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, TypeVar

import orjson
from fastapi import Depends, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from api.http.schemas import inline_schema
from api.service.contract import Classifier
from api.service.core import Service

Body = TypeVar("Body", bound=BaseModel)


async def service_core(request: Request) -> Service:
    """The service core the app serves (routes that need more than `classify`).

    `async` although it awaits nothing: FastAPI runs a plain `def` dependency in a worker
    thread, so every request would hop threads, and under load each of those threads grew
    its own malloc arena (resident memory climbed with the number of clients).
    """
    service: Service = request.app.state.service
    return service


Core = Annotated[Service, Depends(service_core)]


class ScoresResponse(Response):
    """A JSON answer written by orjson: an answer's scores are floats, which the standard
    library's encoder writes ~15 times slower. Scores are finite (the predictor fails a
    row that is not), so nothing needs JSON's refusal of NaN. (FastAPI's ORJSONResponse
    is this, deprecated there in favour of response models, which these routes skip.)"""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def classifier_of(request: Request) -> Classifier:
    """What classifies for the app (the core, or a front end's remote one), for routes that
    skip FastAPI's dependencies (see read_body)."""
    classifier: Classifier = request.app.state.service
    return classifier


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI request body of a route that reads `model` itself with `read_body`."""
    schema = inline_schema(model)
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


class OwnBodyRoute(APIRoute):
    """A route whose endpoint takes the Request alone, reads its own body (`read_body`) and
    returns a Response: FastAPI's request handler, which solves dependencies, opens exit
    stacks and would validate a response model, has nothing to do for it and is skipped
    (FastAPI's documented way: a custom `APIRoute.get_route_handler`). Exception handlers,
    middleware and the OpenAPI description are the same as any route's. In the service the
    innermost middleware (api.http.middleware.direct) answers these routes before FastAPI's
    router is reached; this handler is what serves them in an app without it."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        if list(inspect.signature(endpoint).parameters) != ["request"]:
            raise TypeError(f"{endpoint.__name__}: an OwnBodyRoute endpoint takes `request` alone")
        super().__init__(path, endpoint, **kwargs)

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler: Callable[[Request], Coroutine[Any, Any, Response]] = self.endpoint
        return handler


async def read_body(request: Request, model: type[Body]) -> Body:
    """The JSON body validated as `model`, with FastAPI's errors, for a hot route.

    Declaring `body: Model` makes FastAPI solve dependencies, build its own error lists and
    wrap the route for each request: measured at 32 clients on the cache-hit path, about a
    sixth of the event loop's time per request. This is the same parse (the standard
    library's, which keeps lone surrogates for the model's own check to name) and the same
    validation, and failures are the same RequestValidationError, so the one handler
    words them.
    """
    content_type = request.headers.get("content-type", "application/json")
    subtype = content_type.partition(";")[0].strip().lower().rpartition("/")[2]
    if subtype != "json" and not subtype.endswith("+json"):
        raise RequestValidationError(
            [{"type": "content_type", "loc": ("body",), "msg": "send JSON (application/json)"}]
        )
    try:
        data = json.loads(await request.body())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body",), "msg": f"invalid JSON: {exc}"}]
        ) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_input=False)) from None
