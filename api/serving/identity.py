"""What identifies an answer: one digest per servable (a model with one adapter), built once
when the model is loaded, that every cache tier keys by."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from api.models.adapters import AdapterDigests
from api.models.registry import ServedModel
from api.models.versions import library_versions


@dataclass(frozen=True)
class AnswerIdentity:
    """Everything that decides the scores a servable gives a text, and its digest."""

    components: dict[str, object]
    digest: str

    @classmethod
    def of(cls, served: ServedModel, adapter: str | None) -> AnswerIdentity:
        """The identity of `served` answering with `adapter` (None: a model without any)."""
        digests = served.loaded.adapter_digests.get(adapter) if adapter is not None else None
        return cls.with_adapter(served, digests)

    @classmethod
    def with_adapter(cls, served: ServedModel, digests: AdapterDigests | None) -> AnswerIdentity:
        """The identity of `served` answering with the adapter of these digests (None: none);
        an adapter loaded at run time has no name in the models file to look them up by."""
        loaded = served.loaded
        components: dict[str, object] = {
            "base": loaded.base_fingerprint,
            "adapter_weights": digests.weights if digests else None,
            "adapter_config": digests.config if digests else None,
            **loaded.numerics,
            "packed_batches": served.predictor.packs_batches,
            "cuda_graphs": served.predictor.cuda_graphs is not None,
            "scores_texts_alone": served.predictor.scores_alone,
            "pad_to_multiple_of": served.predictor.pad_to_multiple_of,
            "versions": library_versions(),
        }
        canonical = json.dumps(components, sort_keys=True, separators=(",", ":"), default=str)
        return cls(components, hashlib.sha256(canonical.encode()).hexdigest())
