"""A benchmark as its make target runs it, `python -m bench.<module>`, in a process of its own
from the repository root: the tests of the benchmarks' quick and smoke forms use it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.server_process import REPO_ROOT


def run_bench(module: str, args: list[str], out: Path, report: str, timeout: float) -> Any:
    """Runs `bench.<module>` with `args`, failing with the end of its stderr unless it exits
    0; the figures it wrote to `<out>/<report>.json`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / f"{report}.json").read_text(encoding="utf-8"))
