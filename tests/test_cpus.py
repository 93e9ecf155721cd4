"""MODEL_CPUS and FRONT_END_CPUS: CPU lists read as Linux writes them, and each process of the
service pinned, every thread, to its own, as the kernel reports it for each thread;
CPUs a process cannot have stop it at start, saying which it may have."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from api.cpus import format_cpu_list, parse_cpu_list
from api.settings import SettingsError, load_settings
from tests.support.batch_cli import cli_env, read_jsonl, run_cli
from tests.support.server_process import children_of, run_server
from tests.support.tiny_models import simulated_entry, write_models_file

AVAILABLE = sorted(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("text", "cpus"),
    [
        ("0", {0}),
        ("3", {3}),
        ("0-3,8", {0, 1, 2, 3, 8}),
        (" 1 , 4-5 ", {1, 4, 5}),
        ("2-2", {2}),
        ("5,1,5", {1, 5}),
    ],
)
def test_a_cpu_list_reads_as_linux_writes_it(text: str, cpus: set[int]) -> None:
    assert parse_cpu_list(text) == cpus


@pytest.mark.parametrize(
    ("cpus", "text"), [({0}, "0"), ({0, 1, 2, 3, 8}, "0-3,8"), ({1, 3, 5, 6}, "1,3,5-6")]
)
def test_a_set_of_cpus_is_written_as_its_shortest_list(cpus: set[int], text: str) -> None:
    assert format_cpu_list(cpus) == text


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("a", "'a' is not a CPU number"),
        ("1_0", "'1_0' is not a CPU number"),  # int() would read it as 10
        ("-1", "'-1' is not a CPU number"),
        ("1-", "'1-' is not a CPU number"),
        ("0,,1", "'' is not a CPU number"),
        ("٣", "'٣' is not a CPU number"),  # a digit to str.isdigit and int(), not to Linux
        ("3-1", "the range '3-1' runs backwards"),
        ("0-99999999", "CPU 99999999 is past Linux's largest"),
    ],
)
def test_what_is_not_a_cpu_list_is_refused_naming_the_setting(text: str, said: str) -> None:
    for name in ("model_cpus", "front_end_cpus"):
        with pytest.raises(SettingsError) as refused:
            load_settings(**{name: text})
        assert f"{name.upper()}: Value error, {said}" in str(refused.value)


def test_torch_takes_a_thread_a_model_cpu_unless_told_otherwise() -> None:
    assert load_settings(model_cpus="0-2,5").torch_threads == 4
    assert load_settings(model_cpus="0-2,5", torch_num_threads=2).torch_threads == 2
    assert load_settings(model_cpus="").torch_threads is None


def allowed_cpus(pid: int) -> dict[int, set[int]]:
    """Each thread of the process and the CPUs the kernel lets it run on."""
    return {
        int(task.name): os.sched_getaffinity(int(task.name))
        for task in Path(f"/proc/{pid}/task").iterdir()
    }


def simulated_env(folder: Path) -> dict[str, str]:
    models = write_models_file(folder / "models.yaml", [simulated_entry()])
    return {"MODELS_FILE": str(models), "DISK_CACHE_DIR": str(folder / "cache")}


def test_the_split_runs_its_front_end_and_its_model_side_each_on_its_own_cpus(
    tmp_path: Path,
) -> None:
    # On one CPU both get it: still each process's own setting, checked thread by thread.
    front_end_cpu, model_cpu = AVAILABLE[0], AVAILABLE[-1]
    env = {
        **simulated_env(tmp_path),
        "SPLIT_FRONT_END": "true",
        "FRONT_END_CPUS": str(front_end_cpu),
        "MODEL_CPUS": str(model_cpu),
    }
    with run_server(env, tmp_path) as service:
        service.wait_ready()
        answered = httpx.post(f"{service.url}/predict", json={"inputs": "pinned"}, timeout=30)
        assert answered.status_code == 200 and answered.headers["x-model"] == "sim"
        (front_end,) = children_of(service.process.pid)
        model_side = allowed_cpus(service.process.pid)
        front = allowed_cpus(front_end)
    # Threads started while serving (the batch worker, the disk tier's writer) among them.
    assert len(model_side) > 1 and set(map(frozenset, model_side.values())) == {
        frozenset({model_cpu})
    }
    assert set(map(frozenset, front.values())) == {frozenset({front_end_cpu})}
    assert f"running on CPUs {model_cpu} (MODEL_CPUS)" in service.log()
    assert f"running on CPUs {front_end_cpu} (FRONT_END_CPUS)" in service.log()


def test_unset_the_processes_run_wherever_they_may(tmp_path: Path) -> None:
    with run_server(simulated_env(tmp_path), tmp_path) as service:
        service.wait_ready()
        threads = allowed_cpus(service.process.pid)
    assert set(map(frozenset, threads.values())) == {frozenset(AVAILABLE)}


@pytest.mark.parametrize(
    ("cpus", "said"),
    [
        ("8191", "MODEL_CPUS=8191: Invalid argument; this process may run on CPUs"),
        (f"{AVAILABLE[0]},8191", f"MODEL_CPUS={AVAILABLE[0]},8191: the kernel granted only"),
    ],
)
def test_cpus_a_process_cannot_have_stop_it_at_start(tmp_path: Path, cpus: str, said: str) -> None:
    env = {**simulated_env(tmp_path), "MODEL_CPUS": cpus}
    with run_server(env, tmp_path) as service:
        assert service.process.wait(timeout=120) == 2
    log = service.log()
    assert said in log and format_cpu_list(AVAILABLE) in log


def test_scoring_a_file_in_process_runs_on_model_cpus(tmp_path: Path) -> None:
    models = write_models_file(tmp_path / "models.yaml", [simulated_entry()])
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "win a prize now"}\n{"text": "see you at lunch"}\n')
    output = tmp_path / "scored.jsonl"
    pinned = cli_env(models, tmp_path, MODEL_CPUS=str(AVAILABLE[-1]))
    scored = run_cli(pinned, tmp_path, "score", texts, "-o", output)
    assert scored.returncode == 0, scored.stderr
    assert len(read_jsonl(output)[1]) == 2
    refused = run_cli(cli_env(models, tmp_path, MODEL_CPUS="8191"), tmp_path, "score", texts)
    assert refused.returncode == 2
    assert "MODEL_CPUS=8191: Invalid argument; this process may run on CPUs" in refused.stderr
