"""Where every log line goes and how it looks: text for a person, or with LOG_FORMAT=json one
JSON object per line (time, level, logger, message, and inside a request its fields) for a
log pipeline. uvicorn's loggers and Python warnings go the same way."""

from __future__ import annotations

import logging
import logging.config
import re
from typing import Any, Literal

from pythonjsonlogger.core import RESERVED_ATTRS

from api.observability.record import CURRENT, RequestRecord

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

LogFormat = Literal["text", "json"]
ACCESS_LOGGER = "loraserve.access"
# The fields a request's lines carry, in this order (RequestRecord's).
REQUEST_FIELDS = tuple(RequestRecord.__dataclass_fields__)
# Loggers that come with handlers of their own elsewhere (uvicorn's default config): here
# they pass every line on to the one handler.
PASSED_ON_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "py.warnings")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn adds a coloured copy of some messages; a JSON line needs only the one.
_NOT_FIELDS = (*RESERVED_ATTRS, "color_message")


class RequestFields(logging.Filter):
    """Gives each line logged while a request runs that request's fields, as attributes."""

    def filter(self, record: logging.LogRecord) -> bool:
        request = CURRENT.get()
        if request is not None:
            for name, value in request.fields().items():
                if not hasattr(record, name):
                    setattr(record, name, value)
        return True


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, then the request's fields as `name=value`."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [
            f"{name}={_text_value(value)}"
            for name in REQUEST_FIELDS
            if (value := getattr(record, name, None)) is not None
        ]
        return f"{line} [{' '.join(fields)}]" if fields else line


def _text_value(value: object) -> str:
    if isinstance(value, dict):
        return ",".join(f"{key}={count}" for key, count in value.items())
    return str(value)


def logging_config(level: str, log_format: LogFormat) -> dict[str, Any]:
    """The `logging.config.dictConfig` of the process, uvicorn's loggers included (uvicorn
    applies it as its `log_config`): one handler on stderr, every logger through it."""
    formatter: dict[str, Any]
    if log_format == "json":
        formatter = {
            "()": "pythonjsonlogger.json.JsonFormatter",
            "fmt": "%(levelname)s %(name)s %(message)s",
            "rename_fields": {"levelname": "level", "name": "logger"},
            "timestamp": "time",
            "reserved_attrs": list(_NOT_FIELDS),
            "json_ensure_ascii": False,
        }
    else:
        formatter = {"()": TextFormatter}
    passed_on = {"handlers": [], "propagate": True, "level": level.upper()}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"request": {"()": RequestFields}},
        "formatters": {"line": formatter},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "stream": "ext://sys.stderr",
                "formatter": "line",
                "filters": ["request"],
            }
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {name: dict(passed_on) for name in PASSED_ON_LOGGERS},
    }


def configure_logging(level: str, log_format: LogFormat) -> dict[str, Any]:
    """Applies the process's logging (warnings included) and returns its config, for uvicorn."""
    config = logging_config(level, log_format)
    logging.config.dictConfig(config)
    logging.captureWarnings(True)
    return config


def log_access(request: RequestRecord) -> None:
    """The one access line of a finished request, at info; its fields come with it."""
    logger = logging.getLogger(ACCESS_LOGGER)
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s %s %s", request.method, printable(request.path), request.status)


def printable(text: str) -> str:
    """`text` with its control characters escaped: a client's path (`%0A` decodes to a line
    break) cannot start a forged line in a text log."""
    return _CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def quiet_libraries() -> None:
    """transformers' load reports and progress bars say nothing the service does not log;
    its errors go through the service's own handler (its own would write plain text)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    # A line per HTTP request httpx makes: the split's forwards (each has its access line)
    # and `loraserve score --url`'s chunks.
    logging.getLogger("httpx").setLevel(logging.WARNING)
