"""Runs `loraserve score` / `evaluate` of this checkout as a subprocess, and reads its JSONL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.server_process import REPO_ROOT


def cli_env(models_file: Path, folder: Path, **extra: str) -> dict[str, str]:
    """The environment of a CLI run on `models_file`: its caches in `folder`."""
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "MODELS_FILE": str(models_file),
        "MODEL_CACHE_DIR": str(folder / "model-cache"),
        "DISK_CACHE_DIR": str(folder / "predictions"),
        **extra,
    }


def command(*args: str | Path) -> list[str]:
    return [sys.executable, "-m", "api.cli", *map(str, args)]


def run_cli(
    env: dict[str, str], cwd: Path, *args: str | Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Runs the CLI to its end; its status, stdout and stderr."""
    return subprocess.run(
        command(*args), env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def read_jsonl(path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An output's header and its row lines."""
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return lines[0]["header"], lines[1:]
