"""The users' two models for bench.gpu, in their exact shapes, with random weights built on the
device: EXAONE-3.5-2.4B-Instruct as the hub ships it (EXAONE layout, two shards and an index,
tied embeddings) with a rank-16 LoRA adapter trained on its module names, and
KoELECTRA-small-v3-discriminator with a LoRA adapter; and texts of an exact token count.

Shapes: EXAONE 3.5's technical report (arXiv 2412.04862, table 1) for the 2.4B model: d_model
2,560, 30 layers, feed-forward 7,168, 32 heads and 8 KV heads of 80, vocabulary 102,400,
tied word embeddings, 32,768 positions, RoPE theta 1,000,000 (llama3 scaling, as its
config.json says); KoELECTRA-small-v3-discriminator's config.json: embeddings 128, hidden
256, 12 layers, 4 heads, intermediate 1,024, vocabulary 35,000, 512 positions. Random
weights cost what trained ones cost: nothing here depends on their values but the answers,
which this benchmark does not judge.

The tokenizers are word-level over made-up words (the real ones are not on this machine):
a text of n words is n tokens for EXAONE, n + 2 for KoELECTRA ([CLS], [SEP]), and `texts`
checks each count by tokenizing.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

LABELS = ["ham", "spam"]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "</s>"]
PAD, UNK, CLS, SEP, BOS, EOS = 0, 1, 2, 3, 5, 6
VOCAB_WORDS = 2000
EXAONE_ATTENTION = ("q_proj", "k_proj", "v_proj", "out_proj")


@dataclass(frozen=True)
class Shapes:
    """The geometry of both models, and the LoRA ranks."""

    exaone: dict[str, Any]
    koelectra: dict[str, Any]
    exaone_lora_rank: int = 16
    koelectra_lora_rank: int = 8

    @property
    def exaone_parameters(self) -> int:
        """Parameters of the EXAONE base (embeddings tied: counted once)."""
        e = self.exaone
        hidden, heads, kv, head, inner = (
            e["hidden_size"],
            e["num_attention_heads"],
            e["num_key_value_heads"],
            e["head_dim"],
            e["intermediate_size"],
        )
        attention = hidden * head * (2 * heads + 2 * kv)
        block = attention + 3 * hidden * inner + 2 * hidden
        return int(e["vocab_size"] * hidden + e["num_layers"] * block + hidden)


EXAONE_3_5_2_4B: dict[str, Any] = {
    "hidden_size": 2560,
    "num_layers": 30,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 80,
    "intermediate_size": 7168,
    "vocab_size": 102400,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
}
KOELECTRA_SMALL_V3: dict[str, Any] = {
    "vocab_size": 35000,
    "embedding_size": 128,
    "hidden_size": 256,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "intermediate_size": 1024,
    "max_position_embeddings": 512,
}
USERS = Shapes(EXAONE_3_5_2_4B, KOELECTRA_SMALL_V3)
# --smoke: the same code on a few thousand parameters, room for 512-token texts kept.
TINY = Shapes(
    {
        **EXAONE_3_5_2_4B,
        "hidden_size": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "vocab_size": 4096,
    },
    {
        **KOELECTRA_SMALL_V3,
        "vocab_size": 4096,
        "embedding_size": 32,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
    },
    exaone_lora_rank=4,
    koelectra_lora_rank=4,
)


@dataclass(frozen=True)
class BuiltModels:
    """Folders of both bases and their adapters."""

    exaone: Path
    exaone_adapter: Path
    koelectra: Path
    koelectra_adapter: Path


def build_all(root: Path, shapes: Shapes, device: torch.device, seed: int = 0) -> BuiltModels:
    """Both models and both adapters under `root` (replacing what is there)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    built = BuiltModels(
        root / "exaone-3.5-2.4b", root / "exaone-spam", root / "koelectra", root / "koelectra-spam"
    )
    build_exaone(built.exaone, shapes.exaone, device, generator)
    build_exaone_lora(built.exaone_adapter, shapes, device, generator)
    build_koelectra(built.koelectra, built.koelectra_adapter, shapes, seed)
    return built


def write_tokenizer(folder: Path, encoder: bool) -> None:
    """A word-level tokenizer over SPECIALS and VOCAB_WORDS words ("w0", "w1", ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS)}
    vocab |= {f"w{n}": len(SPECIALS) + n for n in range(VOCAB_WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    names: dict[str, str] = {"unk_token": "[UNK]", "pad_token": "[PAD]"}
    if encoder:
        core.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)]
        )
        names |= {"cls_token": "[CLS]", "sep_token": "[SEP]", "mask_token": "[MASK]"}
    else:
        names |= {"bos_token": "<s>", "eos_token": "</s>"}
    PreTrainedTokenizerFast(tokenizer_object=core, **names).save_pretrained(folder)


def _random(
    shape: tuple[int, ...], std: float, device: torch.device, generator: torch.Generator
) -> torch.Tensor:
    """Drawn on the device (seconds for 2.4 B values on a GPU), handed back in bf16 on the CPU
    for safetensors."""
    values = torch.randn(shape, device=device, generator=generator, dtype=torch.float32) * std
    return values.to(torch.bfloat16).cpu()


def exaone_config(shape: dict[str, Any]) -> dict[str, Any]:
    """config.json as EXAONE 3.5 ships it: its own field names, its remote-code entries."""
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
        "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05,
        "model_type": "exaone",
        "pad_token_id": PAD,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        **shape,
    }


def build_exaone(
    folder: Path, shape: dict[str, Any], device: torch.device, generator: torch.Generator
) -> None:
    """The EXAONE-layout checkpoint: config, tokenizer, two shards and their index."""
    folder.mkdir(parents=True, exist_ok=True)
    write_tokenizer(folder, encoder=False)
    (folder / "config.json").write_text(json.dumps(exaone_config(shape), indent=2))
    hidden, inner = shape["hidden_size"], shape["intermediate_size"]
    heads, kv, head = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    layers = shape["num_layers"]
    ones = torch.ones(hidden, dtype=torch.bfloat16)
    shards = [range(0, layers // 2), range(layers // 2, layers)]
    weight_map: dict[str, str] = {}
    for number, blocks in enumerate(shards, start=1):
        tensors: dict[str, torch.Tensor] = {}
        if number == 1:
            tensors["transformer.wte.weight"] = _random(
                (shape["vocab_size"], hidden), 0.02, device, generator
            )
        for layer in blocks:
            block = f"transformer.h.{layer}"
            attention = f"{block}.attn.attention"
            tensors |= {
                f"{block}.ln_1.weight": ones.clone(),
                f"{attention}.q_proj.weight": _random(
                    (heads * head, hidden), 0.02, device, generator
                ),
                f"{attention}.k_proj.weight": _random((kv * head, hidden), 0.02, device, generator),
                f"{attention}.v_proj.weight": _random((kv * head, hidden), 0.02, device, generator),
                f"{attention}.out_proj.weight": _random(
                    (hidden, heads * head), 0.02, device, generator
                ),
                f"{block}.ln_2.weight": ones.clone(),
                f"{block}.mlp.c_fc_0.weight": _random((inner, hidden), 0.02, device, generator),
                f"{block}.mlp.c_fc_1.weight": _random((inner, hidden), 0.02, device, generator),
                f"{block}.mlp.c_proj.weight": _random((hidden, inner), 0.02, device, generator),
            }
        if number == len(shards):
            tensors["transformer.ln_f.weight"] = ones.clone()
        name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def build_exaone_lora(
    folder: Path, shapes: Shapes, device: torch.device, generator: torch.Generator
) -> None:
    """A sequence-classification LoRA on EXAONE's attention in every block, saved as peft
    saves one trained on EXAONE (its module names), its `score` head in modules_to_save."""
    from peft import LoraConfig, TaskType

    shape, rank = shapes.exaone, shapes.exaone_lora_rank
    hidden, heads, kv, head = (
        shape["hidden_size"],
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["head_dim"],
    )
    dims = {
        "q_proj": (heads * head, hidden),
        "k_proj": (kv * head, hidden),
        "v_proj": (kv * head, hidden),
        "out_proj": (hidden, heads * head),
    }
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(shape["num_layers"]):
        for name, (rows, columns) in dims.items():
            key = f"base_model.model.transformer.h.{layer}.attn.attention.{name}"
            lora_a = _random((rank, columns), columns**-0.5, device, generator).float()
            tensors[f"{key}.lora_A.weight"] = lora_a
            tensors[f"{key}.lora_B.weight"] = _random((rows, rank), 0.01, device, generator).float()
    tensors["base_model.model.score.weight"] = _random(
        (len(LABELS), hidden), hidden**-0.5, device, generator
    ).float()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(EXAONE_ATTENTION),
        modules_to_save=["score"],
    )
    config.save_pretrained(str(folder))


def build_koelectra(base: Path, adapter: Path, shapes: Shapes, seed: int) -> None:
    """The discriminator checkpoint (no classification head, as the hub's), built from its
    config with random weights, and a LoRA adapter on query/value with the head."""
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import ElectraConfig, ElectraForPreTraining, ElectraForSequenceClassification

    torch.manual_seed(seed)
    config = ElectraConfig(**shapes.koelectra, pad_token_id=PAD)
    ElectraForPreTraining(config).save_pretrained(base, safe_serialization=True)
    write_tokenizer(base, encoder=True)
    labelled = ElectraForSequenceClassification.from_pretrained(
        base, num_labels=len(LABELS), id2label=dict(enumerate(LABELS))
    )
    lora = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=shapes.koelectra_lora_rank,
        lora_alpha=2 * shapes.koelectra_lora_rank,
        target_modules=["query", "value"],
        init_lora_weights=False,
    )
    get_peft_model(labelled, lora).save_pretrained(str(adapter), safe_serialization=True)


def texts(folder: Path, tokens: int, count: int, seed: int) -> list[str]:
    """`count` distinct texts that the tokenizer in `folder` makes exactly `tokens` tokens."""
    from transformers import PreTrainedTokenizerFast

    # Not AutoTokenizer: it reads EXAONE's config.json, which names remote code.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    specials = len(tokenizer("w0")["input_ids"]) - 1
    rng = random.Random(seed)
    made = [
        " ".join(f"w{rng.randrange(VOCAB_WORDS)}" for _ in range(tokens - specials))
        for _ in range(count)
    ]
    lengths = {len(ids) for ids in tokenizer(made)["input_ids"]}
    if lengths != {tokens}:
        raise RuntimeError(f"texts meant to be {tokens} tokens came out {sorted(lengths)}")
    return made
