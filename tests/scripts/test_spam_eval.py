"""How the spam adapters are scored: metrics, the decision threshold, the look-alike slice,
checked on small cases worked out by hand."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from scripts.spam_data import PH, SMS, LabelledText, SpamSplits
from scripts.spam_eval import (
    choose_decision_threshold,
    compute_metrics,
    evaluate_fixed,
    lookalike,
    threshold_cost,
)


def sms(label: int, text: str = "") -> LabelledText:
    return LabelledText(text or f"sms {label}", label, SMS, "spam" if label else "ham")


def ph(category: str, text: str = "") -> LabelledText:
    return LabelledText(text or f"ph {category}", int(category == "spam"), PH, category)


def test_metrics_of_a_confusion_worked_out_by_hand() -> None:
    # 3 spam caught, 1 missed, 2 ham blocked, 4 passed.
    m = compute_metrics([1, 1, 1, 1, 0, 0, 0, 0, 0, 0], [1, 1, 1, 0, 1, 1, 0, 0, 0, 0])
    assert (m.true_spam, m.false_ham, m.false_spam, m.true_ham) == (3, 1, 2, 4)
    assert m.accuracy == pytest.approx(0.7)
    assert m.spam_precision == pytest.approx(3 / 5)
    assert m.spam_recall == pytest.approx(3 / 4)
    assert m.spam_f1 == pytest.approx(2 * 0.6 * 0.75 / 1.35)
    assert m.ham_false_positive_rate == pytest.approx(2 / 6)


def test_each_corpus_weighs_the_same_and_a_blocked_ham_twice_a_missed_spam() -> None:
    rows = [sms(0), sms(0), sms(1), sms(1), ph("ads"), ph("spam")]
    spam = [0.1, 0.3, 0.7, 0.9, 0.6, 0.95]
    # At 0.5 the PH ad is blocked: 2 x 1 of PH's 2 texts; the SMS texts are all right.
    assert threshold_cost(rows, spam, 0.5) == pytest.approx(1.0)
    chosen = choose_decision_threshold(rows, spam)
    assert chosen["threshold"] == 0.65  # between the ad (0.6) and the SMS spam (0.7)
    assert chosen["validation_cost"] == 0 and chosen["validation_cost_at_0_5"] == 1.0


def test_ties_keep_the_threshold_nearest_one_half() -> None:
    rows = [sms(0), sms(0), sms(1), sms(1)]
    assert choose_decision_threshold(rows, [0.1, 0.3, 0.7, 0.9])["threshold"] == 0.5


def test_blocking_a_ham_costs_more_than_missing_a_spam() -> None:
    # The ham scores above the spam: no threshold is right on both. Missing the spam (1)
    # beats blocking the ham (2), so the threshold goes above both texts.
    rows = [ph("ads"), ph("spam")]
    chosen = choose_decision_threshold(rows, [0.8, 0.6])
    assert chosen["threshold"] > 0.8 and chosen["validation_cost"] == pytest.approx(0.5)


def test_lookalike_counts_blocked_legitimate_ph_texts_by_category() -> None:
    rows = [ph("ads", "a1"), ph("ads", "a2"), ph("gov"), ph("notifs"), ph("spam"), sms(0)]
    slices = lookalike(rows, [0.9, 0.2, 0.7, 0.1, 0.99, 0.99], 0.5)
    assert slices["ads"] == {"n": 2, "blocked": 1, "false_positive_rate": 0.5}
    assert slices["gov"] == {"n": 1, "blocked": 1, "false_positive_rate": 1.0}
    assert slices["notifs"] == {"n": 1, "blocked": 0, "false_positive_rate": 0.0}
    # SMS ham and PH spam are not look-alikes.
    assert slices["all"] == {"n": 4, "blocked": 2, "false_positive_rate": 0.5}


def test_a_fixed_model_is_held_out_on_every_corpus_it_never_saw() -> None:
    corpora = {
        SMS: SpamSplits([sms(0, "s1")], [sms(1, "s2")], [sms(1, "win s3"), sms(0, "s4")], 13),
        PH: SpamSplits([ph("ads", "p1")], [ph("gov", "p2")], [ph("ads", "win p3")], 13),
    }

    def score(rows: Sequence[LabelledText]) -> list[float]:
        return [0.9 if "win" in r.text else 0.1 for r in rows]

    report = evaluate_fixed(score, corpora, 0.5, trained_on=[SMS])
    assert set(report["results"]) == {"sms_test", "ph_newest", "without_ph"}
    assert report["results"]["sms_test"]["accuracy"] == 1.0
    assert report["results"]["ph_newest"]["false_spam"] == 1
    # Every PH text, train and validation included: the model never saw any of them.
    assert report["results"]["without_ph"]["n"] == 3
    assert report["lookalike"]["without_ph"]["ads"] == {
        "n": 2,
        "blocked": 1,
        "false_positive_rate": 0.5,
    }
