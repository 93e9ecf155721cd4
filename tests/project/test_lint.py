"""ruff, mypy and the import graph's contracts run with the suite, so style, types and the
way imports run are checked wherever tests run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.mark.parametrize(
    "command",
    [
        ["ruff", "check", "."],
        ["ruff", "format", "--check", "."],
        ["mypy"],
        # pyproject.toml's [tool.importlinter]: no circle in api/, no door imported by the core
        # or what it composes; a broken contract names the offending import and its line.
        ["lint-imports", "--no-cache"],
    ],
    ids=["ruff-check", "ruff-format", "mypy", "import-graph"],
)
def test_code_is_clean(command: list[str]) -> None:
    result = subprocess.run(
        [str(BIN / command[0]), *command[1:]],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
