"""The `loraserve` command: read settings, build the app, run uvicorn, exit with a status."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from api.allocator import restart_on_jemalloc
from api.cpus import CpuPinningError, format_cpu_list, pin_process
from api.observability import tracing
from api.observability.logs import configure_logging, quiet_libraries
from api.observability.tracing import TracingConfigError
from api.settings import Settings, SettingsError, load_settings

# The service's own modules bring torch, transformers, peft and bitsandbytes, which log as
# they are imported: imported in the functions, once the process's logging is set up, so
# those lines come out in LOG_FORMAT too.
if TYPE_CHECKING:
    from api.http.split.child import FrontEnds
    from api.service.contract import Classifier

logger = logging.getLogger(__name__)

EXIT_BAD_SETTINGS = 2
EXIT_LOAD_FAILED = 1
EXIT_DEVICE_FAILED = 3
EXIT_FRONT_END_FAILED = 4


class Server(uvicorn.Server):
    """uvicorn that drains on SIGTERM/SIGINT and then exits 0.

    On the signal `/ready` and new requests answer 503 at once, while requests already
    accepted finish (at most DRAIN_SECONDS); only then does uvicorn close its sockets. Plain
    uvicorn stops accepting at once and re-raises the signal, so the process ends with 143.
    A fatal device error drains the same way, then the process exits with EXIT_DEVICE_FAILED.
    With SPLIT_FRONT_END its front ends are signalled first and this process drains once they
    have gone; a front end that dies on its own stops it with EXIT_FRONT_END_FAILED.
    """

    service: Classifier | None = None
    fatal_error: BaseException | None = None
    drain_seconds: float = 10.0
    front_ends: FrontEnds | None = None  # SPLIT_FRONT_END's children, stopped first
    _drain: asyncio.Task[None] | None = None
    _deferred_signal: int | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        front_ends = self.front_ends
        if front_ends is not None and not self.should_exit and not front_ends.all_exited():
            # The front ends drain first: their requests in flight need these models to
            # finish. This process goes on serving them, and drains once they have gone.
            if front_ends.stopping and sig == signal.SIGINT:
                front_ends.kill_now()  # a second Ctrl-C stops without waiting
            front_ends.stop()
            self._deferred_signal = sig
            return
        self._exit_on(sig)

    async def on_tick(self, counter: int) -> bool:
        front_ends = self.front_ends
        if front_ends is not None and not self.should_exit and self._drain is None:
            front_ends.kill_if_overdue()
            if self._deferred_signal is not None:
                if front_ends.all_exited():
                    self._exit_on(self._deferred_signal)
            elif (code := front_ends.exited()) is not None:
                from api.http.split.child import FrontEndExited

                self.fatal_error = FrontEndExited(f"the front end exited with {code}")
                self.should_exit = True
        return await super().on_tick(counter)

    def _exit_on(self, sig: int) -> None:
        if self.should_exit or self._drain is not None:
            if sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C stops without waiting
            self.should_exit = True
            return
        from api.service.contract import Phase

        service = self.service
        if service is None or service.phase is not Phase.READY:
            self.should_exit = True
            return
        service.begin_drain()
        loop = asyncio.get_event_loop()
        loop.call_soon_threadsafe(self._start_drain, loop)

    def stop_on_fatal(self, error: BaseException) -> None:
        """Stops with `error` as the reason. After a fatal device error (/ready already 503)
        the requests in flight still get their answers, within the drain time, as on
        SIGTERM; a failed load stops at once. Called on the event loop."""
        from api.service.core import DeviceFailed

        self.fatal_error = error
        if isinstance(error, DeviceFailed) and self.service is not None and self._drain is None:
            self._start_drain(asyncio.get_running_loop())
        else:
            self.should_exit = True

    def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
        self._drain = loop.create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        assert self.service is not None
        started = time.monotonic()
        deadline = started + self.drain_seconds
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.service.in_flight:
            logger.warning(
                "drain: DRAIN_SECONDS (%g s) ran out with %d accepted requests unanswered; "
                "they are answered 503",
                self.drain_seconds,
                self.service.in_flight,
            )
            # Answered now, not cut off unanswered by the server's own shutdown.
            self.service.abandon_unanswered(f"DRAIN_SECONDS ({self.drain_seconds:g} s) ran out")
        else:
            logger.info(
                "drained in %.2f s: every accepted request answered", time.monotonic() - started
            )
        self.should_exit = True


def build_server(
    settings: Settings,
    log_config: dict[str, Any] | None = None,
    front_end: bool = False,
    uds: Path | None = None,
) -> Server:
    """The configured server with its app; the models load once it runs. `log_config` is
    the process's logging (api.observability.logs), which uvicorn applies again. A
    `front_end` serves the split's HTTP, its models in the process on SPLIT_SOCKET. `uds`:
    a Unix socket to serve HTTP on instead of HOST:PORT."""
    from api.http.app import create_app
    from api.http.split.front_end import create_front_end_app
    from api.models.spec import load_models_file

    server: Server

    def stop_on_fatal(error: BaseException) -> None:
        server.stop_on_fatal(error)

    if front_end:
        app = create_front_end_app(settings)
    else:
        specs = load_models_file(settings.models_file, settings.adapter_dirs)
        app = create_app(settings, specs, on_fatal=stop_on_fatal)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        uds=None if uds is None else str(uds),
        log_level=settings.log_level,
        log_config=log_config,
        lifespan="on",
        access_log=False,
        timeout_graceful_shutdown=max(1, round(settings.drain_seconds)),
    )
    server = Server(config)
    server.service = app.state.service
    server.drain_seconds = settings.drain_seconds
    return server


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script: no arguments (or `serve`) serves; `score` and
    `evaluate` score a file (api.batch)."""
    arguments = sys.argv[1:] if argv is None else argv
    if not arguments:
        return serve()
    from api.batch.commands import add_commands, run_command

    parser = argparse.ArgumentParser(
        prog="loraserve",
        description="Serve LoRA text classifiers (no command: serve, as `serve`), or score "
        "and evaluate files with them.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser("serve", help="serve the models over HTTP (the default)")
    commands.add_parser(
        "front-end",
        help="serve HTTP only, the models being served by `loraserve` on SPLIT_SOCKET",
    )
    add_commands(commands)
    args = parser.parse_args(arguments)
    if args.command in (None, "serve"):
        return serve()
    if args.command == "front-end":
        return serve(front_end=True)
    return run_command(args)


def pinned_as_set(settings: Settings, front_end: bool) -> bool:
    """This process on the CPUs its setting names (FRONT_END_CPUS for a front end, else
    MODEL_CPUS), if set; False, logged, when they cannot be had."""
    cpus, setting = (
        (settings.front_end_cpus, "FRONT_END_CPUS")
        if front_end
        else (settings.model_cpus, "MODEL_CPUS")
    )
    if cpus is None:
        return True
    try:
        pin_process(cpus, setting)
    except CpuPinningError as exc:
        logger.critical("loraserve: %s", exc)
        return False
    logger.info("running on CPUs %s (%s)", format_cpu_list(cpus), setting)
    return True


def serve(front_end: bool = False) -> int:
    """Serves the models file's models (or, as a `front_end`, the HTTP of those served on
    SPLIT_SOCKET) until stopped; the exit status says how it ended."""
    try:
        settings = load_settings()
    except SettingsError as exc:
        # The settings did not load: LOG_FORMAT is taken as it is in the environment.
        wanted = os.environ.get("LOG_FORMAT", "").strip().lower()
        configure_logging("info", "json" if wanted == "json" else "text")
        logger.critical("loraserve: %s", exc)
        return EXIT_BAD_SETTINGS
    log_config = configure_logging(settings.log_level, settings.log_format)
    if settings.memory_allocator == "jemalloc" and not front_end:
        restart_on_jemalloc()  # returns only where it already runs on it, or none is installed
    from api.http.split.socket_claim import SocketInUse
    from api.models.spec import ModelsFileError
    from api.models.tokenizing import keep_tokenizers_serial
    from api.service.core import DeviceFailed
    from api.serving.cascade import CascadeError

    quiet_libraries()
    keep_tokenizers_serial()
    if front_end and settings.split_socket is None:
        logger.critical("loraserve front-end: SPLIT_SOCKET is not set: the model side's socket")
        return EXIT_BAD_SETTINGS
    listening = None
    if front_end:
        from api.http.split.child import die_with_parent, inherited_listening_socket

        if not die_with_parent():
            logger.critical("loraserve front-end: the process that started it has gone")
            return EXIT_FRONT_END_FAILED
        listening = inherited_listening_socket()
    with contextlib.ExitStack() as cleanup:
        children = None
        uds = None
        if settings.split_front_end and not front_end:
            # The split with one command: the models here, HTTP on HOST:PORT in children; this
            # process's own HTTP on a socket beside the split's, for the operator alone.
            from api.http.split.child import FrontEnds

            folder = Path(
                cleanup.enter_context(tempfile.TemporaryDirectory(prefix="loraserve-split-"))
            )
            split_socket = settings.split_socket or folder / "model.sock"
            settings = settings.model_copy(update={"split_socket": split_socket})
            uds = folder / "model-http.sock"
            address = (settings.host, settings.port)
            try:
                children = FrontEnds(
                    split_socket,
                    settings.drain_seconds,
                    address,
                    settings.front_ends,
                    folder / "front-end-metrics",
                )
            except OSError as exc:
                logger.critical("loraserve: cannot listen on %s:%d: %s", *address, exc)
                return EXIT_BAD_SETTINGS
            cleanup.callback(children.close)  # stopped, whatever they are doing, at the end
        try:
            tracing.configure()
            server = build_server(settings, log_config, front_end, uds)
        except (ModelsFileError, CascadeError, TracingConfigError, SocketInUse) as exc:
            logger.critical("loraserve: %s", exc)
            return EXIT_BAD_SETTINGS
        server.front_ends = children
        try:
            if children is not None:
                children.start()  # before this process is pinned: a child inherits its CPUs
            if not pinned_as_set(settings, front_end):
                return EXIT_BAD_SETTINGS
            server.run(sockets=None if listening is None else [listening])
        finally:
            tracing.shutdown()  # the spans still buffered go out before the process ends
    from api.http.split.child import FrontEndExited

    if isinstance(server.fatal_error, FrontEndExited):
        logger.critical("loraserve: stopped: %s", server.fatal_error)
        return EXIT_FRONT_END_FAILED
    if isinstance(server.fatal_error, DeviceFailed):
        logger.critical("loraserve: stopped by a fatal device error: %s", server.fatal_error)
        return EXIT_DEVICE_FAILED
    if server.fatal_error is not None:
        logger.critical("loraserve: start-up failed: %s", server.fatal_error)
        return EXIT_LOAD_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
