"""Which CPUs a process of the service runs on (MODEL_CPUS, FRONT_END_CPUS).

A CPU list is Linux's own format (cpusets, `taskset -c`): numbers and ranges, `0-3,8`. A
process is pinned whole, each of its threads (threads it starts later inherit their starter's
CPUs), and the CPUs the kernel granted are read back: a cgroup's cpuset can leave some out
without an error, and an operator who pinned the model side away from the front end must not
find both on one core unawares.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from pathlib import Path

# Linux's largest configurable CPU count: a list past it is a typo, not a machine (and a range
# such as 0-99999999 would otherwise be a set of a hundred million numbers).
MAX_CPU = 8191
_ENTRY = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)
_THREADS = Path("/proc/self/task")


class CpuPinningError(RuntimeError):
    """The process could not be pinned to the CPUs asked for; the message says why."""


def parse_cpu_list(text: str) -> frozenset[int]:
    """The CPUs of a list such as `0-3,8`; ValueError names the entry that is not one."""
    cpus: set[int] = set()
    for entry in text.split(","):
        matched = _ENTRY.fullmatch(entry.strip())
        if matched is None:
            raise ValueError(f"{entry.strip()!r} is not a CPU number or a range such as 0-3")
        first = int(matched[1])
        last = first if matched[2] is None else int(matched[2])
        if last < first:
            raise ValueError(f"the range {entry.strip()!r} runs backwards")
        if last > MAX_CPU:
            raise ValueError(f"CPU {last} is past Linux's largest, {MAX_CPU}")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The shortest list of `cpus` in the same format: {0, 1, 2, 3, 8} is `0-3,8`."""
    entries: list[str] = []
    ordered = sorted(set(cpus))
    start = 0
    for index, cpu in enumerate(ordered):
        if index + 1 == len(ordered) or ordered[index + 1] != cpu + 1:
            first = ordered[start]
            entries.append(str(cpu) if first == cpu else f"{first}-{cpu}")
            start = index + 1
    return ",".join(entries)


def pin_process(cpus: frozenset[int], setting: str) -> None:
    """Every thread of this process on `cpus` and on nothing else, or CpuPinningError naming
    `setting` (the setting that asked for them) and the CPUs this process may have."""
    if not hasattr(os, "sched_setaffinity"):
        raise CpuPinningError(f"{setting}: this platform cannot pin a process to CPUs")
    available = os.sched_getaffinity(0)
    pinned: set[int] = set()
    try:
        # Listed again until no thread is new: one started meanwhile by a thread not yet
        # pinned would have inherited that thread's CPUs.
        while threads := {int(task.name) for task in _THREADS.iterdir()} - pinned:
            for thread in threads:
                with contextlib.suppress(ProcessLookupError):  # it ended since the listing
                    os.sched_setaffinity(thread, cpus)
            pinned |= threads
    except OSError as exc:  # EINVAL: none of them is a CPU this process may run on
        raise CpuPinningError(
            f"{setting}={format_cpu_list(cpus)}: {exc.strerror}; this process may run on "
            f"CPUs {format_cpu_list(available)}"
        ) from None
    granted = os.sched_getaffinity(0)
    if granted != cpus:
        raise CpuPinningError(
            f"{setting}={format_cpu_list(cpus)}: the kernel granted only "
            f"{format_cpu_list(granted)} (a CPU this machine lacks, or one a cgroup's cpuset "
            f"leaves out); this process may run on CPUs {format_cpu_list(available)}"
        )
