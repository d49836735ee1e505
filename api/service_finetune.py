"""Submitting a fine-tune job (called by `api.service.submit` for `kind: finetune`). No torch.

A fine-tune is one shard over all its rows, so it is claimed, leased, renewed and reaped like any generation shard;
a worker that takes over after a crash resumes from the last complete checkpoint. Training rows are checked
structurally here (`core.training_data`): one bad row refuses the job, naming its line (or 0-based row). Validation
rows, when given as a file, are stored as rows marked `split: validation` after the training rows. Both files are
read by the reader every job uses (JSONL, CSV, Parquet, a saved dataset; `file_format`, `input_columns`); the format
each resolved to is recorded in the job's metrics (`input`), and generated row ids name the place (`line-7`,
`row-6`, `validation-line-3`).

`then_generate` creates the generation job right after the fine-tune is stored: it names the fine-tune as its
adapter and waits, queued and without shards, until the adapter is registered (see `core.adapters`).
"""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy import select

from api import service_models
from core import adapters, files, formats
from core.db import session_scope
from core.errors import JobsError
from core.models import Job, JobRow, Shard
from core.queue import ping_redis, queue_for
from core.settings import get_settings
from core.spec import FinetuneSpec, GenerateSpec, parse_spec
from core.states import JobState, RowState, ShardState
from core.store import add_event, create_shards, get_job, new_id, now, transition
from core.training_data import TrainingRow, file_format, parse_training_file

log = logging.getLogger(__name__)
INHERITED = ("revision", "dtype", "attn_implementation", "use_kernels", "kernel_config", "device_map",
             "trust_remote_code", "gpus")


def submit_finetune(*, owner: str, spec: FinetuneSpec, admin: bool = False) -> dict[str, Any]:
    from api import service

    spec = service._resolve_model(spec)
    hub_check = service_models.check(spec)  # a Hub base: resolved to a commit, its config read
    spec = hub_check.spec
    then = _then_generate_spec(spec)
    ping_redis()
    with session_scope() as session:
        gpus = service._resolve_gpus(session, spec)
        input_file_id, rows, read_as = _training_rows(session, owner, spec)
        job = Job(id=new_id("job"), kind="finetune", state=JobState.queued.value, owner=owner,
                  spec=spec.model_dump(mode="json"), input_file_id=input_file_id, queue=queue_for(gpus), gpus=gpus,
                  created_at=now(), rows_total=len(rows), rows_succeeded=0, rows_failed=0, prompt_tokens=0,
                  completion_tokens=0, retries=0, metrics={"input": read_as, **hub_check.metrics})
        session.add(job)
        session.flush()
        session.execute(JobRow.__table__.insert(), [
            {"job_id": job.id, "idx": r.idx, "line": r.line, "input": r.input, "state": RowState.pending.value,
             "custom_id": ("validation-" if r.input.get("split") else "") + f"{r.where}-{r.line}", "executions": 0}
            for r in rows])
        n_valid = sum(1 for r in rows if r.input.get("split"))
        add_event(session, job.id, f"submitted by {owner}: fine-tune on {len(rows) - n_valid} training rows"
                  f" ({read_as['format']})"
                  + (f" and {n_valid} validation rows ({read_as['validation_format']})" if n_valid else "")
                  + f", queue {job.queue}")
        for note in hub_check.notes:
            add_event(session, job.id, note)
        transition(session, job, JobState.validating, reason="structural checks done")
        # One shard over every row: the fine-tune is leased, renewed and reaped like any shard.
        shards = create_shards(session, job, shard_rows=max(len(rows), 1), max_attempts=get_settings().max_attempts)
        transition(session, job, JobState.running, reason="1 training shard queued")
        job_id, shard_ids = job.id, [s.id for s in shards]
    if then is not None:
        _chain(job_id, then, owner=owner, admin=admin)
    service.enqueue(shard_ids, queue_for(gpus))
    with session_scope() as session:
        return service.job_view(session, get_job(session, job_id))


def _training_rows(session, owner: str, spec: FinetuneSpec) -> tuple[str, list[TrainingRow], dict[str, str]]:
    """The checked rows of `input` (then `validation_input`), the training file's id, and the format each file was
    read as."""
    settings = get_settings()
    limits = dict(max_rows=settings.max_rows, max_row_bytes=settings.max_row_bytes, input_format=spec.input_format,
                  columns=spec.input_columns)
    train_file, fmt = _dataset_file(session, owner, spec.input, spec.file_format)
    rows = parse_training_file(files.absolute(train_file), fmt, **limits)
    read_as = {"format": fmt}
    if spec.validation_input:
        valid_file, valid_fmt = _dataset_file(session, owner, spec.validation_input, spec.file_format)
        rows += parse_training_file(files.absolute(valid_file), valid_fmt, split="validation", start_idx=len(rows),
                                    what="validation dataset", **limits)
        read_as["validation_format"] = valid_fmt
    return train_file.id, rows, read_as


def _dataset_file(session, owner: str, ref: str, fmt: str):
    """The stored file (row count checked against JOBS_MAX_ROWS) and the format it is read as (`auto` resolved)."""
    from api import service

    file = service._input_file(session, owner, ref, fmt=fmt)
    if fmt == "auto":
        fmt = file_format(formats.detect(files.absolute(file), file.filename))
    return file, fmt


def _then_generate_spec(spec: FinetuneSpec) -> dict[str, Any] | None:
    """The chained generation spec, checked before anything is stored (its adapter id is filled in later)."""
    if spec.then_generate is None:
        return None
    data = {k: getattr(spec, k) for k in INHERITED if getattr(spec, k) is not None}
    data.update(spec.then_generate, kind="generate", model=spec.model, adapter="job_pending")
    data.setdefault("name", f"{spec.name or 'fine-tune'}: generate")
    parsed = parse_spec(data)
    assert isinstance(parsed, GenerateSpec)
    return data


def _chain(job_id: str, then: dict[str, Any], *, owner: str, admin: bool) -> None:
    """Submit the chained generation job; if that is refused, the fine-tune fails with the reason (nothing runs)."""
    from api import service

    try:
        chained = service.submit(owner=owner, spec_data={**then, "adapter": job_id}, admin=admin)
    except JobsError as exc:
        with session_scope() as session:
            job = get_job(session, job_id)
            error = f"then_generate was refused: {exc}"
            transition(session, job, JobState.failed, reason=error, error=error, finished_at=now())
            for shard in session.scalars(select(Shard).where(Shard.job_id == job_id)).all():
                transition(session, shard, ShardState.cancelled, reason="the chained job was refused")
        raise
    with session_scope() as session:
        job = get_job(session, job_id)
        job.metrics = {**(job.metrics or {}), "then_generate_job": chained["id"]}
        add_event(session, job_id, f"generation job {chained['id']} will run with this adapter once it is ready")



# --- adapters and training progress (read) -------------------------------------------------------------------------


def list_adapters(*, owner: str | None, limit: int = 100) -> list[dict[str, Any]]:
    with session_scope() as session:
        return [adapters.view(a) for a in adapters.list_for(session, owner=owner, limit=limit)]


def get_adapter(adapter_id: str, *, owner: str | None) -> dict[str, Any]:
    with session_scope() as session:
        return adapters.view(adapters.get(session, adapter_id, owner=owner))


def training_progress(session, job: Job) -> dict[str, Any] | None:
    """A fine-tune's last logged step, epoch, loss and an ETA from the recent step time (None before step 1)."""
    from core.models import JobEvent

    recent = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.kind == "metric")
                             .order_by(JobEvent.id.desc()).limit(3)).all()
    if not recent:
        return None
    data: dict[str, Any] = {}
    for event in reversed(recent):  # the newest value of each key (the last log of a run holds only train_loss)
        data.update(event.data or {})
    event = recent[0]
    remaining = max((data.get("max_steps") or 0) - data.get("step", 0), 0)
    if data.get("step_seconds") and not JobState(job.state).terminal:
        data["eta_s"] = round(remaining * data["step_seconds"], 1)
    data["at"] = event.ts
    return data
