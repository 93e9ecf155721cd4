"""Writing a converted folder so that it appears under its final name whole, or not at all.

A conversion writes into a hidden temporary folder beside the final one, flushes every file
to disk and renames the folder into place: a crash, a full disk or a power loss never leaves
a half-written folder that a later start would take for a finished one.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING_MARK = ".partial-"


@contextmanager
def staged_folder(out_folder: Path, complete_marker: str) -> Iterator[Path]:
    """Yields an empty folder to write into; on a clean exit it becomes `out_folder`.

    `complete_marker` is a file every finished folder holds: when another process published
    `out_folder` meanwhile and it holds the marker, that folder is kept and ours dropped.
    On any exception nothing is left behind, not even the temporary folder.
    """
    out_folder.parent.mkdir(parents=True, exist_ok=True)
    # Same parent, so the final rename stays on one filesystem and is atomic.
    staging = Path(
        tempfile.mkdtemp(prefix=f".{out_folder.name}{STAGING_MARK}", dir=out_folder.parent)
    )
    try:
        # mkdtemp makes the folder private (0700); the service may read it as another user.
        staging.chmod(0o755)
        yield staging
        _make_readable(staging)
        _sync_tree(staging)
        _publish(staging, out_folder, complete_marker)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """safetensors writes files 0600; the service may run as another user than the converter."""
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _sync_tree(folder: Path) -> None:
    """Flushes every file, then the folder itself, before the rename publishes them."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _publish(staging: Path, out_folder: Path, complete_marker: str) -> None:
    """Renames the finished folder into place; a complete folder already there wins."""
    try:
        staging.rename(out_folder)
    except OSError as exc:
        if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        if (out_folder / complete_marker).is_file():
            return  # another process converted the same sources meanwhile: as good as ours
        raise FileExistsError(
            exc.errno,
            "exists but is not a complete conversion; remove it to convert again",
            str(out_folder),
        ) from None
