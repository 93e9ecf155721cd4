"""bench.gpu, smoke mode: the GPU benchmark's whole path (random-weight EXAONE and KoELECTRA
built from config, three starts of the real server, latency, load, cascade, packing, report)
on tiny shapes on this machine's device, so that it cannot rot before a GPU runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpu_front_ends, gpu_graphs, gpu_replicas, gpu_report
from bench.gpu import BATCH_SIZES, REPORTS, SMOKE, main
from bench.gpu_load import client_shares, load, metric_sums
from bench.load_clients import CLIENTS_PER_PROCESS
from tests.support.bench_runs import run_bench
from tests.support.server_process import run_server
from tests.support.tiny_models import write_models_file


def smoke_run(module: str, report: str, tmp_path: Path, timeout: float) -> tuple[Any, str]:
    """`python -m bench.<module> --smoke` in its own process, into `tmp_path`: the report's
    figures (`<report>.json`) and page (`<report>.md`)."""
    out = tmp_path / "out"
    args = ["--smoke", "--work", str(tmp_path / "work"), "--out", str(out)]
    figures = run_bench(module, args, out, report, timeout)
    return figures, (out / f"{report}.md").read_text(encoding="utf-8")


@pytest.mark.timeout(600)
def test_the_gpu_benchmark_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    report, markdown = smoke_run("gpu", "gpu", tmp_path, timeout=590)

    starts = report["starts"]
    states = {
        title: start["models"]["exaone"]["prequantized_cache"] for title, start in starts.items()
    }
    assert states == {"first start": "written", "quantized at start": "off", "later start": "hit"}
    assert all(
        start["models"]["koelectra"]["prequantized_cache"] is None for start in starts.values()
    )
    for start in starts.values():  # the port opens after the imports, before the loads end
        assert 0 < start["listening_s"] < start["ready_s"]
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

    forward = {(row["model"], row["tokens"], row["texts"]) for row in report["forward"]}
    assert forward == grid  # the same batches in the benchmark's own process
    for row in report["forward"]:
        assert row["model_ms"] > 0 and row["predictor_ms"] > 0
        assert row["predictor_graphed"] is False  # as served: no CUDA graphs off a GPU
    assert "## The forward alone" in markdown

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


def test_client_shares_hold_every_client_in_processes_of_at_most_the_limit() -> None:
    for clients in (1, CLIENTS_PER_PROCESS, CLIENTS_PER_PROCESS + 1, 35, 128):
        shares = client_shares(clients)
        assert sum(shares) == clients and max(shares) <= CLIENTS_PER_PROCESS
        assert max(shares) - min(shares) <= 1
    assert len(client_shares(128)) == 128 // CLIENTS_PER_PROCESS


@pytest.mark.parametrize("servers", [2, 4])
def test_client_shares_give_each_server_as_many_clients_give_or_take_one(servers: int) -> None:
    """Process i asks server i mod `servers`: the processes come in a multiple of `servers`."""
    for clients in (servers, 20, 35, 64, 256):
        shares = client_shares(clients, servers)
        assert sum(shares) == clients and max(shares) <= CLIENTS_PER_PROCESS
        assert len(shares) % servers == 0
        per_server = [sum(shares[i::servers]) for i in range(servers)]
        assert max(per_server) - min(per_server) <= 1


@pytest.mark.timeout(300)
def test_the_replicas_benchmark_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    """bench.gpu_replicas on tiny shapes: one and two real servers started together, the
    clients spread over both (each ran batches), every request answered."""
    report, markdown = smoke_run("gpu_replicas", "gpu-replicas", tmp_path, timeout=290)
    rows = report["rows"]
    assert [(row["replicas"], row["clients"]) for row in rows] == [(1, 4), (2, 4)]
    for row in rows:
        assert set(row["statuses"]) == {"200"} and row["texts_per_s"] > 0
        assert len(row["ready_s"]) == row["replicas"]
        assert len(row["batches_per_replica"]) == row["replicas"]
        assert all(count > 0 for count in row["batches_per_replica"])
        assert row["mean_batch_texts"] >= 1
    assert gpu_replicas.markdown(report) == markdown
    assert "smoke run: not a GPU's figures" in markdown
    assert gpu_replicas.main(["--smoke", "--out", str(REPORTS)]) == 2


@pytest.mark.timeout(300)
def test_the_front_ends_benchmark_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    """bench.gpu_front_ends on tiny shapes: one process, then the split with two front ends
    on one model side, every request answered, the front ends and the model side at work
    over the counted seconds; the forward's own rate timed once the servers stopped."""
    report, markdown = smoke_run("gpu_front_ends", "gpu-front-ends", tmp_path, timeout=290)
    rows = report["rows"]
    assert [(row["front_ends"], row["clients"]) for row in rows] == [(0, 4), (2, 4)]
    for row in rows:
        assert set(row["statuses"]) == {"200"} and row["texts_per_s"] > 0
        assert len(row["front_end_cores"]) == row["front_ends"]
        # Which front end a connection reaches is the kernel's hash: 4 may all reach one.
        assert row["front_ends"] == 0 or sum(row["front_end_cores"]) > 0
        assert row["model_cores"] > 0 and 0 < row["device_busy"] <= 1
        assert row["mean_batch_texts"] >= 1 and row["mean_batch_ms"] > 0
    forward = report["forward"]
    assert forward["texts"] == 32 and forward["predictor_ms"] > 0
    assert forward["texts_per_s"] == pytest.approx(32 * 1000 / forward["predictor_ms"])
    assert gpu_front_ends.markdown(report) == markdown
    assert "smoke run: not a GPU's figures" in markdown
    assert gpu_front_ends.main(["--smoke", "--out", str(REPORTS)]) == 2


def test_the_cuda_graphs_benchmark_runs_end_to_end_in_smoke_mode(tmp_path: Path) -> None:
    """bench.gpu_graphs on tiny shapes: the forward both ways (here on the CPU, where no model
    records graphs, so both ways give the same logits), then a server started with
    CUDA_GRAPHS=false and one with true, every request answered."""
    report, markdown = smoke_run("gpu_graphs", "gpu-graphs", tmp_path, timeout=290)
    forward = report["forward"]
    assert not forward["enabled"] and forward["recorded"] == 0
    shapes = [(row["tokens"], row["texts"]) for row in forward["rows"]]
    assert shapes == [(32, 1), (32, 8), (32, 32), (64, 1), (64, 8), (64, 32)]
    assert all(row["max_logit_difference"] == 0 for row in forward["rows"])
    served = report["served"]
    assert [(row["cuda_graphs"], row["clients"]) for row in served] == [(False, 4), (True, 4)]
    for row in served:
        assert not row["listed_cuda_graphs"] and not row["graph_warnings"]
        assert set(row["statuses"]) == {"200"} and row["mean_batch_texts"] >= 1
    assert gpu_graphs.markdown(report) == markdown
    assert "smoke run: not a GPU's figures" in markdown
    assert gpu_graphs.main(["--smoke", "--out", str(REPORTS)]) == 2


def test_a_load_point_over_several_client_processes_counts_what_the_server_answered(
    tmp_path: Path,
) -> None:
    """35 clients (three processes) on a simulated model: every counted answer is one the
    server gave, and each client's answers are counted."""
    entry = {
        "name": "sim",
        "simulated": {"seconds_per_batch": 0.005, "seconds_per_token": 0.0},
        "labels": ["ham", "spam"],
        "max_length": 64,
    }
    env = {
        "MODELS_FILE": str(write_models_file(tmp_path / "models.yaml", [entry])),
        "LRU_CACHE_ENTRIES": "0",
        "DISK_CACHE_MAX_BYTES": "0",
        "ADMISSION_CONTROL": "false",
    }
    texts = [f"message {n} about a prize" for n in range(100)]
    answered = "loraserve_requests_total"
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        point = load(server.url, "sim", texts, clients=35, seconds=1.0, warmup=1.0)
        served = metric_sums(server.url, {answered}, route="/predict", status="200")[answered]
    counted = point["statuses"]["200"]
    assert set(point["statuses"]) == {"200"} and point["answered_by"] == {"sim": counted}
    assert point["clients"] == 35 and point["seconds"] >= 1.0
    assert point["texts_per_s"] == pytest.approx(counted / point["seconds"])
    # Each client waits for its answer: at least one each, and none the server did not give.
    assert 35 <= counted <= served


def test_the_committed_replicas_report_is_its_figures_rendered() -> None:
    figures = json.loads((REPORTS / "gpu-replicas.json").read_text(encoding="utf-8"))
    assert figures["meta"]["device"] == "cuda" and not figures["meta"]["smoke"]
    expected = (REPORTS / "gpu-replicas.md").read_text(encoding="utf-8")
    assert gpu_replicas.markdown(figures) == expected


def test_the_committed_front_ends_report_is_its_figures_rendered() -> None:
    figures = json.loads((REPORTS / "gpu-front-ends.json").read_text(encoding="utf-8"))
    assert figures["meta"]["device"] == "cuda" and not figures["meta"]["smoke"]
    layouts = {(row["front_ends"], row["clients"]) for row in figures["rows"]}
    assert layouts == {(n, c) for n in (0, 1, 2, 4) for c in (64, 256)}
    expected = (REPORTS / "gpu-front-ends.md").read_text(encoding="utf-8")
    assert gpu_front_ends.markdown(figures) == expected


def test_the_committed_cuda_graphs_report_is_its_figures_rendered() -> None:
    figures = json.loads((REPORTS / "gpu-graphs.json").read_text(encoding="utf-8"))
    assert figures["meta"]["device"] == "cuda" and not figures["meta"]["smoke"]
    assert figures["forward"]["enabled"] and figures["forward"]["failure"] is None
    assert [row["listed_cuda_graphs"] for row in figures["served"]] == [False] * 4 + [True] * 4
    expected = (REPORTS / "gpu-graphs.md").read_text(encoding="utf-8")
    assert gpu_graphs.markdown(figures) == expected


def test_the_committed_gpu_report_is_its_figures_rendered() -> None:
    """bench/reports/gpu.md says what gpu.json holds: no figure edited by hand, and wording
    changed in bench/gpu_report.py rendered again from the run's own figures."""
    figures = json.loads((REPORTS / "gpu.json").read_text(encoding="utf-8"))
    assert figures["meta"]["device"] == "cuda" and not figures["meta"]["smoke"]
    assert gpu_report.markdown(figures) == (REPORTS / "gpu.md").read_text(encoding="utf-8")
