"""Structural checks of fine-tune rows, run in the API at submit (no torch).

A training row is one of three formats: chat `{"messages": [...]}` (the loss is on assistant turns only),
`{"prompt": str, "completion": str}` (the loss is on the completion only), or `{"text": str}` (every token).
`input_format` in the spec pins one format; `auto` takes each row as it comes.

Unlike a generation dataset, where a bad row becomes a failed row and the others run, a bad training row refuses
the whole job at submit: silently training on part of the data is worse than asking for a fixed file. The error
names the first bad lines and what each lacks. Token checks (max_seq_length) need the tokenizer and run on the
worker before the first training step.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from core.errors import InvalidInput

ROLES = ("system", "user", "assistant", "tool", "developer")
FORMATS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"), "text": ("text",)}
SHOWN_ERRORS = 5
UTF8_BOM = b"\xef\xbb\xbf"


@dataclass
class TrainingRow:
    idx: int
    line: int
    input: dict[str, Any]


def parse_training_jsonl(stream: BinaryIO, *, input_format: str = "auto", split: str = "train", start_idx: int = 0,
                         max_rows: int, max_row_bytes: int, what: str = "dataset") -> list[TrainingRow]:
    """Every row of a JSONL training file, checked; raise InvalidInput naming the bad lines (or an empty file)."""
    rows, errors = [], []
    for line_no, raw in enumerate(_lines(stream, max_row_bytes), start=1):
        if line_no == 1:
            raw = raw.removeprefix(UTF8_BOM)
        if not raw.strip():
            continue
        if len(rows) + len(errors) >= max_rows:
            raise InvalidInput(f"the {what} has more than {max_rows} rows (JOBS_MAX_ROWS): split it")
        try:
            row = check_row(_decode(raw, max_row_bytes), input_format)
        except ValueError as exc:
            errors.append(f"line {line_no}: {exc}")
            continue
        if split != "train":
            row["split"] = split
        rows.append(TrainingRow(start_idx + len(rows), line_no, row))
    if errors:
        more = f" (and {len(errors) - SHOWN_ERRORS} more)" if len(errors) > SHOWN_ERRORS else ""
        raise InvalidInput(f"the fine-tune {what} has {len(errors)} bad row(s){more}: "
                           + "; ".join(errors[:SHOWN_ERRORS]) + ". Fix them and submit again")
    if not rows:
        raise InvalidInput(f"the fine-tune {what} is empty: expected one JSON object per line with 'messages', "
                           "'prompt' and 'completion', or 'text'")
    return rows


def _lines(stream: BinaryIO, limit: int) -> Iterator[bytes]:
    while raw := stream.readline(limit + 2):
        if not raw.endswith(b"\n") and len(raw) >= limit + 2:
            while (rest := stream.readline(1 << 16)) and not rest.endswith(b"\n"):
                pass
            yield b"\x00too-long"
            continue
        yield raw


def _decode(raw: bytes, limit: int) -> dict[str, Any]:
    if raw == b"\x00too-long":
        raise ValueError(f"row longer than {limit} bytes (JOBS_MAX_ROW_BYTES)")
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"not valid UTF-8 at byte {exc.start}: save the file as UTF-8") from None
    except ValueError as exc:
        raise ValueError(f"invalid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


def detect_format(obj: dict[str, Any]) -> str:
    if "messages" in obj:
        return "messages"
    if "prompt" in obj or "completion" in obj:
        return "prompt_completion"
    if "text" in obj:
        return "text"
    raise ValueError("a training row needs 'messages' (chat), 'prompt' and 'completion', or 'text'")


def check_row(obj: dict[str, Any], input_format: str = "auto") -> dict[str, Any]:
    """The stored form of one training row (only its format's fields), or ValueError saying what is missing."""
    fmt = detect_format(obj) if input_format == "auto" else input_format
    fields = FORMATS[fmt]
    for name in fields:
        if name not in obj:
            raise ValueError(f"a {fmt} row needs {' and '.join(repr(f) for f in fields)}; '{name}' is missing")
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
            raise ValueError(f"messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) and "
                             "'content' (a string)")
    if not any(m["role"] == "assistant" and m["content"] for m in messages):
        raise ValueError("a chat row needs at least one non-empty assistant message: the loss is on assistant "
                         "turns only")
    return [{"role": m["role"], "content": m["content"]} for m in messages]
