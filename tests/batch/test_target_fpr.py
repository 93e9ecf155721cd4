"""The threshold evaluate reports for a target ham false-positive rate, against every cut
tried by brute force on the model's own scores; the value it gives, written with its digits
(6 decimals where they keep the cut), makes the same cut; and where no threshold can be
told, it says why rather than giving one."""

from __future__ import annotations

import argparse
import random

import pytest
import yaml

from api.batch.commands import UsageError, add_commands, check_target_fpr
from api.batch.evaluation import Sweep, at_target_fpr
from api.batch.scoring import Servable
from api.batch.target_fpr import allowed_false_positives, negatives_needed
from tests.support.fpr_cuts import Scored, lowest_cut, made_cut


def servable(decision_threshold: float | None) -> Servable:
    return Servable("m", "a", ["ham", "spam"], decision_threshold, {"m": "digest"})


def random_scored(rng: random.Random, count: int) -> Scored:
    """Scores on a coarse grid (ties, of ham with spam too), some 1e-7 apart, a few 0 and 1."""
    rows: Scored = []
    for _ in range(count):
        spam = rng.random() < 0.3
        score, kind = round(rng.random() * 0.6 + (0.35 if spam else 0.0), 2), rng.random()
        if kind < 0.2:
            score += 1e-7
        elif kind < 0.21:
            score = 1.0
        elif kind < 0.23:
            score = 0.0
        rows.append((spam, score))
    return rows


@pytest.mark.parametrize("decision_threshold", [None, 0.3, 0.85])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_threshold_makes_the_lowest_cut_meeting_the_target(
    seed: int, decision_threshold: float | None
) -> None:
    rows = random_scored(random.Random(seed), 400)
    sweep = Sweep.of(rows)
    for target in (0.5, 0.2, 0.1, 0.05, 0.01, 0.001):
        found = at_target_fpr(servable(decision_threshold), sweep, target, 1.0, 1.0)
        expected = lowest_cut(rows, target, decision_threshold)
        if expected is None:
            assert found["model_threshold"] is None and "too few ham rows" in found["reason"]
            continue
        fp, tp, cut = expected
        if cut == 1.0:  # hams scoring 1 are let through below any threshold of (0, 1)
            assert found["model_threshold"] is None and "no value in (0, 1)" in found["reason"]
            continue
        assert (found["fp"], found["tp"]) == (fp, tp)
        hams = sum(1 for spam, _ in rows if not spam)
        assert found["false_positive_rate"] == fp / hams <= target
        assert found["recall"] == tp / (len(rows) - hams)
        assert found["precision"] == (tp / (tp + fp) if tp + fp else 0.0)
        chosen = found["model_threshold"]
        assert 0 < chosen < 1 and len(repr(chosen).split(".")[1]) <= 17
        assert made_cut(rows, chosen, decision_threshold) == (fp, tp)
        assert made_cut(rows, yaml.safe_load(f"t: {chosen!r}")["t"], decision_threshold) == (
            fp,
            tp,
        )
        served = found["served_threshold"]  # the same cut on the served scores
        assert sum(1 for spam, s in rows if not spam and s > served) == fp


def test_six_decimals_where_they_keep_the_cut_more_where_they_do_not() -> None:
    # Ham 0.3000001 is the highest left out at a target of 10 % (one of ten let through), and
    # spam 0.3000004 the next score: their midpoint to 6 decimals is 0.3, below both.
    hams = [0.1, 0.15, 0.2, 0.22, 0.25, 0.27, 0.28, 0.29, 0.3000001, 0.95]
    rows: Scored = [*((False, s) for s in hams), (True, 0.3000004), (True, 0.99)]
    found = at_target_fpr(servable(None), Sweep.of(rows), 0.1, 1.0, 1.0)
    assert (found["fp"], found["tp"], 0.3000001) == lowest_cut(rows, 0.1, None)
    assert (found["fp"], found["tp"]) == (1, 2)
    chosen = found["model_threshold"]
    assert 0.3000001 < chosen < 0.3000004 and len(repr(chosen)) == len("0.3000003")
    assert made_cut(rows, round(chosen, 6), None) == (2, 2)  # 6 decimals would move the cut
    assert made_cut(rows, chosen, None) == (1, 2)
    # Far apart, the midpoint to the models file's 6 decimals.
    apart: Scored = [(False, 0.1), (False, 0.2), (False, 0.4), (True, 0.7)]
    found = at_target_fpr(servable(None), Sweep.of(apart), 0.34, 1.0, 1.0)
    assert found["model_threshold"] == 0.3 and (found["fp"], found["tp"]) == (1, 1)


def test_no_threshold_where_none_can_be_told() -> None:
    spam_only: Scored = [(True, 0.9), (True, 0.4)]
    found = at_target_fpr(servable(0.3), Sweep.of(spam_only), 0.01, 1.0, 1.0)
    assert found["model_threshold"] is None and found["reason"] == "no ham rows"
    few: Scored = [(False, i / 100) for i in range(50)] + [(True, 0.9)]
    found = at_target_fpr(servable(0.3), Sweep.of(few), 0.01, 1.0, 1.0)
    assert found["model_threshold"] is None and "fp" not in found
    assert found["reason"] == "too few ham rows: 50, 100 needed"
    cascade = Servable("cascade", None, ["ham", "spam"], None, {"a": "d", "b": "d"})
    found = at_target_fpr(cascade, Sweep.of(few), 0.5, 1.0, 1.0)
    assert found["reason"] == "the cascade has no decision_threshold of its own"
    # The cut falls on hams scoring 1: no threshold below 1 leaves them out.
    saturated: Scored = [(False, 0.2), (False, 1.0), (False, 1.0), (True, 1.0)]
    found = at_target_fpr(servable(0.3), Sweep.of(saturated), 0.34, 1.0, 1.0)
    assert found["model_threshold"] is None and found["served_threshold"] is None
    assert found["reason"] == "no value in (0, 1) between scores 1.0 and 1.0"


@pytest.mark.parametrize("target", [0.29, 0.07, 0.1, 0.01, 0.001, 1 / 3, 0.0004])
def test_allowed_false_positives_as_the_reported_rate_divides(target: float) -> None:
    for negatives in (1, 3, 7, 100, 1000, 2501):
        allowed = allowed_false_positives(negatives, target)
        assert allowed == max(k for k in range(negatives + 1) if k / negatives <= target)
    assert negatives_needed(target) == next(n for n in range(1, 10**4) if 1 / n <= target)


def test_target_ham_fpr_is_repeated_between_0_and_1() -> None:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    args = parser.parse_args(
        ["evaluate", "f.csv", "--target-ham-fpr", "0.01", "--target-ham-fpr", "1e-3"]
    )
    assert args.target_ham_fpr == [0.01, 0.001]
    assert parser.parse_args(["evaluate", "f.csv"]).target_ham_fpr == []
    for wrong in ("0", "1", "-0.1", "nan", "1%"):
        with pytest.raises(SystemExit):
            parser.parse_args(["evaluate", "f.csv", "--target-ham-fpr", wrong])


@pytest.mark.parametrize(
    ("labels", "multi_label", "kind"),
    [(["neutral", "positive", "negative"], False, "3 labels"), (["ham", "spam"], True, "multi")],
)
def test_target_ham_fpr_needs_a_two_label_softmax_model(
    labels: list[str], multi_label: bool, kind: str
) -> None:
    check_target_fpr(servable(None))
    with pytest.raises(UsageError, match=f"--target-ham-fpr needs a two-label .* {kind}"):
        check_target_fpr(Servable("m", None, labels, None, {}, multi_label))
