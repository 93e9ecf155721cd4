"""Model declarations: the readable YAML/JSON file that says which models to serve."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from api.models.languages import LANGUAGE_SCRIPTS, unknown_languages
from api.settings import ADAPTER_DIR_SUFFIX

ARTIFACTS_DIR = Path(__file__).resolve().parents[2] / "artifacts"
EMBEDDED_MODELS_FILE = ARTIFACTS_DIR / "models.yaml"
PACKAGE_SCHEME = "pkg:"

Quantization = Literal["none", "int8", "nf4", "fp4", "dynamic-int8"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
OtherLanguage = Literal["route", "refuse", "answer"]
NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,63}$"
LORA_PREFIX = "lora_"


class AdapterSpec(BaseModel):
    """A LoRA adapter folder (adapter_config.json + adapter_model.safetensors)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="Name clients select it by.")
    path: Path = Field(description="Adapter folder; relative paths start at the models file.")
    sha256: str | None = Field(
        None, pattern=r"^[0-9a-f]{64}$", description="Expected sha256 of its weights file."
    )

    @field_validator("name")
    @classmethod
    def _not_in_lora_prefix(cls, name: str) -> str:
        # peft finds an adapter's tensors by name; one inside "lora_" ("a", "lo") matches
        # every LoRA tensor and its weights are silently re-initialised.
        if name in LORA_PREFIX:
            raise ValueError(f"adapter name {name!r} is part of peft's prefix {LORA_PREFIX!r}")
        return name


class CandidateSpec(BaseModel):
    """An adapter tried beside the model's default on live traffic (api.serving.rollout):
    `shadow` scores a share of the default's texts with it too, off the request's path, and
    compares; `canary` answers a share of the texts with it (chosen by a hash of the text).
    The guards roll a candidate back by themselves once `min_texts` are compared."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    adapter: str = Field(pattern=NAME_PATTERN, description="One of the model's adapters.")
    mode: Literal["shadow", "canary"] = Field(description="shadow or canary.")
    share: float = Field(gt=0, le=1, description="The share of texts it scores or answers.")
    max_flip_rate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="Rolled back once more than this share of compared texts change label.",
    )
    min_texts: int = Field(200, ge=1, description="Texts compared before a guard may roll it back.")


class GgufSource(BaseModel):
    """A GGUF file the base folder is converted from, once, when the folder is missing."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    file: str = Field(description="The .gguf file: a path or pkg:<module>/<file>.")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Its pinned sha256.")


class SimulatedDevice(BaseModel):
    """A stand-in device: no weights, each batch answered after sleeping what it would cost."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds_per_batch: float = Field(ge=0, le=60, description="A batch's fixed cost.")
    seconds_per_token: float = Field(
        ge=0, le=1, description="What each token the batch computes (padding counted) adds."
    )


# What a simulated model cannot be given: it loads no weights, so none of these could apply.
WEIGHT_FIELDS = (
    "base",
    "revision",
    "task",
    "prompt",
    "label_words",
    "chat_template",
    "quantization",
    "dtype",
    "compute_dtype",
    "trust_remote_code",
    "weights_sha256",
    "gguf",
    "adapters",
    "default_adapter",
    "runtime_adapters",
    "base_name",
)


class ModelSpec(BaseModel):
    """One base model with its adapters and how to load it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN, description="Name clients select it by.")
    base: str | None = Field(
        None,
        description="Local folder, hub id (from the HF cache), or pkg:<module>/<sub-folder>; "
        "required unless simulated.",
    )
    simulated: SimulatedDevice | None = Field(
        None,
        description="Serve a stand-in for capacity planning and load tests: no weights, scores "
        "from a keyed hash of the token ids, each batch after sleeping its cost. Only a "
        "models file can declare one.",
    )
    tokenizer: str | None = Field(
        None,
        description="Simulated models: the folder (or pkg:<module>/<sub-folder>) whose "
        "tokenizer they use; unset: the embedded model's base.",
    )
    revision: str | None = Field(None, description="Hub revision (commit) to pin.")
    task: Literal["text-classification", "causal-lm"] = Field(
        "text-classification",
        description="text-classification: a *ForSequenceClassification head; causal-lm: a "
        "causal LM scored by the next-token logits of `label_words` after `prompt`.",
    )
    prompt: str | None = Field(
        None, description="causal-lm: the prompt, with {text} where the text goes."
    )
    label_words: dict[str, str] | None = Field(
        None, description="causal-lm: label → the word that answers it (its first token counts)."
    )
    chat_template: bool = Field(
        False, description="causal-lm: render the prompt through the tokenizer's chat template."
    )
    quantization: Quantization = Field("none", description="none, int8, nf4, fp4, dynamic-int8.")
    dtype: DType = Field("auto", description="Weight dtype; auto is float32 on CPU.")
    compute_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, description="4-bit compute dtype; unset is bfloat16 on GPU, float32 on CPU."
    )
    labels: list[str] | None = Field(None, description="Labels in class-index order.")
    decision_threshold: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Two labels: the second wins when the model gives it more than this "
        "probability; served scores are re-centred on it (see predictor). Unset: 0.5.",
    )
    cascade_threshold: float | None = Field(
        None,
        ge=0.5,
        le=1,
        description="As the cascade's first model: texts whose top probability is below this "
        "go on to the second model (CASCADE_THRESHOLD overrides it).",
    )
    max_length: int = Field(512, ge=1, le=32768, description="Tokens kept after truncation.")
    trust_remote_code: bool = Field(False, description="Run the checkpoint's own model code.")
    weights_sha256: dict[str, str] = Field(
        default_factory=dict, description="Expected sha256 per weight file name."
    )
    gguf: GgufSource | None = Field(
        None,
        description="Convert this GGUF into MODEL_CACHE_DIR/gguf/<its sha256> when that is "
        "missing; `base` then only names the model.",
    )
    adapters: list[AdapterSpec] = Field(default_factory=list)
    default_adapter: str | None = Field(
        None, description="Adapter used when a request names none; the first one if unset."
    )
    candidate: CandidateSpec | None = Field(
        None,
        description="An adapter tried beside the default on live traffic: shadow or canary.",
    )
    runtime_adapters: bool = Field(
        False,
        description="Accept adapters loaded at run time (the /v1 adapter routes, ADAPTERS_DIR); "
        "its own adapters are then never merged into its weights.",
    )
    base_name: str | None = Field(
        None,
        description="The name adapters trained on this base give as base_model_name_or_path "
        "(its hub id); run-time adapters must name it, the base as declared, or its folder.",
    )
    languages: list[str] | None = Field(
        None,
        min_length=1,
        description="The languages it reads (ISO 639-1: [ko], [en, tl]); a text detected in "
        "another is routed, refused or answered as on_other_language says. Unset: any.",
    )
    on_other_language: OtherLanguage = Field(
        "answer",
        description="A text outside `languages`: route (to the first other model that reads "
        "it, when the request names no model), refuse (422), or answer (flagged).",
    )

    @field_validator("languages")
    @classmethod
    def _known_languages(cls, languages: list[str] | None) -> list[str] | None:
        if languages is None:
            return None
        unknown = unknown_languages(languages)
        if unknown:
            raise ValueError(
                f"languages {unknown} are not ISO 639-1 codes detection can tell "
                f"(known: {', '.join(sorted(LANGUAGE_SCRIPTS))})"
            )
        return list(dict.fromkeys(languages))

    @model_validator(mode="after")
    def _check_simulated(self) -> ModelSpec:
        if self.simulated is None:
            if self.base is None:
                raise ValueError(f"model {self.name!r}: base is required (or simulated: {{...}})")
            if self.tokenizer is not None:
                raise ValueError(
                    f"model {self.name!r}: tokenizer is for simulated models; a real model "
                    "uses its base's"
                )
            return self
        given = [name for name in WEIGHT_FIELDS if name in self.model_fields_set]
        if given:
            raise ValueError(
                f"model {self.name!r} is simulated and loads no weights: "
                f"{', '.join(given)} cannot apply"
            )
        if self.labels is None:
            raise ValueError(f"model {self.name!r}: a simulated model needs its labels")
        return self

    @model_validator(mode="after")
    def _check_adapters(self) -> ModelSpec:
        names = [adapter.name for adapter in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"model {self.name!r}: adapter names repeat: {names}")
        if self.default_adapter is not None and self.default_adapter not in names:
            raise ValueError(
                f"model {self.name!r}: default_adapter {self.default_adapter!r} is not among "
                f"its adapters {names}"
            )
        if self.runtime_adapters and (not self.adapters or self.quantization == "dynamic-int8"):
            # Run-time adapters attach to the peft model that serves its own adapters: a model
            # with none is no peft model, and dynamic int8 layers are none peft can wrap.
            raise ValueError(
                f"model {self.name!r}: runtime_adapters needs at least one adapter of its own "
                "and a quantization other than dynamic-int8"
            )
        if self.candidate is not None:
            self._check_candidate(self.candidate, names)
        if self.labels is not None and len(set(self.labels)) != len(self.labels):
            raise ValueError(f"model {self.name!r}: labels repeat: {self.labels}")
        two_labels = self.labels is None or len(self.labels) == 2
        if self.decision_threshold is not None and not two_labels:
            raise ValueError(f"model {self.name!r}: a decision_threshold needs two labels")
        causal = (self.prompt, self.label_words, self.chat_template)
        if self.task == "text-classification" and any(causal):
            raise ValueError(
                f"model {self.name!r}: prompt, label_words and chat_template are for "
                "task: causal-lm"
            )
        if self.task == "causal-lm":
            if self.prompt is None or self.prompt.count("{text}") != 1:
                raise ValueError(f"model {self.name!r}: a causal-lm prompt holds {{text}} once")
            if not self.label_words or len(self.label_words) < 2:
                raise ValueError(
                    f"model {self.name!r}: a causal-lm needs label_words for 2+ labels"
                )
            if self.labels is not None and self.labels != list(self.label_words):
                raise ValueError(
                    f"model {self.name!r}: labels {self.labels} differ from label_words' "
                    f"{list(self.label_words)}"
                )
        return self

    def _check_candidate(self, candidate: CandidateSpec, names: list[str]) -> None:
        if self.quantization == "dynamic-int8":
            # Its one adapter is merged into the weights before they are quantized: there is
            # no base left to run a second adapter on.
            raise ValueError(
                f"model {self.name!r}: a candidate needs adapters kept beside the base, and "
                "quantization: dynamic-int8 merges its adapter into the weights: use "
                "quantization: none (or int8, nf4, fp4 on a GPU)"
            )
        if candidate.adapter not in names:
            raise ValueError(
                f"model {self.name!r}: candidate {candidate.adapter!r} is not among its "
                f"adapters {names}"
            )
        if candidate.adapter == self.active_default_adapter:
            raise ValueError(
                f"model {self.name!r}: candidate {candidate.adapter!r} is already its default "
                "adapter"
            )

    @property
    def active_default_adapter(self) -> str | None:
        """The adapter a request without one gets."""
        if self.default_adapter is not None:
            return self.default_adapter
        return self.adapters[0].name if self.adapters else None


class ModelsFile(BaseModel):
    """The top level of a models file."""

    model_config = ConfigDict(extra="forbid")

    models: list[ModelSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique_names(self) -> ModelsFile:
        names = [model.name for model in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names repeat: {names}")
        return self


class ModelsFileError(Exception):
    """A models file that cannot be read or does not validate."""


def adapter_env_name(model_name: str) -> str:
    """`exaone-spam` -> `EXAONE_SPAM_ADAPTER_DIR`, the seed name for its adapter folder."""
    return re.sub(r"[^A-Z0-9]", "_", model_name.upper()) + ADAPTER_DIR_SUFFIX


def resolve_base(base: str, root: Path) -> str:
    """Turns `pkg:` and relative bases into absolute folders; hub ids pass through."""
    if base.startswith(PACKAGE_SCHEME):
        module, _, sub = base[len(PACKAGE_SCHEME) :].partition("/")
        found = importlib.util.find_spec(module)
        if found is None or not found.submodule_search_locations:
            raise ModelsFileError(
                f"base {base!r}: Python package {module!r} is not installed "
                "(see requirements/embedded-models.txt)"
            )
        return str(Path(next(iter(found.submodule_search_locations))) / sub)
    candidate = Path(base).expanduser()
    if not candidate.is_absolute() and (base.startswith(".") or (root / candidate).exists()):
        candidate = root / candidate
    if candidate.is_absolute():
        return str(candidate.resolve())
    return base


def load_models_file(
    path: Path | None, adapter_dirs: Mapping[str, str] | None = None
) -> list[ModelSpec]:
    """Reads and validates a models file, applying `<MODEL>_ADAPTER_DIR` overrides.

    Relative paths are taken from the file's own folder, so a file travels with its artifacts.
    """
    path = path or EMBEDDED_MODELS_FILE
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        parsed = ModelsFile.model_validate(raw)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        reason = exc if not isinstance(exc, ValidationError) else _short(exc)
        raise ModelsFileError(f"models file {path}: {reason}") from None
    root = path.resolve().parent
    specs = [_with_paths_resolved(spec, root) for spec in parsed.models]
    if any(spec.simulated is not None and spec.tokenizer is None for spec in specs):
        tokenizer = embedded_base()
        specs = [
            spec.model_copy(update={"tokenizer": tokenizer})
            if spec.simulated is not None and spec.tokenizer is None
            else spec
            for spec in specs
        ]
    return _apply_adapter_dirs(specs, dict(adapter_dirs or {}))


def _short(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}" for error in exc.errors()
    )


def embedded_base() -> str:
    """The folder of the embedded models file's first base: where a simulated model's
    tokenizer comes from unless it names another."""
    first = ModelsFile.model_validate(
        yaml.safe_load(EMBEDDED_MODELS_FILE.read_text(encoding="utf-8"))
    ).models[0]
    assert first.base is not None
    return resolve_base(first.base, EMBEDDED_MODELS_FILE.parent)


def _with_paths_resolved(spec: ModelSpec, root: Path) -> ModelSpec:
    if spec.simulated is not None:
        if spec.tokenizer is None:
            return spec
        return spec.model_copy(update={"tokenizer": resolve_base(spec.tokenizer, root)})
    assert spec.base is not None
    adapters = [
        adapter.model_copy(update={"path": (root / adapter.path).resolve()})
        for adapter in spec.adapters
    ]
    if spec.gguf is not None:  # base is a name; the folder is the GGUF's, made at load time
        gguf = spec.gguf.model_copy(update={"file": resolve_base(spec.gguf.file, root)})
        return spec.model_copy(update={"gguf": gguf, "adapters": adapters})
    return spec.model_copy(update={"base": resolve_base(spec.base, root), "adapters": adapters})


def _apply_adapter_dirs(specs: list[ModelSpec], adapter_dirs: dict[str, str]) -> list[ModelSpec]:
    by_env: dict[str, ModelSpec] = {}
    for spec in specs:
        env_name = adapter_env_name(spec.name)
        other = by_env.setdefault(env_name, spec)
        if other is not spec:  # `spam-a` and `spam_a`: one variable could not tell them apart
            raise ModelsFileError(
                f"models {other.name!r} and {spec.name!r} share the setting {env_name}; "
                "rename one of them"
            )
    unknown = sorted(set(adapter_dirs) - set(by_env))
    if unknown:
        raise ModelsFileError(
            f"{', '.join(unknown)}: no declared model has this name "
            f"(models: {', '.join(spec.name for spec in specs)})"
        )
    result = []
    for env_name, spec in by_env.items():
        folder = adapter_dirs.get(env_name)
        if folder is None:
            result.append(spec)
            continue
        target = spec.active_default_adapter or "default"
        override = AdapterSpec(name=target, path=Path(folder).expanduser().resolve(), sha256=None)
        # A new folder means new weights: a pinned digest of the old one no longer applies.
        kept = [adapter for adapter in spec.adapters if adapter.name != target]
        adapters = [override, *kept] if spec.default_adapter is None else [*kept, override]
        result.append(spec.model_copy(update={"adapters": adapters}))
    return result
