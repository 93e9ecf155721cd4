"""What a tier signs its values with: an HMAC over each value's key and the value, made with
a secret that whoever else can write the storage (a shared Redis, the disk tier's folder)
does not hold. Redis's secret is REDIS_CACHE_SECRET; the disk tier's is DISK_CACHE_SECRET, or
else a random key it keeps in a file outside its folder (`load_key`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import secrets
import stat
import struct
from pathlib import Path

MAC_BYTES = hashlib.sha256().digest_size
_KEY_LENGTH = struct.Struct("<I")
# A key file holds a secret as DISK_CACHE_SECRET does (its text is the key), so that its text
# can be handed to another replica as that setting: 32 random bytes, in hex.
_NEW_KEY_BYTES = 32
MIN_KEY_CHARS = 16  # as the secrets' settings require
_MAX_KEY_FILE_BYTES = 4096


def mac(secret: bytes, key: str, body: bytes) -> bytes:
    """HMAC-SHA256 of the key (its length first, so key and body cannot trade bytes) and the
    value's body: a value copied to another key, or forged without the secret, does not
    carry it."""
    encoded = key.encode()
    signer = _keyed(secret).copy()
    signer.update(_KEY_LENGTH.pack(len(encoded)) + encoded + body)
    return signer.digest()


@functools.lru_cache(maxsize=8)
def _keyed(secret: bytes) -> hmac.HMAC:
    """An HMAC keyed with `secret`, fed nothing. Each MAC starts from a copy of it: OpenSSL 3
    takes longer to set a key up than to hash a value, and a disk hit's MAC is computed on
    the event loop (a copy's MAC took 2.1 µs, `hmac.digest`'s 3.5, on 2 busy cores)."""
    return hmac.new(secret, digestmod=hashlib.sha256)


class KeyFileError(Exception):
    """A key file this process must not trust: not its own, readable by others, not a file."""


def default_key_file(folder: Path) -> Path:
    """Where the disk tier keeps its key by default: beside its folder (`<folder>.key`), not
    in it, as whoever can write the folder must not be able to replace the key."""
    absolute = folder.resolve()
    return absolute.with_name(f"{absolute.name}.key")


def load_key(path: Path) -> bytes:
    """The key kept in `path`, made there first if there is none. Refused (KeyFileError) unless
    it is a regular file of this process's user that no one else can read or write: one
    planted by someone else would choose the answers the tier serves."""
    try:
        return _read_key(path)
    except FileNotFoundError:
        _create_key(path)
        return _read_key(path)


def _read_key(path: Path) -> bytes:
    # Not through a link (which could point at anyone's file), and without blocking on a
    # FIFO planted in its place: the checks below then refuse anything but a plain file.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileError(f"key file {path} is not a regular file")
        if info.st_uid != os.geteuid():
            raise KeyFileError(
                f"key file {path} belongs to uid {info.st_uid}, not to this process's "
                f"({os.geteuid()}): remove it, or set DISK_CACHE_SECRET"
            )
        if info.st_mode & 0o077:
            raise KeyFileError(
                f"key file {path} can be read or written by others "
                f"(mode {stat.S_IMODE(info.st_mode):o}): chmod 600 it, or set DISK_CACHE_SECRET"
            )
        key = os.read(fd, _MAX_KEY_FILE_BYTES).strip()
    finally:
        os.close(fd)
    if len(key) < MIN_KEY_CHARS:
        raise KeyFileError(f"key file {path} holds fewer than {MIN_KEY_CHARS} characters")
    return key


def _create_key(path: Path) -> None:
    """A new random key in `path`, whole or not at all: written to a file of its own (mode
    0600), then linked into place, which never replaces a file there. Replicas that start
    together on one folder thus all read the first one's key."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{secrets.token_hex(8)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(staging, flags, 0o600)
    try:
        try:
            os.write(fd, f"{secrets.token_hex(_NEW_KEY_BYTES)}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another's, made meanwhile, is the key
            os.link(staging, path)
    finally:
        staging.unlink(missing_ok=True)
