"""Structural checks of dataset rows, run in the API at submit (no torch).

A bad row never sinks the job: it becomes a failed row that names its 1-based physical line and the problem,
and the other rows run. Blank lines are skipped (they are not rows) but still count for line numbers.

A good row is stored as `{"prompt": str} | {"messages": [...]}` plus `"params"` (per-row overrides of the
sampling parameters) and `"extra"` (every other key, returned unchanged with the row's result).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from core.errors import InvalidInput
from core.spec import SamplingParams, describe

ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass
class ParsedRow:
    idx: int
    line: int
    custom_id: str
    input: dict[str, Any] | None
    error: str | None = None


def parse_jsonl(lines: Iterable[bytes]) -> Iterator[ParsedRow]:
    """Parse JSONL bytes line by line; raise InvalidInput for an empty dataset or duplicate custom_ids."""
    seen: dict[str, int] = {}
    idx = 0
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        row = _parse_line(idx, line_no, raw)
        if row.custom_id in seen:
            raise InvalidInput(
                f"duplicate custom_id {row.custom_id!r} on lines {seen[row.custom_id]} and {line_no}: "
                "custom_ids must be unique within a dataset"
            )
        seen[row.custom_id] = line_no
        yield row
        idx += 1
    if idx == 0:
        raise InvalidInput("the dataset is empty: expected one JSON object per line with 'prompt' or 'messages'")


def _parse_line(idx: int, line_no: int, raw: bytes) -> ParsedRow:
    fallback_id = f"line-{line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _bad(idx, line_no, fallback_id, raw, f"not valid UTF-8 at byte {exc.start}")
    try:
        obj = json.loads(text.rstrip("\r\n"))  # the line ending must not move the reported column
    except json.JSONDecodeError as exc:
        return _bad(idx, line_no, fallback_id, raw, f"invalid JSON: {exc.msg} (column {exc.colno})")
    if not isinstance(obj, dict):
        return _bad(idx, line_no, fallback_id, raw, f"expected a JSON object, got {type(obj).__name__}")
    custom_id = obj.pop("custom_id", None)
    if custom_id is not None and (not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255):
        return _bad(idx, line_no, fallback_id, raw, "custom_id must be a non-empty string of at most 255 characters")
    custom_id = custom_id or fallback_id
    try:
        return ParsedRow(idx, line_no, custom_id, _row_input(obj))
    except ValueError as exc:
        return _bad(idx, line_no, custom_id, raw, str(exc))


def _row_input(obj: dict[str, Any]) -> dict[str, Any]:
    prompt, messages = obj.pop("prompt", None), obj.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise ValueError("a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages)")
    params = {k: obj.pop(k) for k in list(obj) if k in SamplingParams.model_fields}
    try:
        params = SamplingParams.model_validate(params).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise ValueError(f"invalid per-row parameter: {describe(exc)}") from None
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("'prompt' must be a non-empty string")
        return {"prompt": prompt, "params": params, "extra": obj}
    return {"messages": _check_messages(messages), "params": params, "extra": obj}


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str) or msg.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) and 'content'")
    return messages


def _bad(idx: int, line_no: int, custom_id: str, raw: bytes, reason: str) -> ParsedRow:
    return ParsedRow(idx, line_no, custom_id, {"raw": raw[:2000].decode("utf-8", "replace")}, f"line {line_no}: {reason}")
