"""Structural checks of dataset rows, run in the API at submit (no torch), and which engines can run a row.

Every input format (`core.formats`: jsonl, openai, csv, parquet, hf) is read by `read_records` into records with
their place in the file; `parse_dataset` turns each into a stored row. A bad row never sinks the job: it becomes a
failed row that names its place and the problem (`line 7: …`, 1-based physical line, for jsonl, openai and csv;
`row 6: …`, 0-based, for parquet and saved datasets), and the other rows run. Blank lines are skipped (they are
not rows) but still count for line numbers. Whole-file problems (empty, duplicate custom_ids, too many rows, a
column mapping naming a missing column, or mapping `prompt` to another column of a table that has its own
`prompt`, an unreadable Parquet file) refuse the submission.

A good row is stored as `{"prompt": str} | {"messages": [...]}` plus `"params"` (per-row overrides of the
sampling parameters) and `"extra"` (every other key, returned unchanged with the row's result); a row of an
OpenAI batch line also keeps `"openai": {"url", "model"}` for its response.

The token check (a prompt plus `max_new_tokens` against the model's context, without torch) and the submit's pass
over the parsed rows that runs it are core/preflight.py; the reason it gives a row too long, `too_long`, is here,
since the worker gives the same one, and so is the worker's refusal of fine-tune rows longer than max_seq_length
(`too_long_to_train`): `retry_can_change` knows both, and every other refusal of a fine-tune for its spec and input
(`core.errors.CannotTrain`, whose message starts with CANNOT_TRAIN).

Limits (settings): a row of more than `JOBS_MAX_ROW_BYTES` UTF-8 bytes becomes a failed row (`formats.too_big`:
its place, size and the limit) and only its first bytes are kept (a JSONL line is never read into memory whole).
Every format counts bytes alike: a JSONL line or CSV record as in the file, line ending excluded; a Parquet or
saved-dataset row as its JSON line. A dataset of more than `JOBS_MAX_ROWS` rows is refused as a whole.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, get_args

from pydantic import ValidationError

from core import formats, openai_batch, structured
from core.errors import CANNOT_TRAIN, FieldError, InvalidInput
from core.formats import Record
from core.settings import get_settings
from core.spec import SamplingParams, describe, first_field, sampling_of

ROLES = ("system", "user", "assistant", "tool", "developer")
RAW_KEPT = 2000  # bytes of a bad row kept for `results --errors`
READ_CHUNK = 1 << 16
LONE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")  # only an escape can make one; a real pair is fine
UTF8_BOM, UTF16_BOMS = b"\xef\xbb\xbf", (b"\xff\xfe", b"\xfe\xff")
PARAMS = frozenset(SamplingParams.model_fields)
_INT_PARAMS = {k for k, f in SamplingParams.model_fields.items() if int in get_args(f.annotation)}
SAMPLE_AT_ZERO = (
    "do_sample is true but temperature is 0 (the row's or the job's): sampling needs a temperature "
    "above 0; set one, or set do_sample false for greedy decoding"
)
NOT_PASSED_THROUGH = frozenset({"prompt", "messages", "custom_id", *PARAMS})  # what a row's `extra` never holds
ONE_OF = "a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages)"


TOO_LONG = "exceeds the model's context"
TOO_LONG_TO_TRAIN = "longer than max_seq_length"


def too_long(prompt_tokens: int, max_new_tokens: int, context: int) -> str:
    """The reason a row does not fit the model's context (the token check at submit, and the worker's)."""
    return (
        f"prompt of {prompt_tokens} tokens + max_new_tokens {max_new_tokens} {TOO_LONG} of {context} tokens: "
        "shorten the prompt or lower max_new_tokens"
    )


def too_long_to_train(too_long: list[tuple[int, int]], max_seq_length: int) -> str:
    """The reason the worker refuses a fine-tune whose rows, as (line, tokens), exceed max_seq_length under
    `truncation: refuse`; every row of the shard fails with it, and a retry keeps them failed."""
    shown = ", ".join(f"line {line} ({n} tokens)" for line, n in too_long[:5])
    more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
    return (
        f"{len(too_long)} row(s) are {TOO_LONG_TO_TRAIN}={max_seq_length} tokens: {shown}{more}. Raise "
        "max_seq_length, shorten the rows, or set truncation: truncate"
    )


def retry_can_change(row: Any, spec: Any) -> bool:
    """Can running this failed row again end otherwise? Not when it was refused at submit (it never ran: its
    error names its place and it has no execution), when the submit checks refuse its parameters now (a job stored
    before a check existed), when the worker found it too long for the model's context, or when the worker refused
    a fine-tune for its spec and input (`core.errors.CannotTrain`: its error starts with CANNOT_TRAIN; rows longer
    than max_seq_length failed before that mark with TOO_LONG_TO_TRAIN): the same spec and input are refused the
    same way. A row that failed in the engine for another reason (a chat template, a shard that gave up, a worker
    lost or out of memory) may: the model or the worker may have been fixed."""
    stored, error = row.input or {}, row.error or ""
    if "raw" in stored or TOO_LONG in error or TOO_LONG_TO_TRAIN in error or error.startswith(CANNOT_TRAIN):
        return False
    if not row.executions and error.startswith((f"line {row.line}: ", f"row {row.line}: ")):
        return False
    try:
        _row_params(dict(stored.get("params") or {}), spec)
    except ValueError:
        return False
    return True


def fast_unsupported(params: dict[str, Any], filtered: bool = False) -> str | None:
    """The sampling parameter (effective, `sampling_of`) the fast engine cannot run, or None. `filtered`: it samples
    with top_p and top_k (worker/engines/fastgen.py FILTERED_SAMPLING, which the worker passes). The submit check
    (`engine_problem`) cannot import the worker to read that flag, so it judges by its default, off until a GPU has
    measured it: under `engine: fast` such rows are refused at submit, and under `auto` they run padded or, where a
    worker's flag is on, fast. The default here follows the flag's (tests/test_engine_fast.py checks it)."""
    if params.get("repetition_penalty") is not None:
        return "repetition_penalty"
    if filtered:
        return None
    if params.get("do_sample") and params.get("top_p") not in (None, 1, 1.0):
        return "top_p"
    if params.get("do_sample") and params.get("top_k") not in (None, 0):
        return "top_k"
    return None


def continuous_unsupported(params: dict[str, Any]) -> str | None:
    """What the continuous engine cannot do for these effective parameters (docs/design.md "Structured outputs"):
    its manager builds its logits processors itself, so no per-row grammar mask and no top-k log-probabilities."""
    if structured.constraint(params) is not None:
        return "a constrained output (response_format, guided_choice, guided_regex)"
    if params.get("logprobs"):
        return "logprobs"
    return None


def engine_problem(engine: str, params: dict[str, Any]) -> str | None:
    """Why the engine a job asked for refuses a row with these effective sampling parameters (`sampling_of`), or
    None. The workers' per-row refusals that need no model (worker/engines/fast.py, continuous.py), made at submit
    too: for the job's own parameters (the submit is refused) and for each row's (a failed row)."""
    if engine == "continuous" and params.get("repetition_penalty") is not None:
        return (
            "repetition_penalty is not supported by the continuous engine (transformers drops it): use engine "
            "padded or auto"
        )
    if engine == "continuous" and (name := continuous_unsupported(params)):
        return (
            f"{name} is not supported by the continuous engine (transformers' continuous batching takes no "
            "logits processor of ours): use engine auto, fast, padded or static"
        )
    if engine == "fast" and (name := fast_unsupported(params)):
        return f"{name} is not supported by the fast engine: use engine auto (which runs such rows padded) or padded"
    return None


def several_greedy(n: int) -> str:
    """The reason a row asking for n > 1 outputs under greedy decoding fails (at submit, and in the worker)."""
    return (
        f"num_return_sequences {n} needs sampling (greedy decoding returns the same text each time): set "
        "temperature > 0 or do_sample true for this row"
    )


@dataclass
class ParsedRow:
    idx: int
    line: int  # the record's place: 1-based physical line, or 0-based row for parquet and hf inputs
    custom_id: str
    input: dict[str, Any] | None
    error: str | None = None
    param: str | None = None  # the field at fault in a failed row, where one is (an OpenAI line's `body.n`)


def parse_jsonl(
    source: BinaryIO | Iterable[bytes],
    *,
    spec: Any = None,
    max_rows: int | None = None,
    max_row_bytes: int | None = None,
) -> Iterator[ParsedRow]:
    """Parse JSONL bytes line by line; raise InvalidInput for an empty dataset, one of more than `max_rows` rows,
    a UTF-16 file or duplicate custom_ids.

    `source` is a binary file (read line by line, never more than `max_row_bytes` of a line at once) or an
    iterable of lines. `spec` (the job's), when given, lets a row's parameters be checked together with the
    job's. Limits default to the settings (`JOBS_MAX_ROWS`, `JOBS_MAX_ROW_BYTES`).
    """
    return parse_records(read_jsonl(source, max_row_bytes=max_row_bytes), fmt="jsonl", spec=spec, max_rows=max_rows)


def parse_dataset(
    path: Path,
    fmt: str,
    *,
    spec: Any = None,
    columns: dict[str, str] | None = None,
    max_rows: int | None = None,
    max_row_bytes: int | None = None,
) -> Iterator[ParsedRow]:
    """The stored rows of the input file at `path` in format `fmt` (not `auto`: see `formats.detect`)."""
    return parse_records(
        read_records(path, fmt, columns=columns, max_row_bytes=max_row_bytes), fmt=fmt, spec=spec, max_rows=max_rows
    )


def read_records(
    path: Path, fmt: str, *, columns: dict[str, str] | None = None, max_row_bytes: int | None = None
) -> Iterator[Record]:
    """The records of an input file of any format, each with its line (or row) and its data as a dict, or the
    reason it cannot be read. This is the reader for every kind of job (generation and fine-tune datasets)."""
    max_row_bytes = get_settings().max_row_bytes if max_row_bytes is None else max_row_bytes
    if fmt in ("jsonl", "openai"):
        with open(path, "rb") as stream:
            yield from read_jsonl(stream, max_row_bytes=max_row_bytes, columns=columns if fmt == "jsonl" else None)
    elif fmt == "csv":
        with open(path, "rb") as stream:
            head = stream.read(2)
            stream.seek(0)
            if head in UTF16_BOMS:
                raise InvalidInput(
                    "the dataset is UTF-16 encoded (it starts with a UTF-16 byte-order mark): save it as UTF-8"
                )
            yield from formats.read_csv(stream, columns=columns, max_row_bytes=max_row_bytes)
    elif fmt == "parquet":
        yield from formats.read_parquet(path, columns=columns, max_row_bytes=max_row_bytes)
    elif fmt == "hf":
        yield from formats.read_hf(path, columns=columns, max_row_bytes=max_row_bytes)
    else:
        raise InvalidInput(f"unknown input_format {fmt!r}: use one of {', '.join(formats.INPUT_FORMATS)}")


def read_jsonl(
    source: BinaryIO | Iterable[bytes], *, max_row_bytes: int | None = None, columns: dict[str, str] | None = None
) -> Iterator[Record]:
    """JSON-object records of JSONL bytes, by 1-based physical line; blank lines are skipped."""
    max_row_bytes = get_settings().max_row_bytes if max_row_bytes is None else max_row_bytes
    for line_no, (raw, size) in enumerate(_lines(source, max_row_bytes), start=1):
        raw = _strip_bom(raw) if line_no == 1 else raw.removeprefix(UTF8_BOM)  # files joined with `cat` keep theirs
        if size <= max_row_bytes and not raw.strip():
            continue
        text = raw[:RAW_KEPT].decode("utf-8", "replace")
        if size > max_row_bytes:
            yield Record(line_no, None, text, formats.too_big(size, max_row_bytes))
            continue
        obj, error = _decode_line(raw)
        if obj is not None and (clash := formats.clashes(obj, columns, "the row also has a key")):
            obj, error = None, clash
        yield Record(line_no, formats.map_columns(obj, columns) if obj is not None else None, text, error)


def parse_records(
    records: Iterable[Record], *, fmt: str, spec: Any = None, max_rows: int | None = None
) -> Iterator[ParsedRow]:
    """Stored rows of records; raise InvalidInput for an empty dataset, more than `max_rows` rows or duplicate
    custom_ids (naming both places)."""
    max_rows = get_settings().max_rows if max_rows is None else max_rows
    where = formats.location(fmt)
    seen: dict[str, int] = {}
    idx = 0
    for record in records:
        if idx >= max_rows:
            raise too_many_rows(max_rows)
        row = _parse_record(idx, record, fmt, spec)
        if row.custom_id in seen:
            raise InvalidInput(
                f"duplicate custom_id {row.custom_id!r} on {where}s {seen[row.custom_id]} and {record.pos}: "
                "custom_ids must be unique within a dataset",
                param="custom_id",
            )
        seen[row.custom_id] = record.pos
        yield row
        idx += 1
    if idx == 0:
        if fmt in ("jsonl", "openai"):
            raise InvalidInput("the dataset is empty: expected one JSON object per line with 'prompt' or 'messages'")
        raise InvalidInput(f"the dataset has no rows: expected a {fmt} file with one record per row")


def check_prompt_columns(path: Path, fmt: str, columns: dict[str, str] | None) -> None:
    """Refuse a table input (CSV, Parquet, saved dataset) in which no row can run because no column gives a row its
    `prompt` or `messages`, naming the columns it has and the mapping that would use one. Read from the header or
    schema alone, before a single row is parsed. A CSV file separated by semicolons or tabs (its header one column
    holding them) is refused as such, not with a mapping to that one column. A file whose header the reader
    refuses, and a mapping to a column the file lacks, are left to the reader, which names the problem."""
    names = formats.columns_of(path, fmt)
    if fmt == "csv" and names and (separator := formats.other_separator(names)):
        raise InvalidInput(
            f"the CSV header (line 1) is one column, {names[0][:200]!r}: the file looks separated by {separator}, "
            f"not commas; {formats.NOT_COMMAS}"
        )
    if not names or not any(n.strip() for n in names) or len(set(names)) < len(names):
        return  # no header, an empty one or a repeated name: the reader refuses the file with its own reason
    if any(theirs not in names for theirs in (columns or {}).values()):
        return
    if {"prompt", "messages"} & set(formats.map_columns(dict.fromkeys(names), columns)):
        return
    raise InvalidInput(
        f"the {formats.TABLE_NAMES[fmt]} has no 'prompt' or 'messages' column, so no row can run; its columns "
        f"are {', '.join(map(repr, names)) or 'none'}: {_map_hint(names, columns)}"
    )


def nothing_runs(
    total: int, first_error: str | None, keys: Iterable[str], fmt: str, *, param: str | None = None
) -> InvalidInput:
    """The refusal of a dataset whose every row is invalid (at submit, or too long for the model): no job is made
    of it. When rows lack a prompt, the keys the rows have and the mapping that would use one are named. `param`:
    the field at fault in the first row, where its check named one."""
    message = f"no row of the dataset can run ({total} rows, every one invalid); the first: {first_error}"
    names = [k for k in keys if k != "raw"]
    if fmt != "openai" and first_error and ONE_OF in first_error and names:
        return InvalidInput(
            f"{message}; the rows' keys are {', '.join(map(repr, names))}: {_map_hint(names, None)}", param=param
        )
    return InvalidInput(f"{message}: fix the dataset and submit it again", param=param)


def _map_hint(names: list[str], columns: dict[str, str] | None) -> str:
    """How to map a column to `prompt`, with the first column that is not mapped or ours already as the example."""
    used = set((columns or {}).values()) | NOT_PASSED_THROUGH | {"id"}
    example = next((n for n in names if n not in used), names[0] if names else "COLUMN")
    return (
        f"map the column that holds the prompt with --column prompt={example} (spec: "
        f'"input_columns": {{"prompt": {json.dumps(example)}}}), or messages=COLUMN for chat messages'
    )


def too_many_rows(max_rows: int) -> InvalidInput:
    return InvalidInput(
        f"the dataset has more than {max_rows} rows, the limit of this server (JOBS_MAX_ROWS): "
        "split it into several jobs"
    )


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
        raise InvalidInput(
            "the dataset is UTF-16 encoded (it starts with a UTF-16 byte-order mark): save it as "
            "UTF-8, one JSON object per line"
        )
    return raw.removeprefix(UTF8_BOM)  # editors on Windows write one; it is not part of the first row


def _decode_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """A JSONL line as a JSON object, or why it is not one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not valid UTF-8 at byte {exc.start}: save the file as UTF-8"
    try:
        # the line ending must not move the reported column
        obj = json.loads(text.rstrip("\r\n"), parse_constant=_not_json)
    except json.JSONDecodeError as exc:
        return None, f"invalid JSON: {exc.msg} (column {exc.colno})"
    except ValueError as exc:  # NaN or Infinity: Python reads them, JSON (and Postgres) does not
        return None, f"invalid JSON: {exc}"
    except RecursionError:
        return None, "invalid JSON: nested too deeply"
    if LONE_SURROGATE.search(raw) and not _encodable(obj):
        return None, (
            "the row holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff), which is not text: fix "
            "or remove the escape"
        )
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got {type(obj).__name__}"
    return obj, None


def _parse_record(idx: int, record: Record, fmt: str, spec: Any = None) -> ParsedRow:
    where = formats.location(fmt)
    fallback_id = f"{where}-{record.pos}"
    if record.error is not None:
        return _bad(idx, record.pos, fallback_id, record.raw, record.error, where)
    obj = dict(record.data)
    if fmt == "openai":
        return _openai_row(idx, record, obj, spec)
    custom_id = obj.pop("custom_id", None)
    if fmt != "jsonl" and isinstance(custom_id, int) and not isinstance(custom_id, bool):
        custom_id = str(custom_id)  # an integer id column of a table
    if fmt == "csv" and custom_id == "":
        custom_id = None
    if custom_id is not None and (
        not isinstance(custom_id, str) or not custom_id or len(custom_id) > 255 or not custom_id.isprintable()
    ):
        return _bad(
            idx,
            record.pos,
            fallback_id,
            record.raw,
            "custom_id must be a non-empty string of at most 255 printable characters" + _not(custom_id, str),
            where,
            record.data,
        )
    custom_id = custom_id or fallback_id
    try:
        if fmt == "csv":
            obj = _csv_cells(obj)
        elif fmt != "jsonl":  # a table's empty (null) parameter cell means "the job's value"
            obj = {k: v for k, v in obj.items() if not (k in PARAMS and v is None)}
        return ParsedRow(idx, record.pos, custom_id, _row_input(obj, spec))
    except ValueError as exc:
        return _bad(idx, record.pos, custom_id, record.raw, str(exc), where, record.data)


def _csv_cells(obj: dict[str, Any]) -> dict[str, Any]:
    """CSV cells are text: a parameter cell is read as JSON (12, 0.5, true; a stop string may stay plain text, or
    be a JSON list), an empty one means the job's value, and a `messages` cell holds the messages as JSON."""
    out = {}
    for key, value in obj.items():
        if key in PARAMS:
            if value == "":
                continue
            if key == "stop" and not value.lstrip().startswith("["):
                out[key] = value
                continue
            try:
                out[key] = json.loads(value)
            except ValueError:
                out[key] = value  # the strict check names the parameter and what it should be
        elif key == "messages" and value != "":
            try:
                out[key] = json.loads(value)
            except ValueError:
                raise ValueError("the messages column must hold a JSON list of {role, content} objects") from None
        elif key in ("messages", "prompt") and value == "":
            out[key] = None  # an empty cell: a row with no other prompt says which one is empty
        else:
            out[key] = value
    return out


def _openai_row(idx: int, record: Record, obj: dict[str, Any], spec: Any) -> ParsedRow:
    fallback_id = f"line-{record.pos}"
    n_param = "num_return_sequences" if "num_return_sequences" in PARAMS else None
    try:
        request = openai_batch.openai_request(obj, n_param=n_param)
    except ValueError as exc:
        custom_id = obj.get("custom_id")
        ok = isinstance(custom_id, str) and 0 < len(custom_id) <= 255 and custom_id.isprintable()
        param = getattr(exc, "param", None)
        return _bad(idx, record.pos, custom_id if ok else fallback_id, record.raw, str(exc), param=param)
    if len(request.custom_id) > 255 or not request.custom_id.isprintable():
        return _bad(
            idx,
            record.pos,
            fallback_id,
            record.raw,
            "custom_id must be a non-empty string of at most 255 printable characters",
            param="custom_id",
        )
    try:
        row = _row_input({request.kind: request.content, **request.params}, spec)
    except ValueError as exc:
        # a line without its messages (or prompt) has that field at fault; otherwise the check names one, or none
        ours = request.kind if request.content is None else getattr(exc, "param", None)
        param = openai_batch.body_param(ours, obj.get("body"))
        return _bad(idx, record.pos, request.custom_id, record.raw, f"{exc} (in body)", param=param)
    row["openai"] = {"url": request.url, "model": request.model}
    return ParsedRow(idx, record.pos, request.custom_id, row)


def openai_models(path: Path, *, max_row_bytes: int | None = None) -> tuple[dict[str, int], int | None]:
    """The models that OpenAI batch lines name in `body.model`: {name: first line}, and the first line that
    names none (None when every line names one). Unreadable lines are left to the row checks."""
    models: dict[str, int] = {}
    unnamed = None
    with open(path, "rb") as stream:
        for record in read_jsonl(stream, max_row_bytes=max_row_bytes):
            body = (record.data or {}).get("body")
            if not isinstance(body, dict):
                continue
            model = body.get("model")
            if isinstance(model, str) and model.strip():
                models.setdefault(model, record.pos)
            elif unnamed is None:
                unnamed = record.pos
    return models, unnamed


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
    empty = [repr(k) for k in ("prompt", "messages") if k in obj and obj[k] is None]
    prompt, messages = obj.pop("prompt", None), obj.pop("messages", None)
    if prompt is None and messages is None and empty:  # a null, or an empty CSV cell, in the prompt's column
        raise ValueError(f"{ONE_OF}; this row's {' and '.join(empty)} {'is' if len(empty) == 1 else 'are'} empty")
    if (prompt is None) == (messages is None):
        raise ValueError(ONE_OF)
    params = _row_params({k: obj.pop(k) for k in PARAMS.intersection(obj)}, spec)
    if prompt is not None:
        if not isinstance(prompt, str) or not prompt:
            raise FieldError("'prompt' must be a non-empty string" + _not(prompt, str), param="prompt")
        return {"prompt": prompt, "params": params, "extra": obj}
    return {"messages": _check_messages(messages), "params": params, "extra": obj}


def _row_params(params: dict[str, Any], spec: Any) -> dict[str, Any]:
    """Per-row overrides, typed strictly (a number given as a string, or a boolean as a number, is an error: a
    spreadsheet's quoting must not silently change a parameter); 12.0 is accepted as the integer 12."""
    if not params:
        return {}  # the common row (the job's own parameters were checked at submit)
    params = {
        k: int(v) if k in _INT_PARAMS and isinstance(v, float) and v.is_integer() else v for k, v in params.items()
    }
    try:
        params = SamplingParams.model_validate(params, strict=True).model_dump(exclude_none=True)
    except ValidationError as exc:
        raise FieldError(f"invalid per-row parameter: {describe(exc)}", param=first_field(exc)) from None
    do_sample, temperature = params.get("do_sample"), params.get("temperature")
    if spec is not None:  # the row's parameters over the job's, as the worker will use them
        do_sample = spec.do_sample if do_sample is None else do_sample
        temperature = spec.temperature if temperature is None else temperature
    if do_sample and temperature == 0:
        raise ValueError(SAMPLE_AT_ZERO)
    n = params.get("num_return_sequences") or (getattr(spec, "num_return_sequences", None) or 1)
    if n > 1 and not (do_sample if do_sample is not None else bool(temperature)):
        raise ValueError(several_greedy(n))  # the worker's check (worker/engines/common.py), made before GPU time
    effective = sampling_of(spec, params) if spec is not None else params
    if problem := structured.problem(effective):
        raise ValueError(problem)
    if spec is not None and (problem := engine_problem(getattr(spec, "engine", "auto"), effective)):
        raise ValueError(problem)
    return params


def _not(value: Any, expected: type) -> str:
    """', not a number' when `value` has the wrong JSON type, else ''."""
    if isinstance(value, expected):
        return ""
    names = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "a list"), (dict, "an object"))
    return ", not " + next((name for types, name in names if isinstance(value, types)), "null")


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise FieldError(
            "'messages' must be a non-empty list of {role, content} objects" + _not(messages, list), param="messages"
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("content"), str) or msg.get("role") not in ROLES:
            raise FieldError(
                f"messages[{i}] must be an object with 'role' (one of {', '.join(ROLES)}) and 'content'",
                param=f"messages[{i}]",
            )
    return messages


def _bad(
    idx: int,
    pos: int,
    custom_id: str,
    raw: str,
    reason: str,
    where: str = "line",
    data: dict[str, Any] | None = None,
    *,
    param: str | None = None,
) -> ParsedRow:
    """A failed row: its reason with its line (or row), only the start of the record's text, and the record's
    pass-through keys (`extra`, from its `data` where it was read), which its error record carries like a result."""
    extra = {k: v for k, v in (data or {}).items() if k not in NOT_PASSED_THROUGH}
    stored = {"raw": raw[:RAW_KEPT], **({"extra": extra} if extra else {})}
    return ParsedRow(idx, pos, custom_id, stored, f"{where} {pos}: {reason}", param)
