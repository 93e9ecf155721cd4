"""The output JSONL: a header line saying what scored the file and from which input, then
one line per input row, in input order. Lines are written whole and flushed per chunk, so an
interrupted run leaves at most one cut line at the end, which --resume drops and scores
again, once the header says it is the same input scored the same way."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from api import __version__
from api.batch.rows import Row
from api.batch.scoring import Outcome, Servable
from api.serving.unicode import valid_unicode

HEADER_KEY = "header"
# What must match for --resume to add to an output: the same answers to the same rows.
RESUME_KEYS = ("model", "adapter", "labels", "identities", "truncate", "input")
# Not checked: the same file named from another folder is the same input.
UNCHECKED = ("input.path",)


class OutputError(ValueError):
    """An output that --resume cannot continue."""


def header(servable: Servable, truncate: bool, source: dict[str, Any]) -> dict[str, Any]:
    """The header line's content: the servable, its answer identities, truncation, and the
    input's identity (rows.input_identity)."""
    return {**asdict(servable), "truncate": truncate, "input": source, "version": __version__}


def row_line(row: Row, outcome: Outcome | None, expected: str | None = None) -> dict[str, Any]:
    """One row's line: row number, id (if the row has one), then the label and scores as
    /predict gives them (and which model gave them), or the error that kept it unscored."""
    line: dict[str, Any] = {"row": row.index}
    if row.id is not None:
        line["id"] = row.id
    if expected is not None:
        line["expected"] = expected
    if outcome is None:
        line["error"] = {"code": "invalid_input", "message": row.error or "no text"}
    elif outcome.error is not None:
        line["error"] = outcome.error
    else:
        assert outcome.ranked is not None
        line["label"] = outcome.ranked[0]["label"]
        line["scores"] = outcome.ranked
        line["answered_by"] = outcome.answered_by
    return line


@dataclass
class Done:
    """What an output already holds: its header and how many rows (the first ones)."""

    header: dict[str, Any] | None
    rows: int
    valid_bytes: int


def read_done(path: Path) -> Done:
    """The header and the whole row lines in order at the start of `path`; a cut or
    unreadable line and all after it do not count."""
    if not path.exists():
        return Done(None, 0, 0)
    found: dict[str, Any] | None = None
    rows = valid = 0
    with path.open("rb") as lines:
        for raw in lines:
            if not raw.endswith(b"\n"):
                break  # cut by an interruption mid-write
            try:
                line = json.loads(raw)
            except ValueError:
                break
            if found is None:
                if not isinstance(line, dict) or HEADER_KEY not in line:
                    raise OutputError(f"{path}: its first line is no header of loraserve score")
                found = line[HEADER_KEY]
            elif isinstance(line, dict) and line.get("row") == rows:
                rows += 1
            else:
                break
            valid += len(raw)
    return Done(found, rows, valid)


def check_resumable(path: Path, done: Done, wanted: dict[str, Any], total: int) -> None:
    """Refuses to add to an output that other answers (model, adapter, identity, labels,
    truncation) or another input (its content, format or columns) began, or that holds more
    rows than the input has: each difference named, then and now."""
    if done.header is None:
        return
    now = json.loads(json_text(wanted))  # as the header line reads back
    differing = [d for key in RESUME_KEYS for d in differences(done.header.get(key), now[key], key)]
    if differing:
        began = done.header.get("input")
        source = f"; it began from {began['path']}" if isinstance(began, dict) else ""
        raise OutputError(
            f"{path} was scored with other {', '.join(name for name, _, _ in differing)} "
            f"({'; '.join(f'{name}: {then!r} then, {now!r} now' for name, then, now in differing)})"
            f"{source}; score into a new file, or drop --resume to overwrite it"
        )
    if done.rows > total:
        raise OutputError(
            f"{path} holds {done.rows} rows, more than the {total} of its input; "
            "score into a new file, or drop --resume to overwrite it"
        )


def differences(then: object, now: object, name: str) -> list[tuple[str, object, object]]:
    """Where a header's value differs from the one wanted, by dotted name (input.sha256)."""
    if name in UNCHECKED:
        return []
    if isinstance(then, dict) and isinstance(now, dict):
        keys = dict.fromkeys([*then, *now])
        return [d for k in keys for d in differences(then.get(k), now.get(k), f"{name}.{k}")]
    return [] if then == now else [(name, then, now)]


def json_text(value: object, indent: int | None = None) -> str:
    """`value` as JSON that is valid UTF-8: a lone surrogate left in it (an id or label
    refused as such, a file name that is not UTF-8) is written as U+FFFD, so no write fails
    and every reader (jq, pandas) takes every line."""
    return valid_unicode(json.dumps(value, ensure_ascii=False, indent=indent))


def write_json(stream: IO[str], value: dict[str, Any], key: str, items: Iterable[object]) -> None:
    """`value` with the list of `items` under `key`, its last key, as json_text(indent=2)
    writes the whole (and a newline), but an item at a time: a list as long as the input
    (evaluate's disagreements) is never held."""
    assert key not in value
    empty = "[]\n}"
    opening = json_text({**value, key: []}, indent=2)
    stream.write(opening.removesuffix(empty))
    between = "[\n"
    for item in items:
        stream.write(between + "    " + json_text(item, indent=2).replace("\n", "\n    "))
        between = ",\n"
    stream.write(empty + "\n" if between == "[\n" else "\n  ]\n}\n")


class Writer:
    """Writes whole lines and flushes after each chunk."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream

    def write(self, lines: list[dict[str, Any]]) -> None:
        if not lines:
            return
        text = "".join(json_text(line) + "\n" for line in lines)
        self.stream.write(text)
        self.stream.flush()


def open_output(
    path: Path, resume: bool, wanted: dict[str, Any], total: int
) -> tuple[IO[str], int]:
    """The output file ready for appending, and how many rows it holds already (0 unless
    resuming). Resuming cuts what follows the last whole row line."""
    if not resume:
        stream = path.open("w", encoding="utf-8")
        Writer(stream).write([{HEADER_KEY: wanted}])
        return stream, 0
    done = read_done(path)
    check_resumable(path, done, wanted, total)
    if done.header is None:
        return open_output(path, False, wanted, total)
    with path.open("r+b") as handle:
        handle.truncate(done.valid_bytes)
    return path.open("a", encoding="utf-8"), done.rows
