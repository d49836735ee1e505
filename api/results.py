"""Results files: a job's finished rows as our JSONL records or as the bytes of a results file (JSONL, OpenAI
batch output or error lines, CSV, Parquet), streamed chunk by chunk, also while the job still runs. Reads only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import formats, logprob_store, openai_batch, writers
from core.db import session_scope
from core.errors import InvalidInput, WrongKind
from core.models import Job, JobRow
from core.states import RowState
from core.store import get_job

RESULT_FIELDS = (
    "custom_id",
    "line",
    "output",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "logprobs",
    "error",
)


INPUT_KEYS = ("prompt", "messages")  # what `with_input` puts beside a row's output


def shadowed_keys(where: str) -> frozenset[str]:
    """Pass-through keys that would collide with a result record's own (`output`, `error`, `line`, ...) or with
    the `extra` key that holds them: such keys come back under `extra`, the same in every format."""
    return frozenset({*RESULT_FIELDS, where, "extra"})


def results(
    job_id: str, *, owner: str | None, errors: bool = False, order: str = "input", with_input: bool = False
) -> Iterator[dict[str, Any]]:
    """Finished rows (succeeded, or failed with `errors`) in input order or as they finished (`order`), as our
    JSONL records; works while the job still runs."""
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        only_generation(job)
        where = formats.location(job.spec.get("input_format") or "jsonl")
        for row in _finished_rows(session, job_id, errors=errors, order=order):
            yield result_record(row, errors=errors, where=where, with_input=with_input)


def export(
    job_id: str,
    *,
    owner: str | None,
    fmt: str = "jsonl",
    errors: bool = False,
    order: str = "input",
    with_input: bool = False,
) -> Iterator[bytes]:
    """Finished rows as the bytes of a results file: `jsonl` (ours), `openai` (the OpenAI Batch output file, or
    its error file with `errors`), `csv` or `parquet`. Streams chunk by chunk; works while the job still runs.

    CSV and Parquet have the columns custom_id, line (or row), output, finish_reason, prompt_tokens,
    completion_tokens (error, with `errors`), logprobs where the job or a row asked for them (JSON text: the
    OpenAI chat shape, see `result_record`), then the rows' pass-through keys as text columns (lists and objects
    JSON-encoded; several outputs of a row are a JSON list in CSV and a list column in Parquet).

    `with_input` puts each row's `prompt` (text) or `messages` (a list; JSON text in CSV and Parquet) beside its
    output: keys of our JSONL records and of the OpenAI lines (an extension their readers ignore), columns after
    `line`/`row` in CSV and Parquet (the kinds the job's rows have; both for jobs stored before this was recorded).
    Off by default: a prompt is often many times longer than its output, and results are downloaded again and
    again while a job runs. A row refused at submit for its own text has no prompt to give (its `line` locates
    it)."""
    if fmt not in formats.OUTPUT_FORMATS or order not in ("input", "finished"):
        raise InvalidInput(
            f"format {fmt!r} / order {order!r}: use a format of {', '.join(formats.OUTPUT_FORMATS)} "
            "and order input or finished"
        )
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        only_generation(job)
        spec, info = job.spec, (job.metrics or {}).get("input") or {}
        where = formats.location(spec.get("input_format") or "jsonl")
        rows = _finished_rows(session, job_id, errors=errors, order=order)
        if fmt == "openai":
            model = spec.get("model") or ""
            yield from writers.jsonl_chunks(
                (
                    openai_batch.openai_error_record(r, job_id=job_id)
                    if errors
                    else openai_batch.openai_output_record(r, job_id=job_id, model=model)
                )
                | (input_of(r) if with_input else {})
                for r in rows
            )
            return
        records = (result_record(r, errors=errors, where=where, with_input=with_input) for r in rows)
        if fmt == "jsonl":
            yield from writers.jsonl_chunks(records)
            return
        given = [k for k in INPUT_KEYS if k in info.get("input_kinds", INPUT_KEYS)] if with_input else []
        asked = info.get("logprobs") or bool(spec.get("logprobs"))  # the job or some row asked for them
        fixed = ["custom_id", where, *given] + (
            ["error"]
            if errors
            else ["output", "finish_reason", "prompt_tokens", "completion_tokens"] + ["logprobs"] * asked
        )
        keys, shadowed = info.get("extra_keys") or [], shadowed_keys(where)
        columns = fixed + [k for k in keys if k not in shadowed]
        columns += ["extra"] if any(k in shadowed for k in keys) else []
        if fmt == "csv":
            yield from writers.csv_chunks(records, columns)
            return
        several = info.get("several_outputs") or (spec.get("num_return_sequences") or 1) > 1
        types = {
            where: "int",
            "prompt_tokens": "int",
            "completion_tokens": "int",
            **({"output": "list", "finish_reason": "list"} if several else {}),
        }
        yield from writers.parquet_chunks(records, columns, types)


def readable(job_id: str, *, owner: str | None) -> None:
    """What `export` would refuse (no such job: 404; a fine-tune: 409), raised before a results stream starts."""
    with session_scope() as session:
        only_generation(get_job(session, job_id, owner=owner))


def only_generation(job: Job) -> None:
    """Results are generated rows, and a fine-tune has none: its rows are training data, all marked done when its
    adapter is registered or all failed with the job's one error (a bad row refuses it at submit; the worker fails
    the whole shard). So a fine-tune's results, and its failed rows too, are refused with what it made instead: its
    adapter, its then_generate job, or once the error it failed with (not once per training row)."""
    if job.kind != "finetune":
        return
    message = f"job {job.id} is a fine-tune: it has no generated rows"
    chained = (job.metrics or {}).get("then_generate_job")
    if chained:
        message += f" (its then_generate job {chained} holds the generations: `gpujobs results {chained}`)"
    adapter = f"GET /adapters/{job.id} (`gpujobs adapters show {job.id}`)"
    if job.state == "succeeded":
        message += f"; its adapter is {adapter}"
    elif job.state == "failed":
        message += f"; it failed and registered no adapter: {job.error or 'no error recorded'}"
    elif job.state == "cancelled":
        message += "; it was cancelled and registered no adapter"
    else:
        message += f"; once it succeeds, its adapter is {adapter}"
    raise WrongKind(message)


def _finished_rows(session: Session, job_id: str, *, errors: bool, order: str) -> Iterator[JobRow]:
    state = RowState.failed if errors else RowState.succeeded
    by = (JobRow.idx,) if order == "input" else (func.coalesce(JobRow.finished_at, 0.0), JobRow.idx)
    stmt = (
        select(JobRow)
        .where(JobRow.job_id == job_id, JobRow.state == state.value)
        .order_by(*by)
        .execution_options(yield_per=1000)
    )
    yield from session.scalars(stmt)


def result_record(row: JobRow, *, errors: bool, where: str = "line", with_input: bool = False) -> dict[str, Any]:
    """A row as a line of our JSONL results: its pass-through keys, custom_id, `line` (or `row` for Parquet and
    saved-dataset inputs), with `with_input` its prompt or messages, and output, finish_reason and token counts
    (or error). Several outputs are a list. A row that asked for log-probabilities has `logprobs`: per generated
    token {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}, OpenAI's `choices[].logprobs.content`
    (a list of them per output with several outputs). Pass-through keys named like one of these, or `extra`, are
    under `extra` (`shadowed_keys`)."""
    extra, reserved = (row.input or {}).get("extra", {}), shadowed_keys(where)
    record: dict[str, Any] = {k: v for k, v in extra.items() if k not in reserved}
    shadowed = {k: v for k, v in extra.items() if k in reserved}
    record.update({"custom_id": row.custom_id, where: row.line})
    if with_input:
        record.update(input_of(row))
    if errors:
        record["error"] = row.error
    else:
        record.update(
            output=row.output,
            finish_reason=row.finish_reason,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
        )
        if row.logprobs is not None:
            record["logprobs"] = logprob_store.render_row(row.logprobs)
    if shadowed:
        record["extra"] = shadowed
    return record


def input_of(row: JobRow) -> dict[str, Any]:
    """The row's prompt or chat messages as it was stored (`{}` for a row refused before it had one)."""
    stored = row.input or {}
    return {k: stored[k] for k in INPUT_KEYS if k in stored}
