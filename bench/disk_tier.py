"""The disk tier's own CPU a text, against diskcache's own calls doing the same work, in the
same run: what the tier costs the process that serves the model.

Run: `python -m bench.disk_tier` (or `make bench-disk-tier`); `--quick` is a smoke run of a few
seconds that writes into bench/out/disk-tier-quick/ instead. Writes
bench/reports/disk_tier.{md,json}.

Each round, in two new folders (one a way), the same answers of the service's shape under the
service's keys (sha256 hex):

- **writes**: `entries` answers in transactions of TRANSACTION (a turn's worth under load):
  the tier's `_write` (one statement a transaction, then its `cull`, as its writer thread runs
  them) against diskcache's `set` of each entry inside one `transact()`, through the same
  text-only serializer (two statements an entry, and diskcache's own cull); each way signs
  each value (`value_text`, the HMAC over key and value);
- **reads**: those keys and as many never stored (a fresh text misses), TRANSACTION keys a
  read: the tier's `_rows` (one query, as a turn of the event loop reads) against
  diskcache's `get` a key.

CPU µs a text (this process, `time.process_time`), medians of the rounds after a warm-up
round. Both ways' tables hold the same rows after the writes: checked each round by reading a
sample of keys back through diskcache.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import diskcache

from api.metrics import Metrics
from api.serving.cache.disk import DiskTier, value_text
from api.serving.cache.text_disk import TextOnlyDisk
from bench.harness import (
    add_out,
    host,
    machine_line,
    out_folder,
    quiet_start,
    run_head,
    write_report,
)

TRANSACTION = 64
MAX_BYTES = 2**30  # the service's default DISK_CACHE_MAX_BYTES: nothing is evicted here
ANSWER = ((0.25, 0.75), (-0.5493061443340549, 0.5493061443340549))
SECRET = b"the bench's disk cache secret"  # both ways write the same signed rows
LOAD_WAIT_SECONDS = 600


def keys(prefix: str, count: int) -> list[str]:
    return [hashlib.sha256(f"{prefix}.{i}".encode()).hexdigest() for i in range(count)]


def chunks(items: list[str]) -> list[list[str]]:
    return [items[i : i + TRANSACTION] for i in range(0, len(items), TRANSACTION)]


def cpu_us_a_text(work: Callable[[list[str]], object], groups: list[list[str]]) -> float:
    started = time.process_time()
    for group in groups:
        work(group)
    return 1e6 * (time.process_time() - started) / sum(map(len, groups))


def one_round(entries: int, name: str) -> dict[str, float]:
    """Both ways' writes, then both ways' reads, each in a folder of its own."""
    stored = keys(f"{name}.stored", entries)
    fresh = keys(f"{name}.fresh", entries)
    asked = [key for pair in zip(stored, fresh, strict=True) for key in pair]
    with tempfile.TemporaryDirectory() as folder:
        tier = DiskTier(Path(folder, "tier"), MAX_BYTES, None, Metrics(2.0), secret=SECRET)
        plain = diskcache.Cache(
            str(Path(folder, "diskcache")),
            disk=TextOnlyDisk,
            size_limit=MAX_BYTES,
            eviction_policy="least-recently-stored",
        )

        def diskcache_write(group: list[str]) -> None:
            with plain.transact():
                for key in group:
                    plain.set(key, value_text(ANSWER, key, SECRET))

        figures = {
            "write_tier_us": cpu_us_a_text(
                lambda group: tier._write([(key, ANSWER) for key in group]), chunks(stored)
            ),
            "write_diskcache_us": cpu_us_a_text(diskcache_write, chunks(stored)),
            "read_tier_us": cpu_us_a_text(tier._rows, chunks(asked)),
            "read_diskcache_us": cpu_us_a_text(
                lambda group: [plain.get(key) for key in group], chunks(asked)
            ),
        }
        check_same_rows(Path(folder, "tier"), plain, stored[:: max(1, entries // 100)])
        asyncio.run(tier.close())
        plain.close()
    return {key: round(value, 2) for key, value in figures.items()}


def check_same_rows(tier_folder: Path, plain: diskcache.Cache, sample: list[str]) -> None:
    """diskcache reads back the same text from both ways' tables."""
    with diskcache.Cache(str(tier_folder), disk=TextOnlyDisk) as written:
        for key in sample:
            if not written.get(key) == plain.get(key) == value_text(ANSWER, key, SECRET):
                raise AssertionError(f"the two ways stored different rows for {key}")


def run(entries: int, rounds: int, quick: bool) -> dict[str, Any]:
    load_at_start = quiet_start(quick, LOAD_WAIT_SECONDS)
    one_round(entries, "warm-up")
    measured = []
    for number in range(rounds):
        measured.append(one_round(entries, str(number)))
        print(json.dumps(measured[-1]), flush=True)
    medians = {key: statistics.median(r[key] for r in measured) for key in measured[0]}
    return {
        **run_head(host(), load_at_start),
        "entries": entries,
        "transaction": TRANSACTION,
        "rounds": measured,
        "medians": medians,
    }


def report(result: dict[str, Any]) -> str:
    medians = result["medians"]
    lines = [
        "# The disk tier's CPU a text, against diskcache's own calls",
        "",
        machine_line(result, "`make bench-disk-tier` (bench/disk_tier.py)."),
        "",
        f"Each round: {result['entries']:,} answers written in transactions of "
        f"{result['transaction']}, into a new table each way; then those keys and as many "
        f"never stored read back, {result['transaction']} keys a read. CPU µs a text, medians "
        f"of {len(result['rounds'])} rounds after a warm-up round.",
        "",
        "| work | the tier | diskcache's own calls | tier / diskcache |",
        "|---|---:|---:|---:|",
    ]
    for work, label in (("write", "write (a transaction's entries)"), ("read", "read (half miss)")):
        tier, plain = medians[f"{work}_tier_us"], medians[f"{work}_diskcache_us"]
        lines.append(f"| {label} | {tier} | {plain} | {round(tier / plain, 2)} |")
    lines += [
        "",
        "Rounds (µs a text):",
        "",
        "| round | tier write | diskcache write | tier read | diskcache read |",
        "|---:|---:|---:|---:|---:|",
    ]
    for number, r in enumerate(result["rounds"], start=1):
        lines.append(
            f"| {number} | {r['write_tier_us']} | {r['write_diskcache_us']} "
            f"| {r['read_tier_us']} | {r['read_diskcache_us']} |"
        )
    lines += [
        "",
        "The tier's writes run in its writer thread and its reads on the event loop (a turn's "
        "keys in one query): what they cost the process is in [Batching](../../batching.md).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_out(parser, quick_help="smoke run of a few seconds")
    args = parser.parse_args()
    quick = args.quick
    entries, rounds = (2_048, 1) if quick else (51_200, 5)
    out = out_folder(args.out, quick, "disk-tier")
    result = run(entries, rounds, quick)
    write_report(out, "disk_tier", result, report(result))


if __name__ == "__main__":
    main()
