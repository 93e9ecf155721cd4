"""The adapters one model serves: its own (the models file's, as they are) and those loaded at
run time, which are checked before use, attached between batches, swapped atomically, evicted
least recently used, and unloaded once the requests holding them are answered."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import partial
from pathlib import Path
from typing import Any, Literal

from api.metrics import ADAPTER_LOAD_RESULTS, Metrics
from api.models.adapter_check import check_adapter
from api.models.adapters import AdapterError, CheckedAdapter
from api.models.registry import ServedModel, UnknownName
from api.serving.batching import BatchFailed
from api.serving.errors import DeadlineExceeded
from api.serving.identity import AnswerIdentity

logger = logging.getLogger(__name__)

Source = Literal["models_file", "api", "folder"]
# Joins an adapter's name and its version's number in the peft name the version runs under;
# no adapter name holds it, so a version's peft name can never be another adapter's.
VERSION_MARK = "@"


class AdapterRefused(Exception):
    """An adapter that failed its checks; nothing changed. The message names it and why."""


class AdapterConflict(Exception):
    """A load or unload the model's adapters cannot take as they stand: a model without
    run-time adapters, a name the models file or the watched folder owns, pins over the limit."""


@dataclass(eq=False)
class Version:
    """One set of weights of a run-time adapter, attached under its own peft name. A request's
    rows name the version it was accepted with, so a swap never moves it to other weights."""

    peft_name: str
    checked: CheckedAdapter
    identity: AnswerIdentity
    last_used: float = field(default_factory=time.monotonic)
    resident: bool = False  # attached, or to be once `op` (an attach) is done
    retired: bool = False  # swapped out or unloaded: detached once its last lease is back
    leases: int = 0
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while leases == 0
    op: asyncio.Task[float] | None = None  # the last attach or detach scheduled

    def __post_init__(self) -> None:
        self.idle.set()


@dataclass(eq=False)
class RuntimeAdapter:
    """A run-time adapter by name: where it came from, and the version it serves now."""

    name: str
    source: Source
    folder: Path
    pinned: bool
    version: Version
    loaded_at: datetime
    requests: int = 0


@dataclass(frozen=True)
class Lease:
    """What one request runs with: the peft adapter its rows name and the identity its
    answers are cached under. A run-time version stays attached until the lease is back."""

    adapter: str | None
    identity: AnswerIdentity
    version: Version | None = None


@dataclass(frozen=True)
class AdapterInfo:
    """One adapter as `GET /v1/adapters` lists it."""

    name: str
    source: Source
    path: str
    digest: str | None
    rank: int | None
    pinned: bool
    resident: bool
    loaded_at: datetime | None
    requests: int
    identity: str


@dataclass(frozen=True)
class LoadResult:
    """What a load did (loaded, swapped or unchanged), to which adapter, in how long, and how
    long of that the model's forwards paused for the attach."""

    result: str
    adapter: AdapterInfo
    seconds: float
    attach_seconds: float = 0.0


class AdapterSet:
    """Every adapter of one served model, and the one place that says which weights and which
    answer identity a request's adapter name stands for.

    Run-time adapters attach and detach on the model's device thread while holding the
    device's batch slot, so never during a forward. Only the event loop touches this object.
    """

    def __init__(
        self,
        served: ServedModel,
        device: Executor,
        device_slot: asyncio.Semaphore,
        max_resident: int,
        max_rank: int,
        metrics: Metrics,
    ) -> None:
        self.served = served
        self.max_resident = max_resident
        self._device = device
        self._slot = device_slot
        self._max_rank = max_rank
        self._metrics = metrics
        declared: list[str | None] = [*served.loaded.adapters] or [None]
        self._declared = {name: AnswerIdentity.of(served, name) for name in declared}
        self._declared_requests = dict.fromkeys(declared, 0)
        self._adapters: dict[str, RuntimeAdapter] = {}
        self._versions = 0
        self._changing = asyncio.Lock()  # one load or unload at a time
        # Why a run-time adapter must stay (its rollout's say: the default, a candidate);
        # None: it may go. Set by the service core.
        self.in_use: Callable[[str], str | None] = lambda name: None
        self._tasks: set[asyncio.Task[float]] = set()
        name = served.name
        for result in ADAPTER_LOAD_RESULTS:
            metrics.adapter_loads.labels(name, result)
        metrics.adapter_load_seconds.labels(name)
        metrics.adapter_evictions.labels(name)
        metrics.adapters_resident.labels(name).set_function(self.resident_count)

    @property
    def accepts_runtime(self) -> bool:
        """The models file declared this model with `runtime_adapters: true`."""
        return self.served.loaded.spec.runtime_adapters

    def resident_count(self) -> int:
        """Run-time adapters attached (or being attached) now."""
        return sum(adapter.version.resident for adapter in self._adapters.values())

    def identities(self) -> dict[str | None, AnswerIdentity]:
        """Each adapter's answer identity: the models file's, then the run-time ones'."""
        identities = dict(self._declared)
        for name, adapter in self._adapters.items():
            identities[name] = adapter.version.identity
        return identities

    def folder_names(self) -> list[str]:
        """The run-time adapters that the watched folder loaded."""
        return [name for name, adapter in self._adapters.items() if adapter.source == "folder"]

    def answer_identity(self, name: str | None) -> AnswerIdentity:
        """The identity adapter `name` (as `ServedModel.adapter_for` resolved it) answers under
        now, attaching nothing: a request asks the caches with it first. Called once per
        request, which it counts."""
        runtime = self._adapters.get(name) if name is not None else None
        if runtime is not None:
            runtime.requests += 1
            return runtime.version.identity
        if name not in self._declared:  # unloaded since the route resolved it
            raise UnknownName(f"model {self.served.name!r} has no adapter {name!r}")
        self._declared_requests[name] += 1
        return self._declared[name]

    async def lease(self, name: str | None, deadline: float) -> Lease:
        """Holds adapter `name` (as `ServedModel.adapter_for` resolved it) for one request's
        texts that no cache holds; an evicted one is attached again first, within `deadline`
        (monotonic clock)."""
        runtime = self._adapters.get(name) if name is not None else None
        if runtime is None or name is None:
            if name not in self._declared:  # unloaded since the route resolved it
                raise UnknownName(f"model {self.served.name!r} has no adapter {name!r}")
            return Lease(name, self._declared[name])
        version = runtime.version
        version.leases += 1
        version.idle.clear()
        version.last_used = time.monotonic()
        lease = Lease(version.peft_name, version.identity, version)
        try:
            if not version.resident:
                self._attach_again(version)
            if version.op is not None and not version.op.done():
                await self._until_attached(name, version.op, deadline)
        except BaseException:
            self.release(lease)
            raise
        return lease

    async def _until_attached(self, name: str, op: asyncio.Task[float], deadline: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(op), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise DeadlineExceeded(
                f"adapter {name!r} was not attached again within the request's deadline"
            ) from None
        except Exception as exc:
            raise BatchFailed(f"adapter {name!r} cannot be attached: {exc}") from None

    def release(self, lease: Lease) -> None:
        """Gives a lease back: a retired version leaves with its last one, and an adapter
        over the residency limit may now be evicted."""
        version = lease.version
        if version is None:
            return
        version.leases -= 1
        if version.leases:
            return
        version.idle.set()
        if version.retired:
            self._detach(version)
        else:
            self._evict_over_limit()

    async def load(
        self, name: str, folder: Path, sha256: str | None, pinned: bool, source: Source
    ) -> LoadResult:
        """Checks the adapter in `folder` off the event loop, attaches it between batches, then
        swaps it in: the next request gets it, those holding the old weights finish on them.
        The same weights again change only `pinned`."""
        async with self._changing:
            current = self._adapters.get(name)
            self._check_owner(name, source, current)
            if pinned and not (current and current.pinned) and self._pins() >= self.max_resident:
                raise AdapterConflict(
                    f"model {self.served.name!r} has {self._pins()} pinned adapters, as many as "
                    "MAX_ADAPTERS_PER_MODEL; unpin one (load it again with pinned false) first"
                )
            started = time.perf_counter()
            try:
                checked = await asyncio.to_thread(
                    check_adapter, folder, self.served.loaded, sha256, self._max_rank
                )
                if current is not None and current.version.checked.digests == checked.digests:
                    current.pinned, current.source, current.folder = pinned, source, folder
                    self._count("unchanged")
                    return LoadResult("unchanged", self._info(current), _since(started))
                self._versions += 1
                identity = AnswerIdentity.with_adapter(self.served, checked.digests)
                peft_name = f"{name}{VERSION_MARK}{self._versions}"
                version = Version(peft_name, checked, identity, resident=True)
                attaching = self._schedule(version, attach=True)
                try:
                    attach_seconds = await asyncio.shield(attaching)
                except asyncio.CancelledError:
                    # The caller went (its client, a front end's reconnect); the device thread
                    # finishes the attach all the same: undone once done, so that no adapter
                    # stays attached that nothing serves, and a retry attaches one copy.
                    attaching.add_done_callback(lambda _: self._undo_attach(version))
                    self._count("cancelled")
                    raise
            except Exception as exc:
                self._count("refused")
                reason = str(exc) if isinstance(exc, AdapterError) else _one_line(exc)
                raise AdapterRefused(
                    f"model {self.served.name!r}: adapter {name!r} refused: {reason}"
                ) from None
            seconds = _since(started)
            self._metrics.adapter_load_seconds.labels(self.served.name).observe(seconds)
            # The swap, in one step of the event loop: requests from here on lease the new
            # version; the old one is detached once the requests holding it are answered.
            loaded_at = datetime.now(timezone.utc)
            self._adapters[name] = RuntimeAdapter(name, source, folder, pinned, version, loaded_at)
            self._publish()
            if current is not None:
                self._retire(current.version)
            self._count("loaded" if current is None else "swapped")
            self._evict_over_limit()
            logger.info(
                "model %s: adapter %s %s from %s in %.3f s (sha256 %s)",
                self.served.name,
                name,
                "loaded" if current is None else "swapped",
                folder,
                seconds,
                checked.digests.weights[:12],
            )
            result = "loaded" if current is None else "swapped"
            return LoadResult(result, self._info(name), seconds, attach_seconds)

    async def unload(self, name: str, source: Source) -> AdapterInfo:
        """Removes a run-time adapter: new requests get 404 at once; it is detached, and this
        returns, once the requests already holding it are answered."""
        async with self._changing:
            current = self._adapters.get(name)
            if current is None:
                self._check_owner(name, source, None)
                raise UnknownName(f"model {self.served.name!r} has no run-time adapter {name!r}")
            self._check_owner(name, source, current)
            kept_for = self.in_use(name)
            if kept_for is not None:
                raise AdapterConflict(
                    f"adapter {name!r} of model {self.served.name!r} stays loaded: {kept_for}"
                )
            info = self._info(current)
            del self._adapters[name]
            self._publish()
            self._retire(current.version)
        version = current.version
        await version.idle.wait()
        if version.op is not None:
            await asyncio.gather(version.op, return_exceptions=True)
        logger.info("model %s: adapter %s unloaded", self.served.name, name)
        return info

    def listing(self) -> list[AdapterInfo]:
        """The models file's adapters, then the run-time ones, in load order."""
        loaded = self.served.loaded
        configs: dict[str, Any] = getattr(loaded.model, "peft_config", {})
        declared = [
            AdapterInfo(
                name=spec.name,
                source="models_file",
                path=str(spec.path),
                digest=loaded.adapter_digests[spec.name].weights,
                rank=getattr(configs.get(spec.name), "r", None),
                pinned=True,
                resident=True,
                loaded_at=None,
                requests=self._declared_requests.get(spec.name, 0),
                identity=self._declared[spec.name].digest,
            )
            for spec in loaded.spec.adapters
            if spec.name in self._declared
        ]
        return declared + [self._info(name) for name in self._adapters]

    async def close(self) -> None:
        """Waits for the attaches and detaches under way (at shutdown, batches stopped)."""
        await self.settled()

    async def settled(self) -> None:
        """Returns once no attach or detach is under way, those that others schedule as they
        end included (a cancelled load's undoing)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _check_owner(self, name: str, source: Source, current: RuntimeAdapter | None) -> None:
        model = self.served.name
        if not self.accepts_runtime:
            raise AdapterConflict(
                f"model {model!r} takes no run-time adapters: declare it with "
                "runtime_adapters: true in the models file"
            )
        if name in self.served.loaded.adapters:
            raise AdapterConflict(
                f"adapter {name!r} of model {model!r} comes from the models file and stays as it is"
            )
        if source == "api" and current is not None and current.source == "folder":
            raise AdapterConflict(
                f"adapter {name!r} of model {model!r} comes from the watched folder "
                f"({current.folder}): change or remove it there"
            )

    def _pins(self) -> int:
        return sum(adapter.pinned for adapter in self._adapters.values())

    def _count(self, result: str) -> None:
        self._metrics.adapter_loads.labels(self.served.name, result).inc()

    def _publish(self) -> None:
        """Tells the served model which run-time names exist (for `adapter_for`)."""
        self.served.runtime_adapters = frozenset(self._adapters)

    def _attach_again(self, version: Version) -> None:
        version.resident = True
        self._schedule(version, attach=True)
        self._count("reloaded")
        self._evict_over_limit()

    def _undo_attach(self, version: Version) -> None:
        """Detaches a version whose load was cancelled, once its attach has run (a failed
        attach has removed what it added already)."""
        if version.resident:
            self._detach(version)

    def _retire(self, version: Version) -> None:
        version.retired = True
        if version.leases == 0:
            self._detach(version)

    def _detach(self, version: Version) -> None:
        if version.resident:
            version.resident = False
            self._schedule(version, attach=False)

    def _evict_over_limit(self) -> None:
        """Past MAX_ADAPTERS_PER_MODEL, detaches the least recently used unpinned adapters no
        request holds; their checked tensors stay in CPU memory for the next request."""
        resident = [adapter for adapter in self._adapters.values() if adapter.version.resident]
        over = len(resident) - self.max_resident
        if over <= 0:
            return
        idle = [a for a in resident if not a.pinned and a.version.leases == 0]
        for adapter in sorted(idle, key=lambda a: a.version.last_used)[:over]:
            self._detach(adapter.version)
            self._metrics.adapter_evictions.labels(self.served.name).inc()
            logger.info("model %s: adapter %s evicted", self.served.name, adapter.name)

    def _schedule(self, version: Version, attach: bool) -> asyncio.Task[float]:
        """Runs an attach or detach of `version` after the one scheduled before it."""
        task = asyncio.create_task(self._device_op(version, attach, version.op))
        version.op = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(_seen)
        return task

    async def _device_op(
        self, version: Version, attach: bool, previous: asyncio.Task[float] | None
    ) -> float:
        """Runs the attach or detach on the device thread; returns its seconds there."""
        if previous is not None:
            await asyncio.gather(previous, return_exceptions=True)
        predictor = self.served.predictor
        call = (
            partial(predictor.attach_adapter, version.peft_name, version.checked)
            if attach
            else partial(predictor.detach_adapter, version.peft_name)
        )
        loop = asyncio.get_running_loop()
        try:
            async with self._slot:  # the batchers' slot: no forward runs meanwhile
                return await loop.run_in_executor(self._device, _timed, call)
        except Exception as exc:
            if attach:
                version.resident = False
            else:
                logger.warning(
                    "model %s: detaching %s failed: %s", self.served.name, version.peft_name, exc
                )
            raise

    def _info(self, adapter: RuntimeAdapter | str) -> AdapterInfo:
        if isinstance(adapter, str):
            adapter = self._adapters[adapter]
        version = adapter.version
        return AdapterInfo(
            name=adapter.name,
            source=adapter.source,
            path=str(adapter.folder),
            digest=version.checked.digests.weights,
            rank=version.checked.rank,
            pinned=adapter.pinned,
            resident=version.resident,
            loaded_at=adapter.loaded_at,
            requests=adapter.requests,
            identity=version.identity.digest,
        )


def _since(started: float) -> float:
    return time.perf_counter() - started


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return f"{type(exc).__name__}: {text.splitlines()[0][:300]}"


def _timed(call: Callable[[], None]) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def _seen(task: asyncio.Task[float]) -> None:
    """Marks a device operation's failure as seen: whoever waited on it has been told."""
    if not task.cancelled():
        task.exception()
