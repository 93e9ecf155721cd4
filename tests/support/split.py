"""The split as the service runs it, for tests: a model side and its front end, two real
processes on one socket."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import simulated_entry, write_models_file

FRONT_END = ("front-end",)


@contextmanager
def split(folder: Path, env: dict[str, str]) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """The model side, then its front end, both ready; the front end's /ready is the model
    side's, forwarded."""
    socket = {"SPLIT_SOCKET": str(folder / "model.sock"), **env}
    with run_server(socket, folder) as model_side:
        model_side.wait_ready()
        with run_server(socket, folder, FRONT_END) as front_end:
            front_end.wait_ready()
            yield model_side, front_end


def simulated_split_env(folder: Path, seconds_per_batch: float) -> dict[str, str]:
    cost = {"seconds_per_batch": seconds_per_batch, "seconds_per_token": 0.0}
    entry = simulated_entry(simulated=cost)
    return {
        "MODELS_FILE": str(write_models_file(folder / "models.yaml", [entry])),
        "DISK_CACHE_DIR": str(folder / "cache"),
        "ADMISSION_CONTROL": "false",
    }
