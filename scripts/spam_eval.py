"""How both spam adapters are scored: metrics, the decision threshold, the generalization
suite (original held-out split, newest months, leave one corpus out, look-alike slice) and
the model-card tables that put a model beside the one it replaces.

Every model is judged on P(spam) per text and one threshold: spam when P(spam) > threshold.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from api.models.loader import LoadedModel
from api.models.predictor import Predictor, Scores
from scripts.spam_data import CORPORA, PH, PH_TEST_FROM, SMS, LabelledText, SpamSplits, joined

# A blocked ham message (a bank alert, a wanted promotion) costs its reader more than a
# missed spam costs them a glance: the threshold weighs it this many times.
FALSE_POSITIVE_COST = 2.0
THRESHOLD_DECIMALS = 6
"""Thresholds are chosen among values of this many decimals, so the models file holds the
exact number that was scored."""

Scorer = Callable[[Sequence[LabelledText]], list[float]]
"""P(spam) of each row, in order."""

EVALUATIONS: dict[str, str] = {
    "sms_test": "SMS Spam Collection, original held-out test split",
    "ph_newest": f"PH set, newest months (first received from {PH_TEST_FROM:%Y-%m-%d})",
    "without_sms": "SMS Spam Collection, every text, model trained without it",
    "without_ph": "PH set, every text, model trained without it",
}
"""The splits every model is reported on, in table order."""

TEST_SPLITS = ("sms_test", "ph_newest")
"""The two test splits (keys of EVALUATIONS) a served model is scored on."""


def scored_test_splits(corpora: dict[str, SpamSplits]) -> dict[str, Sequence[LabelledText]]:
    """The rows of each of TEST_SPLITS: the SMS held-out split, the PH newest months."""
    return {"sms_test": corpora[SMS].test, "ph_newest": corpora[PH].test}


LOOKALIKE_CATEGORIES = ("ads", "gov", "notifs")
LOOKALIKE_NAMES = {
    "ads": "promotions the user wanted (ads)",
    "gov": "government notices (gov)",
    "notifs": "alerts and notifications (notifs)",
}


@dataclass(frozen=True, slots=True)
class Metrics:
    """Binary metrics with spam as the positive class."""

    n: int
    accuracy: float
    spam_precision: float
    spam_recall: float
    spam_f1: float
    ham_false_positive_rate: float
    true_spam: int
    false_spam: int
    true_ham: int
    false_ham: int


@dataclass
class Trained:
    """A model fitted on some corpora: its training record, its scorer, the model itself."""

    record: dict[str, Any]
    score: Scorer
    model: Any


def compute_metrics(labels: Sequence[int], predictions: Sequence[int]) -> Metrics:
    """Accuracy, spam precision / recall / F1, ham false-positive rate, confusion counts."""
    pairs = list(zip(labels, predictions, strict=True))
    tp = sum(1 for y, p in pairs if y == 1 and p == 1)
    fp = sum(1 for y, p in pairs if y == 0 and p == 1)
    tn = sum(1 for y, p in pairs if y == 0 and p == 0)
    fn = sum(1 for y, p in pairs if y == 1 and p == 0)
    n = len(pairs)
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return Metrics(
        n=n,
        accuracy=(tp + tn) / n if n else 0.0,
        spam_precision=precision,
        spam_recall=recall,
        spam_f1=f1,
        ham_false_positive_rate=fp / (fp + tn) if fp + tn else 0.0,
        true_spam=tp,
        false_spam=fp,
        true_ham=tn,
        false_ham=fn,
    )


def decide(spam_probability: Sequence[float], threshold: float) -> list[int]:
    """1 (spam) where P(spam) > threshold, else 0."""
    return [int(p > threshold) for p in spam_probability]


def metrics_at(
    rows: Sequence[LabelledText], spam_probability: Sequence[float], threshold: float
) -> dict[str, Any]:
    """The metrics of deciding at `threshold`, as a dict for eval.json."""
    return asdict(compute_metrics([r.label for r in rows], decide(spam_probability, threshold)))


def prediction_cost(rows: Sequence[LabelledText], predictions: Sequence[int]) -> float:
    """Sum over corpora of (FALSE_POSITIVE_COST x ham blocked + spam missed) / texts: each
    corpus weighs the same, however many texts it brings."""
    cost = 0.0
    for corpus in {r.corpus for r in rows}:
        pairs = [(r.label, p) for r, p in zip(rows, predictions, strict=True) if r.corpus == corpus]
        blocked = sum(1 for y, p in pairs if y == 0 and p == 1)
        missed = sum(1 for y, p in pairs if y == 1 and p == 0)
        cost += (FALSE_POSITIVE_COST * blocked + missed) / len(pairs)
    return cost


def threshold_cost(
    rows: Sequence[LabelledText], spam_probability: Sequence[float], threshold: float
) -> float:
    """prediction_cost of deciding at `threshold`."""
    return prediction_cost(rows, decide(spam_probability, threshold))


def candidate_thresholds(values: Sequence[float]) -> list[float]:
    """0.5 and the midpoints between consecutive distinct values (and 0 below them, 1 above
    them: blocking every text, or none), rounded, inside (0, 1)."""
    ordered = sorted({0.0, 1.0, *values})
    low, high = 10.0**-THRESHOLD_DECIMALS, 1.0 - 10.0**-THRESHOLD_DECIMALS
    mids = {round((a + b) / 2, THRESHOLD_DECIMALS) for a, b in itertools.pairwise(ordered)}
    return sorted({0.5} | {min(max(m, low), high) for m in mids})


def choose_decision_threshold(
    rows: Sequence[LabelledText], spam_probability: Sequence[float]
) -> dict[str, Any]:
    """The threshold of least `threshold_cost` on validation `rows`; ties go to the one
    nearest 0.5 in log-odds (the argmax, unless the data says otherwise)."""

    def key(threshold: float) -> tuple[float, float]:
        cost = threshold_cost(rows, spam_probability, threshold)
        return round(cost, 12), abs(math.log(threshold / (1.0 - threshold)))

    best = min(candidate_thresholds(spam_probability), key=key)
    return {
        "threshold": best,
        "rule": (
            "least validation cost, summed over corpora: (2 x ham blocked + spam missed) / "
            "texts of that corpus; ties to the threshold nearest 0.5"
        ),
        "validation_cost": round(threshold_cost(rows, spam_probability, best), 6),
        "validation_cost_at_0_5": round(threshold_cost(rows, spam_probability, 0.5), 6),
        "validation_texts": {c: sum(r.corpus == c for r in rows) for c in CORPORA},
    }


def lookalike(
    rows: Sequence[LabelledText], spam_probability: Sequence[float], threshold: float
) -> dict[str, dict[str, Any]]:
    """Legitimate messages that look like spam (the PH set's ham categories): per category,
    and all together, how many there are and how many are blocked."""
    slices: dict[str, dict[str, Any]] = {}
    for name in (*LOOKALIKE_CATEGORIES, "all"):
        chosen = [
            p
            for r, p in zip(rows, spam_probability, strict=True)
            if r.corpus == PH and r.label == 0 and (name == "all" or r.category == name)
        ]
        blocked = sum(1 for p in chosen if p > threshold)
        slices[name] = {
            "n": len(chosen),
            "blocked": blocked,
            "false_positive_rate": blocked / len(chosen) if chosen else 0.0,
        }
    return slices


def evaluate_fixed(
    score: Scorer, corpora: dict[str, SpamSplits], threshold: float, trained_on: Sequence[str]
) -> dict[str, Any]:
    """A given model on the suite's splits it did not train on: both test splits, and every
    text of each corpus it never saw (its leave-one-corpus-out figure)."""
    results: dict[str, Any] = {}
    slices: dict[str, Any] = {}
    for key, rows in (("sms_test", corpora[SMS].test), ("ph_newest", corpora[PH].test)):
        probabilities = score(rows)
        results[key] = metrics_at(rows, probabilities, threshold)
        if key == "ph_newest":
            slices[key] = lookalike(rows, probabilities, threshold)
    for corpus in CORPORA:
        if corpus in trained_on:
            continue
        rows = corpora[corpus].everything()
        probabilities = score(rows)
        results[f"without_{corpus}"] = metrics_at(rows, probabilities, threshold)
        if corpus == PH:
            slices["without_ph"] = lookalike(rows, probabilities, threshold)
    return {"threshold": threshold, "results": results, "lookalike": slices}


def evaluate_chosen(
    score: Scorer, corpora: dict[str, SpamSplits], trained_on: Sequence[str], seed: int
) -> dict[str, Any]:
    """evaluate_fixed at the threshold chosen on the validation texts of every corpus, with
    the validation metrics per corpus at that threshold."""
    validation = joined(corpora, CORPORA, seed).validation
    probabilities = score(validation)
    choice = choose_decision_threshold(validation, probabilities)
    report = evaluate_fixed(score, corpora, choice["threshold"], trained_on)
    report["decision_threshold"] = choice
    report["validation"] = {}
    for corpus in CORPORA:
        pairs = [
            (r, p) for r, p in zip(validation, probabilities, strict=True) if r.corpus == corpus
        ]
        report["validation"][corpus] = metrics_at(
            [r for r, _ in pairs], [p for _, p in pairs], choice["threshold"]
        )
    return report


def evaluate_suite(
    corpora: dict[str, SpamSplits],
    fit: Callable[[SpamSplits, str], Trained],
    seed: int,
    leave_one_out: bool = True,
) -> tuple[dict[str, Any], Trained]:
    """Fits the model on every corpus (the one shipped) and, with `leave_one_out`, once
    without each corpus; each fit chooses its threshold on its own validation texts.
    Returns (report, shipped model)."""
    main = fit(joined(corpora, CORPORA, seed), "every corpus")
    report = evaluate_chosen(main.score, corpora, CORPORA, seed)
    if not leave_one_out:
        return report, main
    report["leave_one_out"] = {}
    for held_out in CORPORA:
        others = [c for c in CORPORA if c != held_out]
        splits = joined(corpora, others, seed)
        fitted = fit(splits, f"without {held_out}")
        chosen = choose_decision_threshold(splits.validation, fitted.score(splits.validation))
        rows = corpora[held_out].everything()
        probabilities = fitted.score(rows)
        report["results"][f"without_{held_out}"] = metrics_at(
            rows, probabilities, chosen["threshold"]
        )
        if held_out == PH:
            report["lookalike"]["without_ph"] = lookalike(rows, probabilities, chosen["threshold"])
        report["leave_one_out"][held_out] = {
            "training": fitted.record,
            "decision_threshold": chosen,
        }
        del fitted
    report["results"] = {key: report["results"][key] for key in EVALUATIONS}
    return report, main


def served_probabilities(
    loaded: LoadedModel, rows: Sequence[LabelledText], batch_size: int = 32
) -> tuple[list[float], list[float]]:
    """(spam score, top score) per row from the service's own Predictor, as served: with
    the model's decision threshold applied, spam wins where its score is above 0.5."""
    predictor = Predictor(loaded)
    ids = predictor.encode([r.text for r in rows])
    order = sorted(range(len(rows)), key=lambda i: len(ids[i]))
    spam, top = [0.0] * len(rows), [0.0] * len(rows)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        batch = predictor.forward([ids[i] for i in idx], [None] * len(idx))
        for i, scores in zip(idx, batch, strict=True):
            if not isinstance(scores, Scores):
                raise scores
            spam[i], top[i] = scores.probabilities[1], max(scores.probabilities)
    return spam, top


# --------------------------------------------------------------------------- card tables


def pct(value: float, digits: int = 2) -> str:
    """A fraction as a percentage."""
    return f"{100 * value:.{digits}f} %"


def threshold_paragraph(model: str, chosen: dict[str, Any]) -> str:
    """The model card's sentence on the decision threshold `chosen` (choose_decision_threshold)."""
    texts = chosen["validation_texts"]
    return (
        f"Decision threshold: spam when P(spam) > **{chosen['threshold']}** (`decision_threshold` "
        f"of `{model}` in `artifacts/models.yaml`, shown by `/info`), chosen on the "
        f"{texts[SMS]} SMS and {texts[PH]} PH validation texts: the {chosen['rule']} "
        f"(validation cost {chosen['validation_cost']}, against "
        f"{chosen['validation_cost_at_0_5']} at 0.5)."
    )


def leave_one_out_paragraph(current: dict[str, Any]) -> str:
    """The model card's reading of the leave-one-corpus-out rows; empty if they were not run."""
    results, lookalikes = current["results"], current["lookalike"]
    if "without_sms" not in results or "without_ph" not in lookalikes:
        return ""
    on_ph, on_sms = results["without_ph"], results["without_sms"]
    ads = lookalikes["without_ph"]["ads"]
    return (
        "What leaving one corpus out says: neither corpus alone teaches where the other draws "
        "the line between spam and ham. Trained on the SMS Spam Collection alone, the model "
        f"blocks {pct(on_ph['ham_false_positive_rate'])} of the PH set's legitimate messages "
        f"and {pct(ads['false_positive_rate'])} of its wanted promotions: in the 2000s UK "
        "corpus, promotional wording meant spam. Trained on the PH set alone, it blocks "
        f"{pct(on_sms['ham_false_positive_rate'])} of the SMS Spam Collection's ham, most "
        "likely because the PH ham is businesses, government and alerts, with no personal "
        "chat. So both corpora train the shipped model, and a deployment should measure, and "
        "train on, its own traffic: a corpus with a line of its own would fare like these rows, "
        "not like the held-out ones."
    )


def _cells(m: dict[str, Any]) -> str:
    return (
        f"{pct(m['accuracy'])} | {m['spam_precision']:.4f} | {m['spam_recall']:.4f} "
        f"| {m['spam_f1']:.4f} | {pct(m['ham_false_positive_rate'])}"
    )


def comparison_table(current: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """Markdown: each split of EVALUATIONS, the previous model's row above this one's."""
    lines = [
        "| Split (texts, spam) | Model | Accuracy | Spam precision | Spam recall | Spam F1 "
        "| Ham FPR |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, title in EVALUATIONS.items():
        m = current["results"].get(key)
        if m is None:
            lines.append(f"| {title} | this model | not run (see Training) | | | | |")
        else:
            spam = m["true_spam"] + m["false_ham"]
            lines.append(f"| {title} ({m['n']}, {spam}) | this model | {_cells(m)} |")
        if previous is None:
            continue
        old = previous["results"].get(key)
        if old is None:
            lines.append("| | previous | trained on it: no held-out figure | | | | |")
        else:
            lines.append(f"| | previous | {_cells(old)} |")
    return "\n".join(lines)


def lookalike_table(current: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """Markdown: blocked look-alike ham per category, newest months and every PH text."""
    header = "| Legitimate look-alikes | Texts | This model: blocked (FPR) |"
    rule = "|---|---|---|"
    if previous is not None:
        header += " Previous: blocked (FPR) |"
        rule += "---|"
    lines = [header, rule]
    for split, title in (("ph_newest", "newest months"), ("without_ph", "every PH text")):
        for name in (*LOOKALIKE_CATEGORIES, "all"):
            label = LOOKALIKE_NAMES.get(name, "all legitimate PH texts")
            if split in current["lookalike"]:
                now = current["lookalike"][split][name]
                rate = pct(now["false_positive_rate"])
                row = f"| {label}, {title} | {now['n']} | {now['blocked']} ({rate}) |"
            else:
                row = f"| {label}, {title} | — | not run |"
            if previous is not None:
                old = previous["lookalike"][split][name]
                row += f" {old['blocked']} ({pct(old['false_positive_rate'])}) |"
            lines.append(row)
    return "\n".join(lines)
