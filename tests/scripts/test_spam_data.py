"""The training data loaders read both corpora as their cards (data/README.md) describe them,
and split them so that no text is in two splits."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from pathlib import Path

import pytest

from scripts.spam_data import (
    DEFAULT_DATA_PATH,
    PH,
    PH_DATA_PATH,
    PH_TEST_FROM,
    SMS,
    LabelledText,
    SpamDataError,
    SpamSplits,
    distinct_texts,
    joined,
    load_corpora,
    message_key,
    read_collection,
    read_ph_messages,
    split_ph,
)

# The cards' own figures (data/README.md), not the loader's.
SMS_LINES, SMS_HAM, SMS_SPAM, SMS_DISTINCT = 5574, 4827, 747, 5171
PH_ROWS = {"spam": 829, "ads": 1020, "gov": 148, "notifs": 11}
PH_BLANK_ROWS = 23
PH_FIRST, PH_LAST = datetime(2022, 9, 29), datetime(2026, 8, 21)
# The split every earlier model was scored on (artifacts/spam-minilm/previous.json).
SMS_SPLIT_SIZES = {"train": 4137, "validation": 517, "test": 517}
SMS_SPLIT_SPAM = {"train": 523, "validation": 65, "test": 65}


@pytest.fixture(scope="module")
def corpora() -> dict[str, SpamSplits]:
    return load_corpora()


def raw_ph_rows() -> list[list[str]]:
    """The PH file's data rows split on tabs, read here without the loader."""
    lines = PH_DATA_PATH.read_text(encoding="utf-8").splitlines()
    return [line.split("\t") for line in lines[1:]]


def test_sms_collection_reads_as_its_card_says() -> None:
    rows = read_collection()
    assert len(rows) == SMS_LINES
    assert Counter(r.label for r in rows) == {0: SMS_HAM, 1: SMS_SPAM}
    assert len(distinct_texts(rows)) == SMS_DISTINCT
    assert all(r.corpus == SMS and r.category == ("spam" if r.label else "ham") for r in rows)


def test_ph_set_reads_as_its_card_says() -> None:
    messages = read_ph_messages()
    blank = Counter(row[0] for row in raw_ph_rows() if row[2] == "<BLANK>")
    assert sum(blank.values()) == PH_BLANK_ROWS
    # Every published row is read, every <BLANK> row dropped, categories as tagged.
    assert Counter(m.category for m in messages) + blank == PH_ROWS
    assert not any(m.text == "<BLANK>" or not m.text.strip() for m in messages)
    assert all(PH_FIRST <= m.received < PH_LAST for m in messages)
    # Whitespace inside a text was collapsed to single spaces before publishing.
    assert not any("  " in m.text or "\t" in m.text or "\n" in m.text for m in messages)


def test_ph_labels_spam_as_spam_and_wanted_messages_as_ham(
    corpora: dict[str, SpamSplits],
) -> None:
    rows = corpora[PH].everything()
    assert {(r.category, r.label) for r in rows} == {
        ("spam", 1),
        ("ads", 0),
        ("gov", 0),
        ("notifs", 0),
    }
    tagged = {row[2]: row[0] for row in raw_ph_rows() if row[2] != "<BLANK>"}
    assert {r.text for r in rows} == set(tagged)  # each published text, once
    assert all((tagged[r.text] == "spam") == (r.label == 1) for r in rows)


def test_no_text_is_in_two_splits_or_two_corpora(corpora: dict[str, SpamSplits]) -> None:
    seen: dict[str, str] = {}
    for corpus, splits in corpora.items():
        for part in ("train", "validation", "test"):
            for row in getattr(splits, part):
                where = f"{corpus}/{part}"
                assert seen.setdefault(row.text, where) == where, row.text
    # In the PH set, texts that differ only in digits, case or spacing stay together too.
    keys: dict[str, str] = {}
    for part in ("train", "validation", "test"):
        for row in getattr(corpora[PH], part):
            assert keys.setdefault(message_key(row.text), part) == part, row.text


def test_the_original_sms_split_is_kept(corpora: dict[str, SpamSplits]) -> None:
    assert corpora[SMS].sizes() == SMS_SPLIT_SIZES
    assert corpora[SMS].spam_counts() == SMS_SPLIT_SPAM
    assert len(corpora[SMS].everything()) == SMS_DISTINCT


def test_ph_test_split_is_the_newest_months(corpora: dict[str, SpamSplits]) -> None:
    first_seen: dict[str, datetime] = {}
    for _category, received, text in raw_ph_rows():
        if text != "<BLANK>":
            when = datetime.strptime(received, "%Y-%m-%d %H:%M:%S")
            first_seen[text] = min(when, first_seen.get(text, when))
    group_first: dict[str, datetime] = {}
    for text, when in first_seen.items():
        key = message_key(text)
        group_first[key] = min(when, group_first.get(key, when))
    ph = corpora[PH]
    older = [*ph.train, *ph.validation]
    assert all(first_seen[r.text] >= PH_TEST_FROM for r in ph.test)
    # A text of a campaign that began earlier is not new: it stays with the older texts.
    assert all(group_first[message_key(r.text)] < PH_TEST_FROM for r in older)
    assert len(ph.test) + len(older) == len(first_seen)
    assert ph.test and ph.spam_counts()["test"] > 0
    assert abs(len(ph.validation) / len(older) - 0.1) < 0.02


def test_splits_are_deterministic_in_the_seed() -> None:
    first, again, other = load_corpora(), load_corpora(), load_corpora(seed=14)
    assert first == again
    assert {r.text for r in first[PH].test} == {r.text for r in other[PH].test}
    assert first[PH].validation != other[PH].validation


def test_joined_puts_the_named_corpora_together(corpora: dict[str, SpamSplits]) -> None:
    both = joined(corpora, (SMS, PH), seed=13)
    for part in ("train", "validation", "test"):
        expected = Counter(getattr(corpora[SMS], part)) + Counter(getattr(corpora[PH], part))
        assert Counter(getattr(both, part)) == expected
    only_ph = joined(corpora, (PH,), seed=13)
    assert {r.corpus for r in only_ph.everything()} == {PH}


def test_altered_or_missing_files_are_refused(tmp_path: Path) -> None:
    altered = tmp_path / "sms.tsv"
    altered.write_bytes(DEFAULT_DATA_PATH.read_bytes() + b"ham\tone more\n")
    with pytest.raises(SpamDataError, match="sha256"):
        read_collection(altered)
    with pytest.raises(SpamDataError, match="not found"):
        read_ph_messages(tmp_path / "missing.tsv")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("category\tdate\ttext\nspam\t2024-01-01 10:00:00\thi\n", "header"),
        ("category\tdate_received\ttext\nphishing\t2024-01-01 10:00:00\thi\n", ":2:"),
        ("category\tdate_received\ttext\nspam\t2024-01-01\thi\n", "date"),
        ("category\tdate_received\ttext\nspam\t2024-01-01 10:00:00\n", ":2:"),
    ],
)
def test_malformed_ph_rows_are_refused_by_line(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "ph.tsv"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(SpamDataError, match=message):
        read_ph_messages(path, verify=False)


def test_a_text_tagged_both_spam_and_ham_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ph.tsv"
    path.write_text(
        "category\tdate_received\ttext\n"
        "ads\t2024-01-01 10:00:00\tSale today\n"
        "spam\t2024-02-01 10:00:00\tSale today\n",
        encoding="utf-8",
    )
    with pytest.raises(SpamDataError, match="both labels"):
        split_ph(read_ph_messages(path, verify=False))
    assert distinct_texts([LabelledText("a", 0), LabelledText("a", 0)]) == [LabelledText("a", 0)]
