"""`loraserve evaluate` on a million rows, run as the command a user types, on a simulated
device: its peak RSS stays within a bound of what the same command takes on a thousand rows.

It keeps of each row what the metrics need (two one-byte label indices and an 8-byte score:
about 10 MB a million rows) and streams everything else. When it held every row's text, id
and ranked answer until the end, a million rows took about 1.3 GB more than a thousand."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.batch_cli import cli_env, command
from tests.support.tiny_models import simulated_entry, write_models_file

ROWS = 1_000_000
BASELINE_ROWS = 1_000
# Above the thousand-row run's peak: 10 MB of kept arrays, ~40 MB for the threshold sweep's
# sorted scores at the end, and room for the allocator; a tenth of what holding the rows
# took, so a regression to holding them fails by far.
BOUND_MIB = 160
# Texts of 512 a chunk and a forward, at a cost of nothing much: a million rows are the
# command's own work (reading, tokenizing, ranking), not the simulated device's sleep.
BATCH = 512
WORDS = ["free", "prize", "call", "now", "win", "cash", "lunch", "home", "see", "you", "later"]
# Runs its arguments as its only child and prints that child's peak RSS (KiB) last. A
# wrapper of its own, a few MB: ru_maxrss of children carries the parent's RSS at the fork
# (the test process's, with torch imported), and covers every child the process waited for.
PEAK_OF_CHILD = (
    "import resource, subprocess, sys; "
    "done = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
    "sys.exit(done.returncode)"
)


def labelled_csv(path: Path, count: int) -> Path:
    """`count` short texts labelled ham/spam, each text its own (no two share a score)."""
    rng = random.Random(3)
    with path.open("w", encoding="utf-8") as handle:
        handle.write("id,label,text\n")
        for index in range(count):
            words = " ".join(rng.choices(WORDS, k=rng.randint(2, 6)))
            handle.write(f"r{index},{'spam' if rng.random() < 0.3 else 'ham'},{words} {index}\n")
    return path


def peak_rss_mib(env: dict[str, str], folder: Path, source: Path) -> tuple[float, dict[str, Any]]:
    """The peak RSS of `loraserve evaluate` on `source`, and its JSON metrics."""
    metrics = folder / f"{source.stem}.json"
    # No cache: the cache tiers are bounded by their own settings; here only evaluate counts.
    args = ["evaluate", source, "--no-cache", "--batch-size", str(BATCH), "--json", metrics]
    out, err = folder / f"{source.stem}.out", folder / f"{source.stem}.err"
    with out.open("w") as stdout, err.open("w") as stderr:
        done = subprocess.run(
            [sys.executable, "-c", PEAK_OF_CHILD, *command(*args)],
            env=env,
            cwd=folder,
            stdout=stdout,
            stderr=stderr,
            timeout=420,
        )
    assert done.returncode == 0, err.read_text(encoding="utf-8")[-3000:]
    peak_kib = int(out.read_text(encoding="utf-8").splitlines()[-1])
    result: dict[str, Any] = json.loads(metrics.read_text(encoding="utf-8"))
    return peak_kib / 1024, result


@pytest.mark.timeout(600)
def test_evaluate_on_a_million_rows_keeps_memory_flat(tmp_path: Path) -> None:
    device = {"seconds_per_batch": 0.0001, "seconds_per_token": 0.0}
    models = write_models_file(
        tmp_path / "models.yaml", [simulated_entry(simulated=device, max_length=32)]
    )
    env = cli_env(models, tmp_path, MAX_BATCH_SIZE=str(BATCH), MAX_TEXTS_PER_REQUEST=str(BATCH))
    small = labelled_csv(tmp_path / "small.csv", BASELINE_ROWS)
    large = labelled_csv(tmp_path / "large.csv", ROWS)

    baseline, _ = peak_rss_mib(env, tmp_path, small)
    started = time.monotonic()
    peak, result = peak_rss_mib(env, tmp_path, large)
    took = time.monotonic() - started

    (reported,) = result["servables"]
    assert (reported["rows"], reported["scored"], reported["errors"]) == (ROWS, ROWS, 0)
    assert sum(sum(row.values()) for row in reported["confusion"].values()) == ROWS
    measured = (
        f"peak RSS {peak:.0f} MiB on {ROWS} rows ({took:.0f} s), "
        f"{baseline:.0f} MiB on {BASELINE_ROWS}"
    )
    print(measured)  # with -s: the figures, not only the verdict
    assert peak < baseline + BOUND_MIB, f"{measured}: more than {BOUND_MIB} MiB above"
