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


def quantize_dynamic_int8(model: torch.nn.Module) -> torch.nn.Module:
    """PyTorch dynamic int8 of every Linear layer: the fast CPU path.

    Eager-mode quantization is deprecated in favour of torchao; it is wrapped here, in one
    place, until torchao's CPU kernels match it.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", FutureWarning)
        quantized: torch.nn.Module = torch.ao.quantization.quantize_dynamic(
            model, {torch.nn.Linear}, dtype=torch.qint8
        )
    return quantized
