"""FORWARD_PROCESSES: a CPU model's batches cut into parts run in worker processes (real
processes, the tiny BERT), answered as the serving process's own forward answers them, and no
worker left behind however the serving process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import pairwise
from pathlib import Path
from typing import cast

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from api.models.adapter_check import check_adapter
from api.models.forward_processes import ForwardProcesses, split_by_tokens
from api.models.predictor import Predictor
from api.models.registry import Registry
from api.models.spec import ModelSpec
from tests.support.in_process import make_settings, serving, spec_for, wait_for
from tests.support.tiny_models import TinyModel

REPO = Path(__file__).resolve().parents[2]
MAX_RANK = 8
# float32's rounding as a text's batch-mates change (~1e-7 on these logits), with room.
ROUNDING = 1e-5
TEXT_IDS = [[2, 40 + i % 9, 50 + i % 5, *([60] * (i % 7)), 3] for i in range(24)]


@pytest.mark.parametrize("lengths", [[5] * 8, [1, 9, 2, 30, 4, 4, 7], [12], [3, 3], [50, 1, 1]])
@pytest.mark.parametrize("parts", [1, 2, 4])
def test_a_batch_is_cut_in_consecutive_parts_of_about_equal_tokens(
    lengths: list[int], parts: int
) -> None:
    slices = split_by_tokens(lengths, parts)
    assert slices[0][0] == 0 and slices[-1][1] == len(lengths)
    assert all(start < end for start, end in slices)
    assert all(a[1] == b[0] for a, b in pairwise(slices))
    assert len(slices) == min(parts, len(lengths))
    # No slice holds more than an equal share of the tokens and one row more.
    largest = max(sum(lengths[start:end]) for start, end in slices)
    assert largest <= sum(lengths) / len(slices) + max(lengths)


@pytest.mark.parametrize(
    ("lengths", "parts", "expected"),
    [
        ([5] * 8, 2, [(0, 4), (4, 8)]),
        ([5] * 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)]),
        # The long row alone: beside it, either neighbour's slice would hold far more.
        ([1, 9, 2, 30, 4, 4, 7], 4, [(0, 3), (3, 4), (4, 6), (6, 7)]),
        ([3, 3], 4, [(0, 1), (1, 2)]),
    ],
)
def test_where_a_batch_is_cut(
    lengths: list[int], parts: int, expected: list[tuple[int, int]]
) -> None:
    assert split_by_tokens(lengths, parts) == expected


def alive(pid: int) -> bool:
    """The process runs (a zombie, exited but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(") ", 1)[1][0] != "Z"


@contextmanager
def spread_registry(spec: ModelSpec) -> Iterator[tuple[Registry, Predictor]]:
    registry = Registry([spec], make_settings(forward_processes=2, torch_num_threads=2))
    registry.load_all()
    try:
        yield registry, registry.models[spec.name].predictor
    finally:
        registry.close()


@pytest.fixture
def spread(tiny_bert: TinyModel) -> Iterator[tuple[Registry, Predictor]]:
    """Per-token int8, packed: a text's logits are the same to the bit whatever its
    batch-mates (api.models.quantization), so a batch's parts answer as the whole does."""
    with spread_registry(
        spec_for(tiny_bert, adapters=("spam",), quantization="dynamic-int8")
    ) as found:
        yield found


@pytest.fixture
def spread_unmerged(tiny_bert: TinyModel) -> Iterator[tuple[Registry, Predictor]]:
    """float32 with two adapters kept apart from the base, as run-time adapters need. A
    float32 matmul sums in an order its rows' count may change: a text's logits move by
    rounding with its batch-mates, here as in one process."""
    with spread_registry(spec_for(tiny_bert)) as found:
        yield found


def workers_of(predictor: Predictor) -> ForwardProcesses:
    assert isinstance(predictor.spread, ForwardProcesses)
    return predictor.spread


def test_batches_in_forward_processes_get_the_serving_process_logits_to_the_bit(
    spread: tuple[Registry, Predictor],
) -> None:
    _, predictor = spread
    assert workers_of(predictor).count == 2
    assert predictor.packs_batches
    for size in (8, 13, 24):
        batch, adapters = TEXT_IDS[:size], cast(list[str | None], ["spam"] * size)
        scores = predictor.forward(batch, adapters)
        here = predictor.logits_here(batch, adapters).float()
        assert torch.equal(torch.tensor([s.logits for s in scores]), here)
    assert predictor.spread is not None  # still spread: nothing was lost on the way


def test_an_adapter_attached_at_run_time_reaches_every_forward_process(
    spread_unmerged: tuple[Registry, Predictor], tiny_bert: TinyModel
) -> None:
    _, predictor = spread_unmerged
    # The promo adapter again under a new name: its rows must get what promo's rows get.
    checked = check_adapter(tiny_bert.adapters["promo"], predictor.loaded, None, MAX_RANK)
    predictor.attach_adapter("promo@1", checked)
    batch = TEXT_IDS[:8]
    adapters: list[str | None] = ["promo@1", "spam"] * 4
    got = torch.tensor([s.logits for s in predictor.forward(batch, adapters)])
    here = predictor.logits_here(batch, adapters).float()
    assert torch.allclose(got, here, rtol=0, atol=ROUNDING)
    # The new adapter's rows got promo's answers, not spam's: the workers applied it.
    promo = predictor.logits_here(batch, ["promo"] * 8).float()
    spam = predictor.logits_here(batch, ["spam"] * 8).float()
    assert torch.allclose(got[0::2], promo[0::2], rtol=0, atol=ROUNDING)
    assert (got[0::2] - spam[0::2]).abs().max() > 100 * ROUNDING
    predictor.detach_adapter("promo@1")
    assert predictor.spread is not None
    with pytest.raises(Exception, match="promo@1"):
        predictor.forward(batch, ["promo@1"] * 8)


def test_a_lost_forward_process_leaves_the_batches_in_the_serving_process(
    spread: tuple[Registry, Predictor],
) -> None:
    _, predictor = spread
    pids = workers_of(predictor).pids
    assert all(alive(pid) for pid in pids)
    os.kill(pids[0], signal.SIGKILL)
    wait_for(lambda: not alive(pids[0]), 10, "the killed worker gone")
    # A batch too small to cut runs here: the workers, lost one included, are not asked.
    predictor.forward(TEXT_IDS[:4], ["spam"] * 4)
    assert predictor.spread is not None
    batch, adapters = TEXT_IDS[:12], cast(list[str | None], ["spam"] * 12)
    scores = predictor.forward(batch, adapters)
    assert predictor.spread is None
    here = predictor.logits_here(batch, adapters).float()
    assert torch.equal(torch.tensor([s.logits for s in scores]), here)
    wait_for(lambda: not any(alive(pid) for pid in pids), 10, "every worker gone")


def test_closing_the_registry_stops_every_forward_process(
    spread: tuple[Registry, Predictor],
) -> None:
    registry, predictor = spread
    pids = workers_of(predictor).pids
    registry.close()
    assert predictor.spread is None
    assert not any(alive(pid) for pid in pids)


KILLED_PARENT = """
import sys, time
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel
from api.models.registry import Registry
from api.models.spec import ModelSpec
from pathlib import Path
tiny = TinyModel(Path(sys.argv[1]), {"spam": Path(sys.argv[2])})
spec = spec_for(tiny, adapters=("spam",))
registry = Registry([spec], make_settings(forward_processes=2, model_cache_dir=sys.argv[3]))
registry.load_all()
print(*registry.models[spec.name].predictor.spread.pids, flush=True)
time.sleep(600)
"""


def test_forward_processes_exit_when_their_serving_process_is_killed(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            KILLED_PARENT,
            str(tiny_bert.base),
            str(tiny_bert.adapters["spam"]),
            str(tmp_path / "cache"),
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
    finally:
        parent.kill()  # SIGKILL: no handler runs, no atexit
        parent.wait()
    # Their pipe's end closes with the parent: each worker reads its end and exits.
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "forward processes outlived their serving process"


# Enough for a batch the workers run (8 texts and more); each alone runs in the serving process.
TEXTS = [
    "win a free prize now",
    "lunch tomorrow?",
    "call 09061701461 to claim your reward",
    "ok see you at 5",
    "URGENT! your mobile number has won £2000",
    "i'll be late, sorry",
    "free entry in 2 a wkly comp to win",
    "did you get the tickets",
    "txt STOP to end, 150p a msg",
    "where are you",
    "claim your cash prize today",
    "mum says hi",
]


def test_the_service_answers_the_same_with_its_batches_in_forward_processes(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """The served answers with FORWARD_PROCESSES=2 and with 1, every text computed (no
    cache tier on), alone and in one request."""
    spec = spec_for(tiny_bert, adapters=("spam",), quantization="dynamic-int8")
    answers = []
    for processes in (1, 2):
        with serving(
            [spec],
            tmp_path / f"cache-{processes}",
            forward_processes=processes,
            lru_cache_entries=0,
            disk_cache_max_bytes=0,
        ) as client:
            responses = [
                client.post("/predict", json={"inputs": TEXTS, "raw_scores": True}),
                *(client.post("/predict", json={"inputs": text}) for text in TEXTS),
            ]
            assert all(response.status_code == 200 for response in responses)
            assert all(r.headers["X-Cache"].endswith("model=1") for r in responses[1:])
            answers.append([response.json() for response in responses])
            (model,) = client.get("/models").json()["models"]
            resident = resident_by_process(client.get("/metrics").text)
        # The app with two did run them: its start timed theirs, /metrics shows their memory.
        assert (model["load_seconds"]["forward_processes"] > 0) == (processes == 2)
        assert sorted(resident) == (["0", "1"] if processes == 2 else [])
        assert all(value > 10e6 for value in resident.values())  # a model and torch each
    assert answers[0] == answers[1]


def resident_by_process(exposition: str) -> dict[str, float]:
    """loraserve_forward_process_resident_memory_bytes of the model "tiny", by process."""
    found = {}
    for family in text_string_to_metric_families(exposition):
        if family.name == "loraserve_forward_process_resident_memory_bytes":
            for sample in family.samples:
                assert sample.labels["model"] == "tiny"
                found[sample.labels["process"]] = sample.value
    return found
