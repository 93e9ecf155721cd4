"""`loraserve score` / `evaluate` on the rows a real archive holds sooner or later, run as
the command a user types on a real (tiny) model: a lone surrogate in a text, an id or a
label, an empty text, a repeated id, a cut last line. Each such row is a row with an error
(or, a repeated id, scored), the run completes, and the output stays JSONL that any reader
takes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.batch_cli import cli_env, read_jsonl, run_cli
from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

SPAM = "free prize call now claim cash"
HAM = "see you at lunch later"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("odd-rows")


@pytest.fixture(scope="module")
def env(tiny_bert: TinyModel, folder: Path) -> dict[str, str]:
    return cli_env(tiny_models_file(folder, tiny_bert), folder)


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    """One JSON object a line; json.dumps writes a lone surrogate escaped, as "\\ud800"."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def errors_of(rows: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    return {r["row"]: r["error"] for r in rows if "error" in r}


def test_a_text_with_a_lone_surrogate_is_refused_in_process_as_over_http(
    env: dict[str, str], folder: Path, tmp_path: Path
) -> None:
    source = write_jsonl(
        folder / "texts.jsonl",
        [{"id": 1, "text": SPAM}, {"id": 2, "text": "call \ud800 now"}, {"id": 3, "text": HAM}],
    )
    local = folder / "texts.local.jsonl"
    done = run_cli(env, folder, "score", source, "-o", local)
    assert done.returncode == 0, done.stderr
    _, rows = read_jsonl(local)
    assert [r["row"] for r in rows] == [0, 1, 2]
    errors = errors_of(rows)
    assert list(errors) == [1] and errors[1]["code"] == "invalid_input"
    assert "not valid Unicode (lone surrogate)" in errors[1]["message"]
    assert "scored 2 rows, 1 written with an error (invalid_input: 1)" in done.stderr

    with run_server({"MODELS_FILE": env["MODELS_FILE"]}, tmp_path) as server:
        server.wait_ready()
        remote = folder / "texts.remote.jsonl"
        done = run_cli(env, folder, "score", source, "--url", server.url, "-o", remote)
    assert done.returncode == 0, done.stderr
    _, remote_rows = read_jsonl(remote)
    assert errors_of(remote_rows)[1]["code"] == "invalid_input"
    assert "lone surrogate" in errors_of(remote_rows)[1]["message"]
    assert [r.get("label") for r in remote_rows] == [r.get("label") for r in rows]


def odd_file(path: Path) -> Path:
    """Seven labelled rows, five of them odd; the last line cut mid-row, as by a copy that
    stopped short."""
    write_jsonl(
        path,
        [
            {"id": "a\ud800", "text": SPAM, "label": "spam"},  # 0: the id
            {"id": "b", "text": "call \udc00 now", "label": "spam"},  # 1: the text
            {"id": "c", "text": "", "label": "ham"},  # 2: an empty text
            {"id": "c", "text": HAM, "label": "ham"},  # 3: the id of row 2 again
            {"id": "d", "text": HAM, "label": "\ud800"},  # 4: the label (evaluate)
            {"id": "e", "text": SPAM, "label": "spam"},  # 5
        ],
    )
    with path.open("a", encoding="utf-8") as handle:
        handle.write('{"id": "f", "te')  # 6
    return path


def read_strictly(path: Path) -> list[dict[str, Any]]:
    """Every line of an output as jq or pandas reads it: strict UTF-8, each a JSON object,
    none holding a lone surrogate (or its escape)."""
    text = path.read_bytes().decode("utf-8")  # strict: raises on anything else
    assert "\\ud8" not in text.lower() and "\\udc" not in text.lower()
    return [json.loads(line) for line in text.splitlines()]


def test_score_writes_every_odd_row_as_an_error_row_and_resume_completes(
    env: dict[str, str], folder: Path
) -> None:
    source = odd_file(folder / "odd.jsonl")
    args = ["score", source, "--batch-size", "2", "--no-cache"]
    whole = folder / "odd.scored.jsonl"
    done = run_cli(env, folder, *args, "-o", whole)
    assert done.returncode == 0, done.stderr
    lines = read_strictly(whole)
    rows = lines[1:]
    assert [r["row"] for r in rows] == list(range(7))
    assert [r.get("id") for r in rows] == ["a\ufffd", "b", "c", "c", "d", "e", None]
    errors = errors_of(rows)
    assert sorted(errors) == [0, 1, 2, 6]
    assert {e["code"] for e in errors.values()} == {"invalid_input"}
    assert "'id' is not valid Unicode (lone surrogate, written as U+FFFD)" in errors[0]["message"]
    assert "inputs[0] is not valid Unicode (lone surrogate)" in errors[1]["message"]
    assert "no tokens" in errors[2]["message"]
    assert "line 7: not JSON" in errors[6]["message"] and "cut?" in errors[6]["message"]
    assert all("label" in rows[i] for i in (3, 4, 5))  # a repeated id is scored as any other
    assert "scored 3 rows, 4 written with an error (invalid_input: 4)" in done.stderr

    # Stopped after row 2, mid-write of row 3: --resume takes the odd rows again as they come.
    resumed = folder / "odd.resumed.jsonl"
    text = whole.read_text(encoding="utf-8").splitlines(keepends=True)
    resumed.write_text("".join(text[:4]) + text[4][:9], encoding="utf-8")
    done = run_cli(env, folder, *args, "-o", resumed, "--resume")
    assert done.returncode == 0, done.stderr
    assert "(3 already in the output)" in done.stderr
    assert read_strictly(resumed) == lines


def test_evaluate_counts_every_odd_row_as_an_error_and_writes_its_reports(
    env: dict[str, str], folder: Path, tmp_path: Path
) -> None:
    # A file name that is not UTF-8 (byte 0xff) reaches Python as a lone surrogate too.
    source = odd_file(tmp_path / "odd-\udcff.jsonl")
    metrics, report = tmp_path / "metrics.json", tmp_path / "report"
    done = run_cli(env, folder, "evaluate", source, "--json", metrics, "--report", report)
    assert done.returncode == 0, done.stderr
    result = json.loads(metrics.read_bytes().decode("utf-8"))
    assert result["input"].endswith("odd-\ufffd.jsonl")
    reported = result["servables"][0]
    assert (reported["rows"], reported["scored"], reported["errors"]) == (7, 2, 5)
    rows = read_strictly(report / "scores-0.jsonl")[1:]
    errors = errors_of(rows)
    assert sorted(errors) == [0, 1, 2, 4, 6]
    assert "'label' is not valid Unicode" in errors[4]["message"]
    assert rows[4]["expected"] == "\ufffd"
    assert (report / "report.md").read_bytes().decode("utf-8").startswith("# Evaluation of")


def test_resume_refuses_another_input_other_columns_and_an_output_longer_than_its_input(
    env: dict[str, str], folder: Path, tmp_path: Path
) -> None:
    records = [{"id": 1, "text": SPAM}, {"id": 2, "text": HAM}, {"id": 3, "text": SPAM}]
    source = write_jsonl(tmp_path / "three.jsonl", records)
    output = tmp_path / "three.scored.jsonl"
    done = run_cli(env, folder, "score", source, "-o", output)
    assert done.returncode == 0, done.stderr
    header, _ = read_jsonl(output)
    assert header["input"] == {
        "path": str(source),
        "format": "jsonl",
        "columns": {"text": "text", "id": "id", "label": None, "names": None},
        "bytes": source.stat().st_size,
        "sha256": hashlib.sha256(source.read_bytes()).hexdigest(),
    }
    whole = output.read_text(encoding="utf-8")
    two_rows = "".join(whole.splitlines(keepends=True)[:3])

    def resume(started: str, *args: str | Path) -> str:
        """--resume on an output that holds `started`; what it said, the output untouched."""
        output.write_text(started, encoding="utf-8")
        done = run_cli(env, folder, "score", *args, "-o", output, "--resume")
        assert done.returncode == 1, done.stderr
        assert output.read_text(encoding="utf-8") == started
        return done.stderr

    other = write_jsonl(tmp_path / "other.jsonl", [{"id": 1, "text": HAM}, *records[1:]])
    said = resume(two_rows, other)
    assert "scored with other input.bytes, input.sha256 (input.bytes: " in said
    assert f"it began from {source}" in said
    # Same path, a row inserted before those scored: the rows moved under the old header.
    write_jsonl(source, [{"id": 0, "text": HAM}, *records])
    assert "scored with other input.bytes, input.sha256" in resume(two_rows, source)
    write_jsonl(source, records)
    said = resume(two_rows, source, "--id-column", "key")
    assert "scored with other input.columns.id (input.columns.id: 'id' then, 'key' now)" in said
    said = resume(two_rows, source, "--format", "tsv", "--columns", "text")
    assert "scored with other input.format, input.columns.names" in said
    extra = json.dumps({"row": 3, "id": 4, "label": "ham", "scores": []}) + "\n"
    assert "holds 4 rows, more than the 3 of its input" in resume(whole + extra, source)

    # The same input, named from another folder, resumes to the run it began.
    output.write_text(two_rows, encoding="utf-8")
    done = run_cli(env, source.parent, "score", source.name, "-o", output, "--resume")
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in whole.splitlines()[1:]]
    assert read_jsonl(output)[1] == rows
