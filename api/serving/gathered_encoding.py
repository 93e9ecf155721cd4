"""Tokenizing for the event loop: the texts of every request that asks in one turn of the loop
go to the tokenizer together, in one call (api.serving.per_turn).

Tokenized one request at a time, each call released the GIL and took it back: a one-text
request's tokenizing cost the loop ~60 µs of CPU where the tokenizer itself takes ~25.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from api.models.predictor import UnservableText
from api.serving.per_turn import PerTurn

# A turn's texts with this many characters at most in all are tokenized on the loop: a thread
# hand-off costs more than a batch of SMS takes to tokenize. Longer ones go to a worker
# thread, so that the loop keeps serving meanwhile.
INLINE_MAX_CHARS = 4096

# Per request, its texts' ids, or the refusal of one of its texts (Predictor.encode_many).
Encoded = list[list[list[int]] | UnservableText]
EncodeMany = Callable[[list[list[str]], bool], Encoded]


@dataclass(eq=False)
class _Job:
    texts: list[str]
    truncate: bool
    ids: asyncio.Future[list[list[int]]]


class GatheredEncoder:
    """`encode(texts, truncate)` for the event loop, gathered per turn of the loop."""

    def __init__(self, encode_many: EncodeMany) -> None:
        self._encode_many = encode_many
        self._turn = PerTurn(self._flush)

    async def encode(self, texts: list[str], truncate: bool) -> list[list[int]]:
        """The texts' ids, or the UnservableText that refuses one of them."""
        job = _Job(texts, truncate, asyncio.get_running_loop().create_future())
        self._turn.add(job)
        return await job.ids

    def _flush(self, jobs: list[_Job]) -> None:
        for truncate in (True, False):
            group = [job for job in jobs if job.truncate is truncate and not job.ids.done()]
            if not group:
                continue
            texts = [job.texts for job in group]
            if sum(len(text) for request in texts for text in request) <= INLINE_MAX_CHARS:
                _settle(group, _outcome(self._encode_many, texts, truncate))
                continue
            loop = asyncio.get_running_loop()
            try:
                ran = loop.run_in_executor(None, _outcome, self._encode_many, texts, truncate)
            except RuntimeError as exc:  # the executor is shut down: the service is stopping
                _settle(group, exc)
            else:
                ran.add_done_callback(partial(_settled_in_thread, group))


def _outcome(
    encode_many: EncodeMany, texts: list[list[str]], truncate: bool
) -> Encoded | Exception:
    try:
        return encode_many(texts, truncate)
    except Exception as exc:  # the tokenizer itself failed: every request of the group does
        return exc


def _settled_in_thread(group: list[_Job], ran: asyncio.Future[Encoded | Exception]) -> None:
    if not ran.cancelled():  # cancelled: the loop is closing, and nobody waits any more
        _settle(group, ran.result())


def _settle(group: list[_Job], outcome: Encoded | Exception) -> None:
    """Each job's ids, or its refusal; or the group's failure for every job."""
    for index, job in enumerate(group):
        if job.ids.done():  # its request was cancelled (client gone) meanwhile
            continue
        result = outcome if isinstance(outcome, Exception) else outcome[index]
        if isinstance(result, Exception):
            job.ids.set_exception(result)
        else:
            job.ids.set_result(result)
