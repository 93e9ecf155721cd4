"""The service's refusals, whatever the door: a code (the vocabulary of HTTP error bodies, the
split's replies and a scored file's row errors), a message, and when to try again. No status
codes: each door maps these onto its own errors in one place."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every refusal a caller can cause or meet; subclasses fix the code."""

    code = "internal_error"

    def __init__(self, message: str, retry_after_seconds: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_seconds = retry_after_seconds  # None: asking again will not help


class InvalidInput(ServiceError):
    """The request itself is wrong: too many texts, a text too long, an unservable text."""

    code = "invalid_input"


class OtherLanguage(InvalidInput):
    """A text in a language the model does not read, where the model says to refuse it."""

    code = "other_language"


class NotFound(ServiceError):
    """No model, adapter or cascade of that name."""

    code = "not_found"


class Conflict(ServiceError):
    """A change the service's state refuses as it stands (an adapter the models file owns)."""

    code = "conflict"


class Forbidden(ServiceError):
    """A request the settings close: a path outside the configured roots."""

    code = "forbidden"


class Overloaded(ServiceError):
    """Busy: the queue is full, or the answer would come past the latency target."""

    code = "overloaded"


class Unavailable(ServiceError):
    """Not serving: loading, draining, failed, or its models out of reach."""

    code = "unavailable"


class InferenceFailed(ServiceError):
    """The forward pass of the batch holding the request failed."""

    code = "inference_failed"


class NonFiniteAnswer(ServiceError):
    """The model gave NaN or infinity for a text: nothing to answer, and nothing cached."""

    code = "non_finite_scores"


class DeadlineExceeded(ServiceError):
    """The request's time ran out; its rows were dropped unrun."""

    code = "deadline_exceeded"


REFUSALS: dict[str, type[ServiceError]] = {
    kind.code: kind
    for kind in (
        ServiceError,
        InvalidInput,
        OtherLanguage,
        NotFound,
        Conflict,
        Forbidden,
        Overloaded,
        Unavailable,
        InferenceFailed,
        NonFiniteAnswer,
        DeadlineExceeded,
    )
}


def refusal(code: str, message: str, retry_after_seconds: int | None = None) -> ServiceError:
    """The refusal of `code` (as another process names it); ServiceError for a code not known."""
    return REFUSALS.get(code, ServiceError)(message, retry_after_seconds)
