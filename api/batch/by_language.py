"""evaluate's metrics per detected language (api.serving.languages): where a model is blind,
its texts refused or answered wrong, next to where it reads."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator
from typing import Any

from api.batch.evaluation import NO_LABEL, Judgements, ratio
from api.batch.rows import Row
from api.models.languages import NO_LANGUAGE
from api.serving.languages import detect

# What is counted per language: rows, rows without an answer, rows answered with an expected
# label, those answered right; with two labels: positives, negatives, true and false positives.
TALLIED = ("rows", "errors", "scored", "correct", "pos", "neg", "tp", "fp")


class RowLanguages:
    """Each row's detected language, in row order: one byte a row (the languages detection
    reports are a few dozen); a row without a text counts as `none`."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self._index: dict[str, int] = {}
        self.codes: array[int] = array("B")

    def tagged(self, rows: Iterable[Row]) -> Iterator[Row]:
        """`rows`, each one's language noted as it passes."""
        for row in rows:
            language = NO_LANGUAGE if row.text is None else detect(row.text)
            code = self._index.setdefault(language, len(self.names))
            if code == len(self.names):
                self.names.append(language)
            self.codes.append(code)
            yield row


def per_language(judged: Judgements, languages: RowLanguages) -> dict[str, dict[str, Any]]:
    """Per language, most rows first: rows, errors (no answer: refused for the language, or
    another row error), scored (answered, with an expected label of the model's), accuracy,
    and with two labels the second label's recall and the first's false-positive rate."""
    two = len(judged.labels) == 2
    tallies: dict[int, dict[str, int]] = {}
    for code, expected, predicted in zip(
        languages.codes, judged.expected, judged.predicted, strict=True
    ):
        tally = tallies.get(code)
        if tally is None:
            tally = tallies[code] = dict.fromkeys(TALLIED, 0)
        tally["rows"] += 1
        if predicted == NO_LABEL:
            tally["errors"] += 1
            continue
        if expected == NO_LABEL:
            continue
        tally["scored"] += 1
        tally["correct"] += expected == predicted
        if two:
            positive = expected == 1
            tally["pos" if positive else "neg"] += 1
            tally["tp" if positive else "fp"] += predicted == 1
    found: dict[str, dict[str, Any]] = {}
    for code, t in sorted(tallies.items(), key=lambda item: -item[1]["rows"]):
        entry: dict[str, Any] = {
            "rows": t["rows"],
            "errors": t["errors"],
            "scored": t["scored"],
            "accuracy": ratio(t["correct"], t["scored"]),
        }
        if two:
            entry[f"{judged.labels[1]}_recall"] = ratio(t["tp"], t["pos"])
            entry[f"{judged.labels[0]}_false_positive_rate"] = ratio(t["fp"], t["neg"])
        found[languages.names[code]] = entry
    return found
