"""A job's life, from submit to its end: create, validate, open shards, start, fail, retry, cancel, release a
waiting chained job, finalize, and the reaper's pass.

Every state change goes through `core.store.transition`; this module owns the *sequences* of changes, so each is
written once. Work is sent through `core.dispatch`, always after the transaction that queued it has committed.
The API checks a submission and hands it here in one call (`submit(NewJob)`); the worker runs shards under
leases (`core.leases`), which end here (`maybe_finalize`, `release_waiting`).

    queued ──▶ validating ──▶ running ──▶ finalizing ──▶ succeeded | failed
    (rows      (rows checked)   (shards cut     (every shard
    stored)                      and sent)       ended)
    any live state ──▶ cancelling ──▶ cancelled;   a finished job ──retry──▶ queued (same id)

A chained generation job waits in `queued`, with its rows and no shards, until its fine-tune ends.

Functions that take a session leave the transaction to their caller; the others (`submit`, `retry`, `cancel`,
`release_waiting`, `finalize`, `reap`, and the worker's records) open their own and send after it committed.

One concern, a job's life, in one module (a little over 600 lines): its sequences of state changes call each other
(a submit starts or fails a job, a release of a chained job starts it, a cancel and the reaper end jobs through
`maybe_finalize`) and read best side by side; the data access under them is core/store.py, a shard's run
core/leases.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import adapters, dispatch, files, scheduling
from core.dataset import nothing_runs, parse_dataset, retry_can_change
from core.db import session_scope
from core.errors import (
    CANNOT_TRAIN,
    BatchExpired,
    IllegalTransition,
    InvalidInput,
    JobsError,
    NotFinished,
    NothingToRetry,
)
from core.models import Adapter, File, Job, JobEvent, JobRow, Shard
from core.preflight import InputCheck
from core.queue import queue_for
from core.settings import get_settings
from core.spec import GenerateSpec, Spec
from core.states import JobState, RowState, ShardState
from core.store import add_event, create_shards, get_job, insert_rows, new_id, now, open_shards, progress, transition
from core.text import counted
from core.training_data import parse_training_file, split_problem

log = logging.getLogger(__name__)
BATCH_EXPIRED_BY = "the batch's completion window (24h)"  # the cancel reason that makes an OpenAI batch `expired`


@dataclass
class NewJob:
    """A submission that passed the API's checks (api/checks.py): what `submit` stores.

    `spec` is resolved (a model's real directory or pinned commit, `input_format` detected). `inputs` are the
    datasets to store, each a file id or an allowed server path with the format it is read as: a generation job's
    input, or a fine-tune's training data and then its validation data."""

    owner: str
    spec: Spec
    gpus: int
    inputs: list[tuple[str, str]]
    metrics: dict[str, Any] = field(default_factory=dict)  # what the checks found (a Hub model's commit, ...)
    notes: list[str] = field(default_factory=list)  # events to write with the job
    model_dir: Path | None = None  # generation: where a local tokenizer checks rows' lengths
    waits: bool = False  # generation: its adapter's fine-tune is still live, so it waits (queued, no shards)
    then_generate: dict[str, Any] | None = None  # a fine-tune's chained generation spec (its adapter filled in here)


# --- submit -------------------------------------------------------------------------------------------------


def submit(new: NewJob, *, chain: Callable[[dict[str, Any]], str] | None = None) -> str:
    """Store the job, its inputs and rows (bad rows as failed rows), validate, open its shards and start it, in one
    transaction; then send its shards. Returns the job id. A check that fails while rows are read (too many rows,
    an unreadable dataset) leaves nothing behind.

    A fine-tune's `then_generate` is submitted through `chain` (the API's submit of a spec: checks included) after
    the fine-tune is stored and before its shard is sent; if that is refused, the fine-tune fails with the reason
    and the error is raised."""
    with session_scope() as session:
        opened = _open_finetune(session, new) if new.spec.kind == "finetune" else _open_generation(session, new)
        job_id, queue, shard_ids = opened.id, opened.queue, opened.shard_ids
    if new.then_generate is not None:
        if chain is None:
            raise TypeError("a fine-tune with then_generate needs `chain` to submit the chained job")
        _chain(job_id, {**new.then_generate, "adapter": job_id}, chain)
    dispatch.send(shard_ids, queue)
    return job_id


@dataclass
class _Opened:
    id: str
    queue: str
    shard_ids: list[int]


def _create(session: Session, new: NewJob, file: File, **values: Any) -> Job:
    job = Job(
        id=new_id("job"),
        kind=new.spec.kind,
        state=JobState.queued.value,
        owner=new.owner,
        spec=new.spec.model_dump(mode="json"),
        input_file_id=file.id,
        queue=queue_for(new.gpus),
        gpus=new.gpus,
        created_at=now(),
        rows_succeeded=0,
        rows_failed=0,
        prompt_tokens=0,
        completion_tokens=0,
        retries=0,
        priority=scheduling.rank(new.spec.priority),
        **values,
    )
    session.add(job)
    session.flush()
    return job


def _open_generation(session: Session, new: NewJob) -> _Opened:
    """Create a generation job from its stored input: every row checked (token checks where the API can read the
    tokenizer), then validating, then its shards and running. It stops at `queued` while it waits for a fine-tune.
    A dataset whose every row is invalid (malformed, without a prompt, too long for the model) is refused with
    InvalidInput and nothing is stored: a failed job would only tell a script later what submit can tell now."""
    (
        spec,
        (ref, _),
    ) = new.spec, *new.inputs
    file = files.stored(session, ref, owner=new.owner)
    job = _create(session, new, file, rows_total=0)
    checked = InputCheck(spec, model_dir=new.model_dir)
    rows = checked.rows(parse_dataset(files.absolute(file), spec.input_format, spec=spec, columns=spec.input_columns))
    total, failed, first_error = insert_rows(session, job.id, rows)
    if failed == total:  # nothing could run: refused, and the transaction (job, rows, a copied input) rolls back
        param = checked.first_failed.param if checked.first_failed else None
        raise nothing_runs(total, first_error, checked.extra_keys, spec.input_format, param=param)
    job.rows_total = total
    job.metrics = {"input": checked.summary(), **new.metrics}
    add_event(session, job.id, f"submitted by {new.owner}: {total} rows, {failed} invalid, queue {job.queue}")
    for note in new.notes:
        add_event(session, job.id, note)
    if new.waits:  # queued, no shards: released when the fine-tune ends
        add_event(session, job.id, f"waiting for fine-tune {spec.adapter} to register its adapter")
        return _Opened(job.id, job.queue, [])
    transition(session, job, JobState.validating, reason="structural checks done")
    add_event(session, job.id, checked.token_note())
    shard_ids = start(session, job, shard_rows=spec.shard_rows or get_settings().shard_rows)
    return _Opened(job.id, job.queue, shard_ids)


def _open_finetune(session: Session, new: NewJob) -> _Opened:
    """Create a fine-tune: its training rows (then its validation rows, marked `split: validation`), each checked
    (one bad row refuses the job), then validating, then its one shard over every row, and running."""
    spec, settings = new.spec, get_settings()
    limits = dict(
        max_rows=settings.max_rows,
        max_row_bytes=settings.max_row_bytes,
        input_format=spec.input_format,
        columns=spec.input_columns,
    )
    (train_ref, fmt), *validation = new.inputs
    train = files.stored(session, train_ref, owner=new.owner)
    rows = parse_training_file(files.absolute(train), fmt, **limits)
    if problem := split_problem(len(rows), spec.validation_split):  # the worker would refuse it, model loaded
        raise InvalidInput(f"invalid finetune spec: {problem}")
    read_as = {"format": fmt}
    for valid_ref, valid_fmt in validation:
        valid = files.stored(session, valid_ref, owner=new.owner)
        rows += parse_training_file(
            files.absolute(valid),
            valid_fmt,
            split="validation",
            start_idx=len(rows),
            what="validation dataset",
            **limits,
        )
        read_as["validation_format"] = valid_fmt
    job = _create(session, new, train, rows_total=len(rows), metrics={"input": read_as, **new.metrics})
    session.execute(
        JobRow.__table__.insert(),
        [
            {
                "job_id": job.id,
                "idx": r.idx,
                "line": r.line,
                "input": r.input,
                "state": RowState.pending.value,
                "custom_id": ("validation-" if r.input.get("split") else "") + f"{r.where}-{r.line}",
                "executions": 0,
            }
            for r in rows
        ],
    )
    n_valid = sum(1 for r in rows if r.input.get("split"))
    add_event(
        session,
        job.id,
        f"submitted by {new.owner}: fine-tune on {len(rows) - n_valid} training rows"
        f" ({read_as['format']})"
        + (f" and {n_valid} validation rows ({read_as['validation_format']})" if n_valid else "")
        + f", queue {job.queue}",
    )
    for note in new.notes:
        add_event(session, job.id, note)
    transition(session, job, JobState.validating, reason="structural checks done")
    # One shard over every row: the fine-tune is leased, renewed and reaped like any shard.
    shard_ids = start(session, job, shard_rows=max(len(rows), 1), reason="1 training shard queued")
    return _Opened(job.id, job.queue, shard_ids)


def start(session: Session, job: Job, *, shard_rows: int, reason: str | None = None) -> list[int]:
    """Cut a validating job into shards of up to `shard_rows` rows and move it to running. Returns the shard ids to send
    once the transaction has committed."""
    shards = create_shards(session, job, shard_rows=shard_rows, max_attempts=get_settings().max_attempts)
    transition(
        session,
        job,
        JobState.running,
        reason=reason or f"{counted(len(shards), 'shard')} of up to {shard_rows} rows queued",
    )
    return [s.id for s in shards]


def _chain(job_id: str, spec_data: dict[str, Any], chain: Callable[[dict[str, Any]], str]) -> None:
    """Submit a fine-tune's chained generation job; if that is refused, the fine-tune fails with the reason (its
    shard is cancelled before it was ever sent) and the refusal is raised."""
    try:
        chained = chain(spec_data)
    except JobsError as exc:
        with session_scope() as session:
            job = get_job(session, job_id)
            fail(session, job, f"then_generate was refused: {exc}")
            for shard in session.scalars(select(Shard).where(Shard.job_id == job_id)).all():
                transition(session, shard, ShardState.cancelled, reason="the chained job was refused")
        raise
    with session_scope() as session:
        job = get_job(session, job_id)
        job.metrics = {**(job.metrics or {}), "then_generate_job": chained}
        add_event(session, job_id, f"generation job {chained} will run with this adapter once it is ready")


def fail(session: Session, job: Job, error: str, **values: Any) -> None:
    """The job ends failed with `error` (its reason and its error)."""
    transition(session, job, JobState.failed, reason=error, error=error, finished_at=now(), **values)


# --- retry and cancel -----------------------------------------------------------------------------------------


def retry(job_id: str, *, owner: str | None, failed_only: bool, by: str) -> None:
    """Re-open a finished job under the same id and re-run its failed (and, unless failed_only, unfinished) rows.

    Failed rows whose failure cannot change are kept failed (`core.dataset.retry_can_change`: refused at submit,
    or refused by the worker for their own input); when that leaves nothing to run, the error says how many, or,
    for a fine-tune the worker refused for its spec and input, why and to submit a new one.
    """
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        if not JobState(job.state).terminal:
            raise NotFinished(
                f"job {job_id} is {job.state}: retry a job once it has finished (`gpujobs wait "
                f"{job_id}`), or cancel it first (`gpujobs cancel {job_id}`)"
            )
        if (deadline := batch_deadline(job)) is not None and now() > deadline:
            raise BatchExpired(
                f"batch {job_id}'s completion window ended at "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(deadline))}, and a batch never runs past it: "
                f"create a new batch from its input file {job.input_file_id} (the finished rows of this one are kept)"
            )
        states = [RowState.failed.value] + ([] if failed_only else [RowState.pending.value])
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job_id, JobRow.state.in_(states))).all()
        spec = _generate_spec(job)
        rerun = [r for r in rows if r.state == RowState.pending.value or retry_can_change(r, spec)]
        if not rerun and job.kind == "finetune" and rows:
            raise NothingToRetry(_cannot_train_again(job_id, rows[0].error or ""))
        if not rerun:
            left = 0
            if failed_only:  # rows a cancel left: the plain retry runs them
                left = session.scalar(
                    select(func.count()).where(JobRow.job_id == job_id, JobRow.state == RowState.pending.value)
                )
            raise NothingToRetry(_nothing_to_retry(job_id, len(rows), failed_only) + _unfinished(job_id, left or 0))
        for row in rerun:
            row.state, row.error, row.output, row.finish_reason = RowState.pending.value, None, None, None
            row.logprobs = None
        # a new run: the one that ended goes into metrics.runs, and the new one's clock starts at its first claim,
        # so its duration and rates leave out the idle time between the end and the retry
        transition(
            session,
            job,
            JobState.queued,
            reason=f"retry of {counted(len(rerun), 'row')} requested by {by}",
            retries=Job.retries + 1,
            error=None,
            finished_at=None,
            started_at=None,
            metrics=close_run(job),
        )
        transition(session, job, JobState.validating, reason="rows reset")
        shard_ids = _reopen_shards(session, job, {r.idx for r in rerun})
        transition(session, job, JobState.running, reason=f"{counted(len(shard_ids), 'shard')} re-queued")
        queue = job.queue
    dispatch.send(shard_ids, queue)


def _generate_spec(job: Job) -> GenerateSpec | None:
    """A generation job's stored spec, for the row checks of a retry (None: a fine-tune, or a spec stored by an
    older version that no longer validates; its rows are then judged without it)."""
    if job.kind != "generate":
        return None
    try:
        return GenerateSpec.model_validate(job.spec)
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None


def _nothing_to_retry(job_id: str, kept: int, failed_only: bool) -> str:
    if not kept:
        return f"job {job_id} has no rows to retry" + (" (--failed-only)" if failed_only else "")
    rows = "1 failed row was" if kept == 1 else f"{kept} failed rows were"
    return (
        f"job {job_id}: {rows} refused for their input (at submit, or by the worker) and cannot be retried; fix "
        f"the input (`gpujobs results {job_id} --errors` names each row's line and problem) and submit it again"
    )


def _unfinished(job_id: str, left: int) -> str:
    """What `retry --failed-only` leaves of a cancelled job, and how to run it ('' when nothing)."""
    if not left:
        return ""
    return (
        f"; its {counted(left, 'row')} a cancel left unfinished "
        f"{'runs' if left == 1 else 'run'} with `gpujobs retry {job_id}` (without --failed-only)"
    )


def _cannot_train_again(job_id: str, error: str) -> str:
    """Why a fine-tune the worker refused for its spec and input (`core.errors.CannotTrain`) is not retried: a retry
    runs the same spec on the same rows, so it would load the model only to be refused the same way."""
    return (
        f"fine-tune {job_id} cannot be retried: the worker refused its spec and input before training "
        f"({error.removeprefix(CANNOT_TRAIN + ': ')}), and a retry runs the same spec on the same rows, so it would "
        "be refused the same way. Submit a new fine-tune with the change the error names (`gpujobs status "
        f"{job_id} --json` shows this one's spec)"
    )


RUN_METRICS = (
    "duration_s",
    "output_tok_s",
    "rows_per_s",
    "time_to_first_result_s",
)  # a run's own; the rest are the job's


def close_run(job: Job) -> dict[str, Any]:
    """The job's metrics for a new run: the ended run's own numbers (RUN_METRICS) move into `metrics.runs`, with
    its state, times, error and row counts; what belongs to the job (its input, model, GPU-seconds) stays."""
    metrics = dict(job.metrics or {})
    ended = {
        "run": (job.retries or 0) + 1,
        "state": job.state,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "error": job.error,
        "rows_succeeded": job.rows_succeeded,
        "rows_failed": job.rows_failed,
        **{k: metrics.pop(k) for k in RUN_METRICS if k in metrics},
    }
    metrics["runs"] = [*metrics.get("runs", []), ended]
    return metrics


def supersede_steps(job_id: str, *, after_step: int) -> int:
    """A fine-tune resumes from its checkpoint at `after_step` (0: from the start): the current run's step events
    after it are marked superseded, since those steps run again; the current view then shows each step once.
    Returns how many were marked."""
    with session_scope() as session:
        run = session.scalar(select(Job.retries).where(Job.id == job_id)) + 1
        events = session.scalars(
            select(JobEvent).where(
                JobEvent.job_id == job_id,
                JobEvent.run == run,
                JobEvent.kind == "metric",
                JobEvent.superseded.is_(False),
            )
        )
        marked = [e for e in events.all() if (e.data or {}).get("step", 0) > after_step]
        for event in marked:
            event.superseded = True
        if marked:
            add_event(
                session,
                job_id,
                f"training resumes after step {after_step}: {len(marked)} step events of the "
                "interrupted attempt are superseded (`gpujobs events --all-runs` shows them)",
            )
        return len(marked)


def _reopen_shards(session: Session, job: Job, idxs: set[int]) -> list[int]:
    shard_ids = []
    for shard in session.scalars(select(Shard).where(Shard.job_id == job.id)).all():
        if any(shard.row_start <= i < shard.row_end for i in idxs):
            transition(
                session,
                shard,
                ShardState.queued,
                reason="retry",
                attempts=0,
                error=None,
                enqueued_at=None,
                lease_owner=None,
                lease_expires_at=None,
            )
            shard_ids.append(shard.id)
    return shard_ids


def cancel(job_id: str, *, owner: str | None, by: str) -> None:
    """Cancel a live job of `owner` (None: any owner's); see `cancel_job`."""
    with session_scope() as session:
        cancel_job(session, get_job(session, job_id, owner=owner), by=by)


def cancel_job(session: Session, job: Job, *, by: str) -> None:
    """Move a live job to cancelling, cancel its shards no worker has claimed, and finalize it if nothing runs.

    A running shard's worker sees the job stopping within a heartbeat and stops between decode steps."""
    if JobState(job.state).terminal:
        raise IllegalTransition(f"job {job.id} is already {job.state}: nothing to cancel")
    if job.state != JobState.cancelling.value:
        transition(session, job, JobState.cancelling, reason=f"cancel requested by {by}")
    queued = session.scalars(select(Shard).where(Shard.job_id == job.id, Shard.state == ShardState.queued.value))
    for shard in queued.all():
        try:
            transition(session, shard, ShardState.cancelled, reason="job cancelled before it ran")
        except IllegalTransition:
            pass  # a worker claimed it just now; it will see the job is cancelling and stop
    maybe_finalize(session, job.id)


def batch_deadline(job: Job) -> float | None:
    """When an OpenAI batch (a generation job whose input is batch lines) must have ended: `created_at` plus the
    completion window, for every run (a retry neither moves it nor may run past it); None for another job."""
    if job.kind != "generate" or (job.spec or {}).get("input_format") != "openai":
        return None
    return job.created_at + get_settings().batch_window_seconds


def expire_batches(session: Session, window_seconds: float) -> list[str]:
    """Cancel OpenAI batches (jobs whose input is batch lines) still live past their completion window; their
    finished rows are kept. Run by every worker's reaper, so a batch nobody reads expires too."""
    terminal = [s.value for s in JobState if s.terminal] + [JobState.cancelling.value]
    live = session.scalars(
        select(Job).where(Job.kind == "generate", Job.state.not_in(terminal), Job.created_at < now() - window_seconds)
    ).all()
    expired = []
    for job in live:
        if job.spec.get("input_format") == "openai":
            try:
                cancel_job(session, job, by=BATCH_EXPIRED_BY)
                expired.append(job.id)
            except IllegalTransition:
                pass  # it ended meanwhile
    return expired


# --- chained jobs waiting for a fine-tune -----------------------------------------------------------------------


def release_waiting(finetune_id: str | None = None) -> None:
    """Queued generation jobs waiting for a fine-tune that has ended (`finetune_id`, or any): shard and send them
    (it succeeded and registered its adapter) or fail them with its outcome. Called by the worker that finished
    the fine-tune, and by every reaper as a safety net. Each job moves by conditional transitions, so two
    processes releasing at once never both shard one job."""
    with session_scope() as session:
        jobs = session.scalars(select(Job).where(Job.kind == "generate", Job.state == JobState.queued.value)).all()
        to_send = []
        for job in jobs:
            ref = (job.spec or {}).get("adapter")
            if (
                not ref
                or adapters.is_file_ref(ref)
                or (finetune_id and ref != finetune_id)
                or _has_shards(session, job.id)
            ):
                continue
            parent = session.get(Job, ref)
            if parent is not None and not JobState(parent.state).terminal:
                continue
            to_send += _release(session, job, parent)
    for shard_ids, queue in to_send:
        dispatch.send(shard_ids, queue)


def _has_shards(session: Session, job_id: str) -> bool:
    return session.scalar(select(Shard.id).where(Shard.job_id == job_id).limit(1)) is not None


def _release(session: Session, job: Job, parent: Job | None) -> list[tuple[list[int], str]]:
    ok = parent is not None and parent.state == JobState.succeeded.value and session.get(Adapter, parent.id)
    try:
        if not ok:
            outcome = f"{parent.state}" + (f": {parent.error}" if parent.error else "") if parent else "deleted"
            fail(session, job, f"fine-tune {job.spec.get('adapter')} ended {outcome}; this job needed its adapter")
            return []
        transition(session, job, JobState.validating, reason=f"adapter {parent.id} is ready")
    except IllegalTransition:
        return []  # another process released it, or it was cancelled meanwhile
    shard_ids = start(session, job, shard_rows=job.spec.get("shard_rows") or get_settings().shard_rows)
    return [(shard_ids, job.queue)]


# --- the end of a job -----------------------------------------------------------------------------------------


def finalize(job_id: str) -> bool:
    """`maybe_finalize` in a transaction of its own (a worker, after its shard ended)."""
    with session_scope() as session:
        return maybe_finalize(session, job_id)


def maybe_finalize(session: Session, job_id: str) -> bool:
    """Finish the job if no shard is open. Safe to call from many processes: one conditional update wins."""
    job = session.get(Job, job_id)
    if job is None or open_shards(session, job_id):
        return False
    if job.state == JobState.cancelling.value:
        transition(
            session, job, JobState.cancelled, reason="every shard stopped", finished_at=now(), **_totals(session, job)
        )
        return True
    if job.state != JobState.running.value:
        return False
    try:
        transition(session, job, JobState.finalizing, reason="every shard is done")
    except IllegalTransition:
        return False  # another process is finalizing it
    totals = _totals(session, job)
    failed_shards = session.scalars(
        select(Shard).where(Shard.job_id == job_id, Shard.state == ShardState.failed.value)
    ).all()
    left = _left_by_cancel(session, job_id)
    if failed_shards:
        fail(session, job, _shards_error(failed_shards), **totals)
    elif left:
        reason = (
            f"{counted(left, 'row')} {'was' if left == 1 else 'were'} not run: a cancel stopped them and `retry "
            f"--failed-only` re-runs failed rows only; `gpujobs retry {job_id}` runs them"
        )
        transition(session, job, JobState.cancelled, reason=reason, finished_at=now(), **totals)
    else:
        transition(session, job, JobState.succeeded, reason=_summary(totals), finished_at=now(), **totals)
    return True


def _left_by_cancel(session: Session, job_id: str) -> int:
    """Pending rows of the job's cancelled shards: rows a cancel stopped that `retry --failed-only` did not re-open,
    which no run of this job will do."""
    cancelled = (
        select(Shard.id)
        .where(
            Shard.job_id == JobRow.job_id,
            Shard.state == ShardState.cancelled.value,
            JobRow.idx >= Shard.row_start,
            JobRow.idx < Shard.row_end,
        )
        .exists()
    )
    stmt = select(func.count()).where(JobRow.job_id == job_id, JobRow.state == RowState.pending.value, cancelled)
    return session.scalar(stmt) or 0


def _shards_error(failed: list[Shard]) -> str:
    """The job's error from its failed shards: each distinct error once, with the shards that had it (a cause that
    fails every shard, such as a kernel that does not compile, reads as one line)."""
    by_error: dict[str, list[Shard]] = {}
    for shard in failed:
        by_error.setdefault(shard.error or "failed", []).append(shard)
    parts = []
    for error, shards in by_error.items():
        if len(shards) == 1:
            s = shards[0]
            parts.append(f"shard {s.idx} (rows {s.row_start}-{s.row_end - 1}): {error}")
        else:
            parts.append(
                f"{len(shards)} shards ({', '.join(str(s.idx) for s in shards[:10])}"
                f"{', …' if len(shards) > 10 else ''}): {error}"
            )
    return "; ".join(parts)


def _totals(session: Session, job: Job) -> dict[str, Any]:
    p = progress(session, job)
    shards = session.scalars(select(Shard).where(Shard.job_id == job.id)).all()
    shard_metrics = [s.metrics or {} for s in shards]
    started = job.started_at or job.created_at  # this run's first claim (a retry resets it)
    duration = max(round(now() - started, 3), 0.001)  # whole ms: the rates below are of the duration shown
    run_rows, run_tokens = session.execute(
        select(func.count(), func.coalesce(func.sum(JobRow.completion_tokens), 0)).where(
            JobRow.job_id == job.id, JobRow.finished_at >= started, JobRow.worker.is_not(None)
        )
    ).one()  # this run's rows
    metrics = dict(job.metrics or {})
    metrics.update(
        duration_s=duration,
        output_tok_s=round(int(run_tokens) / duration, 2),
        rows_per_s=round(int(run_rows) / duration, 3),
        gpu_seconds=round(sum(m.get("gpu_seconds", 0.0) for m in shard_metrics), 3),
        engine_seconds=round(sum(m.get("engine_seconds", 0.0) for m in shard_metrics), 3),
        peak_memory_bytes=max((m.get("peak_memory_bytes", 0) for m in shard_metrics), default=0),
    )
    if job.kind == "finetune":
        metrics.pop("rows_per_s")
        metrics.pop("output_tok_s")  # it generated nothing: its rate is training's (metrics.training, events)
    return dict(
        rows_succeeded=p["succeeded"],
        rows_failed=p["failed"],
        prompt_tokens=p["prompt_tokens"],
        completion_tokens=p["completion_tokens"],
        metrics=metrics,
    )


def _summary(totals: dict[str, Any]) -> str:
    m = totals["metrics"]
    if m.get("output_tok_s") is None:  # a fine-tune: its rows are training rows, it generated nothing
        return f"{totals['rows_succeeded']} training rows in {m['duration_s']:.1f} s"
    return (
        f"{counted(totals['rows_succeeded'], 'row')} succeeded, {totals['rows_failed']} failed, "
        f"{totals['completion_tokens']} tokens in {m['duration_s']:.1f} s ({m['output_tok_s']:.1f} tok/s)"
    )


def stuck_jobs(session: Session) -> list[str]:
    """Running or cancelling jobs with no open shard: finalize them (a finalizer died in between)."""
    live = (ShardState.queued.value, ShardState.running.value)
    open_exists = select(Shard.id).where(Shard.job_id == Job.id, Shard.state.in_(live)).exists()
    stmt = select(Job.id).where(Job.state.in_((JobState.running.value, JobState.cancelling.value)), ~open_exists)
    return list(session.scalars(stmt.limit(100)).all())


def reap() -> None:
    """The reaper's pass, on every worker's heartbeat: shards first (`core.dispatch.reap`: never sent, lease
    expired, lost in flight), then what no process finished: jobs whose shards all ended, OpenAI batches past
    their window, chained jobs whose fine-tune ended while no worker was there to release them."""
    dispatch.reap()
    with session_scope() as session:
        for job_id in stuck_jobs(session):
            maybe_finalize(session, job_id)
        for job_id in expire_batches(session, get_settings().batch_window_seconds):
            log.info("%s reaper: OpenAI batch past its completion window: cancelled as expired", job_id)
    release_waiting()


# --- what a worker records on a job ---------------------------------------------------------------------------


def event(job_id: str, message: str, **kwargs: Any) -> None:
    """An event on the job, in a transaction of its own (`core.store.add_event`'s keywords)."""
    with session_scope() as session:
        add_event(session, job_id, message, **kwargs)


def record_load(job_id: str, resolved: dict[str, Any], versions: Callable[[], dict[str, Any]]) -> None:
    """The load options and library versions (`versions()`, read only then) of the job's first load; later shards
    keep them."""
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job.load_options is None:
            job.load_options = resolved
            job.versions = versions()


def record_engine(job_id: str, engine_info: dict[str, Any]) -> None:
    """The job's load options also say which engine ran, as the first finished shard saw it (each shard's
    metrics keep their own)."""
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job.load_options is not None and "engine" not in job.load_options:
            job.load_options = {**job.load_options, "engine": engine_info}
