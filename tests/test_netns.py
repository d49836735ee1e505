"""Across hosts, for real: API, Redis and PostgreSQL in one network namespace, a worker host in each of two others
(tests/netns.py draws the topology). Cut one worker host off the network in the middle of a job: the other host
finishes the job, every row has one result written once, and the cut host, once it is back, writes nothing for
the shard it lost and is registered online again.

Needs root and iproute2 (`ip netns`), redis-server and the PostgreSQL server binaries: skipped on a laptop without
them, failed under CI=true.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import pytest
from sqlalchemy import func, select

from core.models import Job, JobEvent, JobRow, Shard, Worker
from tests import netns
from tests.conftest import registered, reset_caches, wait_for
from tests.services import require_service

pytestmark = pytest.mark.slow

ROWS, SHARD_ROWS, BATCH_ROWS, NEW_TOKENS = 128, 32, 4, 48
# Stated bound, default settings: A's lease runs out at most 20 s (JOBS_LEASE_SECONDS) after its last renewal,
# B's reaper sees that within one heartbeat (20 / 3 s), then B runs the rows A left (a second or two). ~30 s;
# twice that for a loaded 2-core machine. B also runs every shard nobody had taken yet, which is why there are
# only 4 shards: with 8, on a 2-core machine shared with three other tests, B's own rows alone took over 60 s.
FINISH_AFTER_CUT_S = 60.0
# B's reaper marks a silent worker lost after JOBS_WORKER_TIMEOUT (30 s) + at most one heartbeat.
LOST_AFTER_CUT_S = 60.0
# With the network back, A's stuck connections resume at their next TCP retransmission (nothing in the product sets
# a socket timeout or keepalive): within a second after a "cable" cut, ~25-30 s after a "switch" cut this long.
RECOVER_AFTER_RESTORE_S = 120.0


@pytest.fixture
def cluster(monkeypatch, tmp_path) -> Iterator[netns.Cluster]:
    """The hub (PostgreSQL, Redis) and two empty worker hosts. This test process reaches the hub over the bridge
    and uses the hub's store and Redis as its own settings. Logs end up in tmp_path/cluster-logs."""
    reason = netns.unavailable()
    if reason:
        require_service("a cluster of network namespaces", reason)
    pg_bin = netns.pg_bindir()
    if pg_bin is None:
        require_service("PostgreSQL server", "no initdb/pg_ctl or no postgres user (apt install postgresql)")
    try:
        from core.embedded import find_redis_server

        find_redis_server()
        import psycopg  # noqa: F401
    except (RuntimeError, ImportError) as exc:
        require_service("redis-server and psycopg", str(exc))

    c = netns.new_cluster(("a", "b"))
    try:
        c.create_network()
        c.start_postgres(pg_bin)
        c.start_redis()
        for key in [k for k in os.environ if k.startswith("JOBS_")]:
            monkeypatch.delenv(key)
        for key, value in c.env("home-test").items():
            if key.startswith("JOBS_"):
                monkeypatch.setenv(key, value)
        reset_caches()
        from core import auth
        from core.db import session_scope, upgrade

        upgrade()
        with session_scope() as session:
            c.token = auth.create_token(session, owner="alice", scopes=["admin", "user"], name="netns test")
        yield c
    finally:
        reset_caches()  # close this process's connections before PostgreSQL goes
        logs = tmp_path / "cluster-logs"
        logs.mkdir(exist_ok=True)
        c.close(keep_logs=logs)


def session():
    from core.db import session_scope

    return session_scope()


def worker(pid: int) -> Worker:
    with session() as s:
        return s.scalars(select(Worker).where(Worker.pid == pid)).one()


def rows_of(job_id: str) -> list[JobRow]:
    with session() as s:
        return list(s.scalars(select(JobRow).where(JobRow.job_id == job_id).order_by(JobRow.idx)).all())


def settled(job_id: str) -> list[tuple]:
    return [(r.idx, r.state, r.worker, r.finished_at, r.executions, r.output) for r in rows_of(job_id)]


def job_state(job_id: str) -> str:
    with session() as s:
        return s.get(Job, job_id).state


def progress(job_id: str, a: str, b: str) -> tuple[int, int, Shard | None, int]:
    """Rows committed by A and by B, the shard A holds (if any) and its pending rows."""
    with session() as s:
        by_worker = dict(
            s.execute(
                select(JobRow.worker, func.count())
                .where(JobRow.job_id == job_id, JobRow.state == "succeeded")
                .group_by(JobRow.worker)
            ).all()
        )
        shard = s.scalars(
            select(Shard).where(Shard.job_id == job_id, Shard.state == "running", Shard.lease_owner == a)
        ).first()
        pending = (
            0
            if shard is None
            else s.scalar(
                select(func.count()).where(
                    JobRow.job_id == job_id,
                    JobRow.idx >= shard.row_start,
                    JobRow.idx < shard.row_end,
                    JobRow.state == "pending",
                )
            )
        )
    return by_worker.get(a, 0), by_worker.get(b, 0), shard, pending


def cut_a_mid_shard(c: netns.Cluster, how: str, job_id: str, a: str, b: str, procs) -> Shard:
    """Cut A off right after one of its commits, while it holds a shard with at least four micro-batches to go.

    Right after a commit A computes the next micro-batch (no database work), so the cut does not land inside one
    of its transactions. A cut there leaves the shard's row lock held by A's session on the server, and today that
    blocks every other worker's reaper (and with it their heartbeats) until the network comes back: workers set no
    lock_timeout and no idle_in_transaction_session_timeout. That is a product gap, not what this test is about.
    """
    deadline, last = time.monotonic() + 120, None
    while time.monotonic() < deadline:
        done_a, done_b, shard, pending = progress(job_id, a, b)
        if last is not None and done_a > last and done_b and shard is not None and pending >= 4 * BATCH_ROWS:
            c.cut("a", how)
            return shard
        last = done_a
        for p in procs:
            assert p.alive(), f"process {p.pid} died:\n{p.tail()}"
        time.sleep(0.01)
    raise AssertionError(f"no moment with both hosts committed and A mid-shard in 120 s: {progress(job_id, a, b)}")


@pytest.mark.parametrize("how", ["cable", "switch"])
def test_cut_worker_host_mid_job_other_host_finishes_and_cut_host_writes_nothing(cluster, tiny_model, tmp_path, how):
    """Cut host A off while it holds a half-done shard ("cable": its link loses carrier; "switch": its link stays
    up and its frames go nowhere): host B finishes the job within FINISH_AFTER_CUT_S, every row has exactly one
    result executed once, rows finished after the cut are all B's, B marks A lost; with the network back, A's late
    commit is refused by the lease check (the store does not change) and A heartbeats again, registered online."""
    from api.client import Client

    c, t0 = cluster, time.monotonic()
    proc_a, proc_b = c.spawn_worker("a", wait=False), c.spawn_worker("b", wait=False)
    api = c.start_api(model_roots=[tiny_model.parent], data_roots=[tmp_path])
    for host, proc in (("a", proc_a), ("b", proc_b)):  # both consume: the first two shards go one to each host
        wait_for(
            lambda host=host, proc=proc: registered(c.database_url, proc.pid) and c.consuming(host),
            90,
            f"the worker on host-{host} to register and consume",
            procs=[proc],
        )
    wa, wb = worker(proc_a.pid), worker(proc_b.pid)
    assert (wa.host, wb.host) == ("host-a", "host-b")
    a, b = wa.name, wb.name
    started = time.monotonic() - t0

    data = tmp_path / "rows.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"Row {i}: tell me about the sky.", "custom_id": f"r{i}"}) + "\n" for i in range(ROWS)
        )
    )
    client = Client(url=c.api_url, token=c.token)  # over the bridge, to the API in the hub
    job_id = client.submit(
        {
            "model": str(tiny_model),
            "input": client.upload(data)["id"],
            "gpus": 0,
            "max_new_tokens": NEW_TOKENS,
            "ignore_eos": True,
            "shard_rows": SHARD_ROWS,
            "batch_rows": BATCH_ROWS,
        }
    )["id"]

    shard = cut_a_mid_shard(c, how, job_id, a, b, [proc_a, proc_b, api])
    cut_at, cut_t = time.time(), time.monotonic()
    before = {r.idx: r.worker for r in rows_of(job_id) if r.state == "succeeded"}
    assert 0 < len(before) < ROWS and set(before.values()) == {a, b}

    # --- B finishes the job, A's half-done shard included ---
    try:
        wait_for(
            lambda: job_state(job_id) in ("succeeded", "failed", "cancelled"),
            FINISH_AFTER_CUT_S,
            "the job to finish on host B",
            interval=0.2,
            procs=[proc_b, api],
        )
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{c.diagnostics()}") from None
    finished_after = time.monotonic() - cut_t
    assert job_state(job_id) == "succeeded"
    rows = rows_of(job_id)
    assert len(rows) == ROWS and all(r.state == "succeeded" and r.completion_tokens == NEW_TOKENS for r in rows)
    assert {r.executions for r in rows} == {1}, "a row was executed twice"
    after = {r.idx: r.worker for r in rows if r.idx not in before}
    assert after and set(after.values()) == {b}, f"rows finished after the cut by someone else than {b}"
    assert {r.worker for r in rows if r.finished_at > cut_at} == {b}
    assert all(r.finished_at < cut_at for r in rows if r.worker == a)
    with session() as s:
        lost = s.get(Shard, shard.id)
        messages = [e.message for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id)).all()]
    assert lost.state == "succeeded" and lost.attempts == 2
    assert any(f"lease of {a} expired" in m for m in messages), messages
    assert sum(m.startswith("job → succeeded") for m in messages) == 1

    # --- B's reaper marks the silent host lost; then A is reconnected ---
    wait_for(
        lambda: worker(proc_a.pid).state == "lost",
        LOST_AFTER_CUT_S - (time.monotonic() - cut_t),
        "host A to be marked lost",
        procs=[proc_b],
    )
    cut_for = time.monotonic() - cut_t
    store = settled(job_id)
    c.restore("a", how)
    restored_t = time.monotonic()
    restored_at = time.time()

    def a_back_and_done() -> bool:  # a heartbeat after the restore, and A's shard is over (current shard None)
        w = worker(proc_a.pid)
        return w.state == "online" and w.heartbeat_at > restored_at and w.current_shard_id is None

    wait_for(
        a_back_and_done,
        RECOVER_AFTER_RESTORE_S,
        "host A to heartbeat again with its shard given up",
        interval=0.5,
        procs=[proc_a],
    )
    recovered_after = time.monotonic() - restored_t
    log = proc_a.log.read_text(errors="replace")
    refused = f"is no longer leased by {a}" in log or "lost the lease of shard" in log
    # A's late commit is refused by the lease check, or (libpq's tcp_user_timeout and keepalives notice a cut within
    # ~20 s, and a "cable" cut fails new connections at once) its attempt ends on the network error instead: either
    # way it wrote nothing, which the store comparison below checks
    assert refused or "database cannot be reached" in log, proc_a.tail(60)
    time.sleep(1)  # a commit that slipped past the lease check would have landed by now
    assert settled(job_id) == store, "host A wrote rows after it lost its lease"
    assert job_state(job_id) == "succeeded"
    print(
        f"\nnetns[{how}]: subnet {netns.NET}.{c.subnet}.0/24; workers+API up in {started:.1f} s; job finished "
        f"{finished_after:.1f} s after the cut ({len(before)} rows committed before it, {len(after)} after, all "
        f"by B); A marked lost, off the network {cut_for:.1f} s; A heartbeat again {recovered_after:.1f} s after "
        f"the restore; A's late commit {'refused by the lease check' if refused else 'failed on the network'}"
    )


class MessageLost(AssertionError):
    """A shard's only message went to a host that vanished, and nothing sent it again."""


def test_message_popped_by_a_host_that_drops_off_is_sent_again(cluster, tiny_model):
    """Host A waits in BRPOP; its network goes ("switch") and the job's only message is pushed at that instant, so
    Redis pops it into A's lost reply. Host B, idle, must still get the shard: the job finishes on B."""
    import redis

    from api import service

    c = cluster
    r = redis.Redis.from_url(c.redis_url, socket_timeout=10)
    data = c.workdir / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Row {i}"}) + "\n" for i in range(4)))
    # Lease 6 s (heartbeat and reaper every 2 s) on every host of this cluster, so the wait below is short.
    fast = {"JOBS_LEASE_SECONDS": "6"}
    # This Redis has been in use: a reaper claimed its epoch long ago (else the first reaper to start would re-send
    # every queued shard, this one included, as after a Redis restart).
    r.set("gpujobs:broker-epoch", str(time.time()))
    spec = {"model": str(tiny_model), "input": str(data), "gpus": 0, "max_new_tokens": 4}

    # A's BRPOP waits 10 s in Redis (not 1 s): the push below follows MONITOR's report of it, which came 1.7 s late on
    # a loaded machine, after a 1 s BRPOP had already timed out. The job is submitted only then (its send is the
    # push): a message held back while A started would be re-sent by a reaper once a lease passed with its queue
    # empty (seen on CI, where A's start outlasts the 6 s lease), and the scenario would not happen.
    proc_a = c.spawn_worker("a", **fast, JOBS_BROKER_WAIT_SECONDS="10")
    pusher = redis.Redis.from_url(c.redis_url, socket_timeout=10)  # its own connection, open before it counts
    pusher.ping()
    job_id = None
    # Up to 3 tries: on a loaded machine A's pending BRPOP was sometimes gone (it timed out or A's connection was
    # reset) when the push landed, and the message stayed in the list; the scenario then did not happen, so it is
    # parked, A's network restored, and the next BRPOP of A is used.
    for attempt in range(3):
        deadline = time.monotonic() + 60
        with redis.Redis.from_url(c.redis_url, socket_timeout=10).monitor() as monitor:
            for command in monitor.listen():  # the instant A sends BRPOP (it then waits up to 10 s server-side)
                if command["client_address"] == c.addr("a") and command["command"].upper().startswith("BRPOP"):
                    c.cut("a", "switch")
                    if job_id is None:
                        job_id = service.submit(owner="t", spec_data=spec)["id"]
                    else:
                        pusher.lmove("gpujobs-test:parked", "cpu", "LEFT", "RIGHT")
                    pushed = time.time() - float(command["time"])
                    break
                assert time.monotonic() < deadline and proc_a.alive(), f"A never waited in BRPOP:\n{proc_a.tail()}"
        try:
            wait_for(lambda: r.llen("cpu") == 0, 10, "Redis to hand the message to A's pending BRPOP")
            break
        except AssertionError:
            assert attempt < 2, (
                f"Redis never handed the message to A's pending BRPOP in 3 tries (the last pushed "
                f"{pushed:.3f} s after A sent it; it waits 10 s)"
            )
            assert r.llen("cpu") == 1, f"{r.llen('cpu')} messages in the queue: a reaper sent the shard again"
            pusher.lmove("cpu", "gpujobs-test:parked", "RIGHT", "LEFT")
            c.restore("a", "switch")
    assert r.hlen("unacked") == 0  # kombu would only record it once A read the reply

    proc_b = c.spawn_worker("b", **fast)
    try:
        wait_for(lambda: job_state(job_id) == "succeeded", 20, "the job to finish on host B", procs=[proc_b])
    except AssertionError as exc:
        with session() as s:
            shard = s.scalars(select(Shard).where(Shard.job_id == job_id)).one()
        raise MessageLost(
            f"{exc}\nshard {shard.id} is {shard.state}, sent at {shard.enqueued_at}, queue length "
            f"{r.llen('cpu')}, unacked {r.hlen('unacked')}: its message is gone"
        ) from None
