"""The HTTP door's errors: its own refusals, the status of each of the core's, and the one
place that writes them out."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.serving.errors import (
    Conflict,
    DeadlineExceeded,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NonFiniteAnswer,
    NotFound,
    Overloaded,
    ServiceError,
    Unavailable,
)

logger = logging.getLogger(__name__)
_MAX_DETAILS = 5
OIP_PREFIX = "/v2"  # the Open Inference Protocol's routes, whose error body is its own


class HttpError(Exception):
    """A refusal of the HTTP door's own (the body, the key, the client): status and code fixed
    by each subclass. The core's refusals are api.serving.errors, mapped by STATUS_CODES."""

    status_code = 400
    code = "bad_request"

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}


class BadRequest(HttpError):
    status_code = 400
    code = "bad_request"


class PayloadTooLarge(HttpError):
    status_code = 413
    code = "payload_too_large"


class Unauthorized(HttpError):
    status_code = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, {"WWW-Authenticate": "Bearer"})


class ClientGone(HttpError):
    """The client disconnected; nobody reads this answer (nginx's 499)."""

    status_code = 499
    code = "client_gone"


# The HTTP contract of each of the core's refusals (a subclass not named: its base's status).
STATUS_CODES: dict[type[ServiceError], int] = {
    ServiceError: 500,
    InvalidInput: 422,
    NotFound: 404,
    Conflict: 409,
    Forbidden: 403,
    Overloaded: 429,
    Unavailable: 503,
    InferenceFailed: 503,
    NonFiniteAnswer: 500,
    DeadlineExceeded: 504,
}


def status_of(refusal: ServiceError) -> int:
    """The status code `refusal` is answered with."""
    for kind in type(refusal).__mro__:
        if kind in STATUS_CODES:
            return STATUS_CODES[kind]
    return 500


def response_for(error: ServiceError | HttpError, path: str = "") -> JSONResponse:
    """`error` as the answer to a request for `path`: its status, body and headers (a core
    refusal's time to retry as `Retry-After`). Also an ASGI app, for middlewares."""
    if isinstance(error, HttpError):
        return error_response(error.status_code, error.code, error.message, error.headers, path)
    retry = error.retry_after_seconds
    headers = None if retry is None else {"Retry-After": str(retry)}
    return error_response(status_of(error), error.code, error.message, headers, path)


def speaks_oip(path: str) -> bool:
    """Whether `path` is one of the Open Inference Protocol's (`/v2`, `/v2/...`)."""
    return path == OIP_PREFIX or path.startswith(OIP_PREFIX + "/")


def error_response(
    status_code: int,
    code: str,
    message: str,
    headers: dict[str, str] | None = None,
    path: str = "",
) -> JSONResponse:
    """The one place that writes an error body: `{"error": {"code", "message"}}`, or on the
    Open Inference Protocol's routes its own shape, `{"error": "<message>"}` (same status)."""
    body: dict[str, object] = (
        {"error": message} if speaks_oip(path) else {"error": {"code": code, "message": message}}
    )
    return JSONResponse(body, status_code=status_code, headers=headers)


async def _refusal(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError | HttpError)
    response = response_for(exc, request.url.path)
    if response.status_code >= 500:
        logger.warning("%s: %s", exc.code, exc.message)
    return response


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    # FastAPI's own handler echoes the input back (2 MB in, 2 MB out) and fails on lone
    # surrogates; this one names where and what, never the value.
    assert isinstance(exc, RequestValidationError)
    details = []
    for error in exc.errors()[:_MAX_DETAILS]:
        where = ".".join(str(part) for part in error.get("loc", ()) if part != "body")
        details.append(f"{where or 'body'}: {error.get('msg', 'invalid')}")
    return error_response(422, InvalidInput.code, "; ".join(details), path=request.url.path)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = NotFound.code if exc.status_code == 404 else f"http_{exc.status_code}"
    headers = dict(exc.headers or {})
    return error_response(exc.status_code, code, str(exc.detail), headers, request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, ServiceError.code, "internal error", path=request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Registers every handler, in one place."""
    app.add_exception_handler(ServiceError, _refusal)
    app.add_exception_handler(HttpError, _refusal)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
