"""Padding-free batches on the real loader: the padded forward's answers, or no packing."""

from __future__ import annotations

import logging

import pytest
import torch

from api.models import packing
from api.models.loader import load_model
from api.models.predictor import Predictor
from tests.support.in_process import make_settings, spec_for
from tests.support.tiny_models import TinyModel, build_encoder_classifier

# Lengths from 3 to 30 tokens in one batch: padded, most rows carry padding.
TEXTS = [
    "win",
    "call now",
    "are we still meeting for lunch tomorrow or not, tell me soon please",
    "free prize claim",
    "ok lunch now, call me",
    "winner! call 0800 to claim your free prize today",
]


def logits(predictor: Predictor, rows: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
    return torch.tensor([scores.logits for scores in predictor.forward(rows, adapters)])


@pytest.fixture(scope="module")
def tiny_electra(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return TinyModel(build_encoder_classifier(tmp_path_factory.mktemp("electra"), "electra"), {})


@pytest.fixture(scope="module")
def tiny_roberta(tmp_path_factory: pytest.TempPathFactory) -> TinyModel:
    return TinyModel(build_encoder_classifier(tmp_path_factory.mktemp("roberta"), "roberta"), {})


def test_packed_forward_gives_the_padded_logits(
    tiny_bert: TinyModel, tiny_electra: TinyModel
) -> None:
    for spec in (spec_for(tiny_bert, adapters=("spam",)), spec_for(tiny_electra, adapters=())):
        predictor = Predictor(load_model(spec, make_settings()))
        rows = predictor.encode(TEXTS)
        assert len({len(row) for row in rows}) == len(rows)  # every row a different length
        padded = logits(predictor, rows, [None] * len(rows))

        assert predictor.enable_packing() and predictor.packs_batches
        packed = logits(predictor, rows, [None] * len(rows))
        alone = torch.cat([logits(predictor, [row], [None]) for row in rows])

        assert torch.allclose(packed, padded, atol=1e-5), (packed - padded).abs().max()
        assert torch.allclose(alone, padded, atol=1e-5)


def test_packed_dynamic_int8_answers_like_padded(tiny_bert: TinyModel) -> None:
    # Dynamic int8 scales activations over the whole batch, padding included when padded:
    # the two differ as two batchings differ, not more.
    spec = spec_for(tiny_bert, adapters=("spam",), quantization="dynamic-int8")
    predictor = Predictor(load_model(spec, make_settings()))
    rows = predictor.encode(TEXTS)
    padded = torch.tensor([s.probabilities for s in predictor.forward(rows, [None] * len(rows))])

    assert predictor.enable_packing()
    packed = torch.tensor([s.probabilities for s in predictor.forward(rows, [None] * len(rows))])
    assert torch.allclose(packed, padded, atol=0.05)
    assert torch.equal(packed.argmax(dim=1), padded.argmax(dim=1))


def test_unmerged_adapters_pack_each_batch_mixed_or_not(
    tiny_bert: TinyModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    predictor = Predictor(load_model(spec_for(tiny_bert), make_settings()))
    rows = predictor.encode(TEXTS)
    spam = logits(predictor, rows, ["spam"] * len(rows))
    promo = logits(predictor, rows, ["promo"] * len(rows))
    half = len(rows) // 2
    mixed_adapters: list[str | None] = ["spam"] * half + ["promo"] * (len(rows) - half)

    assert predictor.enable_packing()

    def no_padding(*args: object, **kwargs: object) -> None:
        raise AssertionError("a packed model padded a batch")

    monkeypatch.setattr(predictor.loaded.tokenizer, "pad", no_padding)
    assert torch.allclose(logits(predictor, rows, ["spam"] * len(rows)), spam, atol=1e-5)
    assert torch.allclose(logits(predictor, rows, ["promo"] * len(rows)), promo, atol=1e-5)
    # A mixed batch: one packed forward per adapter, answers back in the batch's order.
    mixed = logits(predictor, rows, mixed_adapters)
    assert torch.allclose(mixed, torch.cat([spam[:half], promo[half:]]), atol=1e-5)
    interleaved: list[str | None] = ["promo", "spam"] * (len(rows) // 2)
    expected = torch.stack(
        [(spam if name == "spam" else promo)[i] for i, name in enumerate(interleaved)]
    )
    assert torch.allclose(logits(predictor, rows, interleaved), expected, atol=1e-5)


def test_decoder_models_stay_padded(tiny_llama: TinyModel) -> None:
    predictor = Predictor(load_model(spec_for(tiny_llama, adapters=("spam",)), make_settings()))
    rows = predictor.encode(TEXTS)
    before = logits(predictor, rows, [None] * len(rows))

    assert not predictor.enable_packing() and not predictor.packs_batches
    assert torch.equal(logits(predictor, rows, [None] * len(rows)), before)


def test_eager_attention_stays_padded(tiny_bert: TinyModel) -> None:
    settings = make_settings(attn_implementation="eager")
    predictor = Predictor(load_model(spec_for(tiny_bert, adapters=("spam",)), settings))
    assert not predictor.enable_packing()


def test_the_load_check_refuses_a_packing_that_answers_differently(
    tiny_roberta: TinyModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # RoBERTa counts positions from its padding index, not 0: were it let through the
    # architecture list, the probe must catch the different answers and keep it padded.
    monkeypatch.setattr(packing, "PACKABLE_MODEL_TYPES", frozenset({"roberta"}))
    predictor = Predictor(load_model(spec_for(tiny_roberta, adapters=()), make_settings()))
    rows = predictor.encode(TEXTS)
    before = logits(predictor, rows, [None] * len(rows))

    with caplog.at_level(logging.WARNING):
        assert not predictor.enable_packing()
    assert "packed logits differ from padded ones" in caplog.text
    assert predictor.loaded.model.config._attn_implementation == "sdpa"
    assert torch.equal(logits(predictor, rows, [None] * len(rows)), before)


def test_packing_is_off_on_a_gpu(tiny_bert: TinyModel) -> None:
    loaded = load_model(spec_for(tiny_bert, adapters=("spam",)), make_settings())
    with pytest.raises(packing.PackingUnsupported, match="for CPUs"):
        packing.PackedRunner(loaded.model, torch.device("cuda"))


def test_layout_attends_within_each_text_only_as_if_alone() -> None:
    # 11 texts of 5 lengths, in no order: packed by length, runs of one length attend together.
    lengths = [3, 1, 5, 2, 2, 4, 5, 1, 3, 2, 2]
    layout = packing.PackedLayout.of(lengths, torch.device("cpu"))
    packed_lengths = sorted(lengths)
    assert [lengths[text] for text in layout.order] == packed_lengths
    assert layout.positions.tolist() == [[i for n in packed_lengths for i in range(n)]]
    torch.manual_seed(0)
    query, key, value = (torch.randn(1, 2, sum(lengths), 4) for _ in range(3))

    got = layout.attend(query, key, value, scaling=None)

    expected, start = [], 0
    for n in packed_lengths:  # each text alone, as a batch of one
        q, k, v = (t[:, :, start : start + n] for t in (query, key, value))
        expected.append(torch.nn.functional.scaled_dot_product_attention(q, k, v))
        start += n
    want = torch.cat(expected, dim=2).transpose(1, 2)  # [1, tokens, heads, dim]
    assert got.shape == want.shape
    assert torch.equal(got, want)  # to the bit: no padding, no mask

    # Gathered back apart in batch order: text 1 (1 token) is the first in packed order.
    hidden = layout.pad_hidden(torch.arange(float(sum(lengths))).reshape(1, -1, 1))
    assert hidden.shape == (len(lengths), max(lengths), 1)
    assert hidden[1, :, 0].tolist() == [0, 0, 0, 0, 0]
    # The two 5-token texts are packed last, in batch order (the sort is stable).
    assert hidden[2, :, 0].tolist() == [20, 21, 22, 23, 24]
    assert hidden[6, :, 0].tolist() == [25, 26, 27, 28, 29]
