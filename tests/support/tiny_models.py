"""Builds tiny but real checkpoints (a BERT and a Llama with LoRA adapters, and other
encoder classifiers with their heads), on disk."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from peft import LoraConfig, TaskType, get_peft_model
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    AutoModelForSequenceClassification,
    BertConfig,
    BertModel,
    ElectraConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    RobertaConfig,
)

from api.models.spec import EMBEDDED_MODELS_FILE

WORDS = [
    "win",
    "winner",
    "free",
    "prize",
    "claim",
    "call",
    "now",
    "cash",
    "urgent",
    "txt",
    "reply",
    "stop",
    "offer",
    "mobile",
    "are",
    "we",
    "still",
    "meeting",
    "for",
    "lunch",
    "tomorrow",
    "ok",
    "see",
    "you",
    "later",
    "love",
    "home",
    "thanks",
    "sorry",
    "the",
    "a",
    "to",
    "is",
    "in",
    "it",
    "i",
    "u",
    "and",
    "of",
    "me",
    "my",
    "on",
    "at",
    "be",
]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "</s>"]
LABELS = ["ham", "spam"]


@dataclass(frozen=True)
class TinyModel:
    """A base folder and its adapter folders."""

    base: Path
    adapters: dict[str, Path]


def _vocab() -> dict[str, int]:
    chars = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789!?.,'£$")
    tokens = SPECIALS + WORDS + chars + [f"##{c}" for c in chars]
    return {token: index for index, token in enumerate(dict.fromkeys(tokens))}


def build_tokenizer(
    folder: Path, decoder: bool, vocab: dict[str, int] | None = None
) -> PreTrainedTokenizerFast:
    """A WordPiece tokenizer over a small vocabulary (`vocab`, else the English one),
    saved as tokenizer.json; the English one lower-cases."""
    english = vocab is None
    vocab = _vocab() if vocab is None else vocab
    core = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    core.normalizer = normalizers.BertNormalizer(lowercase=english)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if decoder:
        core.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
        )
    else:
        core.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
        )
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=core,
            unk_token="[UNK]",
            pad_token="[PAD]",
            cls_token="[CLS]",
            sep_token="[SEP]",
            mask_token="[MASK]",
        )
    tokenizer.save_pretrained(folder)
    return tokenizer


def build_bert(folder: Path, seed: int = 0) -> Path:
    """A 2-layer BERT saved like sentence-transformers bases: no classification head."""
    torch.manual_seed(seed)
    build_tokenizer(folder, decoder=False)
    config = BertConfig(
        vocab_size=len(_vocab()),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    BertModel(config).save_pretrained(folder, safe_serialization=True)
    return folder


def build_encoder_classifier(
    folder: Path, model_type: str, seed: int = 0, vocab: dict[str, int] | None = None
) -> Path:
    """A 2-layer `electra` or `roberta` classifier with a random head, no adapter needed;
    its vocabulary `vocab` (else the English one)."""
    torch.manual_seed(seed)
    build_tokenizer(folder, decoder=False, vocab=vocab)
    common: dict[str, object] = {
        "vocab_size": len(vocab or _vocab()),
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 128,
        "max_position_embeddings": 72,
        "pad_token_id": 0,
        "num_labels": len(LABELS),
        "id2label": dict(enumerate(LABELS)),
        "label2id": {label: index for index, label in enumerate(LABELS)},
    }
    config = (
        ElectraConfig(embedding_size=32, **common)
        if model_type == "electra"
        else RobertaConfig(**common)
    )
    model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_llama(folder: Path, seed: int = 0) -> Path:
    """A 2-layer Llama saved as a causal LM, as instruct checkpoints are (no score head)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(folder, decoder=True)
    config = LlamaConfig(
        vocab_size=len(_vocab()),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def build_adapter(
    base: Path, folder: Path, targets: list[str], seed: int, rank: int = 4, **fields: object
) -> Path:
    """A LoRA adapter with random (non-zero) weights and a trained-looking head; `fields`
    are more LoraConfig fields (or other values of its own), as a trainer would give them."""
    model = AutoModelForSequenceClassification.from_pretrained(
        base,
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id={label: index for index, label in enumerate(LABELS)},
    )
    if model.config.pad_token_id is None:
        model.config.pad_token_id = model.config.eos_token_id
    torch.manual_seed(seed)
    settings: dict[str, object] = {
        "task_type": TaskType.SEQ_CLS,
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": targets,
        "init_lora_weights": False,
        **fields,
    }
    config = LoraConfig(**settings)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # a distinct head per adapter, so adapters answer differently
        for name, param in peft_model.named_parameters():
            if "modules_to_save" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(folder, safe_serialization=True)
    return folder


def build_tiny(root: Path, kind: str) -> TinyModel:
    """`bert` or `llama`: a base with two adapters, `spam` and `promo`."""
    base = root / kind / "base"
    if kind == "bert":
        build_bert(base)
        targets = ["query", "value"]
    else:
        build_llama(base)
        targets = ["q_proj", "v_proj"]
    adapters = {
        name: build_adapter(base, root / kind / f"adapter-{name}", targets, seed)
        for name, seed in (("spam", 1), ("promo", 2))
    }
    return TinyModel(base=base, adapters=adapters)


def write_models_file(path: Path, entries: list[dict[str, object]]) -> Path:
    """A models file (JSON is YAML too) for the given model entries."""
    path.write_text(json.dumps({"models": entries}, default=str, indent=2), encoding="utf-8")
    return path


def spam_entry(tiny: TinyModel, name: str, **fields: object) -> dict[str, object]:
    """A models-file entry serving `tiny` with its spam adapter."""
    return {
        "name": name,
        "base": str(tiny.base),
        "labels": LABELS,
        "max_length": 32,
        "adapters": [{"name": "spam", "path": str(tiny.adapters["spam"])}],
        **fields,
    }


def tiny_models_file(
    folder: Path, tiny: TinyModel, adapters: tuple[str, ...] = ("spam", "promo"), **fields: object
) -> Path:
    """`folder/models.yaml` serving the tiny model as "tiny" with the named adapters."""
    entry: dict[str, object] = {
        "name": "tiny",
        "base": str(tiny.base),
        "labels": LABELS,
        "max_length": 32,
        "adapters": [{"name": name, "path": str(tiny.adapters[name])} for name in adapters],
        **fields,
    }
    return write_models_file(folder / "models.yaml", [entry])


def embedded_encoder_file(folder: Path) -> Path:
    """`folder/encoder.yaml`: the embedded default's first model (the encoder) alone.

    For tests of the serving machinery that push unusual batch settings through the real
    encoder: the embedded LLM would spend minutes warming up at such shapes on a CPU.
    """
    embedded = yaml.safe_load(EMBEDDED_MODELS_FILE.read_text(encoding="utf-8"))
    encoder = embedded["models"][0]
    for adapter in encoder["adapters"]:
        adapter["path"] = str(EMBEDDED_MODELS_FILE.parent / adapter["path"])
    return write_models_file(folder / "encoder.yaml", [encoder])


# The model code of `faulty_bert`: a real BERT classifier whose forward fails as a CUDA
# kernel's device-side assert does, for one input only (a CPU cannot fail so).
FAULTY_MODELING = '''
"""A BERT classifier that fails like a CUDA device-side assert on one input: for tests."""

import torch
from transformers import BertForSequenceClassification

TRIGGER_ID = {trigger_id}


def _triggered(input_ids: torch.Tensor) -> bool:
    """Three trigger tokens in a row (no warm-up or probe batch has any two)."""
    hits = (input_ids == TRIGGER_ID).int()
    return hits.shape[-1] >= 3 and bool((hits[..., :-2] * hits[..., 1:-1] * hits[..., 2:]).any())


class FaultyBertForSequenceClassification(BertForSequenceClassification):
    def forward(self, input_ids=None, **kwargs):
        if input_ids is not None and _triggered(input_ids):
            raise RuntimeError(
                "CUDA error: device-side assert triggered\\n"
                "CUDA kernel errors might be asynchronously reported at some other API call"
            )
        return super().forward(input_ids=input_ids, **kwargs)
'''


def faulty_bert(tiny: TinyModel, folder: Path, trigger_word: str) -> TinyModel:
    """A copy of the tiny BERT whose model code (trust_remote_code) raises a CUDA device
    assert for texts holding `trigger_word` three times in a row; its adapters as they are."""
    base = folder / "faulty-bert"
    shutil.copytree(tiny.base, base)
    trigger_id = PreTrainedTokenizerFast.from_pretrained(base).convert_tokens_to_ids(trigger_word)
    modeling = FAULTY_MODELING.replace("{trigger_id}", str(trigger_id))
    (base / "modeling_faulty.py").write_text(modeling, encoding="utf-8")
    config = json.loads((base / "config.json").read_text(encoding="utf-8"))
    config["auto_map"] = {
        "AutoModelForSequenceClassification": "modeling_faulty.FaultyBertForSequenceClassification"
    }
    (base / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return TinyModel(base=base, adapters=tiny.adapters)


# The costs of the tests' simulated device (`simulated:` in a models file).
SIMULATED = {"seconds_per_batch": 0.002, "seconds_per_token": 0.000001}


def simulated_entry(**extra: object) -> dict[str, object]:
    """A models-file entry for a simulated model `sim` (no weights), with `extra` fields."""
    return {
        "name": "sim",
        "simulated": dict(SIMULATED),
        "labels": ["ham", "spam"],
        "max_length": 128,
        **extra,
    }
