"""The one place that sends work to Redis: send a shard and mark it sent, send it again, and the reaper's pass
over shards.

A shard is sent only after the transaction that queued it has committed, and marked sent (`enqueued_at`) in a
transaction of its own once the message is in Redis. So a crash or a Redis outage between the commit and the send
loses nothing: a queued shard never sent (`enqueued_at IS NULL`) is found and sent by the reaper. Duplicate
messages are harmless: a claim of a shard that is done, or leased by a live worker, does nothing (core/leases.py).

The reaper (`reap`, run on every worker's heartbeat through `core.jobs.reap`, safe to run many at once) sends
never-sent shards, re-queues shards whose lease expired, sends again shards whose message was lost in flight (or
taken by a claim that found its owner at quota: sent again once the owner is under it), and after a Redis restart
sends every queued shard. Each re-queue and re-send is a conditional update: only the
process that won it sends the message.
"""

from __future__ import annotations

import logging

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core import registry, scheduling
from core.db import session_scope
from core.errors import IllegalTransition, ServiceUnavailable
from core.models import Job, Shard
from core.queue import TASK_RUN_SHARD, redis_client, waiting_messages
from core.queue import send as send_task
from core.settings import get_settings
from core.states import JobState, ShardState
from core.store import add_event, now, transition

log = logging.getLogger(__name__)
BROKER_EPOCH_KEY = "gpujobs:broker-epoch"


def send(shard_ids: list[int], queue: str) -> None:
    """Send one task per shard, each marked sent in its own transaction once Redis has it. A send that fails
    raises (ServiceUnavailable) and leaves that shard and the rest unsent: the reaper sends them later."""
    for shard_id in shard_ids:
        send_task(TASK_RUN_SHARD, [shard_id], queue)
        with session_scope() as session:
            mark_enqueued(session, [shard_id])


def resend(shard_id: int) -> None:
    """Send a shard that went back to the queue (handed back, or its attempt failed) to its job's queue again."""
    send([shard_id], queue_of(shard_id))


def send_again(shard_id: int) -> None:
    """`resend`, after the commit that put the shard back in the queue. When Redis cannot take the message (it is
    down, or gone with a stopped stack) the shard stays queued and unsent (`enqueued_at` NULL) and the reaper sends
    it once Redis is back; raising would make the caller take its committed hand-back for a failure of its own (a
    worker stopping because Redis went away wrote a failed attempt on a shard it had handed back)."""
    try:
        resend(shard_id)
    except ServiceUnavailable as exc:
        log.warning(
            "shard %s is back in the queue but not sent (%s): the reaper sends it once Redis is back", shard_id, exc
        )


def wake(owner: str) -> None:
    """A shard of `owner` ended. When she has a cap on running shards, the messages of her queued shards may have
    found her at it and been dropped (core/scheduling.py): one message now for her next queued shard lets a capped
    owner run at the pace of her shards, not of the reaper's pass (a lease after the send). Nothing for an owner
    without a cap; a message that finds nothing it may take does nothing."""
    with session_scope() as session:
        if not scheduling.caps(session, {owner}):
            return
        nxt = session.execute(
            select(Shard.id, Job.queue)
            .join(Job, Job.id == Shard.job_id)
            .where(Job.owner == owner, Job.state == JobState.running.value, Shard.state == ShardState.queued.value)
            .order_by(Job.priority.desc(), Job.created_at, Job.id, Shard.idx)
            .limit(1)
        ).first()
    if nxt is None:
        return
    try:
        send_task(TASK_RUN_SHARD, [nxt.id], nxt.queue)
    except ServiceUnavailable as exc:  # a shortcut only: the reaper's pass sends it a lease after its last send
        log.warning("could not wake %s's next shard %s (%s): the reaper sends it", owner, nxt.id, exc)


def queue_of(shard_id: int) -> str:
    with session_scope() as session:
        return session.scalar(select(Job.queue).join(Shard, Shard.job_id == Job.id).where(Shard.id == shard_id))


def mark_enqueued(session: Session, shard_ids: list[int]) -> None:
    session.execute(update(Shard).where(Shard.id.in_(shard_ids)).values(enqueued_at=now()))


# --- the reaper ------------------------------------------------------------------------------------------------


def reap() -> None:
    """Send never-sent shards, re-queue shards whose lease expired, and send again shards whose message was lost.

    After a Redis restart (its data, our messages included, are gone) every queued shard is sent again. Two
    reapers may both send a shard: the second message finds the shard leased or done and does nothing.
    """
    settings = get_settings()
    broker_restarted = _claim_broker_epoch()
    with session_scope() as session:
        registry.mark_lost(session, settings.worker_timeout)
        cutoff = now() if broker_restarted else now() - settings.lease_seconds
        shards = queued_shards(session, older_than=cutoff, unsent_only=not broker_restarted)
        to_send = [(s.id, s.job_id) for s in shards]
        for shard in expired_shards(session):
            if requeue_expired(session, shard):
                to_send.append((shard.id, shard.job_id))
        # A message Redis handed to a host as it dropped off the network is gone (kombu records it as unacked only
        # once read): a shard still queued a lease after its send, while its queue is empty, is sent again.
        stale = sent_long_ago(session, sent_before=now() - settings.lease_seconds)
        empty = {q for q in {q for _, q in stale} if waiting_messages(q) == 0}
        # a shard held by its owner's quota stays queued on purpose: its message is sent once the owner is under it
        held = scheduling.held_by_quota(session, {shard.job_id for shard, _ in stale})
        for shard, queue in stale:
            if queue in empty and shard.job_id not in held and mark_resent(session, shard):
                to_send.append((shard.id, shard.job_id))
    for shard_id, job_id in to_send:
        log.info("%s reaper: enqueuing shard %s", job_id, shard_id)
        resend(shard_id)


def _claim_broker_epoch() -> bool:
    """True for the one process that first sees an empty Redis (a fresh or restarted server lost its messages).

    That process re-sends every queued shard; duplicate messages are harmless (a claim is idempotent).
    """
    # a connect timeout too: the reaper runs in the heartbeat thread, which must not wait on an unreachable host
    # for the kernel's SYN retries (about 2 min) while the lease it renews expires
    client = redis_client(socket_connect_timeout=5, socket_timeout=5)
    return bool(client.set(BROKER_EPOCH_KEY, str(now()), nx=True))


def expired_shards(session: Session) -> list[Shard]:
    return list(
        session.scalars(
            select(Shard)
            .where(Shard.state == ShardState.running.value, Shard.lease_expires_at < now())
            .limit(100)
            .with_for_update(skip_locked=True)  # a row locked by a session of a partitioned host: next beat
        ).all()
    )


def requeue_expired(session: Session, shard: Shard, *, by: str = "the reaper") -> bool:
    """Back to the queue, unsent, for a shard whose lease expired, with an event naming `by`. True if this process
    won: the reaper then sends its message; a claim (`core.leases`) sends none, it goes on to pick a shard, and the
    reaper sends this one if that claim took another. False when the lease was renewed or another process
    re-queued it first."""
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
    add_event(session, shard.job_id, f"shard {shard.idx} re-enqueued by {by}", shard_id=shard.id)
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
    add_event(
        session,
        shard.job_id,
        f"shard {shard.idx} sent again: queued since its send, and its queue is empty (the message was lost in flight)",
        shard_id=shard.id,
    )
    return True
