"""The adapter registry: LoRA adapters made by fine-tune jobs, and generation jobs that wait for one.

An adapter is registered by the worker that trained it, after it checked that the saved adapter loads onto its base
and generates; only then does the fine-tune succeed. Its id is the fine-tune job's id. Files live under the
artifacts dir: `finetune/<job>/checkpoints` while training, `adapters/<job>/` once registered (`path` is stored
relative to the artifacts dir, so hosts may mount it at different places).

Chaining: a generation job that names `adapter: <fine-tune id>` while that fine-tune is still live is stored with
its rows but left `queued`, with no shards. When the fine-tune ends, `release_waiting` (called by the worker that
finished it, and by every reaper as a safety net) creates its shards, or fails it with the fine-tune's outcome.
This lives in core because both the API (submit) and the worker (release) need it.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core.errors import Conflict, InvalidInput, JobsError, NotFound
from core.models import Adapter, Job, Shard
from core.settings import get_settings
from core.states import JobState
from core.store import add_event, create_shards, now, transition

log = logging.getLogger(__name__)
WEIGHTS = "adapter_model.safetensors"


class RegistryError(JobsError):
    """A trained adapter failed the registry's check (it does not load onto its base, or cannot generate)."""


def workdir(job_id: str) -> Path:
    """Where a fine-tune's checkpoints are written (shared by every worker that may resume it)."""
    return get_settings().artifacts / "finetune" / job_id


def adapter_dir(job_id: str) -> Path:
    return get_settings().artifacts / "adapters" / job_id


def absolute(adapter: Adapter) -> Path:
    return get_settings().artifacts / adapter.path


def digest(folder: Path) -> tuple[int, str]:
    """(bytes, sha256) of the adapter's weights file."""
    data = (folder / WEIGHTS).read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def register(session: Session, job: Job, folder: Path, *, lora_config: dict[str, Any], load_options: dict[str, Any],
             metrics: dict[str, Any]) -> Adapter:
    """Record the adapter saved at `folder` (under the artifacts dir) for fine-tune `job`; idempotent per job."""
    size, sha = digest(folder)
    row = session.get(Adapter, job.id) or Adapter(id=job.id, job_id=job.id)
    row.owner, row.base_model, row.base_revision = job.owner, job.spec["model"], job.spec.get("revision")
    row.tokenizer, row.path = job.spec["model"], str(folder.relative_to(get_settings().artifacts))
    row.bytes, row.sha256, row.lora_config, row.load_options = size, sha, lora_config, load_options
    row.metrics, row.created_at = metrics, now()
    session.add(row)
    add_event(session, job.id, f"adapter registered: {size} bytes, sha256 {sha[:12]}…", data={"path": row.path})
    return row


def get(session: Session, adapter_id: str, *, owner: str | None) -> Adapter:
    """An adapter by id (= its fine-tune job id); another owner's answers NotFound, as if it did not exist."""
    row = session.get(Adapter, adapter_id)
    if row is None or (owner is not None and row.owner != owner):
        raise NotFound(f"no adapter {adapter_id!r}: list yours with `gpujobs adapters list`")
    return row


def list_for(session: Session, *, owner: str | None, limit: int = 100) -> list[Adapter]:
    stmt = select(Adapter).order_by(Adapter.created_at.desc()).limit(limit)
    if owner is not None:
        stmt = stmt.where(Adapter.owner == owner)
    return list(session.scalars(stmt).all())


def view(row: Adapter) -> dict[str, Any]:
    return {"id": row.id, "job_id": row.job_id, "owner": row.owner, "base_model": row.base_model,
            "base_revision": row.base_revision, "tokenizer": row.tokenizer, "path": str(absolute(row)),
            "bytes": row.bytes, "sha256": row.sha256, "lora_config": row.lora_config,
            "load_options": row.load_options, "metrics": row.metrics, "created_at": row.created_at}


def check_for_generation(session: Session, *, ref: str, owner: str, admin: bool, model: str,
                         revision: str | None) -> bool:
    """Can a generation job of `owner` on `model` use adapter `ref`? True: yes, but its fine-tune is still running
    (the job must wait for it). Raises with what is wrong otherwise."""
    if not ref.startswith("job_"):
        raise InvalidInput(f"adapter {ref!r}: name the fine-tune job that made it (job_…); list adapters with "
                           "`gpujobs adapters list`")
    job = session.get(Job, ref)
    if job is None or (not admin and job.owner != owner):
        raise NotFound(f"no adapter {ref!r}: list yours with `gpujobs adapters list`")
    if job.kind != "finetune":
        raise InvalidInput(f"adapter {ref!r} names a {job.kind} job, not a fine-tune")
    base, base_revision = job.spec.get("model"), job.spec.get("revision")
    if (base, base_revision) != (model, revision):
        raise InvalidInput(f"adapter {ref} was trained on {base!r}" + (f" (revision {base_revision})" if base_revision
                           else "") + f", not on {model!r}: submit with --model {base}")
    state = JobState(job.state)
    if not state.terminal:
        return True
    if state is not JobState.succeeded:
        raise Conflict(f"fine-tune {ref} is {job.state}" + (f" ({job.error})" if job.error else "")
                       + ": it has no adapter. Retry it with `gpujobs retry`")
    if session.get(Adapter, ref) is None:
        raise Conflict(f"fine-tune {ref} succeeded but registered no adapter: retry it with `gpujobs retry`")
    return False


def release_waiting(session: Session, finetune_id: str | None = None) -> list[tuple[list[int], str]]:
    """Queued generation jobs waiting for a fine-tune that has ended: shard them (it succeeded) or fail them.

    Returns (shard ids, queue) to send once the caller's transaction has committed. Each job moves by conditional
    transitions, so two processes releasing at once never both shard one job.
    """
    jobs = session.scalars(select(Job).where(Job.kind == "generate", Job.state == JobState.queued.value)).all()
    to_send = []
    for job in jobs:
        ref = (job.spec or {}).get("adapter")
        if not ref or (finetune_id and ref != finetune_id) or _has_shards(session, job.id):
            continue
        parent = session.get(Job, ref)
        if parent is not None and not JobState(parent.state).terminal:
            continue
        to_send += _release(session, job, parent)
    return to_send


def _has_shards(session: Session, job_id: str) -> bool:
    return session.scalar(select(Shard.id).where(Shard.job_id == job_id).limit(1)) is not None


def _release(session: Session, job: Job, parent: Job | None) -> list[tuple[list[int], str]]:
    from core.errors import IllegalTransition

    ok = parent is not None and parent.state == JobState.succeeded.value and session.get(Adapter, parent.id)
    try:
        if not ok:
            outcome = f"{parent.state}" + (f": {parent.error}" if parent.error else "") if parent else "deleted"
            error = f"fine-tune {job.spec.get('adapter')} ended {outcome}; this job needed its adapter"
            transition(session, job, JobState.failed, reason=error, error=error, finished_at=now())
            return []
        transition(session, job, JobState.validating, reason=f"adapter {parent.id} is ready")
    except IllegalTransition:
        return []  # another process released it, or it was cancelled meanwhile
    settings = get_settings()
    shard_rows = job.spec.get("shard_rows") or settings.shard_rows
    shards = create_shards(session, job, shard_rows=shard_rows, max_attempts=settings.max_attempts)
    transition(session, job, JobState.running, reason=f"{len(shards)} shards of up to {shard_rows} rows queued")
    return [([s.id for s in shards], job.queue)]
