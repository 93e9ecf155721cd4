"""EXAONE 3.5 without its remote code: converted once into the Llama layout.

The fixture writes a tiny EXAONE-3.5-layout checkpoint with no EXAONE (or Llama) code at
all: a config.json with EXAONE's field names, safetensors shards with EXAONE's tensor names
and random values, GQA, llama3 rope scaling, tied embeddings; and two LoRA adapters named
the EXAONE way, each with its `score` head. `exaone_hidden` below is an independent forward
written from EXAONE's modelling code in plain torch (float64). The converted model's logits
must match it: a wrong name, gate and up swapped, a lost rope scaling or epsilon or untied
embeddings all move them far beyond the tolerance (`test_the_reference_catches_a_wrong_mapping`
breaks one mapping at a time and shows it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, TaskType
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from api.models.convert import exaone as exaone_module
from api.models.convert.exaone import CACHE_FOLDER, convert_exaone
from tests.tiny_models import build_tokenizer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INNER, LAYERS = 64, 4, 2, 16, 128, 2
THETA, EPS = 10000.0, 1e-2  # an epsilon far from Llama's default, so losing it shows
# Wavelengths of the 8 rotary pairs run from 6 to 20,000 positions: with an original
# context of 64, pairs fall in all three llama3 bands (kept, smoothed, divided by factor).
ROPE = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 64,
    "rope_type": "llama3",
}
PAD, BOS, EOS = 0, 5, 6  # "[PAD]", "<s>", "</s>" in tests.tiny_models' vocabulary
TEXTS = [
    "win a free prize now call txt claim cash",
    "ok",
    "are we still meeting for lunch tomorrow",
]
ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
MLP = ("c_fc_0", "c_fc_1", "c_proj")


@dataclass(frozen=True)
class Lora:
    """A LoRA adapter folder, its EXAONE-named config and tensors."""

    folder: Path
    r: int
    alpha: int
    targets: tuple[str, ...]
    layers: tuple[int, ...]
    tensors: dict[str, torch.Tensor]

    def delta(self, module: str) -> torch.Tensor | None:
        """(alpha / r) · B · A for an EXAONE module path, or None where LoRA is not."""
        key = f"base_model.model.{module}"
        if f"{key}.lora_A.weight" not in self.tensors:
            return None
        a, b = self.tensors[f"{key}.lora_A.weight"], self.tensors[f"{key}.lora_B.weight"]
        return (self.alpha / self.r) * b.double() @ a.double()

    @property
    def score(self) -> torch.Tensor:
        return self.tensors["base_model.model.score.weight"].double()


@dataclass(frozen=True)
class TinyExaone:
    """An EXAONE-layout base folder, its tensors and config, and two adapters."""

    base: Path
    weights: dict[str, torch.Tensor]
    config: dict[str, Any]
    adapters: dict[str, Lora]


def exaone_config(vocab_size: int) -> dict[str, Any]:
    """A config.json as EXAONE 3.5's reads: its own field names, its remote-code entries."""
    return {
        "activation_function": "silu",
        "architectures": ["ExaoneForCausalLM"],
        "attention_dropout": 0.0,
        "auto_map": {
            "AutoConfig": "configuration_exaone.ExaoneConfig",
            "AutoModelForCausalLM": "modeling_exaone.ExaoneForCausalLM",
            "AutoModelForSequenceClassification": "modeling_exaone.ExaoneForSequenceClassification",
        },
        "bos_token_id": BOS,
        "embed_dropout": 0.0,
        "eos_token_id": EOS,
        "head_dim": HEAD_DIM,
        "hidden_size": HIDDEN,
        "initializer_range": 0.02,
        "intermediate_size": INNER,
        "layer_norm_epsilon": EPS,
        "max_position_embeddings": 128,
        "model_type": "exaone",
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_layers": LAYERS,
        "pad_token_id": PAD,
        "rope_scaling": ROPE,
        "rope_theta": THETA,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "transformers_version": "4.43.0",
        "use_cache": True,
        "vocab_size": vocab_size,
    }


def exaone_weights(vocab_size: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random EXAONE tensors, large enough that every one of them moves the logits."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * std

    weights = {
        "transformer.wte.weight": normal(vocab_size, HIDDEN, std=1.0),
        "transformer.ln_f.weight": 1.0 + normal(HIDDEN, std=0.3),
    }
    for layer in range(LAYERS):
        block = f"transformer.h.{layer}"
        weights |= {
            f"{block}.ln_1.weight": 1.0 + normal(HIDDEN, std=0.3),
            # Sharper than usual attention, so positions (hence RoPE) matter.
            f"{block}.attn.attention.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN, std=0.15),
            f"{block}.attn.attention.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.15),
            f"{block}.attn.attention.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN, std=0.15),
            f"{block}.attn.attention.out_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM, std=0.15),
            f"{block}.ln_2.weight": 1.0 + normal(HIDDEN, std=0.3),
            f"{block}.mlp.c_fc_0.weight": normal(INNER, HIDDEN, std=0.15),
            f"{block}.mlp.c_fc_1.weight": normal(INNER, HIDDEN, std=0.15),
            f"{block}.mlp.c_proj.weight": normal(HIDDEN, INNER, std=0.12),
        }
    return weights


def write_exaone(folder: Path, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> None:
    """The checkpoint as the hub ships EXAONE 3.5: two shards and their index, no lm_head
    (tied), the tokenizer with its [PAD]."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, decoder=True)
    tokenizer.pad_token = "[PAD]"
    tokenizer.save_pretrained(folder)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    first = {
        k: v for k, v in weights.items() if k.startswith(("transformer.wte", "transformer.h.0."))
    }
    shards = {
        "model-00001-of-00002.safetensors": first,
        "model-00002-of-00002.safetensors": {k: v for k, v in weights.items() if k not in first},
    }
    for name, tensors in shards.items():
        save_file(tensors, folder / name, metadata={"format": "pt"})
    index = {name: shard for shard, tensors in shards.items() for name in tensors}
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}), encoding="utf-8"
    )


def write_lora(
    folder: Path,
    targets: tuple[str, ...],
    layers: tuple[int, ...],
    r: int,
    seed: int,
    **config: Any,
) -> Lora:
    """A sequence-classification LoRA adapter saved as peft saves one trained on EXAONE."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {
        "q_proj": (HEADS * HEAD_DIM, HIDDEN),
        "k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
        "out_proj": (HIDDEN, HEADS * HEAD_DIM),
        "c_fc_0": (INNER, HIDDEN),
        "c_fc_1": (INNER, HIDDEN),
        "c_proj": (HIDDEN, INNER),
    }
    tensors = {}
    for layer in layers:
        for name in targets:
            parent = "attn.attention" if name in ATTENTION else "mlp"
            key = f"base_model.model.transformer.h.{layer}.{parent}.{name}"
            rows, columns = shapes[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, columns, generator=generator) / 8
            tensors[f"{key}.lora_B.weight"] = torch.randn(rows, r, generator=generator) / 4
    tensors["base_model.model.score.weight"] = torch.randn(2, HIDDEN, generator=generator) / 3
    folder.mkdir(parents=True)
    save_file(tensors, folder / "adapter_model.safetensors", metadata={"format": "pt"})
    lora = LoraConfig(
        task_type=TaskType.SEQ_CLS, r=r, lora_alpha=2 * r, target_modules=list(targets), **config
    )
    lora.save_pretrained(str(folder))
    return Lora(folder, r, 2 * r, targets, layers, tensors)


@pytest.fixture(scope="module")
def exaone(tmp_path_factory: pytest.TempPathFactory) -> TinyExaone:
    root = tmp_path_factory.mktemp("exaone")
    vocab_size = len(build_tokenizer(root / "vocab", decoder=True))
    config, weights = exaone_config(vocab_size), exaone_weights(vocab_size)
    write_exaone(root / "base", config, weights)
    adapters = {
        # Every module EXAONE has, in every block; the head saved as peft saves it.
        "spam": write_lora(
            root / "spam", ATTENTION + MLP, (0, 1), r=4, seed=1, modules_to_save=["score"]
        ),
        # Block 1 only, found through EXAONE's block list `h`; peft's automatic head names.
        "promo": write_lora(
            root / "promo",
            ("q_proj", "c_proj"),
            (1,),
            r=2,
            seed=2,
            layers_pattern="h",
            layers_to_transform=[1],
            modules_to_save=["classifier", "score"],
        ),
    }
    return TinyExaone(root / "base", weights, config, adapters)


# --- the reference: EXAONE 3.5's forward, from modeling_exaone.py, in plain torch ----------


def llama3_inv_freq() -> torch.Tensor:
    """RoPE frequencies with llama3 scaling (Meta's formula, which EXAONE 3.5 uses)."""
    base = 1.0 / THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    factor, low, high = ROPE["factor"], ROPE["low_freq_factor"], ROPE["high_freq_factor"]
    old = ROPE["original_max_position_embeddings"]
    scaled = []
    for frequency in base.tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < old / high:
            scaled.append(frequency)
        elif wavelength > old / low:
            scaled.append(frequency / factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            scaled.append((1 - smooth) * frequency / factor + smooth * frequency)
    return torch.tensor(scaled, dtype=torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """EXAONE's apply_rotary_pos_emb: halves, not interleaved pairs."""
    first, second = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2 :]
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def exaone_hidden(
    weights: dict[str, torch.Tensor], ids: list[int], lora: Lora | None = None
) -> torch.Tensor:
    """Final hidden states [tokens, hidden] of one unpadded text, in float64."""

    def linear(x: torch.Tensor, module: str) -> torch.Tensor:
        weight = weights[f"{module}.weight"].double()
        delta = lora.delta(module) if lora is not None else None
        return x @ (weight if delta is None else weight + delta).T

    length = len(ids)
    x = weights["transformer.wte.weight"].double()[ids]
    angles = torch.outer(torch.arange(length, dtype=torch.float64), llama3_inv_freq())
    cos = torch.cat((angles, angles), dim=-1).cos()[:, None, :]
    sin = torch.cat((angles, angles), dim=-1).sin()[:, None, :]
    future = torch.triu(torch.ones(length, length, dtype=torch.bool), diagonal=1)
    for layer in range(LAYERS):
        block = f"transformer.h.{layer}"
        h = rms_norm(x, weights[f"{block}.ln_1.weight"].double())
        attention = f"{block}.attn.attention"
        q = linear(h, f"{attention}.q_proj").view(length, HEADS, HEAD_DIM)
        k = linear(h, f"{attention}.k_proj").view(length, KV_HEADS, HEAD_DIM)
        v = linear(h, f"{attention}.v_proj").view(length, KV_HEADS, HEAD_DIM)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        # repeat_kv: query heads 2i and 2i+1 share key/value head i.
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HEAD_DIM)
        probabilities = scores.masked_fill(future, -math.inf).softmax(dim=-1)
        mixed = torch.einsum("hqk,khd->qhd", probabilities, v).reshape(length, HEADS * HEAD_DIM)
        x = x + linear(mixed, f"{attention}.out_proj")
        h = rms_norm(x, weights[f"{block}.ln_2.weight"].double())
        gated = torch.nn.functional.silu(linear(h, f"{block}.mlp.c_fc_0"))
        x = x + linear(gated * linear(h, f"{block}.mlp.c_fc_1"), f"{block}.mlp.c_proj")
    return rms_norm(x, weights["transformer.ln_f.weight"].double())


def reference_scores(exaone: TinyExaone, adapter: str) -> torch.Tensor:
    """ExaoneForSequenceClassification's logits: `score` at each text's last token."""
    # The tokenizer files alone: AutoTokenizer would read the config and its remote-code map.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(exaone.base)
    lora = exaone.adapters[adapter]
    rows = [
        exaone_hidden(exaone.weights, tokenizer(text)["input_ids"], lora)[-1] @ lora.score.T
        for text in TEXTS
    ]
    return torch.stack(rows)


def reference_lm_logits(exaone: TinyExaone, ids: list[int]) -> torch.Tensor:
    """ExaoneForCausalLM's logits: lm_head tied to wte."""
    hidden = exaone_hidden(exaone.weights, ids)
    return hidden @ exaone.weights["transformer.wte.weight"].double().T


# --- the conversion ----------------------------------------------------------------------


def converted_lm_logits(out: Path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, use_safetensors=True)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0].double()  # type: ignore[no-any-return]


def test_converted_folder_is_a_llama_with_exaone_numerics(
    exaone: TinyExaone, tmp_path: Path
) -> None:
    files = sorted(exaone.base.glob("*.safetensors"))
    out = convert_exaone(exaone.base, files, {}, tmp_path / "cache")

    assert out.parent == tmp_path / "cache" / CACHE_FOLDER
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert "auto_map" not in config  # nothing left that would run remote code
    assert config["rope_scaling"] == ROPE and config["rope_theta"] == THETA
    assert config["rms_norm_eps"] == EPS and config["num_hidden_layers"] == LAYERS
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        BOS,
        EOS,
        PAD,
    )
    assert config["tie_word_embeddings"] is True and config["head_dim"] == HEAD_DIM
    assert (out / "tokenizer.json").read_bytes() == (exaone.base / "tokenizer.json").read_bytes()
    index = json.loads((out / "model.safetensors.index.json").read_text(encoding="utf-8"))
    assert "model.layers.1.mlp.gate_proj.weight" in index["weight_map"]
    ids = AutoTokenizer.from_pretrained(out)(TEXTS[0])["input_ids"]
    difference = (converted_lm_logits(out, ids) - reference_lm_logits(exaone, ids)).abs().max()
    assert difference < 1e-4, difference


# Tensors renamed wrongly, or config fields mapped wrongly (None: left out, so that
# LlamaConfig's default applies).
MUTATIONS: dict[str, dict[str, Any]] = {
    "gate and up swapped": {"mlp.c_fc_0": "mlp.up_proj", "mlp.c_fc_1": "mlp.gate_proj"},
    "ln_1 and ln_2 swapped": {"ln_1": "post_attention_layernorm", "ln_2": "input_layernorm"},
    "rope scaling lost": {"rope_scaling": None},
    "epsilon lost": {"rms_norm_eps": None},
    "embeddings untied": {"tie_word_embeddings": False},
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_the_reference_catches_a_wrong_mapping(
    exaone: TinyExaone, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutation: str
) -> None:
    """Each mapping broken on purpose: the converted model no longer matches the reference,
    by far more than the 1e-4 the tests above allow."""
    change = MUTATIONS[mutation]
    if set(change) <= set(exaone_module.BLOCK_MODULES):
        for exaone_name, llama_name in change.items():
            monkeypatch.setitem(exaone_module.BLOCK_MODULES, exaone_name, llama_name)
    else:
        right = exaone_module.llama_config

        def wrong(source: dict[str, Any], path: Path) -> dict[str, Any]:
            config = {**right(source, path), **change}
            return {name: value for name, value in config.items() if value is not None}

        monkeypatch.setattr(exaone_module, "llama_config", wrong)
    files = sorted(exaone.base.glob("*.safetensors"))
    out = convert_exaone(exaone.base, files, {}, tmp_path / "cache")
    ids = AutoTokenizer.from_pretrained(out)(TEXTS[0])["input_ids"]

    difference = (converted_lm_logits(out, ids) - reference_lm_logits(exaone, ids)).abs().max()
    assert difference > 1e-2, difference
