"""The rows of an input file (JSONL, CSV or TSV): each with its text, id and label, or the
reason it has none. A bad row is a row with an error, never a row dropped."""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from api.serving.unicode import has_lone_surrogate

Format = Literal["jsonl", "csv", "tsv"]
FORMATS: dict[str, Format] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".txt": "tsv",
}
# JSONL rows may carry their text under /predict's own field name.
JSONL_TEXT_FALLBACK = "inputs"
DIGEST_BLOCK_BYTES = 1 << 20


class InputError(ValueError):
    """The input file cannot be read at all (missing, unknown format, bad header)."""


@dataclass(frozen=True)
class Columns:
    """Which columns hold the text, the row id and the label (None: not asked for)."""

    text: str = "text"
    id: str | None = "id"  # a row without it gets no id, not an error
    label: str | None = None
    names: Sequence[str] | None = None  # column names of a CSV/TSV without a header row


@dataclass(frozen=True)
class Row:
    """One input row: `index` counts data rows from 0; `error` says why it has no text."""

    index: int
    text: str | None
    id: object = None  # as the file holds it: a JSON value, or a CSV/TSV field's text
    label: str | None = None
    error: str | None = None


def file_format(path: Path, given: Format | None = None) -> Format:
    """The format named, else the one the file's suffix says."""
    if given is not None:
        return given
    found = FORMATS.get(path.suffix.lower())
    if found is None:
        raise InputError(
            f"{path}: cannot tell the format from the suffix {path.suffix!r}; "
            f"pass --format ({', '.join(sorted(set(FORMATS.values())))})"
        )
    return found


def read_rows(path: Path, columns: Columns, given: Format | None = None) -> Iterator[Row]:
    """Every data row of the file in order, as Row."""
    kind = file_format(path, given)
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    records = _jsonl_records(path) if kind == "jsonl" else _table_records(path, kind, columns)
    for index, (record, problem) in enumerate(records):
        yield problem_row(index, problem) if record is None else _row(index, record, columns, kind)


def count_rows(path: Path, columns: Columns, given: Format | None = None) -> int:
    """How many rows read_rows gives: the total a progress report counts to."""
    return sum(1 for _ in read_rows(path, columns, given))


def input_identity(path: Path, columns: Columns, given: Format | None = None) -> dict[str, Any]:
    """What the output's header records of its input, for --resume to check that row n is
    still the same row n: the format, the columns, the size and SHA-256 of the whole file
    (a row inserted, changed or added anywhere changes them), and its path as given."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(DIGEST_BLOCK_BYTES):
            digest.update(block)
    named = asdict(columns)
    named["names"] = None if columns.names is None else list(columns.names)
    return {
        "path": str(path),
        "format": file_format(path, given),
        "columns": named,
        "bytes": path.stat().st_size,
        "sha256": digest.hexdigest(),
    }


def problem_row(index: int, problem: str | None) -> Row:
    return Row(index, None, error=problem or "unreadable row")


Record = dict[str, object]


def _jsonl_records(path: Path) -> Iterator[tuple[Record | None, str | None]]:
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline, a spacer) are no rows
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                cut = "" if line.endswith("\n") else "; the last line, with no newline: cut?"
                yield None, f"line {number}: not JSON ({exc.msg}){cut}"
                continue
            if not isinstance(record, dict):
                yield None, f"line {number}: not a JSON object"
                continue
            yield record, None


def _table_records(
    path: Path, kind: Format, columns: Columns
) -> Iterator[tuple[Record | None, str | None]]:
    with path.open(encoding="utf-8", errors="replace", newline="") as handle:
        # TSV has no quoting: a quote in a text is part of it (as in the shipped SMS data).
        if kind == "tsv":
            reader = csv.DictReader(
                handle, fieldnames=columns.names, delimiter="\t", quoting=csv.QUOTE_NONE
            )
        else:
            reader = csv.DictReader(handle, fieldnames=columns.names)
        header = reader.fieldnames or []
        if columns.text not in header:
            raise InputError(
                f"{path}: no column {columns.text!r} (columns: {list(header)}); "
                "name it with --text-column, or --columns for a file without a header row"
            )
        for record in reader:
            if None in record:  # more fields than the header names
                yield None, f"line {reader.line_num}: more fields than the header has"
                continue
            yield dict(record), None


def _row(index: int, record: Record, columns: Columns, kind: Format) -> Row:
    text = record.get(columns.text)
    if text is None and kind == "jsonl" and columns.text == "text":
        text = record.get(JSONL_TEXT_FALLBACK)
    row_id = None if columns.id is None else record.get(columns.id)
    label = _label(record, columns.label)
    if text is None:
        return Row(index, None, row_id, label, f"no {columns.text!r} in this row")
    if not isinstance(text, str):
        return Row(index, None, row_id, label, f"{columns.text!r} is not a string")
    # Not scored: its line could not give back the id or label the file holds (a text with
    # one is the service's to refuse, as it refuses it from any client).
    for name, value in ((columns.id, row_id), (columns.label, label)):
        if value is not None and has_lone_surrogate(value):
            problem = f"{name!r} is not valid Unicode (lone surrogate, written as U+FFFD)"
            return Row(index, None, row_id, label, problem)
    return Row(index, text, row_id, label)


def _label(record: Record, name: str | None) -> str | None:
    """A label as text: a JSON 1 is "1", as the same column of a CSV file reads."""
    if name is None:
        return None
    value = record.get(name)
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value)
