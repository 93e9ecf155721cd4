"""Padding-free batches for encoder classifiers: the texts of a batch run as one sequence.

On a CPU a forward costs about its tokens, padding included, so a batch of short texts with
one long one pays for the long one in every row. Packed, the linear layers (most of the
cost) see only real tokens: the batch is one row of all its texts' tokens, each text with
its own positions from 0. Attention alone needs the texts apart: it gathers the texts,
sorted by length, into padded blocks of a few texts each (so a block pads only to its own
longest), attends within each text under a key-padding mask (no text sees another), and
scatters the result back. The encoder's output is padded back apart the same way before the
classification head, which then reads each text's first token as usual.

The answers are the padded forward's to the last bit in full precision (tested); under
dynamic int8, whose activation scale is taken over the whole batch, they differ from it as
much as one padded batch differs from another, since padding no longer enters the scale.

Only models on a CPU whose embeddings start positions at 0 and whose head pools the first
token are packed (`PACKABLE_MODEL_TYPES`), and each only after `Predictor.enable_packing`
has compared a packed and a padded forward at load.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
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


# Texts per attention block: sorted by length, a block pads only to its own longest text.
ATTENTION_BLOCK_ROWS = 8


@dataclass(frozen=True)
class _Padding:
    """Texts gathered from the packed row into a padded [texts, longest] block."""

    gather: torch.Tensor  # [texts, longest]: index into the packed row (0 where padding)
    real: torch.Tensor  # [texts, longest]: True where a real token lies
    real_flat: torch.Tensor  # indexes of the real tokens in the flattened [texts × longest]
    uneven: bool  # some text is shorter than the longest: attention needs a mask

    @classmethod
    def of(cls, starts: list[int], lengths: list[int], device: torch.device) -> _Padding:
        sizes = torch.tensor(lengths, device=device)
        offsets = torch.arange(max(lengths), device=device)
        real = offsets.unsqueeze(0) < sizes.unsqueeze(1)
        first = torch.tensor(starts, device=device).unsqueeze(1)
        return cls(
            gather=torch.where(real, first + offsets, 0),
            real=real,
            real_flat=real.reshape(-1).nonzero().squeeze(1),
            uneven=min(lengths) != max(lengths),
        )


@dataclass(frozen=True)
class PackedLayout:
    """Where each text's tokens lie in the packed row, and how to pad them back apart."""

    positions: torch.Tensor  # [1, tokens]: each text's positions, from 0
    texts: _Padding  # every text, in batch order: the encoder's output for the head
    blocks: tuple[_Padding, ...]  # the texts by length, ATTENTION_BLOCK_ROWS a block
    block_tokens: torch.Tensor  # packed index of each real token, in the blocks' order

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> PackedLayout:
        starts = [0, *accumulate(lengths[:-1])]
        by_length = sorted(range(len(lengths)), key=lengths.__getitem__)
        blocks = [
            by_length[i : i + ATTENTION_BLOCK_ROWS]
            for i in range(0, len(by_length), ATTENTION_BLOCK_ROWS)
        ]
        block_tokens = [
            token
            for block in blocks
            for text in block
            for token in range(starts[text], starts[text] + lengths[text])
        ]
        return cls(
            positions=torch.cat([torch.arange(n, device=device) for n in lengths]).unsqueeze(0),
            texts=_Padding.of(starts, lengths, device),
            blocks=tuple(
                _Padding.of([starts[t] for t in block], [lengths[t] for t in block], device)
                for block in blocks
            ),
            block_tokens=torch.tensor(block_tokens, device=device),
        )

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scaling: float | None,
    ) -> torch.Tensor:
        """Attention of [1, heads, tokens, dim] packed states, each text within itself,
        block by block; [1, tokens, heads, dim] packed, as transformers' attention returns."""
        tokens_first = [states[0].transpose(0, 1) for states in (query, key, value)]
        outputs = []
        for block in self.blocks:
            q, k, v = (states[block.gather].transpose(1, 2) for states in tokens_first)
            mask = block.real[:, None, None, :] if block.uneven else None
            output = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
            flat = output.transpose(1, 2).reshape(-1, output.shape[1], output.shape[3])
            outputs.append(flat[block.real_flat])
        packed = torch.empty_like(tokens_first[0])
        packed[self.block_tokens] = torch.cat(outputs)
        return packed.unsqueeze(0)

    def pad_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """[1, tokens, width] packed → [texts, longest, width] padded, zeros where padding."""
        return hidden[0][self.texts.gather] * self.texts.real.unsqueeze(-1).to(hidden.dtype)


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
        ids = torch.tensor([token for row in rows for token in row], device=self._device)
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
