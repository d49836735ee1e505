"""Dataset formats: their names, and every input format detected and read into plain records.

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
ours is used as it is, every other column is kept and returned unchanged with the row's result. A file (or a
JSONL row) with a column named like one of ours that the mapping takes from another column (a `prompt` column
beside `prompt=question`) is refused (a failed row in JSONL), rather than one of the two dropped.

Outputs (`OUTPUT_FORMATS`): our JSONL, the OpenAI Batch output and error files, CSV and Parquet, written by
core/writers.py. An OpenAI Batch line, read as our row or written from one, is core/openai_batch.py.
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
    JSON object), then by the file name's extension (.csv; .tsv is refused); plain text that is not JSON is CSV
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
    if name.endswith(".tsv"):
        raise InvalidInput(f"a tab-separated (.tsv) file is not read: {NOT_COMMAS}")
    return "csv" if "," in text else "jsonl"


NOT_COMMAS = (
    "a CSV input here is comma separated (RFC 4180 quoting): save it with commas (pandas: "
    "df.to_csv(path, index=False)) or as JSONL"
)
SEPARATORS = {"\t": "tabs", ";": "semicolons", "|": "pipes"}


def other_separator(header: list[str]) -> str | None:
    """'semicolons' (or tabs, pipes) when a CSV header read with commas is one column holding that separator: a
    file saved by a spreadsheet with another separator, whose every row would be read as one cell."""
    if len(header) != 1:
        return None
    return next((name for sep, name in SEPARATORS.items() if sep in header[0]), None)


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


def too_big(size: int, limit: int) -> str:
    """The reason a row over JOBS_MAX_ROW_BYTES fails, the same for every format (its place is put before it)."""
    return f"row of {size} bytes exceeds the limit of {limit} bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it"


def utf8_size(text: str) -> int:
    """Bytes of text read from a file (bytes that were not UTF-8 kept as surrogates count as what they were)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogateescape"))


def map_columns(data: dict[str, Any], columns: dict[str, str] | None) -> dict[str, Any]:
    """Rename the file's columns to ours (`columns` = {ours: theirs}); a column mapped to a name of ours is not
    also kept under its own name. A column already named like a name mapped elsewhere would be dropped: the
    readers refuse it first (`clashes`)."""
    if not columns:
        return data
    out = {k: v for k, v in data.items() if k not in columns.values() and k not in columns}
    for ours, theirs in columns.items():
        if theirs in data:
            out[ours] = data[theirs]
    return out


def check_columns(available: Iterable[str], columns: dict[str, str] | None, what: str) -> None:
    """Refuse a mapping that names a column the file does not have (the whole submission: every row would fail),
    and one that maps a name of ours to a column while the file has a column of that name (`clashes`)."""
    names = list(available)
    missing = [f"{ours}={theirs}" for ours, theirs in (columns or {}).items() if theirs not in names]
    if missing:
        raise InvalidInput(
            f"input_columns {', '.join(missing)}: the {what} has no such column; its columns are "
            f"{', '.join(map(repr, names)) or 'none'}"
        )
    if clash := clashes(names, columns, f"the {what} also has a column"):
        raise InvalidInput(clash)


def clashes(names: Iterable[str], columns: dict[str, str] | None, has: str) -> str | None:
    """Why a mapping cannot apply to a file (or JSONL row) that already has a column named like a name of ours
    mapped to another column (`prompt=question` beside a `prompt` column), or None. Mapping would drop that
    column, and which of the two the user meant as the prompt is a guess: refused, naming both."""
    used = set((columns or {}).values())
    found = [(ours, theirs) for ours, theirs in (columns or {}).items() if ours in names and ours not in used]
    if not found:
        return None
    return "; ".join(
        f"input_columns {ours}={theirs}: {has} named {ours!r}, which the mapping would drop (a row takes its "
        f"{ours} from one column): rename or drop {ours!r} or {theirs!r} in the file, or leave the mapping out "
        f"to use {ours!r}"
        for ours, theirs in found
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
    than `max_row_bytes` (its bytes in the file, quotes and inner line breaks included, its line ending not, as a
    JSONL line's) is a failed record; a broken quote that swallows the rest of the file refuses it, and so does a
    single field longer than the limit (the reader stops inside it, and cannot tell where its record ends)."""
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", errors="surrogateescape", newline="")
    csv.field_size_limit(max(csv.field_size_limit(), max_row_bytes + 1))  # characters: a field over it is over in bytes
    consumed: list[int] = []  # bytes of the physical lines read for the record being read, line endings included
    ending = [0]  # characters of the last one's line ending

    def physical_lines() -> Iterator[str]:
        for line in text:
            consumed.append(utf8_size(line))
            ending[0] = len(line) - len(line.rstrip("\r\n"))
            yield line

    def record_size() -> int:
        size = sum(consumed) - ending[0]
        consumed.clear()
        return size

    reader = csv.reader(physical_lines(), strict=True)
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
        last, _ = reader.line_num, record_size()
        for fields in reader:
            start, last, size = last + 1, reader.line_num, record_size()
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
            elif size > max_row_bytes:
                yield Record(start, None, _clean(raw), too_big(size, max_row_bytes))
            elif any(_bad_text(f) for f in fields):
                yield Record(start, None, _clean(raw), "not valid UTF-8: save the file as UTF-8")
            else:
                yield Record(start, map_columns(dict(zip(header, fields)), columns), raw)
    except csv.Error as exc:
        if "field larger than field limit" in str(exc):
            raise InvalidInput(
                f"the CSV file cannot be read at line {reader.line_num}: a field there is longer than the row limit "
                f"of {max_row_bytes} bytes (JOBS_MAX_ROW_BYTES), or a quote that is never closed swallows the rest "
                "of the file: shorten the row, or fix the quoting"
            ) from None
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
            text = json.dumps(clean, ensure_ascii=False)  # the row as a JSONL line: what its size is counted in
            if max_row_bytes is not None and (size := utf8_size(text)) > max_row_bytes:
                yield Record(row, None, text[:RAW_KEPT], too_big(size, max_row_bytes))
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
