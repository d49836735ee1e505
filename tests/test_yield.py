"""Yields (issue 17): a running shard hands its worker to work that outranks it and has waited
JOBS_YIELD_AFTER_SECONDS (core/scheduling.yield_reason); every attempt counts in owners' GPU-seconds (shard_runs);
the daily GPU-seconds cap. The rule in SQL on SQLite and Postgres; real workers yielding a generation shard between
micro-batches and a fine-tune at a step's checkpoint, each resuming where it stopped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from sqlalchemy import func, select, update

from api import service, views
from core import scheduling
from core.db import session_scope
from core.models import Job, JobEvent, JobRow, Shard, ShardRun
from core.store import now
from tests.conftest import wait_for
from tests.test_finetune import FT_DATA, ROOT, UNBROKEN, ft_spec, metric_events
from tests.test_recovery import write_dataset
from tests.test_scheduling import claim, gen_spec, make_job, ran

AFTER = 30.0


def running_for(shard_id: int, seconds: float) -> None:
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id == shard_id).values(started_at=now() - seconds))


def queued_for(shard_ids: list[int], seconds: float) -> None:
    with session_scope() as session:
        session.execute(update(Shard).where(Shard.id.in_(shard_ids)).values(queued_at=now() - seconds))


def reason(shard_id: int) -> str | None:
    with session_scope() as session:
        return scheduling.yield_reason(session, shard_id, AFTER)


# --- the rule, in SQL --------------------------------------------------------------------------------------------


@pytest.mark.usefixtures("any_jobs_env")
def test_a_running_shard_yields_to_higher_priority_work_only_once_both_waited_and_ran_the_setting():
    """A low shard that ran 60 s yields to a high shard queued 60 s; not to one queued 10 s; not when it ran 10 s
    itself; never with the setting 0; the reason names the priority and the owner."""
    _, (low,) = make_job("ann", priority="low")
    assert claim(low).id == low
    _, (high,) = make_job("bob", priority="high")
    running_for(low, 60)
    queued_for([high], 10)
    assert reason(low) is None
    queued_for([high], 60)
    assert reason(low).startswith("high-priority work of bob waited 6")
    with session_scope() as session:
        assert scheduling.yield_reason(session, low, 0) is None
    running_for(low, 10)
    assert reason(low) is None


@pytest.mark.usefixtures("any_jobs_env")
def test_fair_share_yields_only_past_a_margin_of_gpu_seconds_and_never_to_the_same_owner_or_to_an_owner_at_quota():
    """Equal priority: ann's running shard yields to bob's waiting one when ann's GPU-seconds exceed bob's by more
    than the setting, not by less; not to ann's own queued work; not to bob at his cap."""
    ann_job, (ann_shard, ann_next) = make_job("ann", shards=2)
    _, (bob_shard,) = make_job("bob")
    assert claim(ann_shard).id == ann_shard
    queued_for([bob_shard, ann_next], 60)
    running_for(ann_shard, AFTER + 5)  # ann 35 GPU-seconds, bob 0: more than the margin (30) apart
    assert reason(ann_shard).startswith("fair share: bob's work waited 6")
    bob_old, _ = make_job("bob")
    ran(bob_old, 20)  # bob 20: 20 + 30 > 35, no yield
    assert reason(ann_shard) is None
    with session_scope() as session:
        session.execute(update(ShardRun).values(started_at=ShardRun.ended_at - 1))  # bob 1: 1 + 30 < 35
        scheduling.set_quota(session, "bob", max_running_shards=0, by="root")
    assert reason(ann_shard) is None  # bob at his cap: his work could not run anyway
    with session_scope() as session:
        scheduling.set_quota(session, "bob", max_running_shards=None, by="root")
    assert reason(ann_shard) is not None


@pytest.mark.usefixtures("any_jobs_env")
def test_one_waiting_shard_takes_one_victim_the_worst_and_a_fresh_yield_counts_as_taken():
    """Two running shards (normal of ann, low of cat) and one high shard waiting: only cat's low shard yields; once
    it yielded (queued again, `yielded_at` now), ann's does not yield for the same waiting shard."""
    _, (ann_shard,) = make_job("ann")
    _, (cat_shard,) = make_job("cat", priority="low")
    assert claim(ann_shard).id == ann_shard and claim(cat_shard).id == cat_shard
    _, (high,) = make_job("bob", priority="high")
    running_for(ann_shard, 60)
    running_for(cat_shard, 60)
    queued_for([high], 60)
    assert reason(cat_shard) is not None and reason(ann_shard) is None
    with session_scope() as session:
        session.execute(
            update(Shard)
            .where(Shard.id == cat_shard)
            .values(state="queued", lease_owner=None, queued_at=now(), yielded_at=now())
        )
    assert reason(ann_shard) is None
    with session_scope() as session:  # the yield is old: the high shard still waits, so ann's shard yields now
        session.execute(update(Shard).where(Shard.id == cat_shard).values(yielded_at=now() - 2 * AFTER))
    assert reason(ann_shard) is not None


@pytest.mark.usefixtures("any_jobs_env")
def test_every_ended_attempt_is_a_run_and_counts_in_gpu_seconds():
    """A shard claimed, handed back and claimed again leaves one shard_runs row per ended attempt (its owner, when
    it ended and how), and the owner's GPU-seconds add the ended attempt to the running one."""
    from core import leases

    _, (shard_id,) = make_job("ann")
    assert claim(shard_id).id == shard_id
    running_for(shard_id, 50)
    with session_scope() as session:
        leases.hand_back(session, session.get(Shard, shard_id), "w", "yielded: test", count_attempt=False)
    assert claim(shard_id).id == shard_id
    running_for(shard_id, 10)
    with session_scope() as session:
        runs = session.scalars(select(ShardRun).where(ShardRun.shard_id == shard_id)).all()
        assert [(r.owner, r.ended_as, r.weight) for r in runs] == [("ann", "queued", 1.0)]
        assert 49 < runs[0].ended_at - runs[0].started_at < 52
        assert 59 < scheduling.gpu_seconds(session, {"ann"})["ann"] < 63
        assert session.get(Shard, shard_id).attempts == 1  # a hand-back that does not count the attempt


@pytest.mark.usefixtures("any_jobs_env")
def test_an_owner_over_its_daily_gpu_seconds_waits_with_a_reason_and_others_run():
    """ann's cap of 100 GPU-seconds a day, 150 used 2 h ago: her queued shard is not claimed (status says why) while
    bob's is; runs older than 24 h do not count; a bad cap is refused naming the field."""
    from core.errors import InvalidInput

    with session_scope() as session:
        scheduling.set_quota(session, "ann", max_gpu_seconds_per_day=100, by="root")
        quota = scheduling.quota_view(session, "ann")
        assert quota["max_gpu_seconds_per_day"] == 100 and quota["max_running_shards"] is None
    old, _ = make_job("ann", created_at=now() - 7200)
    ran(old, 150)
    ann_job, (ann_shard,) = make_job("ann", created_at=now() - 60)
    _, (bob_shard,) = make_job("bob")
    assert claim(ann_shard).id == bob_shard  # ann's message takes bob's shard: ann is over her day
    assert claim(ann_shard) is None
    with session_scope() as session:
        place = scheduling.place(session, session.get(Job, ann_job))
        assert place["waiting"].startswith("waiting: owner quota (100 GPU-seconds per day"), place
        session.execute(update(ShardRun).values(started_at=now() - 26 * 3600, ended_at=now() - 25 * 3600))
    assert claim(ann_shard).id == ann_shard
    with session_scope() as session:
        for bad in (-1, "a lot", True):
            with pytest.raises(InvalidInput, match="max_gpu_seconds_per_day"):
                scheduling.set_quota(session, "ann", max_gpu_seconds_per_day=bad, by="root")
        with pytest.raises(InvalidInput, match="give one or more of"):
            scheduling.set_quota(session, "ann", by="root")
        assert scheduling.quota_view(session, "ann")["max_gpu_seconds_per_day"] == 100


# --- real workers ------------------------------------------------------------------------------------------------

YIELDING = dict(JOBS_YIELD_AFTER_SECONDS="2", JOBS_LEASE_SECONDS="3")  # a yield asked within a beat (1 s) of 2 s


def finished(job_id: str, procs) -> dict:
    """The job once it ended. The bound only catches a hang: a loaded CI machine takes minutes to reload a model
    and train the steps left after a yield."""
    return wait_for(
        lambda: (j := views.get(job_id, owner=None))["state"] in ("succeeded", "failed", "cancelled") and j,
        600,
        f"job {job_id} to finish",
        procs=procs,
    )


def submit_high(model, tmp_path) -> dict:
    """bob's high-priority 2-row generation job (his token has the priority scope)."""
    spec = gen_spec(model, write_dataset(tmp_path / "high.jsonl", 2), priority="high")
    return service.submit(owner="bob", may_prioritize=True, spec_data=spec)


def yield_events(job_id: str) -> list[JobEvent]:
    with session_scope() as session:
        return session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "yield").order_by(JobEvent.id)
        ).all()


def test_a_generation_shard_yields_between_micro_batches_and_its_rest_runs_after(
    jobs_env, spawn_worker, tiny_model, tmp_path
):
    """One worker runs ann's low 1-shard job (40 rows, 2 a micro-batch of >= 1 s); bob's high job, queued 2 s,
    makes the shard yield: at most two micro-batches of ann's are committed after the request (rows are stamped when
    the committer thread writes them, so one handed over just before the request can be written after it, and the
    engine's next one is the boundary), bob's job starts after the yield and succeeds, then ann's job ends with every row run exactly once, its counts whole, the yield not
    counted as an attempt, and both attempts in shard_runs."""
    low = service.submit(
        owner="ann",
        spec_data=gen_spec(tiny_model, write_dataset(tmp_path / "low.jsonl", 40), priority="low", shard_rows=40),
    )
    worker = spawn_worker(JOBS_TEST_FAULTS="sleep_1@batch", **YIELDING)
    wait_for(
        lambda: views.get(low["id"], owner=None)["rows"]["succeeded"] >= 2,
        120,
        "ann's first micro-batch",
        procs=[worker],
    )
    high = submit_high(tiny_model, tmp_path)
    assert finished(high["id"], [worker])["state"] == "succeeded"
    done = finished(low["id"], [worker])
    assert done["state"] == "succeeded" and done["rows"]["succeeded"] == 40, done
    (event,) = yield_events(low["id"])
    asked = event.data["requested_at"]
    assert asked - high["created_at"] >= 2  # the setting: bob's work waited 2 s first
    assert "high-priority work of bob" in event.message and "after " in event.data["at"], event.message
    with session_scope() as session:
        high_start = session.scalar(select(Shard.started_at).where(Shard.job_id == high["id"]))
        (low_shard,) = session.scalars(select(Shard).where(Shard.job_id == low["id"])).all()
        rows = session.execute(select(JobRow.finished_at, JobRow.executions).where(JobRow.job_id == low["id"])).all()
        runs = session.execute(
            select(ShardRun.ended_as).where(ShardRun.shard_id == low_shard.id).order_by(ShardRun.id)
        ).all()
    assert event.ts <= high_start
    # without the yield the shard would run on: its ~30 rows left would all be committed before bob's shard starts
    after = len([t for t, _ in rows if asked < t < high_start])
    assert after <= 4, f"{after} rows committed after the request: more than two micro-batches"
    assert 0 < len([t for t, _ in rows if t < asked]) < 40
    assert {e for _, e in rows} == {1}
    assert low_shard.rows_done == 40 and low_shard.attempts == 1
    assert low_shard.metrics["earlier_attempts"] == 1 and low_shard.metrics["earlier_seconds"] > 0
    assert [r for (r,) in runs] == ["queued", "succeeded"]


def test_a_yielded_fine_tune_resumes_from_its_yield_checkpoint_with_the_loss_of_an_unbroken_run(
    tmp_path, jobs_env, spawn_worker, base_model, tiny_model
):
    """ann's low fine-tune (no periodic checkpoint within its 12 steps) runs on the only worker; bob's high
    generation job waits 2 s: the fine-tune saves a complete checkpoint at the end of the step it is in, yields,
    bob's job runs, then the fine-tune resumes from that checkpoint and succeeds; every step is logged once in the
    current view and the resumed steps' losses are within 5 % of an unbroken run's."""
    from core import adapters
    from core.spec import FinetuneSpec
    from worker.training import finetune

    spec_data = ft_spec(base_model, max_steps=12, learning_rate=2e-3, checkpoint_steps=100, priority="low")
    worker = spawn_worker([], JOBS_TEST_FAULTS="sleep_1@train_step", **YIELDING)
    ft = service.submit(owner="ann", spec_data=spec_data)
    wait_for(lambda: any(e.get("step", 0) >= 2 for e in metric_events(ft["id"])), 180, "step 2", procs=[worker])
    high = submit_high(tiny_model, tmp_path)
    assert finished(high["id"], [worker])["state"] == "succeeded"
    done = finished(ft["id"], [worker])
    assert done["state"] == "succeeded", done["error"]
    (event,) = yield_events(ft["id"])
    step = int(event.data["at"].split()[2].rstrip(","))
    assert 2 <= step < 12 and f"checkpoint-{step}" in event.data["at"], event.data
    checkpoints = adapters.workdir(ft["id"]) / "checkpoints"
    assert step in [s for s, _ in finetune.complete_checkpoints(checkpoints)]
    assert done["metrics"]["training"]["resumed_from_step"] == step
    with session_scope() as session:
        high_start = session.scalar(select(Shard.started_at).where(Shard.job_id == high["id"]))
        assert event.ts <= high_start
        assert session.scalar(select(func.max(Shard.attempts)).where(Shard.job_id == ft["id"])) == 1
    current = [e for e in views.events(ft["id"], owner=None, run="current", limit=5000) if e["kind"] == "metric"]
    logged = {e["data"]["step"]: e["data"]["loss"] for e in current if "loss" in e["data"]}
    assert sorted(logged) == list(range(1, 13))
    # the step in flight when asked is the last; a step whose end was checked just before the ask may be logged
    # just after it, so at most 2 of the first attempt's logged steps are later than the request
    after_ask = [e for e in current if "loss" in e["data"] and e["ts"] > event.data["requested_at"]]
    assert len([e for e in after_ask if e["data"]["step"] <= step]) <= 2, "training went on after the request"

    spec = FinetuneSpec.model_validate({**spec_data, "model": str(base_model)})
    reference = tmp_path / "unbroken.json"
    subprocess.run(
        [sys.executable, "-c", UNBROKEN, spec.model_dump_json(), str(FT_DATA), str(tmp_path / "ref"), str(reference)],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    unbroken = {int(s): loss for s, loss in json.loads(reference.read_text()).items()}
    for s in range(step + 1, 13):
        assert logged[s] == pytest.approx(unbroken[s], rel=0.05), (s, logged[s], unbroken[s])


def test_cli_sets_each_cap_alone_keeps_the_other_and_refuses_bad_ones_with_exit_2(api_server, jobs_env):
    """`quota set --max-gpu-seconds-per-day`, then `--max-running-shards`: both caps stand; `quota show` prints the
    24 h use against the cap; `--no-cap` removes the quota (`quota show` lists no owner again); no cap, `--no-cap`
    with a cap, a negative cap, an owner name a token could not have (a space, a control character): exit 2 with
    the reason, the quota unchanged."""
    from tests.test_e2e import jobs as cli

    url, admin, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=admin)

    def shown() -> dict:
        return json.loads(cli(env, "quota", "show", "ann", "--json", check=True).stdout)[0]

    assert "no owner has a quota" in cli(env, "quota", "show", check=True).stdout
    cli(env, "quota", "set", "ann", "--max-gpu-seconds-per-day", "3600", check=True)
    cli(env, "quota", "set", "ann", "--max-running-shards", "2", check=True)
    assert (shown()["max_gpu_seconds_per_day"], shown()["max_running_shards"]) == (3600, 2)
    assert "0.0 of 3600 GPU-s in 24 h" in cli(env, "quota", "show", "ann", check=True).stdout
    for bad, says in (
        ((), "--no-cap alone"),
        (("--no-cap", "--max-running-shards", "1"), "--no-cap alone"),
        (("--max-gpu-seconds-per-day", "-5"), "-5"),
    ):
        refused = cli(env, "quota", "set", "ann", *bad)
        assert refused.returncode == 2 and says in refused.stderr, (bad, refused.stderr)
    for owner in ("bad name", "tab\there", "ann\x7f"):
        refused = cli(env, "quota", "set", owner, "--max-running-shards", "1")
        assert (refused.returncode, refused.stderr) == (
            2,
            f"Error: owner {owner!r}: give a name of 1 to 128 characters without spaces or control characters\n",
        )
    assert (shown()["max_gpu_seconds_per_day"], shown()["max_running_shards"]) == (3600, 2)
    assert [q["owner"] for q in json.loads(cli(env, "quota", "show", "--json", check=True).stdout)] == ["ann"]
    cli(env, "quota", "set", "ann", "--no-cap", check=True)
    assert (shown()["max_gpu_seconds_per_day"], shown()["max_running_shards"]) == (None, None)
    assert json.loads(cli(env, "quota", "show", "--json", check=True).stdout) == []
    assert "no owner has a quota" in cli(env, "quota", "show", check=True).stdout
