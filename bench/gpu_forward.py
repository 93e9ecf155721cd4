"""The forward without the server, for bench.gpu: each model loaded in the benchmark's own
process with the server's loader and settings, and timed at the latency grid's shapes two
ways, so that the served batch time can be split into the model and what serving adds:

- model: the model's own call on padded ids already on the device, synchronized;
- predictor: `Predictor.forward`, what the batch worker calls (ids from the host, packing
  where the model packs, CUDA graphs where the server would replay them, scores back on the
  host).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from api.models.loader import load_model
from api.models.predictor import Predictor
from api.models.spec import ModelSpec, load_models_file
from api.settings import Settings
from bench.harness import median_ms


def forward_times(
    models: Path,
    settings: Settings,
    corpus: dict[str, dict[int, list[str]]],
    sizes: tuple[int, ...],
    repeats: int,
) -> list[dict[str, Any]]:
    """For each model of the models file and each (tokens, texts) of the grid, the median
    milliseconds of a model call and of a `Predictor.forward`, after two warm-ups each."""
    rows = []
    for spec in load_models_file(models):
        rows += model_times(spec, settings, corpus[spec.name], sizes, repeats)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the model is gone with model_times' frame
    return rows


def model_times(
    spec: ModelSpec,
    settings: Settings,
    corpus: dict[int, list[str]],
    sizes: tuple[int, ...],
    repeats: int,
) -> list[dict[str, Any]]:
    loaded = load_model(spec, settings)
    predictor = Predictor(loaded)
    # As the server runs it: replayed as CUDA graphs where it would be.
    graphed = settings.cuda_graphs and predictor.enable_cuda_graphs(settings.max_batch_size)
    adapter = spec.adapters[0].name if spec.adapters else None
    rows = []
    for tokens, texts in corpus.items():
        for size in sizes:
            ids: list[list[int]] = loaded.tokenizer(texts[:size])["input_ids"]
            # Predictor.forward first: it makes the adapter active for the model calls.
            predictor_ms = timed(partial(predictor.forward, ids, [adapter] * size), repeats)
            padded = loaded.tokenizer.pad({"input_ids": ids}, return_tensors="pt")
            inputs = {name: t.to(loaded.device) for name, t in padded.items()}
            model_ms = timed(partial(call, loaded.model, inputs), repeats)
            rows.append(
                {
                    "model": spec.name,
                    "tokens": tokens,
                    "texts": size,
                    "model_ms": model_ms,
                    "predictor_ms": predictor_ms,
                    "predictor_graphed": graphed,
                }
            )
    return rows


@torch.inference_mode()
def call(model: Any, inputs: dict[str, torch.Tensor]) -> None:
    model(**inputs)


def synced(work: Callable[[], object]) -> None:
    """`work`, then the device synchronized: its queued kernels are part of its time."""
    work()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(work: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of `work` after two warm-ups, the device synchronized after each
    call (so each timed call starts with the device idle)."""
    return median_ms(partial(synced, work), repeats, warmups=2)
