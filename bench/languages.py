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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from api.serving.languages import detect
from bench.harness import REPORTS, host, load_average, run_head, write_report
from scripts.spam_data import read_collection, read_ph_messages

ROOT = Path(__file__).resolve().parents[1]
ROUNDS = 5
KOREAN = ROOT / "tests" / "data" / "korean_sms.tsv"


def korean_texts() -> list[str]:
    """The Korean test texts (`label<TAB>text` a line)."""
    return [line.split("\t", 1)[1] for line in KOREAN.read_text(encoding="utf-8").splitlines()]


# The longest text a request may hold (MAX_TEXT_CHARS as shipped), one token shaped like the
# start of an address again and again: where the address pattern could backtrack. A regex
# that did took 0.8 s of the event loop for a fifth of this.
LONGEST_TEXT = 20_000


def address_like_tokens() -> list[str]:
    """Whitespace-free texts of LONGEST_TEXT characters that almost hold an address."""
    half = LONGEST_TEXT // 2
    return [
        "a." * half,  # dotted, no domain
        "a." * (half - 2) + "com",  # dotted, a domain at the end
        "a" * (LONGEST_TEXT - 1) + "@",  # an e-mail's name, no domain
        "a@" * half,  # every other character an "@"
        ("a" * 30 + ".") * (LONGEST_TEXT // 31) + ".com",  # words and a broken domain
    ]


SETS: dict[str, Callable[[], list[str]]] = {
    "SMS Spam Collection (English)": lambda: [row.text for row in read_collection()],
    "PH spam and marketing SMS (English, Taglish)": lambda: [m.text for m in read_ph_messages()],
    "Korean test texts (tests/data)": korean_texts,
    f"{LONGEST_TEXT:,}-character address-like tokens (worst case)": address_like_tokens,
}


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
    for name, read in SETS.items():
        texts = read()
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
one-text request costs (bench/reports/rollout.md), this is well under 0.1 %. The last row is
the worst a client can send: the longest text a request may hold, one token almost an
address; its cost grows with the length, not with its square.
"""


def main() -> None:
    figures = measure()
    write_report(REPORTS, "languages", figures, page(figures))


if __name__ == "__main__":
    main()
