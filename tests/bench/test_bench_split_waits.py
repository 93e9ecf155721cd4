"""bench.split_waits: its reading of a thread's time on a core against a known amount of work,
and its quick form on the real servers (one process and the split), with figures in the
units they claim."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.split_waits import LAYOUTS, read
from tests.support.bench_runs import run_bench


def test_a_loop_that_works_half_a_second_reads_as_half_a_second_on_a_core() -> None:
    pid = os.getpid()  # this test runs on the process's main thread, as a server's loop does
    before = read((pid,))
    until = time.thread_time() + 0.5
    while time.thread_time() < until:
        pass
    after = read((pid,))
    ran = after.loops[0][0] - before.loops[0][0]
    assert 0.45 <= ran <= 0.8, ran  # nanoseconds of schedstat, as seconds
    assert after.processes[0] - before.processes[0] >= 0.4  # clock ticks, as seconds
    assert after.busy - before.busy >= 0.4  # the machine's busy time counts this core's


def test_the_quick_run_reads_each_servers_loop_and_the_machine(tmp_path: Path) -> None:
    figures = run_bench(
        "split_waits", ["--quick", "--out", str(tmp_path)], tmp_path, "split_waits", timeout=300
    )
    assert sorted(figures["rounds"]) == sorted(LAYOUTS)
    for layout, (split, _) in LAYOUTS.items():
        (measured,) = figures["rounds"][layout]
        assert set(measured["statuses"]) == {"200"}, layout
        assert measured["ratio"] > 0
        assert 0 <= measured["machine_idle"] < 1
        processes = 2 if split else 1
        for name in ("loop_cores", "loop_waiting", "other_threads_cores"):
            assert len(measured[name]) == processes, (layout, name)
        # Each loop served thousands of requests, and one thread runs on one core at most.
        assert all(0.05 < cores <= 1.02 for cores in measured["loop_cores"]), measured
        assert all(0 <= share < 1 for share in measured["loop_waiting"]), measured
        # The batch worker runs in the process that serves the model.
        assert measured["other_threads_cores"][-1] > 0, measured
    page = (tmp_path / "split_waits.md").read_text(encoding="utf-8")
    assert all(page.count(f"| {layout} |") == 2 for layout in LAYOUTS)  # its round, its median
