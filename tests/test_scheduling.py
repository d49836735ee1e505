"""Fair scheduling (core/scheduling.py): priorities, fair share between owners, FIFO within an owner, quotas; the
claim's choice under concurrent claims on SQLite and Postgres; real workers taking high-priority and small jobs
first and holding an owner's quota under 50 concurrent submissions; bad input refused with nothing created."""

from __future__ import annotations

import json
import queue as queues
import threading

import pytest
from sqlalchemy import func, select, update

from api import service, views
from core import leases, scheduling
from core.dataset import ParsedRow
from core.db import session_scope
from core.errors import Forbidden, InvalidInput
from core.models import Job, JobEvent, JobRow, Shard, ShardRun
from core.states import JobState
from core.store import create_shards, insert_rows, new_id, now
from tests.conftest import started, wait_for
from tests.test_e2e import jobs as cli
from tests.test_recovery import write_dataset

LEASE = 30.0
TERMINAL = ("succeeded", "failed", "cancelled")


def make_job(
    owner: str, *, priority: str = "normal", shards: int = 1, created_at: float | None = None, queue: str = "cpu"
) -> tuple[str, list[int]]:
    """A running job of `owner` with `shards` queued one-row shards; returns (job id, shard ids)."""
    with session_scope() as session:
        job = Job(
            id=new_id("job"),
            kind="generate",
            state=JobState.running.value,
            owner=owner,
            spec={"model": "m", "input": "f"},
            queue=queue,
            gpus=0,
            rows_total=shards,
            created_at=created_at or now(),
            priority=scheduling.rank(priority),
        )
        session.add(job)
        session.flush()
        insert_rows(
            session,
            job.id,
            [ParsedRow(i, i + 1, f"r{i}", {"prompt": "p", "params": {}, "extra": {}}, None) for i in range(shards)],
        )
        return job.id, [s.id for s in create_shards(session, job, shard_rows=1, max_attempts=3)]


def claim(hint: int, worker: str = "w") -> Shard | None:
    with session_scope() as session:
        got = leases.claim(session, hint, worker, LEASE)
        return got.shard if got else None


def ran(job_id: str, seconds: float) -> None:
    """Record that the job's first shard ran `seconds` ago for `seconds` (recent GPU-seconds of its owner)."""
    with session_scope() as session:
        shard = session.scalar(select(Shard).where(Shard.job_id == job_id).limit(1))
        shard.state, shard.started_at, shard.finished_at = "succeeded", now() - seconds - 1, now() - 1
        owner = session.scalar(select(Job.owner).where(Job.id == job_id))
        session.add(
            ShardRun(
                shard_id=shard.id,
                owner=owner,
                weight=1.0,
                started_at=shard.started_at,
                ended_at=shard.finished_at,
                ended_as="succeeded",
            )
        )


# --- the rule, in SQL --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("any_jobs_env")
def test_a_higher_priority_shard_is_claimed_before_any_lower_one_whatever_the_message_names():
    """Messages of a low job's shards take the high job's shard first, then normal, then low (oldest first)."""
    low, low_shards = make_job("ann", priority="low", shards=2, created_at=now() - 30)
    normal, (normal_shard,) = make_job("bob", priority="normal", created_at=now() - 20)
    high, (high_shard,) = make_job("cat", priority="high")
    taken = [claim(hint).id for hint in [*low_shards, normal_shard, high_shard]]
    assert taken[:3] == [high_shard, normal_shard, low_shards[0]]
    assert taken[3] == low_shards[1] and len(taken) == 4
    assert claim(high_shard) is None  # nothing left: a late message takes nothing


@pytest.mark.usefixtures("any_jobs_env")
def test_among_equals_the_owner_with_fewer_recent_gpu_seconds_goes_first_and_fifo_within_an_owner():
    """Equal priority: bob (no recent GPU-seconds) before ann (100 s), though ann's jobs are older; ann's own jobs
    run oldest first, whichever message arrives; GPU-seconds older than the window do not count."""
    old_run, _ = make_job("ann", created_at=now() - 500)
    ran(old_run, 100)
    ann_first, ann_first_shards = make_job("ann", shards=2, created_at=now() - 60)
    ann_second, (ann_second_shard,) = make_job("ann", created_at=now() - 50)
    bob, (bob_shard,) = make_job("bob")
    with session_scope() as session:
        used = scheduling.gpu_seconds(session, {"ann", "bob"})
        assert 99 < used["ann"] < 102 and "bob" not in used
        assert scheduling.gpu_seconds(session, {"ann"}, window=0.5) == {}
    assert claim(ann_second_shard).id == bob_shard
    assert [claim(ann_second_shard).id for _ in range(3)] == [*ann_first_shards, ann_second_shard]


@pytest.mark.usefixtures("any_jobs_env")
def test_within_an_owner_and_priority_shards_run_in_order_whichever_message_arrives():
    """FIFO within an owner: the last shard's message takes the first queued shard, and so on."""
    job, shards = make_job("ann", shards=3)
    assert [claim(shards[2]).id for _ in range(3)] == shards


@pytest.mark.usefixtures("any_jobs_env")
def test_an_owner_at_quota_waits_with_a_reason_and_others_run():
    """ann's cap of 1 running shard: her second shard waits (status says why) while bob's runs; once her shard
    ends the next claim takes hers. A cap of the wrong shape is refused."""
    with session_scope() as session:
        scheduling.set_quota(session, "ann", max_running_shards=1, by="root")
        for bad in (-1, 1.5, "2", True):
            with pytest.raises(InvalidInput, match="max_running_shards"):
                scheduling.set_quota(session, "ann", max_running_shards=bad, by="root")
    ann, ann_shards = make_job("ann", shards=2, created_at=now() - 10)
    bob, (bob_shard,) = make_job("bob")
    assert claim(ann_shards[0]).id == ann_shards[0]
    assert claim(ann_shards[1]).id == bob_shard
    assert claim(ann_shards[1]) is None
    place = views.get(ann, owner=None)["scheduling"]
    assert place["waiting"].startswith("waiting: owner quota") and place["shards_queued"] == 1
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id == ann_shards[0]).values(state="succeeded", finished_at=now()))
    assert claim(bob_shard).id == ann_shards[1]


@pytest.mark.usefixtures("any_jobs_env")
def test_status_shows_priority_position_and_reason_and_metrics_count_queued_shards_by_priority_and_owner():
    """A queued low job behind high work says so, with its position; the queue depth is exported per priority
    and owner."""
    low, _ = make_job("ann", priority="low", shards=2, created_at=now() - 10)
    high, _ = make_job("bob", priority="high", shards=3)
    view = views.get(low, owner=None)
    assert view["priority"] == "low"
    assert view["scheduling"] == {
        "position": 4,
        "shards_ahead": 3,
        "shards_queued": 2,
        "waiting": "waiting: higher-priority work",
    }
    assert views.get(high, owner=None)["scheduling"]["waiting"] == "waiting: next for a free worker"
    with session_scope() as session:
        assert sorted(scheduling.queue_depth(session)) == [("cpu", "high", "bob", 3), ("cpu", "low", "ann", 2)]


@pytest.mark.usefixtures("any_jobs_env")
def test_concurrent_claims_never_double_claim_nor_forget_a_shard():
    """60 shards of three owners and priorities, one message each, claimed by 8 threads at once (each its own
    session): every shard is claimed exactly once, every message takes one, none is left queued; with a cap of 2
    on one owner, never more than 2 of hers run."""
    with session_scope() as session:
        scheduling.set_quota(session, "capped", max_running_shards=2, by="root")
    hints = []
    for owner, priority, n in (("ann", "low", 20), ("bob", "normal", 15), ("cat", "high", 15), ("capped", "high", 10)):
        hints += make_job(owner, priority=priority, shards=n)[1]
    messages: queues.Queue[int] = queues.Queue()
    for hint in hints:
        messages.put(hint)
    taken: list[int] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(i: int) -> None:
        barrier.wait()
        while True:
            try:
                hint = messages.get_nowait()
            except queues.Empty:
                return
            try:
                got = claim(hint, f"w{i}")
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                return
            if got is not None:
                taken.append(got.id)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    assert len(taken) == len(set(taken)) == 52  # every message took one shard but the capped owner's last 8
    with session_scope() as session:
        states = dict(
            session.execute(
                select(Job.owner, func.count())
                .join(Shard, Shard.job_id == Job.id)
                .where(Shard.state == "running")
                .group_by(Job.owner)
            ).all()
        )
        assert states == {"ann": 20, "bob": 15, "cat": 15, "capped": 2}
        assert session.scalar(select(func.max(Shard.attempts))) == 1


# --- real workers ------------------------------------------------------------------------------------------------


def gen_spec(model, data: str, **extra) -> dict:
    return {
        "model": str(model),
        "input": data,
        "gpus": 0,
        "max_new_tokens": 4,
        "ignore_eos": True,
        "batch_rows": 2,
        "shard_rows": 2,
        **extra,
    }


def started_shards(job_id: str) -> list[tuple[float, int]]:
    with session_scope() as session:
        return sorted(
            session.execute(
                select(Shard.started_at, Shard.idx).where(Shard.job_id == job_id, Shard.started_at.is_not(None))
            ).all()
        )


def finished(job_id: str, procs) -> dict:
    return wait_for(
        lambda: (j := views.get(job_id, owner=None))["state"] in TERMINAL and j,
        180,
        f"job {job_id} to finish",
        procs=procs,
    )


def test_a_high_priority_job_submitted_behind_a_long_low_one_starts_within_one_micro_batch(
    jobs_env, spawn_worker, tiny_model, tmp_path
):
    """One worker runs a 30-shard low-priority job (one micro-batch per shard); a high-priority job submitted while
    it runs starts next: at most one low shard starts between its submit and its start (SQL timestamps)."""
    low = service.submit(
        owner="ann", spec_data=gen_spec(tiny_model, write_dataset(tmp_path / "low.jsonl", 60), priority="low")
    )
    worker = spawn_worker(JOBS_TEST_FAULTS="sleep_1@batch")  # each micro-batch of this worker lasts >= 1 s
    wait_for(lambda: started_shards(low["id"]), 120, "the low job's first shard to start", procs=[worker])
    high = service.submit(
        owner="bob",
        may_prioritize=True,
        spec_data=gen_spec(tiny_model, write_dataset(tmp_path / "high.jsonl", 2), priority="high"),
    )
    done = finished(high["id"], [worker])
    assert done["state"] == "succeeded" and done["priority"] == "high"
    ((high_start, _),) = started_shards(high["id"])
    low_starts = [t for t, _ in started_shards(low["id"])]
    assert len([t for t in low_starts if t < high_start]) < 30, "precondition: the low job still had queued shards"
    between = [t for t in low_starts if done["created_at"] <= t < high_start]
    assert len(between) <= 1, (between, high_start)
    service.cancel(low["id"], owner=None, by="test")
    finished(low["id"], [worker])


def test_two_owners_the_small_job_finishes_before_the_huge_one_is_ten_percent_done(
    jobs_env, spawn_worker, tiny_model, tmp_path
):
    """ann's 40-shard job, then bob's 2-shard job, both queued before the only worker starts: fair share alternates
    the owners, so bob's job ends while ann's has under 10 % of its shards done (FIFO would run all of ann's)."""
    huge = service.submit(owner="ann", spec_data=gen_spec(tiny_model, write_dataset(tmp_path / "huge.jsonl", 80)))
    small = service.submit(owner="bob", spec_data=gen_spec(tiny_model, write_dataset(tmp_path / "small.jsonl", 4)))
    assert views.get(small["id"], owner=None)["scheduling"]["waiting"].startswith("waiting:")
    worker = spawn_worker()
    done = finished(small["id"], [worker])
    assert done["state"] == "succeeded"
    with session_scope() as session:
        huge_done = session.scalar(
            select(func.count()).where(
                Shard.job_id == huge["id"], Shard.state == "succeeded", Shard.finished_at <= done["finished_at"]
            )
        )
    assert huge_done < 4, huge_done  # 10 % of 40 shards
    service.cancel(huge["id"], owner=None, by="test")
    finished(huge["id"], [worker])


CAPPED_JOBS, FREE_JOBS = 50, 4


def test_a_quota_of_2_holds_under_50_concurrent_submissions_on_3_workers(
    any_jobs_env, spawn_worker, tiny_model, tmp_path
):
    """ann (max_running_shards=2) submits 50 one-shard jobs from 50 threads at once while bob (no cap) submits 4;
    3 real workers drain them: every job succeeds and every row runs once, never more than 2 of ann's shards run at
    once (from the shards' state events in SQL), and bob's jobs end while ann still has shards queued."""
    with session_scope() as session:
        scheduling.set_quota(session, "ann", max_running_shards=2, by="root")
    # Each shard is one micro-batch, slowed to >= 0.5 s so that ann's shards overlap. A claim that finds ann at
    # quota takes nothing and its message is gone: the reaper sends her queued shards again a lease after their
    # send, on its beat (a third of the lease, in whole seconds): a lease of 6 s (not 20) beats every 2 s. Shorter
    # leases expired on SQLite during the burst of submissions (a heartbeat waits for the write lock behind them).
    workers = [spawn_worker(wait=False, JOBS_TEST_FAULTS="sleep_0.5@batch", JOBS_LEASE_SECONDS="6") for _ in range(3)]
    url = any_jobs_env.database_url
    wait_for(lambda: all(started(url, w.pid) for w in workers), 240, "3 workers to start", procs=workers)
    owners = ["ann"] * CAPPED_JOBS + ["bob"] * FREE_JOBS
    specs = [gen_spec(tiny_model, write_dataset(tmp_path / f"{i}.jsonl", 2)) for i in range(len(owners))]
    barrier = threading.Barrier(len(owners))
    submitted: dict[str, list[str]] = {"ann": [], "bob": []}
    errors: list[BaseException] = []

    def submit(owner: str, spec: dict) -> None:
        barrier.wait()
        try:
            submitted[owner].append(service.submit(owner=owner, spec_data=spec)["id"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=submit, args=args) for args in zip(owners, specs, strict=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and not any(t.is_alive() for t in threads), errors
    ids = submitted["ann"] + submitted["bob"]
    wait_for(lambda: ended(ids) == len(ids), 300, f"{len(ids)} jobs to end", interval=1, procs=workers)

    with session_scope() as session:
        assert dict(
            session.execute(select(Job.state, func.count()).where(Job.id.in_(ids)).group_by(Job.state)).all()
        ) == {"succeeded": len(ids)}
        rows = session.execute(select(JobRow.state, JobRow.executions).where(JobRow.job_id.in_(ids))).all()
        assert len(rows) == 2 * len(ids) and set(rows) == {("succeeded", 1)}, "a row failed or ran twice"
        events = session.execute(
            select(JobEvent.shard_id, JobEvent.ts, JobEvent.data)
            .where(JobEvent.job_id.in_(submitted["ann"]), JobEvent.kind == "state", JobEvent.shard_id.is_not(None))
            .order_by(JobEvent.id)
        ).all()
        bob_ended = session.scalar(select(func.max(Job.finished_at)).where(Job.id.in_(submitted["bob"])))
    runs = running_spans(events)
    assert len({shard_id for shard_id, _, _ in events}) == CAPPED_JOBS and len(runs) >= CAPPED_JOBS
    assert most_at_once(runs) == 2  # at most the cap, and the cap was reached: it held, it was not idle
    assert bob_ended < max(start for start, _ in runs), "bob's jobs waited until ann had nothing queued"


def test_a_capped_owners_next_shard_starts_when_her_running_one_ends_not_on_the_reapers_pass(
    jobs_env, spawn_worker, tiny_model, tmp_path
):
    """ann (cap 1) runs a 6-row job on worker A; her two jobs submitted then are claimed by idle worker B, which finds
    her at her cap and drops both messages. The reaper would send them again only a lease (600 s here) after their
    send: the end of each of her shards sends one message for her next (dispatch.wake), so all three succeed."""
    with session_scope() as session:
        scheduling.set_quota(session, "ann", max_running_shards=1, by="root")
    slow = dict(JOBS_TEST_FAULTS="sleep_1@batch", JOBS_LEASE_SECONDS="600", JOBS_WORKER_TIMEOUT="1800")
    workers = [spawn_worker(**slow) for _ in range(2)]
    first = service.submit(owner="ann", spec_data=gen_spec(tiny_model, write_dataset(tmp_path / "first.jsonl", 6)))
    wait_for(lambda: started_shards(first["id"]), 120, "ann's first shard to start", procs=workers)
    more = [
        service.submit(owner="ann", spec_data=gen_spec(tiny_model, write_dataset(tmp_path / f"{i}.jsonl", 2)))["id"]
        for i in range(2)
    ]
    dropped = "nothing queued on cpu may run now"
    wait_for(
        lambda: sum(w.log.read_text(errors="replace").count(dropped) for w in workers) >= 2,
        120,
        "both messages to find ann at her cap",
        procs=workers,
    )
    ids = [first["id"], *more]
    wait_for(lambda: ended(ids) == 3, 240, "ann's three jobs to end", procs=workers)
    assert [views.get(i, owner=None)["state"] for i in ids] == ["succeeded"] * 3


def running_spans(events) -> list[tuple[float, float]]:
    """[start, end) of each time a shard was running, from its state events (shard id, ts, data) in order: from its
    move to running to its next move (succeeded, or back to the queue: a lease that expired, a hand-back), so a
    shard that ran twice counts right, whatever its `attempts` say (a hand-back does not count one)."""
    spans, since = [], {}
    for shard_id, ts, data in events:
        if data["state"] == "running":
            since[shard_id] = ts
        elif shard_id in since:
            spans.append((since.pop(shard_id), ts))
    return spans


def ended(job_ids: list[str]) -> int:
    with session_scope() as session:
        return session.scalar(select(func.count()).where(Job.id.in_(job_ids), Job.state.in_(TERMINAL)))


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most spans [start, end) open at one instant. The times are the state events' (written after each
    conditional UPDATE, in its transaction), not the shards' started_at and finished_at (read from the clock before
    it): a claim that waited for the quota row lock while a shard finished would seem to overlap it. An end and a
    start at the same time do not overlap."""
    running = most = 0
    for _, step in sorted([(end, -1) for _, end in spans] + [(start, 1) for start, _ in spans]):
        running += step
        most = max(most, running)
    return most


# --- bad input ---------------------------------------------------------------------------------------------------


def job_count() -> int:
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(Job))


def test_an_unknown_priority_or_high_without_the_scope_is_refused_and_nothing_is_created(
    jobs_env, tiny_model, tmp_path
):
    """The service refuses `urgent` (InvalidInput naming the choices) and `high` for a caller without the scope
    (Forbidden naming the scope); neither leaves a job behind; `low` needs no scope."""
    data = write_dataset(tmp_path / "d.jsonl", 2)
    with pytest.raises(InvalidInput, match="priority"):
        service.submit(owner="ann", spec_data=gen_spec(tiny_model, data, priority="urgent"))
    with pytest.raises(Forbidden, match="priority or admin scope"):
        service.submit(owner="ann", spec_data=gen_spec(tiny_model, data, priority="high"))
    assert job_count() == 0
    assert service.submit(owner="ann", spec_data=gen_spec(tiny_model, data, priority="low"))["priority"] == "low"


def test_cli_refuses_bad_priorities_with_exit_2_and_nothing_created(api_server, jobs_env, tiny_model, tmp_path):
    """`gpujobs submit generate --priority urgent` and `--priority high` with a user token exit 2 with the reason,
    nothing created; a token with the priority scope submits high; `quota set` refuses a bad cap with exit 2 and
    `quota show` reads it back; `list` and `status` show the priority."""
    from core import auth

    url, admin, _ = api_server
    with session_scope() as session:
        user = auth.create_token(session, owner="ann", scopes=["user"])
        prioritized = auth.create_token(session, owner="bob", scopes=["user", "priority"])
    data = write_dataset(tmp_path / "d.jsonl", 2)
    args = ["submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0"]
    as_user = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=user)
    before = job_count()
    bad = cli(as_user, *args, "--priority", "urgent")
    assert bad.returncode == 2 and "urgent" in bad.stderr and "low" in bad.stderr, bad.stderr
    refused = cli(as_user, *args, "--priority", "high")
    assert refused.returncode == 2 and "priority or admin scope" in refused.stderr, refused.stderr
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps({"model": str(tiny_model), "input": data, "gpus": 0, "priority": "urgent"}))
    from_spec = cli(as_user, "submit", "generate", "--spec", str(spec_file))
    assert from_spec.returncode == 2 and "priority" in from_spec.stderr, from_spec.stderr
    assert job_count() == before
    ok = cli(dict(as_user, JOBS_TOKEN=prioritized), *args, "--priority", "high", check=True)
    job_id = ok.stdout.strip()
    listed = cli(dict(as_user, JOBS_TOKEN=prioritized), "list", check=True)
    assert job_id in listed.stdout and " high " in listed.stdout and "waiting:" in listed.stdout, listed.stdout
    status = cli(dict(as_user, JOBS_TOKEN=prioritized), "status", job_id, check=True)
    assert "priority high" in status.stdout and "position 1" in status.stdout, status.stdout
    as_admin = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=admin)
    wrong = cli(as_admin, "quota", "set", "ann", "--max-running-shards", "-3")
    assert wrong.returncode == 2, wrong.stderr
    assert cli(as_user, "quota", "set", "ann", "--max-running-shards", "3").returncode == 2  # a user: refused
    cli(as_admin, "quota", "set", "ann", "--max-running-shards", "3", check=True)
    shown = json.loads(cli(as_admin, "quota", "show", "ann", "--json", check=True).stdout)
    assert shown[0]["owner"] == "ann" and shown[0]["max_running_shards"] == 3


def test_openai_batch_metadata_priority_is_the_job_s_and_bad_ones_are_refused(
    jobs_env, tiny_model, tmp_path, monkeypatch
):
    """batches.create with metadata {"priority": "low"} makes a low job's spec; "high" with a user token answers
    403 naming the scope, "urgent" 422 naming the choices; neither leaves a job behind."""
    from fastapi.testclient import TestClient

    from api import access, openai_api
    from api.app import app
    from core import auth
    from core.settings import reset

    monkeypatch.setenv("JOBS_MODEL_ROOTS", str(tiny_model.parent))
    reset()
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": tiny_model.name, "messages": [{"role": "user", "content": "hi"}]},
    }
    with session_scope() as session:
        token = auth.create_token(session, owner="ann", scopes=["user"])
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    uploaded = client.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("b.jsonl", json.dumps(line).encode() + b"\n")}
    )
    assert uploaded.status_code == 200, uploaded.text
    request = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    ann = access.Principal(owner="ann", scopes=frozenset({"user"}))
    spec = openai_api.batch_spec(ann, openai_api.BatchRequest(**request, metadata={"priority": "low"}))
    assert spec["priority"] == "low" and spec["metadata"]["priority"] == "low"
    high = client.post("/v1/batches", json={**request, "metadata": {"priority": "high"}})
    assert high.status_code == 403 and "priority or admin scope" in high.text, high.text
    urgent = client.post("/v1/batches", json={**request, "metadata": {"priority": "urgent"}})
    assert urgent.status_code == 400 and "priority" in urgent.text, urgent.text  # OpenAI's status for invalid
    assert job_count() == 0


@pytest.mark.usefixtures("jobs_env")
def test_metrics_export_queued_shards_by_queue_priority_and_owner_and_running_shards_by_owner():
    """/metrics: gpujobs_queued_shards{queue,priority,owner} and gpujobs_running_shards{owner}."""
    from fastapi.testclient import TestClient

    from api.app import app
    from api.metrics import parse
    from core import auth

    make_job("ann", priority="low", shards=2)
    _, (bob_shard, _) = make_job("bob", priority="high", shards=2)
    assert claim(bob_shard).id == bob_shard
    with session_scope() as session:
        token = auth.create_token(session, owner="prometheus", scopes=["metrics"])
    text = TestClient(app).get("/metrics", headers={"Authorization": f"Bearer {token}"}).text
    samples = parse(text)
    assert sorted((s["queue"], s["priority"], s["owner"], v) for s, v in samples["gpujobs_queued_shards"]) == [
        ("cpu", "high", "bob", 1.0),
        ("cpu", "low", "ann", 2.0),
    ]
    assert samples["gpujobs_running_shards"] == [({"owner": "bob"}, 1.0)]


@pytest.mark.usefixtures("jobs_env")
def test_the_reaper_leaves_a_shard_held_by_its_owners_quota_and_sends_it_once_the_owner_is_under_it():
    """A queued shard whose message was taken by a claim that found its owner at quota is not sent again while the
    owner is at quota (no stream of no-op messages), and is sent again by the next reaper pass once it is not."""
    from core import dispatch
    from core.queue import waiting_messages

    dispatch.reap()  # the first pass on a fresh Redis sends every queued shard (none yet): that is not this test
    with session_scope() as session:
        scheduling.set_quota(session, "ann", max_running_shards=1, by="root")
    _, (first, second) = make_job("ann", shards=2)
    assert claim(first).id == first and claim(second) is None  # the second shard's message found ann at quota
    long_ago = now() - 3600
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id == second).values(enqueued_at=long_ago))
    dispatch.reap()
    assert waiting_messages("cpu") == 0
    with session_scope() as session:
        assert session.get(Shard, second).enqueued_at == long_ago
        session.execute(update(Shard).where(Shard.id == first).values(state="succeeded", finished_at=now()))
    dispatch.reap()
    assert waiting_messages("cpu") == 1
    with session_scope() as session:
        assert session.get(Shard, second).enqueued_at > long_ago


@pytest.mark.usefixtures("jobs_env")
def test_status_right_after_a_retry_rates_the_last_minute_of_the_current_run_only():
    """`live` (status's "last minute" rate and ETA) leaves out the rows run 1 finished within the minute before the
    retry: none of run 2's before its first claim, then run 2's rows over run 2's age (was: run 1's rows too, over
    run 2's age: 7x too fast here). The bounds allow a loaded machine 30 s between the writes and the read."""

    def finish(session, idxs, at: float) -> None:
        for row in session.scalars(select(JobRow).where(JobRow.job_id == job_id, JobRow.idx.in_(idxs))):
            row.state, row.worker, row.finished_at, row.completion_tokens = "succeeded", "w", at, 10
        for shard in session.scalars(select(Shard).where(Shard.job_id == job_id, Shard.row_start.in_(idxs))):
            shard.state, shard.finished_at = "succeeded", at

    job_id, _ = make_job("ann", shards=40)
    with session_scope() as session:  # run 1: 30 rows, finished 55 s ago (in the last minute)
        session.get(Job, job_id).started_at = now() - 70
        finish(session, range(30), now() - 55)
    service.cancel(job_id, owner=None, by="t")
    assert service.retry(job_id, owner=None, failed_only=False, by="t")["live"] == {
        "rows_per_s": 0.0,
        "tokens_per_s": 0.0,
        "eta_s": None,
    }
    with session_scope() as session:  # run 2: first claimed 50 s ago, 5 rows done since
        session.get(Job, job_id).started_at = now() - 50
        finish(session, range(30, 35), now() - 1)
    live = views.get(job_id, owner=None)["live"]
    assert 5 / 80 <= live["rows_per_s"] <= 5 / 50 + 1e-3, live  # run 1's rows counted too: 35 / 50 = 0.7
    assert 50 <= live["eta_s"] <= 80, live  # 5 rows left at that rate


@pytest.mark.usefixtures("jobs_env")
def test_jobs_and_adapters_page_with_after_the_last_id_listed():
    """GET /jobs and GET /adapters page with `after` = the last id listed: newest first, ties in created_at broken by
    id, so pages of 2 give the whole list once, in order, even where rows share an instant; another owner's id is
    a 404 (it names nothing of theirs)."""
    from core import adapters as adapter_store
    from core.errors import NotFound
    from core.models import Adapter

    t = now()
    ids = [make_job("ann", created_at=t - i // 2)[0] for i in range(5)]  # pairs made in one instant
    with session_scope() as session:
        for i, job_id in enumerate(ids):
            session.add(
                Adapter(
                    id=job_id,
                    job_id=job_id,
                    owner="ann",
                    base_model="m",
                    tokenizer="m",
                    path=f"a/{i}",
                    bytes=0,
                    sha256="0" * 64,
                    lora_config={},
                    load_options={},
                    created_at=t - i // 2,
                )
            )

    def paged(list_page) -> list[str]:
        seen, after = [], None
        while page := list_page(after):
            seen += page
            after = page[-1]
        return seen

    whole = [j["id"] for j in views.list_jobs(owner="ann", limit=10)]
    assert sorted(whole) == sorted(ids)
    assert paged(lambda after: [j["id"] for j in views.list_jobs(owner="ann", limit=2, after=after)]) == whole
    with session_scope() as session:
        listed = [a.id for a in adapter_store.list_for(session, owner="ann", limit=10)]
        assert (
            paged(lambda after: [a.id for a in adapter_store.list_for(session, owner="ann", limit=2, after=after)])
            == listed
        )
    assert sorted(listed) == sorted(ids)
    with pytest.raises(NotFound):
        views.list_jobs(owner="bob", after=ids[0])
