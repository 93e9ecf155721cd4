"""evaluate's metrics from what it keeps of each row (two label indices and a score, in
arrays) against the same metrics computed from whole rows, as evaluate computed them when
it held every row: equal to the last bit, with errors, unlabelled rows, tied scores and
scores closer than the thresholds' rounding. And its JSON, written a disagreement at a time,
against the whole written at once."""

from __future__ import annotations

import io
import itertools
import json
import random
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from api.batch.evaluation import (
    Judgements,
    disagreeing_rows,
    disagreements,
    evaluate,
    model_threshold,
)
from api.batch.output import json_text, write_json
from api.batch.rows import Row
from api.batch.scoring import Outcome, Ranked, Servable

Judged = tuple[str | None, Ranked | None]  # a whole row: its expected label and answer


def ranked_answer(labels: Sequence[str], scores: Sequence[float]) -> Ranked:
    pairs = sorted(zip(labels, scores, strict=True), key=lambda p: -p[1])
    return [{"label": label, "score": score} for label, score in pairs]


def random_rows(rng: random.Random, labels: list[str], count: int) -> list[Judged]:
    """Rows with every kind of outcome; positive scores on a coarse grid (ties), some of them
    1e-7 apart (midpoints that round to one threshold), and 0 and 1 themselves."""
    rows: list[Judged] = []
    for _ in range(count):
        expected = rng.choice([*labels, *labels, "other", None])
        kind = rng.random()
        if kind < 0.05:
            rows.append((expected, None))  # no text, or refused
            continue
        if len(labels) == 2:
            p = rng.choice([0.0, 1.0, round(rng.random(), 2), round(rng.random(), 2) + 1e-7])
            scores = [1.0 - p, min(p, 1.0)]
        else:
            weights = [rng.random() for _ in labels]
            scores = [w / sum(weights) for w in weights]
        rows.append((expected, ranked_answer(labels, scores)))
    return rows


def judgements_of(labels: list[str], rows: Sequence[Judged], compared: bool = False) -> Judgements:
    judged = Judgements(labels, compared)
    for expected, ranked in rows:
        judged.add(expected, None if ranked is None else Outcome(ranked, "m"))
    return judged


def whole_rows_metrics(
    servable: Servable, rows: Sequence[Judged], cost_fp: float, cost_fn: float
) -> dict[str, Any]:
    """The metrics from the rows as evaluate held them: each threshold's counts by trying
    every score against it."""
    labels = servable.labels
    predicted = [None if ranked is None else ranked[0]["label"] for _, ranked in rows]
    counted = [
        (e, p, ranked)
        for (e, ranked), p in zip(rows, predicted, strict=True)
        if p is not None and e in labels
    ]
    confusion = {e: dict.fromkeys(labels, 0) for e in labels}
    for e, p, _ in counted:
        confusion[e][p] += 1

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    def f1(p: float, r: float) -> float:
        return ratio(2 * p * r, p + r)

    per_label = {}
    for label in labels:
        tp = confusion[label][label]
        support = sum(confusion[label].values())
        precision = ratio(tp, sum(confusion[e][label] for e in labels))
        recall = ratio(tp, support)
        per_label[label] = {
            "precision": precision,
            "recall": recall,
            "f1": f1(precision, recall),
            "support": support,
        }
    errors = sum(1 for p in predicted if p is None)
    negatives = sum(confusion[labels[0]].values())
    report: dict[str, Any] = {
        "servable": servable.column,
        "rows": len(rows),
        "scored": len(counted),
        "errors": errors,
        "unlabelled": len(rows) - errors - len(counted),
        "accuracy": ratio(sum(confusion[k][k] for k in labels), len(counted)),
        "per_label": per_label,
        "negative_label": labels[0],
        "negative_false_positive_rate": ratio(
            negatives - confusion[labels[0]][labels[0]], negatives
        ),
        "confusion": confusion,
    }
    if len(labels) != 2:
        return report
    positive = labels[1]
    scored = [
        (e == positive, next(float(s["score"]) for s in ranked if s["label"] == positive))
        for e, _, ranked in counted
    ]

    def at(t: float) -> dict[str, Any]:
        tp = sum(1 for truth, s in scored if truth and s > t)
        fp = sum(1 for truth, s in scored if not truth and s > t)
        fn = sum(1 for truth, s in scored if truth and s <= t)
        tn = sum(1 for truth, s in scored if not truth and s <= t)
        precision, recall = ratio(tp, tp + fp), ratio(tp, tp + fn)
        return {
            "tp": tp,
            "fp": fp,
            "tn": tn,
            "fn": fn,
            "accuracy": ratio(tp + tn, tp + fp + tn + fn),
            "precision": precision,
            "recall": recall,
            "f1": f1(precision, recall),
            "false_positive_rate": ratio(fp, fp + tn),
            "cost": cost_fp * fp + cost_fn * fn,
        }

    ordered = sorted({0.0, 1.0, *(s for _, s in scored)})
    mids = {round((a + b) / 2, 6) for a, b in itertools.pairwise(ordered)}
    best = min(sorted({0.5} | mids), key=lambda t: (at(t)["cost"], abs(t - 0.5)))
    report["thresholds"] = {
        "positive_label": positive,
        "cost_fp": cost_fp,
        "cost_fn": cost_fn,
        "decision": {
            "served_threshold": 0.5,
            "model_threshold": servable.decision_threshold or 0.5,
            **at(0.5),
        },
        "least_cost": {
            "served_threshold": best,
            "model_threshold": model_threshold(best, servable.decision_threshold),
            **at(best),
        },
    }
    return report


@pytest.mark.parametrize(
    ("labels", "seed", "costs"),
    [
        (["ham", "spam"], 1, (1.0, 1.0)),
        (["ham", "spam"], 2, (5.0, 1.0)),
        (["ham", "spam"], 3, (1.0, 7.0)),
        (["neutral", "positive", "negative"], 4, (1.0, 1.0)),
    ],
)
def test_metrics_from_the_kept_arrays_equal_those_of_whole_rows(
    labels: list[str], seed: int, costs: tuple[float, float]
) -> None:
    rows = random_rows(random.Random(seed), labels, 700)
    servable = Servable("m", "a", labels, 0.3, {"m": "digest"})
    judged = judgements_of(labels, rows)
    reported = evaluate(servable, judged, *costs)
    assert reported == whole_rows_metrics(servable, rows, *costs)
    assert reported["errors"] and reported["unlabelled"]  # the rows had both kinds
    if len(labels) == 2:  # one byte a label, one double a score: nothing else per row
        assert (judged.expected.itemsize, judged.predicted.itemsize) == (1, 1)
        assert len(judged.positive) == len(rows) and not judged.top


def test_thresholds_of_equal_cost_and_distance_from_half_go_to_the_lower() -> None:
    # Candidates 0.1875, 0.5 and 0.8125 (midpoints of 0, 0.375, 0.625, 1), costing 1, 2, 1;
    # the two of cost 1 exactly as far from 0.5: the first one tried, the lower, as min() did.
    servable = Servable("m", None, ["ham", "spam"], None, {})
    rows: list[Judged] = [
        ("spam", ranked_answer(servable.labels, [0.625, 0.375])),
        ("ham", ranked_answer(servable.labels, [0.375, 0.625])),
    ]
    reported = evaluate(servable, judgements_of(servable.labels, rows), 1.0, 1.0)
    assert reported["thresholds"]["least_cost"]["served_threshold"] == 0.1875
    assert reported == whole_rows_metrics(servable, rows, 1.0, 1.0)


def test_no_row_scored_gives_zeros_not_a_failure() -> None:
    servable = Servable("m", None, ["ham", "spam"], None, {})
    rows: list[Judged] = [(None, None), ("spam", None)]
    assert evaluate(servable, judgements_of(servable.labels, rows), 1.0, 1.0) == (
        whole_rows_metrics(servable, rows, 1.0, 1.0)
    )


def test_disagreements_come_from_the_kept_labels_and_the_file_read_again() -> None:
    labels = ["ham", "spam"]
    rng = random.Random(9)
    first, second = random_rows(rng, labels, 300), random_rows(rng, labels, 300)
    columns = {
        "m/a": judgements_of(labels, first, compared=True),
        "m/b": judgements_of(labels, second, compared=True),
    }
    file_rows = [Row(i, f"text {i}", f"id{i}", f"label{i}") for i in range(300)]

    def expected(row: Row) -> str | None:
        return None if row.label is None else row.label.upper()

    apart = disagreeing_rows(columns)
    found = list(disagreements(columns, apart, file_rows, expected))
    wanted = [
        {
            "row": i,
            "id": f"id{i}",
            "expected": f"LABEL{i}",
            "labels": {"m/a": a[0]["label"], "m/b": b[0]["label"]},
            "top_scores": {"m/a": a[0]["score"], "m/b": b[0]["score"]},
        }
        for i, ((_, a), (_, b)) in enumerate(zip(first, second, strict=True))
        if a is not None and b is not None and a[0]["label"] != b[0]["label"]
    ]
    assert wanted and found == wanted
    assert list(apart) == [d["row"] for d in wanted]


def test_no_disagreement_reads_no_file() -> None:
    def unread() -> Iterator[Row]:
        raise AssertionError("read")
        yield  # a generator

    assert list(disagreements({}, [], unread(), lambda row: None)) == []


@pytest.mark.parametrize("count", [0, 1, 3])
def test_json_written_an_item_at_a_time_reads_as_the_whole(count: int) -> None:
    head = {"input": "in\udc80.csv", "servables": [{"rows": 3, "per_label": {"ham": {}}}]}
    items = [{"row": i, "labels": {"a": "ham", "b": "spam"}, "id": None} for i in range(count)]
    stream = io.StringIO()
    write_json(stream, head, "disagreements", iter(items))
    whole = {**head, "disagreements": items}
    assert stream.getvalue() == json_text(whole, indent=2) + "\n"
    assert json.loads(stream.getvalue())["disagreements"] == items
