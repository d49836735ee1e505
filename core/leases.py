"""Shard leases: claim, renew, commit rows, finish, hand back, and the reaper.

The rules that make "nothing lost, nothing run twice" hold:

- A shard is run only under a lease in SQL (`lease_owner`, `lease_expires_at`), taken by a conditional update
  from `queued` and renewed by the worker's heartbeat. Each claim counts an attempt; a shard that has used its
  attempts fails with that reason instead of looping.
- Rows are written in micro-batches, each in one transaction that first re-checks the lease: a worker that
  lost its lease (paused, partitioned, reaped) cannot write anything. A row result is written only while the
  row is pending (idempotent on (job, row)); `executions` counts every attempt to write it, so a duplicate
  execution is visible, never hidden by a unique key.
- A late or redelivered message finds its shard done or leased by a live worker and does nothing.
- The reaper (run by every worker's heartbeat thread, safe to run many at once) re-queues shards whose lease
  expired and re-sends shards whose first enqueue never happened; only the process whose conditional update
  won sends the message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from core.errors import IllegalTransition, LeaseLost
from core.models import Job, JobRow, Shard
from core.states import JobState, RowState, ShardState
from core.store import add_event, fail_pending_rows, maybe_finalize, now, transition

log = logging.getLogger(__name__)

STOPPED_JOB_STATES = (JobState.cancelling.value, JobState.cancelled.value, JobState.failed.value)


@dataclass
class Claim:
    shard: Shard
    job: Job
    rows: list[JobRow]


@dataclass
class RowResult:
    idx: int
    output: str | None = None
    finish_reason: str | list[str] | None = None  # a list with num_return_sequences > 1
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None
    started_at: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def claim(session: Session, shard_id: int, worker: str, lease_seconds: float) -> Claim | None:
    """Take the shard's lease, or return None (with an event) when there is nothing for this worker to do."""
    shard = session.get(Shard, shard_id)
    if shard is None:
        log.warning("shard %s does not exist (job deleted?): message dropped", shard_id)
        return None
    job = session.get(Job, shard.job_id)
    if ShardState(shard.state).terminal:
        log.info("%s shard %s is already %s: late message ignored", job.id, shard.idx, shard.state)
        return None
    if job.state in STOPPED_JOB_STATES:
        _stop(session, shard, job)
        return None
    t = now()
    try:
        if shard.state == ShardState.running.value:
            if shard.lease_expires_at and shard.lease_expires_at > t:
                log.info("%s shard %s is leased by %s: duplicate message ignored", job.id, shard.idx,
                         shard.lease_owner)
                return None
            expired_lease = Shard.lease_expires_at == shard.lease_expires_at
            transition(session, shard, ShardState.queued, reason=f"lease of {shard.lease_owner} expired",
                       where=[expired_lease])
        if shard.attempts >= shard.max_attempts:
            lost = shard.error or "the worker was lost each time"
            give_up(session, shard, f"gave up after {shard.attempts} attempts: {lost}")
            return None
        transition(
            session,
            shard,
            ShardState.running,
            reason=f"claimed by {worker} (attempt {shard.attempts + 1} of {shard.max_attempts})",
            lease_owner=worker,
            lease_expires_at=t + lease_seconds,
            attempts=Shard.attempts + 1,
            started_at=t,
        )
    except IllegalTransition:  # a duplicate message claimed it (or the reaper re-queued it) at the same time
        log.info("%s shard %s was taken by another process: duplicate message ignored", job.id, shard.idx)
        return None
    if job.state == JobState.running.value and job.started_at is None:
        session.execute(update(Job).where(Job.id == job.id, Job.started_at.is_(None)).values(started_at=t))
    rows = session.scalars(
        select(JobRow)
        .where(
            JobRow.job_id == job.id,
            JobRow.idx >= shard.row_start,
            JobRow.idx < shard.row_end,
            JobRow.state == RowState.pending.value,
        )
        .order_by(JobRow.idx)
    ).all()
    return Claim(shard, job, list(rows))


def _stop(session: Session, shard: Shard, job: Job) -> None:
    try:
        transition(session, shard, ShardState.cancelled, reason=f"job is {job.state}")
    except IllegalTransition:
        return
    maybe_finalize(session, job.id)


def give_up(session: Session, shard: Shard, reason: str) -> None:
    """Fail the shard and its unfinished rows with `reason`; finalize the job if this was its last shard."""
    transition(session, shard, ShardState.failed, reason=reason, error=reason, lease_owner=None, finished_at=now())
    fail_pending_rows(session, shard.job_id, shard.row_start, shard.row_end, reason)
    maybe_finalize(session, shard.job_id)


def _hold(session: Session, shard_id: int, worker: str, lease_seconds: float) -> None:
    """Renew the lease, or raise LeaseLost if it is no longer ours."""
    stmt = (
        update(Shard)
        .where(Shard.id == shard_id, Shard.lease_owner == worker, Shard.state == ShardState.running.value)
        .values(lease_expires_at=now() + lease_seconds)
    )
    if session.execute(stmt).rowcount != 1:
        raise LeaseLost(f"shard {shard_id} is no longer leased by {worker}")


def renew(session: Session, shard_id: int, worker: str, lease_seconds: float) -> bool:
    try:
        _hold(session, shard_id, worker, lease_seconds)
        return True
    except LeaseLost:
        return False


def commit_rows(session: Session, shard: Shard, worker: str, results: list[RowResult], lease_seconds: float) -> None:
    """Write one micro-batch of results under the lease, idempotently on (job, row)."""
    _hold(session, shard.id, worker, lease_seconds)
    if not results:
        return
    t = now()
    table = JobRow.__table__
    same_row = (table.c.job_id == bindparam("b_job"), table.c.idx == bindparam("b_idx"))
    keys = [{"b_job": shard.job_id, "b_idx": r.idx} for r in results]
    session.execute(update(table).where(*same_row).values(executions=table.c.executions + 1), keys)
    values = [
        {
            "b_job": shard.job_id,
            "b_idx": r.idx,
            "b_state": (RowState.failed if r.error else RowState.succeeded).value,
            "b_output": r.output,
            "b_finish_reason": r.finish_reason,
            "b_prompt_tokens": r.prompt_tokens,
            "b_completion_tokens": r.completion_tokens,
            "b_error": r.error,
            "b_worker": worker,
            "b_started_at": r.started_at,
            "b_finished_at": t,
        }
        for r in results
    ]
    columns = [k[2:] for k in values[0] if k not in ("b_job", "b_idx")]
    session.execute(
        update(table)
        .where(*same_row, table.c.state == RowState.pending.value)
        .values({c: bindparam(f"b_{c}") for c in columns}),
        values,
    )
    failed = sum(1 for r in results if r.error)
    session.execute(
        update(Shard)
        .where(Shard.id == shard.id)
        .values(
            rows_done=Shard.rows_done + len(results) - failed,
            rows_failed=Shard.rows_failed + failed,
            completion_tokens=Shard.completion_tokens + sum(r.completion_tokens or 0 for r in results),
        )
    )


def finish(session: Session, shard: Shard, worker: str, metrics: dict[str, Any]) -> None:
    mine = [Shard.lease_owner == worker]
    transition(session, shard, ShardState.succeeded, where=mine, lease_owner=None, finished_at=now(), metrics=metrics)


def hand_back(session: Session, shard: Shard, worker: str, reason: str, *, count_attempt: bool = True) -> None:
    """Return a running shard to the queue (shutdown, out-of-memory retry, engine error with attempts left)."""
    values: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "enqueued_at": None}
    if not count_attempt:
        values["attempts"] = Shard.attempts - 1
    transition(session, shard, ShardState.queued, reason=reason, where=[Shard.lease_owner == worker], **values)


def stop_cancelled(session: Session, shard: Shard, worker: str) -> None:
    transition(session, shard, ShardState.cancelled, reason="job cancelled", where=[Shard.lease_owner == worker], lease_owner=None, finished_at=now())
    maybe_finalize(session, shard.job_id)


def job_stopping(session: Session, job_id: str) -> bool:
    return session.scalar(select(Job.state).where(Job.id == job_id)) in STOPPED_JOB_STATES


def mark_enqueued(session: Session, shard_ids: list[int]) -> None:
    session.execute(update(Shard).where(Shard.id.in_(shard_ids)).values(enqueued_at=now()))


def expired_shards(session: Session) -> list[Shard]:
    return list(
        session.scalars(
            select(Shard)
            .where(Shard.state == ShardState.running.value, Shard.lease_expires_at < now())
            .limit(100)
            .with_for_update(skip_locked=True)  # a row locked by a session of a partitioned host: next beat
        ).all()
    )


def requeue_expired(session: Session, shard: Shard) -> bool:
    """Reaper step for one shard whose lease expired. True if this process won and must send the message."""
    try:
        transition(
            session,
            shard,
            ShardState.queued,
            reason=f"lease of {shard.lease_owner} expired (worker lost?)",
            where=[Shard.lease_expires_at == shard.lease_expires_at],
            lease_owner=None,
            enqueued_at=None,
        )
    except IllegalTransition:
        return False
    add_event(session, shard.job_id, f"shard {shard.idx} re-enqueued by the reaper", shard_id=shard.id)
    return True


def queued_shards(session: Session, *, older_than: float, unsent_only: bool = True) -> list[Shard]:
    """Queued shards of jobs created before `older_than`: only those never sent (Redis down at submit, crash
    between commit and send), or all of them (after a Redis restart lost the messages)."""
    stmt = (
        select(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(Shard.state == ShardState.queued.value, Job.created_at < older_than)
        .order_by(Shard.id)
        .limit(10000)
    )
    if unsent_only:
        stmt = stmt.where(Shard.enqueued_at.is_(None))
    return list(session.scalars(stmt).all())


def sent_long_ago(session: Session, *, sent_before: float) -> list[tuple[Shard, str]]:
    """Queued shards (with their queue) whose message was sent before `sent_before` and never claimed."""
    stmt = (
        select(Shard, Job.queue)
        .join(Job, Job.id == Shard.job_id)
        .where(Shard.state == ShardState.queued.value, Shard.enqueued_at < sent_before)
        .order_by(Shard.id)
        .limit(1000)
    )
    return [(shard, queue) for shard, queue in session.execute(stmt).all()]


def mark_resent(session: Session, shard: Shard) -> bool:
    """Reaper step for a shard whose message is gone. True if this process won and must send it again."""
    stmt = (
        update(Shard)
        .where(Shard.id == shard.id, Shard.state == ShardState.queued.value, Shard.enqueued_at == shard.enqueued_at)
        .values(enqueued_at=now())
    )
    if session.execute(stmt).rowcount != 1:
        return False
    add_event(session, shard.job_id, f"shard {shard.idx} sent again: queued since its send, and its queue is empty "
              "(the message was lost in flight)", shard_id=shard.id)
    return True


def stuck_jobs(session: Session) -> list[str]:
    """Running or cancelling jobs with no open shard: finalize them (a finalizer died in between)."""
    live = (ShardState.queued.value, ShardState.running.value)
    open_exists = select(Shard.id).where(Shard.job_id == Job.id, Shard.state.in_(live)).exists()
    stmt = select(Job.id).where(Job.state.in_((JobState.running.value, JobState.cancelling.value)), ~open_exists)
    return list(session.scalars(stmt.limit(100)).all())
