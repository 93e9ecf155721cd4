"""A CPU model's forwards spread over worker processes of a few torch threads each.

In one process a CPU forward shares its cores with the event loop, and loses more than the
loop takes: torch's OpenMP team waits at every parallel region for a thread the loop has
descheduled, and the forward takes the GIL back between ops, so each burst of the loop's work
pauses it (bench/reports/measured_in_tests.md). With FORWARD_PROCESSES=n each CPU model is
loaded again in n worker processes, torch on TORCH_NUM_THREADS / n threads in each; a batch is
cut into parts of about equal tokens, which the workers take as they finish one, and the
logits come back in the batch's order. A process taken off its core delays its own part only.

Under per-token int8 a text's logits do not depend on its batch-mates (api.models.packing),
so the parts give what the whole batch gives, to the bit; in float32 they move by rounding, as
batching moves them in one process. The workers must also give this process's own logits for
the probe batch, to the bit, or the model forwards here instead. This process keeps its own
copy: the warm-up and the probes run on it, adapters attach to it first, a batch too small to
cut runs on it, and it forwards again, with the same answers, if a worker fails or exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import cast

import numpy
import torch

from api.models.adapters import CheckedAdapter
from api.models.faults import ForwardProcessLost, one_line
from api.models.loader import load_model
from api.models.predictor import Predictor, probe_lengths
from api.models.spec import ModelSpec
from api.observability.logs import configure_logging, quiet_libraries
from api.settings import Settings

logger = logging.getLogger(__name__)

# A worker loads the model as this process did (seconds to a minute); one that has not
# greeted by then is taken to be stuck.
READY_TIMEOUT_SECONDS = 600.0
# Parts a batch is cut into, per worker: more balance the workers where another process takes
# a core from one of them, and cost each part a forward's fixed overhead.
# Measured on 2 cores at 32 clients: 2 parts a worker served 1.2 times 1 part's and 4 parts'.
PARTS_PER_WORKER = 2
# Fewest rows in a part. A batch too small for two such parts runs in the serving process, on
# all of its threads: cut in parts of a row or two, it ran slower in the workers (at 4 clients
# of one text a request, 0.68 of one process's rate on 2 cores).
ROWS_PER_PART = 4
# Asked to stop, a worker ends its forward and exits; one that does not is killed.
STOP_SECONDS = 5.0


@dataclass(frozen=True)
class WorkerSetup:
    """What a worker needs to load the model as the serving process did."""

    spec: ModelSpec
    settings: Settings
    threads: int
    packs_batches: bool
    scores_alone: bool
    warm_up: tuple[int, int] | None  # (max batch size, max batch tokens); None: no warm-up


@dataclass(frozen=True)
class Logits:
    """Rows' logits on the worker, in the order asked."""

    rows: list[list[int]]
    adapters: list[str | None]


@dataclass(frozen=True)
class Attach:
    name: str
    checked: CheckedAdapter


@dataclass(frozen=True)
class Detach:
    name: str


@dataclass(frozen=True)
class Refused:
    """The worker's own failure at a request (a forward's out-of-memory, an adapter error)."""

    message: str


Request = Logits | Attach | Detach


class ForwardProcesses:
    """The workers of one model, each behind a pipe. Used from the model's device thread
    only, one batch at a time, as the Predictor itself."""

    def __init__(self, name: str, workers: list[tuple[BaseProcess, Connection]]) -> None:
        self.name = name
        self._workers = workers

    @property
    def count(self) -> int:
        return len(self._workers)

    @property
    def pids(self) -> list[int]:
        """The workers' process ids."""
        return [process.pid for process, _ in self._workers if process.pid is not None]

    @classmethod
    def start(
        cls,
        predictor: Predictor,
        settings: Settings,
        count: int,
        warm_up: tuple[int, int] | None,
    ) -> ForwardProcesses:
        """`count` workers holding `predictor`'s model, each warmed up at `warm_up`'s (max
        batch size, max batch tokens) where given, and checked against `predictor`; a
        ForwardProcessLost if one fails to load or gives other logits."""
        loaded = predictor.loaded
        threads = max(1, (settings.torch_threads or torch.get_num_threads()) // count)
        setup = WorkerSetup(
            loaded.spec,
            # A worker serves its own forwards: none of its own to spread.
            settings.model_copy(update={"forward_processes": 1, "torch_num_threads": threads}),
            threads,
            predictor.packs_batches,
            predictor.scores_alone,
            warm_up,
        )
        context = multiprocessing.get_context("spawn")
        workers: list[tuple[BaseProcess, Connection]] = []
        processes = cls(loaded.spec.name, workers)
        try:
            for index in range(count):
                mine, theirs = context.Pipe()
                process = context.Process(
                    target=serve,
                    args=(theirs, setup),
                    name=f"forward-{loaded.spec.name}-{index}",
                    daemon=True,  # stopped with this process, whatever stops it
                )
                process.start()
                theirs.close()
                workers.append((process, mine))
            for started, connection in workers:
                processes._greeted(started, connection)
            processes._check_against(predictor)
        except BaseException:
            processes.close()
            raise
        logger.info(
            "model %s forwards in %d processes of %d torch threads each",
            loaded.spec.name,
            count,
            threads,
        )
        return processes

    def takes(self, rows: int) -> bool:
        """A batch of this many rows runs in the workers: it makes two parts at least."""
        return rows >= 2 * ROWS_PER_PART

    def logits(self, batch: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
        """The batch's logits, its parts run at once: each worker takes the next part as it
        finishes one, so a worker whose core is taken meanwhile takes fewer."""
        count = min(self.count * PARTS_PER_WORKER, len(batch) // ROWS_PER_PART)
        parts = split_by_tokens([len(row) for row in batch], max(1, count))
        answers: list[numpy.ndarray | Refused | str | None] = [None] * len(parts)
        doing: dict[Connection, tuple[BaseProcess, int]] = {}
        following = iter(range(len(parts)))

        def give(process: BaseProcess, connection: Connection) -> None:
            index = next(following, None)
            if index is not None:
                start, end = parts[index]
                self._send(process, connection, Logits(batch[start:end], adapters[start:end]))
                doing[connection] = (process, index)

        for process, connection in self._workers:
            give(process, connection)
        while doing:
            for ready in wait(list(doing)):
                assert isinstance(ready, Connection)
                process, index = doing.pop(ready)
                answers[index] = self._receive(process, ready)
                give(process, ready)
        refused = [answer for answer in answers if isinstance(answer, Refused)]
        if refused:
            raise RuntimeError(refused[0].message)
        return torch.cat([torch.from_numpy(cast(numpy.ndarray, answer)) for answer in answers])

    def attach_adapter(self, name: str, checked: CheckedAdapter) -> None:
        self._everywhere(Attach(name, checked))

    def detach_adapter(self, name: str) -> None:
        self._everywhere(Detach(name))

    def close(self) -> None:
        """Stops every worker: asked first, killed if it does not exit."""
        for _, connection in self._workers:
            with suppress(OSError):  # gone already
                connection.send(None)
            connection.close()
        for process, _ in self._workers:
            process.join(STOP_SECONDS)
            if process.is_alive():
                process.kill()
                process.join()
        self._workers.clear()

    def _everywhere(self, request: Attach | Detach) -> None:
        """`request` done by every worker; a worker that refuses it leaves the workers apart
        from this process: they are lost."""
        for process, connection in self._workers:
            self._send(process, connection, request)
        for process, connection in self._workers:
            answer = self._receive(process, connection)
            if isinstance(answer, Refused):
                raise ForwardProcessLost(
                    f"a forward process of model {self.name} refused what its serving process "
                    f"did: {answer.message}"
                )

    def _greeted(self, process: BaseProcess, connection: Connection) -> None:
        if not connection.poll(READY_TIMEOUT_SECONDS):
            raise ForwardProcessLost(
                f"a forward process of model {self.name} was not ready in "
                f"{READY_TIMEOUT_SECONDS:.0f} s"
            )
        answer = self._receive(process, connection)
        if isinstance(answer, Refused):
            raise ForwardProcessLost(
                f"a forward process of model {self.name} failed to load it: {answer.message}"
            )

    def _check_against(self, predictor: Predictor) -> None:
        """Each worker's logits for the probe batch, whole, equal this process's."""
        rows = predictor.probe_rows(probe_lengths(predictor.max_length))
        adapters = [predictor.loaded.spec.active_default_adapter] * len(rows)
        expected = predictor.logits_here(rows, adapters).float()
        for process, connection in self._workers:
            self._send(process, connection, Logits(rows, adapters))
            answer = self._receive(process, connection)
            if isinstance(answer, Refused) or not torch.equal(torch.from_numpy(answer), expected):
                raise ForwardProcessLost(
                    f"a forward process of model {self.name} gives other logits than its "
                    "serving process for the probe batch"
                )

    def _send(self, process: BaseProcess, connection: Connection, request: Request) -> None:
        try:
            connection.send(request)
        except OSError:
            raise self._lost(process) from None

    def _receive(
        self, process: BaseProcess, connection: Connection
    ) -> numpy.ndarray | Refused | str:
        try:
            answer = connection.recv()
        except (EOFError, OSError):
            raise self._lost(process) from None
        if not isinstance(answer, numpy.ndarray | Refused | str):
            raise ForwardProcessLost(
                f"a forward process of model {self.name} answered a {type(answer).__name__}"
            )
        return answer

    def _lost(self, process: BaseProcess) -> ForwardProcessLost:
        process.join(1.0)
        return ForwardProcessLost(
            f"forward process {process.pid} of model {self.name} exited "
            f"(exit code {process.exitcode})"
        )


def split_by_tokens(lengths: Sequence[int], parts: int) -> list[tuple[int, int]]:
    """min(parts, rows) consecutive (start, end) slices of rows of these lengths, none
    empty, each near an equal share of the tokens the slices after the last cut hold: a row
    starts the next slice where taking it would overshoot the share by more than leaving it
    out falls short."""
    slices: list[tuple[int, int]] = []
    start, taken = 0, 0
    tokens_left, parts_left = sum(lengths), min(parts, len(lengths))
    for index, length in enumerate(lengths):
        share = tokens_left / parts_left
        if index > start and parts_left > 1 and share - taken < taken + length - share:
            slices.append((start, index))
            tokens_left, parts_left = tokens_left - taken, parts_left - 1
            start, taken = index, 0
        taken += length
        rows_after = len(lengths) - index - 1
        if parts_left > 1 and (taken >= tokens_left / parts_left or rows_after == parts_left - 1):
            slices.append((start, index + 1))
            tokens_left, parts_left = tokens_left - taken, parts_left - 1
            start, taken = index + 1, 0
    if start < len(lengths):
        slices.append((start, len(lengths)))
    return slices


def serve(connection: Connection, setup: WorkerSetup) -> None:
    """A worker's life: loads the model as its serving process did, greets it, then answers
    each request until told to stop (None) or its serving process is gone."""
    # Ctrl-C reaches the whole process group: the serving process stops its workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Its lines as its serving process writes them (JSON where it writes JSON).
    configure_logging(setup.settings.log_level, setup.settings.log_format)
    quiet_libraries()
    torch.set_num_threads(setup.threads)
    try:
        predictor = _load(setup)
    except Exception as exc:
        connection.send(Refused(one_line(exc)))
        return
    connection.send("ready")
    while True:
        try:
            request = connection.recv()
        except (EOFError, OSError):
            return  # the serving process is gone
        if request is None:
            return
        try:
            connection.send(_answer(predictor, request))
        except (BrokenPipeError, ConnectionResetError):
            return


def _load(setup: WorkerSetup) -> Predictor:
    predictor = Predictor(load_model(setup.spec, setup.settings), setup.settings.pad_to_multiple_of)
    if setup.packs_batches and not predictor.enable_packing():
        raise RuntimeError("the model does not pack here as it does in its serving process")
    predictor.scores_alone = setup.scores_alone
    if setup.warm_up is not None:
        predictor.warm_up(*setup.warm_up)
    return predictor


def _answer(predictor: Predictor, request: Request) -> numpy.ndarray | Refused | str:
    try:
        if isinstance(request, Logits):
            logits = predictor.logits_here(request.rows, request.adapters)
            return logits.float().numpy()
        if isinstance(request, Attach):
            predictor.attach_adapter(request.name, request.checked)
        else:
            predictor.detach_adapter(request.name)
    except Exception as exc:
        return Refused(one_line(exc))
    return "done"
