"""Checkpoint files on disk: finding them, checking them, and fingerprinting them."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

SAFETENSORS_SUFFIX = ".safetensors"
PICKLE_WEIGHT_NAMES = ("pytorch_model.bin", "adapter_model.bin")
# Files at most this large are hashed whole for a fingerprint; larger ones (weights) by
# name, size, modification time and safetensors header, so a 5 GB base costs no full read.
FULL_HASH_MAX_BYTES = 16 * 1024 * 1024
_HASH_CHUNK_BYTES = 8 * 1024 * 1024


class CheckpointError(Exception):
    """A checkpoint file that is missing, truncated, corrupt or not the one pinned."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def sha256_of(path: Path) -> str:
    """The hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def read_safetensors_header(path: Path) -> bytes:
    """Returns the JSON header of a safetensors file after checking the file is whole.

    The header lists every tensor's byte range, so a truncated file is caught here, before
    any tensor is built from it.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as handle:
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise CheckpointError(path, "not a safetensors file: shorter than its header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(path, "truncated or corrupt: header runs past the file")
            header = handle.read(header_len)
    except OSError as exc:
        raise CheckpointError(path, f"cannot read: {exc.strerror or exc}") from None
    try:
        entries = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(path, "corrupt safetensors header (not JSON)") from None
    if not isinstance(entries, dict):
        raise CheckpointError(path, "corrupt safetensors header (not a JSON object)")
    data_end = 0
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2):
            raise CheckpointError(path, f"corrupt safetensors header at tensor {name!r}")
        data_end = max(data_end, int(offsets[1]))
    expected = 8 + header_len + data_end
    if size < expected:
        raise CheckpointError(path, f"truncated: {size} bytes on disk, header needs {expected}")
    if size > expected:
        raise CheckpointError(path, f"corrupt: {size - expected} unexpected bytes after the data")
    return header


def safetensors_tensor_names(path: Path) -> set[str]:
    """Names of the tensors a (checked) safetensors file holds."""
    entries = json.loads(read_safetensors_header(path))
    return {name for name in entries if name != "__metadata__"}


def weight_files(folder: Path, use_safetensors: bool) -> list[Path]:
    """The weight files of a model folder, safetensors first; none found is an error."""
    found = sorted(folder.glob(f"*{SAFETENSORS_SUFFIX}"))
    if found:
        return found
    pickles = [folder / name for name in PICKLE_WEIGHT_NAMES if (folder / name).is_file()]
    pickles += sorted(folder.glob("pytorch_model-*.bin"))
    if pickles and use_safetensors:
        raise CheckpointError(
            folder,
            "only pickle .bin weights found and USE_SAFETENSORS=true: convert them to "
            "safetensors (pickle files can run code when loaded)",
        )
    if not pickles:
        raise CheckpointError(folder, "no weight files (*.safetensors or pytorch_model.bin)")
    return pickles


def verify_files(files: list[Path], pinned_sha256: dict[str, str]) -> None:
    """Checks each safetensors file is whole and each pinned digest matches."""
    by_name = {path.name: path for path in files}
    for name in pinned_sha256:
        if name not in by_name:
            raise CheckpointError(Path(name), "pinned in weights_sha256 but not found")
    for path in files:
        if path.suffix == SAFETENSORS_SUFFIX:
            read_safetensors_header(path)
        expected = pinned_sha256.get(path.name)
        if expected is not None:
            actual = sha256_of(path)
            if actual != expected:
                raise CheckpointError(path, f"sha256 {actual} does not match pinned {expected}")


def folder_fingerprint(folder: Path, pinned_sha256: dict[str, str] | None = None) -> str:
    """A digest that changes whenever any file of the folder changes.

    Small files (config, tokenizer, adapters) are hashed whole; large weight files by their
    pinned digest when one is given, else by size, modification time and header.
    """
    pinned = pinned_sha256 or {}
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and ".git" not in p.parts):
        stat = path.stat()
        digest.update(str(path.relative_to(folder)).encode())
        if path.name in pinned:
            digest.update(pinned[path.name].encode())
        elif stat.st_size <= FULL_HASH_MAX_BYTES:
            digest.update(path.read_bytes())
        else:
            digest.update(f"{stat.st_size}:{stat.st_mtime_ns}".encode())
            if path.suffix == SAFETENSORS_SUFFIX:
                digest.update(read_safetensors_header(path))
    return digest.hexdigest()
