"""File modes obeyed by a process that may be root, for tests of a file it cannot read: root's
right to read past a file's mode is two capabilities, given up for a block and taken back."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# linux/capability.h: version 3 of the calls' header, and the two capabilities that read and
# search what a file's mode refuses.
_CAPABILITY_VERSION_3 = 0x20080522
CAP_DAC_OVERRIDE = 1
CAP_DAC_READ_SEARCH = 2
PAST_MODES = (1 << CAP_DAC_OVERRIDE) | (1 << CAP_DAC_READ_SEARCH)


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Sets(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


# Version 3 holds the sets in two words each; the first holds capabilities 0 to 31.
_Words = _Sets * 2
_LIBC = ctypes.CDLL(None, use_errno=True)


def _capabilities(call: str, sets: ctypes.Array[_Sets]) -> bool:
    """capget or capset on the calling thread (pid 0); False where there is no such call
    (not Linux) or it is refused."""
    function = getattr(_LIBC, call, None)
    if function is None:
        return False
    header = _Header(_CAPABILITY_VERSION_3, 0)
    return int(function(ctypes.byref(header), sets)) == 0


@contextmanager
def modes_obeyed() -> Iterator[None]:
    """The block runs on this thread with file modes obeyed as by a user who is not root:
    CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH out of the thread's effective capabilities, and
    back after (they stay permitted). The process keeps its user, so what that user reads by
    mode it still reads wherever it lies: a checkout, virtualenv or temporary folder under a
    folder only root opens, which a switch to another user (`seteuid`) could not reach.

    The calling thread's alone: reads on another thread still pass the modes. Where the
    capabilities cannot be read or set (not Linux), the block runs unchanged: see `readable`.
    """
    sets = _Words()
    if not _capabilities("capget", sets) or not sets[0].effective & PAST_MODES:
        yield  # nothing to give up (not root, or root without them), or no way to
        return
    held = sets[0].effective
    sets[0].effective = held & ~PAST_MODES
    if not _capabilities("capset", sets):
        yield
        return
    try:
        yield
    finally:
        sets[0].effective = held
        restored = _capabilities("capset", sets)
        assert restored, f"capset could not restore the capabilities: errno {ctypes.get_errno()}"


def readable(path: Path) -> bool:
    """Whether this thread can open `path` for reading now."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        return False
    os.close(fd)
    return True
