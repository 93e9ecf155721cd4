"""Shared cache folders: what writers killed mid-way left is removed at the next start, and
only that: a live writer's staging folder, here or on another machine, is never touched."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from api.models.convert.staging import STALE_AFTER_SECONDS, process_owner, staging_folder_for
from tests.support.server_process import run_server
from tests.support.tiny_models import TinyModel, tiny_models_file

# Another machine's (or pid namespace's) writer, pid 1 as in every pod.
ELSEWHERE = "0123456789abcdef.1.4242"


def staged(out_folder: Path, owner: str, quiet_seconds: float = 0.0) -> Path:
    """A staging folder with a half-written file in it, nothing changed for `quiet_seconds`."""
    folder = staging_folder_for(out_folder, owner)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"half")
    then = time.time() - quiet_seconds
    for path in (folder / "model.safetensors", folder):
        os.utime(path, (then, then))
    return folder


def test_a_start_removes_what_dead_writers_left_and_keeps_the_live_ones(
    tiny_bert: TinyModel, tmp_path: Path
) -> None:
    cache = tmp_path / "model-cache"
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = staged(cache / "prequantized" / ("a" * 64), process_owner(writer.pid))
    writer.kill()
    writer.wait()
    # This test's own process is a live writer on this machine, however long it is quiet.
    live_here = staged(cache / "gguf" / ("b" * 64), process_owner(os.getpid()), 86_400)
    quiet_elsewhere = staged(
        cache / "exaone-llama" / "adapters" / ("c" * 64), ELSEWHERE, STALE_AFTER_SECONDS + 60
    )
    busy_elsewhere = staged(cache / "prequantized" / ("d" * 64), ELSEWHERE, 60)

    env = {
        "MODELS_FILE": str(tiny_models_file(tmp_path, tiny_bert, adapters=("spam",))),
        "MODEL_CACHE_DIR": str(cache),
    }
    with run_server(env, tmp_path) as server:
        server.wait_ready()
        log = server.log()

    assert not killed.exists() and not quiet_elsewhere.exists()
    assert live_here.is_dir() and busy_elsewhere.is_dir()
    assert (live_here / "model.safetensors").read_bytes() == b"half"
    assert str(killed) in log and str(quiet_elsewhere) in log
    leftovers = [p.name for p in cache.rglob(".*") if ".removing-" in p.name]
    assert leftovers == []
