"""What scores a file's texts, in process or against a running server: the same answers,
the same refusals. A refusal of one text becomes that row's error; a busy or loading
service is waited for; anything else stops the run (its output stays resumable)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from api.serving.errors import InvalidInput, NonFiniteAnswer, OtherLanguage, ServiceError

Ranked = list[dict[str, Any]]  # /predict's answer to one text: labels with scores, best first
# Refusals that concern the texts themselves: the rest of a batch is still scored.
ROW_REFUSALS = (InvalidInput.code, OtherLanguage.code, NonFiniteAnswer.code)
# Refusals that pass: a busy, loading or slow service. After this many in a row, give up.
MAX_WAITS = 30
WAIT_SECONDS = 1.0
# A model config's problem_type for sigmoid scores, one per label.
MULTI_LABEL = "multi_label_classification"


class ScoringFailed(RuntimeError):
    """The service refused in a way that waiting does not fix: the run stops."""


@dataclass(frozen=True)
class Target:
    """Which answers are asked for: a model (None: the first) with an adapter (None: its
    default), or the cascade."""

    model: str | None = None
    adapter: str | None = None
    cascade: bool = False


@dataclass(frozen=True)
class Servable:
    """What answers a target, as the output's header records it."""

    model: str  # the model's name, or "cascade"
    adapter: str | None  # the adapter answering; None for the cascade or a model without any
    labels: list[str]
    decision_threshold: float | None  # in the model's own scores; served ones centre on it
    identities: dict[str, str]  # model name → answer identity digest (two for the cascade)
    multi_label: bool = False  # sigmoid scores (MULTI_LABEL): no decision_threshold applies

    @property
    def column(self) -> str:
        """How reports name it: model/adapter."""
        return self.model if self.adapter is None else f"{self.model}/{self.adapter}"


@dataclass
class Outcome:
    """One text's answer as /predict gives it, and which model gave it; or its error."""

    ranked: Ranked | None = None
    answered_by: str | None = None
    error: dict[str, str] | None = field(default=None)


class Source(Protocol):
    """Scores texts for a target: in process or over HTTP."""

    async def describe(self, target: Target) -> Servable: ...

    async def score(self, target: Target, texts: list[str], truncate: bool) -> list[Outcome]:
        """The texts' outcomes in order; raises Refused as the service refuses the batch."""
        ...


@dataclass
class Refused(Exception):
    """A refusal read back from a service (over HTTP): its code, message, wait."""

    code: str
    message: str
    retry_after: float | None = None


def refusal_of(error: ServiceError) -> Refused:
    """A refusal of the service core in this process, as the HTTP answer carries it."""
    wait = error.retry_after_seconds
    return Refused(error.code, error.message, None if wait is None else float(wait))


Score = Callable[[list[str]], Awaitable[list[Outcome]]]


async def score_rows(score: Score, texts: list[str]) -> list[Outcome]:
    """Every text's outcome: a batch refused for a text in it is split in halves, asked
    together, until each refused text stands alone, so only the texts refused get an error
    (a batch of n with k such texts costs about 2k·log2(n) requests, not n); busy or loading
    answers are waited out."""
    try:
        return await waiting(score, texts)
    except Refused as refused:
        if refused.code not in ROW_REFUSALS:
            raise ScoringFailed(f"{refused.code}: {refused.message}") from None
        if len(texts) == 1:
            return [Outcome(error={"code": refused.code, "message": refused.message})]
    middle = len(texts) // 2
    halves = await asyncio.gather(  # both to their end: a failure stops the run, not a half
        score_rows(score, texts[:middle]), score_rows(score, texts[middle:]), return_exceptions=True
    )
    outcomes: list[Outcome] = []
    for half in halves:
        if isinstance(half, BaseException):
            raise half
        outcomes += half
    return outcomes


async def waiting(score: Score, texts: list[str]) -> list[Outcome]:
    """`score(texts)`, asked again after the wait a busy, loading or slow service gives."""
    for _ in range(MAX_WAITS):
        try:
            return await score(texts)
        except Refused as refused:
            if refused.code in ROW_REFUSALS or not passes(refused):
                raise
            await asyncio.sleep(refused.retry_after or WAIT_SECONDS)
    return await score(texts)


def passes(refused: Refused) -> bool:
    """A refusal that asking again later can turn into an answer."""
    return refused.code in ("overloaded", "unavailable", "inference_failed", "deadline_exceeded")
