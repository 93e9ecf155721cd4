"""`loraserve score` / `evaluate` on the rows a real archive holds sooner or later, run as
the command a user types on a real (tiny) model: a lone surrogate in a text, an id or a
label, an empty text, a repeated id, a cut last line. Each such row is a row with an error
(or, a repeated id, scored), the run completes, and the output stays JSONL that any reader
takes."""

from __future__ import annotations

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
