"""The service core: the models file's models loaded, warmed and served behind the caches,
admission and batchers; the one lifecycle of a classifying request; adapters at run time;
the drain. It knows no protocol: its refusals are api.serving.errors."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

from api.metrics import ForwardProcessMemoryCollector, Metrics
from api.models.predictor import NonFiniteScores, UnservableText
from api.models.registry import Registry, UnknownName
from api.models.spec import CandidateSpec, ModelSpec, load_models_file
from api.observability import record
from api.service.contract import Answer, ClassifyRequest, Lifecycle, Phase
from api.service.runners import start_runners
from api.serving.adapter_folder import AdapterFolder
from api.serving.adapter_roots import OutsideRoots, adapter_roots, place
from api.serving.adapters import (
    AdapterConflict,
    AdapterInfo,
    AdapterRefused,
    AdapterSet,
    LoadResult,
)
from api.serving.admission import NotAdmitted
from api.serving.batching import BatchFailed, QueueFull, Stopped
from api.serving.cache import ResultCache
from api.serving.cache.tiers import DEFAULT_TIER_NAMES
from api.serving.cascade import CASCADE_NAME, Cascade, cascade_models, cascade_threshold
from api.serving.classify import Classified, ModelRunner
from api.serving.errors import (
    Conflict,
    Forbidden,
    InferenceFailed,
    InvalidInput,
    NonFiniteAnswer,
    NotFound,
    Overloaded,
    ServiceError,
    Unavailable,
)
from api.serving.grouped import Answered, Group, answered_by_one, gather_in_order
from api.serving.heap import ServingHeap
from api.serving.language_gate import LanguageGate, TextRoutes
from api.serving.rollout import Candidate, Rollout
from api.serving.rollout.canary import classify_split
from api.serving.rollout.drift import count_answers
from api.serving.rollout.shadow import score_in_shadow
from api.serving.unicode import first_lone_surrogate
from api.settings import Settings

logger = logging.getLogger(__name__)

FatalHandler = Callable[[BaseException], None]
RETRY_SOON_SECONDS = 1  # a full queue or a failed batch: worth asking again at once
Result = TypeVar("Result")


class DeviceFailed(RuntimeError):
    """A forward pass failed in a way that leaves its device unusable (a CUDA device-side
    assert, an illegal memory access): every later batch would fail; a new process recovers."""


class StartFailed(RuntimeError):
    """The models did not load."""


class Service(Lifecycle):
    """The models of `specs` (default: the models file's) served as the settings say.

    `start` begins loading in the background (the phase says how far it is; `started` waits
    for the end of it); `close` stops taking work, then stops everything. `on_fatal` is called,
    on the event loop, when a model fails to load, or with a DeviceFailed when a forward pass
    leaves its device unusable (the service is then failed). ADAPTERS_DIR is read before
    the service turns ready, then followed unless `follow_adapters_dir` is off. The models
    file's candidates start with it unless `run_candidates` is off (a file scored in
    process is answered by each model's default).
    """

    def __init__(
        self,
        settings: Settings,
        specs: list[ModelSpec] | None = None,
        on_fatal: FatalHandler | None = None,
        follow_adapters_dir: bool = True,
        run_candidates: bool = True,
    ) -> None:
        if settings.transformers_cache is not None:
            logger.warning(
                "TRANSFORMERS_CACHE is deprecated (transformers reads HF_HOME, whose hub/ folder "
                "is the cache); honoured here: hub ids resolve from %s",
                settings.transformers_cache,
            )
        if specs is None:
            specs = load_models_file(settings.models_file, settings.adapter_dirs)
        super().__init__(Metrics(settings.latency_target_seconds))
        self.settings = settings
        self.registry = Registry(specs, settings)
        self.metrics.registry.register(
            ForwardProcessMemoryCollector(self.registry.forward_process_pids)
        )
        self.cascade_names = cascade_models(settings, specs)
        self.on_fatal = on_fatal
        self.follow_adapters_dir = follow_adapters_dir
        self.run_candidates = run_candidates
        self.cache: ResultCache | None = None
        self.runners: dict[str, ModelRunner] = {}
        self.cascade: Cascade | None = None
        self.rollouts: dict[str, Rollout] = {}
        self._labels: dict[str, list[str]] = {}  # each model's, for counting answers
        # The declared languages; the routes between models once their labels are known.
        self.languages = LanguageGate(specs, {}, self.metrics)
        self._shadows: set[asyncio.Task[None]] = set()  # shadow scorings under way
        self.heap = ServingHeap(settings.gc_gen0_threshold)
        self._loading: asyncio.Task[None] | None = None
        self._loaded = asyncio.Event()

    # --- start and stop ---------------------------------------------------------------------

    async def start(self) -> None:
        """Opens the cache tiers and begins loading; returns at once."""
        self.cache = ResultCache.from_settings(self.settings, self.metrics)
        self._loading = asyncio.create_task(self._load())

    async def started(self) -> None:
        """Waits for the load to end; StartFailed unless the service is then ready."""
        await self._loaded.wait()
        if self.phase is not Phase.READY:
            raise StartFailed(self.error or f"service is {self.phase.value}")

    def abandon_unanswered(self, reason: str) -> None:
        """Answers every request still waiting for its batch now, with Unavailable (503 and
        Retry-After) for `reason`: the drain has run out."""
        for runner in self.runners.values():
            runner.batcher.abandon(reason)

    async def close(self) -> None:
        """Takes no new work, then stops loading, the batchers, the adapters, the models and
        the caches (what accepted work is waited for is the door's drain, before this)."""
        self.begin_drain()
        if self._loading is not None:
            self._loading.cancel()
            await asyncio.gather(self._loading, return_exceptions=True)
        for shadow in self._shadows:  # nobody waits for them
            shadow.cancel()
        await asyncio.gather(*self._shadows, return_exceptions=True)
        await asyncio.gather(*(r.batcher.stop() for r in self.runners.values()))
        await asyncio.gather(*(r.adapters.close() for r in self.runners.values()))
        self.registry.close()
        if self.cache is not None:
            await self.cache.close()
        self.heap.release()  # what start-up built may be garbage now: collectable again

    async def _load(self) -> None:
        try:
            await asyncio.to_thread(self.registry.load_all)
            loop = asyncio.get_running_loop()

            def device_failed(reason: str) -> None:  # called on a device thread
                loop.call_soon_threadsafe(self._fail_device, reason)

            self.runners = start_runners(self.settings, self.registry, self.metrics, device_failed)
            self.rollouts = self._rollouts()
            self._labels = {name: r.served.loaded.labels for name, r in self.runners.items()}
            self.languages = LanguageGate(self.registry.specs, self._labels, self.metrics)
            if self.cascade_names is not None:
                first, second = (self.runners[name] for name in self.cascade_names)
                threshold, source = cascade_threshold(self.settings, first.served.loaded.spec)
                self.cascade = Cascade(first, second, threshold, self.metrics, source)
            adapters_dir = await self._read_adapters_dir()
        except Exception as exc:
            self.phase, self.error = Phase.FAILED, str(exc)
            self._loaded.set()
            logger.error("start-up failed: %s", exc)
            if self.on_fatal is not None:
                self.on_fatal(exc)
            return
        if self.phase is Phase.LOADING:
            self.heap.settle()
            self.phase = Phase.READY
            self.metrics.ready.set(1)
            logger.info("ready: %s", ", ".join(self.registry.models))
        self._loaded.set()
        if adapters_dir is not None and self.follow_adapters_dir:
            await adapters_dir.run()  # until close cancels loading

    def _rollouts(self) -> dict[str, Rollout]:
        """A rollout per model, with the candidates the models file declares."""
        rollouts: dict[str, Rollout] = {}
        settings = self.settings
        for name, runner in self.runners.items():
            samples = settings.rollout_samples_dir, settings.rollout_samples_max
            rollout = Rollout(runner.served, self.metrics, *samples)
            runner.adapters.in_use = rollout.adapter_in_use
            candidate = runner.served.loaded.spec.candidate
            if candidate is not None and self.run_candidates:
                rollout.start(candidate)
            rollouts[name] = rollout
        return rollouts

    async def _read_adapters_dir(self) -> AdapterFolder | None:
        """Loads what ADAPTERS_DIR holds, before the service turns ready: a restart serves the
        same set. The folder is then followed until shutdown (None: no ADAPTERS_DIR)."""
        root = self.settings.adapters_dir
        if root is None:
            return None
        adapter_sets = {name: runner.adapters for name, runner in self.runners.items()}
        folder = AdapterFolder(root, adapter_sets, self.settings.adapters_poll_seconds)
        await folder.sync(settle=False)
        return folder

    def _fail_device(self, reason: str) -> None:
        """The service after a fatal device error: failed, not ready, and told to stop."""
        if self.phase is Phase.FAILED:
            return
        self.phase, self.error = Phase.FAILED, reason
        self.metrics.ready.set(0)
        logger.critical("fatal device error, the service stops: %s", reason)
        if self.on_fatal is not None:
            self.on_fatal(DeviceFailed(reason))

    # --- classifying ------------------------------------------------------------------------

    async def classify(self, request: ClassifyRequest) -> Answer:
        """The one lifecycle of a classifying request: serving, its deadline, the limits, which
        model or cascade, the caches, admission, the batcher; refusals as ServiceErrors."""
        self.check_serving()
        # The one deadline of this request: every stage (the cascade's two included) shares it.
        deadline = time.monotonic() + request.seconds_given(self.settings.request_timeout_seconds)
        check_limits(request.texts, self.settings)
        cache = self.cache if request.use_cache else None
        texts, truncate = request.texts, request.truncate
        is_cascade = request.model == CASCADE_NAME
        candidate: Candidate | None = None
        picked: list[int] = []
        text_adapters: list[str | None] | None = None
        routes: TextRoutes | None = None
        routed = False  # some texts go to another model than the one asked
        if is_cascade:
            cascade = self.pick_cascade(request.adapter)
            labels = cascade.first.served.loaded.labels
            # The cascade routes nothing: its first model's languages refuse or flag a text.
            routes = self.languages.route(cascade.first.served.name, texts, may_route=False)
            work = cascade.classify(texts, truncate, cache, deadline)
            adapters = {r.served.name: r.served.adapter_for(None) for r in cascade.runners}
            adapter = None
            record.note_call(CASCADE_NAME, None, len(texts))
        else:
            runner, adapter = self.pick_runner(request.model, request.adapter)
            labels = runner.served.loaded.labels
            # Routed only where the request leaves the choice of model (and adapter) to us.
            may_route = request.model is None and request.adapter is None
            routes = self.languages.route(runner.served.name, texts, may_route)
            routed = routes is not None and bool(routes.routed)
            own = [texts[i] for i in routes.own] if routes is not None and routed else texts
            candidate = self._candidate_for(runner, request.adapter, adapter)
            picked = [] if candidate is None else candidate.picks(own)
            if candidate is not None and candidate.mode == "canary" and picked:
                text_adapters = [adapter] * len(own)
                for index in picked:
                    text_adapters[index] = candidate.adapter
                work = classify_split(runner, own, text_adapters, truncate, cache, deadline)
            else:
                work = answered_by_one(runner, own, adapter, truncate, cache, deadline)
            adapters = {runner.served.name: adapter}
            if routes is not None and routed:
                work = self._routed(work, routes, texts, truncate, cache, deadline)
                adapters.update(
                    (name, self.runners[name].served.adapter_for(None)) for name in routes.routed
                )
                if text_adapters is not None:  # the canary's, of the model's own texts
                    text_adapters = _spread(text_adapters, routes, adapters, len(texts))
            record.note_call(runner.served.name, adapter, len(texts))
        try:
            result, answered_by = await refused_as_service_errors(work)
        except Overloaded:
            await hold_refusal(self.settings.refusal_delay_seconds, deadline)
            raise
        if not is_cascade and candidate is not None and picked:
            mine = result if routes is None or not routed else _part(result, routes.own)
            self._shadow(runner, candidate, own, picked, mine, truncate)
        split_adapters = None  # per text, where a canary or a route gave them two adapters
        several = text_adapters is not None or (not is_cascade and len(adapters) > 1)
        if text_adapters is None:
            text_adapters = [adapters[name] for name in answered_by]
        if several and len(set(text_adapters)) == 1:
            adapter = text_adapters[0]  # the candidate, or the model routed to, took them all
        elif several:
            split_adapters = text_adapters
        count_answers(self.metrics, self._labels, answered_by, text_adapters, result.scores)
        tiers = DEFAULT_TIER_NAMES if self.cache is None else self.cache.tier_names
        record.note_cache(result.tiers, tiers)
        outside = None if routes is None or not routes.outside else routes.outside
        return Answer(
            result, answered_by, labels, adapter, is_cascade, tiers, split_adapters, outside
        )

    def _routed(
        self,
        own: Coroutine[Any, Any, Answered],
        routes: TextRoutes,
        texts: list[str],
        truncate: bool,
        cache: ResultCache | None,
        deadline: float,
    ) -> Coroutine[Any, Any, Answered]:
        """The model's own texts (`own`, answering `routes.own`) and each routed group by its
        model's default adapter, together, answered in the texts' order."""
        groups: list[Group] = [(routes.own, own)] if routes.own else []
        if not routes.own:
            own.close()  # never awaited: no text of the request is the model's own
        for name, indexes in routes.routed.items():
            chosen = [texts[i] for i in indexes]
            work = answered_by_one(self.runners[name], chosen, None, truncate, cache, deadline)
            groups.append((indexes, work))
        return gather_in_order(len(texts), groups)

    def _candidate_for(
        self, runner: ModelRunner, asked: str | None, adapter: str | None
    ) -> Candidate | None:
        """The candidate standing beside `adapter`, for a request that named no adapter (one
        naming its adapter gets that one, candidate or not)."""
        if asked is not None:
            return None
        candidate = self.rollouts[runner.served.name].candidate
        if candidate is None or candidate.served != adapter:
            return None
        return candidate

    def _shadow(
        self,
        runner: ModelRunner,
        candidate: Candidate,
        texts: list[str],
        picked: list[int],
        result: Classified,
        truncate: bool,
    ) -> None:
        """The picked texts scored in shadow once answered (see score_in_shadow): a task
        nobody awaits, cancelled at close."""
        chosen = [texts[index] for index in picked]
        answered = [result.scores[index] for index in picked]
        rollout = self.rollouts[runner.served.name]
        wait = self.settings.shadow_max_wait_seconds
        shadow = score_in_shadow(rollout, runner, candidate, chosen, answered, truncate, wait)
        task = asyncio.create_task(shadow)
        self._shadows.add(task)
        task.add_done_callback(self._shadows.discard)

    def pick_runner(self, model: str | None, adapter: str | None) -> tuple[ModelRunner, str | None]:
        """The named model's runner (None: the first) and the adapter a request gets."""
        try:
            runner = self.runners[self.registry.get(model).name]
            return runner, runner.served.adapter_for(adapter)
        except UnknownName as exc:
            raise NotFound(str(exc)) from None

    def pick_cascade(self, adapter: str | None) -> Cascade:
        """The cascade, which uses each model's default adapter."""
        if self.cascade is None:
            raise NotFound(f"no {CASCADE_NAME!r}: it needs two models")
        if adapter is not None:
            raise InvalidInput("the cascade uses each model's default adapter: send no adapter")
        return self.cascade

    # --- rollouts: a candidate beside the default -------------------------------------------

    def rollout(self, model: str | None) -> Rollout:
        """The rollout of the named model (None: the first)."""
        try:
            return self.rollouts[self.registry.get(model).name]
        except UnknownName as exc:
            raise NotFound(str(exc)) from None

    def set_candidate(self, model: str | None, spec: CandidateSpec) -> Rollout:
        """Starts `spec` as the model's candidate (replacing one that stands)."""
        self.check_serving()
        rollout = self.rollout(model)
        rollout.start(spec)
        return rollout

    def stop_candidate(self, model: str | None) -> Rollout:
        """Stops the model's candidate; its default stays."""
        self.check_serving()
        rollout = self.rollout(model)
        rollout.stop()
        return rollout

    def promote_candidate(self, model: str | None) -> Rollout:
        """The candidate becomes the model's default; the old default stays loaded."""
        self.check_serving()
        rollout = self.rollout(model)
        rollout.promote()
        return rollout

    def roll_back(self, model: str | None) -> Rollout:
        """Rolls the standing candidate back, else the last promotion."""
        self.check_serving()
        rollout = self.rollout(model)
        rollout.roll_back()
        return rollout

    # --- adapters at run time ---------------------------------------------------------------

    def adapter_set(self, model: str | None) -> AdapterSet:
        """The adapters of the named model (None: the first)."""
        try:
            return self.runners[self.registry.get(model).name].adapters
        except UnknownName as exc:
            raise NotFound(str(exc)) from None

    async def load_adapter(
        self, model: str | None, name: str, lora_path: str, sha256: str | None, pinned: bool
    ) -> tuple[AdapterSet, LoadResult]:
        """Loads an adapter, or swaps in new weights for one of that name: checked against
        its base first (refused with the reason, nothing changed), attached between batches.
        Only from under ADAPTERS_DIR or ADAPTER_ROOTS: elsewhere is Forbidden, which says
        nothing of what lies there."""
        try:
            folder: Path = place(lora_path, adapter_roots(self.settings))
        except OutsideRoots as exc:
            raise Forbidden(str(exc)) from None
        self.check_serving()
        adapters = self.adapter_set(model)
        try:
            done = await adapters.load(name, folder, sha256, pinned, "api")
        except AdapterRefused as exc:
            raise InvalidInput(str(exc)) from None
        except AdapterConflict as exc:
            raise Conflict(str(exc)) from None
        return adapters, done

    async def unload_adapter(self, model: str | None, name: str) -> tuple[AdapterSet, AdapterInfo]:
        """Unloads a run-time adapter: new requests for it are NotFound at once; this returns
        once the requests already holding it are answered and it is detached."""
        self.check_serving()
        adapters = self.adapter_set(model)
        try:
            info = await adapters.unload(name, "api")
        except UnknownName as exc:
            raise NotFound(str(exc)) from None
        except AdapterConflict as exc:
            raise Conflict(str(exc)) from None
        return adapters, info


def _part(result: Classified, indexes: list[int]) -> Classified:
    """The answers at `indexes`, in that order."""
    return Classified([result.scores[i] for i in indexes], [result.tiers[i] for i in indexes])


def _spread(
    own_adapters: list[str | None],
    routes: TextRoutes,
    adapters: dict[str, str | None],
    count: int,
) -> list[str | None]:
    """Per text of the request, its adapter: the model's own texts' as given, a routed
    text's model's default."""
    spread: list[str | None] = [None] * count
    for index, adapter in zip(routes.own, own_adapters, strict=True):
        spread[index] = adapter
    for name, indexes in routes.routed.items():
        for index in indexes:
            spread[index] = adapters[name]
    return spread


async def refused_as_service_errors(work: Coroutine[Any, Any, Result]) -> Result:
    """Runs `work`; the refusals of the tokenizer, admission and batcher become ServiceErrors."""
    try:
        return await work
    except ServiceError:
        raise
    except Exception as exc:
        refusal = service_error(exc)
        if refusal is None:
            raise
        raise refusal from None


def service_error(exc: Exception) -> ServiceError | None:
    """The refusal a caller gets for an error of the tokenizer, admission or batcher; None
    for any other error (a fault of the service's own)."""
    if isinstance(exc, UnservableText):
        return InvalidInput(str(exc))
    if isinstance(exc, NonFiniteScores):
        return NonFiniteAnswer(str(exc))
    if isinstance(exc, QueueFull):
        return Overloaded(f"model is busy: {exc}", RETRY_SOON_SECONDS)
    if isinstance(exc, NotAdmitted):
        return Overloaded(f"model is busy: {exc}", exc.retry_after)
    if isinstance(exc, Stopped):
        return Unavailable(f"the service stopped before answering: {exc}", RETRY_SOON_SECONDS)
    if isinstance(exc, BatchFailed):
        return InferenceFailed(f"inference failed: {exc}", RETRY_SOON_SECONDS)
    if isinstance(exc, UnknownName):  # an adapter unloaded between the pick and its batch
        return NotFound(str(exc))
    return None


async def hold_refusal(delay: float, deadline: float) -> None:
    """Waits `delay` seconds (at most until `deadline`) before an overload refusal goes out.

    A client that retries at once, whatever Retry-After says, would otherwise get its next
    refusal within a millisecond: 128 such clients kept the event loop busy on refusals
    alone, and the forwards, sharing its cores and the GIL, ran at an eighth to a fifth of
    their speed. Held, each client costs one refusal per `delay`.
    """
    await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))


def check_limits(texts: list[str], settings: Settings) -> None:
    """Count, length and Unicode limits, checked before any tokenizing or cache key: every
    door gets the same refusal (HTTP also refuses a lone surrogate as it parses the body)."""
    if len(texts) > settings.max_texts_per_request:
        raise InvalidInput(
            f"{len(texts)} texts in one request; at most {settings.max_texts_per_request}"
        )
    for index, text in enumerate(texts):
        if len(text) > settings.max_text_chars:
            raise InvalidInput(
                f"inputs[{index}] has {len(text)} characters; at most {settings.max_text_chars}"
            )
    lone = first_lone_surrogate(texts)
    if lone is not None:
        raise InvalidInput(f"inputs[{lone}] is not valid Unicode (lone surrogate)")
