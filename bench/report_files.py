"""Where a benchmark's report goes: its figures as JSON and its page as markdown, side by side."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(out: Path, name: str, figures: dict[str, Any], page: str) -> None:
    """`out/name.json` (the figures) and `out/name.md` (the page), then the page printed."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    (out / f"{name}.md").write_text(page, encoding="utf-8")
    print(page)
