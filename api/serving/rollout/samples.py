"""The texts a candidate labels otherwise than the served adapter, kept for a person to read:
only where the operator names a folder (ROLLOUT_SAMPLES_DIR), capped per candidate."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from pathlib import Path

logger = logging.getLogger(__name__)


class DisagreementSamples:
    """Appends up to `cap` disagreements, one JSON line each, to
    `<folder>/<model>/<candidate>.jsonl`; the lines already there count towards the cap, so
    a restart does not write past it. A write that fails is logged once and turns it off."""

    def __init__(self, folder: Path, model: str, candidate: str, cap: int) -> None:
        self.path = folder / model / f"{candidate}.jsonl"
        self.cap = cap
        self.kept = _lines(self.path)
        self._failed = False

    @property
    def full(self) -> bool:
        return self._failed or self.kept >= self.cap

    def keep(self, text: str, served: str, served_label: str, candidate_label: str) -> None:
        if self.full:
            return
        line = {
            "at": datetime.now(timezone.utc).isoformat(),
            "text": text,
            "served": served,
            "served_label": served_label,
            "candidate_label": candidate_label,
        }
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as out:
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
        except OSError as exc:
            self._failed = True
            logger.warning("disagreement samples off: cannot write %s: %s", self.path, exc)
            return
        self.kept += 1


def _lines(path: Path) -> int:
    try:
        with path.open("rb") as kept:
            return sum(1 for _ in kept)
    except FileNotFoundError:
        return 0
