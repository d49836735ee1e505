"""worker/committer.py: a generation shard's micro-batches committed on a thread of their own, in order, with the
engine free to go on while a commit runs. Real threads; every wait is on an event, none on the clock. The runner
around it (worker/runtime.py `_run`) runs in every test that runs a generation job on a worker."""

from __future__ import annotations

import threading

import pytest

from core.errors import LeaseLost
from worker import committer
from worker.committer import Committer

WAIT = 60  # a bound for a hung thread, never reached by one that works


def test_put_returns_while_a_commit_runs_and_commits_keep_their_order():
    entered, release = threading.Event(), threading.Event()
    got: list[int] = []

    def commit(batch: int) -> bool:
        if batch == 0:
            entered.set()
            assert release.wait(WAIT)
        got.append(batch)
        return True

    c = Committer(commit)
    c.put(0)
    assert entered.wait(WAIT)
    for batch in range(1, committer.DEPTH + 1):  # the first commit still runs: the engine hands over DEPTH more
        c.put(batch)
    assert got == []
    release.set()
    c.close()
    assert got == list(range(committer.DEPTH + 1))


def test_put_blocks_once_depth_batches_wait():
    release = threading.Event()
    c = Committer(lambda batch: release.wait(WAIT))
    for batch in range(committer.DEPTH + 1):  # one in the commit, DEPTH waiting
        c.put(batch)
    handed = threading.Event()
    extra = threading.Thread(target=lambda: (c.put("one more"), handed.set()))
    extra.start()
    assert not handed.wait(0.5)  # still blocked (a wrong answer here could only come from a put that did not block)
    release.set()
    assert handed.wait(WAIT)
    extra.join(WAIT)
    c.close()


def test_a_stopping_job_drops_the_batches_after_it():
    got: list[int] = []

    def commit(batch: int) -> bool:
        got.append(batch)
        return batch != 1  # batch 1 finds the job stopping

    c = Committer(commit)
    for batch in range(4):
        c.put(batch)
    c.close()
    assert got == [0, 1] and c.stopped and c.halted


def test_a_lost_lease_is_raised_in_the_engine_thread_and_nothing_after_it_is_committed():
    got: list[int] = []
    failed = threading.Event()

    def commit(batch: int) -> bool:
        if batch == 1:
            failed.set()
            raise LeaseLost("the lease is another worker's")
        got.append(batch)
        return True

    c = Committer(commit)
    c.put(0)
    c.put(1)
    assert failed.wait(WAIT)
    with pytest.raises(LeaseLost):
        c.put(2)  # raised at the next hand-over, so the engine stops there
    with pytest.raises(LeaseLost):
        c.close()
    assert got == [0] and c.halted


def test_close_waits_for_every_batch_handed_over():
    got: list[int] = []
    c = Committer(lambda batch: got.append(batch) is None)
    for batch in range(3):
        c.put(batch)
    c.close()
    assert got == [0, 1, 2] and not c.halted
