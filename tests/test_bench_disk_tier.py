"""bench.disk_tier in its quick form: the tier's writes and reads and diskcache's own, timed
on real tables in temporary folders (the bench itself checks that both ways stored the same
rows), and the report's page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("write_tier_us", "write_diskcache_us", "read_tier_us", "read_diskcache_us")


def test_the_disk_tier_benchmark_times_both_ways(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench.disk_tier", "--quick", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads((tmp_path / "disk_tier.json").read_text(encoding="utf-8"))
    (measured,) = figures["rounds"]
    assert sorted(measured) == sorted(FIGURES)
    assert all(measured[name] > 0 for name in FIGURES)
    assert figures["medians"] == measured  # one round: its own median
    page = (tmp_path / "disk_tier.md").read_text(encoding="utf-8")
    assert page.count("\n| ") == 2 + 2 + 1  # two headers, two works, one round
