"""The SMS Spam Collection v.1: read, verify and split it deterministically.

The collection (Almeida, Gómez Hidalgo and Yamakami, DocEng 2011; CC BY 4.0) has 5,574
lines but only 5,171 distinct texts. The split is made on distinct texts, so the same
message never lands in two splits, stratified by label, 80 / 10 / 10, from a seed.

    from scripts.spam_data import load_splits
    splits = load_splits()  # train / validation / test lists of LabelledText
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

DEFAULT_DATA_PATH: Path = (
    Path(__file__).resolve().parent.parent / "data" / "sms_spam_collection.tsv"
)
DATA_SHA256 = "7d039a24a6083ed9ef0f806ebad56bbb976e3aeb8de05669173bfdc4996c239d"
DEFAULT_SEED = 13

LABELS: tuple[str, str] = ("ham", "spam")
"""Label names by id: ham is 0, spam is 1."""
LABEL2ID: dict[str, int] = {name: i for i, name in enumerate(LABELS)}

TRAIN_FRACTION = 0.8
VALIDATION_FRACTION = 0.1
# The test split takes the rest (≈ 0.1).


class SpamDataError(ValueError):
    """The data file is missing, altered or malformed."""


@dataclass(frozen=True, slots=True)
class LabelledText:
    """One distinct message and its label (0 = ham, 1 = spam)."""

    text: str
    label: int


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


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_collection(path: Path = DEFAULT_DATA_PATH, *, verify: bool = True) -> list[LabelledText]:
    """Every line of the TSV as a LabelledText, in file order (duplicates kept).

    With ``verify`` (the default) the file's sha256 must match the published copy.
    """
    if not path.is_file():
        raise SpamDataError(f"data file not found: {path}")
    if verify:
        actual = sha256_file(path)
        if actual != DATA_SHA256:
            raise SpamDataError(f"{path}: sha256 {actual}, expected {DATA_SHA256}")
    rows: list[LabelledText] = []
    with path.open(encoding="utf-8", newline="") as fh:
        for lineno, raw in enumerate(fh, start=1):
            line = raw.rstrip("\r\n")
            if not line:
                continue
            label, sep, text = line.partition("\t")
            if not sep or label not in LABEL2ID:
                raise SpamDataError(f"{path}:{lineno}: expected 'ham|spam<TAB>text'")
            rows.append(LabelledText(text=text, label=LABEL2ID[label]))
    return rows


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


def split_distinct(rows: list[LabelledText], seed: int = DEFAULT_SEED) -> SpamSplits:
    """Stratified 80 / 10 / 10 split of already-distinct rows, deterministic in ``seed``.

    Each label's texts are sorted, shuffled with ``random.Random(seed)`` and cut; the test
    split takes what is left after train and validation. Each split is then shuffled.
    """
    rng = random.Random(seed)
    train: list[LabelledText] = []
    validation: list[LabelledText] = []
    test: list[LabelledText] = []
    for label in range(len(LABELS)):
        group = sorted((r for r in rows if r.label == label), key=lambda r: r.text)
        rng.shuffle(group)
        n_validation = round(len(group) * VALIDATION_FRACTION)
        n_test = round(len(group) * (1.0 - TRAIN_FRACTION - VALIDATION_FRACTION))
        n_train = len(group) - n_validation - n_test
        train.extend(group[:n_train])
        validation.extend(group[n_train : n_train + n_validation])
        test.extend(group[n_train + n_validation :])
    for part in (train, validation, test):
        rng.shuffle(part)
    return SpamSplits(train=train, validation=validation, test=test, seed=seed)


def load_splits(path: Path = DEFAULT_DATA_PATH, seed: int = DEFAULT_SEED) -> SpamSplits:
    """Read and verify the collection, deduplicate texts, and split it (see module doc)."""
    return split_distinct(distinct_texts(read_collection(path)), seed=seed)
