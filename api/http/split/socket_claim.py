"""Who owns SPLIT_SOCKET: the one model side that holds the lock beside it. A second process
started on the same path (another model side, a new one before the old has stopped) is
refused at its start, naming the holder; a model side removes only the socket it made.

The socket is made in a private folder beside its path, with mode 0600, and renamed into
place, so it is never open to others, whatever the umask, not even for an instant.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import tempfile
from pathlib import Path

SOCKET_MODE = 0o600
PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class SocketInUse(RuntimeError):
    """Another live process holds the split's socket."""


class SocketClaim:
    """The lock on `path` (taken at once, or SocketInUse), then the socket bound there."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.with_name(path.name + ".lock")
        self._inode: int | None = None
        self._lock = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, SOCKET_MODE)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._lock, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._lock)
            raise SocketInUse(
                f"SPLIT_SOCKET {path} is held by process {holder} (another model side, or a "
                "server started with the same .env): stop it first, or give this one a "
                "SPLIT_SOCKET of its own"
            ) from None
        os.ftruncate(self._lock, 0)
        os.pwrite(self._lock, f"{os.getpid()}\n".encode(), 0)

    def bind(self) -> socket.socket:
        """A listening socket at `path`, mode 0600; a file left there by a process that has
        gone (it held no lock) is replaced."""
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with tempfile.TemporaryDirectory(dir=self.path.parent, prefix=".split-") as private:
                made = Path(private) / "socket"  # the folder is 0700: nobody else reaches it
                listening.bind(str(made))
                made.chmod(SOCKET_MODE)
                made.rename(self.path)
            listening.listen(socket.SOMAXCONN)
        except BaseException:
            listening.close()
            raise
        self._inode = self.path.stat().st_ino
        listening.setblocking(False)
        return listening

    def release(self) -> None:
        """Removes the socket if it is still the one this claim bound, then lets the lock go."""
        with contextlib.suppress(FileNotFoundError):
            if self._inode is not None and self.path.stat().st_ino == self._inode:
                self.path.unlink()
        self._inode = None
        with contextlib.suppress(OSError):
            os.close(self._lock)


def peer_uid(connection: socket.socket) -> int:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    _, uid, _ = PEER_CREDENTIALS.unpack(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size)
    )
    return int(uid)
