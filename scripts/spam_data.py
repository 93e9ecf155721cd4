"""The two SMS corpora the spam adapters learn from: read, verify and split them.

- The SMS Spam Collection v.1 (Almeida, Gómez Hidalgo and Yamakami, DocEng 2011; CC BY 4.0):
  5,574 lines but only 5,171 distinct texts. Split on distinct texts, so the same message
  never lands in two splits, stratified by label, 80 / 10 / 10, from a seed. This is the
  split every earlier model was scored on ("the original held-out split"), kept as it was.
- "spam and marketing SMS" by Scott Lee Chua (CC BY 4.0): the texts one person in the
  Philippines received, 2022-2026, tagged spam / ads / gov / notifs. ``spam`` is spam; the
  others are messages the person wanted or had to get (marketing from their own businesses,
  government announcements, notifications), so they are ham (see ``PH_LABELS``). Split in
  time: the texts first received from ``PH_TEST_FROM`` on are the test split (the newest
  months); a stratified, seeded 10 % of the older ones is validation, the rest train.
  Texts that differ only in case, spacing or digits (one campaign, another number) are one
  group and go to one split together.

    from scripts.spam_data import load_corpora
    corpora = load_corpora()  # {"sms": SpamSplits, "ph": SpamSplits}
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

DATA_DIR: Path = Path(__file__).resolve().parent.parent / "data"
DEFAULT_DATA_PATH: Path = DATA_DIR / "sms_spam_collection.tsv"
DATA_SHA256 = "7d039a24a6083ed9ef0f806ebad56bbb976e3aeb8de05669173bfdc4996c239d"
PH_DATA_PATH: Path = DATA_DIR / "ph_spam_marketing_sms.tsv"
PH_DATA_SHA256 = "e9fb12d779feb4f7b02272e7a70245fb1fb3971fc06d7296c8eba798965689f2"
DEFAULT_SEED = 13

LABELS: tuple[str, str] = ("ham", "spam")
"""Label names by id: ham is 0, spam is 1."""
LABEL2ID: dict[str, int] = {name: i for i, name in enumerate(LABELS)}

SMS, PH = "sms", "ph"
CORPORA: tuple[str, str] = (SMS, PH)
"""Corpus ids, in the order reports list them."""

# The author tags `spam` what came unsolicited from unknown senders, and treats the rest
# as legitimate: marketing from businesses the person is a customer of, government
# public-service announcements, notifications. A user's filter must pass those.
PH_LABELS: dict[str, int] = {"spam": 1, "ads": 0, "gov": 0, "notifs": 0}
PH_HEADER: tuple[str, str, str] = ("category", "date_received", "text")
PH_BLANK = "<BLANK>"
"""An empty message as exported; the card says to drop these rows."""
PH_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"
PH_TEST_FROM = datetime(2026, 1, 1)
"""Texts first received on or after this (UTC+8) are the newest months: the test split."""

TRAIN_FRACTION = 0.8
VALIDATION_FRACTION = 0.1
# The SMS test split takes the rest (≈ 0.1); the PH validation split is this share of the
# messages older than PH_TEST_FROM.


class SpamDataError(ValueError):
    """The data file is missing, altered or malformed."""


@dataclass(frozen=True, slots=True)
class LabelledText:
    """One distinct message and its label (0 = ham, 1 = spam), with where it came from."""

    text: str
    label: int
    corpus: str = SMS
    category: str = ""
    """The corpus's own tag: ``ham``/``spam`` in the collection, spam/ads/gov/notifs in PH."""


@dataclass(frozen=True, slots=True)
class SpamSplits:
    """Disjoint train / validation / test splits over distinct texts."""

    train: list[LabelledText]
    validation: list[LabelledText]
    test: list[LabelledText]
    seed: int

    def sizes(self) -> dict[str, int]:
        """Number of texts in each split."""
        return {
            "train": len(self.train),
            "validation": len(self.validation),
            "test": len(self.test),
        }

    def spam_counts(self) -> dict[str, int]:
        """Number of spam texts in each split."""
        return {
            "train": sum(r.label for r in self.train),
            "validation": sum(r.label for r in self.validation),
            "test": sum(r.label for r in self.test),
        }

    def everything(self) -> list[LabelledText]:
        """Every distinct text of the corpus (the three splits together)."""
        return [*self.train, *self.validation, *self.test]


@dataclass(frozen=True, slots=True)
class PhMessage:
    """One published row of the PH file."""

    category: str
    received: datetime
    text: str


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _verified(path: Path, expected: str, verify: bool) -> Path:
    if not path.is_file():
        raise SpamDataError(f"data file not found: {path}")
    if verify:
        actual = sha256_file(path)
        if actual != expected:
            raise SpamDataError(f"{path}: sha256 {actual}, expected {expected}")
    return path


def read_collection(path: Path = DEFAULT_DATA_PATH, *, verify: bool = True) -> list[LabelledText]:
    """Every line of the SMS Spam Collection as a LabelledText, in file order (duplicates kept).

    With ``verify`` (the default) the file's sha256 must match the published copy.
    """
    rows: list[LabelledText] = []
    with _verified(path, DATA_SHA256, verify).open(encoding="utf-8", newline="") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.rstrip("\r\n")
            if not line:
                continue
            label, sep, text = line.partition("\t")
            if not sep or label not in LABEL2ID:
                raise SpamDataError(f"{path}:{lineno}: expected 'ham|spam<TAB>text'")
            rows.append(LabelledText(text=text, label=LABEL2ID[label], corpus=SMS, category=label))
    return rows


def read_ph_messages(path: Path = PH_DATA_PATH, *, verify: bool = True) -> list[PhMessage]:
    """Every row of the PH file whose text was published, in file order (duplicates kept).

    The header must be the card's; ``<BLANK>`` rows are dropped; every other row needs a
    known category and a date.
    """
    messages: list[PhMessage] = []
    with _verified(path, PH_DATA_SHA256, verify).open(encoding="utf-8", newline="") as fh:
        header = tuple(fh.readline().rstrip("\r\n").split("\t"))
        if header != PH_HEADER:
            raise SpamDataError(f"{path}: header {header}, expected {PH_HEADER}")
        for lineno, raw in enumerate(fh, start=2):
            line = raw.rstrip("\r\n")
            if not line:
                continue
            fields = line.split("\t")
            if len(fields) != len(PH_HEADER) or fields[0] not in PH_LABELS:
                raise SpamDataError(f"{path}:{lineno}: expected 'category<TAB>date<TAB>text'")
            category, received, text = fields
            if text == PH_BLANK:
                continue
            try:
                when = datetime.strptime(received, PH_DATE_FORMAT)
            except ValueError:
                raise SpamDataError(f"{path}:{lineno}: date {received!r}") from None
            messages.append(PhMessage(category=category, received=when, text=text))
    return messages


def every_text() -> list[str]:
    """Every published text of both corpora, in file order (duplicates kept), verified."""
    return [row.text for row in read_collection()] + [m.text for m in read_ph_messages()]


def message_key(text: str) -> str:
    """What makes two texts one message for splitting: case, spacing and digits ignored."""
    return re.sub(r"\s+", " ", re.sub(r"\d+", "0", text.casefold())).strip()


def distinct_texts(rows: list[LabelledText]) -> list[LabelledText]:
    """Exact-text duplicates removed (first occurrence kept); a text with two labels fails."""
    seen: dict[str, int] = {}
    out: list[LabelledText] = []
    for row in rows:
        previous = seen.get(row.text)
        if previous is None:
            seen[row.text] = row.label
            out.append(row)
        elif previous != row.label:
            raise SpamDataError(f"text carries both labels: {row.text[:60]!r}")
    return out


def _stratified_cut(
    groups: list[list[LabelledText]], fractions: tuple[float, float], rng: random.Random
) -> tuple[list[LabelledText], list[LabelledText], list[LabelledText]]:
    """Groups of one label each, cut per label into (first, second, rest) by count of groups."""
    parts: tuple[list[LabelledText], list[LabelledText], list[LabelledText]] = ([], [], [])
    for label in range(len(LABELS)):
        ordered = sorted((g for g in groups if g[0].label == label), key=lambda g: g[0].text)
        rng.shuffle(ordered)
        n_second = round(len(ordered) * fractions[1])
        n_rest = round(len(ordered) * (1.0 - fractions[0] - fractions[1]))
        n_first = len(ordered) - n_second - n_rest
        for index, group in enumerate(ordered):
            which = 0 if index < n_first else 1 if index < n_first + n_second else 2
            parts[which].extend(group)
    for part in parts:
        rng.shuffle(part)
    return parts


def split_distinct(rows: list[LabelledText], seed: int = DEFAULT_SEED) -> SpamSplits:
    """Stratified 80 / 10 / 10 split of already-distinct rows, deterministic in ``seed``.

    Each label's texts are sorted, shuffled with ``random.Random(seed)`` and cut; the test
    split takes what is left after train and validation. Each split is then shuffled.
    """
    rng = random.Random(seed)
    train, validation, test = _stratified_cut(
        [[row] for row in rows], (TRAIN_FRACTION, VALIDATION_FRACTION), rng
    )
    return SpamSplits(train=train, validation=validation, test=test, seed=seed)


def ph_rows(messages: Iterable[PhMessage]) -> list[tuple[datetime, LabelledText]]:
    """Each distinct text once, labelled by PH_LABELS, with the first time it was received.

    A text tagged twice keeps its earliest row's category; it fails if the tags map to both
    labels.
    """
    first: dict[str, tuple[datetime, LabelledText]] = {}
    for message in sorted(messages, key=lambda m: m.received):
        row = LabelledText(
            text=message.text,
            label=PH_LABELS[message.category],
            corpus=PH,
            category=message.category,
        )
        seen = first.setdefault(message.text, (message.received, row))
        if seen[1].label != row.label:
            raise SpamDataError(f"text carries both labels: {message.text[:60]!r}")
    return list(first.values())


def split_ph(messages: Iterable[PhMessage], seed: int = DEFAULT_SEED) -> SpamSplits:
    """The PH texts split in time (see module doc), texts of one ``message_key`` together."""
    groups: dict[str, list[tuple[datetime, LabelledText]]] = {}
    for received, row in ph_rows(messages):
        groups.setdefault(message_key(row.text), []).append((received, row))
    older: list[list[LabelledText]] = []
    test: list[LabelledText] = []
    for key, members in groups.items():
        if len({row.label for _, row in members}) > 1:
            raise SpamDataError(f"texts like {key[:60]!r} carry both labels")
        rows = [row for _, row in members]
        if min(received for received, _ in members) >= PH_TEST_FROM:
            test.extend(rows)
        else:
            older.append(rows)
    rng = random.Random(seed)
    train, validation, _ = _stratified_cut(
        older, (1.0 - VALIDATION_FRACTION, VALIDATION_FRACTION), rng
    )
    test.sort(key=lambda r: r.text)
    rng.shuffle(test)
    return SpamSplits(train=train, validation=validation, test=test, seed=seed)


def load_splits(path: Path = DEFAULT_DATA_PATH, seed: int = DEFAULT_SEED) -> SpamSplits:
    """The SMS Spam Collection read, verified, deduplicated and split (see module doc)."""
    return split_distinct(distinct_texts(read_collection(path)), seed=seed)


def load_ph_splits(path: Path = PH_DATA_PATH, seed: int = DEFAULT_SEED) -> SpamSplits:
    """The PH set read, verified and split in time (see module doc)."""
    return split_ph(read_ph_messages(path), seed=seed)


def load_corpora(
    sms_path: Path = DEFAULT_DATA_PATH, ph_path: Path = PH_DATA_PATH, seed: int = DEFAULT_SEED
) -> dict[str, SpamSplits]:
    """Both corpora's splits, by corpus id (CORPORA)."""
    return {SMS: load_splits(sms_path, seed), PH: load_ph_splits(ph_path, seed)}


def joined(corpora: dict[str, SpamSplits], names: Iterable[str], seed: int) -> SpamSplits:
    """The named corpora's splits put together, each split shuffled from ``seed``."""
    chosen = [corpora[name] for name in names]
    rng = random.Random(seed)
    parts = []
    for part in ("train", "validation", "test"):
        rows = [row for splits in chosen for row in getattr(splits, part)]
        rng.shuffle(rows)
        parts.append(rows)
    return SpamSplits(train=parts[0], validation=parts[1], test=parts[2], seed=seed)
