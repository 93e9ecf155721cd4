"""Real server processes that share one Redis, each with its own disk cache."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.support.redis_server import RedisServer
from tests.support.server_process import ServerProcess, run_server
from tests.support.tiny_models import TinyModel, tiny_models_file


@contextmanager
def replicas(
    count: int, tiny: TinyModel, redis: RedisServer, folder: Path, **settings: str
) -> Iterator[list[ServerProcess]]:
    """`count` real server processes sharing one Redis, each with its own disk cache, and
    the given `settings` (SETTING_NAME=value) besides."""
    models = tiny_models_file(folder, tiny, adapters=("spam",))
    with ExitStack() as stack:
        started = []
        for index in range(count):
            env = {
                "MODELS_FILE": str(models),
                "REDIS_URL": redis.url,
                "REDIS_CACHE_SECRET": "a secret the replicas share",
                "DISK_CACHE_DIR": str(folder / f"disk-{index}"),
                **settings,
            }
            started.append(stack.enter_context(run_server(env, folder)))
        for server in started:
            server.wait_ready()
        yield started
