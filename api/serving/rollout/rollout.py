"""One model's rollout: the candidate adapter tried beside its default (shadow or canary),
the comparison of their answers, the guards, promotion and the way back."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from api.metrics import Metrics
from api.models.predictor import Scores
from api.models.registry import ServedModel
from api.models.spec import CandidateSpec
from api.serving.errors import Conflict, NotFound
from api.serving.rollout.comparison import Comparison, label_of
from api.serving.rollout.picking import is_picked, salt_for
from api.serving.rollout.samples import DisagreementSamples

logger = logging.getLogger(__name__)

Mode = Literal["shadow", "canary"]
ROLLBACK_REASONS = ("guard", "admin")


@dataclass(eq=False)
class Candidate:
    """A candidate while it stands: what it is compared with, and the counts so far."""

    spec: CandidateSpec
    served: str | None  # the default adapter when it started: the side it is compared with
    comparison: Comparison
    salt: bytes
    samples: DisagreementSamples | None = None

    @property
    def adapter(self) -> str:
        return self.spec.adapter

    @property
    def mode(self) -> Mode:
        return self.spec.mode

    def picks(self, texts: Sequence[str]) -> list[int]:
        """The indexes of the texts it takes (scores in shadow, answers in a canary)."""
        share, salt = self.spec.share, self.salt
        return [index for index, text in enumerate(texts) if is_picked(text, share, salt)]


@dataclass
class Ended:
    """How the last candidate ended: promoted, stopped or rolled back, why, and its counts."""

    state: Literal["promoted", "stopped", "rolled_back"]
    reason: str
    at: datetime
    summary: dict[str, Any]


@dataclass
class Rollout:
    """The candidate of one served model (at most one at a time) and its default adapter's
    history. Only the event loop touches it, so each change below is atomic: a request reads
    the default and the candidate once, as it starts."""

    served: ServedModel
    metrics: Metrics
    samples_dir: Path | None = None
    samples_cap: int = 200
    candidate: Candidate | None = None
    previous_default: str | None = None  # the way back after a promotion
    ended: Ended | None = None

    def __post_init__(self) -> None:
        for reason in ROLLBACK_REASONS:  # at 0 from the start: increases defined at once
            self.metrics.labelled(self.metrics.candidate_rollbacks, self.model, reason)
        self.metrics.labelled(self.metrics.candidate_promotions, self.model)

    @property
    def model(self) -> str:
        return self.served.name

    def start(self, spec: CandidateSpec) -> Candidate:
        """Sets `spec` as the candidate (one standing before is stopped): it must be one of the
        model's adapters, served unmerged, and not its default."""
        served, model = self.served, self.model
        if served.loaded.merged:
            raise Conflict(
                f"model {model!r} serves its adapter merged into its weights: a candidate needs "
                "adapters kept beside the base (quantization: none, or declare a second adapter)"
            )
        if not served.has_adapter(spec.adapter):
            raise NotFound(
                f"model {model!r} has no adapter {spec.adapter!r}: load it first "
                "(POST /v1/load_lora_adapter or the models file)"
            )
        if spec.adapter == served.default_adapter:
            raise Conflict(f"adapter {spec.adapter!r} is already model {model!r}'s default")
        if self.candidate is not None:
            self._end("stopped", f"replaced by {spec.adapter!r}")
        labels = served.loaded.labels
        comparison = Comparison(model, served.default_adapter, spec.adapter, labels, self.metrics)
        samples = None
        if self.samples_dir is not None:
            samples = DisagreementSamples(self.samples_dir, model, spec.adapter, self.samples_cap)
        self.candidate = Candidate(
            spec, served.default_adapter, comparison, salt_for(model, spec.adapter), samples
        )
        self._share(spec.share)
        logger.info(
            "model %s: candidate %s in %s at share %g beside %s",
            model,
            spec.adapter,
            spec.mode,
            spec.share,
            served.default_adapter,
        )
        return self.candidate

    def stop(self) -> Ended:
        """Stops the candidate; the default stays as it is."""
        if self.candidate is None:
            raise NotFound(f"model {self.model!r} has no candidate")
        return self._end("stopped", "admin")

    def promote(self) -> tuple[str, str | None]:
        """The candidate becomes the default, the old default the way back: (new, old). A
        request already under way keeps the adapter it started with; the caches key answers by
        adapter, so none of the old default's answers serves a request under the new one."""
        candidate = self.candidate
        if candidate is None:
            raise NotFound(f"model {self.model!r} has no candidate to promote")
        old = self.served.default_adapter
        self._end("promoted", f"{candidate.adapter!r} made the default, {old!r} kept to go back")
        self.served.default_adapter = candidate.adapter
        self.previous_default = old
        self.metrics.labelled(self.metrics.candidate_promotions, self.model).inc()
        logger.info("model %s: %s promoted, %s kept to go back", self.model, candidate.adapter, old)
        return candidate.adapter, old

    def roll_back(self) -> tuple[str | None, str | None]:
        """Undoes the last step: a standing candidate is rolled back (the default unchanged);
        else the last promotion (the previous default again): (default now, adapter left)."""
        if self.candidate is not None:
            adapter = self.candidate.adapter
            self._end("rolled_back", "admin")
            self._count_rollback("admin")
            return self.served.default_adapter, adapter
        if self.previous_default is None:
            raise Conflict(f"model {self.model!r}: nothing to roll back")
        left, back = self.served.default_adapter, self.previous_default
        self.served.default_adapter = back
        self.previous_default = None
        self._count_rollback("admin")
        logger.warning("model %s: rolled back to %s from %s", self.model, back, left)
        return back, left

    def adapter_in_use(self, name: str) -> str | None:
        """Why adapter `name` must stay loaded (None: it need not): it is the default, the
        candidate, the side a candidate is compared with, or the way back."""
        candidate = self.candidate
        if name == self.served.default_adapter:
            return f"it is model {self.model!r}'s default adapter"
        if candidate is not None and name in (candidate.adapter, candidate.served):
            return f"it is in model {self.model!r}'s rollout; stop or promote it first"
        if name == self.previous_default:
            return f"it is model {self.model!r}'s way back from a promotion; roll back first"
        return None

    def compare(
        self,
        candidate: Candidate,
        texts: Sequence[str],
        served: Sequence[Scores | None],
        tried: Sequence[Scores | None],
    ) -> None:
        """Counts the two sides' answers to `texts` (None: a side dropped it), keeps the
        disagreements where samples are kept, then applies the guards."""
        if candidate is not self.candidate:
            return  # ended while these were scored: they count for none
        flipped = candidate.comparison.add(served, tried)
        if candidate.samples is not None:
            labels = self.served.loaded.labels
            for index in flipped:
                mine, theirs = served[index], tried[index]
                assert mine is not None and theirs is not None
                candidate.samples.keep(
                    texts[index],
                    candidate.served or "none",
                    labels[label_of(mine)],
                    labels[label_of(theirs)],
                )
        self._guard(candidate)

    def summary(self) -> dict[str, Any]:
        """What the candidate route answers: the default, the way back, the candidate standing
        with its counts, and how the last one ended."""
        candidate = self.candidate
        standing = None
        if candidate is not None:
            standing = _described(candidate)
        ended = None
        if self.ended is not None:
            ended = {
                "state": self.ended.state,
                "reason": self.ended.reason,
                "at": self.ended.at.isoformat(),
                **self.ended.summary,
            }
        return {
            "model": self.model,
            "default_adapter": self.served.default_adapter,
            "previous_default": self.previous_default,
            "candidate": standing,
            "last": ended,
        }

    def _guard(self, candidate: Candidate) -> None:
        spec, comparison = candidate.spec, candidate.comparison
        if spec.max_flip_rate is None or comparison.texts < spec.min_texts:
            return
        if comparison.flip_rate <= spec.max_flip_rate:
            return
        reason = (
            f"guard: flip rate {comparison.flip_rate:.4f} over max_flip_rate "
            f"{spec.max_flip_rate:g} after {comparison.texts} texts"
        )
        self._end("rolled_back", reason)
        self._count_rollback("guard")
        logger.warning("model %s: candidate %s rolled back: %s", self.model, spec.adapter, reason)

    def _end(self, state: Literal["promoted", "stopped", "rolled_back"], reason: str) -> Ended:
        candidate = self.candidate
        assert candidate is not None
        self.candidate = None
        self._share(0.0, candidate)
        self.ended = Ended(state, reason, datetime.now(timezone.utc), _described(candidate))
        return self.ended

    def _share(self, share: float, candidate: Candidate | None = None) -> None:
        candidate = candidate or self.candidate
        assert candidate is not None
        self.metrics.candidate_share.labels(
            self.model, candidate.served or "none", candidate.adapter, candidate.mode
        ).set(share)

    def _count_rollback(self, reason: str) -> None:
        self.metrics.labelled(self.metrics.candidate_rollbacks, self.model, reason).inc()


def _described(candidate: Candidate) -> dict[str, Any]:
    spec = candidate.spec
    return {
        "adapter": spec.adapter,
        "mode": spec.mode,
        "share": spec.share,
        "max_flip_rate": spec.max_flip_rate,
        "min_texts": spec.min_texts,
        "served": candidate.served,
        "samples": None if candidate.samples is None else str(candidate.samples.path),
        **candidate.comparison.summary(),
    }
