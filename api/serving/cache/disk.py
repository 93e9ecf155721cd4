"""The disk tier: diskcache, kept across restarts. Reads on the event loop, one query a turn of
it; writes in a thread, one statement for what gathers meanwhile; diskcache evicts."""

from __future__ import annotations

import asyncio
import hmac
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
import orjson
from diskcache.core import DBNAME, MODE_RAW

from api.metrics import Metrics
from api.serving.cache.doorkeeper import Doorkeeper
from api.serving.cache.entry import Entry
from api.serving.cache.signing import MAC_BYTES, default_key_file, load_key, mac
from api.serving.cache.text_disk import TextOnlyDisk, text_value
from api.serving.cache.tier import screened
from api.serving.cache.verify import NOT_AN_ANSWER, AnswerShape, Rejected
from api.serving.per_turn import PerTurn

logger = logging.getLogger(__name__)

# How long the writer lets answers gather before it takes them into one transaction: much of
# a transaction's cost is its commit, and a batch's requests store their answers milliseconds
# apart (bench/reports/measured_in_tests.md, "The disk tier's writes and reads"). The LRU tier
# in front answers repeats meanwhile: only another process sees an entry this much later.
WRITE_GATHER_SECONDS = 0.02

# Each sqlite statement lets the GIL go, and the thread that let it go then waits to take it
# back, so the tier queries diskcache's own table (its schema in diskcache 5, to which
# pyproject.toml holds it) one statement a turn's reads and one a transaction's writes, where
# diskcache's own calls run one a key read and two an entry written. The schema, its
# triggers' count of entries, expiry and eviction (`cull`) stay diskcache's.

# The keys of a turn's requests, as diskcache's `get` finds one: a text key is stored with
# raw = 1, and an expired row is a miss.
READ_QUERY = (
    "SELECT key, mode, value FROM Cache WHERE key IN (SELECT value FROM json_each(?))"
    " AND raw = 1 AND (expire_time IS NULL OR expire_time > ?)"
)

# A transaction's entries (a JSON object: each key's value text), each written as
# diskcache's `set` writes it through TextOnlyDisk (its `_row_insert`, or `_row_update` for a
# key it holds): a text key (raw = 1), the value text kept in the row (MODE_RAW: size 0, no
# file, no tag), stored and accessed now. A row the key held, whatever it was (a pickle, a
# file's name, which is never deleted), is overwritten in place. An object, not an array of
# pairs: json_each gives each member's key and text as they are, where `json_extract` on a
# pair parses it again for each column.
WRITE_QUERY = (
    "INSERT INTO Cache(key, raw, store_time, expire_time, access_time, access_count, tag, size,"
    " mode, filename, value)"
    " SELECT key, 1, :now, :expire, :now, 0, NULL, 0, :mode, NULL, value"
    " FROM json_each(:entries) WHERE true"
    " ON CONFLICT(key, raw) DO UPDATE SET store_time = excluded.store_time,"
    " expire_time = excluded.expire_time, access_time = excluded.access_time, access_count = 0,"
    " tag = NULL, size = 0, mode = excluded.mode, filename = NULL, value = excluded.value"
)

# A row's value: the HMAC (signing.mac) over the row's key and the rest, in hex since a
# row's value is text (TextOnlyDisk), then the entry as JSON text (`value_text`).
MAC_CHARS = 2 * MAC_BYTES

# Per key read, its entry, the refusal of what was there, or None (a miss).
Found = list[Entry | Rejected | None]


@dataclass(eq=False)
class _Read:
    keys: list[str]
    found: asyncio.Future[tuple[Found, int]]  # and how many of the keys failed to be read


class DiskTier:
    """diskcache bounded in bytes. Values are JSON text kept in the row, never pickles: the
    folder may be shared, and a pickle from it could run code. The tier reads and writes rows
    itself (READ_QUERY, WRITE_QUERY) and refuses any row it could not have written
    (text_value); TextOnlyDisk, diskcache's serializer here, never deletes the file a row names
    when diskcache evicts the row. Every value carries an HMAC over its key and itself with
    `secret` (else the key kept in `key_file`, by default beside the folder: whoever can
    write the folder must not choose the answers it holds); one without a valid HMAC (forged,
    moved to another key, or written before values were signed) is a miss, counted as
    rejected ("mac"), and so is a value that is not an answer; any fault is a miss, counted.
    With a `doorkeeper`, only the answers it admits are written (a key's from its second store
    on); the others are counted as not admitted.
    """

    name = "disk"
    rejects: tuple[str, ...] = ("format", "mac", *NOT_AN_ANSWER)

    def __init__(
        self,
        folder: Path,
        max_bytes: int,
        ttl_seconds: float | None,
        metrics: Metrics,
        doorkeeper: Doorkeeper | None = None,
        *,
        secret: bytes | None = None,
        key_file: Path | None = None,
    ) -> None:
        self.ttl_seconds = ttl_seconds
        self.metrics = metrics
        self._doorkeeper = doorkeeper
        # Least recently stored, not used: under "least-recently-used" every read, a miss
        # included, writes the entry's access time, so the event loop's reads would queue
        # for the sqlite lock behind the writer's commits. Reads stay plain selects, which
        # WAL never blocks; the LRU tier in front keeps what is hot.
        self._cache = diskcache.Cache(
            str(folder),
            disk=TextOnlyDisk,
            size_limit=max_bytes,
            eviction_policy="least-recently-stored",
            # diskcache culls only in `cull`, which `_write` calls once a transaction.
            cull_limit=0,
        )
        if secret is None:  # after the folder is made: the default key file is in its parent
            try:
                secret = load_key(default_key_file(folder) if key_file is None else key_file)
            except BaseException:
                self._cache.close()
                raise
        self._secret = secret
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
        self._connections: list[sqlite3.Connection] = []
        self._write_connection: sqlite3.Connection | None = None

    @classmethod
    def open(
        cls,
        folder: Path,
        max_bytes: int,
        ttl_seconds: float | None,
        metrics: Metrics,
        doorkeeper: Doorkeeper | None = None,
        *,
        secret: bytes | None = None,
        key_file: Path | None = None,
    ) -> DiskTier | None:
        """The tier, or None (counted) when the folder cannot hold a cache or the key file
        cannot be made or trusted."""
        try:
            return cls(
                folder,
                max_bytes,
                ttl_seconds,
                metrics,
                doorkeeper,
                secret=secret,
                key_file=key_file,
            )
        # An unwritable folder, a full disk, a bad database; a key file of another user's or
        # that others can read: then nothing is served from the folder.
        except Exception as exc:
            logger.warning("disk cache off: cannot open %s: %s", folder, exc)
            metrics.cache_errors.labels("disk", "open").inc()
            return None

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
                found = [_entry(key, rows.get(key), self._secret) for key in read.keys]
                read.found.set_result((found, 0))

    def _rows(self, keys: list[str]) -> dict[str, tuple[int, Any]]:
        """Per key found and not expired, its row's mode and value."""
        cursor = self._reader().execute(READ_QUERY, (orjson.dumps(keys).decode(), time.time()))
        return {key: (mode, value) for key, mode, value in cursor}

    def _reader(self) -> sqlite3.Connection:
        """This thread's read-only connection to the tier's database. It never waits for a
        lock: under WAL a read never needs one, and a database too broken to read is a miss."""
        reader: sqlite3.Connection | None = getattr(self._readers, "connection", None)
        if reader is None:
            reader = self._connect("ro", timeout=0)
            self._readers.connection = reader
        return reader

    def _writer_connection(self) -> sqlite3.Connection:
        """The writer's connection, which waits for the write lock as diskcache's own do."""
        if self._write_connection is None:
            self._write_connection = self._connect("rw", timeout=self._cache.timeout)
            # As diskcache sets its own: under WAL, synced at checkpoints, not every commit.
            synchronous = int(self._cache.sqlite_synchronous)
            self._write_connection.execute(f"PRAGMA synchronous = {synchronous}")
        return self._write_connection

    def _connect(self, mode: str, timeout: float) -> sqlite3.Connection:
        """A connection to the tier's database, closed with the tier (from whichever thread
        closes it: each is used by one thread at a time)."""
        uri = f"{self._database.resolve().as_uri()}?mode={mode}"
        connection = sqlite3.connect(
            uri, uri=True, timeout=timeout, isolation_level=None, check_same_thread=False
        )
        self._connections.append(connection)
        return connection

    def put_many(self, keys: Sequence[str], entries: Sequence[Entry]) -> None:
        pairs = list(zip(keys, entries, strict=True))
        if self._doorkeeper is not None:
            admitted = [(key, entry) for key, entry in pairs if self._doorkeeper.admit(key)]
            if len(admitted) < len(pairs):
                not_admitted = self.metrics.labelled(self.metrics.cache_not_admitted, self.name)
                not_admitted.inc(len(pairs) - len(admitted))
            if not admitted:
                return
            pairs = admitted
        with self._backlog_lock:
            self._backlog.extend(pairs)
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
        now = time.time()
        # A key stored twice since the last commit keeps its latest entry, as in diskcache.
        values = {key: value_text(entry, key, self._secret) for key, entry in pending}
        parameters = {
            "now": now,
            "expire": None if self.ttl_seconds is None else now + self.ttl_seconds,
            "mode": MODE_RAW,
            "entries": orjson.dumps(values).decode(),
        }
        try:
            writer = self._writer_connection()
            with writer:  # commits, or rolls back on an exception
                writer.execute("BEGIN IMMEDIATE")
                writer.execute(WRITE_QUERY, parameters)
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
        for connection in self._connections:
            connection.close()
        self._cache.close()


def value_text(entry: Entry, key: str, secret: bytes) -> str:
    """The text the row of `key` keeps for an entry: the HMAC (MAC_CHARS hex digits), then its
    probabilities and logits, a JSON array of two arrays. orjson, not json: the writer holds
    the GIL while it writes them (the event loop waits), and the standard library writes
    floats much slower."""
    body = orjson.dumps(entry)
    return mac(secret, key, body).hex() + body.decode()


def _entry(key: str, row: tuple[int, Any] | None, secret: bytes) -> Entry | Rejected | None:
    """The entry the row of `key` holds, its refusal, or None for no row. The HMAC is checked
    before anything else of the value is read: what was not written with the secret for
    this key is never parsed."""
    if row is None:
        return None
    try:
        text = text_value(*row)
        body = text[MAC_CHARS:]
        try:
            signature = bytes.fromhex(text[:MAC_CHARS])
        except ValueError:  # not hex: no HMAC this tier writes
            signature = b""
        if not hmac.compare_digest(signature, mac(secret, key, body.encode())):
            raise Rejected("mac", "value not written with the disk tier's secret for this key")
        return _decode(body)
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
