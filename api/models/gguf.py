"""Converting a GGUF checkpoint once into a safetensors folder the loader reads fast."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from api.models.checkpoint import sha256_of


class GgufError(Exception):
    """A GGUF file that is missing, not the one pinned, or cannot be converted."""


def convert_gguf(
    gguf_path: Path, expected_sha256: str, out_folder: Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Dequantizes `gguf_path` into `out_folder` (config, tokenizer, model.safetensors).

    The folder is written under a temporary name and renamed into place, so a crash never
    leaves a half-written folder that looks complete.
    """
    if not gguf_path.is_file():
        raise GgufError(f"{gguf_path}: no such file")
    actual = sha256_of(gguf_path)
    if actual != expected_sha256:
        raise GgufError(f"{gguf_path}: sha256 {actual} does not match pinned {expected_sha256}")
    out_folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_folder.name}-", dir=out_folder.parent))
    try:
        source, name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=name, dtype=dtype)
        # transformers refuses to save a model it still considers GGUF-quantized; its
        # weights are already dequantized, so only the marker goes.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        staging.rename(out_folder)
    except (OSError, ValueError, RuntimeError) as exc:
        raise GgufError(f"{gguf_path}: cannot convert: {exc}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return out_folder
