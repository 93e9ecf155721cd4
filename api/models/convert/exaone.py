"""Converting an EXAONE 3.5 checkpoint, once, into the Llama layout transformers runs natively.

EXAONE 3.5 ships its own model code (`trust_remote_code`), but it computes what Llama does
under other names. What was checked in the public code, and what it means here:

- LG AI Research's `modeling_exaone.py` (the EXAONE 3.x remote code; read in the port to
  huggingface/transformers, src/transformers/models/exaone/modeling_exaone.py): blocks are
  pre-norm, `x + attn(ln_1(x))` then `x + mlp(ln_2(x))`; `ExaoneRMSNorm` is LlamaRMSNorm's
  formula (float32 `x * rsqrt(mean(x²) + eps)`, cast back, times the weight); the rotary
  tables come from transformers' `ROPE_INIT_FUNCTIONS` (so `llama3` scaling is Llama's very
  function) and are applied with `rotate_half`, Llama's half-split form, not GPT-J's
  interleaved one: q and k rows need no permutation; scores are scaled by 1/sqrt(head_dim)
  and k/v heads repeated for GQA; no Linear has a bias; the MLP is
  `c_proj(act(c_fc_0(x)) * c_fc_1(x))`, so c_fc_0 is gate_proj and c_fc_1 up_proj; the
  embedding is not scaled; `lm_head` is tied to `wte` when `tie_word_embeddings`;
  `ExaoneForSequenceClassification` has a bias-free `score` read at the last non-pad token.
  (It indexes "number of non-pad tokens - 1", Llama the rightmost non-pad token: the same
  position for the right-padded batches this service runs.)
- `configuration_exaone.py` (the same port, and the copy SGLang ships for 3.5): the field
  names (`num_layers`, `layer_norm_epsilon`, `activation_function`, `rope_scaling`...) and
  defaults, which differ from LlamaConfig's (eps 1e-5 not 1e-6, intermediate_size
  4 * hidden_size, tie_word_embeddings true, bos 0): every field is written out explicitly.
- vLLM's `models/exaone.py`: loads c_fc_0 then c_fc_1 as the two halves of `gate_up_proj`
  under `SiluAndMul` (gate first), neox-style (half-split) RoPE, `head_dim` honoured when
  the config gives it, silu only. llama.cpp's gguf tensor map (`c_fc_0` -> ffn_gate,
  `c_fc_1` -> ffn_up) and its converter (asserts silu), and mlx-lm's `exaone.py`, agree.

The converted folder lives under MODEL_CACHE_DIR/exaone-llama/<digest>, the digest taken
over the source files' sha256 digests, so a later start finds it and only reads it, and a
changed source converts into a new folder. Anything the conversion cannot map faithfully (an
unknown config field, a tensor it does not know, a shape that does not fit the config) is
refused rather than guessed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file

from api.models.checkpoint import CheckpointError, read_safetensors_header, sha256_of
from api.models.convert.staging import staged_folder
from api.models.digest_memo import DigestMemo

logger = logging.getLogger(__name__)

# Part of every digest: a converter that writes differently converts into new folders.
CONVERSION_VERSION = "1"
CACHE_FOLDER = "exaone-llama"
MANIFEST = "loraserve-conversion.json"
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE_WEIGHTS = "model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)
FLOAT_DTYPES = frozenset({"F32", "F16", "BF16"})

# EXAONE's module paths inside block N (transformer.h.N.*) and Llama's (model.layers.N.*).
BLOCK_MODULES = {
    "ln_1": "input_layernorm",
    "attn.attention.q_proj": "self_attn.q_proj",
    "attn.attention.k_proj": "self_attn.k_proj",
    "attn.attention.v_proj": "self_attn.v_proj",
    "attn.attention.out_proj": "self_attn.o_proj",
    "ln_2": "post_attention_layernorm",
    "mlp.c_fc_0": "mlp.gate_proj",  # act(c_fc_0(x)) * c_fc_1(x): the gate
    "mlp.c_fc_1": "mlp.up_proj",
    "mlp.c_proj": "mlp.down_proj",
}
TOP_MODULES = {
    "transformer.wte": "model.embed_tokens",
    "transformer.ln_f": "model.norm",
    "lm_head": "lm_head",
    "score": "score",
}
# Last path components, as LoRA's target_modules and modules_to_save name modules.
MODULE_NAMES = {
    **{path.rsplit(".", 1)[-1]: llama.rsplit(".", 1)[-1] for path, llama in BLOCK_MODULES.items()},
    "wte": "embed_tokens",
    "ln_f": "norm",
    "lm_head": "lm_head",
    "score": "score",
}
_BLOCK = re.compile(r"transformer\.h\.(\d+)\.(.+)")

# configuration_exaone.py's defaults, for fields a config.json leaves out (or sets null).
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 102400,
    "max_position_embeddings": 2048,
    "hidden_size": 2048,
    "num_layers": 32,
    "num_attention_heads": 32,
    "activation_function": "silu",
    "rope_theta": 10000.0,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
# Read into the Llama config below, with their EXAONE meaning.
_MAPPED = frozenset(
    {
        *_DEFAULTS,
        "num_key_value_heads",
        "intermediate_size",
        "head_dim",
        "rope_scaling",
        "tie_word_embeddings",
        "pad_token_id",
        "num_hidden_layers",  # some copies of the config class store num_layers twice
        "attention_dropout",
        "use_cache",
        "torch_dtype",
        "dtype",
        "id2label",
        "label2id",
        "num_labels",
        "problem_type",
    }
)
# No effect on an inference forward: bookkeeping, training-only dropout, generation defaults.
_NO_EFFECT = frozenset(
    {
        "architectures",
        "auto_map",
        "model_type",
        "transformers_version",
        "embed_dropout",
        "gradient_checkpointing",
        "return_dict",
        "output_hidden_states",
        "output_attentions",
        "use_bfloat16",
        "tokenizer_class",
        "finetuning_task",
        "max_length",
        "min_length",
        "do_sample",
        "num_beams",
        "temperature",
        "top_k",
        "top_p",
        "repetition_penalty",
    }
)
# Fields other EXAONE readers know, converted only at the value EXAONE 3.5 has.
_FIXED: dict[str, Any] = {
    "attention_bias": False,
    "mlp_bias": False,
    "bias": False,
    "partial_rotary_factor": 1.0,
    "rope_pct": 1.0,
}
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
_ARCHITECTURES = {
    "ExaoneForCausalLM": "LlamaForCausalLM",
    "ExaoneForSequenceClassification": "LlamaForSequenceClassification",
    "ExaoneModel": "LlamaModel",
}


class ExaoneError(Exception):
    """An EXAONE checkpoint (or adapter) that cannot be converted; names the file and why."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def is_exaone(folder: Path) -> bool:
    """Whether the folder's config.json says `model_type: exaone`."""
    try:
        config = json.loads((folder / CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # the loader's own reading of the config reports what is wrong
    return isinstance(config, dict) and config.get("model_type") == "exaone"


def llama_module(path: str) -> str | None:
    """An EXAONE module path (`transformer.h.3.mlp.c_fc_0`) as Llama's; None if unknown."""
    if path in TOP_MODULES:
        return TOP_MODULES[path]
    match = _BLOCK.fullmatch(path)
    if match is None or match.group(2) not in BLOCK_MODULES:
        return None
    return f"model.layers.{match.group(1)}.{BLOCK_MODULES[match.group(2)]}"


def llama_key(key: str) -> str | None:
    """A tensor name under an EXAONE module as Llama's: the module part renamed, what follows
    it (`weight`, `lora_A.weight`, ...) kept; None when no known module starts it."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = llama_module(".".join(parts[:end]))
        if module is not None:
            return ".".join([module, *parts[end:]])
    return None


def llama_config(source: dict[str, Any], path: Path) -> dict[str, Any]:
    """EXAONE's config.json as a LlamaConfig's, every field explicit; refuses what it cannot map."""
    known = _MAPPED | _NO_EFFECT | set(_FIXED)
    # "_name_or_path", "_attn_implementation_autoset"...: transformers' own bookkeeping.
    unknown = sorted(name for name in source if name not in known and not name.startswith("_"))
    if unknown:
        raise ExaoneError(
            path,
            f"unknown EXAONE config field(s) {unknown}: the conversion cannot tell whether "
            "they change the model's numerics, so it refuses rather than drop them",
        )
    for name, value in _FIXED.items():
        if name in source and source[name] != value:
            raise ExaoneError(path, f"{name}={source[name]!r} is not converted (only {value!r})")

    def get(name: str) -> Any:
        value = source.get(name)
        return _DEFAULTS[name] if value is None else value

    hidden = _positive(path, "hidden_size", get("hidden_size"))
    heads = _positive(path, "num_attention_heads", get("num_attention_heads"))
    layers = _positive(path, "num_layers", get("num_layers"))
    kv_heads = _positive(path, "num_key_value_heads", source.get("num_key_value_heads") or heads)
    # configuration_exaone.py: a falsy intermediate_size means 4 * hidden_size.
    inner = _positive(path, "intermediate_size", source.get("intermediate_size") or 4 * hidden)
    # The EXAONE code derives hidden_size // heads; vLLM and mlx-lm honour a given head_dim.
    # Either way the weights' shapes are checked against it before anything is written.
    head_dim = _positive(path, "head_dim", source.get("head_dim") or hidden // heads)
    if heads % kv_heads:
        raise ExaoneError(path, f"num_attention_heads {heads} is not a multiple of {kv_heads}")
    if source.get("num_hidden_layers", layers) != layers:
        raise ExaoneError(path, f"num_hidden_layers {source['num_hidden_layers']} != num_layers")
    if get("activation_function") != "silu":  # every public EXAONE implementation asserts it
        raise ExaoneError(path, f"activation_function {get('activation_function')!r} is not silu")

    architectures = source.get("architectures") or ["ExaoneForCausalLM"]
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES.get(name, "LlamaForCausalLM") for name in architectures],
        "model_type": "llama",
        "vocab_size": _positive(path, "vocab_size", get("vocab_size")),
        "hidden_size": hidden,
        "intermediate_size": inner,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": _positive(
            path, "max_position_embeddings", get("max_position_embeddings")
        ),
        "rms_norm_eps": get("layer_norm_epsilon"),
        "rope_theta": float(get("rope_theta")),
        # configuration_exaone.py defaults it to true (as PretrainedConfig did); Llama to false.
        "tie_word_embeddings": bool(source.get("tie_word_embeddings", True)),
        "bos_token_id": get("bos_token_id"),
        "eos_token_id": get("eos_token_id"),
        "pad_token_id": source.get("pad_token_id"),
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": source.get("attention_dropout") or 0.0,
        "initializer_range": get("initializer_range"),
        "pretraining_tp": 1,
        "use_cache": source.get("use_cache", True),
    }
    rope_scaling = _rope_scaling(source.get("rope_scaling"), path)
    if rope_scaling is not None:
        # Written the long-standing way (rope_theta + rope_scaling), which transformers 4
        # reads as is and transformers 5 folds into its rope_parameters.
        config["rope_scaling"] = rope_scaling
    for name in ("torch_dtype", "dtype", "id2label", "label2id", "num_labels", "problem_type"):
        if source.get(name) is not None:
            config[name] = source[name]
    return config


def _positive(path: Path, name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ExaoneError(path, f"{name} must be a positive integer, not {value!r}")
    return value


def _rope_scaling(value: Any, path: Path) -> dict[str, Any] | None:
    """EXAONE 3.5's llama3 rope scaling (or none) as Llama's; other kinds are refused."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ExaoneError(path, f"rope_scaling must be an object, not {value!r}")
    kind = value.get("rope_type", value.get("type"))
    if "type" in value and value.get("type") != kind:
        raise ExaoneError(path, f"rope_scaling says both {kind!r} and {value['type']!r}")
    if kind == "default" and set(value) <= {"rope_type", "type"}:
        return None
    if kind != "llama3":
        raise ExaoneError(path, f"rope_scaling type {kind!r} is not converted (only llama3)")
    unknown = sorted(set(value) - set(_LLAMA3_ROPE) - {"rope_type", "type"})
    missing = [name for name in _LLAMA3_ROPE if not isinstance(value.get(name), int | float)]
    if unknown or missing:
        # transformers' llama3 init (which EXAONE's code calls) reads exactly these four.
        raise ExaoneError(path, f"llama3 rope_scaling: unknown {unknown}, missing {missing}")
    return {"rope_type": "llama3", **{name: value[name] for name in _LLAMA3_ROPE}}


def expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor an EXAONE checkpoint of this config must hold, by EXAONE name."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    block = {
        "ln_1": (hidden,),
        "attn.attention.q_proj": (q_rows, hidden),
        "attn.attention.k_proj": (kv_rows, hidden),
        "attn.attention.v_proj": (kv_rows, hidden),
        "attn.attention.out_proj": (hidden, q_rows),
        "ln_2": (hidden,),
        "mlp.c_fc_0": (inner, hidden),
        "mlp.c_fc_1": (inner, hidden),
        "mlp.c_proj": (hidden, inner),
    }
    shapes = {
        f"transformer.h.{layer}.{module}.weight": shape
        for layer in range(config["num_hidden_layers"])
        for module, shape in block.items()
    }
    shapes["transformer.wte.weight"] = (config["vocab_size"], hidden)
    shapes["transformer.ln_f.weight"] = (hidden,)
    return shapes


def source_weight_files(folder: Path, files: list[Path]) -> list[Path]:
    """The safetensors files holding the checkpoint: the one file, or the index's shards."""
    if any(path.suffix != ".safetensors" for path in files):
        raise ExaoneError(folder, "EXAONE checkpoints are converted from safetensors weights only")
    index = folder / INDEX
    if not index.is_file():
        if len(files) != 1:
            raise ExaoneError(folder, f"{len(files)} safetensors files and no {INDEX}")
        return files
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        shards = sorted({folder / str(name) for name in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ExaoneError(index, f"unreadable index: {exc}") from None
    absent = [shard.name for shard in shards if shard not in files]
    if absent:
        raise ExaoneError(index, f"names shards that are not there: {absent}")
    return shards


def check_weights(config: dict[str, Any], files: list[Path]) -> None:
    """Refuses a checkpoint whose tensors are not exactly those of the config, in float."""
    expected = expected_shapes(config)
    found: dict[str, Path] = {}
    for path in files:
        try:
            header = json.loads(read_safetensors_header(path))
        except CheckpointError as exc:
            raise ExaoneError(exc.path, exc.reason) from None
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            found[name] = path
            shape, dtype = tuple(entry.get("shape", ())), entry.get("dtype")
            if name in ("lm_head.weight", "score.weight"):
                rows = config["vocab_size"] if name == "lm_head.weight" else shape[0]
                want: tuple[int, ...] | None = (rows, config["hidden_size"])
            else:
                want = expected.get(name)
            if want is None:
                raise ExaoneError(path, f"unexpected tensor {name!r}: no Llama counterpart")
            if shape != want:
                reason = f"tensor {name!r} has shape {list(shape)}, the config says {list(want)}"
                raise ExaoneError(path, reason)
            if dtype not in FLOAT_DTYPES:
                raise ExaoneError(path, f"tensor {name!r} is {dtype}, not a float: not converted")
    missing = sorted(set(expected) - set(found))
    if missing:
        where = files[0] if len(files) == 1 else files[0].parent / INDEX
        raise ExaoneError(where, f"{len(missing)} tensors missing, e.g. {missing[:3]}")


def source_digests(
    folder: Path, files: list[Path], pinned: dict[str, str], memo: DigestMemo
) -> dict[str, str]:
    """sha256 of every file the conversion reads (config, index, tokenizer, weights)."""
    names = [CONFIG, INDEX, *TOKENIZER_FILES]
    small = [folder / name for name in names if (folder / name).is_file()]
    digests = {path.name: sha256_of(path) for path in small}
    for path in files:
        # A pinned digest was checked by the loader just before; a hub cache names each large
        # blob by its sha256; else the file is read, unless unchanged since it last was.
        digests[path.name] = pinned.get(path.name) or _hub_blob_sha256(path) or memo.sha256_of(path)
    return digests


def _hub_blob_sha256(path: Path) -> str | None:
    """The Hugging Face cache links each LFS file to blobs/<its sha256>."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and re.fullmatch(r"[0-9a-f]{64}", target.name):
        return target.name
    return None


def digest_of(digests: dict[str, str]) -> str:
    """One digest over the sources' digests and the converter's version."""
    text = json.dumps({"version": CONVERSION_VERSION, "files": digests}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def read_json_object(path: Path, problem: str) -> dict[str, Any]:
    """The JSON object in `path`; else ExaoneError saying `problem` and why."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ExaoneError(path, f"{problem}: {exc}") from None
    if not isinstance(value, dict):
        raise ExaoneError(path, f"{problem}: not a JSON object")
    return value


def convert_exaone(
    folder: Path, files: list[Path], pinned: dict[str, str], cache_root: Path
) -> Path:
    """The Llama folder converted from the EXAONE `folder`, converting it on first use.

    `files` are the folder's weight files (already checked whole, and against `pinned`, by
    the loader). Returns MODEL_CACHE_DIR/exaone-llama/<digest>; raises ExaoneError.
    """
    config_path = folder / CONFIG
    source = read_json_object(config_path, "unreadable config")
    config = llama_config(source, config_path)
    shards = source_weight_files(folder, files)
    check_weights(config, shards)
    digests = source_digests(folder, shards, pinned, DigestMemo(cache_root))
    out = cache_root / CACHE_FOLDER / digest_of(digests)
    if (out / MANIFEST).is_file():
        return out
    logger.info("converting EXAONE checkpoint %s into the Llama layout at %s (once)", folder, out)
    try:
        with staged_folder(out, MANIFEST) as staging:
            _write_weights(shards, staging, tied=config["tie_word_embeddings"])
            for name in TOKENIZER_FILES:
                if (folder / name).is_file():
                    shutil.copyfile(folder / name, staging / name)  # follows hub symlinks
            write_json(staging / CONFIG, config)
            # Last: a folder holding the manifest is a finished one (see staged_folder).
            write_json(staging / MANIFEST, _manifest(folder, digests))
    except OSError as exc:
        raise ExaoneError(out, f"cannot write the converted folder: {exc}") from None
    return out


def _write_weights(shards: list[Path], staging: Path, tied: bool) -> None:
    """Each shard renamed into the same-named shard (one in memory at a time), plus an index."""
    weight_map: dict[str, str] = {}
    total = 0
    for shard in shards:
        name = shard.name if len(shards) > 1 else SINGLE_WEIGHTS
        tensors = {}
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                # Tied: EXAONE's model ties lm_head to wte when loading, whatever is stored.
                if key == "lm_head.weight" and tied:
                    continue
                llama = llama_key(key)
                assert llama is not None, key  # check_weights let through known names only
                tensors[llama] = handle.get_tensor(key)
        save_file(tensors, str(staging / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(staging / INDEX, index)


def _manifest(source: Path, digests: dict[str, str]) -> dict[str, Any]:
    return {
        "converted_by": "loraserve api.models.convert.exaone",
        "version": CONVERSION_VERSION,
        "source": str(source),
        "source_sha256": digests,
    }


def write_json(path: Path, value: dict[str, Any]) -> None:
    """Writes `value` as indented JSON."""
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
