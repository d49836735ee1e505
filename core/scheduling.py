"""Which queued shard a free worker takes next: priorities, fair share between owners, per-owner quotas; and when a
running shard yields to waiting work (`yield_reason`, at the end of this docstring).

The rule. A worker that receives a message from queue Q takes, in the claim's transaction (`core.leases.claim`):

1. the highest priority (high > normal > low) among Q's queued shards whose owner is under quota;
2. among the owners with work at that priority, the owner with the fewest GPU-seconds over the last
   JOBS_FAIR_SHARE_WINDOW_SECONDS (1 h; every ended attempt, from `shard_runs`, and the shards that run now, up to
   now; a slice of g GPUs counts g per second, a CPU shard 1); ties go to the owner whose oldest queued job is
   oldest;
3. within that owner and priority, first in first out: the oldest job first, its shards in order, whichever shard
   the message was sent for (a shard handed back by a stopping worker goes before its job's later shards).

Why the decision is made in SQL and not by the order of messages in Redis: Redis holds messages in the order they
were sent, and a message cannot be moved once sent; the state the rule reads (what is queued, who ran how much,
who is at quota) is in SQL, and a claim reads it as it is when a worker is free. So a message now means "a shard
is ready on queue Q" (it still names one shard: the claim reads its queue from it, and tidies it: a stopping
job's shard is cancelled, an expired lease re-queued).

Why nothing is lost or run twice: the pick is taken by the conditional UPDATE every claim makes (queued → running,
`core.store.transition`); on Postgres the candidate row is read `FOR UPDATE SKIP LOCKED`, so concurrent claims
take different shards instead of queueing on one; a claim that loses a race anyway (SQLite) picks again. Every
queued shard was sent at least one message, and every message makes exactly one claim, which takes at most one
shard; a message whose own shard another claim took (or that is done) takes the best queued shard instead. So
while shards are queued on Q there are at least as many messages on their way to Q's workers, and each of them
takes one. Duplicate messages take nothing once the queue is empty. The reaper still sends a shard that stays
queued a lease after its send while Q has no message left (`core.dispatch.reap`), as before.

Quotas: an owner with `max_running_shards` set runs at most that many shards at once, and one with
`max_gpu_seconds_per_day` set starts no shard once its GPU-seconds over the last 24 hours reach it (checked when a
claim picks; a shard that runs finishes). The claim's UPDATE counts the
owner's running shards in its WHERE, after locking the owner's quota row on Postgres (so two claims of one capped
owner are serialized; SQLite serializes every write), so a cap holds under concurrent claims. An owner at its cap
is skipped: its queued jobs wait (`gpujobs status` says "waiting: owner quota"). A message that found nothing to
take is gone; the reaper sends such a shard again once it has been queued a lease since its send, the queue has no
message left and its owner is under quota again (`core.dispatch.reap`), so a freed quota is used within a beat.

The cost: per claim one grouped query over Q's queued shards, two over the candidates' recent runs (`shard_runs`
by owner and end, the running shards by state), and one or two single-row reads; ops/bench/load.py measures it
(`--claims`).

Yields: a running shard is interrupted only at a boundary where nothing is lost (a committed micro-batch, a
fine-tune's checkpointed step), when waiting work outranks it and waited JOBS_YIELD_AFTER_SECONDS; the rule and why
it does not thrash: `yield_reason`, docs/design.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, func, or_, select
from sqlalchemy.orm import Session

from core.auth import check_owner
from core.errors import InvalidInput
from core.models import Job, Quota, Shard, ShardRun
from core.settings import get_settings
from core.states import JobState, ShardState
from core.store import now

PRIORITIES = ("low", "normal", "high")  # the stored rank is the index: 0 low, 1 normal, 2 high
DEFAULT_PRIORITY = "normal"
STOPPED_JOB_STATES = (JobState.cancelling.value, JobState.cancelled.value, JobState.failed.value)
QUEUED, RUNNING = ShardState.queued.value, ShardState.running.value


def rank(priority: str) -> int:
    if priority not in PRIORITIES:
        raise InvalidInput(f"unknown priority {priority!r}: use {', '.join(PRIORITIES)}")
    return PRIORITIES.index(priority)


def name(priority_rank: int) -> str:
    return PRIORITIES[priority_rank] if 0 <= priority_rank < len(PRIORITIES) else str(priority_rank)


@dataclass(frozen=True)
class Waiting:
    """Work of one owner at one priority queued on a queue (one class of the rule above)."""

    priority: int
    owner: str
    oldest: float  # created_at of the owner's oldest job with a queued shard at this priority
    shards: int  # queued shards
    gpu_seconds: float = 0.0
    at_quota: bool = False


def _queued_on(queue: str) -> tuple[Any, ...]:
    return Shard.state == QUEUED, Job.queue == queue, Job.state.not_in(STOPPED_JOB_STATES)


def _jobs_waiting_on(queue: str) -> tuple[Any, ...]:
    """Jobs of `queue` with a queued shard: a job-level filter (an EXISTS on the shards' (job, state) index), so the
    claim's queries grow with the jobs waiting, not with their shards. Only running jobs have queued shards."""
    has_queued = select(Shard.id).where(Shard.job_id == Job.id, Shard.state == QUEUED).exists()
    return Job.queue == queue, Job.state == JobState.running.value, has_queued


def waiting(session: Session, queue: str, *, count_shards: bool = False) -> list[Waiting]:
    """Every class of queued work on `queue`, in the order the rule takes them (owners at quota last, flagged);
    with `count_shards`, each class's queued shards (for views; the claim does not need them)."""
    rows = session.execute(
        select(Job.priority, Job.owner, func.min(Job.created_at))
        .where(*_jobs_waiting_on(queue))
        .group_by(Job.priority, Job.owner)
    ).all()
    if not rows:
        return []
    owners = {owner for _, owner, _ in rows}
    used = gpu_seconds(session, owners)
    full = at_quota(session, owners)
    counts = (
        dict(
            ((p, o), n)
            for p, o, n in session.execute(
                select(Job.priority, Job.owner, func.count())
                .select_from(Shard)
                .join(Job, Job.id == Shard.job_id)
                .where(*_queued_on(queue))
                .group_by(Job.priority, Job.owner)
            ).all()
        )
        if count_shards
        else {}
    )
    classes = [Waiting(p, o, oldest, counts.get((p, o), 0), used.get(o, 0.0), o in full) for p, o, oldest in rows]
    return sorted(classes, key=lambda w: (w.at_quota, -w.priority, w.gpu_seconds, w.oldest, w.owner))


def gpu_seconds(session: Session, owners: set[str], window: float | None = None) -> dict[str, float]:
    """GPU-seconds each owner's shards used over the last `window` seconds (default: the fair-share window): every
    ended attempt (`shard_runs`: a yielded or handed-back one too) and the shards running now, up to now."""
    t = now()
    since = t - (window if window is not None else get_settings().fair_share_window)
    used: dict[str, float] = {}
    start = case((ShardRun.started_at > since, ShardRun.started_at), else_=since)
    ended = (
        select(ShardRun.owner, func.sum((ShardRun.ended_at - start) * ShardRun.weight))
        .where(ShardRun.owner.in_(owners), ShardRun.ended_at > since)
        .group_by(ShardRun.owner)
    )
    start = case((Shard.started_at > since, Shard.started_at), else_=since)
    weight = case((Job.gpus > 0, Job.gpus), else_=1)
    running = (
        select(Job.owner, func.sum((t - start) * weight))
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(Shard.state == RUNNING, Job.owner.in_(owners), Shard.started_at.is_not(None))
        .group_by(Job.owner)
    )
    for stmt in (ended, running):
        for owner, seconds in session.execute(stmt).all():
            used[owner] = used.get(owner, 0.0) + float(seconds or 0.0)
    return used


def running_shards(session: Session, owners: set[str] | None = None) -> dict[str, int]:
    stmt = (
        select(Job.owner, func.count())
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(Shard.state == RUNNING)
        .group_by(Job.owner)
    )
    if owners is not None:
        stmt = stmt.where(Job.owner.in_(owners))
    return dict(session.execute(stmt).all())


def _set_caps(session: Session, owners: set[str], column) -> dict[str, Any]:
    """{owner: cap} of the owners whose quota sets `column` (a Quota limit)."""
    return dict(session.execute(select(Quota.owner, column).where(Quota.owner.in_(owners), column.is_not(None))).all())


def caps(session: Session, owners: set[str]) -> dict[str, int]:
    return _set_caps(session, owners, Quota.max_running_shards)


DAY = 24 * 3600.0


def daily_caps(session: Session, owners: set[str]) -> dict[str, float]:
    return _set_caps(session, owners, Quota.max_gpu_seconds_per_day)


def over_daily(session: Session, owners: set[str]) -> set[str]:
    """Owners whose GPU-seconds over the last 24 hours reached their daily cap."""
    limits = daily_caps(session, owners)
    if not limits:
        return set()
    used = gpu_seconds(session, set(limits), window=DAY)
    return {o for o, cap in limits.items() if used.get(o, 0.0) >= cap}


def at_quota(session: Session, owners: set[str]) -> set[str]:
    """Owners that may not start another shard now: at their cap of running shards, or over their daily
    GPU-seconds."""
    limits = caps(session, owners)
    running = running_shards(session, set(limits)) if limits else {}
    full = {o for o, cap in limits.items() if running.get(o, 0) >= cap}
    return full | over_daily(session, owners - full)


def next_shard(session: Session, queue: str) -> tuple[Shard, Job] | None:
    """The queued shard of `queue` that the rule takes now, or None when nothing on the queue may run. On Postgres
    the shard's row is locked (skipping rows other claims hold) until the caller's transaction ends."""
    for w in waiting(session, queue):
        if w.at_quota:
            return None  # the classes at quota come last: nothing else is queued
        jobs = session.scalars(
            select(Job)
            .where(*_jobs_waiting_on(queue), Job.priority == w.priority, Job.owner == w.owner)
            .order_by(Job.created_at, Job.id)
            .limit(JOBS_LOOKED_AT)
            .execution_options(populate_existing=True)
        ).all()
        for job in jobs:
            shard = session.scalar(
                select(Shard)
                .where(Shard.job_id == job.id, Shard.state == QUEUED)
                .order_by(Shard.idx)
                .limit(1)
                .with_for_update(skip_locked=True)
                .execution_options(populate_existing=True)
            )
            if shard is not None:
                return shard, job
    return None


JOBS_LOOKED_AT = 20  # of one owner and priority, oldest first: past them every queued shard is held by other claims


def quota_guard(session: Session, owner: str) -> list[Any]:
    """The WHERE conditions that keep `owner` under its cap in the claim's UPDATE (none without a cap). On Postgres
    the owner's quota row is locked first, so two claims of one capped owner count one after the other."""
    cap = session.scalar(select(Quota.max_running_shards).where(Quota.owner == owner).with_for_update())
    if cap is None:
        return []
    running = (
        select(func.count())
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(Job.owner == owner, Shard.state == RUNNING)
        .scalar_subquery()
    )
    return [running < cap]


def held_by_quota(session: Session, job_ids: set[str]) -> set[str]:
    """Of `job_ids`, the jobs whose owner is at its quota now (the reaper does not send their shards again)."""
    if not job_ids:
        return set()
    owners = dict(session.execute(select(Job.id, Job.owner).where(Job.id.in_(job_ids))).all())
    full = at_quota(session, set(owners.values()))
    return {job_id for job_id, owner in owners.items() if owner in full}


# --- yields: a running shard hands its GPU to work that outranks it ----------------------------------------------


@dataclass(frozen=True)
class Running:
    shard_id: int
    priority: int
    owner: str
    started_at: float


def yield_reason(session: Session, shard_id: int, after: float) -> str | None:
    """Why the running shard `shard_id` should yield now (its worker saves and hands it back at the next step or
    micro-batch boundary; core.leases.yield_shard), or None. The rule, on the shard's queue Q:

    - Work that outranks a running shard: a queued shard of higher priority, or of equal priority and another owner
      whose GPU-seconds over the fair-share window are fewer by more than `after` (so two owners' long jobs swap at
      most every 2 x `after` seconds, not at every crossing), whose owner is under quota, and that has been queued
      for `after` seconds. Only a shard that has itself run `after` seconds yields.
    - Each such waiting shard takes one victim, the worst running shard on Q it outranks (lowest priority, then the
      owner with the most GPU-seconds, then the latest started), in the claim's order; shards that yielded within
      the last `after` seconds and are still queued count as victims already taken (their workers are taking the
      waiting work), so two workers do not both yield for one shard.
    """
    t = now()
    shard = session.get(Shard, shard_id)
    if after <= 0 or shard is None or shard.state != RUNNING or not shard.started_at or t - shard.started_at < after:
        return None
    queue = session.scalar(select(Job.queue).where(Job.id == shard.job_id))
    waited = session.execute(
        select(Job.priority, Job.owner, func.count(), func.min(Shard.queued_at))
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(*_queued_on(queue), Shard.queued_at <= t - after)
        .group_by(Job.priority, Job.owner)
    ).all()
    if not waited:
        return None
    running = [
        Running(*row)
        for row in session.execute(
            select(Shard.id, Job.priority, Job.owner, Shard.started_at)
            .select_from(Shard)
            .join(Job, Job.id == Shard.job_id)
            .where(Shard.state == RUNNING, Job.queue == queue, Shard.started_at <= t - after)
        ).all()
    ]
    owners = {o for _, o, _, _ in waited} | {r.owner for r in running}
    full = at_quota(session, owners)
    used = gpu_seconds(session, owners)

    def outranks(priority: int, owner: str, r: Running) -> bool:
        if priority != r.priority:
            return priority > r.priority
        return owner != r.owner and used.get(owner, 0.0) + after < used.get(r.owner, 0.0)

    victims = sorted(running, key=lambda r: (r.priority, -used.get(r.owner, 0.0), -r.started_at, r.shard_id))
    taken = session.scalar(
        select(func.count())
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(*_queued_on(queue), Shard.yielded_at > t - after)
    )
    claimants = sorted((w for w in waited if w[1] not in full), key=lambda w: (-w[0], used.get(w[1], 0.0), w[3], w[1]))
    for priority, owner, count, since in claimants:
        for _ in range(count):
            victim = next((r for r in victims if outranks(priority, owner, r)), None)
            if victim is None:
                break
            victims.remove(victim)
            if taken:  # a shard that yielded a moment ago frees a worker for this one
                taken -= 1
                continue
            if victim.shard_id == shard_id:
                return _why(priority, owner, t - since, victim, used)
    return None


def _why(priority: int, owner: str, waited: float, mine: Running, used: dict[str, float]) -> str:
    if priority > mine.priority:
        return f"{name(priority)}-priority work of {owner} waited {waited:.0f} s"
    return (
        f"fair share: {owner}'s work waited {waited:.0f} s ({used.get(owner, 0.0):.0f} GPU-seconds in the fair-share "
        f"window; {mine.owner} {used.get(mine.owner, 0.0):.0f})"
    )


# --- what users see: a queued job's place, the queues' depth --------------------------------------------------


def place(session: Session, job: Job) -> dict[str, Any] | None:
    """Where a live job with queued shards stands: `shards_ahead` (queued shards the rule takes first, at the
    current GPU-seconds: an estimate, since fair share reorders as work runs), `position` (1 + that) and `waiting`
    (why it does not run now). None when none of its shards is queued."""
    mine = session.scalar(select(func.count()).where(Shard.job_id == job.id, Shard.state == QUEUED))
    if not mine or job.state in STOPPED_JOB_STATES:
        return None
    classes = waiting(session, job.queue, count_shards=True)
    own = next((w for w in classes if w.priority == job.priority and w.owner == job.owner), None)
    if own is None:
        return None
    ahead = sum(w.shards for w in classes[: classes.index(own)] if not w.at_quota)
    ahead += session.scalar(
        select(func.count())
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(
            *_queued_on(job.queue),
            Job.priority == job.priority,
            Job.owner == job.owner,
            or_(Job.created_at < job.created_at, (Job.created_at == job.created_at) & (Job.id < job.id)),
        )
    )
    if own.at_quota:
        daily = daily_caps(session, {job.owner}).get(job.owner)
        if job.owner in over_daily(session, {job.owner}):
            reason = f"waiting: owner quota ({daily:g} GPU-seconds per day used; it frees as runs leave the 24 h)"
        else:
            reason = f"waiting: owner quota ({caps(session, {job.owner}).get(job.owner)} running shards at most)"
    elif any(w.priority > job.priority and not w.at_quota for w in classes):
        reason = "waiting: higher-priority work"
    elif ahead:
        reason = "waiting: fair share (owners with fewer recent GPU-seconds, and this owner's older jobs, go first)"
    else:
        reason = "waiting: next for a free worker"
    return {"position": ahead + 1, "shards_ahead": ahead, "shards_queued": mine, "waiting": reason}


def queue_depth(session: Session) -> list[tuple[str, str, str, int]]:
    """(queue, priority name, owner, queued shards) over every queue: `/metrics`' gpujobs_queued_shards."""
    rows = session.execute(
        select(Job.queue, Job.priority, Job.owner, func.count())
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(Shard.state == QUEUED, Job.state.not_in(STOPPED_JOB_STATES))
        .group_by(Job.queue, Job.priority, Job.owner)
    ).all()
    return [(q, name(p), o, n) for q, p, o, n in rows]


# --- quotas (`gpujobs quota set/show`, admin only) --------------------------------------------------------------


LIMITS = ("max_running_shards", "max_gpu_seconds_per_day")  # a quota's fields: a value caps, None removes the cap


def set_quota(session: Session, owner: str, *, by: str, **limits: int | float | None) -> Quota | None:
    """Set the `limits` given (a subset of LIMITS) of `owner`'s quota; the others stay as they are. A quota left with
    no cap is deleted (None), so `quotas` lists only owners with a cap or with work."""
    check_owner(owner)
    unknown = set(limits) - set(LIMITS)
    if unknown or not limits:
        raise InvalidInput(f"give one or more of {', '.join(LIMITS)} (null removes a cap); got {sorted(limits)}")
    for field, value in limits.items():
        whole = field == "max_running_shards"
        number = isinstance(value, int) if whole else isinstance(value, int | float)
        if value is not None and (isinstance(value, bool) or not number or value < 0):
            raise InvalidInput(
                f"{field} {value!r}: give a {'whole number' if whole else 'number'} >= 0 (0 holds every new shard "
                "of the owner), or null for no cap"
            )
    quota = session.get(Quota, owner)
    if all(limits.get(f, getattr(quota, f, None)) is None for f in LIMITS):
        if quota is not None:
            session.delete(quota)
            session.flush()
        return None
    if quota is None:
        quota = Quota(owner=owner)
        session.add(quota)
    for field, value in limits.items():
        setattr(quota, field, value)
    quota.updated_at, quota.updated_by = now(), by
    session.flush()
    return quota


def quota_view(session: Session, owner: str) -> dict[str, Any]:
    quota = session.get(Quota, owner)
    queued = session.scalar(
        select(func.count())
        .select_from(Shard)
        .join(Job, Job.id == Shard.job_id)
        .where(Job.owner == owner, Shard.state == QUEUED, Job.state.not_in(STOPPED_JOB_STATES))
    )
    return {
        "owner": owner,
        "max_running_shards": quota.max_running_shards if quota else None,
        "max_gpu_seconds_per_day": quota.max_gpu_seconds_per_day if quota else None,
        "running_shards": running_shards(session, {owner}).get(owner, 0),
        "queued_shards": queued,
        "gpu_seconds": round(gpu_seconds(session, {owner}).get(owner, 0.0), 3),
        "gpu_seconds_day": round(gpu_seconds(session, {owner}, window=DAY).get(owner, 0.0), 3),
        "updated_at": quota.updated_at if quota else None,
        "updated_by": quota.updated_by if quota else None,
    }


def quotas(session: Session) -> list[dict[str, Any]]:
    """Every owner with a quota, or with shards queued or running."""
    busy = session.scalars(
        select(Job.owner).join(Shard, Shard.job_id == Job.id).where(Shard.state.in_((QUEUED, RUNNING))).distinct()
    )
    owners = set(session.scalars(select(Quota.owner))) | set(busy)
    return [quota_view(session, owner) for owner in sorted(owners)]
