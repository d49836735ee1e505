"""A shard's run under a lease: claim, renew, commit rows, finish, hand back, give up; and the steps of a worker's
run, each in a transaction of its own (the second half of this module, called by worker/runtime.py).

The rules that make "nothing lost, nothing run twice" hold:

- A shard is run only under a lease in SQL (`lease_owner`, `lease_expires_at`), taken by a conditional update
  from `queued` and renewed by the worker's heartbeat. Each claim counts an attempt; a shard that has used its
  attempts fails with that reason instead of looping.
- Rows are written in micro-batches, each in one transaction that first re-checks the lease: a worker that
  lost its lease (paused, partitioned, reaped) cannot write anything. A row result is written only while the
  row is pending (idempotent on (job, row)); `executions` counts every attempt to write it, so a duplicate
  execution is visible, never hidden by a unique key.
- Which queued shard a claim takes is the scheduling rule's choice (core/scheduling.py: priority, then fair share
  between owners, then FIFO; owners' quotas): a message says "a shard is ready on this queue" (the queue of the
  shard it names). A late or redelivered message whose shard is done or leased by a live worker takes the next
  queued shard, or nothing when none is queued.
- A shard that goes back to the queue is sent again through `core.dispatch`, after its transaction committed
  (when Redis cannot take it then, it stays queued and unsent, and the reaper sends it later); a shard that ends finalizes its job when it was the last one (`core.jobs.maybe_finalize`). The reaper
  (`core.dispatch.reap`) re-queues shards whose lease expired.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, func, select, update
from sqlalchemy.orm import Session

from core import adapters, dispatch, scheduling
from core.db import session_scope
from core.errors import IllegalTransition, LeaseLost
from core.jobs import maybe_finalize
from core.models import Job, JobEvent, JobRow, Shard, ShardRun
from core.states import JobState, RowState, ShardState
from core.store import add_event, fail_pending_rows, now, transition

log = logging.getLogger(__name__)

STOPPED_JOB_STATES = scheduling.STOPPED_JOB_STATES


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
    logprobs: list[Any] | None = None  # a list per output with num_return_sequences > 1


def claim(session: Session, shard_id: int, worker: str, lease_seconds: float) -> Claim | None:
    """Take the lease of the shard the scheduling rule picks on the queue of `shard_id` (the message's shard;
    core/scheduling.py), or return None when nothing queued there may run now. A message whose own shard is done,
    or leased by a live worker, takes the next queued shard all the same: another claim used that shard's message."""
    hinted = session.get(Shard, shard_id)
    if hinted is None:
        log.warning("shard %s does not exist (job deleted?): message dropped", shard_id)
        return None
    queue = _tidy(session, hinted, session.get(Job, hinted.job_id))
    for _ in range(MAX_PICKS):
        picked = scheduling.next_shard(session, queue)
        if picked is None:
            log.info("nothing queued on %s may run now (message of shard %s)", queue, shard_id)
            return None
        shard, job = picked
        if shard.attempts >= shard.max_attempts:
            lost = shard.error or "the worker was lost each time"
            give_up(session, shard, f"gave up after {shard.attempts} attempts: {lost}")
            continue
        taken = _take(session, shard, job, worker, lease_seconds)
        if taken is not None:
            return taken
    log.warning(
        "claims on %s lost %d races in a row: message of shard %s left to the reaper", queue, MAX_PICKS, shard_id
    )
    return None


MAX_PICKS = 50  # each lost race means another claim took a shard: the queue empties long before this


def _tidy(session: Session, shard: Shard, job: Job) -> str:
    """What the message's own shard needs whoever runs next: cancelled with its stopping job, or back to the queue
    once its lease expired (unsent, so the reaper sends it if this claim takes another). Returns its queue."""
    if ShardState(shard.state).terminal:
        log.info("%s shard %s is already %s: late message takes the next queued shard", job.id, shard.idx, shard.state)
    elif job.state in STOPPED_JOB_STATES:
        _stop(session, shard, job)
    elif shard.state == ShardState.running.value and shard.lease_expires_at and shard.lease_expires_at > now():
        log.info(
            "%s shard %s is leased by %s: duplicate message takes the next queued shard, if any",
            job.id,
            shard.idx,
            shard.lease_owner,
        )
    elif shard.state == ShardState.running.value:
        # the reaper's step, its message left unsent; False when the reaper or another message re-queued it first
        dispatch.requeue_expired(session, shard, by="a claim")
    return job.queue


def _take(session: Session, shard: Shard, job: Job, worker: str, lease_seconds: float) -> Claim | None:
    """The conditional update queued → running under this worker's lease (and its owner's quota); None when
    another claim took the shard first or the owner reached its quota meanwhile."""
    guard = scheduling.quota_guard(session, job.owner)  # on Postgres it waits for the owner's quota row first
    t = now()  # after that wait: time spent waiting for a lock does not shorten the lease
    try:
        shard = transition(
            session,
            shard,
            ShardState.running,
            reason=f"claimed by {worker} (attempt {shard.attempts + 1} of {shard.max_attempts})",
            where=guard,
            lease_owner=worker,
            lease_expires_at=t + lease_seconds,
            attempts=Shard.attempts + 1,
            started_at=t,
        )
    except IllegalTransition:
        log.info("%s shard %s was taken by another claim: picking again", job.id, shard.idx)
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
            "b_logprobs": r.logprobs,
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
    metrics = {**metrics, **_earlier_attempts(session, shard, metrics)}
    transition(session, shard, ShardState.succeeded, where=mine, lease_owner=None, finished_at=now(), metrics=metrics)


def _earlier_attempts(session: Session, shard: Shard, metrics: dict[str, Any]) -> dict[str, Any]:
    """This run's attempts of `shard` that ended before the one finishing (yielded, handed back, lost): how many,
    their seconds, and the shard's `gpu_seconds` with theirs added, so a job's GPU-seconds count every attempt.
    Nothing when there were none."""
    started, gpus = session.execute(select(Job.started_at, Job.gpus).where(Job.id == shard.job_id)).one()
    count, seconds = session.execute(
        select(func.count(), func.coalesce(func.sum(ShardRun.ended_at - ShardRun.started_at), 0.0)).where(
            ShardRun.shard_id == shard.id, ShardRun.started_at >= (started or 0.0)
        )
    ).one()
    if not count:
        return {}
    return {
        "earlier_attempts": count,
        "earlier_seconds": round(float(seconds), 3),
        "gpu_seconds": round(metrics.get("gpu_seconds", 0.0) + float(seconds) * max(gpus, 0), 3),
    }


def hand_back(session: Session, shard: Shard, worker: str, reason: str, *, count_attempt: bool = True) -> None:
    """Return a running shard to the queue (shutdown, out-of-memory retry, engine error with attempts left)."""
    values: dict[str, Any] = {"lease_owner": None, "lease_expires_at": None, "enqueued_at": None}
    if not count_attempt:
        values["attempts"] = Shard.attempts - 1
    transition(session, shard, ShardState.queued, reason=reason, where=[Shard.lease_owner == worker], **values)


def stop_cancelled(session: Session, shard: Shard, worker: str) -> None:
    transition(
        session,
        shard,
        ShardState.cancelled,
        reason="job cancelled",
        where=[Shard.lease_owner == worker],
        lease_owner=None,
        finished_at=now(),
    )
    maybe_finalize(session, shard.job_id)


def job_stopping(session: Session, job_id: str) -> bool:
    return session.scalar(select(Job.state).where(Job.id == job_id)) in STOPPED_JOB_STATES


# --- a worker's run, step by step (worker/runtime.py, worker/hubfetch.py) ------------------------------------------
#
# Each step is one transaction; a shard that goes back to the queue is sent again after it committed.

LEASE_LOST, JOB_STOPPING = "lease lost", "job stopping"  # why `watch` says a run must stop


def take(shard_id: int, worker: str, lease_seconds: float) -> Claim | None:
    """`claim` in a transaction of its own: the shard, its job and its pending rows (detached), or None."""
    with session_scope() as session:
        return claim(session, shard_id, worker, lease_seconds)


def watch(shard_id: int, job_id: str, worker: str, *, renew_for: float | None) -> str | None:
    """The heartbeat's look at the shard a worker runs: renew its lease (for `renew_for` seconds, when given), and
    say why the run must stop: LEASE_LOST (someone else owns the shard now), JOB_STOPPING, or None."""
    with session_scope() as session:
        lost = renew_for is not None and not renew(session, shard_id, worker, renew_for)
        stopping = job_stopping(session, job_id)
    return LEASE_LOST if lost else JOB_STOPPING if stopping else None


def record(shard: Shard, worker: str, results: list[RowResult], lease_seconds: float) -> bool:
    """Commit one micro-batch of the claimed `shard` (its id and job are read from it: no query per batch); False,
    and nothing written, once its job is stopping. Raises LeaseLost when the lease is no longer this worker's."""
    with session_scope() as session:
        if job_stopping(session, shard.job_id):
            return False
        commit_rows(session, shard, worker, results, lease_seconds)
    return True


def end_early(shard_id: int, worker: str, *, hand_back: str | None = None) -> bool:
    """Where a run may end before its shard is done. True when it ended here: the shard is cancelled (its job is
    stopping), or, given `hand_back` (why: the worker is stopping, or lost its lease), handed back without counting
    the attempt and sent again. False: the run goes on to finish the shard."""
    with session_scope() as session:
        ended, resend = _end_early(session, session.get(Shard, shard_id), worker, hand_back)
    if resend:
        dispatch.send_again(shard_id)
    return ended


def hand_over(job_id: str, worker: str, reason: str) -> None:
    """`end_early` of the shard this worker holds for `job_id`, if any (a shutdown during a model's download)."""
    with session_scope() as session:
        shard = session.scalar(
            select(Shard).where(
                Shard.job_id == job_id, Shard.lease_owner == worker, Shard.state == ShardState.running.value
            )
        )
        _, resend = _end_early(session, shard, worker, reason) if shard is not None else (False, False)
    if resend:
        dispatch.send_again(shard.id)


def _end_early(session: Session, shard: Shard, worker: str, hand_back_reason: str | None) -> tuple[bool, bool]:
    """(ended, send it again)."""
    if job_stopping(session, shard.job_id):
        stop_cancelled(session, shard, worker)
        return True, False
    if hand_back_reason is None:
        return False, False
    hand_back(session, shard, worker, hand_back_reason, count_attempt=False)
    return True, True


def yield_reason(shard_id: int, after: float) -> str | None:
    """Why the running shard should yield to waiting work now (core.scheduling.yield_reason), or None."""
    with session_scope() as session:
        return scheduling.yield_reason(session, shard_id, after)


def yield_shard(shard_id: int, worker: str, *, reason: str, requested_at: float, at: str) -> None:
    """The shard yields on this worker: back to the queue without counting the attempt, `yielded_at` set, a `yield`
    event (why, when it was asked, where the run stopped: `at`), and sent again. What it committed stays (rows,
    counts, checkpoints); the next attempt runs only what is left. Cancelled instead when its job is stopping."""
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        if job_stopping(session, shard.job_id):
            stop_cancelled(session, shard, worker)
            return
        hand_back(session, shard, worker, f"yielded: {reason}", count_attempt=False)
        session.execute(update(Shard).where(Shard.id == shard_id).values(yielded_at=now()))
        add_event(
            session,
            shard.job_id,
            f"shard {shard.idx} yielded on {worker} {at}: {reason}; it goes back to the queue and goes on from there",
            kind="yield",
            shard_id=shard_id,
            data={"worker": worker, "reason": reason, "requested_at": requested_at, "at": at},
        )
    dispatch.send_again(shard_id)


def complete(shard_id: int, worker: str, metrics: dict[str, Any]) -> None:
    """The shard succeeded on this worker (`finish`), with its metrics."""
    with session_scope() as session:
        finish(session, session.get(Shard, shard_id), worker, metrics)


def complete_training(
    shard_id: int,
    worker: str,
    *,
    rows: list[int],
    folder: Path,
    lora_config: dict[str, Any],
    load_options: dict[str, Any],
    metrics: dict[str, Any],
    lease_seconds: float,
) -> None:
    """A fine-tune's shard succeeded, in one transaction: its `rows` done (under the lease), the adapter at `folder`
    registered (its id is the job's), the training metrics on the job, the shard finished."""
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        commit_rows(session, shard, worker, [RowResult(idx=i) for i in rows], lease_seconds)
        job = session.get(Job, shard.job_id)
        adapters.register(session, job, folder, lora_config=lora_config, load_options=load_options, metrics=metrics)
        job.metrics = {**(job.metrics or {}), "training": metrics}
        finish(session, shard, worker, metrics)


def error_line(error: str) -> str:
    """The line of a traceback that names its exception (`RuntimeError: CUDA error: …`), for events and the job's
    error. Not the traceback's last line: a message of several lines ends in advice (CUDA's `Compile with
    TORCH_USE_CUDA_DSA …`, pydantic's `For further information visit …`) that says nothing of what failed."""
    lines = error.strip().splitlines()
    if not lines:
        return ""
    start = max((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), default=-1)
    return next((line for line in lines[start + 1 :] if line and not line[0].isspace()), lines[-1])


def fail_attempt(shard_id: int, worker: str, error: str) -> None:
    """This worker's attempt failed with `error` (a traceback): an error event with it, then the shard goes back to
    the queue and is sent again, or fails once its attempts are used up. Nothing when another process owns it."""
    last_line = error_line(error)
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        add_event(
            session,
            shard.job_id,
            f"shard {shard.idx} failed on {worker} (attempt {shard.attempts} of {shard.max_attempts}): {last_line}",
            level="error",
            data={"traceback": error},
            shard_id=shard.id,
        )
        try:
            if shard.attempts >= shard.max_attempts:
                give_up(session, shard, f"failed {shard.attempts} times; last error: {last_line}")
                return
            hand_back(session, shard, worker, "engine error; retrying")
        except IllegalTransition:
            return
    dispatch.send_again(shard_id)


def fail_final(shard_id: int, worker: str, cause: str, error: str) -> None:
    """This worker's attempt failed with an error that fails the same way on every attempt (worker/failures.py:
    a kernel that does not compile here, a bad parameter): an error event with the traceback `error`, then the
    shard fails at once, its unfinished rows and its job naming `cause` (one line). Nothing when another process
    owns it now."""
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        add_event(
            session,
            shard.job_id,
            f"shard {shard.idx} failed on {worker} (attempt {shard.attempts} of "
            f"{shard.max_attempts}), not retried: it would fail the same way again: {cause}",
            level="error",
            data={"traceback": error, "cause": cause},
            shard_id=shard.id,
        )
        try:
            give_up(
                session,
                shard,
                f"{cause} (not retried: it fails the same way on every attempt; the traceback: "
                f"gpujobs events {shard.job_id} --json)",
            )
        except IllegalTransition:
            pass


def fail(shard_id: int, reason: str) -> None:
    """The shard cannot run at all (a spec the workers refuse, an adapter the registry refused): it fails with its
    unfinished rows and `reason`, on any attempt. Nothing when another process owns it now."""
    with session_scope() as session:
        try:
            give_up(session, session.get(Shard, shard_id), reason)
        except IllegalTransition:
            pass


def give_back_stalled(
    shard_id: int, worker: str, *, stall: str, stuck_in: str, exit_code: int, data: dict[str, Any]
) -> int:
    """The stall watchdog's hand-back (worker/runtime.py). First the `stall` event (level error, its own transaction,
    so it stays even when the lease is no longer ours): `stall` (what stalled, for how long, the bound), where the
    engine thread is stuck, what becomes of the shard and the worker's `exit_code`, with `data` (the engine
    thread's stack, ...). Then the shard: cancelled with its stopping job, failed once it used its last attempt
    (the stall counts as one), else back to the queue and sent again. Returns the shard's index in its job."""
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        if job_stopping(session, shard.job_id):
            outcome = "the job is stopping: the shard is cancelled"
        elif shard.attempts >= shard.max_attempts:
            outcome = "the shard fails: it used its last attempt"
        else:
            outcome = f"the shard goes back to the queue (attempt {shard.attempts} of {shard.max_attempts} used)"
        add_event(
            session,
            shard.job_id,
            f"shard {shard.idx} stalled on {worker}: {stall}, stuck in {stuck_in}; "
            f"{outcome}; the worker exits with code {exit_code} (the engine thread's stack: gpujobs events "
            "--json)",
            kind="stall",
            level="error",
            shard_id=shard_id,
            data={
                "worker": worker,
                **data,
                "attempt": shard.attempts,
                "max_attempts": shard.max_attempts,
                "exit_code": exit_code,
            },
        )
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        idx = shard.idx
        if job_stopping(session, shard.job_id):
            stop_cancelled(session, shard, worker)
            return idx
        if shard.attempts >= shard.max_attempts:
            give_up(session, shard, f"stalled on attempt {shard.attempts} of {shard.max_attempts} ({worker}): {stall}")
            return idx
        hand_back(session, shard, worker, f"stalled on {worker}: {stall}")
    dispatch.send_again(shard_id)
    return idx


BROKEN_EVENT = "worker_broken"  # the kind of give_back_broken's event


def give_back_broken(shard_id: int, worker: str, *, cause: str, error: str, exit_code: int) -> int:
    """The hand-back of a worker whose process can no longer import its engine or training code (worker/runtime.py,
    worker/preload.py): the worker's fault, not the job's, so the attempt is not counted, and the shard goes back
    to the queue and is sent again (cancelled with its stopping job). First a `worker_broken` event (level error:
    `cause` in one line, the traceback `error` in its data, the worker's `exit_code`).

    The attempt is free only the first `max_attempts` times in the job's run: a cause that followed the shard from
    worker to worker would otherwise send it round for ever (and take each worker down on the way). From then on it
    counts, and the shard fails once its attempts are used. Nothing changes when another process owns the shard
    now. Returns the shard's index in its job."""
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        run = (session.scalar(select(Job.retries).where(Job.id == shard.job_id)) or 0) + 1
        earlier = session.scalar(
            select(func.count()).where(
                JobEvent.shard_id == shard_id, JobEvent.kind == BROKEN_EVENT, JobEvent.run == run
            )
        )
        free = earlier < shard.max_attempts
        used = shard.attempts - 1 if free else shard.attempts
        if job_stopping(session, shard.job_id):
            outcome = "the job is stopping: the shard is cancelled"
        elif used >= shard.max_attempts:
            outcome = f"the shard fails: it used its last attempt (broken workers count after {earlier})"
        else:
            counted = "not counted" if free else f"counted: broken workers count after {earlier}"
            outcome = f"the shard goes back to the queue, the attempt {counted} ({used} of {shard.max_attempts} used)"
        add_event(
            session,
            shard.job_id,
            f"shard {shard.idx} failed on {worker}, whose process can no longer import its code: {cause}; "
            f"{outcome}; the worker exits with code {exit_code} and a fresh process takes its place",
            kind=BROKEN_EVENT,
            level="error",
            shard_id=shard_id,
            data={"worker": worker, "cause": cause, "traceback": error, "counted": not free, "exit_code": exit_code},
        )
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        idx = shard.idx
        try:
            if job_stopping(session, shard.job_id):
                stop_cancelled(session, shard, worker)
                return idx
            if used >= shard.max_attempts:
                give_up(session, shard, f"failed on attempt {used} of {shard.max_attempts} ({worker}): {cause}")
                return idx
            hand_back(session, shard, worker, f"{worker} cannot import its code: {cause}", count_attempt=not free)
        except IllegalTransition:
            return idx
    dispatch.resend(shard_id)
    return idx
