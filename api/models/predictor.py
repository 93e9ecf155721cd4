"""Classification with a loaded model: tokenize, forward with per-row adapters, score."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from api.models.loader import LoadedModel

BASE_ADAPTER = "__base__"  # peft's name for "no adapter" in a mixed batch


class TextTooLong(ValueError):
    """A text over the model's token limit when the client asked not to truncate."""

    def __init__(self, index: int, tokens: int, limit: int) -> None:
        super().__init__(
            f"inputs[{index}] has {tokens} tokens, over the model's limit of {limit}; "
            "send truncate=true to cut it"
        )


@dataclass(frozen=True)
class Scores:
    """One text's result: probabilities and raw logits in class-index order."""

    probabilities: tuple[float, ...]
    logits: tuple[float, ...]


class Predictor:
    """Runs one loaded model. Not thread-safe: one batch at a time per model."""

    def __init__(self, loaded: LoadedModel, pad_to_multiple_of: int | None = None) -> None:
        self.loaded = loaded
        self.pad_to_multiple_of = pad_to_multiple_of
        self.labels = loaded.labels
        self.max_length = loaded.spec.max_length
        self._tokenizer = loaded.tokenizer
        self._sigmoid = loaded.problem_type == "multi_label_classification"
        self._active_adapter: str | None = None

    def encode(self, texts: list[str], truncate: bool = True) -> list[list[int]]:
        """Token ids of each text, cut to the model's max length (or refused if truncate)."""
        encoded = self._tokenizer(
            texts,
            truncation=truncate,
            max_length=self.max_length if truncate else None,
            add_special_tokens=True,
        )["input_ids"]
        if not truncate:
            for index, ids in enumerate(encoded):
                if len(ids) > self.max_length:
                    raise TextTooLong(index, len(ids), self.max_length)
        return [list(ids) for ids in encoded]

    @torch.inference_mode()
    def forward(self, batch: list[list[int]], adapters: list[str | None]) -> list[Scores]:
        """Scores a batch of token-id rows; `adapters[i]` names row i's adapter."""
        inputs = self._tokenizer.pad(
            {"input_ids": batch},
            padding=True,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors="pt",
        )
        inputs = {name: self._to_device(tensor) for name, tensor in inputs.items()}
        logits = self._model_logits(inputs, adapters).float()
        probabilities = torch.sigmoid(logits) if self._sigmoid else torch.softmax(logits, dim=-1)
        return [
            Scores(tuple(p), tuple(raw))
            for p, raw in zip(probabilities.tolist(), logits.tolist(), strict=True)
        ]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """On GPU, copies from pinned host memory without blocking the CPU thread."""
        if self.loaded.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.loaded.device, non_blocking=True)

    def predict(
        self, texts: list[str], adapter: str | None = None, truncate: bool = True
    ) -> list[Scores]:
        """Encodes and scores texts with one adapter (the model's default when None)."""
        return self.forward(self.encode(texts, truncate), [adapter] * len(texts))

    def warm_up(self, rows: int) -> None:
        """One forward at the largest shape served, so the first request pays no set-up."""
        adapters: list[str | None] = [*self.loaded.adapters] or [None]
        for adapter in adapters:
            self.forward(self._filler(rows, self.max_length), [adapter] * rows)

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
        batch, adapters = self._filler(rows, length), [None] * rows
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            self.forward(batch, list(adapters))
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds)

    def _filler(self, rows: int, length: int) -> list[list[int]]:
        """`rows` rows of `length` copies of one ordinary token."""
        token = self._tokenizer.convert_tokens_to_ids(self._tokenizer.unk_token or "a")
        return [[token if isinstance(token, int) else 0] * length for _ in range(rows)]

    def _model_logits(self, inputs: dict[str, Any], adapters: list[str | None]) -> torch.Tensor:
        model: Any = self.loaded.model
        default = self.loaded.spec.active_default_adapter
        names = [name or default for name in adapters]
        if not self.loaded.adapters or self.loaded.merged:
            return model(**inputs).logits  # type: ignore[no-any-return]
        if len(set(names)) == 1:
            if names[0] != self._active_adapter:
                model.set_adapter(names[0])
                self._active_adapter = names[0]
            return model(**inputs).logits  # type: ignore[no-any-return]
        rows = [name or BASE_ADAPTER for name in names]
        return model(**inputs, adapter_names=rows).logits  # type: ignore[no-any-return]
