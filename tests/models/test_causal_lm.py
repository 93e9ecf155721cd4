"""Causal-LM LoRA adapters served as classifiers: one forward, the label words' next-token
logits at the end of the prompt, checked against the model's own next-token logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.models.loader import LoadError, load_model
from api.models.predictor import Predictor
from api.models.spec import AdapterSpec, ModelSpec
from tests.support.in_process import make_settings, serving
from tests.support.tiny_models import TinyModel

PROMPT = "is this spam ? {text} answer :"
WORDS = {"ham": "ok", "spam": "win"}
TEXTS = ["win a free prize now", "see you at lunch tomorrow", "call me"]


@pytest.fixture(scope="module")
def causal_adapter(tiny_llama: TinyModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter trained as a causal LM (no classification head), random weights."""
    folder = tmp_path_factory.mktemp("causal") / "adapter"
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama.base)
    config = LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        init_lora_weights=False,
    )
    get_peft_model(model, config).save_pretrained(folder, safe_serialization=True)
    return folder


def causal_spec(tiny: TinyModel, adapter: Path, **fields: object) -> ModelSpec:
    values: dict[str, object] = {
        "name": "llm",
        "base": str(tiny.base),
        "task": "causal-lm",
        "prompt": PROMPT,
        "label_words": WORDS,
        "max_length": 32,
        "adapters": [AdapterSpec(name="spam", path=adapter)],
        **fields,
    }
    return ModelSpec.model_validate(values)


def reference_logits(tiny: TinyModel, adapter: Path, text: str) -> dict[str, float]:
    """transformers + peft, one text, unpadded: the next-token logits of each label's word."""
    tokenizer = AutoTokenizer.from_pretrained(tiny.base)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny.base), adapter)
    ids = tokenizer(PROMPT.replace("{text}", text), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        next_token = model(input_ids=ids).logits[0, -1]
    return {
        label: next_token[tokenizer.convert_tokens_to_ids(word)].item()
        for label, word in WORDS.items()
    }


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "unmerged"])
def test_scores_are_the_label_words_next_token_logits(
    tiny_llama: TinyModel, causal_adapter: Path, tmp_path: Path, merge: bool
) -> None:
    spec = causal_spec(tiny_llama, causal_adapter)
    with serving([spec], tmp_path / "cache", merge_single_adapter=merge) as client:
        # Texts of different lengths in one request: one left-padded batch.
        raw = client.post("/predict", json={"inputs": TEXTS, "raw_scores": True}).json()
        probabilities = client.post("/predict", json={"inputs": TEXTS}).json()
    for text, got, scored in zip(TEXTS, raw, probabilities, strict=True):
        want = reference_logits(tiny_llama, causal_adapter, text)
        logits = {item["label"]: item["score"] for item in got}
        assert logits.keys() == want.keys()
        for label in want:
            assert abs(logits[label] - want[label]) < 1e-4, (text, label, logits, want)
        softmax = torch.softmax(torch.tensor(list(want.values())), dim=0).tolist()
        expected = dict(zip(want, softmax, strict=True))
        for item in scored:
            assert abs(item["score"] - expected[item["label"]]) < 1e-5


def test_label_words_whose_first_tokens_collide_are_refused(
    tiny_llama: TinyModel, causal_adapter: Path
) -> None:
    # The tiny WordPiece vocabulary splits "okay" as "ok" "##a" "##y": it begins like "ok".
    spec = causal_spec(tiny_llama, causal_adapter, label_words={"ham": "ok", "spam": "okay"})
    with pytest.raises(LoadError, match=r"'ham' and 'spam'.*both begin with the token 'ok'"):
        load_model(spec, make_settings())


def test_truncation_cuts_the_text_and_keeps_the_end_of_the_prompt(
    tiny_llama: TinyModel, causal_adapter: Path
) -> None:
    predictor = Predictor(load_model(causal_spec(tiny_llama, causal_adapter), make_settings()))
    tokenizer = predictor.loaded.tokenizer
    (ids,) = predictor.encode(["win " * 100])
    suffix = tokenizer(" answer :", add_special_tokens=False)["input_ids"]
    assert len(ids) <= 32 and ids[-len(suffix) :] == suffix
    with pytest.raises(ValueError, match="over the model's limit"):
        predictor.encode(["win " * 100], truncate=False)


def test_a_causal_lm_needs_a_prompt_with_the_text_slot(
    tiny_llama: TinyModel, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="holds \\{text\\} once"):
        causal_spec(tiny_llama, tmp_path, prompt="no slot here")
    with pytest.raises(ValueError, match="for task: causal-lm"):
        ModelSpec.model_validate({"name": "x", "base": "b", "prompt": "{text}"})
