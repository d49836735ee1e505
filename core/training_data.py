"""Structural checks of fine-tune rows, run in the API at submit (no torch).

A training row is one of three shapes: chat `{"messages": [...]}` (the loss is on assistant turns only),
`{"prompt": str, "completion": str}` (the loss is on the completion only), or `{"text": str}` (every token).
`input_format` in the spec pins one shape; `auto` takes each row as it comes.

The file holding the rows is read by the reader every job uses (`core.dataset.read_records`): JSONL, CSV, Parquet
or a saved Hugging Face dataset (`file_format` in the spec), with `input_columns` mapping our fields (`messages`,
`prompt`, `completion`, `text`) to the file's columns. Table cells are normalised before the row check: a CSV
`messages` cell holds the messages as JSON (so may a Parquet string column), and an empty CSV cell or a Parquet null
counts as missing, so one table can hold rows of several shapes.

Unlike a generation dataset, where a bad row becomes a failed row and the others run, a bad training row refuses
the whole job at submit: silently training on part of the data is worse than asking for a fixed file. The error
names the first bad rows by their place (`line 7` for JSONL and CSV, whose header is line 1; `row 6`, 0-based, for
Parquet and saved datasets) and what each lacks. Token checks (max_seq_length) need the tokenizer and run on the
worker before the first training step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from core import formats
from core.dataset import read_jsonl, read_records
from core.errors import InvalidInput
from core.formats import Record

ROLES = ("system", "user", "assistant", "tool", "developer")
FORMATS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}
FIELDS = ("messages", "prompt", "completion", "text")  # what input_columns may map
FILE_FORMATS = ("auto", "jsonl", "csv", "parquet", "hf")
SHOWN_ERRORS = 5


@dataclass
class TrainingRow:
    idx: int
    line: int  # the row's place: 1-based physical line (jsonl, csv) or 0-based row (parquet, hf)
    input: dict[str, Any]
    where: str = "line"  # "line" or "row", as `core.formats.location` names the place


def file_format(detected: str) -> str:
    """The reader for a detected format: JSONL lines that look like OpenAI batch requests are still JSONL here
    (their rows fail the training-row check with what they lack)."""
    return "jsonl" if detected == "openai" else detected


def parse_training_file(
    path: Path,
    fmt: str,
    *,
    input_format: str = "auto",
    columns: dict[str, str] | None = None,
    split: str = "train",
    start_idx: int = 0,
    max_rows: int,
    max_row_bytes: int,
    what: str = "dataset",
) -> list[TrainingRow]:
    """Every row of a training file in format `fmt` (jsonl, csv, parquet or hf; not `auto`), checked; raise
    InvalidInput naming the bad rows, an empty file, or a file the reader refuses as a whole."""
    fmt = file_format(fmt)
    if fmt not in FILE_FORMATS[1:]:
        raise InvalidInput(f"file_format {fmt!r} cannot hold training rows: use one of {', '.join(FILE_FORMATS)}")
    records = read_records(path, fmt, columns=columns, max_row_bytes=max_row_bytes)
    return training_rows(
        records,
        fmt,
        input_format=input_format,
        columns=columns,
        split=split,
        start_idx=start_idx,
        max_rows=max_rows,
        what=what,
    )


def parse_training_jsonl(
    stream: BinaryIO,
    *,
    input_format: str = "auto",
    split: str = "train",
    start_idx: int = 0,
    max_rows: int,
    max_row_bytes: int,
    what: str = "dataset",
) -> list[TrainingRow]:
    """Every row of a JSONL training stream, checked (see `parse_training_file`)."""
    return training_rows(
        read_jsonl(stream, max_row_bytes=max_row_bytes),
        "jsonl",
        input_format=input_format,
        split=split,
        start_idx=start_idx,
        max_rows=max_rows,
        what=what,
    )


def training_rows(
    records: Iterable[Record],
    fmt: str,
    *,
    input_format: str = "auto",
    columns: dict[str, str] | None = None,
    split: str = "train",
    start_idx: int = 0,
    max_rows: int,
    what: str = "dataset",
) -> list[TrainingRow]:
    """Checked training rows of a reader's records; one bad record refuses them all (naming the first few)."""
    where = formats.location(fmt)
    rows, errors = [], []
    for record in records:
        if len(rows) + len(errors) >= max_rows:
            raise InvalidInput(f"the {what} has more than {max_rows} rows (JOBS_MAX_ROWS): split it")
        try:
            if record.error is not None:
                raise ValueError(record.error)
            row = check_row(_cells(record.data, fmt), input_format, columns=columns, table=fmt != "jsonl")
        except ValueError as exc:
            errors.append(f"{where} {record.pos}: {exc}")
            continue
        if split != "train":
            row["split"] = split
        rows.append(TrainingRow(start_idx + len(rows), record.pos, row, where))
    if errors:
        more = f" (and {len(errors) - SHOWN_ERRORS} more)" if len(errors) > SHOWN_ERRORS else ""
        raise InvalidInput(
            f"the fine-tune {what} has {len(errors)} bad row(s){more}: "
            + "; ".join(errors[:SHOWN_ERRORS])
            + ". Fix them and submit again"
        )
    if not rows:
        if fmt == "jsonl":
            raise InvalidInput(
                f"the fine-tune {what} is empty: expected one JSON object per line with 'messages', "
                "'prompt' and 'completion', or 'text'"
            )
        raise InvalidInput(
            f"the fine-tune {what} has no rows: expected a {fmt} file with a 'messages', 'prompt' "
            "and 'completion', or 'text' column (or map yours with input_columns / --column)"
        )
    return rows


def validation_rows(train: int, fraction: float) -> int:
    """How many of `train` rows a `validation_split` of `fraction` holds out (at least one)."""
    return max(1, round(train * fraction))


def split_problem(train: int, fraction: float | None) -> str | None:
    """Why a `validation_split` of `fraction` cannot split `train` training rows (it would hold out every one), or
    None: refused at submit, and by the worker (worker/training/data.py) for a job stored before that check."""
    if not fraction or validation_rows(train, fraction) < train:
        return None
    return (
        f"validation_split={fraction} leaves no training row of {train}: lower it, give more rows, or hold "
        "out rows with validation_input"
    )


def _cells(data: dict[str, Any], fmt: str) -> dict[str, Any]:
    """A table's row as a training row: an empty CSV cell or a null is missing; `messages` may be JSON text."""
    if fmt == "jsonl":
        return data
    out = {k: v for k, v in data.items() if not (k in FIELDS and (v is None or (fmt == "csv" and v == "")))}
    if isinstance(out.get("messages"), str):
        try:
            out["messages"] = json.loads(out["messages"])
        except ValueError:
            raise ValueError("the messages column must hold a JSON list of {role, content} objects") from None
    return out


def detect_format(obj: dict[str, Any]) -> str:
    if "messages" in obj:
        return "messages"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    if "text" in obj:
        return "text"
    raise ValueError("a training row needs 'messages' (chat), 'prompt' and 'completion', or 'text'")


def check_row(
    obj: dict[str, Any], input_format: str = "auto", *, columns: dict[str, str] | None = None, table: bool = False
) -> dict[str, Any]:
    """The stored form of one training row (only its shape's fields), or ValueError saying what is missing.

    `columns` (the spec's input_columns) lets a missing field name the file's column it was mapped from; `table`
    says that an empty cell or null counts as missing."""
    try:
        fmt = detect_format(obj) if input_format == "auto" else input_format
    except ValueError as exc:
        raise ValueError(f"{exc} (an empty cell or null counts as missing)" if table else str(exc)) from None
    fields = FORMATS[fmt]
    for name in fields:
        if name not in obj:
            column = f" (column {columns[name]!r})" if columns and name in columns else ""
            raise ValueError(
                f"a {fmt} row needs {' and '.join(repr(f) for f in fields)}; '{name}'{column} is "
                + ("missing or empty" if table else "missing")
            )
    if fmt == "messages":
        return {"messages": _check_messages(obj["messages"])}
    for name in fields:
        if not isinstance(obj[name], str) or not obj[name]:
            raise ValueError(f"'{name}' must be a non-empty string")
    return {name: obj[name] for name in fields}


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str) or msg.get("role") not in ROLES:
            raise ValueError(
                f"messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) and 'content' (a string)"
            )
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ValueError(
            "a chat row needs at least one non-empty assistant message: the loss is on assistant turns only"
        )
    return [{"role": m["role"], "content": m["content"]} for m in messages]
