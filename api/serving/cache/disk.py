"""The disk tier: diskcache, kept across restarts; reads on the event loop, one query a turn
of it; writes in a thread, one transaction for what gathers meanwhile."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
from diskcache.core import DBNAME

from api.metrics import Metrics
from api.serving.cache.entry import Entry
from api.serving.cache.text_disk import TextOnlyDisk, text_value
from api.serving.cache.tier import screened
from api.serving.cache.verify import AnswerShape, Rejected
from api.serving.per_turn import PerTurn

logger = logging.getLogger(__name__)

# How long the writer lets answers gather before it takes them into one transaction. Much
# of a transaction's cost is its commit: an entry cost ~62 µs of CPU written alone and ~23 µs
# among 64 (2 cores), and a batch's requests store their answers milliseconds apart, so
# without the wait most commits held one entry. Each commit also makes the event loop's next
# read start from a cold sqlite page cache. The LRU tier in front answers repeats meanwhile:
# only another process sees an entry this much later.
WRITE_GATHER_SECONDS = 0.02

# The keys of a turn's requests, looked up in diskcache's own table (key, raw, expire_time,
# mode, value: its schema in diskcache 5, to which pyproject.toml holds it) in one statement, as
# diskcache's `get` finds one: a text key is stored with raw = 1, an expired row is a miss.
# diskcache reads one key a statement, and each statement lets the GIL go: one a fresh
# request cost the loop a wait for the GIL that the batch worker or the writer took meanwhile.
READ_QUERY = (
    "SELECT key, mode, value FROM Cache WHERE key IN (SELECT value FROM json_each(?))"
    " AND raw = 1 AND (expire_time IS NULL OR expire_time > ?)"
)

# Per key read, its entry, the refusal of what was there, or None (a miss).
Found = list[Entry | Rejected | None]


@dataclass(eq=False)
class _Read:
    keys: list[str]
    found: asyncio.Future[tuple[Found, int]]  # and how many of the keys failed to be read


class DiskTier:
    """diskcache bounded in bytes. Values are JSON text, never pickles: the folder may be
    shared, and a pickle from it could run code (TextOnlyDisk neither writes nor reads one).
    A value that is not an answer is a miss, counted as rejected; any fault is a miss, counted.
    """

    name = "disk"

    def __init__(
        self, folder: Path, max_bytes: int, ttl_seconds: float | None, metrics: Metrics
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.metrics = metrics
        # Least recently stored, not used: under "least-recently-used" every read, a miss
        # included, updates the entry's access time in a write transaction, so the event
        # loop's reads queued behind the writer thread's commits for the sqlite lock. Under
        # overload (128 clients, fresh texts) that held the loop for seconds: 200s past the
        # 2 s target and starved batches. Reads are now plain selects, which WAL never
        # blocks; the LRU tier in front keeps what is hot.
        self._cache = diskcache.Cache(
            str(folder),
            disk=TextOnlyDisk,
            size_limit=max_bytes,
            eviction_policy="least-recently-stored",
            # No culling inside each `set` (a query for expired rows and one for the size,
            # per entry, held the GIL for most of the writer's ~80 µs an entry): the writer
            # culls once per transaction instead (`_write`), to the same size limit.
            cull_limit=0,
        )
        # Writes go to their own thread: an fsync must not stall the event loop. What
        # requests store while a transaction commits waits in the backlog and goes into the
        # next one: under load one commit serves many requests, not one each.
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="disk-cache")
        self._backlog: list[tuple[str, Entry]] = []
        self._backlog_lock = threading.Lock()
        self._draining = False
        self._database = Path(self._cache.directory, DBNAME)
        self._reads = PerTurn(self._read_turn)
        # sqlite connections belong to the thread that opened them: one per thread that reads
        # (the event loop's, in the server), read-only, all closed with the tier.
        self._readers = threading.local()
        self._reader_connections: list[sqlite3.Connection] = []

    @classmethod
    def open(
        cls, folder: Path, max_bytes: int, ttl_seconds: float | None, metrics: Metrics
    ) -> DiskTier | None:
        """The tier, or None (counted) when the folder cannot hold a cache."""
        try:
            return cls(folder, max_bytes, ttl_seconds, metrics)
        except Exception as exc:  # unwritable folder, full disk, bad database
            logger.warning("disk cache off: cannot open %s: %s", folder, exc)
            metrics.cache_errors.labels("disk", "open").inc()
            return None

    def put(self, key: str, entry: Entry) -> None:
        self._cache.set(key, json.dumps([entry[0], entry[1]]), expire=self.ttl_seconds)

    async def get_many(self, keys: Sequence[str], shape: AnswerShape) -> list[Entry | None]:
        """The entries, read with those of every other request of this turn of the event
        loop in one query (`_read_turn`): a local read costs less than handing it to a thread."""
        read = _Read(list(keys), asyncio.get_running_loop().create_future())
        self._reads.add(read)
        found, errors = await read.found
        return screened(self.metrics, self.name, found, shape, errors)

    def _read_turn(self, reads: list[_Read]) -> None:
        keys = [key for read in reads for key in read.keys]
        try:
            rows = self._rows(keys)
        except Exception as exc:  # I/O error, locked or broken database: every key a miss
            logger.warning("disk cache read failed: %s", type(exc).__name__)
            self.metrics.cache_errors.labels(self.name, "read").inc(len(keys))
            for read in reads:
                if not read.found.done():
                    read.found.set_result(([None] * len(read.keys), len(read.keys)))
            return
        for read in reads:
            if not read.found.done():  # done: its request was cancelled meanwhile
                read.found.set_result(([_entry(rows.get(key)) for key in read.keys], 0))

    def _rows(self, keys: list[str]) -> dict[str, tuple[int, Any]]:
        """Per key found and not expired, its row's mode and value."""
        cursor = self._reader().execute(READ_QUERY, (json.dumps(keys), time.time()))
        return {key: (mode, value) for key, mode, value in cursor}

    def _reader(self) -> sqlite3.Connection:
        """This thread's read-only connection to the tier's database. It never waits for a
        lock: under WAL a read never needs one, and a database too broken to read is a miss."""
        reader: sqlite3.Connection | None = getattr(self._readers, "connection", None)
        if reader is None:
            uri = f"{self._database.resolve().as_uri()}?mode=ro"
            reader = sqlite3.connect(uri, uri=True, timeout=0, check_same_thread=False)
            self._readers.connection = reader
            self._reader_connections.append(reader)
        return reader

    def put_many(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        with self._backlog_lock:
            self._backlog.extend(zip(keys, entries, strict=True))
            if self._draining:  # the writer takes these with the next transaction
                return
            self._draining = True
        self._writer.submit(self._drain)

    def _drain(self) -> None:
        while True:
            time.sleep(WRITE_GATHER_SECONDS)
            with self._backlog_lock:
                pending, self._backlog = self._backlog, []
                if not pending:
                    self._draining = False
                    return
            self._write(pending)

    def _write(self, pending: list[tuple[str, Entry]]) -> None:
        """Everything stored since the last commit, in one transaction; then what expired,
        and the least recently stored entries past the size limit, are removed."""
        try:
            with self._cache.transact():
                for key, entry in pending:
                    self.put(key, entry)
        except Exception as exc:  # disk full, read-only, I/O error: none of them written
            logger.warning("disk cache write failed: %s", type(exc).__name__)
            self.metrics.cache_errors.labels(self.name, "write").inc(len(pending))
            return
        try:
            self._cache.cull()
        except Exception as exc:  # left for the next write's cull
            logger.warning("disk cache eviction failed: %s", type(exc).__name__)
            self.metrics.cache_errors.labels(self.name, "evict").inc()

    def refresh_gauges(self) -> None:
        try:
            entries, size = len(self._cache), int(self._cache.volume())
        except Exception:
            self.metrics.cache_errors.labels(self.name, "stats").inc()
            return
        self.metrics.cache_entries.labels(self.name).set(entries)
        self.metrics.cache_bytes.labels(self.name).set(size)

    async def close(self) -> None:
        await asyncio.to_thread(self._writer.shutdown, wait=True)
        for reader in self._reader_connections:
            reader.close()
        self._cache.close()


def _entry(row: tuple[int, Any] | None) -> Entry | Rejected | None:
    """The entry a row holds, its refusal, or None for no row."""
    if row is None:
        return None
    try:
        return _decode(text_value(*row))
    except Rejected as rejected:
        return rejected


def _decode(raw: Any) -> Entry:
    """The entry a value holds; Rejected for anything but two JSON lists of numbers."""
    try:
        probabilities, logits = json.loads(raw)
        return tuple(map(_number, probabilities)), tuple(map(_number, logits))
    # JSONDecodeError is a ValueError; a huge integer overflows float; deep nesting recurses.
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise Rejected("format", f"not a cache value: {type(exc).__name__}") from None


def _number(value: Any) -> float:
    # float("nan") and float("1e999") parse; bools and strings are not scores.
    if type(value) not in (int, float):
        raise TypeError("a score that is not a number")
    return float(value)
