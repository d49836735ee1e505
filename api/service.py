"""Service functions behind the HTTP API: submit, read, cancel, retry. No torch, no worker code.

`owner=None` means an admin: every job is visible. Otherwise another owner's job or file answers 404, as if it
did not exist.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from api import service_models
from core import adapters, capability, files, formats, hub, leases, model_cache, registry
from core.dataset import PARAMS, SAMPLE_AT_ZERO, InputCheck, count_rows, openai_models, parse_dataset, too_many_rows
from core.db import session_scope
from core.errors import Forbidden, IllegalTransition, InvalidInput, JobsError, Unschedulable
from core.models import Job, JobEvent, JobRow, Shard
from core.queue import TASK_RUN_SHARD, ping_redis, queue_for, send
from core.settings import get_settings
from core.spec import GenerateSpec, Spec, parse_spec
from core.states import JobState, RowState, ShardState
from core.store import (add_event, cancel_job, create_shards, get_job, insert_rows, new_id, now, progress,
                        transition)

log = logging.getLogger(__name__)
HUB_ID = hub.HUB_ID  # org/name; `./x` and `../x` are paths, not Hub ids
MAX_CONFIG_BYTES = 10 << 20  # a model's config.json, read as JSON at submit
RESULT_FIELDS = ("custom_id", "line", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error")


# --- submit -------------------------------------------------------------------------------------------------


def submit(*, owner: str, spec_data: dict[str, Any], admin: bool = False) -> dict[str, Any]:
    """Validate, store the job and its rows, then enqueue its shards. Nothing is written if a check fails.

    A generation job whose `adapter` names a fine-tune still running waits, queued without shards, for its
    adapter (`core.adapters`). `admin` lets an admin's job use another owner's adapter."""
    spec_data = _model_from_input(owner, spec_data)
    spec = parse_spec(spec_data)
    if spec.kind == "finetune":
        from api.service_finetune import submit_finetune

        return submit_finetune(owner=owner, spec=spec, admin=admin)
    _check_sampling(spec)
    spec = _resolve_model(spec)
    hub_check = service_models.check(spec)  # a Hub model or adapter: resolved to a commit, config and tokenizer read
    spec = hub_check.spec
    ping_redis()
    with session_scope() as session:
        gpus = _resolve_gpus(session, spec)
        notes: list[str] = []  # an adapter file's check, for the job's events
        waiting = bool(spec.adapter) and adapters.check_for_generation(
            session, ref=spec.adapter, owner=owner, admin=admin, model=spec.model, revision=spec.revision, notes=notes)
        input_file = _input_file(session, owner, spec.input, fmt=spec.input_format)
        spec = _with_input_format(spec, input_file)
        job = Job(id=new_id("job"), kind=spec.kind, state=JobState.queued.value, owner=owner,
                  spec=spec.model_dump(mode="json"), input_file_id=input_file.id, queue=queue_for(gpus), gpus=gpus,
                  created_at=now(), rows_total=0, rows_succeeded=0, rows_failed=0, prompt_tokens=0,
                  completion_tokens=0, retries=0)
        session.add(job)
        session.flush()
        checked = InputCheck(spec, model_dir=hub_check.local_dir)
        rows = checked.rows(parse_dataset(files.absolute(input_file), spec.input_format, spec=spec,
                                          columns=spec.input_columns))
        total, failed, first_error = insert_rows(session, job.id, rows)
        job.rows_total = total
        job.metrics = {"input": checked.summary(), **hub_check.metrics}
        add_event(session, job.id, f"submitted by {owner}: {total} rows, {failed} invalid, queue {job.queue}")
        for note in hub_check.notes + notes:
            add_event(session, job.id, note)
        if waiting and failed < total:  # queued, no shards: released when the fine-tune ends
            add_event(session, job.id, f"waiting for fine-tune {spec.adapter} to register its adapter")
            return job_view(session, job)
        transition(session, job, JobState.validating, reason="structural checks done")
        add_event(session, job.id, checked.token_note())
        if failed == total:
            error = f"every row is invalid; the first: {first_error}"
            transition(session, job, JobState.failed, reason=error, error=error, rows_failed=failed, finished_at=now())
            return job_view(session, job)
        shard_rows = spec.shard_rows or get_settings().shard_rows
        shards = create_shards(session, job, shard_rows=shard_rows, max_attempts=get_settings().max_attempts)
        transition(session, job, JobState.running, reason=f"{len(shards)} shards of up to {shard_rows} rows queued")
        shard_ids = [s.id for s in shards]
        job_id = job.id
    enqueue(shard_ids, queue_for(gpus))
    with session_scope() as session:
        return job_view(session, get_job(session, job_id))


def enqueue(shard_ids: list[int], queue: str) -> None:
    """Send one task per shard; shards whose send fails stay unsent and the reaper sends them later."""
    for shard_id in shard_ids:
        send(TASK_RUN_SHARD, [shard_id], queue)
        with session_scope() as session:
            leases.mark_enqueued(session, [shard_id])


def _check_sampling(spec: Spec) -> None:
    """Parameters that are each valid but cannot run together (the engine would fail every row)."""
    if getattr(spec, "do_sample", None) and spec.temperature == 0:
        raise InvalidInput(f"invalid {spec.kind} spec: {SAMPLE_AT_ZERO}")


def _resolve_model(spec: Spec) -> Spec:
    """Check the model a spec names before anything is stored; a local path becomes its resolved directory.

    With JOBS_MODEL_ROOTS set, a path is checked against the roots before it is looked at, so a refusal never
    tells whether a path outside them exists, and Hub ids are refused unless JOBS_HUB_MODELS allows them (models come
    only from the roots and that list). A Hub id is checked further by `service_models.check`.
    """
    settings = get_settings()
    if spec.trust_remote_code and not settings.allow_remote_code:
        raise Forbidden("trust_remote_code is disabled on this server (JOBS_ALLOW_REMOTE_CODE): use a model that "
                        "transformers supports natively")
    if not spec.model.strip():
        raise InvalidInput("model is empty: give a local model directory or a Hub id (org/name)")
    path = files.resolve(spec.model, what="model") if spec.model.startswith("~") else Path(spec.model)
    roots = settings.model_roots
    adapter = getattr(spec, "adapter", None)
    if adapter and hub.is_hub_id(adapter) and roots and not hub.allowed(adapter):
        raise InvalidInput(f"adapter {adapter!r}: this server takes Hub repos only where JOBS_HUB_MODELS lists them "
                           "(its models come from JOBS_MODEL_ROOTS): upload the adapter instead (--adapter DIR)")
    if not path.is_absolute() and HUB_ID.match(spec.model) and not path.exists():
        if not roots or hub.allowed(spec.model):
            return spec  # a Hub id: fetched once per host by the workers (service_models.check reads it first)
        raise InvalidInput(f"model {spec.model!r} is not a directory under the model roots "
                           f"({os.pathsep.join(map(str, roots))}): this server loads models only from "
                           "JOBS_MODEL_ROOTS and the Hub ids JOBS_HUB_MODELS lists")
    if not roots and not path.exists():
        raise InvalidInput(f"model {spec.model!r} does not exist: give a local model directory or a Hub id "
                           "(org/name)")
    real = files.check_server_path(str(path), roots, what="model")
    _check_model_dir(real, spec.model)
    return spec.model_copy(update={"model": str(real)})


def _check_model_dir(real: Path, name: str) -> None:
    """A saved transformers model: a directory with a config.json object and safetensors weights."""
    if not real.is_dir():
        raise InvalidInput(f"model path {name!r} is not a directory: point at a directory saved with "
                           "save_pretrained (config.json and *.safetensors)")
    config = real / "config.json"
    if not config.is_file():
        raise InvalidInput(f"model directory {name!r} has no config.json: point at a saved transformers model")
    try:
        with open(config, "rb") as stream:
            data = json.loads(stream.read(MAX_CONFIG_BYTES + 1)) if config.stat().st_size <= MAX_CONFIG_BYTES else 0
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        raise InvalidInput(f"model directory {name!r} has a config.json that is not a JSON object (of at most "
                           f"{MAX_CONFIG_BYTES} bytes): save the model again with save_pretrained")
    if not any(real.glob("*.safetensors")):
        raise InvalidInput(f"model directory {name!r} has no .safetensors weights (pickle .bin checkpoints are "
                           "refused): convert it with save_pretrained(..., safe_serialization=True)")


def _resolve_gpus(session: Session, spec: Spec) -> int:
    """The slice size the job runs on: the spec's, or the smallest that a live worker able to run it offers.

    Refused when live workers exist but none can run the job; the message names each candidate and what it
    lacks. With no live worker at all, a job that names `gpus` is queued until one starts.
    """
    workers = registry.live(session, get_settings().worker_timeout)
    if not workers:
        if spec.gpus is None:
            raise Unschedulable("no live worker: start the local stack with `gpujobs up`, or pass --gpus N to queue "
                                "the job until a worker of that slice size starts")
        return spec.gpus
    sizes = [spec.gpus] if spec.gpus is not None else sorted({registry.slice_size(w) for w in workers})
    gaps = []
    for size in sizes:
        for worker in (w for w in workers if registry.can_serve(w, size)):
            lacking = capability.missing(spec, worker.capabilities, size)
            if not lacking:
                return size
            gaps.append(f"{worker.name} ({queue_for(size)}): {'; '.join(lacking)}")
    if not gaps:
        raise Unschedulable(f"no live worker serves jobs of {spec.gpus} GPU(s) (queue {queue_for(spec.gpus)}); "
                            f"live workers: {_describe(workers)}. Start one with `gpujobs worker --gpus ...`")
    raise Unschedulable("no live worker can run this job: " + " | ".join(gaps))


def _describe(workers: list) -> str:
    return ", ".join(f"{w.name} ({'+'.join(w.queues)})" for w in workers)


def _input_file(session: Session, owner: str, ref: str, *, fmt: str = "auto"):
    """The stored file the job reads: the owner's file id, or a server path copied into the store.

    A dataset of more rows than JOBS_MAX_ROWS is refused here, before a single row is inserted (JSONL and CSV
    by their lines, Parquet by its footer; a saved dataset while it is parsed).
    """
    if not ref.strip():
        raise InvalidInput("input is empty: give a file id (file_…) from POST /files, or a server path under "
                           "JOBS_DATA_ROOTS")
    if ref.startswith("file_"):
        file = files.get(session, ref, owner=owner)
    else:
        file = files.import_server_file(session, owner=owner, path=ref)
    max_rows = get_settings().max_rows
    try:
        fmt = formats.detect(files.absolute(file), file.filename) if fmt == "auto" else fmt
        if fmt in ("parquet", "hf"):
            rows = formats.parquet_rows(files.absolute(file)) if fmt == "parquet" else 0
        else:
            with open(files.absolute(file), "rb") as stream:
                rows = count_rows(stream, limit=max_rows + (fmt == "csv"))  # a CSV header is not a row
                rows -= fmt == "csv"
    except OSError as exc:
        raise JobsError(f"stored file {file.id} cannot be read from the artifacts store ({exc.strerror}): check "
                        "JOBS_ARTIFACTS on the API host, or upload the dataset again") from None
    if rows > max_rows:
        raise too_many_rows(max_rows)
    return file


def _with_input_format(spec: Spec, file) -> Spec:
    """The spec with `input_format` resolved (auto → what the stored file is) and its column mapping checked."""
    fmt = spec.input_format
    if fmt == "auto":
        fmt = formats.detect(files.absolute(file), file.filename)
    columns = spec.input_columns or {}
    ours = {"prompt", "messages", "custom_id", *PARAMS}
    unknown = sorted(set(columns) - ours)
    if unknown:
        raise InvalidInput(f"input_columns {', '.join(map(repr, unknown))}: map one of prompt, messages, custom_id "
                           f"or a sampling parameter ({', '.join(sorted(PARAMS))}) to a column of the file")
    if columns and fmt == "openai":
        raise InvalidInput("input_columns does not apply to OpenAI batch lines (their keys are fixed): leave it out")
    if "prompt" in columns and "messages" in columns:
        raise InvalidInput("input_columns maps both prompt and messages: a row is one or the other")
    return spec.model_copy(update={"input_format": fmt})


def _model_from_input(owner: str, spec_data: Any) -> Any:
    """A generation job that names no model takes it from its OpenAI batch lines' `body.model`: every line must
    name the same one, and it must be allowed. With JOBS_MODEL_ROOTS set, a name is a directory under one of the
    roots (`qwen3-0.6b` → `/models/qwen3-0.6b`); without roots (the single-user local default) it is whatever
    `model` may be in a spec (a local directory, or a Hub id cached on the workers)."""
    if not isinstance(spec_data, dict) or spec_data.get("model") or spec_data.get("kind", "generate") != "generate":
        return spec_data
    ref, fmt = spec_data.get("input"), spec_data.get("input_format", "auto")
    missing = InvalidInput("model is missing: name one (--model, or `model:` in the spec); only OpenAI batch lines "
                           "may name it instead, in body.model")
    if not isinstance(ref, str) or not ref.strip():
        return spec_data  # the spec check says what is missing
    if fmt not in ("auto", "openai"):
        raise missing
    with session_scope() as session:
        if ref.startswith("file_"):
            file = files.get(session, ref, owner=owner)
            path, name = files.absolute(file), file.filename
        else:
            path = files.check_server_path(ref, get_settings().data_roots, what="dataset")
            name = path.name
    if not path.is_file() or (fmt == "auto" and formats.detect(path, name) != "openai"):
        raise missing
    models, unnamed = openai_models(path)
    if not models:
        raise InvalidInput("model is missing: the job names none and no OpenAI batch line names one in body.model: "
                           "name one (--model, or `model:` in the spec)")
    (first, first_line), *others = models.items()
    if others:
        second, second_line = others[0]
        raise InvalidInput(f"lines {first_line} and {second_line} name different models ({first!r} and {second!r}) "
                           "in body.model: when the job names no model every line must name the same one; or name "
                           "the model in the job (--model)")
    if unnamed is not None:
        raise InvalidInput(f"line {unnamed} names no body.model while line {first_line} names {first!r}: when the job "
                           "names no model every line must name the same one; or name the model in the job (--model)")
    return {**spec_data, "model": _allowed_model(first)}


def _allowed_model(name: str) -> str:
    roots = get_settings().model_roots
    if not roots or (HUB_ID.match(name) and hub.allowed(name)):
        return name  # checked like any spec's model by _resolve_model (a Hub id by service_models.check too)
    if not Path(name).is_absolute() and ".." not in Path(name).parts:
        for root in roots:
            if (root / name).is_dir():
                return str(root / name)
    raise InvalidInput(f"body.model {name!r} is not a model directory under the model roots "
                       f"({os.pathsep.join(map(str, roots))}): name one of those directories, or name the model in "
                       "the job (--model)")


# --- read ---------------------------------------------------------------------------------------------------


def job_view(session: Session, job: Job) -> dict[str, Any]:
    p = progress(session, job)
    view = {
        "id": job.id,
        "kind": job.kind,
        "name": job.spec.get("name"),
        "state": job.state,
        "owner": job.owner,
        "model": job.spec.get("model"),
        "queue": job.queue,
        "gpus": job.gpus,
        "rows": {k: p[k] for k in ("total", "succeeded", "failed", "pending")},
        "tokens": {"prompt": p["prompt_tokens"], "completion": p["completion_tokens"]},
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "metrics": _metrics(session, job),
        "load_options": job.load_options,
        "versions": job.versions,
        "error": job.error,
        "retries": job.retries,
        "input_file_id": job.input_file_id,
        "spec": job.spec,
    }
    if not JobState(job.state).terminal:
        view["live"] = _live_rates(session, job, p)
        downloads = _downloads(session, job)
        if downloads:
            view["downloads"] = downloads
    if job.kind == "finetune":
        from api.service_finetune import training_progress

        view["training"] = training_progress(session, job)
    return view


def _downloads(session: Session, job: Job) -> list[dict[str, Any]]:
    """Downloads of the job's Hub model (its pinned commit, once known) and adapter in progress on any host: bytes
    done and total, rate, ETA."""
    found = []
    for key, repo in (("model", job.spec.get("model")), ("adapter", job.spec.get("adapter"))):
        if not repo or not HUB_ID.match(repo):
            continue
        commit = ((job.metrics or {}).get(key) or {}).get("commit")
        found += [model_cache.download_view(r) for r in model_cache.downloads(session, repo, [commit] if commit
                                                                               else None)]
    return found


def _metrics(session: Session, job: Job) -> dict[str, Any]:
    """The job's stored metrics plus time to first result: for the job, its first committed row after its start;
    per shard, each finished shard's first committed row after its claim (min / max over shards)."""
    metrics = dict(job.metrics or {})
    if job.started_at is not None and "time_to_first_result_s" not in metrics:
        first = session.scalar(select(func.min(JobRow.finished_at)).where(
            JobRow.job_id == job.id, JobRow.worker.is_not(None)))
        metrics["time_to_first_result_s"] = round(first - job.started_at, 3) if first is not None else None
    shard_ttfr = [m["time_to_first_result_s"] for m in session.scalars(select(Shard.metrics).where(
        Shard.job_id == job.id, Shard.metrics.is_not(None))) if (m or {}).get("time_to_first_result_s") is not None]
    if shard_ttfr:
        metrics["shard_time_to_first_result_s"] = {"min": min(shard_ttfr), "max": max(shard_ttfr),
                                                   "shards": len(shard_ttfr)}
    return metrics


def _live_rates(session: Session, job: Job, p: dict[str, int]) -> dict[str, Any]:
    """Rows and tokens per second over the last minute, and an ETA from that rate."""
    since = now() - 60
    rows, tokens = session.execute(
        select(func.count(), func.coalesce(func.sum(JobRow.completion_tokens), 0)).where(
            JobRow.job_id == job.id, JobRow.finished_at > since, JobRow.worker.is_not(None)
        )
    ).one()
    window = min(60.0, now() - (job.started_at or now())) or 1.0
    rate = rows / window if rows else 0.0
    return {
        "rows_per_s": round(rate, 3),
        "tokens_per_s": round(tokens / window, 2) if rows else 0.0,
        "eta_s": round(p["pending"] / rate, 1) if rate else None,
    }


def list_jobs(*, owner: str | None, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    with session_scope() as session:
        stmt = select(Job).order_by(Job.created_at.desc()).limit(limit)
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        if state:
            stmt = stmt.where(Job.state == state)
        return [job_view(session, job) for job in session.scalars(stmt).all()]


def get(job_id: str, *, owner: str | None) -> dict[str, Any]:
    with session_scope() as session:
        return job_view(session, get_job(session, job_id, owner=owner))


def results(job_id: str, *, owner: str | None, errors: bool = False,
            order: str = "input") -> Iterator[dict[str, Any]]:
    """Finished rows (succeeded, or failed with `errors`) in input order or as they finished (`order`), as our
    JSONL records; works while the job still runs."""
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        where = formats.location(job.spec.get("input_format") or "jsonl")
        for row in _finished_rows(session, job_id, errors=errors, order=order):
            yield result_record(row, errors=errors, where=where)


def export(job_id: str, *, owner: str | None, fmt: str = "jsonl", errors: bool = False,
           order: str = "input") -> Iterator[bytes]:
    """Finished rows as the bytes of a results file: `jsonl` (ours), `openai` (the OpenAI Batch output file, or
    its error file with `errors`), `csv` or `parquet`. Streams chunk by chunk; works while the job still runs.

    CSV and Parquet have the columns custom_id, line (or row), output, finish_reason, prompt_tokens,
    completion_tokens (error, with `errors`), then the rows' pass-through keys as text columns (lists and objects
    JSON-encoded; several outputs of a row are a JSON list in CSV and a list column in Parquet)."""
    if fmt not in formats.OUTPUT_FORMATS or order not in ("input", "finished"):
        raise InvalidInput(f"format {fmt!r} / order {order!r}: use a format of {', '.join(formats.OUTPUT_FORMATS)} "
                           "and order input or finished")
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        spec, info = job.spec, (job.metrics or {}).get("input") or {}
        where = formats.location(spec.get("input_format") or "jsonl")
        rows = _finished_rows(session, job_id, errors=errors, order=order)
        if fmt == "openai":
            model = spec.get("model") or ""
            yield from formats.jsonl_chunks(formats.openai_error_record(r, job_id=job_id) if errors else
                                            formats.openai_output_record(r, job_id=job_id, model=model) for r in rows)
            return
        records = (result_record(r, errors=errors, where=where) for r in rows)
        if fmt == "jsonl":
            yield from formats.jsonl_chunks(records)
            return
        fixed = ["custom_id", where] + (["error"] if errors else ["output", "finish_reason", "prompt_tokens",
                                                                  "completion_tokens"])
        keys = info.get("extra_keys") or []
        columns = fixed + [k for k in keys if k not in RESULT_FIELDS and k != "row"]
        columns += ["extra"] if any(k in RESULT_FIELDS or k == "row" for k in keys) else []
        if fmt == "csv":
            yield from formats.csv_chunks(records, columns)
            return
        several = info.get("several_outputs") or (spec.get("num_return_sequences") or 1) > 1
        types = {where: "int", "prompt_tokens": "int", "completion_tokens": "int",
                 **({"output": "list", "finish_reason": "list"} if several else {})}
        yield from formats.parquet_chunks(records, columns, types)


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


def result_record(row: JobRow, *, errors: bool, where: str = "line") -> dict[str, Any]:
    """A row as a line of our JSONL results: its pass-through keys, custom_id, `line` (or `row` for Parquet and
    saved-dataset inputs), and output, finish_reason and token counts (or error). Several outputs are a list."""
    extra = (row.input or {}).get("extra", {})
    record: dict[str, Any] = {k: v for k, v in extra.items() if k not in RESULT_FIELDS and k != where}
    shadowed = {k: v for k, v in extra.items() if k in RESULT_FIELDS or k == where}
    record.update({"custom_id": row.custom_id, where: row.line})
    if errors:
        record["error"] = row.error
    else:
        record.update(output=row.output, finish_reason=row.finish_reason,
                      prompt_tokens=row.prompt_tokens, completion_tokens=row.completion_tokens)
    if shadowed:
        record["extra"] = shadowed
    return record


def events(job_id: str, *, owner: str | None, after: int = 0, limit: int = 500) -> list[dict[str, Any]]:
    with session_scope() as session:
        get_job(session, job_id, owner=owner)
        stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after).order_by(JobEvent.id).limit(limit)
        return [
            {"id": e.id, "ts": e.ts, "kind": e.kind, "level": e.level, "message": e.message, "data": e.data,
             "shard_id": e.shard_id}
            for e in session.scalars(stmt).all()
        ]


# --- change -------------------------------------------------------------------------------------------------


def cancel(job_id: str, *, owner: str | None, by: str) -> dict[str, Any]:
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        cancel_job(session, job, by=by)
        return job_view(session, job)


def retry(job_id: str, *, owner: str | None, failed_only: bool, by: str) -> dict[str, Any]:
    """Re-open a finished job under the same id and re-run its failed (and, unless failed_only, unfinished) rows.

    Rows that failed structural checks at submit are kept failed: running them again cannot succeed.
    """
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        if not JobState(job.state).terminal:
            raise IllegalTransition(f"job {job_id} is {job.state}: retry a job once it has finished (or cancel it)")
        states = [RowState.failed.value] + ([] if failed_only else [RowState.pending.value])
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job_id, JobRow.state.in_(states))).all()
        rerun = [r for r in rows if "raw" not in (r.input or {}) and not _structural_error(r)]
        if not rerun:
            raise InvalidInput(f"job {job_id} has no rows to retry" + (" (--failed-only)" if failed_only else ""))
        for row in rerun:
            row.state, row.error, row.output, row.finish_reason = RowState.pending.value, None, None, None
        transition(session, job, JobState.queued, reason=f"retry of {len(rerun)} rows requested by {by}",
                   retries=Job.retries + 1, error=None, finished_at=None)
        transition(session, job, JobState.validating, reason="rows reset")
        shard_ids = _reopen_shards(session, job, {r.idx for r in rerun})
        transition(session, job, JobState.running, reason=f"{len(shard_ids)} shards re-queued")
        queue = job.queue
    enqueue(shard_ids, queue)
    return get(job_id, owner=owner)


def _structural_error(row: JobRow) -> bool:
    return bool(row.error and row.error.startswith((f"line {row.line}:", f"row {row.line}:")))


def _reopen_shards(session: Session, job: Job, idxs: set[int]) -> list[int]:
    shard_ids = []
    for shard in session.scalars(select(Shard).where(Shard.job_id == job.id)).all():
        if any(shard.row_start <= i < shard.row_end for i in idxs):
            transition(session, shard, ShardState.queued, reason="retry", attempts=0, error=None, enqueued_at=None,
                       lease_owner=None, lease_expires_at=None)
            shard_ids.append(shard.id)
    return shard_ids


def workers(*, all: bool = False) -> list[dict[str, Any]]:
    """Registered workers with one state (online, lost, offline: core/registry.py); by default without those that
    stopped over JOBS_STOPPED_WORKERS_SHOWN seconds ago or were replaced by a newer worker on their host and slice."""
    settings, t = get_settings(), now()
    with session_scope() as session:
        found = registry.all_workers(session)
        if not all:
            found = registry.shown(found, t, timeout=settings.worker_timeout,
                                   stopped_for=settings.stopped_workers_shown)
        return [
            {
                "name": w.name, "host": w.host, "pid": w.pid, "slice": w.slice, "queues": w.queues, "gpus": w.gpus,
                "capabilities": w.capabilities, "state": registry.state_of(w, t, settings.worker_timeout),
                "started_at": w.started_at, "heartbeat_at": w.heartbeat_at, "current_shard_id": w.current_shard_id,
                "restarts": w.restarts, "stopped_at": w.stopped_at, "exit_code": w.exit_code, "reason": w.reason,
            }
            for w in found
        ]


def store_upload(*, owner: str, filename: str, stream) -> dict[str, Any]:
    with session_scope() as session:
        return file_view(files.save(session, owner=owner, filename=filename, stream=stream))


def file_view(f) -> dict[str, Any]:
    return {"id": f.id, "filename": f.filename, "bytes": f.bytes, "sha256": f.sha256, "purpose": f.purpose,
            "created_at": f.created_at, "owner": f.owner}


def spec_schema() -> dict[str, Any]:
    return GenerateSpec.model_json_schema()




# --- usage --------------------------------------------------------------------------------------------------

USAGE_FIELDS = ("jobs", "rows_succeeded", "rows_failed", "prompt_tokens", "completion_tokens", "gpu_seconds",
                "engine_seconds")
DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def usage(*, owner: str | None, since: str | None = None) -> dict[str, Any]:
    """What each owner used, summed in SQL over jobs created since `since` (a duration such as 7d, or an ISO date).

    Finished jobs count the totals written when they were finalized; live jobs count their rows so far and the
    metrics of their finished shards. GPU-seconds are each shard's wall time × its worker's slice size (0 on a
    CPU worker); engine seconds are the time spent inside generation. `owner=None` (admins): every owner.
    """
    start = usage_since(since)
    where = [Job.owner == owner] if owner is not None else []
    where += [Job.created_at >= start] if start is not None else []
    terminal = [s.value for s in JobState if s.terminal]
    totals: dict[str, dict[str, float]] = {owner: dict.fromkeys(USAGE_FIELDS, 0)} if owner is not None else {}
    with session_scope() as session:
        for query in _usage_queries(where, terminal):
            for record in session.execute(query).mappings():
                sums = totals.setdefault(record["owner"], dict.fromkeys(USAGE_FIELDS, 0))
                for key, value in record.items():
                    if key != "owner":
                        sums[key] += value or 0
    owners = [{"owner": name, **_rounded(sums)} for name, sums in sorted(totals.items())]
    overall = {key: sum(o[key] for o in owners) for key in USAGE_FIELDS}
    return {"since": start, "until": now(), "owners": owners, "total": _rounded(overall)}


def _usage_queries(where: list, terminal: list[str]) -> list:
    """Per-owner sums: job counts; finished jobs' totals; live jobs' rows so far; live jobs' finished shards."""
    def metric(column, name: str):
        return func.coalesce(func.sum(column[name].as_float()), 0.0)

    def counted(state: RowState):
        return func.coalesce(func.sum(case((JobRow.state == state.value, 1), else_=0)), 0)

    finished, live = Job.state.in_(terminal), Job.state.not_in(terminal)
    return [
        select(Job.owner, func.count().label("jobs")).where(*where).group_by(Job.owner),
        select(Job.owner, func.sum(Job.rows_succeeded).label("rows_succeeded"),
               func.sum(Job.rows_failed).label("rows_failed"), func.sum(Job.prompt_tokens).label("prompt_tokens"),
               func.sum(Job.completion_tokens).label("completion_tokens"),
               metric(Job.metrics, "gpu_seconds").label("gpu_seconds"),
               metric(Job.metrics, "engine_seconds").label("engine_seconds"))
        .where(*where, finished).group_by(Job.owner),
        select(Job.owner, counted(RowState.succeeded).label("rows_succeeded"),
               counted(RowState.failed).label("rows_failed"),
               func.coalesce(func.sum(JobRow.prompt_tokens), 0).label("prompt_tokens"),
               func.coalesce(func.sum(JobRow.completion_tokens), 0).label("completion_tokens"))
        .join(JobRow, JobRow.job_id == Job.id).where(*where, live).group_by(Job.owner),
        select(Job.owner, metric(Shard.metrics, "gpu_seconds").label("gpu_seconds"),
               metric(Shard.metrics, "engine_seconds").label("engine_seconds"))
        .join(Shard, Shard.job_id == Job.id).where(*where, live).group_by(Job.owner),
    ]


def _rounded(sums: dict[str, float]) -> dict[str, Any]:
    return {k: round(float(v), 3) if k.endswith("_seconds") else int(v) for k, v in sums.items()}


def usage_since(value: str | None) -> float | None:
    """`7d`, `12h`, `30m`, `90s`, `2w` before now, or an ISO date/time (UTC unless it names a zone) → Unix seconds."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if match := DURATION.match(text):
        return max(0.0, now() - float(match[1]) * UNIT_SECONDS[match[2]])
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
        return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
    except (ValueError, OverflowError):
        raise InvalidInput(f"since {value!r}: give a duration such as 7d, 12h, 30m or 2w, or an ISO date or time "
                           "such as 2026-01-31 or 2026-01-31T12:00:00Z") from None
