"""Padding-free batches for encoder classifiers: the texts of a batch run as one sequence.

On a CPU a forward costs about its tokens, padding included, so a batch of short texts with
one long one pays for the long one in every row. Packed, the linear layers (most of the
cost) see only real tokens: the batch is one row of all its texts' tokens, sorted by length,
each text with its own positions from 0. Attention alone needs the texts apart: the texts
of one length lie side by side in the packed row, so each such run is viewed as a
[texts, length] batch and attends without padding or mask (no text sees another). The
encoder's output is gathered back apart, in batch order, before the classification head,
which then reads each text's first token as usual.

Every step is then computed per token, or per text as if it were alone: a text's answer does
not depend on its batch-mates (with per-token int8, api.models.quantization, to the bit;
tested). Padding and a key mask would break that: masked attention sums in another order.

Only models on a CPU whose embeddings start positions at 0 and whose head pools the first
token are packed (`PACKABLE_MODEL_TYPES`), and each only after `Predictor.enable_packing`
has compared a packed and a padded forward at load.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate, groupby
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_SDPA = "loraserve_packed_sdpa"
# BERT (MiniLM and its kin) and ELECTRA (KoELECTRA): absolute positions from 0, the first
# token pooled. RoBERTa counts positions from its padding index, XLNet pools the last token.
PACKABLE_MODEL_TYPES = frozenset({"bert", "electra"})


@dataclass(frozen=True)
class PackedLayout:
    """Where each text's tokens lie in the packed row, and how to gather them back apart."""

    order: tuple[int, ...]  # batch indexes in packed order: by length, shortest first
    positions: torch.Tensor  # [1, tokens]: each text's positions, from 0
    runs: tuple[tuple[int, int], ...]  # (texts, length) of each run of one length
    gather: torch.Tensor  # [texts, longest]: packed index of each text's tokens, batch order
    real: torch.Tensor  # [texts, longest]: True where a real token lies (not padding)

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> PackedLayout:
        order = sorted(range(len(lengths)), key=lengths.__getitem__)
        packed_lengths = [lengths[text] for text in order]
        start_of = dict(zip(order, [0, *accumulate(packed_lengths[:-1])], strict=True))
        starts = torch.tensor([start_of[text] for text in range(len(lengths))], device=device)
        offsets = torch.arange(max(lengths), device=device)
        real = offsets.unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        return cls(
            order=tuple(order),
            positions=torch.cat([torch.arange(n, device=device) for n in packed_lengths]).unsqueeze(
                0
            ),
            runs=tuple((len(list(run)), n) for n, run in groupby(packed_lengths)),
            gather=torch.where(real, starts.unsqueeze(1) + offsets, 0),
            real=real,
        )

    def pack(self, rows: list[list[int]]) -> list[int]:
        """The rows' tokens in packed order."""
        return [token for text in self.order for token in rows[text]]

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """Attention of [1, heads, tokens, dim] packed states, each text within itself, one
        run of equal lengths at a time; [1, tokens, heads, dim] packed, as transformers'
        attention returns."""
        outputs, start = [], 0
        for texts, length in self.runs:
            end = start + texts * length
            # [1, heads, texts × length, dim] → [texts, heads, length, dim]: a view, no copy.
            q, k, v = (
                states[0, :, start:end].unflatten(1, (texts, length)).transpose(0, 1)
                for states in (query, key, value)
            )
            output = scaled_dot_product_attention(q, k, v, scale=scaling)
            outputs.append(output.transpose(1, 2).flatten(0, 1))
            start = end
        return torch.cat(outputs).unsqueeze(0)

    def pad_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, tokens, width] packed → [texts, longest, width] in batch order, zeros where
        padding."""
        return hidden[0][self.gather] * self.real.unsqueeze(-1).to(hidden.dtype)


class PackingUnsupported(RuntimeError):
    """The model cannot run packed (causal attention, an unexpected structure)."""


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_layout: PackedLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, run per text when the batch is packed."""
    if packed_layout is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if getattr(module, "is_causal", False):
        raise PackingUnsupported("causal attention")
    return packed_layout.attend(query, key, value, scaling), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)  # padded batches: sdpa's own mask


def transformers_model(model: torch.nn.Module) -> Any:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _encoder_of(hf: Any) -> torch.nn.Module:
    backbone = getattr(hf, getattr(hf, "base_model_prefix", ""), hf)
    encoder = getattr(backbone, "encoder", None)
    if not isinstance(encoder, torch.nn.Module):
        raise PackingUnsupported(f"{type(hf).__name__} has no encoder module")
    return encoder


class PackedRunner:
    """Runs batches of token-id rows packed through one encoder classifier."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        if device.type != "cpu":
            # There a small batch costs its kernel launches more than its padding, and the
            # gathers packing adds are launches too: unmeasured on a GPU, so not done there.
            raise PackingUnsupported(f"packing is for CPUs, the model is on {device.type}")
        hf = transformers_model(model)
        model_type = getattr(hf.config, "model_type", None)
        if model_type not in PACKABLE_MODEL_TYPES:
            raise PackingUnsupported(f"model type {model_type!r} is not packed")
        if hf.config._attn_implementation not in ("sdpa", PACKED_SDPA):
            raise PackingUnsupported(f"attention {hf.config._attn_implementation!r}")
        self._hf = hf
        self._encoder = _encoder_of(hf)
        self._device = device
        self._token_types = "token_type_ids" in inspect.signature(hf.forward).parameters

    def attach(self) -> None:
        """Routes the model's attention through `packed_sdpa_attention` (same answers unpacked)."""
        self._hf.set_attn_implementation(PACKED_SDPA)

    def detach(self) -> None:
        self._hf.set_attn_implementation("sdpa")

    def inputs(self, rows: list[list[int]]) -> dict[str, Any]:
        """The model's keyword arguments for `rows` packed into one sequence."""
        layout = PackedLayout.of([len(row) for row in rows], self._device)
        ids = torch.tensor(layout.pack(rows), device=self._device)
        inputs: dict[str, Any] = {
            "input_ids": ids.unsqueeze(0),
            "position_ids": layout.positions,
            "packed_layout": layout,
        }
        if self._token_types:
            inputs["token_type_ids"] = torch.zeros_like(inputs["input_ids"])
        return inputs

    @contextmanager
    def padded_encoder_output(self, layout: PackedLayout) -> Iterator[None]:
        """While open, the encoder hands the head its output padded back apart per text."""

        def pad(_module: torch.nn.Module, _args: Any, output: Any) -> Any:
            if isinstance(output, tuple):
                return (layout.pad_hidden(output[0]), *output[1:])
            output.last_hidden_state = layout.pad_hidden(output.last_hidden_state)
            return output

        handle = self._encoder.register_forward_hook(pad)
        try:
            yield
        finally:
            handle.remove()


def tolerance(dtype: torch.dtype) -> float:
    """Largest logit difference a packed forward may show beside the padded one."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2
