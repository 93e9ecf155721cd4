"""bench.gpu, smoke mode: the GPU benchmark's whole path (random-weight EXAONE and KoELECTRA
built from config, three starts of the real server, latency, load, cascade, packing, report)
on tiny shapes on this machine's device, so that it cannot rot before a GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu import BATCH_SIZES, REPORTS, SMOKE, main
from tests.server_process import REPO_ROOT


@pytest.mark.timeout(600)
def test_the_gpu_benchmark_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-m", "bench.gpu", "--smoke", "--work", str(tmp_path / "work")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [*command, "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=590,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "gpu.json").read_text(encoding="utf-8"))
    markdown = (out / "gpu.md").read_text(encoding="utf-8")

    starts = report["starts"]
    states = {
        title: start["models"]["exaone"]["prequantized_cache"] for title, start in starts.items()
    }
    assert states == {"first start": "written", "quantized at start": "off", "later start": "hit"}
    assert all(
        start["models"]["koelectra"]["prequantized_cache"] is None for start in starts.values()
    )
    first_phases = starts["first start"]["models"]["exaone"]["load_seconds"]
    assert first_phases["save_quantized"] > 0
    assert starts["later start"]["models"]["exaone"]["load_seconds"]["save_quantized"] == 0

    grid = {(row["model"], row["tokens"], row["texts"]) for row in report["latency"]}
    assert grid == {
        (model, tokens, size)
        for model in ("koelectra", "exaone")
        for tokens in SMOKE.lengths
        for size in BATCH_SIZES
    }
    for row in report["latency"]:
        assert row["batches_per_request"] == 1  # one request, one forward, as the grid means
        assert 0 < row["forward_ms"] <= row["client_ms"]

    points = {(point["model"], point["clients"]) for point in report["throughput"]}
    assert points == {(m, c) for m in ("koelectra", "exaone") for c in SMOKE.clients}
    for point in [*report["throughput"], report["cascade"], report["padded"]["throughput"]]:
        assert set(point["statuses"]) == {"200"} and point["texts_per_s"] > 0
    assert set(report["cascade"]["answered_by"]) <= {"koelectra", "exaone"}
    assert 0.5 <= report["cascade_threshold"] <= 1.0
    assert starts["later start"]["models"]["koelectra"]["packed_batches"]
    assert not starts["quantized at start"]["models"]["koelectra"]["packed_batches"]

    device = report["meta"]["device"]
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":  # no GPU: nothing to read, and said so rather than made up
        assert all(v is None for reading in report["memory"].values() for v in reading.values())
    assert "SMOKE RUN" in markdown and "not a GPU measurement" in markdown
    for section in ("Against the users' targets", "Load time by phase", "Batch latency"):
        assert f"## {section}" in markdown


def test_smoke_figures_never_go_into_the_reports_folder() -> None:
    assert main(["--smoke", "--out", str(REPORTS)]) == 2
    if not torch.cuda.is_available():  # the real run needs a GPU, and says so
        assert main([]) == 2
