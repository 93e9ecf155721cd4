"""Forward speed, memory, accuracy and batch invariance of each CPU option on the embedded
default model.

Run: `python -m bench.speed_options` (or `make bench-speed`). Writes bench/reports/
speed_options.{md,json,png}. Each option is loaded through the service's own loader and
run by the service's own predictor, packed where the service packs it: latency for 1 text
and for a batch of 32 (median of several runs after a warm-up), throughput at 32, weight
bytes in memory, accuracy on the held-out test split of the SMS Spam Collection (the
adapter's own split), and the largest logit difference between a text scored alone and the
same text inside its batch of 32 (over the first 128 held-out texts): 0 is batch-invariant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from api.models.loader import load_model
from api.models.predictor import NonFiniteScores, Predictor, Scores
from api.models.spec import load_models_file
from api.observability.logs import quiet_libraries
from api.settings import Settings
from bench.harness import median_ms
from scripts.spam_data import load_splits

REPORTS = Path(__file__).resolve().parent / "reports"
BATCH = 32

# name → (changes to the model spec, changes to the settings). Every option but
# fp32-unmerged serves the single adapter merged (the service's default where it can);
# bitsandbytes bases keep it unmerged.
OPTIONS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "fp32-unmerged": ({}, {"merge_single_adapter": False}),
    "fp32-merged": ({}, {}),
    "eager-attention": ({}, {"attn_implementation": "eager"}),
    "buckets-16": ({}, {"pad_to_multiple_of": 16}),
    "torch-compile": ({}, {"torch_compile": True}),
    "bf16": ({"dtype": "bfloat16"}, {}),
    "dynamic-int8": ({"quantization": "dynamic-int8"}, {}),
    # The previous default: PyTorch's dynamic int8, one activation scale per batch.
    "dynamic-int8-per-tensor": ({}, {}),
    "fp32-padded": ({}, {"pack_batches": False}),
    "bnb-int8": ({"quantization": "int8"}, {}),
    "bnb-nf4": ({"quantization": "nf4"}, {}),
    # The same adapter under two names, rows alternating: the cost of a mixed-adapter batch.
    "mixed-2-adapters": ({}, {}),
}
MIXED = "mixed-2-adapters"
PER_TENSOR = "dynamic-int8-per-tensor"
INVARIANCE_TEXTS = 128


@dataclass
class Result:
    option: str
    threads: int
    latency_1_ms: float
    latency_32_ms: float
    throughput_32_per_s: float
    weight_bytes: int
    accuracy: float
    load_seconds: float
    packed: bool
    max_logit_difference: float


def measure(option: str, threads: int, repeats: int) -> Result:
    """Loads the default model with the option and times it."""
    spec_changes, setting_changes = OPTIONS[option]
    settings = Settings(_env_file=None, **setting_changes)  # type: ignore[call-arg]
    spec = load_models_file(None)[0]  # the encoder; the second is the cascade's LLM
    # Every option starts from fp32 without quantization, whatever models.yaml serves.
    spec = spec.model_copy(update={"quantization": "none", "dtype": "float32", **spec_changes})
    names: list[str | None] = [spec.active_default_adapter]
    if option == MIXED:
        twin = spec.adapters[0].model_copy(update={"name": "twin"})
        spec = spec.model_copy(update={"adapters": [spec.adapters[0], twin]})
        names = [spec.adapters[0].name, twin.name]
    torch.set_num_threads(threads)
    loaded = load_model(spec, settings)
    if option == PER_TENSOR:
        loaded.model = torch.ao.quantization.quantize_dynamic(
            loaded.model, {torch.nn.Linear}, dtype=torch.qint8
        )
    predictor = Predictor(loaded, settings.pad_to_multiple_of)
    packed = settings.pack_batches and not settings.torch_compile and predictor.enable_packing()
    test = load_splits().test
    texts = [row.text for row in test]
    rows = predictor.encode(texts)
    one, batch = rows[:1], rows[:BATCH]

    def adapters(count: int) -> list[str | None]:
        return [names[index % len(names)] for index in range(count)]

    latency_1 = median_ms(lambda: predictor.forward(one, adapters(1)), repeats * 2)
    latency_32 = median_ms(lambda: predictor.forward(batch, adapters(BATCH)), repeats)
    correct = 0
    batched: list[Scores] = []
    for start in range(0, len(rows), BATCH):
        chunk = rows[start : start + BATCH]
        scores = scored(predictor.forward(chunk, adapters(len(chunk))))
        batched += scores
        for row, score in zip(test[start : start + BATCH], scores, strict=True):
            predicted = score.probabilities.index(max(score.probabilities))
            correct += int(predicted == row.label)
    difference = 0.0
    for index in range(INVARIANCE_TEXTS):
        (alone,) = scored(predictor.forward(rows[index : index + 1], adapters(index + 1)[-1:]))
        for a, b in zip(alone.logits, batched[index].logits, strict=True):
            difference = max(difference, abs(a - b))
    return Result(
        option=option,
        threads=threads,
        latency_1_ms=round(latency_1, 2),
        latency_32_ms=round(latency_32, 1),
        throughput_32_per_s=round(BATCH / (latency_32 / 1000), 1),
        weight_bytes=loaded.weight_bytes,
        accuracy=round(correct / len(test), 4),
        load_seconds=round(loaded.load_seconds, 2),
        packed=packed,
        max_logit_difference=difference,
    )


def scored(results: list[Scores | NonFiniteScores]) -> list[Scores]:
    """The scores, or the first non-finite row's error."""
    for result in results:
        if isinstance(result, NonFiniteScores):
            raise result
    return [result for result in results if isinstance(result, Scores)]


def machine() -> str:
    """CPU model, cores and memory, for the report."""
    cpu = platform.processor() or "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {memory:.0f} GiB, torch {torch.__version__}"


def report(results: list[Result], load_average: str) -> str:
    """The markdown table, ratios against fp32 unmerged at the same thread count."""
    lines = [
        "# CPU options on the embedded default model (all-MiniLM-L6-v2 + spam LoRA)",
        "",
        f"Machine: {machine()}. Date: {datetime.now(timezone.utc):%Y-%m-%d}. "
        f"Load average before: {load_average}.",
        "Latency: median of repeated forwards after a warm-up, texts from the test split "
        f"(~20–40 tokens). Accuracy: the held-out test split ({len(load_splits().test)} texts). "
        "Packed: batches run padding-free, as the service runs them. Max Δ logit: the largest "
        f"difference of a text's logits alone and in its batch of {BATCH} "
        f"(first {INVARIANCE_TEXTS} test texts); 0 means batch-invariant.",
        "",
        "| option | threads | packed | 1 text (ms) | batch of 32 (ms) | texts/s at 32 | × fp32 | "
        "weights (MB) | accuracy | max Δ logit | load (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    baseline = {r.threads: r.throughput_32_per_s for r in results if r.option == "fp32-unmerged"}
    for r in results:
        ratio = r.throughput_32_per_s / baseline.get(r.threads, r.throughput_32_per_s)
        lines.append(
            f"| {r.option} | {r.threads} | {'yes' if r.packed else 'no'} | {r.latency_1_ms} | "
            f"{r.latency_32_ms} | {r.throughput_32_per_s} | {ratio:.2f} | "
            f"{r.weight_bytes / 1e6:.1f} | {r.accuracy:.2%} | {r.max_logit_difference:.2g} | "
            f"{r.load_seconds} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[Result], path: Path) -> None:
    """Throughput at batch 32 per option, one bar per thread count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options = list(dict.fromkeys(r.option for r in results))
    threads = sorted({r.threads for r in results})
    figure, axis = plt.subplots(figsize=(10, 0.5 * len(options) + 1.5))
    height = 0.8 / len(threads)
    for offset, count in enumerate(threads):
        values = [
            next(
                (r.throughput_32_per_s for r in results if r.option == o and r.threads == count), 0
            )
            for o in options
        ]
        positions = [index + offset * height for index in range(len(options))]
        axis.barh(positions, values, height=height, label=f"{count} threads")
    axis.set_yticks([index + height * (len(threads) - 1) / 2 for index in range(len(options))])
    axis.set_yticklabels(options)
    axis.invert_yaxis()
    axis.set_xlabel("texts per second at batch 32 (higher is better)")
    axis.set_title("CPU options, all-MiniLM-L6-v2 + spam LoRA")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", default=f"1,{os.cpu_count() or 1}")
    parser.add_argument("--options", default=",".join(OPTIONS), help="comma-separated names")
    args = parser.parse_args()
    quiet_libraries()
    load_average = Path("/proc/loadavg").read_text().split(" ")[0]
    results = []
    for count in sorted({int(t) for t in args.threads.split(",")}):
        for option in args.options.split(","):
            result = measure(option, count, args.repeats)
            print(json.dumps(asdict(result)), flush=True)
            results.append(result)
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / "speed_options.json").write_text(
        json.dumps([asdict(r) for r in results], indent=2), encoding="utf-8"
    )
    text = report(results, load_average)
    (REPORTS / "speed_options.md").write_text(text, encoding="utf-8")
    plot(results, REPORTS / "speed_options.png")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
