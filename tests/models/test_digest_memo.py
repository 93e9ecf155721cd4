"""The digest memo: a local weight file is read for its sha256 once, and again whenever it may
have changed; what it gives is always the file's own sha256 (hashlib over its bytes).

Which files are read is seen through Python's audit hook: every `open` the process makes."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from api.models.convert.exaone import source_digests
from api.models.digest_memo import MEMO_FILE, DigestMemo

_opened: list[Path] | None = None


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _opened is not None and event == "open" and isinstance(args[0], (str, os.PathLike)):
        _opened.append(Path(os.fspath(args[0])).resolve())


sys.addaudithook(_audit)  # a hook stays for the process's life: it records only when asked


@contextmanager
def opened() -> Iterator[list[Path]]:
    """The paths the process opens inside the block."""
    global _opened
    _opened = []
    try:
        yield _opened
    finally:
        _opened = None


def reference(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def weights(folder: Path, size: int = 1 << 20) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.safetensors"
    path.write_bytes(os.urandom(size))
    return path


def test_an_unchanged_file_is_read_once_across_memos_of_one_cache(tmp_path: Path) -> None:
    file = weights(tmp_path / "model")
    want = reference(file)  # outside the blocks: the reference reads the file too
    with opened() as first:
        assert DigestMemo(tmp_path / "cache").sha256_of(file) == want
    assert file.resolve() in first
    for memo in (DigestMemo(tmp_path / "cache"), DigestMemo(tmp_path / "cache")):
        with opened() as later:  # a later start: a new memo over the same cache
            assert memo.sha256_of(file) == want
        assert file.resolve() not in later
    with opened() as elsewhere:  # another cache has no memo of it
        assert DigestMemo(tmp_path / "other").sha256_of(file) == want
    assert file.resolve() in elsewhere


def test_a_file_changed_in_place_is_read_again_even_with_its_times_set_back(
    tmp_path: Path,
) -> None:
    file = weights(tmp_path / "model")
    memo = DigestMemo(tmp_path / "cache")
    old = memo.sha256_of(file)
    stat = file.stat()
    time.sleep(0.05)  # past the kernel clock's tick, so the change time moves
    file.write_bytes(os.urandom(stat.st_size))  # same size
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # same modification time
    with opened() as reads:
        new = memo.sha256_of(file)
    assert file.resolve() in reads
    assert new == reference(file) != old


def test_a_replaced_file_is_read_again(tmp_path: Path) -> None:
    file = weights(tmp_path / "model")
    memo = DigestMemo(tmp_path / "cache")
    memo.sha256_of(file)
    replacement = weights(tmp_path / "elsewhere")
    replacement.replace(file)  # another inode under the same name
    want = reference(file)
    with opened() as reads:
        assert memo.sha256_of(file) == want
    assert file.resolve() in reads


def test_an_unreadable_or_foreign_memo_costs_a_read_never_a_wrong_digest(tmp_path: Path) -> None:
    file = weights(tmp_path / "model")
    memo = DigestMemo(tmp_path / "cache")
    memo.sha256_of(file)
    path = tmp_path / "cache" / MEMO_FILE
    written = json.loads(path.read_text(encoding="utf-8"))
    (entry,) = written.values()
    planted: list[object] = [
        "not json {",
        ["a list"],
        {str(file.resolve()): {"stat": [1, 2, 3, 4, 5], "sha256": "0" * 64}},  # another stat
        {str(file.resolve()): {**entry, "sha256": "not a digest"}},
        {str(file.resolve()): "a string"},
    ]
    want = reference(file)
    for content in planted:
        text = content if isinstance(content, str) else json.dumps(content)
        path.write_text(text, encoding="utf-8")
        with opened() as reads:
            assert memo.sha256_of(file) == want
        assert file.resolve() in reads
        assert json.loads(path.read_text(encoding="utf-8")) == written  # written afresh


def test_a_memo_that_cannot_be_written_still_gives_the_digest(tmp_path: Path) -> None:
    file = weights(tmp_path / "model")
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache folder would be", encoding="utf-8")
    memo = DigestMemo(blocked)
    assert memo.sha256_of(file) == memo.sha256_of(file) == reference(file)


def test_an_exaone_sources_weights_are_read_at_the_first_start_only(tmp_path: Path) -> None:
    """What finds a converted EXAONE: its small files are hashed each time (cheap), its
    weights once while unchanged."""
    folder = tmp_path / "exaone"
    shards = [weights(folder), folder / "model-2.safetensors"]
    shards[1].write_bytes(os.urandom(1 << 16))
    (folder / "config.json").write_text("{}", encoding="utf-8")
    cache = tmp_path / "cache"
    with opened() as first:
        digests = source_digests(folder, shards, {}, DigestMemo(cache))
    assert digests == {path.name: reference(path) for path in [folder / "config.json", *shards]}
    assert all(shard.resolve() in first for shard in shards)
    with opened() as later:
        assert source_digests(folder, shards, {}, DigestMemo(cache)) == digests
    assert (folder / "config.json").resolve() in later
    assert not any(shard.resolve() in later for shard in shards)
