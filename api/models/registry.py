"""The preloaded models by name, their load progress, and how requests pick one."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from api.models.convert.staging import sweep_stale_staging
from api.models.faults import ForwardProcessLost
from api.models.forward_processes import ForwardProcesses
from api.models.loader import LoadedModel, load_model, timed
from api.models.predictor import Predictor
from api.models.simulated import SimulatedPredictor, load_simulated
from api.models.spec import ModelSpec
from api.settings import Settings

logger = logging.getLogger(__name__)


# MAX_BATCH_TOKENS when unset. On a CPU a forward's time per token rises once a batch's
# activations outgrow the caches: the embedded model (packed, 2 cores) ran 128-token texts at
# ~145 texts/s in batches of 1,024-3,072 tokens, ~115 at 4,096 and ~70 at 6,144-8,192; at 32
# and 64 clients the server capped at 2,048 served 1.5x the texts/s it did at 8,192.
CPU_BATCH_TOKENS = 2048
GPU_BATCH_TOKENS = 8192


class UnknownName(LookupError):
    """A model or adapter name that is not loaded."""


def batch_tokens_for(device: torch.device, configured: int | None) -> int:
    """The most tokens one forward on `device` may hold: MAX_BATCH_TOKENS where set."""
    if configured is not None:
        return configured
    return CPU_BATCH_TOKENS if device.type == "cpu" else GPU_BATCH_TOKENS


@dataclass
class Progress:
    """Where one model's load stands."""

    state: str = "waiting"  # waiting, loading, warming, ready, failed
    started: float | None = None
    finished: float | None = None

    @property
    def seconds(self) -> float:
        """Seconds spent so far (or in all, once finished)."""
        if self.started is None:
            return 0.0
        return (self.finished or time.perf_counter()) - self.started


@dataclass
class ServedModel:
    """A loaded model with its predictor."""

    loaded: LoadedModel
    predictor: Predictor
    overhead_tokens: float | None = None  # the batch cost model's, see BatchLimits
    max_batch_tokens: int = GPU_BATCH_TOKENS  # see batch_tokens_for
    # Largest logit difference of a probe text alone and among batch-mates, measured at load.
    batch_variance: float | None = None
    # Adapters loaded at run time, by name (api.serving.adapters keeps it current).
    runtime_adapters: frozenset[str] = frozenset()
    # (tokens, seconds) of the probe's forwards at load: where admission's cost fit starts.
    probe_costs: tuple[tuple[int, float], ...] = ()
    # What a request naming no adapter gets: the models file's default until a candidate is
    # promoted (api.serving.rollout), changed in one step of the event loop.
    default_adapter: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.default_adapter = self.loaded.spec.active_default_adapter

    @property
    def name(self) -> str:
        return self.loaded.spec.name

    def has_adapter(self, name: str) -> bool:
        """`name` is one of its adapters: the models file's or one loaded at run time."""
        return name in self.loaded.adapters or name in self.runtime_adapters

    def adapter_for(self, name: str | None) -> str | None:
        """The adapter a request gets: the one named, else the model's default.

        The one place where "no adapter named" becomes the default adapter.
        """
        if name is None:
            return self.default_adapter
        if not self.has_adapter(name):
            adapters = ", ".join([*self.loaded.adapters, *sorted(self.runtime_adapters)]) or "none"
            raise UnknownName(f"model {self.name!r} has no adapter {name!r}; adapters: {adapters}")
        return name


@dataclass
class Registry:
    """Loads every declared model (in parallel, or in turn where they share a GPU budget) and
    hands them out by name."""

    specs: list[ModelSpec]
    settings: Settings
    progress: dict[str, Progress] = field(init=False)
    models: dict[str, ServedModel] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _device_threads: dict[str, ThreadPoolExecutor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.progress = {spec.name: Progress() for spec in self.specs}

    @property
    def ready(self) -> bool:
        """Every declared model is loaded and warmed up."""
        return len(self.models) == len(self.specs)

    def device_thread(self, device: torch.device) -> ThreadPoolExecutor:
        """The one thread that runs every forward pass on `device`, warm-ups included.

        One thread, so one batch at a time per device. The warm-up runs there too because
        the memory a forward needs stays with the thread that ran it (its malloc arena, its
        OpenMP team): warmed elsewhere, the serving thread would grow by the largest batch's
        working set under traffic instead of before `/ready`.
        """
        with self._lock:
            key = str(device)
            if key not in self._device_threads:
                self._device_threads[key] = ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"infer-{key}"
                )
            return self._device_threads[key]

    def close(self) -> None:
        """Stops the device threads once their work is done, then the forward processes."""
        with self._lock:
            threads, self._device_threads = list(self._device_threads.values()), {}
            models = list(self.models.values())
        for thread in threads:
            thread.shutdown(wait=True)
        for served in models:  # no batch runs now: their forward processes can go
            served.predictor.stop_spreading()

    def load_all(self) -> None:
        """Loads and warms every model; the first failure is raised (loaded in parallel, once
        all have stopped)."""
        if self.settings.torch_threads is not None:
            torch.set_num_threads(self.settings.torch_threads)
        # What writers killed at an earlier start (of any replica sharing the cache) left.
        sweep_stale_staging(self.settings.model_cache_folder)
        if self._shares_a_gpu_budget():
            self._load_in_turn()
        else:
            with ThreadPoolExecutor(max_workers=max(1, len(self.specs))) as pool:
                futures = [pool.submit(self._load_one, spec) for spec in self.specs]
                errors = [future.exception() for future in futures]
            for error in errors:
                if error is not None:
                    raise error
        # Timed once every model is in, one at a time: a load beside it would skew it.
        if self.settings.warmup and self.settings.batch_overhead_tokens is None:
            for served in self.in_order():
                if served.predictor.packs_batches:
                    continue  # a packed batch costs its real tokens: no lengths to weigh
                with timed(served.loaded.phases, "warmup"):
                    measure = served.predictor.overhead_tokens
                    device = self.device_thread(served.loaded.device)
                    served.overhead_tokens = device.submit(measure).result()

    def _shares_a_gpu_budget(self) -> bool:
        """MAX_MEMORY_GB is one budget per GPU, which the models' loads must share."""
        on_gpu = self.settings.device != "cpu" and torch.cuda.is_available()
        return on_gpu and self.settings.max_memory_gb is not None

    def _load_in_turn(self) -> None:
        """One model at a time, in declaration order: each is given what the budget leaves
        after the bytes the models before it hold, measured once they are in. Loaded side by
        side, two models would each be given the whole budget; reserving by an estimate
        instead would guess (a 4-bit model's bytes are not its files' bytes)."""
        for spec in self.specs:
            self._load_one(spec, self.held_bytes())

    def held_bytes(self) -> dict[int | str, int]:
        """Bytes of weights the models loaded so far hold, by device (see max_memory_map)."""
        held: dict[int | str, int] = {}
        with self._lock:
            for served in self.models.values():
                for device, size in served.loaded.device_bytes.items():
                    held[device] = held.get(device, 0) + size
        return held

    def _load_one(self, spec: ModelSpec, held: dict[int | str, int] | None = None) -> None:
        progress = self.progress[spec.name]
        progress.state, progress.started = "loading", time.perf_counter()
        try:
            predictor = self._predictor(spec, held)
            loaded = predictor.loaded
            device = self.device_thread(loaded.device)
            batch_tokens = batch_tokens_for(loaded.device, self.settings.max_batch_tokens)
            if self.settings.pack_batches and not self.settings.torch_compile:
                with timed(loaded.phases, "warmup"):
                    device.submit(predictor.enable_packing).result()
            if self.settings.cuda_graphs and not self.settings.torch_compile:
                rows = self.settings.max_batch_size
                device.submit(predictor.enable_cuda_graphs, rows).result()
            if self.settings.warmup:
                progress.state = "warming"
                with timed(loaded.phases, "warmup"):
                    limits = self.settings.max_batch_size, batch_tokens
                    device.submit(predictor.warm_up, *limits).result()
            with timed(loaded.phases, "warmup"):
                probe = device.submit(predictor.probe_batches).result()
            variance = probe.variance
            tolerance = self.settings.batch_logit_tolerance
            if tolerance is not None and variance > tolerance:
                predictor.scores_alone = True  # before it serves: no batch runs yet
                logger.info(
                    "model %s: batch_max_logit_difference %.3g is over BATCH_LOGIT_TOLERANCE "
                    "%g: each text is scored alone",
                    spec.name,
                    variance,
                    tolerance,
                )
            spread = self.settings.forward_processes
            if spread > 1 and loaded.device.type == "cpu" and spec.simulated is None:
                progress.state = "spreading"
                warm_up = (self.settings.max_batch_size, batch_tokens)
                self._spread(predictor, spread, warm_up if self.settings.warmup else None)
        except BaseException:
            progress.state, progress.finished = "failed", time.perf_counter()
            raise
        overhead = self.settings.batch_overhead_tokens
        served = ServedModel(
            loaded, predictor, overhead, batch_tokens, variance, probe_costs=probe.costs
        )
        with self._lock:
            self.models[spec.name] = served
        progress.state, progress.finished = "ready", time.perf_counter()
        logger.info(
            "model %s ready in %.2f s (%s)",
            spec.name,
            loaded.load_seconds,
            ", ".join(f"{phase} {seconds:.2f}" for phase, seconds in loaded.phases.items()),
        )

    def _spread(self, predictor: Predictor, count: int, warm_up: tuple[int, int] | None) -> None:
        """The model's batches run in `count` forward processes from now, if they start and
        agree with it; else here, saying why in the log."""
        with timed(predictor.loaded.phases, "forward_processes"):
            try:
                processes = ForwardProcesses.start(predictor, self.settings, count, warm_up)
            except ForwardProcessLost as exc:
                logger.error(
                    "%s; model %s forwards in its own process", exc, predictor.loaded.spec.name
                )
                return
        predictor.spread_over(processes)

    def _predictor(self, spec: ModelSpec, held: dict[int | str, int] | None) -> Predictor:
        """The loaded model's predictor; a simulated one only where the models file says so."""
        pad = self.settings.pad_to_multiple_of
        if spec.simulated is not None:
            return SimulatedPredictor(load_simulated(spec), pad)
        return Predictor(load_model(spec, self.settings, held), pad)

    def forward_process_pids(self) -> dict[str, list[int]]:
        """The forward processes' pids of each model whose batches run in them."""
        with self._lock:
            models = list(self.models.values())
        found = {}
        for served in models:
            spread = served.predictor.spread
            if isinstance(spread, ForwardProcesses):
                found[served.name] = spread.pids
        return found

    def in_order(self) -> list[ServedModel]:
        """The loaded models, in declaration order."""
        return [self.models[spec.name] for spec in self.specs if spec.name in self.models]

    def get(self, name: str | None) -> ServedModel:
        """The named model, or the first declared one when no name is given."""
        wanted = name or self.specs[0].name
        served = self.models.get(wanted)
        if served is None:
            raise UnknownName(
                f"model {wanted!r} is not served; models: {', '.join(s.name for s in self.specs)}"
            )
        return served
