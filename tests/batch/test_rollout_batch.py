"""Files scored beside a server's canary: `score --url` gets what the server serves (texts
split between the default and its candidate), `evaluate --url` judges the default adapter
alone, and in process no candidate runs."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.support.batch_cli import cli_env, read_jsonl, run_cli
from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

CANARY = {"adapter": "promo", "mode": "canary", "share": 0.5}


def labelled_texts(path: Path, count: int) -> tuple[Path, list[str]]:
    texts = [f"row {i} {'win cash now' if i % 3 else 'see you at lunch'}" for i in range(count)]
    rows = [{"text": text, "label": "spam" if i % 3 else "ham"} for i, text in enumerate(texts)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path, texts


def spam_scores(rows: list[dict[str, object]]) -> list[float]:
    found = []
    for row in rows:
        scores = row["scores"]
        assert isinstance(scores, list)
        found.append(next(pair["score"] for pair in scores if pair["label"] == "spam"))
    return found


def test_files_scored_beside_a_canary(tiny_bert: TinyModel, tmp_path: Path) -> None:
    models = tiny_models_file(tmp_path, tiny_bert, candidate=CANARY)
    source, texts = labelled_texts(tmp_path / "labelled.jsonl", 60)
    env = cli_env(models, tmp_path)
    settings = {
        "MODELS_FILE": str(models),
        "DISK_CACHE_DIR": str(tmp_path / "server-cache"),
        "ADMISSION_CONTROL": "false",
    }
    with run_server(settings, tmp_path) as server:
        server.wait_ready()
        by_adapter = {}
        for adapter in ("spam", "promo"):
            answers = []
            for start in range(0, len(texts), 20):
                body = {"inputs": texts[start : start + 20], "adapter": adapter}
                answer = httpx.post(f"{server.url}/predict", json=body, timeout=60)
                assert answer.status_code == 200, answer.text
                answers += spam_scores([{"scores": a} for a in answer.json()])
            by_adapter[adapter] = answers
        scored = tmp_path / "served.jsonl"
        split = run_cli(env, tmp_path, "score", source, "--url", server.url, "-o", scored)
        assert split.returncode == 0, split.stderr
        report = tmp_path / "report"
        judged = run_cli(env, tmp_path, "evaluate", source, "--url", server.url, "--report", report)
        assert judged.returncode == 0, judged.stderr
    _, served = read_jsonl(scored)
    got = spam_scores(served)
    from_candidate = [
        abs(g - p) < 1e-5 and abs(g - s) > 1e-3
        for g, s, p in zip(got, by_adapter["spam"], by_adapter["promo"], strict=True)
    ]
    assert 0 < sum(from_candidate) < len(texts)  # the canary answered some texts, not all
    header, judged_rows = read_jsonl(report / "scores-0.jsonl")
    assert header["adapter"] == "spam"
    assert spam_scores(judged_rows) == pytest.approx(by_adapter["spam"], abs=1e-5)
    local = run_cli(env, tmp_path, "score", source, "-o", tmp_path / "local.jsonl")
    assert local.returncode == 0, local.stderr
    _, in_process = read_jsonl(tmp_path / "local.jsonl")
    assert spam_scores(in_process) == pytest.approx(by_adapter["spam"], abs=1e-5)
