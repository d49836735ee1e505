"""Structural checks of dataset rows, run in the API at submit (no torch).

A bad row never sinks the job: it becomes a failed row that names its 1-based physical line and the problem,
and the other rows run. Blank lines are skipped (they are not rows) but still count for line numbers.

A good row is stored as `{"prompt": str} | {"messages": [...]}` plus `"params"` (per-row overrides of the
sampling parameters) and `"extra"` (every other key, returned unchanged with the row's result).

Limits (settings): a row longer than `JOBS_MAX_ROW_BYTES` becomes a failed row and only its first bytes are kept
(it is never read into memory whole); a dataset of more than `JOBS_MAX_ROWS` rows is refused as a whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, get_args

from pydantic import ValidationError

from core.errors import InvalidInput
from core.settings import get_settings
from core.spec import SamplingParams, describe

ROLES = ("system", "user", "assistant", "tool", "developer")
RAW_KEPT = 2000  # bytes of a bad row kept for `results --errors`
READ_CHUNK = 1 << 16
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # only an escape can make one; a real pair is fine
UTF8_BOM, UTF16_BOMS = b"\xef\xbb\xbf", (b"\xff\xfe", b"\xfe\xff")
PARAMS = frozenset(SamplingParams.model_fields)
_INT_PARAMS = {k for k, f in SamplingParams.model_fields.items() if int in get_args(f.annotation)}
SAMPLE_AT_ZERO = ("do_sample is true but temperature is 0 (the row's or the job's): sampling needs a temperature "
                  "above 0; set one, or set do_sample false for greedy decoding")


@dataclass
class ParsedRow:
    idx: int
    line: int
    custom_id: str
    input: dict[str, Any] | None
    error: str | None = None


def parse_jsonl(source: BinaryIO | Iterable[bytes], *, spec: Any = None, max_rows: int | None = None,
                max_row_bytes: int | None = None) -> Iterator[ParsedRow]:
    """Parse JSONL bytes line by line; raise InvalidInput for an empty dataset, one of more than `max_rows` rows,
    a UTF-16 file or duplicate custom_ids.

    `source` is a binary file (read line by line, never more than `max_row_bytes` of a line at once) or an
    iterable of lines. `spec` (the job's), when given, lets a row's parameters be checked together with the
    job's. Limits default to the settings (`JOBS_MAX_ROWS`, `JOBS_MAX_ROW_BYTES`).
    """
    settings = get_settings()
    max_rows = settings.max_rows if max_rows is None else max_rows
    max_row_bytes = settings.max_row_bytes if max_row_bytes is None else max_row_bytes
    seen: dict[str, int] = {}
    idx = 0
    for line_no, (raw, size) in enumerate(_lines(source, max_row_bytes), start=1):
        if line_no == 1:
            raw = _strip_bom(raw)
        if size <= max_row_bytes and not raw.strip():
            continue
        if idx >= max_rows:
            raise too_many_rows(max_rows)
        if size > max_row_bytes:
            row = _bad(idx, line_no, f"line-{line_no}", raw, f"row of {size} bytes exceeds the limit of "
                       f"{max_row_bytes} bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it")
        else:
            row = _parse_line(idx, line_no, raw, spec)
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


def too_many_rows(max_rows: int) -> InvalidInput:
    return InvalidInput(f"the dataset has more than {max_rows} rows, the limit of this server (JOBS_MAX_ROWS): "
                        "split it into several jobs")


def count_rows(stream: BinaryIO, *, limit: int) -> int:
    """Rows (non-blank lines) of a stored dataset, counted no further than `limit` + 1: a cheap check before any
    row is inserted. Counting newlines is enough when there are few; blank lines are looked at only when the
    file has more lines than `limit`."""
    lines, last = 0, b""
    while chunk := stream.read(1 << 20):
        lines, last = lines + chunk.count(b"\n"), chunk
    lines += bool(last) and not last.endswith(b"\n")
    if lines <= limit:
        return lines
    stream.seek(0)
    rows = 0
    for raw, size in _lines(stream, READ_CHUNK):
        rows += size > READ_CHUNK or bool(raw.strip())
        if rows > limit:
            break
    return rows


def _lines(source: BinaryIO | Iterable[bytes], limit: int) -> Iterator[tuple[bytes, int]]:
    """(line, size) pairs, `size` not counting the line ending. A line longer than `limit` comes as its first
    RAW_KEPT bytes only: the rest is read in chunks and dropped, so even a 10 GB line costs no memory."""
    if not hasattr(source, "readline"):
        for raw in source:
            size = len(raw.rstrip(b"\r\n"))
            yield (raw if size <= limit else raw[:RAW_KEPT]), size
        return
    while raw := source.readline(limit + 2):  # room for a whole allowed line and its \r\n
        if raw.endswith(b"\n") or len(raw) < limit + 2:
            size = len(raw.rstrip(b"\r\n"))
            yield (raw if size <= limit else raw[:RAW_KEPT]), size
            continue
        head, size, tail = raw[:RAW_KEPT], len(raw), raw[-2:]
        while not tail.endswith(b"\n") and (raw := source.readline(READ_CHUNK)):
            size, tail = size + len(raw), (tail + raw)[-2:]
        yield head, size - (2 if tail == b"\r\n" else 1 if tail.endswith(b"\n") else 0)


def _strip_bom(raw: bytes) -> bytes:
    if raw.startswith(UTF16_BOMS):
        raise InvalidInput("the dataset is UTF-16 encoded (it starts with a UTF-16 byte-order mark): save it as "
                           "UTF-8, one JSON object per line")
    return raw.removeprefix(UTF8_BOM)  # editors on Windows write one; it is not part of the first row


def _parse_line(idx: int, line_no: int, raw: bytes, spec: Any = None) -> ParsedRow:
    fallback_id = f"line-{line_no}"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return _bad(idx, line_no, fallback_id, raw, f"not valid UTF-8 at byte {exc.start}: save the file as UTF-8")
    try:
        # the line ending must not move the reported column
        obj = json.loads(text.rstrip("\r\n"), parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        return _bad(idx, line_no, fallback_id, raw, f"invalid JSON: {exc.msg} (column {exc.colno})")
    except ValueError as exc:  # NaN or Infinity: Python reads them, JSON (and Postgres) does not
        return _bad(idx, line_no, fallback_id, raw, f"invalid JSON: {exc}")
    except RecursionError:
        return _bad(idx, line_no, fallback_id, raw, "invalid JSON: nested too deeply")
    if LONE_SURROGATE.search(raw) and not _encodable(obj):
        return _bad(idx, line_no, fallback_id, raw, "the row holds a lone UTF-16 surrogate escape (\\ud800 to "
                                                    "\\udfff), which is not text: fix or remove the escape")
    if not isinstance(obj, dict):
        return _bad(idx, line_no, fallback_id, raw, f"expected a JSON object, got {type(obj).__name__}")
    custom_id = obj.pop("custom_id", None)
    if custom_id is not None and (not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255
                                  or not custom_id.isprintable()):
        return _bad(idx, line_no, fallback_id, raw, "custom_id must be a non-empty string of at most 255 "
                                                    "printable characters")
    custom_id = custom_id or fallback_id
    try:
        return ParsedRow(idx, line_no, custom_id, _row_input(obj, spec))
    except ValueError as exc:
        return _bad(idx, line_no, custom_id, raw, str(exc))


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value: write null or a number")


def _encodable(obj: Any) -> bool:
    """False when a string of the row holds a lone surrogate: the tokenizer and the results file would fail."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _row_input(obj: dict[str, Any], spec: Any = None) -> dict[str, Any]:
    prompt, messages = obj.pop("prompt", None), obj.pop("messages", None)
    if (prompt is None) == (messages is None):
        raise ValueError("a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages)")
    params = _row_params({k: obj.pop(k) for k in PARAMS.intersection(obj)}, spec)
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("'prompt' must be a non-empty string" + _not(prompt, str))
        return {"prompt": prompt, "params": params, "extra": obj}
    return {"messages": _check_messages(messages), "params": params, "extra": obj}


def _row_params(params: dict[str, Any], spec: Any) -> dict[str, Any]:
    """Per-row overrides, typed strictly (a number given as a string, or a boolean as a number, is an error: a
    spreadsheet's quoting must not silently change a parameter); 12.0 is accepted as the integer 12."""
    if not params:
        return {}  # the common row (the job's own parameters were checked at submit)
    params = {k: int(v) if k in _INT_PARAMS and isinstance(v, float) and v.is_integer() else v
              for k, v in params.items()}
    try:
        params = SamplingParams.model_validate(params, strict=True).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise ValueError(f"invalid per-row parameter: {describe(exc)}") from None
    do_sample, temperature = params.get("do_sample"), params.get("temperature")
    if spec is not None:  # the row's parameters over the job's, as the worker will use them
        do_sample = spec.do_sample if do_sample is None else do_sample
        temperature = spec.temperature if temperature is None else temperature
    if do_sample and temperature == 0:
        raise ValueError(SAMPLE_AT_ZERO)
    return params


def _not(value: Any, expected: type) -> str:
    """', not a number' when `value` has the wrong JSON type, else ''."""
    if isinstance(value, expected):
        return ""
    names = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "a list"), (dict, "an object"))
    return ", not " + next((name for types, name in names if isinstance(value, types)), "null")


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {role, content} objects" + _not(messages, list))
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str) or msg.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) and 'content'")
    return messages


def _bad(idx: int, line_no: int, custom_id: str, raw: bytes, reason: str) -> ParsedRow:
    """A failed row: its reason with the line number, and only the first RAW_KEPT bytes of the line."""
    return ParsedRow(idx, line_no, custom_id, {"raw": raw[:RAW_KEPT].decode("utf-8", "replace")},
                     f"line {line_no}: {reason}")
