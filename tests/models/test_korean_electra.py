"""KoELECTRA-shaped models and Korean text: an ELECTRA discriminator (no classification head)
whose LoRA adapters carry the head in `modules_to_save`, a Korean WordPiece vocabulary laid
out as the real checkpoint ships it (vocab.txt + tokenizer_config.json), served packed,
padded and with adapters mixed in one batch, each text checked against transformers + peft
scoring it alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    ElectraConfig,
    ElectraForPreTraining,
)

from api.models.loader import load_model
from api.models.predictor import Predictor, Scores
from api.models.spec import AdapterSpec, ModelSpec
from tests.support.in_process import make_settings, serving

LABELS = ["정상", "스팸"]  # ham, spam: Korean labels travel as UTF-8 JSON too
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
PIECES = [
    "무료", "##로", "당첨", "##되", "##었", "##습니다", "축하", "##합니다", "지금", "전화",
    "##하세요", "안녕", "##하", "##세요", "내일", "봐", "##요", "광고", "쿠폰", "받", "##으",
    "##세", "!", "?", ".", ",", "(", ")", "0", "1", "2", "3", "%",
]  # fmt: skip
TEXTS = [
    "무료로 당첨되었습니다! 지금 전화하세요",
    "안녕하세요, 내일 봐요.",
    "(광고) 쿠폰 받으세요 30%",
    "축하합니다",
]


def wordpiece(text: str, vocab: set[str]) -> list[str]:
    """The reference: BERT's basic split (whitespace, punctuation apart, no lower-casing, no
    accent stripping) and greedy longest-match WordPiece, written from its definition."""
    words: list[str] = []
    for chunk in text.split():
        word = ""
        for char in chunk:
            if not char.isalnum():
                words += [word, char] if word else [char]
                word = ""
            else:
                word += char
        if word:
            words.append(word)
    pieces: list[str] = []
    for word in words:
        start, found = 0, []
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                if piece in vocab:
                    break
                end -= 1
            if end == start:
                found = ["[UNK]"]
                break
            found.append(piece)
            start = end
        pieces += found
    return pieces


@pytest.fixture(scope="module")
def koelectra(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A 2-layer ELECTRA discriminator in KoELECTRA's layout, with no classification head."""
    folder = tmp_path_factory.mktemp("koelectra") / "base"
    folder.mkdir()
    (folder / "vocab.txt").write_text("\n".join(SPECIALS + PIECES) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"do_lower_case": False, "model_max_length": 512}), encoding="utf-8"
    )
    torch.manual_seed(0)
    config = ElectraConfig(
        vocab_size=len(SPECIALS) + len(PIECES),
        embedding_size=32,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    ElectraForPreTraining(config).save_pretrained(folder, safe_serialization=True)
    yield folder


@pytest.fixture(scope="module")
def adapters(koelectra: Path) -> dict[str, Path]:
    """Two SEQ_CLS adapters, each with its own trained-looking head in modules_to_save."""
    found = {}
    for name, seed in (("spam", 1), ("promo", 2)):
        model = AutoModelForSequenceClassification.from_pretrained(
            koelectra, num_labels=2, id2label=dict(enumerate(LABELS))
        )
        torch.manual_seed(seed)
        config = LoraConfig(
            task_type=TaskType.SEQ_CLS,
            r=4,
            lora_alpha=8,
            target_modules=["query", "value"],
            init_lora_weights=False,
        )
        peft_model = get_peft_model(model, config)
        with torch.no_grad():
            for key, param in peft_model.named_parameters():
                if "modules_to_save" in key:
                    param.normal_(0.0, 0.5)
        assert "classifier" in (peft_model.peft_config["default"].modules_to_save or [])
        folder = koelectra.parent / f"adapter-{name}"
        peft_model.save_pretrained(folder, safe_serialization=True)
        found[name] = folder
    return found


def spec(base: Path, adapters: dict[str, Path]) -> ModelSpec:
    return ModelSpec.model_validate(
        {
            "name": "koelectra",
            "base": str(base),
            "labels": LABELS,
            "max_length": 64,
            "adapters": [AdapterSpec(name=n, path=p) for n, p in adapters.items()],
        }
    )


def reference(base: Path, adapter: Path, text: str) -> list[float]:
    """transformers + peft, one text, unpadded, the adapter's saved head."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForSequenceClassification.from_pretrained(base, num_labels=2)
    peft_model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.no_grad():
        logits = peft_model(**tokenizer(text, return_tensors="pt")).logits[0]
    return [float(x) for x in logits]


def test_korean_wordpiece_tokenizes_as_the_reference(koelectra: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(koelectra)
    vocab = set(SPECIALS + PIECES)
    for text in TEXTS:
        assert tokenizer.tokenize(text) == wordpiece(text, vocab)
    assert "[UNK]" not in tokenizer.tokenize(TEXTS[0])


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_each_adapter_and_its_head_serve_as_transformers_alone(
    koelectra: Path, adapters: dict[str, Path], tmp_path: Path, packed: bool
) -> None:
    with serving(
        [spec(koelectra, adapters)], tmp_path / "cache", pack_batches=packed, cache=False
    ) as client:
        listed = client.get("/models").json()["models"][0]
        for name, folder in adapters.items():
            response = client.post(
                "/predict",
                json={"inputs": TEXTS, "adapter": name, "raw_scores": True, "cache": False},
            )
            assert response.status_code == 200
            for text, ranked in zip(TEXTS, response.json(), strict=True):
                got = {item["label"]: item["score"] for item in ranked}
                want = reference(koelectra, folder, text)
                for index, label in enumerate(LABELS):
                    assert abs(got[label] - want[index]) < 1e-5, (name, text, got, want)
    assert listed["packed_batches"] is packed and listed["adapter_mode"] == "unmerged"


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_a_batch_mixing_adapters_scores_each_row_with_its_own(
    koelectra: Path, adapters: dict[str, Path], packed: bool
) -> None:
    predictor = Predictor(load_model(spec(koelectra, adapters), make_settings()))
    if packed:
        assert predictor.enable_packing()
    names: list[str | None] = ["spam", "promo", "promo", "spam"]
    scores = predictor.forward(predictor.encode(TEXTS), names)
    for text, name, result in zip(TEXTS, names, scores, strict=True):
        assert isinstance(result, Scores) and name is not None
        want = reference(koelectra, adapters[name], text)
        assert max(abs(a - b) for a, b in zip(result.logits, want, strict=True)) < 1e-5


def test_character_limits_count_characters_and_errors_stay_utf8(
    koelectra: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    text = "무료" * 10  # 20 characters, 60 bytes in UTF-8
    with serving([spec(koelectra, adapters)], tmp_path / "cache", max_text_chars=20) as client:
        fits = client.post("/predict", json={"inputs": text})
        over = client.post("/predict", json={"inputs": text + "!"})
        unknown = client.post("/predict", json={"inputs": text, "adapter": "nope"})
    assert fits.status_code == 200, fits.text
    assert {item["label"] for item in fits.json()} == set(LABELS)
    assert over.status_code == 422
    assert "21 characters; at most 20" in over.content.decode("utf-8")
    assert unknown.status_code == 404
    unknown.content.decode("utf-8")  # valid UTF-8, or this raises
