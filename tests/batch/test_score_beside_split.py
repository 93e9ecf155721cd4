"""`loraserve score` and `evaluate` in process are a door on the service core: no HTTP app, no
socket, even with the deployment's `.env` (SPLIT_SOCKET set) while its model side serves."""

from __future__ import annotations

import json
import os
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import fastapi
import httpx
import pytest

from api.cli import main
from tests.support.batch_cli import read_jsonl, run_cli
from tests.support.server_process import REPO_ROOT, run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

TEXTS = [f"win a free prize number {n} now" for n in range(40)]


def write_rows(path: Path, texts: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"id": str(n), "text": text}) + "\n" for n, text in enumerate(texts)),
        encoding="utf-8",
    )
    return path


def test_score_with_the_split_socket_set_leaves_the_live_model_side_serving(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """The deployment's `.env` names SPLIT_SOCKET; a model side and its front end serve on it
    under a steady load while `loraserve score` runs in the same folder: every request is
    answered 200 throughout and after, and the socket is the model side's own still."""
    models = tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))
    split_socket = tmp_path / "model.sock"
    (tmp_path / ".env").write_text(
        f"MODELS_FILE={models}\nSPLIT_SOCKET={split_socket}\n"
        f"DISK_CACHE_DIR={tmp_path / 'predictions'}\n",
        encoding="utf-8",
    )
    env = {"MODEL_CACHE_DIR": str(tmp_path / "model-cache")}
    rows = write_rows(tmp_path / "rows.jsonl", TEXTS)
    with run_server(env, tmp_path) as model_side:
        model_side.wait_ready()
        socket_before = split_socket.stat().st_ino
        with run_server(env, tmp_path, ("front-end",)) as front_end:
            front_end.wait_ready()
            answers: list[tuple[int, bool]] = []  # status, and whether score was running
            scoring = threading.Event()
            stop = threading.Event()

            def load() -> None:
                body = {"inputs": "are we still on for lunch", "cache": False}
                with httpx.Client(base_url=front_end.url, timeout=30) as client:
                    while not stop.is_set():
                        running = scoring.is_set()
                        answers.append((client.post("/predict", json=body).status_code, running))

            loader = threading.Thread(target=load)
            loader.start()
            try:
                scoring.set()
                cli_env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}
                scored = run_cli(cli_env, tmp_path, "score", rows, "-o", tmp_path / "out.jsonl")
                scoring.clear()
                answered_then = len(answers)
                while len(answers) < answered_then + 50 and loader.is_alive():
                    stop.wait(0.05)
            finally:
                stop.set()
                loader.join(timeout=60)
            assert scored.returncode == 0, scored.stderr
            assert any(running for _, running in answers), "no request ran beside the command"
            assert len(answers) >= answered_then + 50, "the load stopped after the command"
            assert Counter(status for status, _ in answers).keys() == {200}, Counter(answers)
            assert split_socket.stat().st_ino == socket_before, "the socket was replaced"
            with httpx.Client(base_url=front_end.url, timeout=30) as client:
                assert client.get("/ready").status_code == 200
    _, lines = read_jsonl(tmp_path / "out.jsonl")
    assert [line["id"] for line in lines] == [str(n) for n in range(len(TEXTS))]
    assert all("scores" in line for line in lines)


@pytest.mark.parametrize("command", ["score", "evaluate"])
def test_the_batch_commands_build_no_app_and_bind_no_socket(
    command: str, tiny_bert: TinyModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run in this process with SPLIT_SOCKET set: every FastAPI app made and every socket
    bound is recorded (the real calls still run); the command makes and binds none."""
    models = tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))
    monkeypatch.setenv("MODELS_FILE", str(models))
    monkeypatch.setenv("SPLIT_SOCKET", str(tmp_path / "model.sock"))
    monkeypatch.setenv("DISK_CACHE_DIR", str(tmp_path / "predictions"))
    monkeypatch.setenv("MODEL_CACHE_DIR", str(tmp_path / "model-cache"))
    monkeypatch.chdir(tmp_path)
    labelled = [{"id": str(n), "text": text, "label": "spam"} for n, text in enumerate(TEXTS)]
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(row) + "\n" for row in labelled), encoding="utf-8")
    apps: list[fastapi.FastAPI] = []
    bound: list[Any] = []
    make_app, bind = fastapi.FastAPI.__init__, socket.socket.bind

    def recorded_app(self: fastapi.FastAPI, *args: Any, **kwargs: Any) -> None:
        apps.append(self)
        make_app(self, *args, **kwargs)

    def recorded_bind(self: socket.socket, address: Any) -> None:
        bound.append(address)
        bind(self, address)

    monkeypatch.setattr(fastapi.FastAPI, "__init__", recorded_app)
    monkeypatch.setattr(socket.socket, "bind", recorded_bind)
    out = tmp_path / "out.jsonl"
    output = ["-o", str(out)] if command == "score" else ["--json", str(out)]
    assert main([command, str(rows), *output, "--quiet"]) == 0
    assert apps == [] and bound == []
    assert not (tmp_path / "model.sock").exists()
    if command == "score":
        assert len(read_jsonl(out)[1]) == len(TEXTS)
    else:
        assert json.loads(out.read_text(encoding="utf-8"))
