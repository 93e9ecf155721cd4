"""The installed versions of the libraries whose kernels compute a model's numbers."""

from __future__ import annotations

import importlib.metadata
from functools import cache

# A new release of any of these may round differently, or store quantized weights otherwise.
NUMERIC_LIBRARIES = ("torch", "transformers", "peft", "bitsandbytes")


@cache
def library_versions() -> dict[str, str | None]:
    """The installed version of each numeric library (None where it is not installed)."""
    versions: dict[str, str | None] = {}
    for name in NUMERIC_LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions
