"""EXAONE 3.5 served without its remote code: converted once into the Llama layout.

The fixture writes a tiny EXAONE-3.5-layout checkpoint with no EXAONE (or Llama) code at
all: a config.json with EXAONE's field names, safetensors shards with EXAONE's tensor names
and random values, GQA, llama3 rope scaling, tied embeddings; and two LoRA adapters named
the EXAONE way, each with its `score` head. `exaone_hidden` below is an independent forward
written from EXAONE's modelling code in plain torch (float64). The served logits must match
it: a wrong name, gate and up swapped, a lost rope scaling or epsilon, untied embeddings or
a LoRA delta on the wrong module all move them far beyond the tolerance (the
`test_the_reference_catches_...` tests break one mapping at a time and show it).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import bitsandbytes.functional as bnb_functional
import pytest
import torch
from fastapi.testclient import TestClient
from peft import LoraConfig, TaskType
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from api.http.app import create_app
from api.models.checkpoint import sha256_of
from api.models.convert import exaone as exaone_module
from api.models.convert import exaone_adapter as exaone_adapter_module
from api.models.convert import staging as staging_module
from api.models.convert.exaone import CACHE_FOLDER, MANIFEST, convert_exaone
from api.models.loader import LoadError, load_model
from api.models.predictor import Predictor
from api.models.spec import ModelSpec
from api.settings import Settings
from bench.gpu_models import exaone_config as shipped_exaone_config
from tests.support.in_process import make_settings
from tests.support.tiny_models import LABELS, build_tokenizer

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
PAD, BOS, EOS = 0, 5, 6  # "[PAD]", "<s>", "</s>" in tests.support.tiny_models' vocabulary
TEXTS = [
    "win a free prize now call txt claim cash",
    "ok",
    "are we still meeting for lunch tomorrow",
]
ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")
MLP = ("c_fc_0", "c_fc_1", "c_proj")
# Quantized serving is compared with the reference run on the weights rounded the way
# bitsandbytes stores them (`rounded_like`): its distance to that must stay below this
# fraction of the distance rounding alone puts between the rounded and the exact reference.
# Measured on this model (spam, promo): rounding alone moves the logits by 0.21, 0.098
# (int8) and 1.61, 1.01 (nf4: 16 levels per block of 64 on a tiny random model); served
# int8 stays within 0.11, 0.044 of its rounded reference (LLM.int8 rounds the activations
# to 8 bits as well, which the rounded reference does not): 0.52 and 0.45 of the move;
# served nf4 within 0.062, 0.029 (the CPU 4-bit kernel's arithmetic): 0.039 and 0.028.
ROUNDING_SHARE = {"int8": 1.0, "nf4": 0.1}


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
    """A config.json as EXAONE 3.5's reads (its own field names, its remote-code entries),
    in the tiny shape, with an epsilon and token ids of its own."""
    return shipped_exaone_config(
        {
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "pad_token_id": PAD,
            "head_dim": HEAD_DIM,
            "hidden_size": HIDDEN,
            "intermediate_size": INNER,
            "layer_norm_epsilon": EPS,
            "max_position_embeddings": 128,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "num_layers": LAYERS,
            "rope_scaling": ROPE,
            "rope_theta": THETA,
            "torch_dtype": "float32",
            "transformers_version": "4.43.0",
            "vocab_size": vocab_size,
        }
    )


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


# --- serving -----------------------------------------------------------------------------


def spec_of(exaone: TinyExaone, base: Path | None = None, **fields: Any) -> ModelSpec:
    adapters = [
        {"name": name, "path": lora.folder, **fields.pop(f"{name}_fields", {})}
        for name, lora in exaone.adapters.items()
    ]
    values = {
        "name": "exaone",
        "base": str(base or exaone.base),
        "labels": LABELS,
        "max_length": 32,
        "trust_remote_code": False,
        "adapters": adapters,
        **fields,
    }
    return ModelSpec.model_validate(values)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(model_cache_dir=tmp_path / "cache", max_batch_size=4)


@contextmanager
def served(settings: Settings, spec: ModelSpec) -> Iterator[TestClient]:
    with TestClient(create_app(settings, [spec])) as client:
        deadline = time.monotonic() + 120
        while (ready := client.get("/ready")).status_code != 200:
            assert ready.json()["status"] != "failed", ready.json()
            assert time.monotonic() < deadline, ready.json()
            time.sleep(0.05)
        yield client


def raw_scores(client: TestClient, adapter: str) -> torch.Tensor:
    body = {"inputs": TEXTS, "adapter": adapter, "raw_scores": True}
    response = client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    rows = [{item["label"]: item["score"] for item in row} for row in response.json()]
    return torch.tensor([[row[label] for label in LABELS] for row in rows], dtype=torch.float64)


def test_served_logits_are_the_exaone_forward(exaone: TinyExaone, settings: Settings) -> None:
    with served(settings, spec_of(exaone)) as client:
        (info,) = client.get("/models").json()["models"]
        assert info["architecture"] == "LlamaForSequenceClassification"
        assert info["adapter_mode"] == "unmerged" and info["quantization"] == "none"
        for adapter in ("spam", "promo"):
            got, want = raw_scores(client, adapter), reference_scores(exaone, adapter)
            # float32 against float64: 1e-4 leaves room for rounding only.
            assert (got - want).abs().max() < 1e-4, (adapter, got, want)
        assert not torch.allclose(raw_scores(client, "spam"), raw_scores(client, "promo"))


def rounded_like(weights: dict[str, torch.Tensor], quantization: str) -> dict[str, torch.Tensor]:
    """The reference's weights as bitsandbytes stores the Linear layers' (embedding and norms
    stay): LLM.int8 rounds each row to 127 steps of its largest value; nf4 uses bitsandbytes'
    own blockwise quantizer, with double quantization as the loader asks for it."""

    def rounded(weight: torch.Tensor) -> torch.Tensor:
        if quantization == "int8":
            step = weight.abs().amax(dim=1, keepdim=True) / 127
            return (weight / step).round() * step
        packed, state = bnb_functional.quantize_4bit(
            weight.contiguous(), blocksize=64, quant_type="nf4", compress_statistics=True
        )
        return bnb_functional.dequantize_4bit(packed, state).float()

    linear = [name for name, weight in weights.items() if weight.dim() == 2 and "wte" not in name]
    return {**weights, **{name: rounded(weights[name]) for name in linear}}


@pytest.mark.parametrize("quantization", sorted(ROUNDING_SHARE))
def test_served_quantized_is_the_exaone_forward_of_rounded_weights(
    exaone: TinyExaone, settings: Settings, quantization: str
) -> None:
    rounded = TinyExaone(
        exaone.base, rounded_like(exaone.weights, quantization), exaone.config, exaone.adapters
    )
    with served(settings, spec_of(exaone, quantization=quantization)) as client:
        (info,) = client.get("/models").json()["models"]
        assert info["quantization"] == quantization
        for adapter in ("spam", "promo"):
            got = raw_scores(client, adapter)
            exact, near = reference_scores(exaone, adapter), reference_scores(rounded, adapter)
            rounding = (near - exact).abs().max()
            assert (got - near).abs().max() < ROUNDING_SHARE[quantization] * rounding, (
                adapter,
                got,
                near,
                exact,
            )


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


def test_the_reference_catches_a_lora_delta_on_the_wrong_module(
    exaone: TinyExaone, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The spam adapter's q_proj and out_proj tensors (the same shapes here) trade places."""
    right = exaone_adapter_module.llama_adapter_tensors

    def swapped(tensors: dict[str, Any], path: Path) -> dict[str, Any]:
        names = {"self_attn.q_proj": "self_attn.o_proj", "self_attn.o_proj": "self_attn.q_proj"}
        renamed = {}
        for key, tensor in right(tensors, path).items():
            for name, other in names.items():
                if name in key:
                    key = key.replace(name, other)
                    break
            renamed[key] = tensor
        return renamed

    monkeypatch.setattr(exaone_adapter_module, "llama_adapter_tensors", swapped)
    spec = spec_of(exaone)
    spec = spec.model_copy(update={"adapters": spec.adapters[:1]})
    predictor = Predictor(load_model(spec, settings))
    got = torch.tensor([s.logits for s in predictor.predict(TEXTS, "spam")], dtype=torch.float64)

    assert (got - reference_scores(exaone, "spam")).abs().max() > 1e-2


def test_a_second_start_reads_the_converted_folders(
    exaone: TinyExaone, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="api.models.convert")
    first = load_model(spec_of(exaone), settings)
    converting = [r for r in caplog.records if r.getMessage().startswith("converting EXAONE")]
    assert len(converting) == 3  # the base and both adapters
    files = [first.folder / "model-00001-of-00002.safetensors"]
    files += sorted(
        (settings.model_cache_folder / CACHE_FOLDER / "adapters").glob("*/*.safetensors")
    )
    assert len(files) == 3
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files]
    caplog.clear()

    second = load_model(spec_of(exaone), settings)
    assert second.folder == first.folder
    assert not [r for r in caplog.records if r.getMessage().startswith("converting EXAONE")]
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in files] == before
    assert second.base_fingerprint == first.base_fingerprint
    assert second.adapter_digests == first.adapter_digests
    # Nothing but finished folders: no staging folder left behind.
    assert all(
        (p / MANIFEST).is_file() for p in first.folder.parent.iterdir() if p.name != "adapters"
    )


def test_a_changed_source_converts_into_a_new_folder(
    exaone: TinyExaone, settings: Settings, tmp_path: Path
) -> None:
    first = load_model(spec_of(exaone), settings).folder
    changed = tmp_path / "changed"
    shutil.copytree(exaone.base, changed)
    for shard in changed.glob("*.safetensors"):
        shard.unlink()
    (changed / "model.safetensors.index.json").unlink()
    weights = dict(exaone.weights)
    weights["transformer.ln_f.weight"] = weights["transformer.ln_f.weight"] * 2
    save_file(weights, changed / "model.safetensors", metadata={"format": "pt"})

    second = load_model(spec_of(exaone, base=changed), settings).folder
    assert second != first and second.parent == first.parent
    assert (first / MANIFEST).is_file() and (second / "model.safetensors").is_file()
    manifest = json.loads((second / MANIFEST).read_text(encoding="utf-8"))
    assert manifest["source_sha256"]["model.safetensors"] == sha256_of(
        changed / "model.safetensors"
    )


def test_a_hub_cache_snapshot_converts_from_its_links(exaone: TinyExaone, tmp_path: Path) -> None:
    """As HF_HOME holds a hub download: snapshot files are links to blobs named by sha256."""
    repo = tmp_path / "hf" / "hub" / "models--LGAI-EXAONE--tiny-exaone"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for source in exaone.base.iterdir():
        blob = repo / "blobs" / sha256_of(source)
        shutil.copyfile(source, blob)
        (snapshot / source.name).symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit, encoding="utf-8")
    settings = make_settings(hf_home=tmp_path / "hf", offline=True, model_cache_dir=tmp_path / "c")

    spec = spec_of(exaone).model_copy(update={"base": "LGAI-EXAONE/tiny-exaone"})
    loaded = load_model(spec, settings)
    assert loaded.revision == commit and loaded.folder.parent.name == CACHE_FOLDER
    assert not any(path.is_symlink() for path in loaded.folder.iterdir())  # copies, not links
    manifest = json.loads((loaded.folder / MANIFEST).read_text(encoding="utf-8"))
    # Every file of the snapshot was read: config, index, tokenizer, shards.
    assert manifest["source_sha256"] == {p.name: sha256_of(p) for p in exaone.base.iterdir()}


def test_adapter_pins_name_the_original_files(exaone: TinyExaone, settings: Settings) -> None:
    original = exaone.adapters["spam"].folder / "adapter_model.safetensors"
    pin = sha256_of(original)
    loaded = load_model(spec_of(exaone, spam_fields={"sha256": pin}), settings)
    converted_digest = loaded.adapter_digests["spam"].weights  # what loaded: the renamed copy
    assert converted_digest != pin

    with pytest.raises(LoadError) as caught:
        load_model(spec_of(exaone, spam_fields={"sha256": converted_digest}), settings)
    assert caught.value.model == "exaone" and caught.value.path == str(original)
    assert "does not match pinned" in caught.value.reason


# --- refusals ----------------------------------------------------------------------------


def copy_of(exaone: TinyExaone, folder: Path) -> Path:
    shutil.copytree(exaone.base, folder)
    return folder


def test_a_truncated_shard_is_refused_naming_it(
    exaone: TinyExaone, settings: Settings, tmp_path: Path
) -> None:
    base = copy_of(exaone, tmp_path / "base")
    shard = base / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])

    with pytest.raises(LoadError) as caught:
        load_model(spec_of(exaone, base=base), settings)
    assert caught.value.model == "exaone" and caught.value.path == str(shard)
    assert "truncated" in caught.value.reason
    assert not (settings.model_cache_folder / CACHE_FOLDER).exists()


def test_a_failed_conversion_leaves_no_folder(
    exaone: TinyExaone, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(folder: Path) -> None:
        assert (folder / "config.json").is_file()  # all written, not yet renamed into place
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(staging_module, "_sync_tree", disk_full)
    with pytest.raises(LoadError) as caught:
        load_model(spec_of(exaone), settings)
    assert "No space left on device" in caught.value.reason
    assert list((settings.model_cache_folder / CACHE_FOLDER).iterdir()) == []


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"logit_scale": 0.5}, "unknown EXAONE config field(s) ['logit_scale']"),
        ({"attention_bias": True}, "attention_bias=True is not converted"),
        ({"activation_function": "gelu"}, "activation_function 'gelu' is not silu"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not converted"),
        ({"rope_scaling": {**ROPE, "beta_fast": 32}}, "unknown ['beta_fast']"),
        ({"num_key_value_heads": HEADS}, "has shape [32, 64], the config says [64, 64]"),
    ],
)
def test_a_config_the_conversion_cannot_honour_is_refused(
    exaone: TinyExaone,
    settings: Settings,
    tmp_path: Path,
    change: dict[str, Any],
    fragment: str,
) -> None:
    base = copy_of(exaone, tmp_path / "base")
    config = {**exaone.config, **change}
    (base / "config.json").write_text(json.dumps(config), encoding="utf-8")

    with pytest.raises(LoadError) as caught:
        load_model(spec_of(exaone, base=base), settings)
    assert caught.value.model == "exaone"
    assert fragment in caught.value.reason, caught.value.reason
    assert caught.value.path.startswith(str(base))
    assert not (settings.model_cache_folder / CACHE_FOLDER).exists()  # refused before writing


def test_an_unknown_tensor_is_refused_naming_its_shard(
    exaone: TinyExaone, settings: Settings, tmp_path: Path
) -> None:
    base = copy_of(exaone, tmp_path / "base")
    shard = base / "model-00001-of-00002.safetensors"
    tensors = load_file(shard)
    tensors["transformer.h.0.attn.attention.q_proj.bias"] = torch.zeros(HEADS * HEAD_DIM)
    save_file(tensors, shard, metadata={"format": "pt"})

    with pytest.raises(LoadError) as caught:
        load_model(spec_of(exaone, base=base), settings)
    assert caught.value.path == str(shard)
    assert "unexpected tensor 'transformer.h.0.attn.attention.q_proj.bias'" in caught.value.reason


def test_an_adapter_targeting_by_regular_expression_is_refused(
    exaone: TinyExaone, settings: Settings, tmp_path: Path
) -> None:
    folder = tmp_path / "regex"
    shutil.copytree(exaone.adapters["spam"].folder, folder)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["target_modules"] = r".*attn\.attention\.(q|v)_proj"
    config_path.write_text(json.dumps(config), encoding="utf-8")
    spec = spec_of(exaone).model_copy(
        update={"adapters": [spec_of(exaone).adapters[0].model_copy(update={"path": folder})]}
    )

    with pytest.raises(LoadError) as caught:
        load_model(spec, settings)
    assert caught.value.path == str(config_path)
    assert "regular expression" in caught.value.reason
