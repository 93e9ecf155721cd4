"""The folders a client may have adapters loaded from (ADAPTERS_DIR and ADAPTER_ROOTS), and
the one check that a `lora_path` lies in one of them, links followed."""

from __future__ import annotations

from pathlib import Path

from api.models.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from api.settings import Settings

# One answer for every path outside the roots, so it tells nothing about what is there.
OUTSIDE_ROOTS = (
    "lora_path is not in a folder adapters may be loaded from (ADAPTERS_DIR, ADAPTER_ROOTS)"
)


class OutsideRoots(Exception):
    """A `lora_path` outside every root; the message never depends on the path."""

    def __init__(self) -> None:
        super().__init__(OUTSIDE_ROOTS)


def adapter_roots(settings: Settings) -> tuple[Path, ...]:
    """ADAPTERS_DIR and ADAPTER_ROOTS, each resolved (a root may itself be a link)."""
    roots = [settings.adapters_dir, *(settings.adapter_roots or [])]
    return tuple(root.expanduser().resolve() for root in roots if root is not None)


def place(lora_path: str, roots: tuple[Path, ...]) -> Path:
    """The real folder `lora_path` names, where it and the adapter's files in it lie under a
    root once every link is followed (a link inside a root pointing out is outside)."""
    try:
        folder = Path(lora_path).expanduser().resolve()
        files = [(folder / name).resolve() for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
    except (OSError, RuntimeError, ValueError):  # a link loop, a NUL in the path
        raise OutsideRoots() from None
    if not all(_under(path, roots) for path in (folder, *files)):
        raise OutsideRoots()
    return folder


def _under(path: Path, roots: tuple[Path, ...]) -> bool:
    return any(path.is_relative_to(root) for root in roots)
