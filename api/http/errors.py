"""Errors that carry their HTTP answer, and the one place that writes them out."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)
_MAX_DETAILS = 5
OIP_PREFIX = "/v2"  # the Open Inference Protocol's routes, whose error body is its own


class ServiceError(Exception):
    """Base of every error a client can cause or meet; subclasses fix status and code."""

    status_code = 500
    code = "internal_error"

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}

    def response(self, path: str = "") -> JSONResponse:
        """This error as a response to a request for `path`; also an ASGI app, for
        middlewares (which pass `scope["path"]`)."""
        return error_response(self.status_code, self.code, self.message, self.headers, path)


class InvalidInput(ServiceError):
    status_code = 422
    code = "invalid_input"


class BadRequest(ServiceError):
    status_code = 400
    code = "bad_request"


class NotFound(ServiceError):
    status_code = 404
    code = "not_found"


class Conflict(ServiceError):
    """A change the service's state refuses as it stands (an adapter the models file owns)."""

    status_code = 409
    code = "conflict"


class PayloadTooLarge(ServiceError):
    status_code = 413
    code = "payload_too_large"


class Unauthorized(ServiceError):
    status_code = 401
    code = "unauthorized"

    def __init__(self, message: str) -> None:
        super().__init__(message, {"WWW-Authenticate": "Bearer"})


class Forbidden(ServiceError):
    """A request no key opens: a route closed by the settings, a path outside the roots."""

    status_code = 403
    code = "forbidden"


class Overloaded(ServiceError):
    status_code = 429
    code = "overloaded"


class Unavailable(ServiceError):
    status_code = 503
    code = "unavailable"


class InferenceFailed(ServiceError):
    status_code = 503
    code = "inference_failed"


class NonFiniteAnswer(ServiceError):
    """The model gave NaN or infinity for a text: nothing to answer, and nothing cached."""

    status_code = 500
    code = "non_finite_scores"


class ClientGone(ServiceError):
    """The client disconnected; nobody reads this answer (nginx's 499)."""

    status_code = 499
    code = "client_gone"


class DeadlineExceeded(ServiceError):
    status_code = 504
    code = "deadline_exceeded"


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


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    if exc.status_code >= 500:
        logger.warning("%s: %s", exc.code, exc.message)
    return exc.response(request.url.path)


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
    code = "not_found" if exc.status_code == 404 else f"http_{exc.status_code}"
    headers = dict(exc.headers or {})
    return error_response(exc.status_code, code, str(exc.detail), headers, request.url.path)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, ServiceError.code, "internal error", path=request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Registers every handler, in one place."""
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
