"""HAProxy (Debian's package) on loopback in front of real server processes, running the
project's docker/haproxy/haproxy.cfg with only its addresses changed."""

from __future__ import annotations

import csv
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.in_process import wait_for
from tests.support.server_process import REPO_ROOT, ServerProcess, free_port

HAPROXY_CONFIG = REPO_ROOT / "docker" / "haproxy" / "haproxy.cfg"
INSTALL = "apt-get install -y haproxy  (`make test` does it)"


def haproxy_binary() -> str:
    """HAProxy's path (Debian puts it in /usr/sbin); a missing one fails, saying how to
    install it."""
    binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if binary is None:
        pytest.fail(f"haproxy is not installed; install it with: {INSTALL}")
    return binary


@dataclass
class Balancer:
    """HAProxy's front door and its stats page."""

    url: str
    stats_url: str

    def servers(self) -> dict[str, dict[str, str]]:
        """The stats CSV's row of each server of the backend, by server name."""
        text = httpx.get(f"{self.stats_url};csv", timeout=5).text.removeprefix("# ")
        return {
            row["svname"]: row
            for row in csv.DictReader(text.splitlines())
            if row["pxname"] == "replicas" and row["svname"] not in ("FRONTEND", "BACKEND")
        }


def haproxy_config(folder: Path, port: int, stats_port: int, servers: list[str]) -> Path:
    """The project's HAProxy config with loopback addresses: the front door, the stats page,
    and the replicas in place of the DNS-discovered ones. Nothing else changes."""
    config = HAPROXY_CONFIG.read_text(encoding="utf-8")
    lines = [f"    server replica{i} {address}" for i, address in enumerate(servers, 1)]
    for old, new in (
        ("    bind :8080\n", f"    bind 127.0.0.1:{port}\n"),
        ("    bind :8404\n", f"    bind 127.0.0.1:{stats_port}\n"),
    ):
        assert config.count(old) == 1, f"haproxy.cfg no longer has {old!r}: update this test"
        config = config.replace(old, new)
    [template] = [line for line in config.splitlines() if line.startswith("    server-template ")]
    config = config.replace(template, "\n".join(lines))
    path = folder / "haproxy.cfg"
    path.write_text(config, encoding="utf-8")
    return path


@contextmanager
def load_balancer(folder: Path, replicas: list[ServerProcess]) -> Iterator[Balancer]:
    """HAProxy on loopback in front of `replicas`, once its checks see every one ready."""
    binary = haproxy_binary()
    port, stats_port = free_port(), free_port()
    servers = [replica.url.removeprefix("http://") for replica in replicas]
    config = haproxy_config(folder, port, stats_port, servers)
    log_path = folder / "haproxy.log"
    with log_path.open("w", encoding="utf-8") as log:
        process = subprocess.Popen([binary, "-db", "-f", str(config)], stdout=log, stderr=log)
    balancer = Balancer(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{stats_port}/stats")
    try:

        def all_up() -> bool:
            assert process.poll() is None, log_path.read_text(encoding="utf-8")
            try:
                rows = balancer.servers()
            except httpx.TransportError:
                return False
            return len(rows) == len(replicas) and all(r["status"] == "UP" for r in rows.values())

        wait_for(all_up, 30, "HAProxy sees every replica up")
        yield balancer
    finally:
        process.terminate()
        process.wait(timeout=10)
