"""Work that the requests of one turn of the event loop each ask for, done once for them all.

A call that lets the GIL go (the Rust tokenizer's, a sqlite statement) costs the event loop a
wait to take it back, so the requests of one turn, asked together, wait once between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

Job = TypeVar("Job")


class PerTurn(Generic[Job]):
    """Gathers the jobs added during one turn of the running event loop and hands them to
    `flush` in one call, once the turn's callbacks have run. Each job carries its own future,
    which `flush` settles (skipping those already done: a request cancelled meanwhile)."""

    def __init__(self, flush: Callable[[list[Job]], None]) -> None:
        self._flush = flush
        self._jobs: list[Job] = []
        self._loop: asyncio.AbstractEventLoop | None = None

    def add(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # jobs left by a loop that stopped before its flush
            self._jobs, self._loop = [], loop
        if not self._jobs:  # the first of this turn: the rest of the turn joins it
            loop.call_soon(self._run)
        self._jobs.append(job)

    def _run(self) -> None:
        jobs, self._jobs = self._jobs, []
        self._flush(jobs)
