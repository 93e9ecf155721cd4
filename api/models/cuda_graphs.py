"""CUDA graphs for a classifier's padded forward: a batch's kernels replayed in one launch.

On a GPU a small encoder's forward is bound by launching its kernels from Python, not by the
kernels: KoELECTRA-small's own forward took 7.3-9.0 ms at every shape from 1 x 128 to
32 x 512 tokens on an H200 (bench/reports/gpu.md), and in the server the batch worker also
waits for the GIL between launches while the event loop holds it. A CUDA graph records the
kernels of one forward at one shape once; replaying it costs one launch.

A graph holds the tensors it was recorded with, so each runs one shape: batches are padded up
to a bucket (rows to the next power of two, tokens to the next multiple of LENGTH_STEP) and
one graph is recorded per adapter and bucket, at its first batch. Extra rows are copies of the
first row, so that no row is all padding; their logits are dropped. A graph keeps the weights
it was recorded with, so attaching or removing an adapter drops every graph (`clear`).

Each recording is checked: the graph's replay must give the logits the eager forward gave the
same padded batch, within the packing check's tolerance. A model whose check fails, or whose
forward cannot be recorded, runs eagerly from then on, and the log says why; its batches are
still padded to the buckets, so that its answers stay those of the batches it ran before.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch

from api.models.packing import tolerance

logger = logging.getLogger(__name__)

# Tokens are padded to a multiple of this: 16 graphs an adapter and row count at 512 tokens.
LENGTH_STEP = 32


@dataclass(frozen=True)
class Buckets:
    """The shapes batches are padded to: rows to the next power of two, tokens to the next
    multiple of LENGTH_STEP, neither past the most a batch can hold."""

    max_rows: int
    max_length: int

    def of(self, rows: int, length: int) -> tuple[int, int] | None:
        """The bucket of a batch of `rows` × `length` tokens; None: beyond every bucket."""
        if rows > self.max_rows or length > self.max_length:
            return None
        padded_rows = min(1 << (rows - 1).bit_length(), self.max_rows)
        padded_length = min(-(-length // LENGTH_STEP) * LENGTH_STEP, self.max_length)
        return padded_rows, padded_length


@dataclass(frozen=True)
class _Recorded:
    """One graph and the tensors it reads and writes."""

    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    logits: torch.Tensor


class CudaGraphs:
    """Replays a model's padded forward as CUDA graphs, one per adapter and bucket.

    Not thread-safe: the thread that serves the model is the only one to call it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        max_rows: int,
        max_length: int,
        pad_values: Mapping[str, int],
        name: str,
    ) -> None:
        self._model = model
        self._name = name
        self._device = device
        self.buckets = Buckets(max_rows, max_length)
        self._pad_values = dict(pad_values)  # each input's padding value
        # One memory pool for all of them: only one replays at a time, and its outputs are
        # copied out before the next.
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[str | None, int, int], _Recorded] = {}
        self.failure: str | None = None
        self.replays = 0

    @property
    def recorded(self) -> int:
        """How many graphs are held now."""
        return len(self._graphs)

    def clear(self) -> None:
        """Drops every graph: the weights they read may be about to change."""
        self._graphs.clear()

    def placed(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
        """A padded batch (host tensors, padded on the right) padded on to its bucket, on the
        host: padding to the right, copies of the first row below; None where it has no
        bucket (too many rows, too long, or an input this class does not know how to pad)."""
        if set(inputs) - set(self._pad_values):
            return None
        rows, length = inputs["input_ids"].shape
        bucket = self.buckets.of(rows, length)
        if bucket is None:
            return None
        placed = {}
        for name, tensor in inputs.items():
            filled = torch.full(bucket, self._pad_values[name], dtype=tensor.dtype)
            filled[:rows, :length] = tensor
            filled[rows:] = filled[0]
            placed[name] = filled
        return placed

    def replay(self, placed: dict[str, torch.Tensor], adapter: str | None) -> torch.Tensor | None:
        """The logits of a batch `placed` at its bucket, through the graph of this adapter
        and bucket (recorded first where there is none yet); None once recording has
        failed, for the caller to run the batch eagerly."""
        if self.failure is not None:
            return None
        key = (adapter, *placed["input_ids"].shape)
        recorded = self._graphs.get(key)
        if recorded is None:
            recorded = self._record(placed)
            if recorded is None:
                return None
            self._graphs[key] = recorded
        else:
            for name, tensor in placed.items():
                recorded.inputs[name].copy_(tensor.pin_memory(), non_blocking=True)
        recorded.graph.replay()
        self.replays += 1
        # The pool's memory is the next graph's: the caller gets a copy.
        return recorded.logits.clone()

    def _record(self, placed: dict[str, torch.Tensor]) -> _Recorded | None:
        """Records the forward of this padded batch and checks its replay against the eager
        forward; None, with `failure` set, where either fails."""
        model = cast(Any, self._model)
        with torch.cuda.device(self._device):
            inputs = {name: tensor.to(self._device) for name, tensor in placed.items()}
            # The eager forward on the recording's side stream: what the replay must give,
            # and the warm-up that lets lazy set-up (cuBLAS handles) happen outside it.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager = model(**inputs).logits
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: another thread's CUDA calls (another device's models, a
                # /metrics read of the GPU's memory) may go on while this one records.
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                    logits = model(**inputs).logits
            except Exception as exc:  # whatever cannot be recorded runs eagerly
                self._fail(f"its forward cannot be recorded: {type(exc).__name__}: {exc}")
                return None
            graph.replay()
            difference = (logits.float() - eager.float()).abs().max().item()
        if not difference <= tolerance(logits.dtype):
            self._fail(f"a replay's logits differ from the eager ones by {difference:.3g}")
            return None
        return _Recorded(graph, inputs, logits)

    def _fail(self, reason: str) -> None:
        self.failure = reason
        self._graphs.clear()
        logger.warning("model %s: CUDA graphs off, batches run eagerly: %s", self._name, reason)
