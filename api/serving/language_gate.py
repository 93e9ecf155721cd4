"""Which model answers each text of a request, by the languages models declare: the model
asked where it reads the text; else, as it says, another model that reads it (route), a
refusal, or its own answer flagged as outside its languages. Counted per detected language."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import prometheus_client

from api.metrics import Metrics
from api.models.languages import reads
from api.models.spec import ModelSpec
from api.serving.errors import OtherLanguage
from api.serving.languages import detect


@dataclass(frozen=True)
class Reader:
    """A model's declared languages and what it does with a text outside them."""

    name: str
    languages: frozenset[str]
    policy: str  # route, refuse or answer
    declared: tuple[str, ...]  # as the models file lists them, for messages

    def describe(self) -> str:
        return ", ".join(self.declared)


@dataclass
class TextRoutes:
    """Where a request's texts go, by position: the model asked, or another one (routed);
    `outside`: those the model asked answers outside its languages."""

    own: list[int] = field(default_factory=list)
    routed: dict[str, list[int]] = field(default_factory=dict)
    outside: list[int] = field(default_factory=list)


class LanguageGate:
    """The declared languages of the served models, and the route each model may send a text
    outside them: the other models, in the models file's order, that declare languages and
    give the same labels (an answer must read the same whichever model gave it)."""

    def __init__(
        self, specs: Sequence[ModelSpec], labels: Mapping[str, list[str]], metrics: Metrics
    ) -> None:
        self.metrics = metrics
        # Each (model, language, outcome)'s child of the counter, kept: prometheus_client's
        # `labels` costs microseconds a call, more than telling a text's language.
        self._children: dict[tuple[str, str, str], prometheus_client.Counter] = {}
        self.readers = {
            spec.name: Reader(
                spec.name, frozenset(spec.languages), spec.on_other_language, tuple(spec.languages)
            )
            for spec in specs
            if spec.languages is not None
        }
        self.targets = {
            name: [
                other
                for other in self.readers.values()
                if other.name != name and labels.get(other.name) == labels.get(name)
            ]
            for name in self.readers
        }

    def route(self, model: str, texts: Sequence[str], may_route: bool) -> TextRoutes | None:
        """Where each text goes; None where the model declares no languages (it answers all,
        and nothing is detected). OtherLanguage for the first text it may not answer."""
        reader = self.readers.get(model)
        if reader is None:
            return None
        routes = TextRoutes()
        counts: Counter[tuple[str, str]] = Counter()
        refused: list[tuple[int, str]] = []
        for index, text in enumerate(texts):
            language = detect(text)
            if reads(reader.languages, language):
                routes.own.append(index)
                counts[(language, "answered")] += 1
            elif reader.policy == "answer":
                routes.own.append(index)
                routes.outside.append(index)
                counts[(language, "outside_answered")] += 1
            else:
                target = self._reader_of(model, language)
                if reader.policy == "route" and may_route and target is not None:
                    routes.routed.setdefault(target, []).append(index)
                    counts[(language, "routed")] += 1
                else:
                    refused.append((index, language))
                    counts[(language, "refused")] += 1
        if refused:
            self._count(model, {key: n for key, n in counts.items() if key[1] == "refused"})
            index, language = refused[0]
            raise OtherLanguage(self._refusal(reader, index, language, may_route))
        self._count(model, counts)
        return routes

    def _reader_of(self, model: str, language: str) -> str | None:
        """The first other model that reads `language`, for `model` to route a text to."""
        for other in self.targets.get(model, ()):
            if reads(other.languages, language):
                return other.name
        return None

    def _refusal(self, reader: Reader, index: int, language: str, may_route: bool) -> str:
        message = (
            f"inputs[{index}] is in {language} (told by its script); model {reader.name!r} "
            f"reads {reader.describe()}"
        )
        other = self._reader_of(reader.name, language)
        if other is not None and not (reader.policy == "route" and may_route):
            return f"{message}; model {other!r} reads it: ask it by name"
        if reader.policy == "route":
            return f"{message}, and no other model reads it"
        return message

    def _count(self, model: str, counts: Mapping[tuple[str, str], int]) -> None:
        for (language, outcome), n in counts.items():
            key = (model, language, outcome)
            child = self._children.get(key)
            if child is None:
                child = self._children[key] = self.metrics.language_texts.labels(*key)
            child.inc(n)
