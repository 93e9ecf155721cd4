"""`loraserve evaluate` run as a user runs it, on a real (tiny) model with two adapters: every
metric it reports is recomputed here by hand from the scored rows it wrote."""

from __future__ import annotations

import csv
import json
import math
import random
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.batch_cli import cli_env, read_jsonl, run_cli
from tests.support.tiny_models import TinyModel, tiny_models_file

# Between the two random adapters' own P(spam) (about 0.2 and 0.68): they disagree.
DECISION_THRESHOLD = 0.3
WORDS = [
    "free",
    "prize",
    "call",
    "now",
    "win",
    "cash",
    "lunch",
    "home",
    "see",
    "you",
    "later",
    "txt",
    "claim",
    "urgent",
    "reply",
]


def labelled_csv(path: Path, count: int) -> Path:
    """`count` random texts labelled legit/junk, one unknown label, one empty text."""
    rng = random.Random(5)
    with path.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "kind", "text"])
        for index in range(count):
            text = " ".join(rng.choices(WORDS, k=rng.randint(2, 9)))
            writer.writerow([f"m{index}", rng.choice(["legit", "junk"]), text])
        writer.writerow(["unknown", "maybe", "see you later"])
        writer.writerow(["empty", "junk", ""])
    return path


def by_hand(rows: list[dict[str, Any]], cost_fp: float, cost_fn: float) -> dict[str, Any]:
    """The metrics of scored rows, from their lines alone."""
    counted = [r for r in rows if "label" in r and r["expected"] in ("ham", "spam")]
    pairs = [(r["expected"], r["label"]) for r in counted]
    confusion = {e: {p: pairs.count((e, p)) for p in ("ham", "spam")} for e in ("ham", "spam")}
    per_label = {}
    for label in ("ham", "spam"):
        tp = confusion[label][label]
        predicted = confusion["ham"][label] + confusion["spam"][label]
        actual = sum(confusion[label].values())
        p = tp / predicted if predicted else 0.0
        r = tp / actual if actual else 0.0
        per_label[label] = {
            "precision": p,
            "recall": r,
            "f1": 2 * p * r / (p + r) if p + r else 0.0,
            "support": actual,
        }
    spam_score = [
        (r["expected"] == "spam", next(s["score"] for s in r["scores"] if s["label"] == "spam"))
        for r in counted
    ]

    def cost(threshold: float) -> float:
        fp = sum(1 for spam, s in spam_score if not spam and s > threshold)
        fn = sum(1 for spam, s in spam_score if spam and s <= threshold)
        return cost_fp * fp + cost_fn * fn

    # Every decision the scores allow: nothing, everything, or a cut at each score.
    least = min(cost(t) for t in [-1.0, *(s for _, s in spam_score)])
    return {
        "rows": len(rows),
        "scored": len(counted),
        "errors": sum(1 for r in rows if "error" in r),
        "accuracy": sum(1 for e, p in pairs if e == p) / len(pairs),
        "per_label": per_label,
        "ham_fpr": confusion["ham"]["spam"] / sum(confusion["ham"].values()),
        "confusion": confusion,
        "cost_at_decision": cost(0.5),
        "least_cost": least,
        "cost": cost,
    }


def test_evaluate_side_by_side_metrics_recomputed_by_hand(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    models = tiny_models_file(tmp_path, tiny_bert, decision_threshold=DECISION_THRESHOLD)
    source = labelled_csv(tmp_path / "labelled.csv", 60)
    report, metrics = tmp_path / "report", tmp_path / "metrics.json"
    done = run_cli(
        cli_env(models, tmp_path),
        tmp_path,
        "evaluate",
        source,
        "--label-column",
        "kind",
        "--label-map",
        "legit=ham,junk=spam",
        "--adapter",
        "promo",
        "--adapter",
        "spam",
        "--cost-fp",
        "3",
        "--cost-fn",
        "1",
        "--json",
        metrics,
        "--report",
        report,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(metrics.read_text(encoding="utf-8"))
    # The served default (spam) first, named once.
    assert [s["servable"] for s in result["servables"]] == ["tiny/spam", "tiny/promo"]
    assert "tiny/spam" in done.stdout and "tiny/promo" in done.stdout
    columns = {}
    for index, reported in enumerate(result["servables"]):
        header, rows = read_jsonl(report / f"scores-{index}.jsonl")
        assert header["model"] + "/" + header["adapter"] == reported["servable"]
        assert [r["id"] for r in rows[-2:]] == ["unknown", "empty"]
        assert [r["expected"] for r in rows[-2:]] == ["maybe", "spam"]  # mapped
        columns[reported["servable"]] = rows
        hand = by_hand(rows, 3.0, 1.0)
        assert (reported["rows"], reported["scored"], reported["errors"]) == (62, 60, 1)
        assert reported["unlabelled"] == 1
        assert reported["accuracy"] == pytest.approx(hand["accuracy"])
        assert reported["confusion"] == hand["confusion"]
        assert reported["negative_label"] == "ham"
        assert reported["negative_false_positive_rate"] == pytest.approx(hand["ham_fpr"])
        for label in ("ham", "spam"):
            assert reported["per_label"][label] == pytest.approx(hand["per_label"][label])
        decision = reported["thresholds"]["decision"]
        assert decision["served_threshold"] == 0.5
        assert decision["model_threshold"] == DECISION_THRESHOLD
        assert decision["cost"] == hand["cost_at_decision"]
        assert decision["fp"] == hand["confusion"]["ham"]["spam"]
        assert decision["fn"] == hand["confusion"]["spam"]["ham"]
        least = reported["thresholds"]["least_cost"]
        assert least["cost"] == hand["least_cost"]
        assert hand["cost"](least["served_threshold"]) == hand["least_cost"]
        served = least["served_threshold"]
        if 0 < served < 1:  # served logit + logit(threshold) is the model's own
            logit = math.log(served / (1 - served)) + math.log(
                DECISION_THRESHOLD / (1 - DECISION_THRESHOLD)
            )
            assert least["model_threshold"] == pytest.approx(1 / (1 + math.exp(-logit)), abs=1e-6)
    first, second = columns["tiny/spam"], columns["tiny/promo"]
    differ = [
        a["row"]
        for a, b in zip(first, second, strict=True)
        if "label" in a and "label" in b and a["label"] != b["label"]
    ]
    assert differ, "two random adapters should disagree somewhere"
    assert [d["row"] for d in result["disagreements"]] == differ
    assert re.search(rf"^rows where they disagree +{len(differ)}$", done.stdout, re.MULTILINE)
    text = (report / "report.md").read_text(encoding="utf-8")
    assert "| accuracy |" in text and f"Rows where they disagree ({len(differ)})" in text
    for plot in ("histogram-0.png", "histogram-1.png", "precision-recall.png"):
        assert (report / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({plot})" in text
