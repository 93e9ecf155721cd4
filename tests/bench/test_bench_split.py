"""bench.split end to end in its quick form: a real second process answering over a Unix
socket at each client count, the service's own app with a simulated model driven without
HTTP (disk tier on and off), and the report's page."""

from __future__ import annotations

import json
from pathlib import Path

from bench.split import ANSWER, CLIENT_COUNTS, answers_for
from tests.support.bench_runs import run_bench


def test_the_reply_holds_one_answer_of_the_services_shape_a_text() -> None:
    assert json.loads(answers_for(3)) == [ANSWER, ANSWER, ANSWER]
    assert len(ANSWER) == 4  # two probabilities and their two logits


def test_the_split_benchmark_measures_the_hop_and_the_model_side(tmp_path: Path) -> None:
    args = ["--quick", "--out", str(tmp_path)]
    figures = run_bench("split", args, tmp_path, "split", timeout=300)
    hop = figures["hop"]
    assert [row["clients"] for row in hop] == list(CLIENT_COUNTS)
    for row in hop:
        assert sorted(run["mode"] for run in row["runs"]) == ["hop", "local"]
        # Every run answered every request it asked, a turn at a time.
        assert all(run["requests"] == figures["requests"] for run in row["runs"])
        assert all(0 < run["turns"] <= run["requests"] for run in row["runs"])
    # One client waits for each answer before it asks again: a message a request.
    assert hop[0]["texts_a_turn"] == 1.0
    model_side = figures["model_side"]
    assert sorted(model_side) == ["off", "on"]
    for runs in model_side.values():
        assert len(runs) == figures["repeats"]
        for run in runs:  # each text asked once: answered, or refused and not asked again
            assert run["requests"] + run["refused"] == figures["model_side_requests"]
            assert run["cpu_us"] > 0
    page = (tmp_path / "split.md").read_text(encoding="utf-8")
    rows = len(CLIENT_COUNTS) + 2 * figures["repeats"]
    assert page.count("\n| ") == 2 + rows  # two headers, a row a client count and a run
