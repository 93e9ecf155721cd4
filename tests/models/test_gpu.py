"""The GPU path (the users' deployment): 4-bit nf4 + LoRA on CUDA. Needs a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from api.metrics import GpuMemoryCollector
from api.models.loader import LoadError, load_model
from api.models.predictor import Predictor
from tests.support.in_process import make_settings, serving, spec_for
from tests.support.tiny_models import TinyModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: bitsandbytes 4-bit and CUDA graphs"
    ),
]


def test_nf4_llama_with_adapters_runs_on_the_gpu_within_max_memory(tiny_llama: TinyModel) -> None:
    spec = spec_for(tiny_llama, quantization="nf4", compute_dtype="bfloat16")
    loaded = load_model(spec, make_settings(device="cuda", max_memory_gb=1))
    assert loaded.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in loaded.model.parameters())
    reference = Predictor(load_model(spec_for(tiny_llama), make_settings(device="cpu")))
    got = Predictor(loaded).predict(["win a free prize"], "spam")[0].probabilities
    want = reference.predict(["win a free prize"], "spam")[0].probabilities
    assert got == pytest.approx(want, abs=0.1)


def test_gpu_memory_is_reported_per_device(tiny_llama: TinyModel) -> None:
    load_model(spec_for(tiny_llama, quantization="nf4"), make_settings(device="cuda"))
    families = {family.name: family for family in GpuMemoryCollector().collect()}
    allocated = families["loraserve_gpu_memory_allocated_bytes"].samples
    assert allocated and allocated[0].labels == {"device": "0"} and allocated[0].value > 0


def test_a_model_the_gpu_budget_cannot_hold_is_refused_not_offloaded(
    tiny_llama: TinyModel,
) -> None:
    """Unquantized, so accelerate would put it on the CPU silently; the models before it
    (`held`) have spent the whole budget on GPU 0."""
    settings = make_settings(device="cuda", max_memory_gb=0.5)
    with pytest.raises(LoadError, match=r"model 'tiny': MAX_MEMORY_GB: .* off the GPU"):
        load_model(spec_for(tiny_llama), settings, held={0: 2**29})


def test_a_prequantized_checkpoint_on_the_gpu_answers_as_quantizing_at_start(
    tiny_llama: TinyModel, tmp_path: Path
) -> None:
    """The users' setting (nf4, bfloat16 compute, a budget): saved at the first start, read
    back at the second, with the logits of quantizing at start to the bit."""
    spec = spec_for(tiny_llama, quantization="nf4", compute_dtype="bfloat16")
    values: dict[str, object] = {"device": "cuda", "max_memory_gb": 1, "model_cache_dir": tmp_path}
    at_start = load_model(spec, make_settings(**values, prequantized_cache=False))
    first, second = (
        load_model(spec, make_settings(**values)),
        load_model(spec, make_settings(**values)),
    )

    assert (first.prequantized, second.prequantized) == ("written", "hit")
    texts = ["win a free prize now call", "are we still meeting for lunch tomorrow", "ok"]
    want = [s.logits for s in Predictor(at_start).predict(texts, "spam")]
    for loaded in (first, second):
        assert [s.logits for s in Predictor(loaded).predict(texts, "spam")] == want


def test_on_the_gpu_a_text_scored_alone_keeps_its_lone_logits_in_any_batch(
    tiny_llama: TinyModel,
) -> None:
    """BATCH_LOGIT_TOLERANCE's case on the device it is for: nf4 with a bfloat16 compute dtype
    on CUDA, where a padded batch moves a text's logits (EXAONE: 0.0886 on an H200). Scored
    alone, each text of a batch, with mixed adapters, gets its logits of a batch of one to the
    bit."""
    spec = spec_for(tiny_llama, quantization="nf4", compute_dtype="bfloat16")
    predictor = Predictor(load_model(spec, make_settings(device="cuda", max_memory_gb=1)))
    vocab = predictor.loaded.tokenizer.vocab_size
    lengths = (5, 2, 9, 5, 1, 7, 3, 12)
    rows = [[(7 + 13 * row + 3 * i) % vocab for i in range(n)] for row, n in enumerate(lengths)]
    adapters: list[str | None] = ["spam", "promo"] * 4

    def logits(batch: list[list[int]], names: list[str | None]) -> list[tuple[float, ...]]:
        return [s.logits for s in predictor.forward(batch, names) if not isinstance(s, Exception)]

    alone = [logits([row], [name])[0] for row, name in zip(rows, adapters, strict=True)]
    # Batched, the logits on this device are not the lone ones: without that, nothing is shown.
    assert predictor.probe_batches().variance > 0
    assert logits(rows, adapters) != alone

    predictor.scores_alone = True
    assert logits(rows, adapters) == alone


GRAPHED_TEXTS = [
    "win a free prize now call",
    "are we still meeting for lunch tomorrow",
    "ok",
    " ".join(["call now to claim your free prize"] * 6),  # past 32 tokens: the next bucket
    "see you at the station",
]


def test_cuda_graphs_give_the_eager_forwards_logits_at_every_bucket(tiny_bert: TinyModel) -> None:
    """Batches of 1, 3 and 5 texts, each replayed from a graph recorded at its bucket (rows
    to a power of two, tokens to a multiple of 32), against the model run eagerly as it is."""
    spec = spec_for(tiny_bert, max_length=64)
    settings = make_settings(device="cuda", pack_batches=False)
    eager = Predictor(load_model(spec, settings))
    graphed = Predictor(load_model(spec, settings))
    assert graphed.enable_cuda_graphs(max_rows=8)
    graphs = graphed.cuda_graphs
    assert graphs is not None
    assert [graphs.buckets.of(*shape) for shape in ((1, 5), (3, 33), (5, 64), (9, 8))] == [
        (1, 32),
        (4, 64),
        (8, 64),
        None,
    ]

    for batch in (GRAPHED_TEXTS[:1], GRAPHED_TEXTS[:3], GRAPHED_TEXTS):
        got = [s.logits for s in graphed.predict(batch, "spam")]
        want = [s.logits for s in eager.predict(batch, "spam")]
        assert len(got) == len(batch)
        for row_got, row_want in zip(got, want, strict=True):
            assert row_got == pytest.approx(row_want, abs=1e-4)

    assert graphs.failure is None
    assert (graphs.recorded, graphs.replays) == (3, 3)
    graphed.predict(GRAPHED_TEXTS[:1], "spam")  # the same bucket: replayed, not recorded again
    assert (graphs.recorded, graphs.replays) == (3, 4)


def test_cuda_graphs_replay_the_adapter_each_batch_names(tiny_bert: TinyModel) -> None:
    """A graph holds the weights it was recorded with: one per adapter, and none survives an
    adapter's removal. The two adapters answer differently, so a graph of the wrong one shows."""
    spec = spec_for(tiny_bert, max_length=64)
    settings = make_settings(device="cuda", pack_batches=False)
    eager = Predictor(load_model(spec, settings))
    graphed = Predictor(load_model(spec, settings))
    assert graphed.enable_cuda_graphs(max_rows=8)

    def logits(predictor: Predictor, names: list[str | None]) -> list[tuple[float, ...]]:
        rows = predictor.encode(GRAPHED_TEXTS)
        scored = predictor.forward(rows, names)
        return [s.logits for s in scored if not isinstance(s, Exception)]

    spam, promo = ["spam"] * 5, ["promo"] * 5
    mixed: list[str | None] = ["spam", "promo", "promo", "spam", "promo"]
    assert logits(eager, list(spam)) != logits(eager, list(promo))
    for names in (spam, promo, spam, mixed):
        got, want = logits(graphed, list(names)), logits(eager, list(names))
        for row_got, row_want in zip(got, want, strict=True):
            assert row_got == pytest.approx(row_want, abs=1e-4)
    graphs = graphed.cuda_graphs
    assert graphs is not None and graphs.failure is None and graphs.recorded >= 2

    graphed.detach_adapter("promo")
    assert graphs.recorded == 0
    got, want = logits(graphed, list(spam)), logits(eager, list(spam))
    for row_got, row_want in zip(got, want, strict=True):
        assert row_got == pytest.approx(row_want, abs=1e-4)


def test_a_served_model_on_the_gpu_answers_alike_with_and_without_cuda_graphs(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    """The real app on CUDA: /models says which runs graphs, and both answer the same."""
    spec = spec_for(tiny_bert, max_length=64)
    answers = {}
    for graphs in (False, True):
        with serving(
            [spec], tmp_path / f"cache-{graphs}", device="cuda", cuda_graphs=graphs
        ) as client:
            assert client.get("/models").json()["models"][0]["cuda_graphs"] is graphs
            response = client.post(
                "/predict", json={"inputs": GRAPHED_TEXTS, "adapter": "promo", "cache": False}
            )
            assert response.status_code == 200, response.text
            answers[graphs] = response.json()
    eager, graphed = answers[False], answers[True]
    assert len(graphed) == len(eager) == len(GRAPHED_TEXTS)
    for got, want in zip(graphed, eager, strict=True):
        scores = {item["label"]: item["score"] for item in want}
        assert {item["label"] for item in got} == set(scores)
        for item in got:
            assert item["score"] == pytest.approx(scores[item["label"]], abs=1e-4)
