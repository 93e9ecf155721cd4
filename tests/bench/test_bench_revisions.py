"""bench.revisions' table of where the CPU goes, by stage, base beside head at each number of
clients profiled."""

from __future__ import annotations

from typing import Any

from bench.revisions import PROFILED_CLIENTS, stage_table
from bench.stages import NATIVE, QUEUE


def profiled(requests_per_s: float, stages: dict[str, float]) -> dict[str, Any]:
    """A profile as bench.stages.profile gives it, with these µs a request by stage."""
    return {
        "requests_per_s": requests_per_s,
        "server_cpu_us_per_request": sum(stages.values()),
        "stages": {stage: {"cpu_us_per_request": us} for stage, us in stages.items()},
    }


def test_each_stage_is_a_row_with_base_beside_head_at_each_number_of_clients() -> None:
    profiles = {}
    for clients in PROFILED_CLIENTS:
        profiles[f"base@{clients}"] = profiled(200.0 + clients, {NATIVE: 4000.0, QUEUE: 90.0})
        profiles[f"head@{clients}"] = profiled(250.0 + clients, {NATIVE: 3900.0})
    lines = stage_table(profiles)
    first, second = PROFILED_CLIENTS
    assert lines[0] == (
        f"| stage (CPU µs a request) | base, {first} clients | head, {first} clients "
        f"| base, {second} clients | head, {second} clients |"
    )
    rows = {line.split(" | ")[0].removeprefix("| "): line for line in lines[2:]}
    # Stages in the order bench.stages lists them; one a revision lacks shows as a dash.
    assert list(rows) == [QUEUE, NATIVE, "**all**", "requests/s, profiled"]
    assert rows[QUEUE] == f"| {QUEUE} | 90 | – | 90 | – |"
    assert rows[NATIVE] == f"| {NATIVE} | 4000 | 3900 | 4000 | 3900 |"
    assert rows["**all**"] == "| **all** | **4090** | **3900** | **4090** | **3900** |"
    assert rows["requests/s, profiled"] == (
        f"| requests/s, profiled | {200.0 + first:.1f} | {250.0 + first:.1f} "
        f"| {200.0 + second:.1f} | {250.0 + second:.1f} |"
    )
