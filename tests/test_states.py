"""The state machine: `core.store.transition` allows exactly the pairs of `core.states`, on SQLite and Postgres.

Pairs are generated from the enums, so a state added later is covered without touching this file. Rows are
made directly with the models; between cases a raw UPDATE puts the object back into the source state.
"""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import func, select, update

from core.db import session_scope
from core.errors import IllegalTransition
from core.models import Job, JobEvent, Shard
from core.states import JOB_TRANSITIONS, SHARD_TRANSITIONS, JobState, ShardState
from core.store import new_id, now, transition
from tests.test_leases import race

KINDS = {
    "job": (Job, JobState, JOB_TRANSITIONS),
    "shard": (Shard, ShardState, SHARD_TRANSITIONS),
}


def _make_job(session, state: str = JobState.queued.value) -> Job:
    job = Job(
        id=new_id("job"),
        kind="generate",
        state=state,
        owner="alice",
        spec={"model": "m", "input": "f"},
        queue="gpu",
        gpus=1,
        rows_total=2,
        created_at=now(),
    )
    session.add(job)
    session.flush()
    return job


def _make_shard(session, job: Job, state: str = ShardState.queued.value, **values) -> Shard:
    shard = Shard(job_id=job.id, idx=0, row_start=0, row_end=2, state=state, max_attempts=3, **values)
    session.add(shard)
    session.flush()
    return shard


def _make(kind: str) -> tuple[str, int | str]:
    """A fresh job (and shard); returns (job id, id of the object whose state the test changes)."""
    with session_scope() as session:
        job = _make_job(session)
        if kind == "job":
            return job.id, job.id
        return job.id, _make_shard(session, job).id


def _state_events(session, job_id: str) -> list[JobEvent]:
    return list(
        session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "state").order_by(JobEvent.id)
        ).all()
    )


def _allowed(table, source, target) -> bool:
    return source in table.get(target, ())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_pair_of_states_is_allowed_or_refused_as_the_tables_say(any_jobs_env, kind):
    """Every (source, target) pair of the enum: allowed ones move and write one state event, others raise and change nothing."""
    model, enum, table = KINDS[kind]
    job_id, oid = _make(kind)
    problems: list[str] = []
    pairs = list(itertools.product(enum, enum))
    assert len(pairs) == len(enum) ** 2 >= 25

    for source, target in pairs:
        with session_scope() as session:
            session.execute(update(model).where(model.id == oid).values(state=source.value))
            events_before = len(_state_events(session, job_id))
        outcome: Exception | None = None
        with session_scope() as session:  # commits even after a refusal: a refused transition must write nothing
            obj = session.get(model, oid)
            try:
                returned = transition(session, obj, target, reason="test")
            except IllegalTransition as exc:
                outcome = exc
            else:
                if returned.state != target.value:
                    problems.append(f"{source.value} → {target.value}: returned object says {returned.state}")
        with session_scope() as session:
            stored = session.scalar(select(model.state).where(model.id == oid))
            new_events = _state_events(session, job_id)[events_before:]
        pair = f"{kind} {source.value} → {target.value}"
        if _allowed(table, source, target):
            if outcome is not None:
                problems.append(f"{pair}: allowed but raised {outcome}")
                continue
            if stored != target.value:
                problems.append(f"{pair}: allowed but stored state is {stored}")
            if len(new_events) != 1:
                problems.append(f"{pair}: allowed but wrote {len(new_events)} state events")
                continue
            event = new_events[0]
            label = "job" if kind == "job" else "shard 0"
            expected = {"object": kind, "state": target.value, "reason": "test"}
            if event.message != f"{label} → {target.value}: test" or event.data != expected:
                problems.append(f"{pair}: event {event.message!r} {event.data!r}")
            if event.shard_id != (None if kind == "job" else oid):
                problems.append(f"{pair}: event shard_id {event.shard_id}")
        else:
            if outcome is None:
                problems.append(f"{pair}: not in the table but succeeded")
            elif str(outcome) != f"{kind} {oid} cannot move from {source.value} to {target.value}":
                problems.append(f"{pair}: message {str(outcome)!r}")
            if stored != source.value:
                problems.append(f"{pair}: refused but stored state changed to {stored}")
            if new_events:
                problems.append(f"{pair}: refused but wrote {len(new_events)} state events")

    assert not problems, "\n".join(problems)


def test_transition_tables_only_name_states_of_their_own_enum():
    """Both tables map enum members to enum members, so the generated pairs cover every entry."""
    for table, enum in ((JOB_TRANSITIONS, JobState), (SHARD_TRANSITIONS, ShardState)):
        for target, sources in table.items():
            assert isinstance(target, enum)
            assert all(isinstance(s, enum) for s in sources), (target, sources)


def test_a_where_condition_that_does_not_hold_refuses_and_changes_nothing(any_jobs_env):
    """A legal move whose extra condition (the lease owner) does not match raises and writes neither state, values nor event."""
    with session_scope() as session:
        job = _make_job(session, JobState.running.value)
        shard = _make_shard(
            session, job, ShardState.running.value, lease_owner="w1", lease_expires_at=now() + 60, attempts=1
        )
        job_id, shard_id = job.id, shard.id

    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        with pytest.raises(IllegalTransition, match=f"^shard {shard_id} cannot move from running to queued$"):
            transition(
                session, shard, ShardState.queued, where=[Shard.lease_owner == "w2"], lease_owner=None, attempts=0
            )

    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        assert (shard.state, shard.lease_owner, shard.attempts) == ("running", "w1", 1)
        assert _state_events(session, job_id) == []

    with session_scope() as session:  # the same move with the right owner goes through
        transition(
            session,
            session.get(Shard, shard_id),
            ShardState.queued,
            where=[Shard.lease_owner == "w1"],
            lease_owner=None,
        )
    with session_scope() as session:
        shard = session.get(Shard, shard_id)
        assert (shard.state, shard.lease_owner) == ("queued", None)
        assert len(_state_events(session, job_id)) == 1


def test_a_target_with_no_sources_is_refused_by_name(any_jobs_env, monkeypatch):
    """A target state missing from the table is refused with 'no job may move to …' before touching the row."""
    from core import states

    table = dict(states.JOB_TRANSITIONS)
    del table[JobState.succeeded]
    monkeypatch.setattr(states, "JOB_TRANSITIONS", table)
    with session_scope() as session:
        job = _make_job(session, JobState.finalizing.value)
        with pytest.raises(IllegalTransition, match="^no job may move to succeeded$"):
            transition(session, job, JobState.succeeded)
        assert session.scalar(select(Job.state).where(Job.id == job.id)) == "finalizing"


@pytest.mark.parametrize("kind", ["job", "shard"])
def test_sessions_racing_the_same_transition_only_one_wins(any_jobs_env, kind):
    """Four sessions make the same legal move at once (finalize a job / claim a shard): one wins, three get IllegalTransition."""
    with session_scope() as session:
        job = _make_job(session, JobState.running.value)
        shard = _make_shard(session, job)
        job_id, shard_id = job.id, shard.id

    def attempt(session, i):
        if kind == "job":
            return transition(session, session.get(Job, job_id), JobState.finalizing, reason=f"by {i}").state
        return transition(
            session,
            session.get(Shard, shard_id),
            ShardState.running,
            reason=f"by w{i}",
            lease_owner=f"w{i}",
            attempts=Shard.attempts + 1,
        ).state

    results = race(4, attempt)
    winners = [r for r in results if not isinstance(r, Exception)]
    losers = [r for r in results if isinstance(r, Exception)]
    assert len(winners) == 1, results
    assert all(isinstance(r, IllegalTransition) for r in losers), results
    with session_scope() as session:
        events = _state_events(session, job_id)
        assert len(events) == 1
        if kind == "job":
            assert session.get(Job, job_id).state == "finalizing"
        else:
            shard = session.get(Shard, shard_id)
            assert shard.state == "running"
            assert shard.attempts == 1  # the losers' values were not applied either
            assert events[0].message == f"shard 0 → running: by {shard.lease_owner}"
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 1


def test_events_record_the_run_they_were_written_in(any_jobs_env):
    """An event's `run` is its job's retries + 1 when it was written (read in its INSERT, on SQLite and Postgres);
    a transition that bumps `retries` writes its own event in the new run."""
    from core.store import add_event

    with session_scope() as session:
        job = _make_job(session, JobState.failed.value)
        add_event(session, job.id, "in run 1")
        transition(session, job, JobState.queued, reason="retry", retries=Job.retries + 1)
        add_event(session, job.id, "in run 2")
    with session_scope() as session:
        found = session.execute(
            select(JobEvent.message, JobEvent.run, JobEvent.superseded)
            .where(JobEvent.job_id == job.id)
            .order_by(JobEvent.id)
        ).all()
    assert [tuple(f) for f in found] == [
        ("in run 1", 1, False),
        ("job → queued: retry", 2, False),
        ("in run 2", 2, False),
    ]
