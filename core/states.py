"""Job, shard and row states, and which changes are allowed.

The only code that changes a job's or a shard's state is `core.store.transition`, which makes a conditional
UPDATE (`WHERE state IN allowed sources`) and writes an event in the same transaction. A transition that is
not in these tables, or that lost a race, raises `IllegalTransition`.

Job states map one to one onto the OpenAI Batch states (queued has no OpenAI twin and shows as validating):

    queued → validating → running → finalizing → succeeded | failed
    any live state → cancelling → cancelled
    finalizing → cancelled (a `retry --failed-only` of a cancelled job, while rows the cancel left are not run)
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    queued = "queued"
    validating = "validating"
    running = "running"
    finalizing = "finalizing"
    succeeded = "succeeded"
    failed = "failed"
    cancelling = "cancelling"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (JobState.succeeded, JobState.failed, JobState.cancelled)


class ShardState(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in (ShardState.succeeded, ShardState.failed, ShardState.cancelled)


class RowState(str, Enum):
    pending = "pending"
    succeeded = "succeeded"
    failed = "failed"


J, S = JobState, ShardState
LIVE_JOB_STATES = (J.queued, J.validating, J.running, J.finalizing)

# target state -> the states it may be reached from
JOB_TRANSITIONS: dict[JobState, tuple[JobState, ...]] = {
    J.validating: (J.queued,),
    J.running: (J.validating,),
    J.finalizing: (J.running,),
    J.succeeded: (J.finalizing,),
    # a job fails at validation, when its shards cannot run, or while finalizing
    J.failed: (J.queued, J.validating, J.running, J.finalizing),
    J.cancelling: LIVE_JOB_STATES,
    # finalizing: a `retry --failed-only` of a cancelled job ends cancelled again while rows the cancel left remain
    J.cancelled: (J.cancelling, J.finalizing),
    # `gpujobs retry` re-opens a finished job under the same id
    J.queued: (J.succeeded, J.failed, J.cancelled),
}

SHARD_TRANSITIONS: dict[ShardState, tuple[ShardState, ...]] = {
    S.running: (S.queued,),  # claimed under a lease
    S.queued: (S.running, S.succeeded, S.failed, S.cancelled),  # lease expired / handed back, or retried
    S.succeeded: (S.running,),
    S.failed: (S.queued, S.running),  # attempts exhausted, or the engine gave up
    S.cancelled: (S.queued, S.running),
}


def allowed_sources(kind: str, target: str) -> tuple[str, ...]:
    table = JOB_TRANSITIONS if kind == "job" else SHARD_TRANSITIONS
    enum = JobState if kind == "job" else ShardState
    return tuple(s.value for s in table.get(enum(target), ()))
