"""The disk tier signs every value with a secret that whoever can write its folder does not
hold: DISK_CACHE_SECRET, or else a random key it makes once in a file beside the folder
(`<DISK_CACHE_DIR>.key`, mode 0600) and reads at every start. On real diskcache folders: a
value written by the tier is a hit after a restart; one moved to another key is refused and
counted; replicas sharing the folder and the secret (or the key file's text) hit each other's
entries, and one with another secret does not; a key file that is another user's, that
others can read, a link or a FIFO turns the tier off instead of being trusted."""

from __future__ import annotations

import math
import os
import sqlite3
import threading
from pathlib import Path

import pytest

from api.metrics import Metrics
from api.serving.cache import ResultCache, cache_key
from api.serving.cache.disk import DiskTier
from api.serving.cache.entry import Entry
from api.serving.cache.signing import KeyFileError, default_key_file, load_key
from api.serving.cache.verify import AnswerShape
from api.settings import SettingsError, load_settings
from tests.support.in_process import make_settings

ENTRY = ((0.25, 0.75), (0.0, math.log(3)))  # softmax(0, ln 3) = (1/4, 3/4)
OTHER = ((0.75, 0.25), (math.log(3), 0.0))  # the other label's: as well-formed
SHAPE = AnswerShape(labels=2)


def metrics() -> Metrics:
    return Metrics(latency_target_seconds=2.0)


def rejected_for_mac(counted: Metrics) -> float:
    value: float = counted.cache_rejected.labels("disk", "mac")._value.get()
    return value


async def read(tier: DiskTier, keys: list[str]) -> list[Entry | None]:
    try:
        return await tier.get_many(keys, SHAPE)
    finally:
        await tier.close()


async def test_a_value_the_tier_wrote_is_a_hit_after_a_restart_with_the_key_beside_the_folder(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "disk"
    tier = DiskTier(folder, 2**24, None, metrics())
    tier._write([("stored", ENTRY)])
    await tier.close()
    key_file = tmp_path / "disk.key"
    assert default_key_file(folder) == key_file  # beside the folder, not in it
    info = key_file.stat()
    assert (info.st_mode & 0o777, info.st_uid) == (0o600, os.geteuid())
    text = key_file.read_text(encoding="ascii")
    assert len(text.strip()) == 64 and int(text, 16) > 0  # 32 random bytes, in hex
    assert not any(path.name.endswith(".key") for path in folder.iterdir())

    counted = metrics()
    found = await read(DiskTier(folder, 2**24, None, counted), ["stored"])
    assert found == [ENTRY]
    assert rejected_for_mac(counted) == 0
    assert key_file.read_text(encoding="ascii") == text  # read again, not made anew


async def test_a_value_copied_to_another_key_is_refused_and_counted(tmp_path: Path) -> None:
    folder = tmp_path / "disk"
    tier = DiskTier(folder, 2**24, None, metrics())
    tier._write([("spam text", OTHER), ("ham text", ENTRY)])
    await tier.close()
    # Whoever can write the folder copies one text's genuine value onto another's key.
    with sqlite3.connect(folder / "cache.db") as database:
        database.execute(
            "UPDATE Cache SET value = (SELECT value FROM Cache WHERE key = 'spam text')"
            " WHERE key = 'ham text'"
        )
    counted = metrics()
    found = await read(DiskTier(folder, 2**24, None, counted), ["ham text", "spam text"])
    assert found == [None, OTHER]
    assert rejected_for_mac(counted) == 1


async def test_replicas_that_share_the_folder_and_the_secret_hit_each_others_entries(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "shared"
    secret = "ab" * 32
    key = cache_key("identity", True, "win a free prize now")

    def replica(**settings: object) -> tuple[ResultCache, Metrics]:
        values: dict[str, object] = {"disk_cache_dir": folder, "lru_cache_entries": 0}
        values |= {"disk_cache_admission": "every"}  # the first answer on disk
        counted = metrics()
        return ResultCache.from_settings(make_settings(**values, **settings), counted), counted

    writer, _ = replica(disk_cache_secret=secret)
    writer.store([key], [ENTRY])
    await writer.close()  # its writer finishes first
    assert not default_key_file(folder).exists()  # with DISK_CACHE_SECRET, no key file

    found: dict[str, tuple[list[str], list[Entry | None], float]] = {}
    for name, settings in {
        "the same secret": {"disk_cache_secret": secret},
        "another secret": {"disk_cache_secret": "cd" * 32},
        "the key file": {},  # a replica of the defaults: the key file beside the folder
    }.items():
        cache, counted = replica(**settings)
        lookup = await cache.lookup([key], SHAPE)
        await cache.close()
        found[name] = (lookup.tiers, lookup.entries, rejected_for_mac(counted))
    assert found == {
        "the same secret": (["disk"], [ENTRY], 0),
        "another secret": (["model"], [None], 1),
        "the key file": (["model"], [None], 1),
    }

    # The key file's text given to another replica as DISK_CACHE_SECRET: the same key.
    defaults, _ = replica()
    defaults.store([key], [OTHER])
    await defaults.close()
    shared = default_key_file(folder).read_text(encoding="ascii").strip()
    cache, counted = replica(disk_cache_secret=shared)
    lookup = await cache.lookup([key], SHAPE)
    await cache.close()
    assert (lookup.tiers, lookup.entries, rejected_for_mac(counted)) == (["disk"], [OTHER], 0)


async def test_a_key_file_elsewhere_is_made_there_and_one_inside_the_folder_is_refused(
    tmp_path: Path,
) -> None:
    folder, key_file = tmp_path / "disk", tmp_path / "keys" / "disk-cache.key"
    cache = ResultCache.from_settings(
        make_settings(disk_cache_dir=folder, disk_cache_secret_file=key_file), metrics()
    )
    await cache.close()
    assert [tier.name for tier in cache.tiers] == ["lru", "disk"]
    assert key_file.stat().st_mode & 0o777 == 0o600
    assert not default_key_file(folder).exists()
    # Refused at start (the message start-up exits 2 with).
    inside = {"disk_cache_dir": folder, "disk_cache_secret_file": folder / "sub" / "key"}
    with pytest.raises(SettingsError, match="DISK_CACHE_SECRET_FILE lies inside DISK_CACHE_DIR"):
        load_settings(_env_file=None, **inside)


def refused(key_file: Path, folder: Path) -> str:
    """Why the tier refused to open on `folder` with `key_file`: it is off, counted."""
    counted = metrics()
    assert DiskTier.open(folder, 2**24, None, counted, key_file=key_file) is None
    assert counted.cache_errors.labels("disk", "open")._value.get() == 1
    with pytest.raises((KeyFileError, OSError)) as caught:
        load_key(key_file)
    return str(caught.value)


def test_a_key_file_others_could_read_or_replace_turns_the_tier_off(tmp_path: Path) -> None:
    folder, key_file = tmp_path / "disk", tmp_path / "disk.key"
    secret = load_key(key_file)
    assert load_key(key_file) == secret

    key_file.chmod(0o640)  # the group could read it, and forge values
    assert "chmod 600" in refused(key_file, folder)
    key_file.chmod(0o600)

    # A link, even to a good key: whoever planted it chose the file.
    link = tmp_path / "link.key"
    link.symlink_to(key_file)
    refused(link, folder)

    # A FIFO where the key should be: refused at once, never waited on.
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    assert "not a regular file" in refused(fifo, folder)

    short = tmp_path / "short.key"
    short.write_text("abc\n", encoding="ascii")
    short.chmod(0o600)
    assert "fewer than 16" in refused(short, folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="only root can give a file to another user")
def test_a_key_file_of_another_user_turns_the_tier_off(tmp_path: Path) -> None:
    folder, key_file = tmp_path / "disk", tmp_path / "disk.key"
    load_key(key_file)
    os.chown(key_file, 12345, 12345)  # planted by someone who could write the parent folder
    assert "belongs to uid 12345" in refused(key_file, folder)


def test_replicas_that_start_together_read_the_first_ones_key(tmp_path: Path) -> None:
    key_file = tmp_path / "disk.key"
    start = threading.Barrier(8)
    keys: list[bytes] = []

    def replica() -> None:
        start.wait()
        keys.append(load_key(key_file))

    threads = [threading.Thread(target=replica) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(keys) == 8 and len(set(keys)) == 1
    assert keys[0] == key_file.read_bytes().strip()
    assert [path.name for path in tmp_path.iterdir()] == ["disk.key"]  # no staging left
