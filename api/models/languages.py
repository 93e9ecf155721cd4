"""The languages a models file may declare (ISO 639-1) and the script each is written in:
what a model's `languages` is checked against, and what detection by script can tell."""

from __future__ import annotations

from collections import Counter

# ISO 639-1 code → its usual script (ISO 15924). One script a language: detection reads
# scripts, so a language written in two (Serbian) is not declarable here.
_LATIN = (
    "en tl fr de es it pt nl id ms vi tr pl sv da no fi cs ro hu sk hr sl et lv lt ca eu gl "
    "ga cy sq sw af uz az jv su"
)
LANGUAGE_SCRIPTS: dict[str, str] = {
    **dict.fromkeys(_LATIN.split(), "Latn"),
    **dict.fromkeys(["ru", "uk", "bg", "be", "mk", "kk", "ky", "mn", "tg"], "Cyrl"),
    **dict.fromkeys(["ar", "fa", "ur", "ps"], "Arab"),
    **dict.fromkeys(["hi", "mr", "ne"], "Deva"),
    "ko": "Hang",
    "ja": "Jpan",
    "zh": "Hani",
    "th": "Thai",
    "el": "Grek",
    "he": "Hebr",
    "ka": "Geor",
    "hy": "Armn",
    "bn": "Beng",
}
_WRITERS = Counter(LANGUAGE_SCRIPTS.values())
# A script only one declarable language is written in names that language when detected.
OWNER_OF_SCRIPT: dict[str, str] = {
    script: code for code, script in LANGUAGE_SCRIPTS.items() if _WRITERS[script] == 1
}
NO_LANGUAGE = "none"  # a text without letters: digits, emoji, URLs, punctuation


def undetermined(script: str) -> str:
    """How a text in a script many languages share is named (BCP 47): `und-Latn`."""
    return f"und-{script}"


def language_of_script(script: str) -> str:
    """What detection reports for a text whose dominant script is `script`."""
    return OWNER_OF_SCRIPT.get(script) or undetermined(script)


def reported_languages() -> list[str]:
    """Every value detection reports: the metric's `language` label stays within these."""
    return sorted({language_of_script(s) for s in LANGUAGE_SCRIPTS.values()} | {NO_LANGUAGE})


def unknown_languages(codes: list[str]) -> list[str]:
    """The codes of `codes` that are not declarable (not in LANGUAGE_SCRIPTS)."""
    return [code for code in codes if code not in LANGUAGE_SCRIPTS]


def reads(languages: frozenset[str], detected: str) -> bool:
    """Whether a model declaring `languages` reads a text detected as `detected`: a text
    without letters is read by all; `und-<Script>` by a model with a language in it."""
    if detected == NO_LANGUAGE or detected in languages:
        return True
    if detected.startswith("und-"):
        script = detected[len("und-") :]
        return any(LANGUAGE_SCRIPTS[code] == script for code in languages)
    return False
