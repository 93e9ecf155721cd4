"""bench.disk_tier in its quick form: the tier's writes and reads and diskcache's own, timed
on real tables in temporary folders (the bench itself checks that both ways stored the same
rows), and the report's page."""

from __future__ import annotations

from pathlib import Path

from tests.support.bench_runs import run_bench

FIGURES = ("write_tier_us", "write_diskcache_us", "read_tier_us", "read_diskcache_us")


def test_the_disk_tier_benchmark_times_both_ways(tmp_path: Path) -> None:
    args = ["--quick", "--out", str(tmp_path)]
    figures = run_bench("disk_tier", args, tmp_path, "disk_tier", timeout=120)
    (measured,) = figures["rounds"]
    assert sorted(measured) == sorted(FIGURES)
    assert all(measured[name] > 0 for name in FIGURES)
    assert figures["medians"] == measured  # one round: its own median
    page = (tmp_path / "disk_tier.md").read_text(encoding="utf-8")
    assert page.count("\n| ") == 2 + 2 + 1  # two headers, two works, one round
