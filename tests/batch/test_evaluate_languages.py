"""`loraserve evaluate` per detected language, run as a user runs it: a tiny English model
that refuses other languages, a file of English and Korean rows; the per-language figures
recomputed by hand from the scored rows it wrote."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tests.support.batch_cli import cli_env, read_jsonl, run_cli
from tests.support.tiny_models import TinyModel, tiny_models_file

ENGLISH = ["win a free prize now", "see you later", "txt stop to claim cash", "ok"]
KOREAN = ["내일 회의 3시로 변경되었습니다", "[Web발신] 택배 주소 불명 http://bit.ly/3kR9xT"]
NO_LETTERS = ["010-1234-5678"]


def test_evaluate_reports_each_detected_language(tiny_bert: TinyModel, tmp_path: Path) -> None:
    models_file = tiny_models_file(
        tmp_path, tiny_bert, ("spam",), languages=["en"], on_other_language="refuse"
    )
    data = tmp_path / "mixed.csv"
    rows = [(t, "spam" if i % 2 else "ham") for i, t in enumerate(ENGLISH + KOREAN + NO_LETTERS)]
    with data.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "label", "text"])
        writer.writerows([f"r{i}", label, text] for i, (text, label) in enumerate(rows))
    env = cli_env(models_file, tmp_path)
    report = tmp_path / "report"
    metrics = tmp_path / "m.json"
    done = run_cli(env, tmp_path, "evaluate", data, "--json", metrics, "--report", report)
    assert done.returncode == 0, done.stderr
    assert "language ko: rows / errors" in done.stdout
    found = json.loads(metrics.read_text())["servables"][0]["per_language"]
    _, scored = read_jsonl(report / "scores-0.jsonl")
    assert [row.get("error", {}).get("code") for row in scored[4:6]] == ["other_language"] * 2
    answered = [r for r in scored if "label" in r]
    english = [r for r in answered if int(r["id"][1:]) < len(ENGLISH)]
    correct = sum(1 for r in english if r["label"] == r["expected"])
    assert found["ko"] == {
        "rows": 2,
        "errors": 2,
        "scored": 0,
        "accuracy": 0.0,
        "spam_recall": 0.0,
        "ham_false_positive_rate": 0.0,
    }
    assert found["und-Latn"]["rows"] == 4 and found["und-Latn"]["errors"] == 0
    assert found["und-Latn"]["accuracy"] == correct / 4
    assert found["none"] == {**found["none"], "rows": 1, "errors": 0, "scored": 1}
