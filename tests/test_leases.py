"""Shard leases, row commits, the reaper's queries and job finalization (core.leases, core.dispatch, core.jobs), on
SQLite and Postgres."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select, update

from core import dispatch, jobs, leases
from core.dataset import ParsedRow
from core.db import session_scope
from core.errors import IllegalTransition, LeaseLost
from core.jobs import maybe_finalize
from core.leases import RowResult
from core.models import Job, JobEvent, JobRow, Shard
from core.states import JobState, ShardState
from core.store import create_shards, insert_rows, new_id, now, transition

pytestmark = pytest.mark.usefixtures("any_jobs_env")

LEASE = 30.0


def make_job(
    *,
    rows: int = 4,
    shard_rows: int = 2,
    max_attempts: int = 3,
    state: str = JobState.running.value,
    bad_rows: tuple[int, ...] = (),
    created_at: float | None = None,
) -> tuple[str, list[int]]:
    """A job with `rows` rows (those in `bad_rows` failed at parse time) cut into shards; returns (job id, shard ids)."""
    with session_scope() as session:
        job = Job(
            id=new_id("job"),
            kind="generate",
            state=state,
            owner="alice",
            spec={"model": "m", "input": "f"},
            queue="gpu",
            gpus=1,
            rows_total=rows,
            created_at=created_at or now(),
        )
        session.add(job)
        session.flush()
        parsed = [
            ParsedRow(
                i,
                i + 1,
                f"r{i}",
                {"prompt": f"p{i}", "params": {}, "extra": {}},
                f"line {i + 1}: bad" if i in bad_rows else None,
            )
            for i in range(rows)
        ]
        assert insert_rows(session, job.id, parsed) == (
            rows,
            len(bad_rows),
            f"line {bad_rows[0] + 1}: bad" if bad_rows else None,
        )
        shards = create_shards(session, job, shard_rows=shard_rows, max_attempts=max_attempts)
        return job.id, [s.id for s in shards]


def claim(shard_id: int, worker: str):
    with session_scope() as session:
        return leases.claim(session, shard_id, worker, LEASE)


def shard_of(shard_id: int) -> Shard:
    with session_scope() as session:
        return session.get(Shard, shard_id)


def job_of(job_id: str) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def rows_of(job_id: str) -> dict[int, JobRow]:
    with session_scope() as session:
        return {r.idx: r for r in session.scalars(select(JobRow).where(JobRow.job_id == job_id)).all()}


def messages(job_id: str, kind: str | None = None) -> list[str]:
    with session_scope() as session:
        stmt = select(JobEvent.message).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
        if kind:
            stmt = stmt.where(JobEvent.kind == kind)
        return list(session.scalars(stmt).all())


def expire(shard_id: int) -> None:
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id == shard_id).values(lease_expires_at=now() - 1))


def commit(shard_id: int, worker: str, results: list[RowResult]) -> None:
    with session_scope() as session:
        leases.commit_rows(session, session.get(Shard, shard_id), worker, results, LEASE)


def finish(shard_id: int, worker: str, metrics: dict | None = None) -> None:
    with session_scope() as session:
        leases.finish(session, session.get(Shard, shard_id), worker, metrics or {})


def finalize(job_id: str) -> bool:
    with session_scope() as session:
        return maybe_finalize(session, job_id)


def ok(idx: int, output: str = "out", tokens: int = 5) -> RowResult:
    return RowResult(
        idx, output=output, finish_reason="stop", prompt_tokens=3, completion_tokens=tokens, started_at=now()
    )


def race(n: int, attempt) -> list[object]:
    """Run `attempt(session, i)` in n threads released together, each in its own session; results or exceptions."""
    barrier = threading.Barrier(n)
    results: list[object] = [None] * n

    def run(i: int) -> None:
        barrier.wait()
        try:
            with session_scope() as session:
                results[i] = attempt(session, i)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a racing session hung"
    return results


# --- claim ------------------------------------------------------------------------------------------------------


def test_claim_takes_the_lease_counts_an_attempt_and_returns_the_pending_rows():
    """A claim of a queued shard leases it to the worker, counts attempt 1, starts the job and returns its pending rows."""
    job_id, (s0, _) = make_job(bad_rows=(1,))
    t0 = now()
    got = claim(s0, "w1")
    assert got is not None
    assert [r.idx for r in got.rows] == [0]  # row 1 failed at parse time: not work
    shard = shard_of(s0)
    assert (shard.state, shard.lease_owner, shard.attempts) == ("running", "w1", 1)
    assert t0 + LEASE <= shard.lease_expires_at <= now() + LEASE
    assert shard.started_at >= t0
    assert job_of(job_id).started_at == shard.started_at
    assert messages(job_id, "state") == ["shard 0 → running: claimed by w1 (attempt 1 of 3)"]


def test_a_second_claim_of_a_leased_shard_returns_none():
    """A duplicate message for a shard leased by a live worker, with nothing else queued, is ignored: None, lease and
    attempts untouched."""
    job_id, (s0,) = make_job(rows=2, shard_rows=2)
    assert claim(s0, "w1") is not None
    before = shard_of(s0)
    assert claim(s0, "w2") is None
    assert claim(s0, "w1") is None  # the holder's own redelivered message too
    after = shard_of(s0)
    assert (after.lease_owner, after.attempts, after.lease_expires_at) == ("w1", 1, before.lease_expires_at)
    assert len(messages(job_id, "state")) == 1


@pytest.mark.parametrize("state", [s for s in ShardState if s.terminal])
def test_a_claim_of_a_terminal_shard_returns_none(state):
    """A late message for a finished shard, with nothing else queued, does nothing: None, state and attempts
    unchanged, no event."""
    job_id, (s0,) = make_job(rows=2, shard_rows=2)
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id == s0).values(state=state.value, attempts=1))
    assert claim(s0, "w1") is None
    shard = shard_of(s0)
    assert (shard.state, shard.attempts, shard.lease_owner) == (state.value, 1, None)
    assert messages(job_id) == []


@pytest.mark.parametrize("state", [ShardState.running, ShardState.succeeded])
def test_a_message_whose_shard_is_taken_takes_the_next_queued_shard(state):
    """A message whose shard another claim took (or that is done) takes the next queued shard of its queue, so
    every queued shard still has a message that runs it (core/scheduling.py); the taken shard is untouched."""
    job_id, (s0, s1) = make_job()
    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.id == s0)
            .values(state=state.value, attempts=1, lease_owner="w0", lease_expires_at=now() + LEASE)
        )
    got = claim(s0, "w1")
    assert got is not None and got.shard.id == s1
    assert (shard_of(s0).state, shard_of(s0).lease_owner) == (state.value, "w0")
    assert (shard_of(s1).state, shard_of(s1).lease_owner) == ("running", "w1")
    assert claim(s1, "w2") is None  # s1's own message, late: nothing is left


def test_a_claim_of_a_missing_shard_returns_none():
    """A message for a shard that no longer exists (job deleted) is dropped."""
    assert claim(987654, "w1") is None


def test_a_claim_after_the_lease_expired_requeues_then_claims():
    """An expired lease is taken over: re-queued with an event, then leased to the new worker as attempt 2."""
    job_id, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    expire(s0)
    got = claim(s0, "w2")
    assert got is not None and [r.idx for r in got.rows] == [0, 1]
    shard = shard_of(s0)
    assert (shard.state, shard.lease_owner, shard.attempts) == ("running", "w2", 2)
    assert shard.lease_expires_at > now()
    assert messages(job_id, "state") == [
        "shard 0 → running: claimed by w1 (attempt 1 of 3)",
        "shard 0 → queued: lease of w1 expired (worker lost?)",
        "shard 0 → running: claimed by w2 (attempt 2 of 3)",
    ]
    assert messages(job_id).count("shard 0 re-enqueued by a claim") == 1


def test_concurrent_claims_of_one_queued_shard_lease_it_once():
    """Four workers claim one queued shard at once (duplicate delivery): exactly one gets it, the others get None."""
    job_id, (s0,) = make_job(rows=2, shard_rows=2)
    results = race(4, lambda session, i: leases.claim(session, s0, f"w{i}", LEASE))
    won = [i for i, r in enumerate(results) if isinstance(r, leases.Claim)]
    assert len(won) == 1, results
    assert all(r is None for i, r in enumerate(results) if i not in won), results
    shard = shard_of(s0)
    assert (shard.lease_owner, shard.attempts) == (f"w{won[0]}", 1)
    assert len(messages(job_id, "state")) == 1


def test_a_claim_racing_the_reaper_on_an_expired_lease_never_raises():
    """A worker claiming an expired shard while a reaper re-queues it gets the lease or None, never an error."""
    job_id, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    expire(s0)
    seen = shard_of(s0)

    def attempt(session, i):
        if i == 0:
            return dispatch.requeue_expired(session, seen)
        return leases.claim(session, s0, "w2", LEASE)

    reaped, claimed = race(2, attempt)
    assert reaped in (True, False) and (claimed is None or isinstance(claimed, leases.Claim)), (reaped, claimed)
    assert reaped or claimed is not None  # someone took the expired lease (the claim may also follow the reaper)
    shard = shard_of(s0)
    if claimed is None:
        assert (shard.state, shard.lease_owner, shard.attempts) == ("queued", None, 1)
    else:
        assert (shard.state, shard.lease_owner, shard.attempts) == ("running", "w2", 2)
    claims = messages(job_id, "state").count("shard 0 → running: claimed by w2 (attempt 2 of 3)")
    assert claims == (0 if claimed is None else 1)


def test_exhausted_attempts_fail_the_shard_its_pending_rows_and_the_job():
    """With max_attempts used up, a claim gives up: shard failed 'gave up after N attempts', pending rows failed, job failed."""
    job_id, (s0,) = make_job(rows=3, shard_rows=3, max_attempts=2, bad_rows=(2,))
    assert claim(s0, "w1") is not None
    commit(s0, "w1", [ok(0, "kept")])
    expire(s0)
    assert claim(s0, "w2") is not None
    expire(s0)
    assert claim(s0, "w3") is None

    reason = "gave up after 2 attempts: the worker was lost each time"
    shard = shard_of(s0)
    assert (shard.state, shard.error, shard.attempts, shard.lease_owner) == ("failed", reason, 2, None)
    rows = rows_of(job_id)
    assert (rows[0].state, rows[0].output, rows[0].error) == ("succeeded", "kept", None)
    assert (rows[1].state, rows[1].error) == ("failed", reason)
    assert (rows[2].state, rows[2].error) == ("failed", "line 3: bad")  # a parse failure keeps its own reason
    job = job_of(job_id)
    assert job.state == "failed"
    assert job.error == f"shard 0 (rows 0-2): {reason}"
    assert (job.rows_succeeded, job.rows_failed) == (1, 2)
    assert job.finished_at is not None
    assert messages(job_id, "state")[-3:] == [
        f"shard 0 → failed: {reason}",
        "job → finalizing: every shard is done",
        f"job → failed: shard 0 (rows 0-2): {reason}",
    ]


def test_claim_of_a_shard_of_a_cancelling_job_cancels_the_shard():
    """A message for a shard whose job is being cancelled cancels the shard instead of running it."""
    job_id, (s0,) = make_job(rows=2, shard_rows=2, state=JobState.cancelling.value)
    assert claim(s0, "w1") is None
    assert shard_of(s0).state == "cancelled"
    assert shard_of(s0).attempts == 0
    assert job_of(job_id).state == "cancelled"  # it was the last open shard


# --- commit_rows, renew, hand_back -------------------------------------------------------------------------------


def test_commit_rows_writes_only_pending_rows_and_counts_every_execution():
    """A result lands only on a pending row; a duplicate write bumps executions to 2 and keeps the first result."""
    job_id, (s0, _) = make_job(bad_rows=(1,))
    assert claim(s0, "w1") is not None
    commit(s0, "w1", [ok(0, "first", tokens=7), RowResult(1, output="ignored", completion_tokens=1)])
    commit(s0, "w1", [ok(0, "second", tokens=9)])
    rows = rows_of(job_id)
    assert (rows[0].state, rows[0].output, rows[0].completion_tokens, rows[0].executions) == (
        "succeeded",
        "first",
        7,
        2,
    )
    assert (rows[0].worker, rows[0].finish_reason, rows[0].prompt_tokens) == ("w1", "stop", 3)
    assert rows[0].finished_at is not None and rows[0].started_at is not None
    assert (rows[1].state, rows[1].output, rows[1].error, rows[1].executions) == ("failed", None, "line 2: bad", 1)
    assert (rows[2].state, rows[2].executions) == ("pending", 0)  # another shard's row is not touched


def test_commit_rows_records_a_row_error_as_a_failed_row():
    """A RowResult with an error makes the row failed with that error and counts it on the shard."""
    job_id, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    commit(s0, "w1", [ok(0), RowResult(1, error="prompt too long")])
    rows = rows_of(job_id)
    assert (rows[1].state, rows[1].error, rows[1].output) == ("failed", "prompt too long", None)
    shard = shard_of(s0)
    assert (shard.rows_done, shard.rows_failed, shard.completion_tokens) == (1, 1, 5)


@pytest.mark.parametrize("how", ["other worker", "reclaimed", "reaped"])
def test_commit_rows_under_a_lost_lease_raises_and_writes_nothing(how):
    """A worker that no longer holds the lease gets LeaseLost and no row, counter or lease changes (even if the caller commits)."""
    job_id, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    writer = "w1"
    if how == "other worker":
        writer = "w2"
    elif how == "reclaimed":
        expire(s0)
        assert claim(s0, "w2") is not None
    else:
        expire(s0)
        with session_scope() as session:
            assert dispatch.requeue_expired(session, session.get(Shard, s0))
    before = shard_of(s0)
    with session_scope() as session:  # catch inside so the session commits: LeaseLost itself must write nothing
        with pytest.raises(LeaseLost, match=f"^shard {s0} is no longer leased by {writer}$"):
            leases.commit_rows(session, session.get(Shard, s0), writer, [ok(0)], LEASE)
    after = shard_of(s0)
    assert (after.state, after.lease_owner, after.lease_expires_at, after.rows_done) == (
        before.state,
        before.lease_owner,
        before.lease_expires_at,
        before.rows_done,
    )
    rows = rows_of(job_id)
    assert (rows[0].state, rows[0].output, rows[0].executions) == ("pending", None, 0)


def test_renew_extends_only_the_holders_lease():
    """renew() pushes the holder's lease forward and returns True; anyone else gets False and changes nothing."""
    _, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    expire(s0)
    with session_scope() as session:
        assert leases.renew(session, s0, "w1", LEASE) is True
    assert shard_of(s0).lease_expires_at > now()
    held = shard_of(s0).lease_expires_at
    with session_scope() as session:
        assert leases.renew(session, s0, "w2", 999) is False
    assert shard_of(s0).lease_expires_at == held


@pytest.mark.parametrize("count_attempt", [True, False])
def test_hand_back_requeues_for_a_new_send(count_attempt):
    """hand_back() re-queues the holder's shard with no lease and no enqueue mark; without count_attempt the attempt is returned."""
    job_id, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    with session_scope() as session:
        with pytest.raises(IllegalTransition):
            leases.hand_back(session, session.get(Shard, s0), "w2", "not mine")
    with session_scope() as session:
        leases.hand_back(session, session.get(Shard, s0), "w1", "shutting down", count_attempt=count_attempt)
    shard = shard_of(s0)
    assert (shard.state, shard.lease_owner, shard.lease_expires_at, shard.enqueued_at) == ("queued", None, None, None)
    assert shard.attempts == (1 if count_attempt else 0)
    assert messages(job_id, "state")[-1] == "shard 0 → queued: shutting down"


# --- the reaper ---------------------------------------------------------------------------------------------------


def test_requeue_expired_from_two_sessions_only_one_wins():
    """Two reapers re-queue the same expired shard at once: exactly one returns True (and must send), one event."""
    job_id, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    expire(s0)
    with session_scope() as session:
        assert [s.id for s in dispatch.expired_shards(session)] == [s0]
    seen = shard_of(s0)  # both reapers saw the same expired lease

    results = race(2, lambda session, i: dispatch.requeue_expired(session, seen))
    assert sorted(results, key=repr) == [False, True], results
    shard = shard_of(s0)
    assert (shard.state, shard.lease_owner, shard.enqueued_at) == ("queued", None, None)
    assert messages(job_id).count("shard 0 re-enqueued by the reaper") == 1
    assert messages(job_id, "state")[-1] == "shard 0 → queued: lease of w1 expired (worker lost?)"


def test_requeue_expired_loses_to_a_renewed_lease():
    """A reaper holding a stale view of an expired lease does nothing once the holder renewed it."""
    _, (s0, _) = make_job()
    assert claim(s0, "w1") is not None
    expire(s0)
    stale = shard_of(s0)
    with session_scope() as session:
        assert leases.renew(session, s0, "w1", LEASE)
    with session_scope() as session:
        assert dispatch.requeue_expired(session, stale) is False
    assert (shard_of(s0).state, shard_of(s0).lease_owner) == ("running", "w1")


def test_queued_shards_finds_queued_never_sent_shards_older_than_the_cutoff():
    """queued_shards() lists queued shards with enqueued_at NULL of jobs created before the cutoff, nothing else."""
    old_job, (old_a, old_b, old_c) = make_job(rows=6, created_at=now() - 120)
    young_job, (young,) = make_job(rows=2, created_at=now())
    with session_scope() as session:
        dispatch.mark_enqueued(session, [old_b])
    assert claim(old_c, "w1").shard.id == old_a  # the claim takes the job's first queued shard (FIFO)
    with session_scope() as session:
        found = [s.id for s in dispatch.queued_shards(session, older_than=now() - 60)]
    assert found == [old_c]
    with session_scope() as session:  # a later cutoff takes the young job's shard too
        found = sorted(s.id for s in dispatch.queued_shards(session, older_than=now() + 1))
    assert found == sorted([old_c, young])
    with session_scope() as session:  # after a Redis restart: every queued shard, sent or not
        found = sorted(s.id for s in dispatch.queued_shards(session, older_than=now() + 1, unsent_only=False))
    assert found == sorted([old_b, old_c, young])


def test_stuck_jobs_finds_running_or_cancelling_jobs_without_an_open_shard():
    """stuck_jobs() lists running/cancelling jobs whose shards all ended, not jobs with open shards or finished jobs."""
    stuck, (s_stuck,) = make_job(rows=2, shard_rows=2)
    busy, _ = make_job(rows=2, shard_rows=2)  # its shard is still queued
    cancelling, (s_cancel,) = make_job(rows=2, shard_rows=2, state=JobState.cancelling.value)
    done, (s_done,) = make_job(rows=2, shard_rows=2, state=JobState.succeeded.value)
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id.in_([s_stuck, s_done])).values(state="succeeded"))
        session.execute(update(Shard).where(Shard.id == s_cancel).values(state="cancelled"))
    with session_scope() as session:
        assert sorted(jobs.stuck_jobs(session)) == sorted([stuck, cancelling])
    assert finalize(stuck) and finalize(cancelling)
    with session_scope() as session:
        assert jobs.stuck_jobs(session) == []
    assert (job_of(stuck).state, job_of(cancelling).state, job_of(busy).state) == ("succeeded", "cancelled", "running")


# --- finalization -------------------------------------------------------------------------------------------------


def _run_all(job_id: str, shard_ids: list[int], results_per_shard: list[list[RowResult]], metrics: list[dict]) -> None:
    for i, (sid, results) in enumerate(zip(shard_ids, results_per_shard)):
        assert claim(sid, f"w{i}") is not None
        commit(sid, f"w{i}", results)
        finish(sid, f"w{i}", metrics[i])


def test_maybe_finalize_succeeds_the_job_once_with_totals():
    """With every shard done the job ends succeeded exactly once, with row and token totals and duration/throughput metrics."""
    job_id, shards = make_job(rows=4, shard_rows=2)
    with session_scope() as session:  # the job started 2 s ago: duration is measured from started_at
        session.execute(update(Job).where(Job.id == job_id).values(started_at=now() - 2))
    _run_all(
        job_id,
        shards,
        [[ok(0, tokens=10), ok(1, tokens=20)], [ok(2, tokens=30), ok(3, tokens=40)]],
        [
            {"gpu_seconds": 1.5, "engine_seconds": 1.0, "peak_memory_bytes": 100},
            {"gpu_seconds": 2.5, "engine_seconds": 2.0, "peak_memory_bytes": 300},
        ],
    )
    assert job_of(job_id).state == "running"  # finishing a shard does not finalize by itself
    t_before = now()
    assert finalize(job_id) is True
    assert finalize(job_id) is False  # a second finalizer does nothing

    job = job_of(job_id)
    assert job.state == "succeeded"
    assert (job.rows_succeeded, job.rows_failed, job.prompt_tokens, job.completion_tokens) == (4, 0, 12, 100)
    m = job.metrics
    assert 2 <= m["duration_s"] <= now() - job.started_at + 0.01
    assert m["output_tok_s"] == pytest.approx(100 / m["duration_s"], abs=0.05)  # duration_s is rounded to ms
    assert (m["gpu_seconds"], m["engine_seconds"], m["peak_memory_bytes"]) == (4.0, 3.0, 300)
    assert t_before <= job.finished_at <= now()
    states = messages(job_id, "state")
    assert states[-2] == "job → finalizing: every shard is done"
    assert states[-1].startswith("job → succeeded: 4 rows succeeded, 0 failed, 100 tokens in ")
    assert sum(1 for m in states if m.startswith("job → succeeded")) == 1


def test_concurrent_maybe_finalize_finishes_the_job_once():
    """Three processes finalize the same finished job at once: one returns True, one succeeded event."""
    job_id, shards = make_job(rows=2, shard_rows=2)
    _run_all(job_id, shards, [[ok(0), ok(1)]], [{}])
    results = race(3, lambda session, i: maybe_finalize(session, job_id))
    assert sorted(results, key=repr) == [False, False, True], results
    assert job_of(job_id).state == "succeeded"
    assert sum(1 for m in messages(job_id, "state") if m.startswith("job → succeeded")) == 1


def test_maybe_finalize_waits_for_open_shards():
    """While a shard is queued or running the job is not finalized."""
    job_id, (s0, s1) = make_job()
    _run_all(job_id, [s0], [[ok(0), ok(1)]], [{}])
    assert claim(s1, "w9") is not None
    assert finalize(job_id) is False
    assert job_of(job_id).state == "running"


def test_a_job_whose_rows_partly_failed_still_succeeds_counting_them():
    """Failed rows (at parse time or in the engine) do not fail the job: it succeeds with rows_failed counted."""
    job_id, shards = make_job(rows=4, shard_rows=2, bad_rows=(1,))
    _run_all(job_id, shards, [[ok(0)], [ok(2), RowResult(3, error="too long")]], [{}, {}])
    assert finalize(job_id) is True
    job = job_of(job_id)
    assert (job.state, job.rows_succeeded, job.rows_failed, job.error) == ("succeeded", 2, 2, None)
    assert messages(job_id, "state")[-1].startswith("job → succeeded: 2 rows succeeded, 2 failed, 10 tokens in ")


def test_a_cancelling_job_whose_shards_all_stopped_ends_cancelled():
    """Cancel: a queued shard is cancelled by its message, the running one by its worker; then the job is cancelled, rows kept."""
    job_id, (s0, s1) = make_job()
    assert claim(s0, "w1") is not None
    commit(s0, "w1", [ok(0, "done before cancel")])
    with session_scope() as session:
        transition(session, session.get(Job, job_id), JobState.cancelling, reason="cancelled by alice")
    with session_scope() as session:
        assert leases.job_stopping(session, job_id)
    assert claim(s1, "w2") is None  # the queued shard's message cancels it
    assert (shard_of(s1).state, job_of(job_id).state) == ("cancelled", "cancelling")  # s0 still running
    with session_scope() as session:
        leases.stop_cancelled(session, session.get(Shard, s0), "w1")
    job = job_of(job_id)
    assert (job.state, job.rows_succeeded, job.rows_failed) == ("cancelled", 1, 0)
    assert job.finished_at is not None
    assert rows_of(job_id)[0].output == "done before cancel"
    assert messages(job_id, "state")[-1] == "job → cancelled: every shard stopped"
    assert finalize(job_id) is False


def test_a_failed_attempt_is_summed_up_by_its_exception_line_not_the_last_line_of_a_long_message():
    """An error of several lines (CUDA's, pydantic's) ends in advice; the event and the job's error name the
    exception's own line (`RuntimeError: CUDA error: …`), and the whole traceback stays in the event's data."""
    import traceback

    job_id, (s0,) = make_job(rows=2, shard_rows=2, max_attempts=1)
    assert claim(s0, "w1") is not None
    try:
        try:
            raise KeyError("inner")
        except KeyError:
            raise RuntimeError(
                "CUDA error: an illegal memory access was encountered\n"
                "CUDA kernel errors might be asynchronously reported at some other API call.\n"
                "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions."
            ) from None
    except RuntimeError:
        error = traceback.format_exc()
    leases.fail_attempt(s0, "w1", error)
    line = "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert job_of(job_id).error == f"shard 0 (rows 0-1): failed 1 times; last error: {line}"
    with session_scope() as session:
        event = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.level == "error")).one()
    assert event.message == f"shard 0 failed on w1 (attempt 1 of 1): {line}"
    assert event.data["traceback"] == error
    assert leases.error_line("a plain message\n  with more") == "a plain message"
