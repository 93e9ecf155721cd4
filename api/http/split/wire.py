"""The split's messages: length-prefixed JSON (orjson: a turn's replies carry every score, which
the standard library writes ~15 times slower), each holding every call (or every reply) of one
turn of its sender's event loop, so that a turn's requests cross the socket in one write.

Calls (front end to model side):
    ["classify", number, request_id, model, adapter, texts, truncate, use_cache,
     seconds_left, trace_context]
    ["forward", number, method, path, query, headers, body]  (the id in X-Request-ID)
    ["cancel", number]
Replies (model side to front end), by the call's number:
    [number, "done", scores, tiers, answered_by, labels, adapter, cascade, cache_tiers]
    [number, "refused", error class name, message, headers]
    [number, "failed", description]
    [number, "forwarded", status, headers, body]

Bytes (a forwarded body) travel as latin-1 text, which maps each byte to one character and
back. A request's deadline travels as the seconds it has left (the two processes need not
share a clock), its trace as W3C `traceparent`/`tracestate` (empty with tracing off).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import orjson

LENGTH = struct.Struct("!I")
MAX_MESSAGE_BYTES = 1 << 30


class BrokenMessage(ConnectionError):
    """A message that is not what the other side sends: the connection is not trusted on."""


def framed(items: list[Any]) -> bytes:
    """One message: its length, then its JSON."""
    body = orjson.dumps(items)
    return LENGTH.pack(len(body)) + body


async def read_message(reader: asyncio.StreamReader) -> list[Any]:
    """The next message; IncompleteReadError once the other side has closed."""
    size = LENGTH.unpack(await reader.readexactly(LENGTH.size))[0]
    if size > MAX_MESSAGE_BYTES:
        raise BrokenMessage(f"a message of {size} bytes")
    try:
        items = orjson.loads(await reader.readexactly(size))
    except ValueError as exc:
        raise BrokenMessage(f"a message that is not JSON: {exc}") from None
    if not isinstance(items, list):
        raise BrokenMessage("a message that is not a list")
    return items


def to_text(data: bytes) -> str:
    return data.decode("latin-1")


def to_bytes(text: str) -> bytes:
    return text.encode("latin-1")
