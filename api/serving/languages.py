"""A text's language told by its script: letters counted per Unicode script once URLs and
e-mail addresses are taken out, a Hangul syllable weighed by its jamo. No model, no download:
a few microseconds a text (bench/reports/languages.md)."""

from __future__ import annotations

import bisect
import functools
import re

from api.models.languages import NO_LANGUAGE, language_of_script

# Latin in every language, they say nothing of the text's: taken out of each
# whitespace-separated token that holds a "." or "@" (a regex over the whole text costs more
# than everything else here together). An address starts where a run of its characters
# does (the lookbehinds): tried at every character of a long run instead, the regex took
# time quadratic in the token's length (0.8 s of the event loop for one 4,000-character
# token of "a." repeated), where now it takes linear time.
_TOP_LEVEL_DOMAINS = "com|net|org|ly|kr|ph|io|me|co|gl|to|cc|info|biz|xyz|top|site|link|app|page"
_ADDRESS = re.compile(
    r"(?:https?://|www\.)\S*"
    r"|(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
    r"|(?<![\w.-])[\w-]+(?:\.[\w-]+)*\."
    rf"(?:{_TOP_LEVEL_DOMAINS})\b(?:/\S*)?",
    re.IGNORECASE,
)
# What every address holds: a token without it (a dotted number, "Rs.500") skips the regex
# above, which costs ~10 µs on such a token.
_ADDRESS_MARK = re.compile(rf"@|https?://|www\.|\.(?:{_TOP_LEVEL_DOMAINS})\b", re.IGNORECASE)
_ASCII_LETTERS = re.compile(r"[A-Za-z]")
_LETTER_BYTES = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_HANGUL_SYLLABLES = (0xAC00, 0xD7A3)
# (first code point, last, script, weight): a weight is about how many Latin letters one
# character holds. Hangul syllables are weighed apart (2 or 3 jamo); kana write a syllable
# and Han characters a morpheme, so they count 2. Sorted by first code point.
_RANGES: list[tuple[int, int, str, int]] = [
    (0x00C0, 0x024F, "Latn", 1),
    (0x0370, 0x03FF, "Grek", 1),
    (0x0400, 0x052F, "Cyrl", 1),
    (0x0531, 0x058F, "Armn", 1),
    (0x0590, 0x05FF, "Hebr", 1),
    (0x0600, 0x06FF, "Arab", 1),
    (0x0750, 0x077F, "Arab", 1),
    (0x0900, 0x097F, "Deva", 1),
    (0x0980, 0x09FF, "Beng", 1),
    (0x0E00, 0x0E7F, "Thai", 1),
    (0x10A0, 0x10FF, "Geor", 1),
    (0x1100, 0x11FF, "Hang", 1),
    (0x1E00, 0x1EFF, "Latn", 1),
    (0x1F00, 0x1FFF, "Grek", 1),
    (0x3040, 0x30FF, "Kana", 2),
    (0x3130, 0x318F, "Hang", 1),
    (0x3400, 0x4DBF, "Hani", 2),
    (0x4E00, 0x9FFF, "Hani", 2),
    (0xA960, 0xA97F, "Hang", 1),
    (0xD7B0, 0xD7FF, "Hang", 1),
    (0xF900, 0xFAFF, "Hani", 2),
    (0xFF21, 0xFF3A, "Latn", 1),
    (0xFF41, 0xFF5A, "Latn", 1),
    (0xFF66, 0xFF9F, "Kana", 2),
    (0xFFA0, 0xFFDC, "Hang", 1),
]
_STARTS = [first for first, *_ in _RANGES]
_NOT_LETTERS = {0xD7, 0xF7}  # × and ÷ sit among the Latin-1 letters
_LATIN = "Latn"


@functools.lru_cache(maxsize=8192)
def _script(char: str) -> tuple[str, int] | None:
    """The script and weight of one non-ASCII character; None for no letter."""
    code_point = ord(char)
    if _HANGUL_SYLLABLES[0] <= code_point <= _HANGUL_SYLLABLES[1]:
        return "Hang", 2 if (code_point - 0xAC00) % 28 == 0 else 3
    at = bisect.bisect_right(_STARTS, code_point) - 1
    if at < 0 or code_point in _NOT_LETTERS:
        return None
    _, last, script, weight = _RANGES[at]
    return (script, weight) if code_point <= last else None


def without_addresses(text: str) -> list[str]:
    """The text's whitespace-separated tokens, each without the URLs and e-mail addresses
    it holds."""
    # `_holds_address` written out: a call a token cost Korean texts ~7 % (timeit, in turns).
    return [
        _ADDRESS.sub("", token)
        if ("." in token or "@" in token) and _ADDRESS_MARK.search(token)
        else token
        for token in text.split()
    ]


def _holds_address(token: str) -> bool:
    return ("." in token or "@" in token) and _ADDRESS_MARK.search(token) is not None


def script_weights(text: str) -> dict[str, int]:
    """The weighed letters of `text` per script, its URLs and e-mail addresses left out."""
    kept = " ".join(without_addresses(text))
    ascii_part = kept.encode("ascii", "ignore")
    latin = len(ascii_part) - len(ascii_part.translate(None, _LETTER_BYTES))
    weights: dict[str, int] = {_LATIN: latin} if latin else {}
    if len(ascii_part) == len(kept):
        return weights
    for char in _NON_ASCII.findall(kept):
        found = _script(char)
        if found is not None:
            script, weight = found
            weights[script] = weights.get(script, 0) + weight
    return weights


def dominant_script(weights: dict[str, int]) -> str | None:
    """The script of most weight; on a tie one other than Latin (a Latin-script model would
    misread the other half, a model of another script meets Latin brand names daily)."""
    if not weights:
        return None
    return max(weights, key=lambda script: (weights[script], script != _LATIN, script))


def detect(text: str) -> str:
    """The text's language as detection can tell it: a code where a script has one language
    (`ko`, `ja`, `th`…), `und-<Script>` where many share it (`und-Latn`), `none` without
    letters. Kana anywhere makes Han Japanese."""
    if text.isascii():  # the common case: Latin or no letters, told by the first word
        for token in text.split():
            if _holds_address(token):
                token = _ADDRESS.sub("", token)
            if _ASCII_LETTERS.search(token):
                return language_of_script(_LATIN)
        return NO_LANGUAGE
    weights = script_weights(text)
    if "Kana" in weights:
        weights["Kana"] += weights.pop("Hani", 0)
    script = dominant_script(weights)
    if script is None:
        return NO_LANGUAGE
    return language_of_script("Jpan" if script == "Kana" else script)
