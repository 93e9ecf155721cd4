"""Pre-quantized checkpoints: a bitsandbytes model quantized once, saved, and read back later.

bitsandbytes quantizes a model while transformers loads it: every start reads the full-
precision weights and quantizes them again, the longest part of loading a 4-bit model on a CPU
(bench/reports/load_time.md). So the first start saves the quantized model
with `save_pretrained`, in the serialisation transformers reads back (quantized tensors with
their quantization state, the `quantization_config` in config.json), under
MODEL_CACHE_DIR/prequantized/<key>; later starts load that folder directly.

The key is a digest over everything the saved bytes depend on: the base's fingerprint (its
files' digests), the bitsandbytes settings, the dtype of the unquantized parts, the device
kind, the task, labels and remote-code flag that decide the model class and head, and the
versions of torch, transformers and bitsandbytes. A changed source or setting makes a new
entry; an entry is never served for other sources or settings. An entry is written into a
staging folder and renamed into place with its manifest last (see staging.staged_folder).

Every replica sharing the cache reads the same entry, so one that cannot be read now (an
I/O, permission or network error) is left exactly as it is: that start quantizes at start and
writes nothing. Only an entry proven wrong (incomplete, a size or digest other than written,
a manifest for another key, files transformers cannot read) is set aside, renamed to
`.<key>.broken-<uuid4>` (kept for inspection, never deleted here), and written anew.

Saved right after loading, before any forward: bitsandbytes' 4-bit weights saved after
forwards drift on CPU without double quantization (FINDINGS), and an entry must hold what a
fresh quantization gives.
"""

from __future__ import annotations

import hashlib
import json
import logging
import stat
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from api.models.checkpoint import sha256_of
from api.models.convert.staging import staged_folder
from api.models.faults import one_line
from api.models.spec import ModelSpec
from api.models.versions import library_versions

logger = logging.getLogger(__name__)

CACHE_FOLDER = "prequantized"
MANIFEST = "loraserve-prequantized.json"
# Part of every key: a writer that saves differently writes new entries.
FORMAT_VERSION = "1"
# The libraries that quantize and (de)serialise the weights.
KEYED_LIBRARIES = ("torch", "transformers", "bitsandbytes")


class PrequantizedError(Exception):
    """A pre-quantized entry proven unusable (or one that cannot be written), with the
    reason."""


class EntryUnreadable(Exception):
    """A pre-quantized entry that cannot be read now (an OSError): nothing is proven about
    its bytes, so it is left in place."""


@dataclass(frozen=True)
class PrequantizedEntry:
    """Where the pre-quantized checkpoint for one base and one set of settings lives."""

    folder: Path
    key: str
    components: dict[str, object]

    @classmethod
    def of(
        cls,
        cache_root: Path,
        spec: ModelSpec,
        base_fingerprint: str,
        quant_config: Any,
        dtype: torch.dtype,
        device: torch.device,
    ) -> PrequantizedEntry:
        """The entry for `spec`'s base (fingerprinted) under these quantization settings."""
        versions = library_versions()
        components: dict[str, object] = {
            "format": FORMAT_VERSION,
            "base": base_fingerprint,
            "quantization": quant_config.to_dict(),
            "dtype": str(dtype),
            "device_type": device.type,
            "task": spec.task,
            "labels": spec.labels,
            "trust_remote_code": spec.trust_remote_code,
            "versions": {name: versions.get(name) for name in KEYED_LIBRARIES},
        }
        canonical = json.dumps(components, sort_keys=True, separators=(",", ":"), default=str)
        key = hashlib.sha256(canonical.encode()).hexdigest()
        return cls(cache_root / CACHE_FOLDER / key, key, components)

    def read_manifest(self) -> list[str] | None:
        """The base's missing keys as recorded, if the entry is complete and whole; None if
        there is no entry. A broken entry raises PrequantizedError saying what is wrong; one
        that cannot be read now raises EntryUnreadable.

        The checkpoint's own missing keys (a head the base lacks, that an adapter must
        provide) are recorded, since the saved model holds that head, randomly initialised.
        """
        path = self.folder / MANIFEST
        try:
            if not self.folder.exists():
                return None
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PrequantizedError(f"{self.folder}: no {MANIFEST}: not a complete entry") from None
        except OSError as exc:
            raise EntryUnreadable(f"{path}: cannot read: {one_line(exc)}") from None
        try:
            manifest = json.loads(text)
        except ValueError as exc:
            raise PrequantizedError(f"{path}: unreadable manifest: {exc}") from None
        if not isinstance(manifest, dict) or manifest.get("key") != self.key:
            raise PrequantizedError(f"{path}: written for another key")
        files = manifest.get("files")
        missing_keys = manifest.get("missing_keys")
        if not isinstance(files, dict) or not files or not isinstance(missing_keys, list):
            raise PrequantizedError(f"{path}: manifest lacks its files or missing keys")
        for name, written in files.items():
            _check_file(self.folder / name, written)
        return [str(key) for key in missing_keys]

    def write(self, model: Any, missing_keys: list[str], source: Path) -> None:
        """Saves `model` (quantized, never run) as this entry, atomically; a complete entry
        another process wrote meanwhile is kept. Raises PrequantizedError on failure."""
        try:
            with staged_folder(self.folder, MANIFEST) as staging:
                model.save_pretrained(staging, safe_serialization=True)
                files = {
                    path.name: {"bytes": path.stat().st_size, "sha256": sha256_of(path)}
                    for path in sorted(staging.iterdir())
                    if path.is_file()
                }
                manifest = {
                    "written_by": "loraserve api.models.prequantized",
                    "key": self.key,
                    "source": str(source),
                    "components": self.components,
                    "missing_keys": sorted(missing_keys),
                    "files": files,
                }
                # Last: a folder holding the manifest is a finished one (see staged_folder).
                (staging / MANIFEST).write_text(
                    json.dumps(manifest, indent=2, default=str) + "\n", encoding="utf-8"
                )
        except Exception as exc:  # save_pretrained raises many types; each becomes one error
            raise PrequantizedError(f"{self.folder}: cannot write: {one_line(exc)}") from None

    def set_aside(self) -> Path | None:
        """Renames a broken entry out of the way (atomic: no later start sees half of it) to
        a name no other replica picks, and keeps it; a process still reading it keeps its
        open files. Returns where it went; None when it was gone already or cannot be moved
        (then it stays: a later start judges it again)."""
        aside = self.folder.with_name(f".{self.folder.name}.broken-{uuid.uuid4().hex}")
        try:
            self.folder.rename(aside)
        except OSError:
            return None
        return aside


def _check_file(path: Path, written: object) -> None:
    """The file is there with the size and sha256 it was written with: a truncated, partial
    or overwritten entry is never read. The hashing reads every byte once, which warms the
    page cache that the load then maps."""
    if not isinstance(written, dict):
        raise PrequantizedError(f"{path}: the manifest lacks its size and sha256")
    try:
        status = path.lstat()  # a link is not followed out of the entry
        if not stat.S_ISREG(status.st_mode):
            raise PrequantizedError(f"{path}: listed in the manifest, not a file here")
        if status.st_size != written.get("bytes"):
            raise PrequantizedError(
                f"{path}: {status.st_size} bytes, written with {written.get('bytes')}"
            )
        digest = sha256_of(path)
    except FileNotFoundError:
        raise PrequantizedError(f"{path}: listed in the manifest but missing") from None
    except OSError as exc:
        raise EntryUnreadable(f"{path}: cannot read: {one_line(exc)}") from None
    if digest != written.get("sha256"):
        raise PrequantizedError(f"{path}: its bytes changed since written (sha256 differs)")
