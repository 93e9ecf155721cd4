"""The shared tier: Redis, which every replica reads and writes. Slow or down, it is skipped
within REDIS_TIMEOUT_SECONDS, counted, and tried again with backoff (a circuit breaker)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
from collections.abc import Awaitable, Sequence
from typing import TypeVar

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from api.metrics import Metrics
from api.serving.cache.breaker import Breaker
from api.serving.cache.entry import Entry, is_finite
from api.serving.cache.signing import MAC_BYTES, mac
from api.serving.cache.tier import screened
from api.serving.cache.verify import NOT_AN_ANSWER, AnswerShape, Rejected

logger = logging.getLogger(__name__)

# A value: format version (1 byte), label count n (2 bytes), then n probabilities and n
# logits as little-endian float64 (exact: a hit gives the very floats the model gave), then,
# with REDIS_CACHE_SECRET, a 32-byte HMAC-SHA256 over the whole Redis key and all of that.
# Two labels take 67 bytes (35 without a secret). The version is also in the key, so replicas
# of two versions side by side during a rolling update never read or overwrite each other's
# values.
FORMAT_VERSION = 2
_HEAD = struct.Struct("<BH")
FAULTS = (RedisError, OSError, asyncio.TimeoutError)
Result = TypeVar("Result")


def encode(entry: Entry, key: str, secret: bytes | None) -> bytes:
    """The stored form of a finite entry under the Redis key `key`; ValueError for any other."""
    probabilities, logits = entry
    if len(probabilities) != len(logits) or not is_finite(entry):
        raise ValueError("only finite entries with one logit per label are stored")
    values = (*probabilities, *logits)
    body = _HEAD.pack(FORMAT_VERSION, len(probabilities)) + struct.pack(f"<{len(values)}d", *values)
    return body if secret is None else body + mac(secret, key, body)


def decode(raw: bytes | str, key: str, secret: bytes | None) -> Entry:
    """The entry a value under the Redis key `key` holds; Rejected("format") for a value
    this service does not write, Rejected("mac") for one not written with `secret` for
    this key. What the floats say is checked by the caller (verify.rejection)."""
    if not isinstance(raw, bytes):
        raise Rejected("format", "a text value: not written by this service")
    if len(raw) < _HEAD.size:
        raise Rejected("format", "truncated value")
    version, labels = _HEAD.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise Rejected("format", f"value of format {version}, not {FORMAT_VERSION}")
    size = _HEAD.size + 16 * labels
    if len(raw) != size + (0 if secret is None else MAC_BYTES):
        raise Rejected("format", "value of the wrong length")
    if secret is not None and not hmac.compare_digest(raw[size:], mac(secret, key, raw[:size])):
        raise Rejected("mac", "value not written with REDIS_CACHE_SECRET for this key")
    values = struct.unpack_from(f"<{2 * labels}d", raw, _HEAD.size)
    return values[:labels], values[labels:]


class RedisTier:
    """Reads with one MGET per request, writes with one pipelined SET per batch of answers
    (in the background). A fault opens the breaker: until it lets a probe through, the tier
    is skipped without a call, and every skip is counted."""

    name = "redis"
    rejects: tuple[str, ...] = ("format", "mac", *NOT_AN_ANSWER)

    def __init__(
        self,
        url: str,
        key_prefix: str,
        ttl_seconds: float | None,
        timeout_seconds: float,
        breaker: Breaker,
        metrics: Metrics,
        secret: bytes | None,
    ) -> None:
        self.timeout_seconds = timeout_seconds
        self.breaker = breaker
        self.metrics = metrics
        self._prefix = f"{key_prefix}v{FORMAT_VERSION}:"
        self._secret = secret
        self._ttl_ms = None if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        # No retries inside the client: a retry would stack timeouts on one request; the
        # breaker decides when Redis is tried again.
        self._client = Redis.from_url(
            url,
            socket_timeout=timeout_seconds,
            socket_connect_timeout=timeout_seconds,
            retry=Retry(NoBackoff(), 0),
        )
        self._writes: set[asyncio.Task[None]] = set()
        metrics.cache_tier_up.labels(self.name).set(1)

    def key(self, key: str) -> str:
        """The Redis key of a cache key: prefix, format version, key."""
        return self._prefix + key

    async def get_many(self, keys: Sequence[str], shape: AnswerShape) -> list[Entry | None]:
        if not self.breaker.allow():
            self.metrics.cache_lookups.labels(self.name, "skipped").inc(len(keys))
            return [None] * len(keys)
        try:
            raws = await self._call(self._client.mget([self.key(k) for k in keys]))
        except FAULTS as exc:
            self._fault("read", exc)
            self.metrics.cache_lookups.labels(self.name, "error").inc(len(keys))
            return [None] * len(keys)
        except asyncio.CancelledError:
            self.breaker.abandoned()
            raise
        self._answered()
        found: list[Entry | Rejected | None] = []
        for key, raw in zip(keys, raws, strict=True):
            try:
                found.append(None if raw is None else decode(raw, self.key(key), self._secret))
            except Rejected as rejected:
                found.append(rejected)
        return screened(self.metrics, self.name, found, shape, errors=0)

    def put_many(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        if not keys or not self.breaker.allow():
            return
        task = asyncio.get_running_loop().create_task(self._write(list(keys), list(entries)))
        self._writes.add(task)  # a reference, or the task may be collected mid-write
        task.add_done_callback(self._writes.discard)

    async def _write(self, keys: list[str], entries: list[Entry]) -> None:
        pipe = self._client.pipeline(transaction=False)
        for key, entry in zip(keys, entries, strict=True):
            redis_key = self.key(key)
            pipe.set(redis_key, encode(entry, redis_key, self._secret), px=self._ttl_ms)
        try:
            await self._call(pipe.execute())
        except FAULTS as exc:
            self._fault("write", exc)
        except asyncio.CancelledError:
            self.breaker.abandoned()
            raise
        else:
            self._answered()

    async def _call(self, call: Awaitable[Result]) -> Result:
        # The socket timeouts bound each read and connect; this bounds the whole call.
        return await asyncio.wait_for(call, self.timeout_seconds)

    def _fault(self, op: str, exc: BaseException) -> None:
        self.metrics.cache_errors.labels(self.name, op).inc()
        if self.breaker.failed():
            self.metrics.cache_tier_up.labels(self.name).set(0)
            logger.warning(
                "redis cache tier skipped for %.1f s after a %s fault: %s",
                self.breaker.wait,
                op,
                type(exc).__name__,
            )

    def _answered(self) -> None:
        if self.breaker.succeeded():
            self.metrics.cache_tier_up.labels(self.name).set(1)
            logger.info("redis cache tier answers again")

    def refresh_gauges(self) -> None:
        """Nothing cheap to read: Redis's own size is for Redis's exporter to report."""

    async def close(self) -> None:
        if self._writes:
            await asyncio.wait(self._writes, timeout=self.timeout_seconds * 4)
        await self._client.aclose()
