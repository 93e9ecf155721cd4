"""A diskcache serializer that never unpickles: keys and values are text, kept in the row.

diskcache's own Disk pickles whatever is not a str, bytes or number, and unpickles every row
marked as a pickle (MODE_PICKLE values, and keys stored with raw=0, read back while iterating).
Whoever can write the cache folder (which replicas may share) could plant such a row and run
code in the server when it is read. This one writes only str keys and str values inline
(MODE_RAW, whatever the folder's disk_min_file_size says) and refuses to read any row it could
not have written: a pickle, a value in a file (whose path the row names), a non-text value.
Nor does it delete the file a row names when diskcache replaces or evicts that row: this
service never writes one, and the name, planted, could be any path the server may delete.
"""

from __future__ import annotations

from typing import Any

import diskcache
from diskcache.core import MODE_RAW, UNKNOWN

from api.serving.cache.verify import Rejected


class TextOnlyDisk(diskcache.Disk):  # type: ignore[misc]  # diskcache has no type hints
    """diskcache.Disk for str keys and str values only, nothing ever pickled or unpickled."""

    def put(self, key: Any) -> tuple[str, bool]:
        if type(key) is not str:
            raise TypeError(f"cache keys are str, not {type(key).__name__}")
        return key, True

    def get(self, key: Any, raw: bool) -> str:
        if not raw or type(key) is not str:
            raise Rejected("format", "a cache key this service did not write (a pickle?)")
        return key

    def store(self, value: Any, read: bool, key: Any = UNKNOWN) -> tuple[int, int, None, str]:
        if read or type(value) is not str:
            raise TypeError(f"cache values are str, not {type(value).__name__}")
        return 0, MODE_RAW, None, value

    def remove(self, file_path: str) -> None:
        """Deletes nothing (see the module's docstring)."""

    def fetch(self, mode: int, filename: str | None, value: Any, read: bool) -> str:
        return text_value(mode, value)


def text_value(mode: int, value: Any) -> str:
    """A row's value, if it is text kept in the row (as this service writes every value);
    Rejected for a pickle, a value in a file, or anything else."""
    if mode != MODE_RAW or type(value) is not str:
        raise Rejected("format", f"a cache row of mode {mode} that this service never writes")
    return value
