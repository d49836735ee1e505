"""Service functions behind the HTTP API: submit, read, cancel, retry. No torch, no worker code.

`owner=None` means an admin: every job is visible. Otherwise another owner's job or file answers 404, as if it
did not exist.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import capability, files, leases, registry
from core.dataset import parse_jsonl
from core.db import session_scope
from core.errors import Forbidden, IllegalTransition, InvalidInput, Unschedulable
from core.models import Job, JobEvent, JobRow, Shard
from core.queue import TASK_RUN_SHARD, ping_redis, queue_for, send
from core.settings import get_settings
from core.spec import GenerateSpec, Spec, parse_spec
from core.states import JobState, RowState, ShardState
from core.store import add_event, create_shards, get_job, insert_rows, maybe_finalize, new_id, now, progress, transition

log = logging.getLogger(__name__)
HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
RESULT_FIELDS = ("custom_id", "line", "output", "finish_reason", "prompt_tokens", "completion_tokens", "error")


# --- submit -------------------------------------------------------------------------------------------------


def submit(*, owner: str, spec_data: dict[str, Any]) -> dict[str, Any]:
    """Validate, store the job and its rows, then enqueue its shards. Nothing is written if a check fails."""
    spec = parse_spec(spec_data)
    if spec.kind != "generate":
        raise InvalidInput("fine-tune jobs are not available yet on this server: submit a generate job")
    spec = _resolve_model(spec)
    ping_redis()
    with session_scope() as session:
        gpus = _resolve_gpus(session, spec)
        input_file = _input_file(session, owner, spec.input)
        job = Job(id=new_id("job"), kind=spec.kind, state=JobState.queued.value, owner=owner,
                  spec=spec.model_dump(mode="json"), input_file_id=input_file.id, queue=queue_for(gpus), gpus=gpus,
                  created_at=now(), rows_total=0, rows_succeeded=0, rows_failed=0, prompt_tokens=0,
                  completion_tokens=0, retries=0)
        session.add(job)
        session.flush()
        with open(files.absolute(input_file), "rb") as stream:
            total, failed, first_error = insert_rows(session, job.id, parse_jsonl(stream))
        job.rows_total = total
        add_event(session, job.id, f"submitted by {owner}: {total} rows, {failed} invalid, queue {job.queue}")
        transition(session, job, JobState.validating, reason="structural checks done")
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


def _resolve_model(spec: Spec) -> Spec:
    settings = get_settings()
    if spec.trust_remote_code and not settings.allow_remote_code:
        raise Forbidden("trust_remote_code is disabled on this server (JOBS_ALLOW_REMOTE_CODE): use a model that "
                        "transformers supports natively")
    path = Path(spec.model).expanduser()
    if not path.exists():
        if HUB_ID.match(spec.model) and not settings.model_roots:
            return spec  # a Hub id: the worker loads it from its cache, offline
        raise InvalidInput(f"model {spec.model!r} does not exist: give a local model directory"
                           + ("" if settings.model_roots else " or a Hub id (org/name) cached on the workers"))
    real = files.check_server_path(str(path), settings.model_roots, what="model")
    if not (real / "config.json").is_file():
        raise InvalidInput(f"model directory {spec.model!r} has no config.json: point at a saved transformers model")
    if not any(real.glob("*.safetensors")):
        raise InvalidInput(f"model directory {spec.model!r} has no .safetensors weights (pickle .bin checkpoints are "
                           "refused): convert it with save_pretrained(..., safe_serialization=True)")
    return spec.model_copy(update={"model": str(real)})


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


def _input_file(session: Session, owner: str, ref: str):
    if ref.startswith("file_"):
        return files.get(session, ref, owner=owner)
    return files.import_server_file(session, owner=owner, path=ref)


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
        "metrics": job.metrics or {},
        "load_options": job.load_options,
        "versions": job.versions,
        "error": job.error,
        "retries": job.retries,
        "input_file_id": job.input_file_id,
        "spec": job.spec,
    }
    if not JobState(job.state).terminal:
        view["live"] = _live_rates(session, job, p)
    return view


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


def results(job_id: str, *, owner: str | None, errors: bool = False) -> Iterator[dict[str, Any]]:
    """Finished rows in input order (succeeded, or failed with `errors`); works while the job still runs."""
    with session_scope() as session:
        get_job(session, job_id, owner=owner)
        state = RowState.failed if errors else RowState.succeeded
        stmt = (
            select(JobRow)
            .where(JobRow.job_id == job_id, JobRow.state == state.value)
            .order_by(JobRow.idx)
            .execution_options(yield_per=1000)
        )
        for row in session.scalars(stmt):
            yield result_record(row, errors=errors)


def result_record(row: JobRow, *, errors: bool) -> dict[str, Any]:
    extra = (row.input or {}).get("extra", {})
    record: dict[str, Any] = {k: v for k, v in extra.items() if k not in RESULT_FIELDS}
    shadowed = {k: v for k, v in extra.items() if k in RESULT_FIELDS}
    record.update(custom_id=row.custom_id, line=row.line)
    if errors:
        record["error"] = row.error
    else:
        record.update(output=row.output, finish_reason=row.finish_reason, prompt_tokens=row.prompt_tokens,
                      completion_tokens=row.completion_tokens)
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
        if JobState(job.state).terminal:
            raise IllegalTransition(f"job {job_id} is already {job.state}: nothing to cancel")
        if job.state != JobState.cancelling.value:
            transition(session, job, JobState.cancelling, reason=f"cancel requested by {by}")
        queued = session.scalars(select(Shard).where(Shard.job_id == job_id, Shard.state == ShardState.queued.value))
        for shard in queued.all():
            try:
                transition(session, shard, ShardState.cancelled, reason="job cancelled before it ran")
            except IllegalTransition:
                pass  # a worker claimed it just now; it will see the job is cancelling and stop
        maybe_finalize(session, job_id)
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
    return bool(row.error and row.error.startswith(f"line {row.line}:"))


def _reopen_shards(session: Session, job: Job, idxs: set[int]) -> list[int]:
    shard_ids = []
    for shard in session.scalars(select(Shard).where(Shard.job_id == job.id)).all():
        if any(shard.row_start <= i < shard.row_end for i in idxs):
            transition(session, shard, ShardState.queued, reason="retry", attempts=0, error=None, enqueued_at=None,
                       lease_owner=None, lease_expires_at=None)
            shard_ids.append(shard.id)
    return shard_ids


def workers() -> list[dict[str, Any]]:
    timeout = get_settings().worker_timeout
    with session_scope() as session:
        return [
            {
                "name": w.name, "host": w.host, "pid": w.pid, "slice": w.slice, "queues": w.queues, "gpus": w.gpus,
                "capabilities": w.capabilities, "state": w.state if now() - w.heartbeat_at < timeout else "lost",
                "started_at": w.started_at, "heartbeat_at": w.heartbeat_at, "current_shard_id": w.current_shard_id,
            }
            for w in registry.all_workers(session)
        ]


def store_upload(*, owner: str, filename: str, stream) -> dict[str, Any]:
    with session_scope() as session:
        return file_view(files.save(session, owner=owner, filename=filename, stream=stream))


def file_view(f) -> dict[str, Any]:
    return {"id": f.id, "filename": f.filename, "bytes": f.bytes, "sha256": f.sha256, "purpose": f.purpose,
            "created_at": f.created_at, "owner": f.owner}


def spec_schema() -> dict[str, Any]:
    return GenerateSpec.model_json_schema()


