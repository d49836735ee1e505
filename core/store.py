"""Data access: state transitions, events, jobs, rows and shards. Plain keyword-only functions over a session;
callers own the transaction (`core.db.session_scope`). The sequences of changes that make a job's life are in
`core.jobs`.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable
from typing import Any

from sqlalchemy import and_, func, select, update
from sqlalchemy.orm import Session

from core.dataset import ParsedRow
from core.errors import IllegalTransition, NotFound
from core.models import Job, JobEvent, JobRow, Shard, ShardRun
from core.states import JobState, RowState, ShardState, allowed_sources

INSERT_CHUNK = 2000


def now() -> float:
    return time.time()


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(6)}"


def add_event(
    session: Session,
    job_id: str,
    message: str,
    *,
    kind: str = "log",
    level: str = "info",
    data: dict[str, Any] | None = None,
    shard_id: int | None = None,
) -> None:
    """An event in the job's current run (`jobs.retries + 1`, read in the same statement)."""
    run = select(func.coalesce(Job.retries, 0) + 1).where(Job.id == job_id).scalar_subquery()
    session.add(
        JobEvent(
            job_id=job_id,
            shard_id=shard_id,
            ts=now(),
            kind=kind,
            level=level,
            message=message,
            data=data,
            run=func.coalesce(run, 1),
        )
    )


def transition(
    session: Session,
    obj: Job | Shard,
    to: JobState | ShardState,
    *,
    reason: str = "",
    where: Iterable[Any] = (),
    **values: Any,
) -> Job | Shard:
    """The one way a job's or a shard's state changes.

    A conditional UPDATE from the allowed source states (plus any `where` conditions, such as "the lease is
    still mine"), the extra column `values`, and a `state` event, in the caller's transaction. Raises
    IllegalTransition when the change is not allowed or another process changed the row first.
    Works with detached objects too; returns the row as now stored, bound to `session`.
    """
    model = type(obj)
    kind = "job" if model is Job else "shard"
    sources = allowed_sources(kind, to.value)
    if not sources:
        raise IllegalTransition(f"no {kind} may move to {to.value}")
    run = None  # a shard's attempt that this change ends: (started_at, lease_expires_at)
    if kind == "shard":
        if to is ShardState.queued:
            values.setdefault("queued_at", now())
        if ShardState.running.value in sources:
            before = session.execute(
                select(Shard.state, Shard.started_at, Shard.lease_expires_at).where(Shard.id == obj.id)
            ).one_or_none()
            if before is not None:
                where = [*where, Shard.state == before.state]  # the state read is the state changed
                if before.state == ShardState.running.value and before.started_at is not None:
                    run = (before.started_at, before.lease_expires_at)
    stmt = (
        update(model)
        .where(model.id == obj.id, model.state.in_(sources), *where)
        .values(state=to.value, **values)
        .execution_options(synchronize_session=False)
    )
    changed = session.execute(stmt).rowcount == 1
    fresh = session.get(model, obj.id, populate_existing=True)
    if not changed:
        current = fresh.state if fresh is not None else "deleted"
        raise IllegalTransition(f"{kind} {obj.id} cannot move from {current} to {to.value}")
    if run is not None:
        _record_run(session, fresh, *run)
    job_id, shard_id = (fresh.id, None) if kind == "job" else (fresh.job_id, fresh.id)
    label = kind if kind == "job" else f"shard {fresh.idx}"
    add_event(
        session,
        job_id,
        f"{label} → {to.value}" + (f": {reason}" if reason else ""),
        kind="state",
        data={"object": kind, "state": to.value, "reason": reason or None},
        shard_id=shard_id,
    )
    return fresh


def _record_run(session: Session, shard: Shard, started_at: float, lease_expires_at: float | None) -> None:
    """The attempt of `shard` that just ended, as a `shard_runs` row (owners' GPU-seconds: core/scheduling.py). An
    attempt whose lease expired ended, as far as anyone knows, when its lease did."""
    owner, gpus = session.execute(select(Job.owner, Job.gpus).where(Job.id == shard.job_id)).one()
    ended = now() if lease_expires_at is None else min(now(), lease_expires_at)
    session.add(
        ShardRun(
            shard_id=shard.id,
            owner=owner,
            weight=float(gpus) if gpus > 0 else 1.0,
            started_at=started_at,
            ended_at=max(ended, started_at),
            ended_as=shard.state,
        )
    )


def get_job(session: Session, job_id: str, *, owner: str | None = None) -> Job:
    """A job by id; `owner` (None for admins) hides other owners' jobs as if they did not exist."""
    job = session.get(Job, job_id)
    if job is None or (owner is not None and job.owner != owner):
        raise NotFound(f"no job {job_id!r}: list yours with `gpujobs list`")
    return job


def insert_rows(session: Session, job_id: str, rows: Iterable[ParsedRow]) -> tuple[int, int, str | None]:
    """Insert parsed rows in chunks. Returns (total, failed, first error)."""
    total = failed = 0
    first_error = None
    pending, bad_state = RowState.pending.value, RowState.failed.value  # an Enum's .value costs a call per row
    chunk: list[dict[str, Any]] = []
    for row in rows:
        bad = row.error is not None
        total += 1
        if bad:
            failed += 1
            first_error = first_error or row.error
        chunk.append(
            {
                "job_id": job_id,
                "idx": row.idx,
                "custom_id": row.custom_id,
                "line": row.line,
                "input": row.input,
                "state": bad_state if bad else pending,
                "error": row.error,
                "executions": 0,
            }
        )
        if len(chunk) >= INSERT_CHUNK:
            session.execute(JobRow.__table__.insert(), chunk)
            chunk.clear()
    if chunk:
        session.execute(JobRow.__table__.insert(), chunk)
    return total, failed, first_error


def create_shards(session: Session, job: Job, *, shard_rows: int, max_attempts: int) -> list[Shard]:
    shards = [
        Shard(
            job_id=job.id,
            idx=i,
            row_start=start,
            row_end=min(start + shard_rows, job.rows_total),
            state=ShardState.queued.value,
            queued_at=job.created_at,
            attempts=0,
            max_attempts=max_attempts,
            rows_done=0,
            rows_failed=0,
            completion_tokens=0,
        )
        for i, start in enumerate(range(0, job.rows_total, shard_rows))
    ]
    session.add_all(shards)
    session.flush()
    return shards


def progress(session: Session, job: Job) -> dict[str, int]:
    """Rows done/failed/pending from the rows themselves (exact, also while shards run)."""
    counts = dict(
        session.execute(select(JobRow.state, func.count()).where(JobRow.job_id == job.id).group_by(JobRow.state)).all()
    )
    tokens = session.execute(
        select(
            func.coalesce(func.sum(JobRow.prompt_tokens), 0), func.coalesce(func.sum(JobRow.completion_tokens), 0)
        ).where(JobRow.job_id == job.id)
    ).one()
    return {
        "total": job.rows_total,
        "succeeded": counts.get(RowState.succeeded.value, 0),
        "failed": counts.get(RowState.failed.value, 0),
        "pending": counts.get(RowState.pending.value, 0),
        "prompt_tokens": int(tokens[0]),
        "completion_tokens": int(tokens[1]),
    }


def open_shards(session: Session, job_id: str) -> int:
    live = (ShardState.queued.value, ShardState.running.value)
    return session.scalar(select(func.count()).where(Shard.job_id == job_id, Shard.state.in_(live))) or 0


def fail_pending_rows(session: Session, job_id: str, start: int, end: int, reason: str) -> None:
    session.execute(
        update(JobRow)
        .where(
            and_(JobRow.job_id == job_id, JobRow.idx >= start, JobRow.idx < end, JobRow.state == RowState.pending.value)
        )
        .values(state=RowState.failed.value, error=reason, finished_at=now())
    )
