"""The memory allocator a serving process runs on: jemalloc, preloaded, where it is installed.

glibc's allocator serves the forward's buffers (a batch's activations, of a new size at
every packed batch) from a heap that fragments as the sizes vary: measured on the embedded
model at 32 clients, the forward's time a text rose ~10 % within two minutes of load and the
process grew from 1.05 to 1.25 GB, while on jemalloc both stayed flat and the aged server
served 1.15 times the texts a second (bench/reports/measured_in_tests.md, "A server's
forward slows in its first minutes"). An allocator is chosen before the process starts, so
the process starts itself again, the same command, with jemalloc in LD_PRELOAD.
"""

from __future__ import annotations

import ctypes.util
import logging
import os
import sys

logger = logging.getLogger(__name__)

PRELOAD = "LD_PRELOAD"


def jemalloc_preloaded() -> bool:
    """Whether this process was started with jemalloc in LD_PRELOAD."""
    return "jemalloc" in os.environ.get(PRELOAD, "")


def restart_on_jemalloc() -> None:
    """Replaces this process by the same command with jemalloc preloaded (same pid,
    arguments, folder and environment but for LD_PRELOAD). Returns where it already runs on
    jemalloc, or where no jemalloc is installed (logged: glibc's allocator it is)."""
    if jemalloc_preloaded():
        return
    library = ctypes.util.find_library("jemalloc")
    if library is None:
        logger.warning(
            "MEMORY_ALLOCATOR=jemalloc, but no jemalloc is installed (Debian: libjemalloc2): "
            "serving on the system allocator"
        )
        return
    preload = " ".join(part for part in (os.environ.get(PRELOAD, ""), library) if part)
    sys.stdout.flush()
    sys.stderr.flush()
    # orig_argv, not argv: `python -m api.cli` must run as a module again, from its folder.
    os.execve(
        sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, PRELOAD: preload}
    )
