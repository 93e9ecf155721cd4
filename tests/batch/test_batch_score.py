"""`loraserve score` on the real embedded encoder, run as the command a user types: JSONL,
CSV and TSV in, one line per row out, in order with ids, refused rows written with their
error and counted; an interrupted run resumed equals one uninterrupted run; --url against
the real server gives the scores the in-process run gives."""

from __future__ import annotations

import csv
import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.batch_cli import cli_env, command, read_jsonl, run_cli
from tests.support.load_client import exposition_sum
from tests.support.server_process import REPO_ROOT, run_server
from tests.support.tiny_models import embedded_encoder_file

SPAM = "WINNER!! You have won a £900 prize. Call 09061701461 now to claim, T&C apply"
HAM = "Are we still on for lunch tomorrow? I'll be there at one"
# Well over the encoder's 128 tokens.
LONG = " ".join(["see you at the station after work, then dinner at home"] * 30)
SMS_DATA = REPO_ROOT / "data" / "sms_spam_collection.tsv"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("score")


@pytest.fixture(scope="module")
def env(folder: Path) -> dict[str, str]:
    return cli_env(embedded_encoder_file(folder), folder)


def scored(rows: list[dict[str, Any]]) -> dict[int, tuple[str, dict[str, float]]]:
    """Row number → (label, scores by label) of the rows scored."""
    return {
        r["row"]: (r["label"], {s["label"]: s["score"] for s in r["scores"]})
        for r in rows
        if "error" not in r
    }


def test_jsonl_rows_keep_ids_and_order_and_refusals_are_written_and_counted(
    env: dict[str, str], folder: Path
) -> None:
    source = folder / "messages.jsonl"
    lines = [
        json.dumps({"id": 17, "text": SPAM}),
        json.dumps({"id": "b-2", "text": HAM}),
        json.dumps({"id": 3, "text": ""}),  # nothing to score
        json.dumps({"id": 4, "body": HAM}),  # no text column
        "{not json",
        "",  # a blank line is no row
        json.dumps({"id": 6, "text": LONG}),  # too long with --no-truncate
        json.dumps({"inputs": SPAM}),  # /predict's field name; no id
    ]
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    output = folder / "messages.out.jsonl"
    done = run_cli(env, folder, "score", source, "--no-truncate", "-o", output)
    assert done.returncode == 0, done.stderr
    header, rows = read_jsonl(output)
    assert header["model"] == "spam-minilm" and header["adapter"] == "spam"
    assert header["labels"] == ["ham", "spam"] and header["truncate"] is False
    assert len(header["identities"]["spam-minilm"]) == 64
    assert [r["row"] for r in rows] == list(range(7))
    assert [r.get("id") for r in rows] == [17, "b-2", 3, 4, None, 6, None]
    errors = {r["row"]: r["error"] for r in rows if "error" in r}
    assert sorted(errors) == [2, 3, 4, 5]
    assert "no tokens" in errors[2]["message"]
    assert "no 'text'" in errors[3]["message"] and "line 5" in errors[4]["message"]
    assert "over the model's limit of 128" in errors[5]["message"]
    assert {e["code"] for e in errors.values()} == {"invalid_input"}
    labels = scored(rows)
    assert [labels[i][0] for i in (0, 1, 6)] == ["spam", "ham", "spam"]
    for _, scores in labels.values():
        assert sum(scores.values()) == pytest.approx(1.0)
    assert rows[0]["scores"][0]["score"] >= rows[0]["scores"][1]["score"]  # best first
    assert rows[0]["answered_by"] == "spam-minilm"
    assert "scored 3 rows, 4 written with an error (invalid_input: 4)" in done.stderr


def test_csv_with_quoted_fields_and_a_headerless_tsv(env: dict[str, str], folder: Path) -> None:
    source = folder / "messages.csv"
    with source.open("w", encoding="utf-8", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["id", "when", "message"])
        writer.writerow(["a", "mon", SPAM])
        writer.writerow(["b", "tue", 'lunch, then "the" film?\nreply soon'])
        writer.writerow(["c", "wed", ""])
        writer.writerow(["d", "thu", HAM])
    output = folder / "messages.csv.jsonl"
    done = run_cli(env, folder, "score", source, "--text-column", "message", "-o", output)
    assert done.returncode == 0, done.stderr
    _, rows = read_jsonl(output)
    assert [(r["row"], r["id"]) for r in rows] == [(0, "a"), (1, "b"), (2, "c"), (3, "d")]
    assert "error" in rows[2] and [rows[i]["label"] for i in (0, 3)] == ["spam", "ham"]
    assert "scored 3 rows, 1 written with an error" in done.stderr
    # stderr is no terminal here: progress comes as plain lines, the last one at the end.
    assert re.search(r"^score: 4/4 texts  [0-9.]+ texts/s  0:00:00 left", done.stderr, re.M)

    # The shipped SMS Spam Collection: `label<TAB>text`, no header, quotes that are no quoting.
    tsv = folder / "sms.tsv"
    head = SMS_DATA.read_text(encoding="utf-8").splitlines()[:40]
    tsv.write_text("\n".join(head) + "\n", encoding="utf-8")
    output = folder / "sms.jsonl"
    done = run_cli(env, folder, "score", tsv, "--columns", "label,text", "-o", output)
    assert done.returncode == 0, done.stderr
    _, rows = read_jsonl(output)
    assert [r["row"] for r in rows] == list(range(40))
    assert all("id" not in r and "error" not in r for r in rows)
    expected = [line.split("\t", 1)[0] for line in head]
    right = sum(r["label"] == e for r, e in zip(rows, expected, strict=True))
    assert right >= 38  # the shipped adapter, on texts it mostly trained on


def sms_rows(folder: Path, count: int) -> Path:
    path = folder / f"sms-{count}.tsv"
    head = SMS_DATA.read_text(encoding="utf-8").splitlines()[:count]
    path.write_text("\n".join(head) + "\n", encoding="utf-8")
    return path


def ctrl_c_as_at_a_terminal() -> None:
    """In the child, before it runs: SIGINT back to its default. A shell starts a command
    run in the background (`make test &`) with SIGINT ignored, every process under it
    inherits that, and a Python started so never sees a Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.timeout(600)  # three runs, each loading the model
def test_a_run_interrupted_then_resumed_equals_one_uninterrupted_run(
    env: dict[str, str], folder: Path
) -> None:
    source = sms_rows(folder, 160)
    args = ["score", source, "--columns", "label,text", "--no-cache", "--batch-size", "8"]
    output = folder / "resumed.jsonl"
    process = subprocess.Popen(
        command(*args, "-o", output),
        env=env,
        cwd=folder,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_at_a_terminal,
    )
    deadline = time.monotonic() + 240
    while not output.exists() or output.read_text(encoding="utf-8").count("\n") < 24:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no 24 lines written in time"
        time.sleep(0.02)
    process.send_signal(signal.SIGINT)  # Ctrl-C
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert "--resume continues" in stderr
    text = output.read_text(encoding="utf-8")
    assert text.endswith("\n")
    lines = text.splitlines()
    assert 23 <= len(lines) - 1 < 160, "the run was not stopped mid-way"
    # A kill mid-write leaves a cut line: drop the end of the last one.
    output.write_text(text[:-25], encoding="utf-8")

    done = run_cli(env, folder, *args, "-o", output, "--resume")
    assert done.returncode == 0, done.stderr
    assert f"({len(lines) - 2} already in the output)" in done.stderr

    whole = folder / "whole.jsonl"
    done = run_cli(env, folder, *args, "-o", whole)
    assert done.returncode == 0, done.stderr
    assert read_jsonl(output) == read_jsonl(whole)
    assert len(read_jsonl(whole)[1]) == 160


def test_resume_refuses_an_output_of_other_answers(env: dict[str, str], folder: Path) -> None:
    source = folder / "two.jsonl"
    source.write_text(json.dumps({"text": HAM}) + "\n" + json.dumps({"text": SPAM}) + "\n")
    output = folder / "other.jsonl"
    header = {"model": "spam-minilm", "adapter": "other", "labels": ["ham", "spam"]}
    output.write_text(json.dumps({"header": header}) + "\n", encoding="utf-8")
    done = run_cli(env, folder, "score", source, "-o", output, "--resume")
    assert done.returncode == 1
    assert "scored with other adapter, identities, truncate" in done.stderr
    assert output.read_text(encoding="utf-8").count("\n") == 1  # left as it was


@pytest.mark.timeout(600)  # the server and three runs, each loading the model
def test_url_gives_the_scores_of_the_in_process_run(
    env: dict[str, str], folder: Path, tmp_path: Path
) -> None:
    source = sms_rows(folder, 64)
    lines = source.read_text(encoding="utf-8").splitlines()
    source.write_text("\n".join([*lines, "ham\t"]) + "\n", encoding="utf-8")  # one refused
    args = ["score", source, "--columns", "label,text", "--no-cache"]
    local = tmp_path / "local.jsonl"
    done = run_cli(env, folder, *args, "-o", local)
    assert done.returncode == 0, done.stderr

    key = "s3cret-key"
    server_env = {"MODELS_FILE": env["MODELS_FILE"], "API_KEY": key, "DISK_CACHE_MAX_BYTES": "0"}
    with run_server(server_env, tmp_path) as server:
        server.wait_ready()
        remote = tmp_path / "remote.jsonl"
        client_env = {**env, "API_KEY": key}
        done = run_cli(client_env, folder, *args, "--url", server.url, "-o", remote)
        assert done.returncode == 0, done.stderr
        refused = run_cli(env, folder, *args, "--url", server.url, "-o", tmp_path / "no.jsonl")
    assert refused.returncode == 1 and "unauthorized" in refused.stderr
    assert read_jsonl(remote)[0] == read_jsonl(local)[0]  # the same answer identity
    remote_rows, local_rows = read_jsonl(remote)[1], read_jsonl(local)[1]
    assert len(remote_rows) == 65 and "no tokens" in remote_rows[64]["error"]["message"]
    assert remote_rows == local_rows


def test_a_chunk_refused_for_its_bad_rows_is_split_not_asked_text_by_text(
    env: dict[str, str], folder: Path, tmp_path: Path
) -> None:
    """64 rows in chunks of 32, one empty text in each chunk: each chunk is halved down to
    its bad row (~2·log2(32) requests a chunk) where it was asked again a text a request (32
    a chunk), and the answers are the in-process run's."""
    source = sms_rows(folder, 64)
    lines = source.read_text(encoding="utf-8").splitlines()
    lines[5], lines[40] = "ham\t", "spam\t"  # no tokens: refused as invalid_input
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["score", source, "--columns", "label,text", "--no-cache", "--batch-size", "32"]
    local = tmp_path / "local.jsonl"
    assert run_cli(env, folder, *args, "-o", local).returncode == 0
    # Without admission by time: on a busy machine a 429 and its retry would count here as
    # requests the halving asked.
    server_env = {
        "MODELS_FILE": env["MODELS_FILE"],
        "DISK_CACHE_MAX_BYTES": "0",
        "ADMISSION_CONTROL": "false",
    }
    with run_server(server_env, tmp_path) as server:
        server.wait_ready()
        before = predict_requests(server.url)
        remote = tmp_path / "remote.jsonl"
        done = run_cli(env, folder, *args, "--url", server.url, "-o", remote)
        asked = predict_requests(server.url) - before
    assert done.returncode == 0, done.stderr
    rows = read_jsonl(remote)[1]
    assert [n for n, row in enumerate(rows) if "error" in row] == [5, 40]
    assert rows == read_jsonl(local)[1]
    assert asked <= 2 + 2 * (2 * 5), asked  # the two chunks, then each halved 5 times


def predict_requests(url: str) -> float:
    """The server's count of /predict requests so far."""
    exposition = httpx.get(f"{url}/metrics", timeout=30).text
    return exposition_sum(exposition, "loraserve_requests_total", route="/predict")
