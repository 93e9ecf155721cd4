"""The service-loader targets of the load-time benchmark, and its pre-quantized part.

`minilm`: the embedded default (all-MiniLM-L6-v2 + its LoRA adapter, merged, dynamic int8),
as the service loads it. `smollm2` and `llama-1b`: a bitsandbytes nf4 model loaded three ways
by `load_model`: quantized at start (PREQUANTIZED_CACHE=false), at a first start (quantized,
then saved as a pre-quantized checkpoint) and at a later start (read back from it); beside
them, a plain read of the pre-quantized files' bytes and of the source files' bytes.
`smollm2` is the embedded LLM (SmolLM2-135M-Instruct + its LoRA adapter, the weight pin
checked as at every start), `llama-1b` the generated ~1 B Llama, without adapter.

Each target has its own MODEL_CACHE_DIR under bench/out/load_time/model-cache/, so the
first-start way can empty its pre-quantized folder without touching anything else.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bench.load_worker import OUT_DIR

MINILM, SMOLLM2, LLAMA = "minilm", "smollm2", "llama-1b"
QUANTIZE_AT_START = "service-quantize"
FIRST_START = "service-first"
LATER_START = "service-cached"
READ_PREQUANTIZED = "read-prequantized"
READ_SOURCE = "read-bytes"
SERVICE_WAYS = (QUANTIZE_AT_START, FIRST_START, LATER_START)
# In each round the first start comes before the later one, which reads what it wrote.
PREQUANTIZED_WAYS = (*SERVICE_WAYS, READ_PREQUANTIZED, READ_SOURCE)
PREQUANTIZED_TARGETS = {
    SMOLLM2: "SmolLM2-135M-Instruct, nf4 + LoRA adapter",
    LLAMA: "Llama 1.03 B (generated), nf4",
}
WAY_TITLES = {
    QUANTIZE_AT_START: "load_model, quantized at start (PREQUANTIZED_CACHE=false)",
    FIRST_START: "load_model, first start: quantized, then saved pre-quantized",
    LATER_START: "load_model, later start: from the pre-quantized checkpoint",
    READ_PREQUANTIZED: "read only: the pre-quantized files' bytes",
    READ_SOURCE: "read only: the source files' bytes",
}
LLAMA_FOLDER = OUT_DIR / "llama-1b" / "safetensors"
SMOLLM2_MODEL = "spam-smollm2"


def model_cache(target: str) -> Path:
    """The MODEL_CACHE_DIR a target loads with."""
    return OUT_DIR / "model-cache" / target


def service_target(target: str, way: str) -> tuple[Any, Any]:
    """The spec and settings `load_model` gets for this target and way (the first-start way
    empties the target's pre-quantized folder first)."""
    from api.models.prequantized import CACHE_FOLDER
    from api.models.spec import ModelSpec, load_models_file
    from api.settings import Settings

    if target == MINILM:  # the code's defaults, not a local .env
        return load_models_file(None)[0], Settings(_env_file=None, device="cpu")  # type: ignore[call-arg]
    if target == SMOLLM2:
        spec = next(spec for spec in load_models_file(None) if spec.name == SMOLLM2_MODEL)
    else:
        values = {"name": LLAMA, "base": str(LLAMA_FOLDER), "labels": ["ham", "spam"]}
        spec = ModelSpec.model_validate({**values, "quantization": "nf4"})
    if way == FIRST_START:
        shutil.rmtree(model_cache(target) / CACHE_FOLDER, ignore_errors=True)
    settings = Settings(
        _env_file=None,  # type: ignore[call-arg]
        device="cpu",
        model_cache_dir=model_cache(target),
        prequantized_cache=way != QUANTIZE_AT_START,
    )
    return spec, settings


def prepare(target: str) -> None:
    """What a target needs before its first timed load: SmolLM2's GGUF converted into its model
    cache (once), a tokenizer beside the generated Llama's weights (the service reads one)."""
    if target == SMOLLM2:
        from api.models.loader import resolve_folder

        resolve_folder(*service_target(SMOLLM2, QUANTIZE_AT_START))
    elif not (LLAMA_FOLDER / "tokenizer.json").is_file():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, "<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>", pad_token="<unk>"
        )
        fast.save_pretrained(LLAMA_FOLDER)


def source_folder(target: str) -> Path:
    """The folder of the weights a target is quantized from: for SmolLM2, where the service
    itself resolves it (its GGUF's conversion in the target's model cache)."""
    if target == SMOLLM2:
        from api.models.loader import resolve_folder

        folder, _ = resolve_folder(*service_target(SMOLLM2, QUANTIZE_AT_START))
        return folder
    return LLAMA_FOLDER


def entry_folder(target: str) -> Path:
    """The target's pre-quantized checkpoint (the first-start way wrote it)."""
    from api.models.prequantized import CACHE_FOLDER

    root = model_cache(target) / CACHE_FOLDER
    (entry,) = [path for path in root.iterdir() if not path.name.startswith(".")]
    return entry


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    """One markdown row per target and way of the pre-quantized part."""
    lines = [
        "| model | way | load s, median (min–max) | resolve / weights / save / adapters s "
        "| + first touch s | = ready s | files MB | peak − before MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for target, ways in results.items():
        for way, row in ways.items():
            phases = row.get("phases_median_s")
            split = (
                " / ".join(
                    f"{phases[name]:.2f}"
                    for name in ("resolve", "weights", "save_quantized", "adapters")
                )
                if phases
                else "—"
            )
            lines.append(
                f"| {PREQUANTIZED_TARGETS[target]} | {WAY_TITLES[way]} "
                f"| {row['load_median_s']:.3f} ({row['load_min_s']:.3f}–{row['load_max_s']:.3f}) "
                f"| {split} | {row['touch_median_s']:.3f} | {row['ready_median_s']:.3f} "
                f"| {row['file_bytes'] / 1e6:,.0f} "
                f"| {row['peak_rss_median_mib'] - row['rss_before_median_mib']:,.0f} |"
            )
    return lines
