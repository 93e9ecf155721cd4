"""The watched adapters folder, ADAPTERS_DIR/<model>/<adapter>/: what lies there is what each
model serves at run time, so replicas sharing the folder converge and a restart serves the
same set. Polled, not watched by inotify, which misses changes on network volumes and
Kubernetes' atomic symlink swaps of a mounted ConfigMap."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from api.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from api.models.registry import UnknownName
from api.models.spec import NAME_PATTERN
from api.serving.adapters import AdapterConflict, AdapterRefused, AdapterSet

logger = logging.getLogger(__name__)

# An empty file of this name in an adapter's folder pins it: never evicted.
PINNED_FILE = "pinned"
# Each file's (name, size, modification time, inode); stat follows links, so a swapped
# ConfigMap link counts as a change. A missing file is (name, -1, -1, -1).
Fingerprint = tuple[tuple[str, int, int, int], ...]
# What one adapter name stands for in the folder: its fingerprint, or None when absent.
State = Fingerprint | None


@dataclass(frozen=True)
class Found:
    """An adapter folder as a scan saw it."""

    folder: Path
    pinned: bool
    fingerprint: Fingerprint


def scan(root: Path) -> dict[str, dict[str, Found]]:
    """Every `<model>/<adapter>/` under `root` that holds an adapter config, by model and name;
    other entries (hidden, badly named, loose files) are left alone."""
    found: dict[str, dict[str, Found]] = {}
    for model_dir in sorted(root.iterdir()):
        if not _named(model_dir) or not model_dir.is_dir():
            continue
        for folder in sorted(model_dir.iterdir()):
            if not _named(folder) or not (folder / ADAPTER_CONFIG).is_file():
                continue
            fingerprint = tuple(
                _stat(folder / name) for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PINNED_FILE)
            )
            pinned = fingerprint[-1][1] >= 0
            found.setdefault(model_dir.name, {})[folder.name] = Found(folder, pinned, fingerprint)
    return found


def _named(path: Path) -> bool:
    return re.fullmatch(NAME_PATTERN, path.name) is not None


def _stat(path: Path) -> tuple[str, int, int, int]:
    try:
        stat = path.stat()
    except OSError:
        return (path.name, -1, -1, -1)
    return (path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino)


class AdapterFolder:
    """Brings each model's run-time adapters in line with the folder, a scan at a time.

    A change is acted on once it has stood unchanged for one scan, so an adapter still being
    copied in is not read half-written (except at start, when the folder is taken as it is).
    An adapter refused (bad files, another base) is logged and not retried until it changes;
    the version served before it, if any, stays.
    """

    def __init__(
        self, root: Path, adapter_sets: Mapping[str, AdapterSet], poll_seconds: float
    ) -> None:
        self.root = root
        self.poll_seconds = poll_seconds
        self._sets = adapter_sets
        self._acted: dict[tuple[str, str], Fingerprint] = {}  # the files last loaded or refused
        self._pending: dict[tuple[str, str], State] = {}  # seen once, waiting to stand
        self._warned: set[str] = set()

    async def run(self) -> None:
        """Scans every `poll_seconds`, for ever; a failed scan is logged and the next one runs."""
        while True:
            await asyncio.sleep(self.poll_seconds)
            try:
                await self.sync()
            except Exception:
                logger.exception("ADAPTERS_DIR %s: scan failed", self.root)

    async def sync(self, settle: bool = True) -> None:
        """One scan, then the loads, swaps and unloads that make the served set the folder's.
        An unreadable folder (a network volume away) changes nothing."""
        try:
            found = await asyncio.to_thread(scan, self.root)
        except OSError as exc:
            self._warn_once("root", f"ADAPTERS_DIR {self.root} cannot be read: {exc}")
            return
        for model in sorted(set(found) - set(self._sets)):
            self._warn_once(model, f"ADAPTERS_DIR/{model}: no model {model!r} is served")
        for model, adapters in self._sets.items():
            if not adapters.accepts_runtime:
                if model in found:
                    self._warn_once(
                        model,
                        f"ADAPTERS_DIR/{model}: model {model!r} takes no run-time adapters "
                        "(runtime_adapters: true in the models file)",
                    )
                continue
            await self._converge(model, adapters, found.get(model, {}), settle)

    async def _converge(
        self, model: str, adapters: AdapterSet, found: dict[str, Found], settle: bool
    ) -> None:
        acted_here = {name for key_model, name in self._acted if key_model == model}
        for name in sorted(set(found) | set(adapters.folder_names()) | acted_here):
            key = (model, name)
            entry = found.get(name)
            state: State = entry.fingerprint if entry is not None else None
            if entry is not None and self._acted.get(key) == state:
                self._pending.pop(key, None)
                continue
            if settle and (key not in self._pending or self._pending[key] != state):
                self._pending[key] = state
                continue
            self._pending.pop(key, None)
            if entry is None:
                self._acted.pop(key, None)
                await self._unload(adapters, model, name)
            else:
                self._acted[key] = entry.fingerprint
                await self._load(adapters, model, name, entry)

    async def _load(self, adapters: AdapterSet, model: str, name: str, entry: Found) -> None:
        try:
            await adapters.load(name, entry.folder, None, entry.pinned, "folder")
        except (AdapterRefused, AdapterConflict) as exc:
            logger.warning("ADAPTERS_DIR/%s/%s: %s", model, name, exc)

    async def _unload(self, adapters: AdapterSet, model: str, name: str) -> None:
        if name not in adapters.folder_names():
            return  # refused when it came, or loaded through the API since
        try:
            await adapters.unload(name, "folder")
        except (UnknownName, AdapterConflict) as exc:
            logger.warning("ADAPTERS_DIR/%s/%s: %s", model, name, exc)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message)
