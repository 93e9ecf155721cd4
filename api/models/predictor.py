"""Classification with a loaded model: tokenize, forward with per-row adapters, score."""

from __future__ import annotations

import gc
import logging
import math
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch

from api.models.adapters import CheckedAdapter, attach_checked, detach
from api.models.cuda_graphs import CudaGraphs
from api.models.faults import ForwardProcessLost
from api.models.loader import BUILD_LOCK, LoadedModel
from api.models.packing import PackedRunner, PackingUnsupported, tolerance
from api.models.tokenizing import TextEncoder
from api.models.warmup import warmup_batches

logger = logging.getLogger(__name__)


class UnservableText(ValueError):
    """A text this model cannot score; the message says which and why."""


class TextTooLong(UnservableText):
    """A text over the model's token limit when the client asked not to truncate."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"inputs[{index}] has {tokens} tokens, over the model's limit of {limit}; "
            "send truncate=true to cut it"
        )


class NoTokens(UnservableText):
    """A text that is empty once normalised: nothing but the model's special tokens."""

    def __init__(self, index: int) -> None:
        super().__init__(f"inputs[{index}] has no tokens after normalisation (empty text?)")


class NonFiniteScores(ArithmeticError):
    """The model gave NaN or infinity for one text: that text fails alone, never cached."""

    def __init__(self, logits: list[float]) -> None:
        super().__init__(f"the model produced non-finite scores {logits} for this text")


@dataclass(frozen=True)
class Scores:
    """One text's result: probabilities and raw logits in class-index order."""

    probabilities: tuple[float, ...]
    logits: tuple[float, ...]


def decision_offset(threshold: float | None) -> float:
    """What a two-label model's second logit loses so that its softmax probability passes 0.5
    exactly where the model's own passes `threshold`: logit(threshold); 0 when unset.

    The served model is the trained one with its head's second bias lowered by this: scores
    stay a monotone function of the model's, the top label is the decision, and a cascade's
    "unsure" means near the decision, not near 0.5.
    """
    if threshold is None:
        return 0.0
    return math.log(threshold / (1.0 - threshold))


# The probe batch's row lengths (see Predictor.probe_batches), each at most the model's max.
PROBE_LENGTHS = (5, 2, 9, 5, 1, 7, 3, 12)


def probe_lengths(max_length: int) -> list[int]:
    return [min(n, max_length) for n in PROBE_LENGTHS]


def batch_tokens(batch: list[list[int]], packed: bool) -> int:
    """The batch's tokens as the batcher counts them: the real ones if packed, else rows ×
    its longest row."""
    if packed:
        return sum(map(len, batch))
    return len(batch) * max(map(len, batch), default=0)


@dataclass(frozen=True)
class BatchProbe:
    """What `probe_batches` found: the largest logit difference of a probe text alone and
    inside a batch of texts of other lengths (0 where answers do not depend on batch-mates),
    and the (tokens, seconds) of its forwards, where admission's cost fit starts
    (api.serving.admission), so that a burst right after `/ready` is judged on what batches
    cost here rather than refused as unmeasured."""

    variance: float
    costs: tuple[tuple[int, float], ...]


class SpreadForwards(Protocol):
    """Where a model's batches run instead of in its own process, with the same answers
    (api.models.forward_processes); a ForwardProcessLost when that can no longer be."""

    def takes(self, rows: int) -> bool:
        """Whether a batch of this many rows runs there (else here)."""
        ...

    def logits(self, batch: list[list[int]], adapters: list[str | None]) -> torch.Tensor: ...

    def attach_adapter(self, name: str, checked: CheckedAdapter) -> None: ...

    def detach_adapter(self, name: str) -> None: ...

    def close(self) -> None: ...


class Predictor:
    """Runs one loaded model. Not thread-safe: one batch at a time per model."""

    def __init__(self, loaded: LoadedModel, pad_to_multiple_of: int | None = None) -> None:
        self.loaded = loaded
        self.pad_to_multiple_of = pad_to_multiple_of
        self.labels = loaded.labels
        self.max_length = loaded.spec.max_length
        self._tokenizer = loaded.tokenizer
        self._encoder = TextEncoder(loaded.tokenizer, self.max_length)
        self._sigmoid = loaded.problem_type == "multi_label_classification"
        self._second_label_offset = decision_offset(loaded.spec.decision_threshold)
        # Tokens that say nothing of the text ([CLS], [SEP], <s>...); [UNK] stands for text.
        self._special_ids = frozenset(self._tokenizer.all_special_ids) - {
            self._tokenizer.unk_token_id
        }
        # What the filler batches (warm-up, probes) run with: what most requests get.
        self._default_adapter = loaded.spec.active_default_adapter
        self._active_adapter: str | None = None
        self._packed: PackedRunner | None = None
        self._graphs: CudaGraphs | None = None
        # Set by the registry where BATCH_LOGIT_TOLERANCE finds this model's batches move a
        # text's logits: each text then runs as a batch of one, as `probe_batches` runs it.
        self.scores_alone = False
        self._spread: SpreadForwards | None = None

    @property
    def packs_batches(self) -> bool:
        """Batches run padding-free (see api.models.packing)."""
        return self._packed is not None

    @property
    def cuda_graphs(self) -> CudaGraphs | None:
        """The model's CUDA graphs, where its batches run through them (see enable_cuda_graphs)."""
        return self._graphs

    def enable_cuda_graphs(self, max_rows: int) -> bool:
        """Runs batches of up to `max_rows` texts padded to buckets and replayed as CUDA graphs
        from now on (see api.models.cuda_graphs), if this model can; else says why in the log.

        Run it on the thread that serves, before the warm-up (which then records the graphs
        of its batches); every other bucket's graph is recorded at its first batch."""
        reason = self._cuda_graphs_refusal()
        if reason is not None:
            logger.info("model %s runs without CUDA graphs: %s", self.loaded.spec.name, reason)
            return False
        pad_values = {
            "input_ids": cast(int, self._tokenizer.pad_token_id),
            "attention_mask": 0,
            "token_type_ids": self._tokenizer.pad_token_type_id,
        }
        self._graphs = CudaGraphs(
            self.loaded.model,
            self.loaded.device,
            max_rows,
            self.max_length,
            pad_values,
            self.loaded.spec.name,
        )
        return True

    def _cuda_graphs_refusal(self) -> str | None:
        if self.loaded.device.type != "cuda":
            return f"it runs on {self.loaded.device.type}"
        if self.loaded.spec.quantization != "none":
            return f"{self.loaded.spec.quantization} kernels are launched as they come"
        if self.loaded.label_token_ids is not None:
            return "a causal LM's prompted forward is not recorded"
        if self._packed is not None:
            return "its batches run packed"
        if self._tokenizer.padding_side != "right" or self._tokenizer.pad_token_id is None:
            return "its tokenizer does not pad on the right with a padding token"
        return None

    def enable_packing(self) -> bool:
        """Runs batches packed from now on, if this model can and a packed forward of a probe
        batch gives the padded forward's logits; else stays padded, saying why in the log.

        Run it on the thread that serves, before the warm-up (which then warms the packed
        path). The probe's rows have one length, so even a quantization that scales over the
        whole batch sees the same activations either way: the two must agree to rounding.
        """
        name = self.loaded.spec.name
        try:
            packed = PackedRunner(self.loaded.model, self.loaded.device)
        except PackingUnsupported as exc:
            logger.info("model %s runs padded batches: %s", name, exc)
            return False
        probe = self._probe([min(8, self.max_length)] * 3)
        adapters = [self._default_adapter] * len(probe)
        try:
            packed.attach()
            padded = self._logits(probe, adapters)
            self._packed = packed
            difference = (self._logits(probe, adapters) - padded).abs().max().item()
            reason = f"packed logits differ from padded ones by {difference:.3g}"
            if difference <= tolerance(padded.dtype):
                return True
        except Exception as exc:  # whatever breaks a packed forward keeps the model padded
            reason = f"a packed forward fails: {type(exc).__name__}: {exc}"
        self._packed = None
        packed.detach()
        logger.warning("model %s runs padded batches: %s", name, reason)
        return False

    def encode(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Token ids of each text, cut to the model's max length (or refused if truncate);
        a text with no tokens of its own is refused."""
        (encoded,) = self.encode_many([texts], truncate)
        if isinstance(encoded, UnservableText):
            raise encoded
        return encoded

    def encode_many(
        self, requests: list[list[str]], truncate: bool = True
    ) -> list[list[list[int]] | UnservableText]:
        """Per request, its texts' ids as `encode` gives them, or the refusal of its first
        unservable text (indexed within that request). Every text goes to the tokenizer in
        one call (a prompted model's text by text): a call releases and takes back the GIL,
        which a thread sharing it with the event loop may wait milliseconds for."""
        if self.loaded.prompt is not None:
            return [self._encode_prompted_request(texts, truncate) for texts in requests]
        flat = [text for texts in requests for text in texts]
        encoded = self._encoder.encode(flat, truncate)
        results: list[list[list[int]] | UnservableText] = []
        start = 0
        for texts in requests:
            rows = encoded[start : start + len(texts)]
            start += len(texts)
            results.append(self._refusal(rows, truncate) or rows)
        return results

    def _refusal(self, rows: list[list[int]], truncate: bool) -> UnservableText | None:
        """Why one request's rows cannot be scored (its first such text), or None."""
        for index, ids in enumerate(rows):
            if not truncate and len(ids) > self.max_length:
                return TextTooLong(index, len(ids), self.max_length)
            if self._special_ids.issuperset(ids):
                return NoTokens(index)
        return None

    def _encode_prompted_request(
        self, texts: list[str], truncate: bool
    ) -> list[list[int]] | UnservableText:
        try:
            return [self._encode_prompted(i, text, truncate) for i, text in enumerate(texts)]
        except UnservableText as refusal:
            return refusal

    def _encode_prompted(self, index: int, text: str, truncate: bool) -> list[int]:
        """A causal-LM prompt's ids. Truncation cuts the text, never the prompt around it: the
        end of the prompt is where the label word would come."""
        prompt = self.loaded.prompt
        assert prompt is not None
        if not text.strip():
            raise NoTokens(index)

        def ids_of(content: str) -> list[int]:
            rendered = prompt.render(content)
            return self._encoder.encode([rendered], False, prompt.adds_special_tokens)[0]

        ids = ids_of(text)
        if len(ids) <= self.max_length:
            return ids
        if not truncate:
            raise TextTooLong(index, len(ids), self.max_length)
        room = max(1, self.max_length - len(ids_of("")))
        text_ids = self._encoder.encode([text], False, special_tokens=False)[0][:room]
        ids = ids_of(self._encoder.decode(text_ids))
        return ids[-self.max_length :]  # a tokenizer that merges across the cut: keep the end

    @torch.inference_mode()
    def forward(
        self, batch: list[list[int]], adapters: list[str | None]
    ) -> list[Scores | NonFiniteScores]:
        """Scores a batch of token-id rows; `adapters[i]` names row i's adapter (None: none).

        A row whose scores are not all finite comes back as a NonFiniteScores error, alone.
        """
        logits = self._served_logits(batch, adapters).float()
        if self._second_label_offset:
            logits[:, 1] -= self._second_label_offset
        probabilities = torch.sigmoid(logits) if self._sigmoid else torch.softmax(logits, dim=-1)
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        return [
            Scores(tuple(p), tuple(raw)) if ok else NonFiniteScores(raw)
            for p, raw, ok in zip(probabilities.tolist(), logits.tolist(), finite, strict=True)
        ]

    @property
    def spread(self) -> SpreadForwards | None:
        """Where this model's batches run, if not here."""
        return self._spread

    def spread_over(self, spread: SpreadForwards) -> None:
        """Runs the batches of `forward` in `spread` from now (the warm-up and the probes stay
        here); they come back here for good if it is lost. Run it before the model serves."""
        self._spread = spread

    def stop_spreading(self) -> None:
        """Runs every batch here again, and stops where they ran."""
        spread, self._spread = self._spread, None
        if spread is not None:
            spread.close()

    def logits_here(self, batch: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
        """The batch's logits from this process's own forward, wherever batches run."""
        return self._logits(batch, adapters)

    def probe_rows(self, lengths: list[int]) -> list[list[int]]:
        """Rows of these lengths that the probes run (real tokens of the vocabulary)."""
        return self._probe(lengths)

    def _served_logits(self, batch: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
        if self._spread is not None and self._spread.takes(len(batch)):
            try:
                return self._spread.logits(batch, adapters)
            except ForwardProcessLost as exc:
                self._lose_spread(exc)
        return self._logits(batch, adapters)

    def _lose_spread(self, exc: ForwardProcessLost) -> None:
        logger.error(
            "%s; model %s forwards in its own process from now", exc, self.loaded.spec.name
        )
        self.stop_spreading()

    def probe_batches(self) -> BatchProbe:
        """A batch of probe texts of different lengths, then each of them alone, timed. Run it
        on the thread that serves, after the warm-up."""
        probe = self._probe(probe_lengths(self.max_length))
        adapters = [self._default_adapter] * len(probe)
        started = time.perf_counter()
        together = self._logits(probe, adapters).float()
        costs = [(batch_tokens(probe, self.packs_batches), time.perf_counter() - started)]
        alone = []
        for row in probe:
            started = time.perf_counter()
            alone.append(self._logits([row], adapters[:1]).float())
            costs.append((len(row), time.perf_counter() - started))
        variance = float((together - torch.cat(alone)).abs().max().item())
        return BatchProbe(variance, tuple(costs))

    def release_memory(self) -> None:
        """After an out-of-memory batch and before its halves run: frees what the failed
        forward left and, on a GPU, hands the allocator's cached blocks back, so the halves
        start from the weights alone. Run it on the thread that serves."""
        # The failed forward's frames, with their activations, may sit in reference cycles
        # (an exception's context holding another's traceback) that refcounts never free.
        gc.collect()
        if self.loaded.device.type == "cuda":
            with torch.cuda.device(self.loaded.device):
                torch.cuda.empty_cache()

    def attach_adapter(self, name: str, checked: CheckedAdapter) -> None:
        """Attaches a checked adapter under `name` (an AdapterError leaves none). Run it on the
        thread that serves, between batches: peft rewires layers a forward may be using."""
        with BUILD_LOCK:  # peft builds its layers with torch.nn.init: see the loader
            try:
                attach_checked(self.loaded.model, name, checked)
            finally:
                self._active_adapter = None  # whatever peft made active, set it again
                self._forget_graphs()
        if self._spread is not None:
            try:
                self._spread.attach_adapter(name, checked)
            except ForwardProcessLost as exc:
                self._lose_spread(exc)

    def detach_adapter(self, name: str) -> None:
        """Removes the adapter `name`. Run it on the thread that serves, between batches."""
        try:
            detach(self.loaded.model, name)
        finally:
            self._active_adapter = None
            self._forget_graphs()
        if self._spread is not None:
            try:
                self._spread.detach_adapter(name)
            except ForwardProcessLost as exc:
                self._lose_spread(exc)

    def _forget_graphs(self) -> None:
        """A graph replays the layers it was recorded with: peft has just rewired them."""
        if self._graphs is not None:
            self._graphs.clear()

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """On GPU, copies from pinned host memory without blocking the CPU thread."""
        if self.loaded.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.loaded.device, non_blocking=True)

    def predict(
        self, texts: list[str], adapter: str | None = None, truncate: bool = True
    ) -> list[Scores | NonFiniteScores]:
        """Encodes and scores texts with one adapter (the model's default when None)."""
        rows = self.encode(texts, truncate)
        return self.forward(rows, [adapter or self._default_adapter] * len(rows))

    def warm_up(self, max_batch_size: int, max_batch_tokens: int) -> None:
        """Forwards at the largest shapes the batcher can form with these limits (see
        api.models.warmup), per adapter, so that the first request pays no set-up and
        start-up meets serving's memory peak, not more."""
        batches = warmup_batches(
            self.max_length,
            max_batch_size,
            max_batch_tokens,
            self.packs_batches,
            self.pad_to_multiple_of,
        )
        adapters: list[str | None] = [*self.loaded.adapters] or [None]
        for adapter in adapters:
            for lengths in batches:
                rows = [row for length in lengths for row in self._filler(1, length)]
                self.forward(rows, [adapter] * len(rows))

    def overhead_tokens(self, repeats: int = 5) -> float | None:
        """What one forward costs beyond its tokens, in tokens; None if cost does not grow.

        The intercept over the slope of the line through the times of a 1 × 8-token and an
        8 × 32-token forward (medians of `repeats`): on a CPU tens of tokens, on a GPU, where
        small batches cost the same, None. Run it warm, on the thread that serves.
        """
        small = (1, min(8, self.max_length))
        large = (8, min(32, self.max_length))
        small_tokens, large_tokens = small[0] * small[1], large[0] * large[1]
        small_seconds = self._median_forward_seconds(*small, repeats)
        large_seconds = self._median_forward_seconds(*large, repeats)
        if large_tokens <= small_tokens or large_seconds <= small_seconds:
            return None
        per_token = (large_seconds - small_seconds) / (large_tokens - small_tokens)
        return max(0.0, small_seconds / per_token - small_tokens)

    def _median_forward_seconds(self, rows: int, length: int, repeats: int) -> float:
        batch, adapters = self._filler(rows, length), [self._default_adapter] * rows
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.forward(batch, list(adapters))
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds)

    def _probe(self, lengths: list[int]) -> list[list[int]]:
        """Rows of these lengths whose tokens differ from row to row, as texts do."""
        vocab = max(2, len(self._tokenizer))
        return [[(7 + 13 * row + 3 * i) % vocab for i in range(n)] for row, n in enumerate(lengths)]

    def _filler(self, rows: int, length: int) -> list[list[int]]:
        """`rows` rows of `length` copies of one ordinary token."""
        token = self._tokenizer.convert_tokens_to_ids(self._tokenizer.unk_token or "a")
        return [[token if isinstance(token, int) else 0] * length for _ in range(rows)]

    @torch.inference_mode()
    def _logits(self, batch: list[list[int]], adapters: list[str | None]) -> torch.Tensor:
        if self.scores_alone and len(batch) > 1:
            pairs = zip(batch, adapters, strict=True)
            return torch.cat([self._logits([row], [adapter]) for row, adapter in pairs])
        switchable = bool(self.loaded.adapters) and not self.loaded.merged
        if switchable and len(set(adapters)) > 1:
            return self._per_adapter(batch, adapters)
        if switchable:
            self._activate(adapters[0])
        if self._packed is not None and len(batch) > 1:  # one text has no padding to save
            return self._packed_logits(self._packed, batch)
        return self._padded_logits(batch)

    def _padded_logits(self, batch: list[list[int]]) -> torch.Tensor:
        padded: Mapping[str, torch.Tensor] = self._tokenizer.pad(
            {"input_ids": batch},
            padding=True,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )
        placed = None if self._graphs is None else self._graphs.placed(padded)
        if self._graphs is not None and placed is not None:
            # At its bucket, replayed or (where recording failed) not: the same answers.
            padded = placed
            graphed = self._graphs.replay(placed, self._active_adapter)
            if graphed is not None:
                return graphed[: len(batch)]
        inputs: dict[str, Any] = {name: self._to_device(t) for name, t in padded.items()}
        if self.loaded.label_token_ids is not None:
            # Left-padded: each row's positions count from its first real token, and only
            # the last position's logits are computed (not [rows, tokens, vocabulary]).
            mask = inputs["attention_mask"]
            inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
            inputs["logits_to_keep"] = 1
        logits: torch.Tensor = cast(Any, self.loaded.model)(**inputs).logits
        if self.loaded.label_token_ids is not None:
            return logits[:, -1, self.loaded.label_token_ids]
        return logits[: len(batch)]  # a bucket's extra rows dropped

    def _per_adapter(self, batch: list[list[int]], names: list[str | None]) -> torch.Tensor:
        """One forward per adapter in the batch, the logits back in the batch's order.

        Not peft's per-row `adapter_names`: it refuses a head saved in `modules_to_save` that
        is not a plain Linear (ELECTRA's two-layer classifier: KoELECTRA's adapters), and a
        packed batch (one row) has no batch dimension to split. A forward per adapter costs
        its fixed overhead again, and runs each adapter's rows exactly as alone.
        """
        order: list[int] = []
        parts = []
        for adapter in dict.fromkeys(names):
            rows = [index for index, name in enumerate(names) if name == adapter]
            parts.append(self._logits([batch[index] for index in rows], [adapter] * len(rows)))
            order += rows
        return torch.cat(parts)[torch.tensor(order).argsort()]

    def _activate(self, adapter: str | None) -> None:
        """Makes `adapter` the one peft applies to every row."""
        if adapter != self._active_adapter:
            cast(Any, self.loaded.model).set_adapter(adapter)
            self._active_adapter = adapter

    def _packed_logits(self, packed: PackedRunner, batch: list[list[int]]) -> torch.Tensor:
        inputs = packed.inputs(batch)
        with packed.padded_encoder_output(inputs["packed_layout"]):
            return cast(Any, self.loaded.model)(**inputs).logits  # type: ignore[no-any-return]
