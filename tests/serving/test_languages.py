"""Detection by script: the dominant script of a text's letters, URLs and e-mail addresses
left out, Hangul weighed by its jamo; and what a models file may declare."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.models.languages import reads, reported_languages
from api.models.spec import ModelSpec
from api.serving.languages import detect
from scripts.spam_data import every_text

KOREAN = Path(__file__).parents[1] / "data" / "korean_sms.tsv"


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("내일 회의 3시로 변경되었습니다", "ko"),
        ("Are we still meeting for lunch tomorrow?", "und-Latn"),
        # Short texts: one to three words are told as well as long ones.
        ("네", "ko"),
        ("ok", "und-Latn"),
        ("감사합니다 ^^", "ko"),
        ("Txt STOP", "und-Latn"),
        # Mixed: the weighed letters decide; a syllable holds 2-3 Latin letters' worth.
        ("[Web발신] Amazon 결제 승인", "ko"),
        ("ok 네", "ko"),  # a tie goes to the script that is not Latin
        ("[Web발신] Your DHL parcel is on hold, pay the fee today", "und-Latn"),
        ("확인http://bit.ly/3kR9xT", "ko"),  # a URL glued to Hangul is still taken out
        ("test@naver.com 확인", "ko"),
        ("메일 j.doe+kr@mail.co.kr 확인", "ko"),  # an address with dots and a "+" in its name
        ("1764691373.12.3 안녕하세요", "ko"),  # a dotted number is no address, and no letter
        ("Rs.500 cashback 안녕", "und-Latn"),  # "Rs" is letters: no domain follows the dot
        # No letters: no language, every model answers.
        ("😀🎉👍", "none"),
        ("010-1234-5678 42,000", "none"),
        ("http://bit.ly/3kR9xT", "none"),
        ("www.example.com/path?q=1", "none"),
        ("?!... ---", "none"),
        ("", "none"),
        # Scripts one language owns name it; shared ones are und-<Script>.
        ("こんにちは、元気ですか", "ja"),
        ("東京へ行きます", "ja"),  # Kana anywhere makes Han Japanese
        ("你好，明天见", "zh"),
        ("สวัสดีครับ", "th"),
        ("Γεια σου", "el"),
        ("שלום", "he"),
        ("Привет, как дела", "und-Cyrl"),
        ("مرحبا", "und-Arab"),
        ("Ça va très bien, merci", "und-Latn"),
        ("Ｈｅｌｌｏ", "und-Latn"),  # fullwidth Latin is Latin
    ],
)
def test_detects_the_dominant_script(text: str, language: str) -> None:
    assert detect(text) == language
    assert language in reported_languages()  # the metric's label stays bounded


@pytest.mark.parametrize(
    ("token", "language"),
    [
        ("a." * 10_000, "und-Latn"),  # dotted, no domain: its letters count
        ("a." * 9_998 + "com", "none"),  # one long domain: taken out whole
        ("a" * 19_999 + "@", "und-Latn"),  # an e-mail's name without its domain
        ("a@" * 10_000, "und-Latn"),  # no domain after any "@"
        ("확인 " + "a." * 9_990 + "com", "ko"),  # beside a word: the domain is taken out
    ],
)
def test_the_longest_address_like_token_a_request_may_hold(token: str, language: str) -> None:
    # MAX_TEXT_CHARS as shipped (20,000): the address pattern starts only where a run of its
    # characters does, so it scans such a token once (bench/reports/languages.md, last row).
    assert detect(token) == language


def test_a_model_reads_its_languages_their_script_and_texts_without_letters() -> None:
    english = frozenset({"en", "tl"})
    assert reads(english, "und-Latn") and reads(english, "none")
    assert not reads(english, "ko") and not reads(english, "und-Cyrl")
    korean = frozenset({"ko"})
    assert reads(korean, "ko") and reads(korean, "none") and not reads(korean, "und-Latn")


def test_every_korean_test_text_is_korean_and_every_project_sms_is_not() -> None:
    korean = [line.split("\t", 1)[1] for line in KOREAN.read_text("utf-8").splitlines()]
    assert len(korean) >= 240
    assert {detect(text) for text in korean} == {"ko"}
    assert {detect(text) for text in every_text()} <= {"und-Latn", "none"}


def test_the_models_file_refuses_a_language_detection_cannot_tell() -> None:
    base = {"name": "m", "base": "x"}
    assert ModelSpec.model_validate({**base, "languages": ["ko", "ko"]}).languages == ["ko"]
    with pytest.raises(ValueError, match=r"\['kr'\] are not ISO 639-1 codes"):
        ModelSpec.model_validate({**base, "languages": ["kr"]})
    with pytest.raises(ValueError, match="on_other_language"):
        ModelSpec.model_validate({**base, "languages": ["ko"], "on_other_language": "skip"})
    with pytest.raises(ValueError, match="at least 1"):
        ModelSpec.model_validate({**base, "languages": []})
    assert ModelSpec.model_validate(base).languages is None  # unset: any, as before
