"""Faults with real processes: a shard that kills its worker every time, SIGTERM mid-shard, Redis's visibility
timeout shorter than a shard, and a Redis restart mid-job. Each has a stated outcome and loses nothing. Also the
JOBS_REDIS_URL a worker is given: a password Redis refuses, a unix socket in either library's spelling."""

from __future__ import annotations

import signal
import time

import pytest
from sqlalchemy import select

from api import service, views
from core import exits
from core.db import session_scope
from core.errors import ServiceUnavailable
from core.models import JobRow, Worker
from core.queue import REDIS_URL_FORMS, broker_url, client_url, masked
from tests.conftest import reset_caches, wait_for
from tests.services import socket_redis  # noqa: F401
from tests.test_recovery import job_state, long_spec, row_counts, write_dataset


def executions(job_id: str) -> list[int]:
    with session_scope() as session:
        return list(session.scalars(select(JobRow.executions).where(JobRow.job_id == job_id)).all())


def test_a_shard_that_kills_its_worker_every_time_fails_after_the_attempt_cap(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """A worker that dies on every micro-batch (restarted each time, as systemd would) makes the shard fail with
    "gave up after 3 attempts" instead of looping; the job fails with that reason."""
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 8)))
    deadline = time.monotonic() + 240
    restarts = 0
    while job_state(job["id"]) not in ("failed", "succeeded") and time.monotonic() < deadline:
        worker = spawn_worker([], JOBS_TEST_FAULTS="kill@batch", JOBS_LEASE_SECONDS="3")
        while worker.alive() and job_state(job["id"]) not in ("failed", "succeeded"):
            time.sleep(0.2)
        worker.stop()
        restarts += 1
    final = views.get(job["id"], owner=None)
    assert final["state"] == "failed"
    assert "gave up after 3 attempts" in final["error"]
    assert final["rows"]["failed"] == 8 and restarts >= 3
    assert executions(job["id"]) == [0] * 8  # nothing was ever committed, nothing half-written


def test_sigterm_hands_back_the_shard_and_another_worker_finishes_it(tmp_path, jobs_env, spawn_worker, tiny_model):
    """SIGTERM mid-shard: the worker stops after its current micro-batch, hands the shard back without counting
    an attempt, and exits; another worker finishes the job; every row ran once."""
    first = spawn_worker([])
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 240), shard_rows=240)
    )
    wait_for(lambda: row_counts(job["id"]).get("succeeded", 0) >= 8, 120, "first rows", procs=[first])
    first.popen.send_signal(signal.SIGTERM)
    first.popen.wait(30)
    events = [e["message"] for e in views.events(job["id"], owner=None)]
    assert any("handed back" in m for m in events), events
    second = spawn_worker([])
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the job", procs=[second])
    assert set(executions(job["id"])) == {1}


def test_visibility_timeout_shorter_than_a_shard_runs_every_row_once(tmp_path, jobs_env, spawn_worker, tiny_model):
    """With Redis's visibility timeout at 5 s and a shard of 24 s or more, Redis redelivers the message to the
    second worker, which finds the shard leased and takes nothing (nothing else is queued): every row is executed
    once.

    The shard lasts because its worker sleeps 1 s before each of its 24 micro-batch commits (a test fault), not
    because it has many rows to compute: a fast machine cannot end it early, a loaded one spends no CPU on it."""
    env = {"JOBS_VISIBILITY_TIMEOUT": "5", "JOBS_TEST_FAULTS": "sleep_1@batch"}
    workers = [spawn_worker([], **env), spawn_worker([], **env)]
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 96), shard_rows=96)
    )
    wait_for(lambda: job_state(job["id"]) == "succeeded", 240, "the job", procs=workers)
    assert set(executions(job["id"])) == {1}
    with session_scope() as session:
        started = min(r.started_at for r in session.scalars(select(JobRow).where(JobRow.job_id == job["id"])))
        ended = max(r.finished_at for r in session.scalars(select(JobRow).where(JobRow.job_id == job["id"])))
    assert ended - started > 5, "the shard must outlast the visibility timeout for this test to mean anything"
    logs = "".join(w.log.read_text() for w in workers)
    assert "is leased by" in logs and "duplicate message" in logs, (
        "Redis never redelivered the message: the test proved nothing"
    )


@pytest.mark.parametrize("outage", [2, 10])
def test_redis_killed_and_restarted_mid_job_the_job_completes(
    tmp_path, jobs_env, redis_server, spawn_worker, tiny_model, outage
):
    """SIGKILL Redis while a job runs and restart it empty on the same port after `outage` seconds: the workers
    survive (an ack that fails while Redis is down used to end a Celery 5.7 worker), reconnect, the lost queued
    messages are sent again, and the job completes with every row once."""
    workers = [spawn_worker([]), spawn_worker([])]
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 240), shard_rows=24)
    )
    wait_for(lambda: row_counts(job["id"]).get("succeeded", 0) >= 8, 120, "first rows", procs=workers)
    redis_server.kill()
    time.sleep(outage)
    redis_server.start()
    wait_for(lambda: job_state(job["id"]) == "succeeded", 180, "the job", procs=workers)
    assert set(executions(job["id"])) == {1}


def test_broker_retries_setting_is_a_whole_number_of_reconnects(jobs_env, monkeypatch):
    """JOBS_BROKER_RETRIES: Celery's 100 by default, and what the worker's Celery app is given; -1 or `often` is
    refused naming the variable."""
    from core import settings
    from core.queue import get_app

    assert settings.get_settings().broker_retries == 100
    assert get_app().conf.broker_connection_max_retries == 100
    for value, message in (("-1", "0 or more"), ("often", "give a whole number")):
        monkeypatch.setenv("JOBS_BROKER_RETRIES", value)
        reset_caches()
        with pytest.raises(ValueError, match=f"JOBS_BROKER_RETRIES=.*{message}"):
            settings.get_settings()


def test_a_worker_whose_redis_stays_away_past_its_reconnects_exits_1_and_says_why(jobs_env, redis_server, spawn_worker):
    """With JOBS_BROKER_RETRIES=1, Redis killed and not started again: the worker reconnects once, gives up and exits
    1, and its registration is offline with exit code 1 and Celery's reason (the connection it could not make)."""
    worker = spawn_worker([], JOBS_BROKER_RETRIES="1")
    redis_server.kill()
    try:
        assert worker.popen.wait(120) == 1, worker.tail()
    finally:
        redis_server.start()
    with session_scope() as session:
        row = session.scalars(select(Worker).where(Worker.pid == worker.pid)).one()
    assert (row.state, row.exit_code) == ("offline", 1), row.reason
    assert row.reason.startswith("exit code 1: Unrecoverable error") and "connect" in row.reason.lower(), row.reason
    assert "exits with code 1" in worker.tail(5)


def worker_rows(pid: int) -> list[Worker]:
    with session_scope() as session:
        return list(session.scalars(select(Worker).where(Worker.pid == pid)).all())


def test_a_worker_whose_redis_refuses_its_password_exits_77_at_once_and_is_never_online(
    jobs_env, locked_redis, spawn_worker
):
    """A wrong password in JOBS_REDIS_URL is not retried: the worker exits 77 before it loads anything, with one
    line naming the URL (password masked) and JOBS_REDIS_URL to fix, and its only registration is offline with that
    reason (`gpujobs workers` never showed it online)."""
    url = locked_redis.url("wrong-password")
    worker = spawn_worker([], wait=False, JOBS_REDIS_URL=url)
    assert worker.popen.wait(180) == exits.BROKER_REFUSED, worker.tail()  # the bound is a safety net only
    masked = f"redis://:**@127.0.0.1:{locked_redis.server.port}/0"
    log = worker.log.read_text()
    [line] = [x for x in log.splitlines() if "refused this worker's credentials" in x]
    assert f"refusing to start (exit 77): Redis at {masked} refused this worker's credentials" in line, line
    assert "invalid username-password pair" in line and "JOBS_REDIS_URL" in line
    assert "wrong-password" not in log and "Trying again" not in log
    [row] = worker_rows(worker.pid)
    assert (row.state, row.exit_code) == ("offline", exits.BROKER_REFUSED)
    assert row.reason.startswith(f"refused to start: Redis at {masked} refused this worker's credentials"), row.reason
    [shown] = [w for w in views.workers(all=True) if w["pid"] == worker.pid]
    assert (shown["state"], shown["exit_code"]) == ("offline", 77)


def test_a_worker_whose_redis_password_changes_exits_77_at_its_reconnect_instead_of_retrying(
    jobs_env, locked_redis, spawn_worker
):
    """A worker that started with the right password, whose Redis then changes it and drops its connections, exits 77
    at its first refused reconnect (not JOBS_BROKER_RETRIES retries over 45 minutes), offline with the reason."""
    worker = spawn_worker([], JOBS_REDIS_URL=locked_redis.url(locked_redis.password))
    locked_redis.client().config_set("requirepass", "rotated-password")
    locked_redis.client("rotated-password").client_kill_filter(_type="normal", skipme=True)
    assert worker.popen.wait(180) == exits.BROKER_REFUSED, worker.tail()
    [row] = worker_rows(worker.pid)
    assert (row.state, row.exit_code) == ("offline", exits.BROKER_REFUSED)
    masked = f"redis://:**@127.0.0.1:{locked_redis.server.port}/0"
    assert row.reason.startswith(f"Redis at {masked} refused this worker's credentials"), row.reason
    assert f"exits with code {exits.BROKER_REFUSED}" in worker.tail(5)
    assert locked_redis.password not in worker.log.read_text()


def test_only_refused_credentials_end_a_worker_a_redis_that_is_down_is_left_to_the_retries(
    jobs_env, locked_redis, monkeypatch
):
    """The start-up check: a wrong password and no password (NOAUTH) are refusals, with the URL masked; the right
    password is none, and neither is a Redis that is not there (Celery's retries handle that, as before)."""
    from core.queue import get_app
    from worker import broker

    def refusal(url: str) -> str | None:
        monkeypatch.setenv("JOBS_REDIS_URL", url)
        reset_caches()
        return broker.refusal(get_app())

    port = locked_redis.server.port
    assert "(invalid username-password pair" in refusal(locked_redis.url("wrong"))
    assert f"Redis at redis://:**@127.0.0.1:{port}/0 refused" in refusal(locked_redis.url("wrong"))
    assert f"Redis at redis://127.0.0.1:{port}/0 refused this worker's credentials (Authentication required" in (
        refusal(locked_redis.url(None))
    )
    assert refusal(locked_redis.url(locked_redis.password)) is None
    locked_redis.stop()
    assert refusal(locked_redis.url("wrong")) is None


def test_a_unix_socket_url_in_either_spelling_becomes_each_librarys_own_with_its_password_and_database():
    """redis-py reads unix://[:PASSWORD@]/PATH?db=DB and kombu redis+socket://[:PASSWORD@]/PATH?virtual_host=DB (its
    `db=` there is ignored: database 0); each refuses the other's. Either is accepted and turned into both, keeping
    the password (also redis-py's ?password=) and the database; a TCP URL stays as it is."""
    from redis.connection import parse_url

    both = ("unix://:p%40ss@/run/r.sock?db=2", "redis+socket://:p%40ss@/run/r.sock?virtual_host=2")
    for url in both + ("unix:///run/r.sock?password=p%40ss&db=2", "redis+socket://:p%40ss@/run/r.sock?db=2"):
        assert client_url(url) == "unix://:p%40ss@/run/r.sock?db=2", url
        assert broker_url(url) == "redis+socket://:p%40ss@/run/r.sock?virtual_host=2", url
        assert broker_url(client_url(url)) == broker_url(url) and client_url(broker_url(url)) == client_url(url)
        assert "p@ss" not in masked(url) and "p%40ss" not in masked(url)
    parsed = parse_url(client_url(both[1]))
    assert (parsed["path"], parsed["password"], parsed["db"]) == ("/run/r.sock", "p@ss", 2)
    assert client_url("unix://app:pw@/r.sock") == "unix://app:pw@/r.sock?db=0"
    assert broker_url("unix://app:pw@/r.sock") == "redis+socket://app:pw@/r.sock?virtual_host=0"
    for url in ("redis://:pw@10.0.0.5:6379/3", "rediss://:pw@redis.example:6380/0"):
        assert client_url(url) == broker_url(url) == url


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://:pw@10.0.0.5:6379/0", "is not a Redis URL: give redis://"),
        ("10.0.0.5:6379", "is not a Redis URL: give redis://"),
        ("unix://run/redis.sock", "names no host, only the socket's absolute path (three slashes: unix:///run/"),
        ("redis+socket:///r.sock?db=1&virtual_host=2", "give the database once, as a whole number"),
        ("unix:///r.sock?db=one", "give the database once, as a whole number"),
    ],
)
def test_a_redis_url_of_no_accepted_form_is_refused_naming_the_forms(url, says):
    """Neither redis://, rediss://, unix:// nor redis+socket:// (or a socket URL with a host, or two databases): one
    error naming the accepted forms, the password masked, instead of one library's error on every heartbeat."""
    with pytest.raises(ServiceUnavailable, match="JOBS_REDIS_URL=") as caught:
        broker_url(url)
    assert says in str(caught.value) and "pw" not in str(caught.value)
    if "not a Redis URL" in says:
        assert REDIS_URL_FORMS in str(caught.value)


@pytest.mark.parametrize("scheme", ["unix", "redis+socket"])
def test_a_worker_on_a_unix_socket_redis_runs_a_job_in_either_spelling_of_jobs_redis_url(
    tmp_path, jobs_env, socket_redis, spawn_worker, tiny_model, monkeypatch, scheme
):
    """JOBS_REDIS_URL of a Redis on a unix socket, with a password and database 1, in redis-py's spelling
    (unix://...?db=1) or kombu's (redis+socket://...?virtual_host=1): the submit, the worker's Celery consumer and its
    heartbeat's reaper (redis-py) all reach it; the job succeeds, the worker is online and its log has no error; every
    key (kombu's and ours) is in database 1."""
    db = "db" if scheme == "unix" else "virtual_host"
    url = f"{scheme}://:{socket_redis.password}@{socket_redis.path}?{db}=1"
    monkeypatch.setenv("JOBS_REDIS_URL", url)
    reset_caches()
    worker = spawn_worker([], JOBS_REDIS_URL=url)
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 4)))
    wait_for(lambda: job_state(job["id"]) in ("succeeded", "failed"), 180, "the job", procs=[worker])
    assert views.get(job["id"], owner=None)["state"] == "succeeded"

    def beat() -> float:
        [shown] = [w for w in views.workers() if w["pid"] == worker.pid]
        assert shown["state"] == "online", shown
        return shown["heartbeat_at"]

    # a beat recorded after this one means the reaper of this one (redis-py, after the beat's SQL write) has run
    first = beat()
    wait_for(lambda: beat() > first, 60, "the worker's next heartbeat", procs=[worker])
    log = worker.log.read_text()
    assert "heartbeat of" not in log and "Traceback" not in log and " ERROR " not in log, worker.tail(60)
    assert socket_redis.client(db=0).dbsize() == 0
    keys = {k.decode() for k in socket_redis.client(db=1).keys()}
    assert "gpujobs:broker-epoch" in keys and any(k.startswith("_kombu.binding.") for k in keys), keys


def test_postgres_down_for_seconds_mid_job_the_job_completes(
    tmp_path, private_pg_jobs_env, private_postgres, spawn_worker, tiny_model
):
    """Stop Postgres in immediate mode for 6 s while a job runs, then start it again: the workers ride it out
    (their leases cover the gap or the reaper re-queues), the job completes, rows committed before the outage
    are kept, and every row ran once."""
    workers = [spawn_worker([]), spawn_worker([])]
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 120), shard_rows=12)
    )
    wait_for(lambda: row_counts(job["id"]).get("succeeded", 0) >= 8, 120, "first rows", procs=workers)
    with session_scope() as session:
        before = set(
            session.scalars(select(JobRow.idx).where(JobRow.job_id == job["id"], JobRow.state == "succeeded")).all()
        )
    private_postgres.stop("immediate")
    time.sleep(6)
    private_postgres.start()
    wait_for(lambda: job_state(job["id"]) in ("succeeded", "failed"), 180, "the job", procs=workers)
    final = views.get(job["id"], owner=None)
    assert final["state"] == "succeeded", final["error"]
    with session_scope() as session:
        rows = {r.idx: r for r in session.scalars(select(JobRow).where(JobRow.job_id == job["id"]))}
    assert all(rows[i].state == "succeeded" for i in before)
    assert {r.executions for r in rows.values()} == {1}


def test_out_of_memory_in_a_worker_is_retried_smaller_and_reported(tmp_path, jobs_env, spawn_worker, tiny_model):
    """A worker whose engine runs out of memory above 2 rows per generate call (test-only fault hook) still
    finishes the job, and the job's events say it split the batch."""
    worker = spawn_worker([], JOBS_TEST_FAULTS="oom_over_2@generate")
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 8)))
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the job", procs=[worker])
    messages = [e["message"] for e in views.events(job["id"], owner=None)]
    assert "shard 0: out of memory generating 4 rows together: retrying as 2 + 2" in messages
