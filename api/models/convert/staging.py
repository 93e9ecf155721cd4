"""Writing a cache folder so that it appears under its final name whole, or not at all.

A writer stages into a hidden folder beside the final one, flushes every file to disk and
renames the folder into place: a crash, a full disk or a power loss never leaves a half-written
folder that a later start would take for a finished one. Many replicas may share the cache
and start together: each stages under its own name, the first rename wins, and the others
keep the winner's folder.

A staging folder is named `.<final>.partial-<owner>.<uuid4>`: the uuid keeps two writers
apart even where their process ids are equal (pods each have their pid 1), and the owner
(`<namespace>.<pid>.<start time>`) says who wrote it. A writer killed mid-way leaves its
folder behind; `sweep_stale_staging` removes it at a later start when its owner is proven
gone (same machine and process namespace, and that process no longer runs), or, for a writer
elsewhere, once nothing in it changed for STALE_AFTER_SECONDS: a live writer on another
machine is never told apart from a dead one by its process id.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

logger = logging.getLogger(__name__)

STAGING_MARK = ".partial-"
# A staging folder in which nothing changed for this long belongs to a dead writer. Writing
# touches its files continuously; the longest quiet spell is a GGUF read and dequantized
# before its first file is written (minutes for billions of weights on a CPU).
STALE_AFTER_SECONDS = 6 * 3600
# Cache folders hold staging folders at most this deep (exaone-llama/adapters/<digest>).
_SWEEP_DEPTH = 3
_UNKNOWN = "unknown"
_DIGITS = re.compile(r"[0-9]{1,20}")


@contextmanager
def staged_folder(out_folder: Path, complete_marker: str) -> Iterator[Path]:
    """Yields an empty folder to write into; on a clean exit it becomes `out_folder`.

    `complete_marker` is a file every finished folder holds: when another process published
    `out_folder` meanwhile and it holds the marker, that folder is kept and ours dropped.
    On any exception nothing is left behind, not even the staging folder.
    """
    out_folder.parent.mkdir(parents=True, exist_ok=True)
    # Same parent, so the final rename stays on one filesystem and is atomic. 0755: the
    # service may read it as another user than the one writing it.
    staging = staging_folder_for(out_folder, process_owner(os.getpid()))
    staging.mkdir(mode=0o755)
    try:
        yield staging
        _make_readable(staging)
        _sync_tree(staging)
        _publish(staging, out_folder, complete_marker)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def staging_folder_for(out_folder: Path, owner: str) -> Path:
    """A new staging folder's path for `out_folder`, written by `owner` (process_owner)."""
    return out_folder.with_name(f".{out_folder.name}{STAGING_MARK}{owner}.{uuid.uuid4().hex}")


def process_owner(pid: int) -> str:
    """`<namespace>.<pid>.<start time>`: who writes a staging folder, as _abandoned reads it."""
    return f"{_namespace()}.{pid}.{_start_time(pid)}"


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


def sweep_stale_staging(cache_root: Path, now: float | None = None) -> list[Path]:
    """Removes the staging folders under `cache_root` that dead writers left (see the module
    docstring); returns them. Never raises: a folder it cannot judge or remove is kept."""
    now = time.time() if now is None else now
    removed: list[Path] = []
    for staging in _staging_folders(cache_root, _SWEEP_DEPTH):
        try:
            if not _abandoned(staging, now):
                continue
            # Renamed first, so the removal of a large folder never looks like a live one
            # half-way; a rename that fails means another start is removing it already.
            doomed = staging.with_name(f"{staging.name}.removing-{uuid.uuid4().hex}")
            staging.rename(doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
        logger.warning("removed %s, left by a writer that stopped before finishing", staging)
        removed.append(staging)
    for leftover in _removing_folders(cache_root, _SWEEP_DEPTH):  # a sweep killed mid-way
        shutil.rmtree(leftover, ignore_errors=True)
    return removed


def _staging_folders(folder: Path, depth: int) -> Iterator[Path]:
    yield from (p for p in _hidden_folders(folder, depth) if _is_staging(p.name))


def _removing_folders(folder: Path, depth: int) -> Iterator[Path]:
    yield from (p for p in _hidden_folders(folder, depth) if ".removing-" in p.name)


def _is_staging(name: str) -> bool:
    return STAGING_MARK in name and ".removing-" not in name


def _hidden_folders(folder: Path, depth: int) -> Iterator[Path]:
    """Hidden folders at most `depth` levels under `folder`, links not followed; the hidden
    ones are not entered (a staging folder's contents are the writer's)."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        try:
            if not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        if entry.name.startswith("."):
            yield Path(entry.path)
        elif depth > 1:
            yield from _hidden_folders(Path(entry.path), depth - 1)


def _abandoned(staging: Path, now: float) -> bool:
    """Whether the writer of `staging` is gone: proven so on this machine, else presumed
    after STALE_AFTER_SECONDS without a change."""
    owner = staging.name.rpartition(STAGING_MARK)[2].rsplit(".", 1)[0]
    namespace, _, process = owner.partition(".")
    pid, _, started = process.partition(".")
    if (
        namespace == _namespace() != _UNKNOWN
        and _DIGITS.fullmatch(pid)
        and _DIGITS.fullmatch(started)
    ):
        # A pid reused since by another process is not the writer: the start time tells.
        return _start_time(int(pid)) != started
    return now - _last_change(staging) > STALE_AFTER_SECONDS


def _last_change(folder: Path) -> float:
    """The newest modification time of the folder and of anything in it."""
    newest = folder.stat().st_mtime
    for path in folder.rglob("*"):
        try:
            newest = max(newest, path.stat().st_mtime)
        except OSError:  # removed meanwhile: its writer is at work
            return float("inf")
    return newest


@cache
def _namespace() -> str:
    """Names this machine's boot and this process's pid namespace: equal for two processes
    only when their pids can be compared. `unknown` where the system does not say (then no
    owner is ever proven gone)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        pids = str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        return _UNKNOWN
    return hashlib.sha256(f"{boot}:{pids}".encode()).hexdigest()[:16]


def _start_time(pid: int) -> str:
    """When process `pid` started (clock ticks since boot), or `gone`."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return "gone"
    # Field 22; the command name before it (field 2, in parentheses) may hold spaces.
    return stat.rpartition(")")[2].split()[19]
