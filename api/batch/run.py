"""One scoring run over a file's rows: chunks of texts in flight, lines written in input
order as their chunk is answered, progress, and the count of rows scored and refused."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from api.batch.output import Writer, row_line
from api.batch.progress import Progress
from api.batch.rows import Row
from api.batch.scoring import Outcome, Source, Target, score_rows

# Chunks asked at once: while one runs on the device the next is tokenized and queued, so
# the batcher never waits for this client.
CHUNKS_IN_FLIGHT = 2

Expected = Callable[[Row], str | None]  # a row's expected label (evaluate), or None
# Given each row's expected label (None without Expected) and outcome (None: no text).
Judge = Callable[[str | None, Outcome | None], None]


@dataclass
class Tally:
    """Rows written by this run: scored, and refused by error code."""

    scored: int = 0
    errors: Counter[str] = field(default_factory=Counter)

    @property
    def refused(self) -> int:
        return sum(self.errors.values())


@dataclass
class Run:
    """What to score and how."""

    source: Source
    target: Target
    truncate: bool = True
    batch_size: int = 32
    in_flight: int = CHUNKS_IN_FLIGHT


async def score_file(
    run: Run,
    rows: Iterable[Row],
    writer: Writer | None,
    progress: Progress | None = None,
    expected: Expected | None = None,
    judge: Judge | None = None,
) -> Tally:
    """Scores `rows` and writes their lines in order (`writer` None: only counted);
    `judge`, if given, is called for every row in order as its chunk is answered: nothing of
    a row is held after its chunk."""
    tally = Tally()
    pending: deque[tuple[list[Row], asyncio.Task[list[Outcome]]]] = deque()

    async def write_first() -> None:
        chunk, task = pending.popleft()
        outcomes = iter(await task)
        lines: list[dict[str, Any]] = []
        for row in chunk:
            outcome = None if row.text is None else next(outcomes)
            label = expected(row) if expected else None
            lines.append(row_line(row, outcome, label))
            error = lines[-1].get("error")
            if error is None:
                tally.scored += 1
            else:
                tally.errors[error["code"]] += 1
            if judge is not None:
                judge(label, outcome)
        if writer is not None:
            writer.write(lines)
        if progress is not None:
            progress.advance(len(chunk))

    try:
        for chunk in chunks(iter(rows), run.batch_size):
            texts = [row.text for row in chunk if row.text is not None]
            pending.append((chunk, asyncio.ensure_future(_score(run, texts))))
            if len(pending) >= run.in_flight:
                await write_first()
        while pending:
            await write_first()
    finally:
        for _, task in pending:
            task.cancel()
    return tally


async def _score(run: Run, texts: list[str]) -> list[Outcome]:
    if not texts:
        return []

    async def score(batch: list[str]) -> list[Outcome]:
        return await run.source.score(run.target, batch, run.truncate)

    return await score_rows(score, texts)


def chunks(rows: Iterator[Row], size: int) -> Iterator[list[Row]]:
    """The rows in lists of `size` (the last one shorter)."""
    while chunk := list(islice(rows, size)):
        yield chunk
