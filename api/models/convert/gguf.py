"""Converting a GGUF checkpoint, once, into a safetensors folder the loader reads fast.

A GGUF file (llama.cpp's format) carries the config, the tokenizer and block-quantized
weights in one file. transformers can read it, but only by dequantizing every tensor at each
load, and it will not attach bitsandbytes or LoRA adapters to it the usual way. So the file
is checked against its pinned sha256, dequantized once, and written as an ordinary
transformers folder (config.json, tokenizer files, model.safetensors) that every later load
reads like any other base.

The folder is MODEL_CACHE_DIR/gguf/<the GGUF's sha256>: named by the bytes it was made from
(the pinned digest the file is checked against, and the revision `/models` reports), never by
the model's name, so a new file under an old name is converted anew and served, and one
cache holds the conversions of every version side by side.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from api.models.checkpoint import sha256_of
from api.models.convert.staging import staged_folder
from api.models.faults import one_line

logger = logging.getLogger(__name__)

WEIGHTS_FILE = "model.safetensors"
CACHE_FOLDER = "gguf"


class GgufError(Exception):
    """A GGUF file that is missing, not the one pinned, or cannot be converted."""


def conversion_folder(cache_root: Path, sha256: str) -> Path:
    """Where the conversion of the GGUF whose bytes have this sha256 lives."""
    return cache_root / CACHE_FOLDER / sha256.lower()


def converted_gguf(gguf_path: Path, sha256: str, cache_root: Path) -> Path:
    """The conversion of the GGUF pinned by `sha256`, made on first use: a folder under its
    digest was published whole (see staged_folder), from a file checked against it."""
    folder = conversion_folder(cache_root, sha256)
    if (folder / WEIGHTS_FILE).is_file():
        return folder
    logger.info("converting %s into %s (once)", gguf_path, folder)
    return convert_gguf(gguf_path, sha256, folder)


def convert_gguf(
    gguf_path: Path, expected_sha256: str, out_folder: Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Dequantizes `gguf_path` into `out_folder` (config, tokenizer, model.safetensors).

    The folder is written under a hidden temporary name beside `out_folder` and renamed into
    place, so a crash never leaves a half-written folder under the final name. Returns
    `out_folder`; raises GgufError naming the file on any failure.
    """
    check_sha256(gguf_path, expected_sha256)
    try:
        with staged_folder(out_folder, WEIGHTS_FILE) as staging:
            write_folder(gguf_path, staging, dtype)
    except GgufError:
        raise
    except FileExistsError as exc:
        raise GgufError(f"{out_folder}: {exc.strerror}") from None
    except Exception as exc:  # transformers and gguf raise many types; each becomes one error
        raise GgufError(f"{gguf_path}: cannot convert: {one_line(exc)}") from None
    return out_folder


def check_sha256(gguf_path: Path, expected_sha256: str) -> None:
    """Refuses a missing file, or one whose bytes are not the pinned ones."""
    if not gguf_path.is_file():
        raise GgufError(f"{gguf_path}: no such GGUF file")
    actual = sha256_of(gguf_path)
    if actual != expected_sha256.lower():
        raise GgufError(f"{gguf_path}: sha256 {actual} does not match pinned {expected_sha256}")


def write_folder(gguf_path: Path, folder: Path, dtype: torch.dtype) -> None:
    """Writes the dequantized model and its tokenizer into `folder` as a transformers folder."""
    source, name = str(gguf_path.parent), gguf_path.name
    # The file is local: no hub look-up. Said explicitly, because the saved tokenizer config
    # records this flag, and the folder should not depend on the HF_HUB_OFFLINE of the run.
    tokenizer: Any = AutoTokenizer.from_pretrained(source, gguf_file=name, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(
        source,
        gguf_file=name,
        dtype=dtype,
        local_files_only=True,
        # Without this, transformers keeps the weights in GGUF blocks whenever its `kernels`
        # package is installed; those modules are not a plain checkpoint and do not save as one.
        quantization_config=GgufConfig(dequantize=True),
    )
    packed = [n for n, p in model.named_parameters() if not p.is_floating_point()]
    if packed:
        raise GgufError(f"{gguf_path}: weights still packed after dequantizing: {packed[:3]}")
    # transformers refuses to save a model it still considers GGUF-quantized; its weights
    # are dense now, so only the quantizer and the config's quantization entry go.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    if not (folder / WEIGHTS_FILE).is_file():  # a sharded save would be read differently
        raise GgufError(f"{gguf_path}: conversion wrote no single {WEIGHTS_FILE}")
