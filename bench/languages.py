"""What telling a text's language by its script costs: µs a text over the project's SMS
(English and Taglish, data/) and the Korean test texts, and what each set is detected as.

Run: `python -m bench.languages` (or `make bench-languages`), a few seconds. Writes
bench/reports/languages.{md,json}. Wall-clock µs a text (one thread, `time.perf_counter`),
the median of ROUNDS rounds over each whole set after a warm-up round; the load average at
the start is in the report (the run does not wait for a quiet machine: it is this short).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

from api.serving.languages import detect
from bench.harness import REPORTS, host, load_average, run_head, write_report

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 5
SETS = {
    "SMS Spam Collection (English)": (ROOT / "data" / "sms_spam_collection.tsv", False),
    "PH spam and marketing SMS (English, Taglish)": (
        ROOT / "data" / "ph_spam_marketing_sms.tsv",
        True,
    ),
    "Korean test texts (tests/data)": (ROOT / "tests" / "data" / "korean_sms.tsv", False),
}


def texts_of(path: Path, has_header: bool) -> list[str]:
    """The last column of each line of a TSV."""
    lines = path.read_text(encoding="utf-8").splitlines()[1 if has_header else 0 :]
    return [line.split("\t")[-1] for line in lines if line]


def microseconds_a_text(texts: list[str]) -> float:
    """The median over ROUNDS rounds, after a warm-up one, of µs a text."""
    rounds = []
    for _ in range(ROUNDS + 1):
        start = time.perf_counter()
        for text in texts:
            detect(text)
        rounds.append((time.perf_counter() - start) / len(texts) * 1e6)
    return statistics.median(rounds[1:])


def measure() -> dict[str, Any]:
    figures: dict[str, Any] = {**run_head(host(), load_average()), "rounds": ROUNDS, "sets": []}
    for name, (path, has_header) in SETS.items():
        texts = texts_of(path, has_header)
        detected = Counter(detect(text) for text in texts)
        figures["sets"].append(
            {
                "name": name,
                "texts": len(texts),
                "mean_chars": round(sum(map(len, texts)) / len(texts), 1),
                "us_a_text": round(microseconds_a_text(texts), 2),
                "detected": dict(detected.most_common()),
            }
        )
    return figures


def page(figures: dict[str, Any]) -> str:
    m = figures["machine"]
    rows = "\n".join(
        f"| {s['name']} | {s['texts']:,} | {s['mean_chars']} | {s['us_a_text']} | "
        + ", ".join(f"{k} {v:,}" for k, v in s["detected"].items())
        + " |"
        for s in figures["sets"]
    )
    return f"""# Telling a text's language by its script

{figures["date"]}; {m["cpu"]}, {m["cores"]} cores, Python {m["python"]}; load average at
start {figures["load_average_at_start"]}. Written by `python -m bench.languages`.

Wall-clock µs a text of `detect` (api/serving/languages.py), one thread, the median of
{figures["rounds"]} rounds over each whole set after a warm-up round.

| texts | count | mean characters | µs a text | detected |
|---|---|---|---|---|
{rows}

An ASCII text is told by its first word holding a letter outside a URL; a text with other
characters has its letters counted per script. Against the ~19 ms of server CPU a served
one-text request costs (bench/reports/rollout.md), this is well under 0.1 %.
"""


def main() -> None:
    figures = measure()
    write_report(REPORTS, "languages", figures, page(figures))


if __name__ == "__main__":
    main()
