"""Dataset formats: every input format read into plain records, and results written in every output format.

Inputs (`input_format` in the spec; `auto` picks one from the content, then the file name):

    jsonl     one JSON object per line: `prompt` or `messages`, optional `custom_id`, per-row sampling parameters
    openai    OpenAI Batch lines: `custom_id`, `method` (POST), `url` (/v1/chat/completions or /v1/completions),
              `body` (messages or prompt, max_tokens, max_completion_tokens, temperature, top_p, stop, seed, n,
              response_format, logprobs, top_logprobs; vLLM's guided_choice, guided_regex, guided_json …)
    csv       a header row, then one row per record (UTF-8, comma separated, RFC 4180 quoting)
    parquet   one record per row
    hf        a Hugging Face dataset saved with `Dataset.save_to_disk`, packed into one zip (the CLI packs the
              directory; the Arrow files inside are read with pyarrow, the `datasets` package is not needed)

Where a record is: jsonl, openai and csv give the 1-based physical `line` (csv counts the header, a record that
spans lines is at its first line); parquet and hf give the 0-based `row`. `input_columns` maps our names to the
file's (`{"prompt": "question", "custom_id": "id"}`) for jsonl, csv, parquet and hf; a column named like one of
ours is used as it is, every other column is kept and returned unchanged with the row's result.

Outputs: our JSONL, the OpenAI Batch output and error files, CSV and Parquet, all streamed chunk by chunk so
that a large result set is never held in memory and finished rows can be read while the job runs.

The OpenAI Batch API (routes elsewhere) uses the plain functions here: `openai_request` for an input line, and
`openai_output_record` / `openai_error_record` for the lines of the output and error files. A row's stored
log-probabilities (OpenAI's chat shape, worker/engines/logprobs.py) become a chat choice's `logprobs.content` or a
completion choice's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset` (`completion_logprobs`).
"""

from __future__ import annotations

import csv
import datetime as dt
import decimal
import io
import json
import math
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from core.errors import InvalidInput

INPUT_FORMATS = ("auto", "jsonl", "openai", "csv", "parquet", "hf")
OUTPUT_FORMATS = ("jsonl", "openai", "csv", "parquet")
ROW_FORMATS = ("parquet", "hf")  # located by a 0-based `row`; the others by a 1-based physical `line`
OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
RAW_KEPT = 2000  # characters of a bad record kept for `results --errors`
ARROW_BATCH = 1024
MEDIA_TYPES = {
    "jsonl": "application/x-ndjson",
    "openai": "application/x-ndjson",
    "csv": "text/csv; charset=utf-8",
    "parquet": "application/vnd.apache.parquet",
}


def location(fmt: str) -> str:
    """`row` (0-based) for parquet and hf inputs, `line` (1-based physical line) for the others."""
    return "row" if fmt in ROW_FORMATS else "line"


# --- detection -----------------------------------------------------------------------------------------------


def detect(path: Path, filename: str = "") -> str:
    """The format of a stored input: by its first bytes (Parquet and zip magic, an OpenAI batch first line, a
    JSON object), then by the file name's extension (.csv, .tsv is refused); plain text that is not JSON is CSV
    when its first line has a comma."""
    with open(path, "rb") as stream:
        head = stream.read(4)
        stream.seek(0)
        if head == b"PAR1":
            return "parquet"
        if head == b"PK\x03\x04":
            return "hf"
        first = _first_line(stream)
    name = filename.lower()
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".csv"):
        return "csv"
    text = first.decode("utf-8", "replace").lstrip("\ufeff").strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except ValueError:
            return "jsonl"  # its rows fail with their JSON error
        return "openai" if isinstance(obj, dict) and {"url", "body"} <= obj.keys() else "jsonl"
    return "csv" if "," in text else "jsonl"


def _first_line(stream: BinaryIO, limit: int = 1 << 20) -> bytes:
    while line := stream.readline(limit):
        if line.strip():
            return line
    return b""


# --- reading records -----------------------------------------------------------------------------------------


@dataclass
class Record:
    """One record of an input file: its `data` (columns mapped to our names) or why it cannot be read.

    `pos` is the 1-based physical line (jsonl, openai, csv) or the 0-based row (parquet, hf), as `location()`
    names it; `raw` is the start of the record's text, kept with a failed row."""

    pos: int
    data: dict[str, Any] | None
    raw: str
    error: str | None = None


def map_columns(data: dict[str, Any], columns: dict[str, str] | None) -> dict[str, Any]:
    """Rename the file's columns to ours (`columns` = {ours: theirs}); a column mapped to a name of ours is not
    also kept under its own name."""
    if not columns:
        return data
    out = {k: v for k, v in data.items() if k not in columns.values() and k not in columns}
    for ours, theirs in columns.items():
        if theirs in data:
            out[ours] = data[theirs]
    return out


def check_columns(available: Iterable[str], columns: dict[str, str] | None, what: str) -> None:
    """Refuse a mapping that names a column the file does not have (the whole submission: every row would fail)."""
    names = list(available)
    missing = [f"{ours}={theirs}" for ours, theirs in (columns or {}).items() if theirs not in names]
    if missing:
        raise InvalidInput(
            f"input_columns {', '.join(missing)}: the {what} has no such column; its columns are "
            f"{', '.join(map(repr, names)) or 'none'}"
        )


TABLE_NAMES = {"csv": "CSV file", "parquet": "Parquet file", "hf": "saved dataset"}


def columns_of(path: Path, fmt: str) -> list[str] | None:
    """The column names of a table input (csv: its header; parquet and hf: their schema), read without reading
    any row; None for the line formats, whose keys may differ from row to row, or when the names cannot be read
    (the reader then says what is wrong with the file)."""
    try:
        if fmt == "csv":
            with open(path, encoding="utf-8-sig", errors="replace", newline="") as text:
                return next(csv.reader(text), None)
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(path).schema_arrow.names)
        if fmt == "hf":
            import pyarrow as pa

            with zipfile.ZipFile(path) as archive:
                prefix = _dataset_root(set(archive.namelist()))
                first = _data_files(archive, prefix)[:1]
                if not first:
                    return None
                with archive.open(prefix + first[0]) as stream:
                    return list(pa.ipc.open_stream(stream).schema.names)
    except Exception:  # a damaged file (pyarrow raises many types): the reader refuses it with its reason
        return None
    return None


def read_csv(stream: BinaryIO, *, columns: dict[str, str] | None = None, max_row_bytes: int) -> Iterator[Record]:
    """CSV records: the header names the columns. A record with a wrong number of fields, invalid UTF-8 or more
    than `max_row_bytes` is a failed record; a broken quote that swallows the rest of the file refuses it."""
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline="")
    csv.field_size_limit(max(csv.field_size_limit(), max_row_bytes + 1))
    reader = csv.reader(text, strict=True)
    try:
        header = next(reader, None)
        if header is None or not any(h.strip() for h in header):
            raise InvalidInput(
                "the CSV file is empty: expected a header row naming the columns (e.g. prompt), then one row per record"
            )
        if len(set(header)) != len(header) or any(_bad_text(h) for h in header):
            dupes = sorted({h for h in header if header.count(h) > 1})
            raise InvalidInput(
                "the CSV header (line 1) must name each column once in UTF-8 text"
                + (f"; repeated: {', '.join(map(repr, dupes))}" if dupes else "")
            )
        check_columns(header, columns, "CSV header (line 1)")
        last = reader.line_num
        for fields in reader:
            start, last = last + 1, reader.line_num
            if not fields or fields == [""]:
                continue  # a blank line is not a record
            raw = ",".join(fields)[:RAW_KEPT]
            if len(fields) != len(header):
                yield Record(
                    start,
                    None,
                    _clean(raw),
                    f"has {len(fields)} fields, the header has {len(header)}: "
                    "quote fields that hold commas or line breaks",
                )
            elif sum(len(f) for f in fields) > max_row_bytes:
                yield Record(
                    start,
                    None,
                    _clean(raw),
                    f"row of more than {max_row_bytes} bytes exceeds the limit "
                    "(JOBS_MAX_ROW_BYTES): shorten the row or split it",
                )
            elif any(_bad_text(f) for f in fields):
                yield Record(start, None, _clean(raw), "not valid UTF-8: save the file as UTF-8")
            else:
                yield Record(start, map_columns(dict(zip(header, fields)), columns), raw)
    except csv.Error as exc:
        raise InvalidInput(
            f"the CSV file cannot be read at line {reader.line_num}: {exc} (a quote that is never "
            "closed swallows the rest of the file): fix the quoting"
        ) from None
    except UnicodeDecodeError:  # surrogateescape decodes any byte; only a UTF-16 file's BOM ends here
        raise InvalidInput("the CSV file is not UTF-8: save it as UTF-8") from None


def _bad_text(value: str) -> bool:
    """True when a cell holds bytes that were not UTF-8 (decoded as lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _clean(raw: str) -> str:
    return raw.encode("utf-8", "replace").decode("utf-8")


def read_parquet(
    path: Path, *, columns: dict[str, str] | None = None, max_row_bytes: int | None = None
) -> Iterator[Record]:
    """Parquet records, batch by batch (never the whole file in memory)."""
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise InvalidInput(f"the Parquet file cannot be read ({exc}): write it again with pyarrow or pandas") from None
    check_columns(file.schema_arrow.names, columns, "Parquet file")
    yield from _arrow_records(file.iter_batches(batch_size=ARROW_BATCH), columns, max_row_bytes=max_row_bytes)


def parquet_rows(path: Path) -> int:
    """Rows of a Parquet file, from its footer (no data read)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:
        raise InvalidInput(f"the Parquet file cannot be read ({exc}): write it again with pyarrow or pandas") from None


def read_hf(path: Path, *, columns: dict[str, str] | None = None, max_row_bytes: int | None = None) -> Iterator[Record]:
    """A `Dataset.save_to_disk` directory packed into one zip: `state.json` lists the Arrow files, read in order."""
    import pyarrow as pa

    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise InvalidInput(
            f"the dataset archive cannot be read ({exc}): pass the directory that "
            "save_to_disk wrote to `gpujobs submit --input`, which packs it"
        ) from None
    with archive:
        names = set(archive.namelist())
        prefix = _dataset_root(names)
        data_files = _data_files(archive, prefix)
        schema_checked, counter = False, [0]  # rows are numbered on across the Arrow files
        for name in data_files:
            member = prefix + name
            if member not in names:
                raise InvalidInput(
                    f"the saved dataset lists {name!r} in state.json but the archive has no such "
                    "file: save the dataset again"
                )
            try:
                with archive.open(member) as stream:
                    reader = pa.ipc.open_stream(stream)
                    if not schema_checked:
                        check_columns(reader.schema.names, columns, "saved dataset")
                        schema_checked = True
                    yield from _arrow_records(reader, columns, counter, max_row_bytes=max_row_bytes)
            except (pa.ArrowInvalid, OSError) as exc:
                raise InvalidInput(
                    f"the Arrow file {name!r} of the saved dataset cannot be read ({exc}): save the dataset again"
                ) from None


def _dataset_root(names: set[str]) -> str:
    """'' when state.json is at the archive's root, 'dir/' when the archive holds one saved directory."""
    for prefix in [""] + sorted({n.split("/", 1)[0] + "/" for n in names if "/" in n}):
        if prefix + "state.json" in names:
            return prefix
        if prefix + "dataset_dict.json" in names:
            splits = sorted(
                {
                    n[len(prefix) :].split("/", 1)[0]
                    for n in names
                    if n.startswith(prefix) and n.count("/") > prefix.count("/")
                }
            )
            raise InvalidInput(
                f"this is a DatasetDict with splits {', '.join(splits)}: save one split "
                "(`ds['train'].save_to_disk(path)`) and submit that directory"
            )
    raise InvalidInput(
        "the archive is not a dataset saved with save_to_disk (no state.json): pass the directory "
        "that `Dataset.save_to_disk` wrote"
    )


def _data_files(archive: zipfile.ZipFile, prefix: str) -> list[str]:
    try:
        state = json.loads(archive.read(prefix + "state.json"))
        files = [f["filename"] for f in state["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise InvalidInput(f"the saved dataset's state.json cannot be read ({exc}): save the dataset again") from None
    for name in files:
        if not isinstance(name, str) or PurePosixPath(name).name != name or name in ("", ".", ".."):
            raise InvalidInput(f"the saved dataset's state.json names {name!r}, not a file name: save it again")
    return files


def _arrow_records(
    batches, columns: dict[str, str] | None, counter: list[int] | None = None, *, max_row_bytes: int | None = None
) -> Iterator[Record]:
    """Records of Arrow record batches, numbered by a 0-based row that runs on across batches (and across the
    files of one saved dataset, through the shared `counter`)."""
    counter = counter if counter is not None else [0]
    for batch in batches:
        for data in batch.to_pylist():
            row = counter[0]
            counter[0] += 1
            try:
                clean = {k: jsonable(v) for k, v in data.items()}
            except ValueError as exc:
                yield Record(row, None, _clean(repr(data)[:RAW_KEPT]), str(exc))
                continue
            text = json.dumps(clean, ensure_ascii=False)
            if max_row_bytes is not None and len(text) > max_row_bytes:
                yield Record(
                    row,
                    None,
                    text[:RAW_KEPT],
                    f"row of more than {max_row_bytes} bytes exceeds the limit "
                    "(JOBS_MAX_ROW_BYTES): shorten the row or split it",
                )
                continue
            yield Record(row, map_columns(clean, columns), text[:RAW_KEPT])


def jsonable(value: Any) -> Any:
    """A Parquet/Arrow value as JSON: dates as ISO text, decimals as text, NaN as null; bytes must be UTF-8."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(
                "a binary column holds bytes that are not UTF-8 text: store text columns as strings"
            ) from None
    return value


# --- OpenAI batch lines --------------------------------------------------------------------------------------

# body keys we map onto our sampling parameters
_OPENAI_PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    # extensions that vLLM and TGI accept in the body as well
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "do_sample": "do_sample",
    # structured outputs (core/structured.py): OpenAI's response_format, vLLM's guided_choice and guided_regex
    "response_format": "response_format",
    "guided_choice": "guided_choice",
    "guided_regex": "guided_regex",
    "top_logprobs": "top_logprobs",
}
# body keys that change nothing here when they hold these values
_OPENAI_NEUTRAL = {
    "stream": (False, None),
    "frequency_penalty": (0, None),
    "presence_penalty": (0, None),
    "parallel_tool_calls": (True, False, None),
}
_OPENAI_IGNORED = (
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "messages",
    "prompt",
    "logprobs",  # read by _openai_logprobs
    "guided_json",  # vLLM's name for a JSON schema: read by _openai_params
)


@dataclass
class OpenAIRequest:
    custom_id: str
    kind: str  # "messages" or "prompt"
    content: Any  # the messages list or the prompt string
    params: dict[str, Any]  # in our names, not validated yet
    url: str
    model: str | None


def openai_request(obj: dict[str, Any], *, n_param: str | None = "num_return_sequences") -> OpenAIRequest:
    """One OpenAI Batch input line as our row; raises ValueError saying what is wrong.

    `max_tokens`/`max_completion_tokens` become `max_new_tokens`; `temperature`, `top_p`, `stop`, `seed` keep their
    names; `n` becomes `n_param` (None: only n = 1 is accepted). A parameter the body leaves out takes the
    job's value (not OpenAI's default temperature of 1). `body.model` is returned for the response to echo.
    """
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise ValueError("an OpenAI batch line needs a 'custom_id' (a non-empty string)")
    if obj.get("method", "POST") != "POST":
        raise ValueError(f"method {obj.get('method')!r}: OpenAI batch lines use POST")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))}: an OpenAI batch line has custom_id, method, url and body"
        )
    url, body = obj.get("url"), obj.get("body")
    if url not in OPENAI_URLS:
        raise ValueError(f"url {url!r} is not supported: use /v1/chat/completions or /v1/completions")
    if not isinstance(body, dict):
        raise ValueError("'body' must be an object with the request (messages or prompt, max_tokens, …)")
    kind = OPENAI_URLS[url]
    other = "prompt" if kind == "messages" else "messages"
    if other in body:
        raise ValueError(f"body.{other} does not belong to {url}: use body.{kind}")
    content = body.get(kind)
    if kind == "messages":
        content = _openai_messages(content)
    elif isinstance(content, list) and len(content) == 1 and isinstance(content[0], str):
        content = content[0]
    params = _openai_params(body, n_param)
    params.update(_openai_logprobs(body, kind))
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise ValueError("body.model must be a non-empty string")
    return OpenAIRequest(custom_id, kind, content, params, url, model)


def _openai_messages(messages: Any) -> Any:
    """Text content parts are joined into one string; other parts (images, audio) are refused."""
    if not isinstance(messages, list):
        return messages  # the row check says what is wrong
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and isinstance(msg.get("content"), list):
            parts = msg["content"]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
            ):
                raise ValueError(f"body.messages[{i}].content: only text parts are supported here")
            msg = {**msg, "content": "".join(p["text"] for p in parts)}
        if isinstance(msg, dict):
            msg = {k: v for k, v in msg.items() if k != "name"}
        out.append(msg)
    return out


def _openai_logprobs(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """`logprobs`: chat's is true/false (with `top_logprobs` beside it); completions' is the number of most likely
    tokens to return at each step (0-20), which is our logprobs true + top_logprobs."""
    value = body.get("logprobs")
    if value is None:
        return {}
    if kind == "messages":
        if not isinstance(value, bool):
            raise ValueError("body.logprobs on /v1/chat/completions is true or false (top_logprobs says how many)")
        return {"logprobs": value}
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("body.logprobs on /v1/completions is the number of most likely tokens to return (0-20)")
    return {"logprobs": True, "top_logprobs": value}


def _openai_params(body: dict[str, Any], n_param: str | None) -> dict[str, Any]:
    params = {ours: body[theirs] for theirs, ours in _OPENAI_PARAMS.items() if theirs in body}
    if body.get("guided_json") is not None:
        if "response_format" in body:
            raise ValueError("give body.response_format or body.guided_json, not both")
        schema = body["guided_json"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        params["response_format"] = {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}
    limits = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(set(map(json.dumps, limits.values()))) > 1:
        raise ValueError("body.max_tokens and body.max_completion_tokens differ: give one of them")
    if limits:
        params["max_new_tokens"] = next(iter(limits.values()))
    n = body.get("n")
    if n is not None and n != 1:
        if n_param is None:
            raise ValueError(f"body.n = {n!r}: this server returns one choice per request; send n = 1")
        params[n_param] = n
    for key, allowed in _OPENAI_NEUTRAL.items():
        if key in body and body[key] not in allowed:
            raise ValueError(f"body.{key} = {json.dumps(body[key])} is not supported by this server: leave it out")
    unknown = sorted(set(body) - set(_OPENAI_PARAMS) - set(_OPENAI_NEUTRAL) - set(_OPENAI_IGNORED))
    if unknown:
        raise ValueError(
            f"body key(s) {', '.join(map(repr, unknown))} are not supported by this server: leave them out"
        )
    return params


# --- results -------------------------------------------------------------------------------------------------


def outputs_of(value: Any) -> list[str]:
    """The generated texts of a row: one, or several (num_return_sequences > 1 stores a list)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [value]


def openai_output_record(row: Any, *, job_id: str, model: str) -> dict[str, Any]:
    """A line of the OpenAI Batch output file for a succeeded row (`row` is a `core.models.JobRow`).

    The body is a `chat.completion` for a messages row (and /v1/chat/completions lines) or a `text_completion`
    for a prompt row; each output is one choice. `model` is echoed from the line's body.model when it had one.
    """
    meta = (row.input or {}).get("openai") or {}
    chat = "messages" in (row.input or {})
    texts = outputs_of(row.output)
    reasons = row.finish_reason
    reasons = reasons if isinstance(reasons, list) else [reasons] * len(texts)
    logprobs = logprobs_of(row.logprobs, len(texts))
    choices = [
        (
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None if content is None else {"content": content, "refusal": None},
                "finish_reason": reason,
            }
            if chat
            else {"index": i, "text": text, "logprobs": completion_logprobs(content), "finish_reason": reason}
        )
        for i, (text, reason, content) in enumerate(zip(texts, reasons, logprobs))
    ]
    prompt, completion = row.prompt_tokens or 0, row.completion_tokens or 0
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}-{row.idx}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(row.finished_at or 0),
        "model": meta.get("model") or model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    return {
        "id": _request_id(job_id, row.idx, "batch_req"),
        "custom_id": row.custom_id,
        "response": {"status_code": 200, "request_id": _request_id(job_id, row.idx, "req"), "body": body},
        "error": None,
    }


def logprobs_of(value: Any, outputs: int) -> list[list[dict[str, Any]] | None]:
    """A row's stored log-probabilities per output: one content list per output (the stored value is the list
    itself for one output, a list of them for several), or None for each where the row asked for none."""
    if value is None:
        return [None] * outputs
    return value if outputs > 1 else [value]


def completion_logprobs(content: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """/v1/completions' shape of one output's log-probabilities (from the chat shape we store): tokens,
    token_logprobs, top_logprobs (one {token: logprob} per step, or None when none were asked), text_offset."""
    if content is None:
        return None
    offsets, at = [], 0
    for entry in content:
        offsets.append(at)
        at += len(entry["token"])
    asked = any(entry.get("top_logprobs") for entry in content)
    return {
        "tokens": [entry["token"] for entry in content],
        "token_logprobs": [entry["logprob"] for entry in content],
        "top_logprobs": [{t["token"]: t["logprob"] for t in entry["top_logprobs"]} for entry in content]
        if asked
        else None,
        "text_offset": offsets,
    }


def openai_error_record(row: Any, *, job_id: str) -> dict[str, Any]:
    """A line of the OpenAI Batch error file for a failed row (`row` is a `core.models.JobRow`).

    A row refused by the checks before any GPU time (it never reached a worker) answers 400
    `invalid_request_error`; a row that failed in the engine answers 500 `server_error`."""
    invalid = row.worker is None
    status = 400 if invalid else 500
    error = {
        "message": row.error or "failed",
        "type": "invalid_request_error" if invalid else "server_error",
        "param": None,
        "code": None,
    }
    return {
        "id": _request_id(job_id, row.idx, "batch_req"),
        "custom_id": row.custom_id,
        "response": {
            "status_code": status,
            "request_id": _request_id(job_id, row.idx, "req"),
            "body": {"error": error},
        },
        "error": None,
    }


def _request_id(job_id: str, idx: int, prefix: str) -> str:
    return f"{prefix}_{job_id.removeprefix('job_')}_{idx}"


def jsonl_chunks(records: Iterable[dict[str, Any]], chunk_rows: int = 500) -> Iterator[bytes]:
    buffer: list[str] = []
    for record in records:
        buffer.append(json.dumps(record, ensure_ascii=False) + "\n")
        if len(buffer) >= chunk_rows:
            yield "".join(buffer).encode()
            buffer.clear()
    if buffer:
        yield "".join(buffer).encode()


def cell(value: Any) -> Any:
    """A value for one CSV or Parquet cell: text and numbers as they are, lists and objects JSON-encoded."""
    if value is None or isinstance(value, (str, int, float)):
        return value
    return json.dumps(value, ensure_ascii=False)


def csv_chunks(records: Iterable[dict[str, Any]], columns: list[str], chunk_rows: int = 500) -> Iterator[bytes]:
    """CSV text with a header of `columns`; a record's keys outside `columns` are left out (the caller lists
    every key it wants, see `table_columns`)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    count = 0
    for record in records:
        writer.writerow(["" if (v := cell(record.get(c))) is None else v for c in columns])
        count += 1
        if count % chunk_rows == 0:
            yield buffer.getvalue().encode()
            buffer.seek(0)
            buffer.truncate()
    yield buffer.getvalue().encode()


def parquet_chunks(
    records: Iterable[dict[str, Any]], columns: list[str], types: dict[str, str], chunk_rows: int = 1000
) -> Iterator[bytes]:
    """A Parquet file, one row group per `chunk_rows` records, yielded as its bytes are written.

    `types` gives `int`, `float` or `list` for the columns that are not text; every other column is text (lists
    and objects JSON-encoded, as in CSV)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    arrow = {"int": pa.int64(), "float": pa.float64(), "list": pa.list_(pa.string())}
    schema = pa.schema([(c, arrow.get(types.get(c, "str"), pa.string())) for c in columns])
    sink = _Drain()
    writer = pq.ParquetWriter(sink, schema)

    def write(batch: list[dict[str, Any]]) -> None:
        data = {c: [_typed(r.get(c), types.get(c, "str")) for r in batch] for c in columns}
        writer.write_table(pa.Table.from_pydict(data, schema=schema))

    batch: list[dict[str, Any]] = []
    for record in records:
        batch.append(record)
        if len(batch) >= chunk_rows:
            write(batch)
            batch.clear()
            yield sink.take()
    if batch:
        write(batch)
    writer.close()
    yield sink.take()


def _typed(value: Any, kind: str) -> Any:
    if value is None:
        return None
    if kind == "list":
        return [str(v) for v in value] if isinstance(value, list) else [str(value)]
    if kind in ("int", "float"):
        return value
    return value if isinstance(value, str) else cell(value) if not isinstance(value, (int, float)) else str(value)


class _Drain(io.RawIOBase):
    """A write-only sink whose bytes are taken out as they come (pyarrow writes the footer at close)."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.pos = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        self.pos += len(data)
        return len(data)

    def tell(self) -> int:
        return self.pos

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out
