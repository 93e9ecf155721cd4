"""The sha256 of large local files, remembered by what `stat` says of them.

A plain model folder (a `--local-dir` download, a copied checkpoint) names no digest of its
weights, so finding an EXAONE source's converted copy read every byte of it at every start:
4.8 GB, about 3 s of EXAONE's 7.2 s start on an H200's host (bench/reports/gpu.md), where a
hub cache names each blob by its digest for free. The memo keeps each file's sha256 with its
size, modification time, change time, inode and device, in the model cache, and reads the file
again whenever any of them differs. The change time is the kernel's: writing a file, or
setting its modification time back, moves it, so a file changed in place is always read again.
A memo that cannot be read or written costs a read of the file, never a wrong digest.
"""

from __future__ import annotations

import json
import logging
import re
import tempfile
import threading
from pathlib import Path
from typing import Any

from api.models.checkpoint import sha256_of

logger = logging.getLogger(__name__)

MEMO_FILE = Path("digests") / "sha256.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Models of one process may load in threads; the memo is read, updated and replaced whole.
_LOCK = threading.Lock()


class DigestMemo:
    """`sha256_of`, reading a file only when its `stat` differs from when it was last read."""

    def __init__(self, cache_root: Path) -> None:
        self.path = cache_root / MEMO_FILE

    def sha256_of(self, file: Path) -> str:
        key = str(file.resolve())
        stamp = _stamp(file)
        with _LOCK:
            known = self._read().get(key)
        if isinstance(known, dict) and known.get("stat") == stamp:
            digest = known.get("sha256")
            if isinstance(digest, str) and _SHA256.fullmatch(digest):
                return digest
        digest = sha256_of(file)
        if _stamp(file) == stamp:  # not changed while it was read
            with _LOCK:
                entries = self._read()
                entries[key] = {"stat": stamp, "sha256": digest}
                self._write(entries)
        return digest

    def _read(self) -> dict[str, Any]:
        try:
            entries = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            logger.warning("digest memo %s unreadable, read the files again: %s", self.path, exc)
            return {}
        return entries if isinstance(entries, dict) else {}

    def _write(self, entries: dict[str, Any]) -> None:
        """Replaces the memo whole: a reader sees the old one or the new one, never half."""
        staging: Path | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(
                "w", dir=self.path.parent, suffix=".tmp", delete=False, encoding="utf-8"
            ) as handle:
                staging = Path(handle.name)
                json.dump(entries, handle)
            staging.replace(self.path)
        except OSError as exc:
            logger.warning("digest memo %s not written: %s", self.path, exc)
            if staging is not None:
                staging.unlink(missing_ok=True)


def _stamp(file: Path) -> list[int]:
    stat = file.stat()
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]
