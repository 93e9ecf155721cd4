"""The GPU path (the users' deployment): 4-bit nf4 + LoRA on CUDA. Needs a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from api.metrics import GpuMemoryCollector
from api.models.loader import LoadError, load_model
from api.models.predictor import Predictor
from tests.conftest import make_settings, spec_for
from tests.tiny_models import TinyModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU: bitsandbytes 4-bit on GPU"
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
    assert predictor.batch_variance() > 0
    assert logits(rows, adapters) != alone

    predictor.scores_alone = True
    assert logits(rows, adapters) == alone
