"""Converting a GGUF checkpoint, once, into a safetensors folder the loader reads fast.

A GGUF file (llama.cpp's format) carries the config, the tokenizer and block-quantized
weights in one file. transformers can read it, but only by dequantizing every tensor at each
load, and it will not attach bitsandbytes or LoRA adapters to it the usual way. So the file
is checked against its pinned sha256, dequantized once, and written as an ordinary
transformers folder (config.json, tokenizer files, model.safetensors) that every later load
reads like any other base.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

from api.models.checkpoint import sha256_of

WEIGHTS_FILE = "model.safetensors"
STAGING_MARK = ".partial-"


class GgufError(Exception):
    """A GGUF file that is missing, not the one pinned, or cannot be converted."""


def convert_gguf(
    gguf_path: Path, expected_sha256: str, out_folder: Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Dequantizes `gguf_path` into `out_folder` (config, tokenizer, model.safetensors).

    The folder is written under a hidden temporary name beside `out_folder` and renamed into
    place, so a crash never leaves a half-written folder under the final name. Returns
    `out_folder`; raises GgufError naming the file on any failure.
    """
    check_sha256(gguf_path, expected_sha256)
    out_folder.parent.mkdir(parents=True, exist_ok=True)
    # Same parent, so the final rename stays on one filesystem and is atomic.
    staging = Path(
        tempfile.mkdtemp(prefix=f".{out_folder.name}{STAGING_MARK}", dir=out_folder.parent)
    )
    try:
        # mkdtemp makes the folder private (0700); the service may read it as another user.
        staging.chmod(0o755)
        write_folder(gguf_path, staging, dtype)
        _make_readable(staging)
        _sync_tree(staging)
        _publish(staging, out_folder)
    except GgufError:
        raise
    except Exception as exc:  # transformers and gguf raise many types; each becomes one error
        raise GgufError(f"{gguf_path}: cannot convert: {_one_line(exc)}") from None
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
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


def _make_readable(folder: Path) -> None:
    """safetensors writes weights 0600; the service may run as another user than the converter."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


def _sync_tree(folder: Path) -> None:
    """Flushes every file to disk before the rename publishes them (power loss, not only
    a crash of this process, must not leave a complete-looking folder of empty files)."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _publish(staging: Path, out_folder: Path) -> None:
    """Renames the finished folder into place; a complete folder already there wins."""
    try:
        staging.rename(out_folder)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        # Another process converted the same file meanwhile: its folder is as good as ours.
        if (out_folder / "config.json").is_file() and (out_folder / WEIGHTS_FILE).is_file():
            return
        raise GgufError(
            f"{out_folder}: exists but is not a complete conversion; remove it to convert again"
        ) from None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:500]
