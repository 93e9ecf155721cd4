"""CPU time and waits of a process's threads, by their Python names: what each thread of a
server spent, and how often it waited, per request over a load run (/proc for the counts,
`py-spy dump` for the names)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

from bench.harness import CLOCK_TICKS

# The bench extra installs py-spy beside this Python, which need not be on PATH.
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))


def thread_names(pid: int) -> dict[int, str]:
    """Native thread id -> Python thread name, from `py-spy dump` (Python threads only)."""
    dump = subprocess.run(
        [PY_SPY, "dump", "--pid", str(pid), "--json"], capture_output=True, text=True
    )
    if dump.returncode != 0:
        raise RuntimeError(f"py-spy dump failed: {dump.stderr.strip()}")
    return {
        int(thread["os_thread_id"]): str(thread["thread_name"] or "")
        for thread in json.loads(dump.stdout)
        if thread.get("os_thread_id")
    }


def task_files(pid: int, name: str) -> Iterator[tuple[int, str]]:
    """Per native thread of `pid`: its id and the text of its /proc file `name`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            yield int(task.name), (task / name).read_text()
        except OSError:  # the thread ended meanwhile
            continue


def thread_cpu_seconds(pid: int) -> dict[int, tuple[str, float]]:
    """Per native thread: its command name and user + system CPU seconds."""
    threads: dict[int, tuple[str, float]] = {}
    for tid, text in task_files(pid, "stat"):
        name = text[text.index("(") + 1 : text.rindex(")")]
        after = text.rsplit(")", 1)[1].split()
        threads[tid] = (name, (int(after[11]) + int(after[12])) / CLOCK_TICKS)
    return threads


def thread_waits(pid: int) -> dict[int, int]:
    """Per native thread: how often it has given up its core to wait (the kernel's
    voluntary context switches: a lock, the GIL, a sleep, a socket with nothing to read)."""
    waits: dict[int, int] = {}
    for tid, text in task_files(pid, "status"):
        for line in text.splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                waits[tid] = int(line.split(":", 1)[1])
    return waits


def waits_per_request(
    before: dict[int, int], after: dict[int, int], names: dict[int, str], requests: int
) -> dict[str, float]:
    """Voluntary context switches a request by thread (Python name where known), summed over
    threads of one name; threads that made none are left out."""
    made: Counter[str] = Counter()
    for tid, count in after.items():
        if count > before.get(tid, 0):
            made[names.get(tid) or f"{tid} (native)"] += count - before.get(tid, 0)
    return {name: round(count / max(requests, 1), 3) for name, count in made.most_common()}


def per_thread_us(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    names: dict[int, str],
    requests: int,
) -> dict[str, float]:
    """CPU µs per request by thread (Python name where known, else the kernel's), summed
    over threads of one name; threads that used none are left out."""
    spent: Counter[str] = Counter()
    for tid, (comm, seconds) in after.items():
        used = seconds - before.get(tid, (comm, 0.0))[1]
        if used > 0:
            spent[names.get(tid) or f"{comm} (native)"] += used
    return {
        name: round(1e6 * seconds / max(requests, 1), 1) for name, seconds in spent.most_common()
    }
