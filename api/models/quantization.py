"""Quantization choices: what bitsandbytes and torch can do here, and what is refused."""

from __future__ import annotations

import importlib.metadata
import logging
import warnings

import torch
from transformers import BitsAndBytesConfig

from api.models.spec import ModelSpec

# Classification heads stay in full precision: bitsandbytes' CPU 4-bit kernel needs output
# sizes divisible by its block size, and a 2-label head never is. They are tiny anyway.
HEAD_MODULES = ["classifier", "score"]
BNB_MIN_CPU_VERSION = (0, 49)


class _DropCastNotice(logging.Filter):
    """bitsandbytes logs on every 8-bit forward that fp32 inputs are cast to fp16: expected."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("MatMul8bitLt: inputs will be cast")


logging.getLogger("bitsandbytes.autograd._functions").addFilter(_DropCastNotice())

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class QuantizationRefused(Exception):
    """A quantization that cannot run in this setting, with the reason."""


def torch_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """The weight dtype: `auto` is bfloat16 on GPU and float32 on CPU."""
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def _bitsandbytes_version() -> tuple[int, ...] | None:
    try:
        version = importlib.metadata.version("bitsandbytes")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def bitsandbytes_config(spec: ModelSpec, device: torch.device) -> BitsAndBytesConfig | None:
    """The bitsandbytes config for `int8`, `nf4` and `fp4`; None for the other choices."""
    if spec.quantization not in ("int8", "nf4", "fp4"):
        return None
    version = _bitsandbytes_version()
    if version is None:
        raise QuantizationRefused(
            f"quantization {spec.quantization!r} needs bitsandbytes, which is not installed"
        )
    if device.type == "cpu" and version < BNB_MIN_CPU_VERSION:
        raise QuantizationRefused(
            f"quantization {spec.quantization!r} on CPU needs bitsandbytes >= 0.49 "
            f"(installed: {'.'.join(map(str, version))})"
        )
    if spec.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=HEAD_MODULES)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=spec.quantization,
        # Double quantization also keeps 4-bit weights stable across forwards on CPU.
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch_dtype(spec.compute_dtype, device),
        llm_int8_skip_modules=HEAD_MODULES,
    )


def check_supported(spec: ModelSpec, device: torch.device, adapter_count: int) -> None:
    """Refuses the combinations that cannot run, before any weight is read."""
    if spec.quantization == "dynamic-int8":
        if device.type != "cpu":
            raise QuantizationRefused(
                "quantization 'dynamic-int8' is PyTorch's CPU kernel; on GPU use int8 or nf4"
            )
        if spec.dtype not in ("auto", "float32"):
            raise QuantizationRefused(
                f"quantization 'dynamic-int8' quantizes float32 weights, not {spec.dtype}"
            )
        if adapter_count > 1:
            raise QuantizationRefused(
                "quantization 'dynamic-int8' needs the adapter merged into the base, so it "
                f"serves one adapter, not {adapter_count}"
            )


class PerTokenInt8Linear(torch.nn.Module):
    """A Linear layer in int8 with one activation scale per token: batch-invariant.

    PyTorch's dynamic int8 (`quantize_dynamic`) takes one activation scale over the whole
    input, so a text's answer moved with its batch-mates (up to 0.48 in a logit, measured).
    Here each token is divided by its own largest magnitude before fbgemm's dynamic int8
    kernel, and multiplied back after, so every row is quantized on its own scale. Two pinned
    rows, all +1 and all -1, fix the kernel's per-tensor range at [-1, 1] whatever else the
    batch holds. Quantizing, the int32 product and the rescaling are then exact per row:
    the same token gives the same output bits in any batch. Weights: per output channel.
    """

    bias: torch.Tensor | None
    pin: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        channels = weight.shape[0]
        scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        with warnings.catch_warnings():  # torch deprecates its quantized tensors for torchao
            warnings.simplefilter("ignore")
            quantized_weight = torch.quantize_per_channel(
                weight, scales, torch.zeros(channels, dtype=torch.long), 0, torch.qint8
            )
            self.product = torch.ao.nn.quantized.dynamic.Linear(
                linear.in_features, channels, bias_=False, dtype=torch.qint8
            )
            self.product.set_weight_bias(quantized_weight, None)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)
        self.register_buffer("pin", torch.tensor([[1.0], [-1.0]]).repeat(1, linear.in_features))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1]).float()
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        output: torch.Tensor = self.product(torch.cat([rows / scale, self.pin]))[:-2] * scale
        if self.bias is not None:
            output = output + self.bias
        return output.reshape(*inputs.shape[:-1], output.shape[-1])


def quantize_dynamic_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Every Linear layer of `model` in per-token int8 (`PerTokenInt8Linear`), in place: the
    fast CPU path, and batch-invariant."""
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if isinstance(child, torch.nn.Linear):
                setattr(parent, name, PerTokenInt8Linear(child))
    return model
