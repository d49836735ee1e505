"""Results written in every output format (`formats.OUTPUT_FORMATS`), streamed chunk by chunk, so that a large
result set is never held in memory and finished rows can be read while the job runs: JSONL (ours and the OpenAI
Batch files), CSV and Parquet. api/results.py builds the records and picks the writer.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Iterator
from typing import Any

# Line breaks to line-based readers (Python's str.splitlines(), JavaScript's line terminators, httpx's iter_lines)
# that json.dumps leaves raw, since JSON allows them in strings; every other one (\v, \f, \x1c-\x1e) it escapes.
LINE_BREAKS = (("\u0085", "\\u0085"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029"))


def jsonl_line(record: Any) -> str:
    """One JSONL line: UTF-8 text as it is, but no character a line-based reader splits on, so a row with U+2028 in
    its output is still one line (and json.loads reads the same text back). Outside strings JSON has none of them."""
    text = json.dumps(record, ensure_ascii=False)
    for char, escape in LINE_BREAKS:
        text = text.replace(char, escape)
    return text + "\n"


def jsonl_chunks(records: Iterable[dict[str, Any]], chunk_rows: int = 500) -> Iterator[bytes]:
    buffer: list[str] = []
    for record in records:
        buffer.append(jsonl_line(record))
        if len(buffer) >= chunk_rows:
            yield "".join(buffer).encode()
            buffer.clear()
    if buffer:
        yield "".join(buffer).encode()


def cell(value: Any) -> Any:
    """A value for one CSV or Parquet cell: text and numbers as they are, booleans, lists and objects JSON-encoded
    (`true`, as the row had it, not Python's `True`)."""
    if value is None or (isinstance(value, (str, int, float)) and not isinstance(value, bool)):
        return value
    return json.dumps(value, ensure_ascii=False)


def csv_chunks(records: Iterable[dict[str, Any]], columns: list[str], chunk_rows: int = 500) -> Iterator[bytes]:
    """CSV text with a header of `columns`; a record's keys outside `columns` are left out (the caller lists
    every key it wants, see `table_columns`)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    # A lone carriage return ends a line for CSV readers, but the writer quotes only what holds a character of its
    # "\n" terminator: a cell with one would go out bare and split its row. Such a row has every cell quoted.
    quoted = csv.writer(buffer, lineterminator="\n", quoting=csv.QUOTE_ALL)

    def write(cells: list[Any]) -> None:
        (quoted if any(isinstance(v, str) and "\r" in v for v in cells) else writer).writerow(cells)

    write(columns)
    count = 0
    for record in records:
        write(["" if (v := cell(record.get(c))) is None else v for c in columns])
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
    return value if isinstance(value, str) else str(cell(value))


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
