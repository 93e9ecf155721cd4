"""A candidate adapter tried on live traffic beside a model's default: shadow or canary,
compared, guarded, promoted and rolled back (see docs/rollout.md)."""

from api.serving.rollout.rollout import Candidate, Ended, Rollout

__all__ = ["Candidate", "Ended", "Rollout"]
