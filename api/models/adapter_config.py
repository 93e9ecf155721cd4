"""What an `adapter_config.json` may say: the LoRA fields this service serves as a plain delta
on a shared base, read from bytes already hashed. Anything else is refused, naming the field.

Decided field by field from peft 0.21's `LoraConfig` and what `add_adapter` does with it. Some
fields make peft rewrite the base every adapter shares (PiSSA, OLoRA, CorDA, LoftQ and KaSA
overwrite the targeted weights in place; `layer_replication` rebuilds the layer list); some
are not a LoRA delta at all (DoRA's magnitudes, token rows, parameter wrappers, variants); a
field this list does not know, from a later peft, might be either, so it is refused too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from peft import LoraConfig

# Fields that describe or select, and change no weight: metadata, where LoRA goes and how it
# scales. peft checks their values (a bad one fails the attach, which is then rolled back).
PLAIN_FIELDS = frozenset(
    {
        "task_type",
        "peft_version",
        "base_model_name_or_path",
        "revision",
        "auto_mapping",  # written by save_pretrained for custom models; never read when loading
        "inference_mode",  # set to True whatever it says
        "r",
        "target_modules",
        "exclude_modules",
        "lora_alpha",
        "lora_dropout",  # inactive in eval mode
        "fan_in_fan_out",
        "use_rslora",
        "modules_to_save",  # per-adapter copies; which modules, run-time adapters check apart
        "layers_to_transform",
        "layers_pattern",
        "rank_pattern",
        "alpha_pattern",
        "megatron_core",  # a module name, imported only with a megatron_config (refused)
        "qalora_group_size",  # used only with use_qalora (refused)
    }
)
# init_lora_weights values that initialise lora_A and lora_B alone (reset_lora_parameters,
# orthogonal_init; "eva" zeroes lora_B, its data-driven step runs only in training). The file's
# weights replace all of them, so these are served as False: no init work, the same answers.
PLAIN_INITS: tuple[object, ...] = (True, False, "gaussian", "orthogonal", "eva")
_DEFAULT_MEGATRON_CORE = "megatron.core"


def _only(*defaults: object, reason: str) -> Callable[[object], str | None]:
    """A check that lets through only the given defaults, of the same JSON type (an empty
    object is not null: peft turns `"kasa_config": {}` into KaSA's default config)."""

    def check(value: object) -> str | None:
        same = any(type(value) is type(default) and value == default for default in defaults)
        return None if same else f"{value!r}: {reason}"

    return check


def _init(value: object) -> str | None:
    if any(value is plain or (isinstance(value, str) and value == plain) for plain in PLAIN_INITS):
        return None
    if isinstance(value, str) and value.lower().startswith(("pissa", "olora", "corda", "loftq")):
        return (
            f"{value!r} makes peft rewrite the base model's weights, which every adapter of it "
            "shares (save the adapter converted to plain LoRA: peft's save_pretrained with "
            "path_initial_model_for_weight_conversion)"
        )
    return f"{value!r} is not a plain LoRA initialisation (true, false, gaussian, orthogonal, eva)"


def _bias(value: object) -> str | None:
    if value == "none":
        return None
    return f"{value!r} loads the base model's biases, which every adapter shares (only 'none')"


# Fields allowed only at their default, each with why: a value there changes the shared base
# or is not served as a LoRA delta by this service.
NULL, FALSE = (None,), (False,)
RESTRICTED_FIELDS: Mapping[str, Callable[[object], str | None]] = {
    "init_lora_weights": _init,
    "bias": _bias,
    "layer_replication": _only(*NULL, [], reason="rebuilds the base model's layer list"),
    "loftq_config": _only(*NULL, {}, reason="LoftQ replaces the base model's weights"),
    "corda_config": _only(*NULL, reason="CorDA rewrites the base model's weights"),
    "kasa_config": _only(*NULL, reason="KaSA truncates the base model's weights"),
    "lora_ga_config": _only(*NULL, reason="LoRA-GA is not a plain LoRA initialisation"),
    "trainable_token_indices": _only(
        *NULL, reason="trains embedding rows, not a LoRA delta: not served"
    ),
    "target_parameters": _only(*NULL, reason="wraps parameters, not layers: not served"),
    "use_dora": _only(*FALSE, reason="DoRA's magnitude vectors are not served"),
    "lora_bias": _only(*FALSE, reason="a bias on lora_B is not served"),
    "use_qalora": _only(*FALSE, reason="QALoRA is for GPTQ bases only: not served"),
    "megatron_config": _only(*NULL, reason="Megatron parallel layers are not served"),
    "velora_config": _only(*NULL, reason="a LoRA variant (VeLoRA), not served"),
    "alora_invocation_tokens": _only(*NULL, reason="a LoRA variant (aLoRA), not served"),
    "monteclora_config": _only(*NULL, reason="a LoRA variant (MonteCLoRA), not served"),
    "use_bdlora": _only(*NULL, reason="a LoRA variant (BD-LoRA), not served"),
    "arrow_config": _only(*NULL, reason="a LoRA variant (Arrow), not served"),
    "ensure_weight_tying": _only(*FALSE, reason="ties adapter layers across the base: not served"),
    "eva_config": lambda value: None,  # EVA's data-driven init runs only in training
}
# Never saved by peft, which drops it when reading a file (runtime settings, not the adapter's).
DROPPED_FIELDS = frozenset({"runtime_config"})


class ConfigRefused(Exception):
    """An adapter config this service will not serve; the message names the field."""


def parse_adapter_config(data: bytes) -> LoraConfig:
    """The LoraConfig the bytes of an `adapter_config.json` describe, checked field by field
    and with plain inits neutralised; a ConfigRefused names the field and why."""
    try:
        fields = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigRefused(f"not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ConfigRefused("not a JSON object")
    peft_type = fields.get("peft_type")
    if peft_type != "LORA":
        raise ConfigRefused(f"peft_type {peft_type!r} is not LoRA")
    kept: dict[str, Any] = {}
    for name, value in sorted(fields.items()):  # sorted: the same file, the same message
        if name == "peft_type" or name in DROPPED_FIELDS:
            continue
        if name in PLAIN_FIELDS:
            kept[name] = value
            continue
        check = RESTRICTED_FIELDS.get(name)
        if check is None:
            raise ConfigRefused(f"field {name!r} is not one this service knows how to serve")
        if (reason := check(value)) is not None:
            raise ConfigRefused(f"{name}: {reason}")
        kept[name] = value
    if kept.get("megatron_core", _DEFAULT_MEGATRON_CORE) not in (None, _DEFAULT_MEGATRON_CORE):
        raise ConfigRefused(f"megatron_core: {kept['megatron_core']!r} is not peft's default")
    kept["init_lora_weights"] = False  # each plain init is overwritten by the file's weights
    kept["eva_config"] = None
    kept["inference_mode"] = True
    try:
        return LoraConfig(**kept)
    except Exception as exc:  # peft raises ValueError/TypeError for values it cannot take
        raise ConfigRefused(f"peft refuses it: {exc}") from None
