"""The stall watchdog: progress, not liveness, renews a lease (worker/progress.py, worker/runtime.py), and workers
that cannot run refuse to start (worker/main.py). Real workers, real Redis and SQLite; an engine step that never
returns is injected with JOBS_TEST_FAULTS=hang_after_N@POINT while the heartbeat thread goes on."""

from __future__ import annotations

import subprocess
import sys

import pytest
from sqlalchemy import select

from api import service, views
from core import exits, registry
from core.db import session_scope
from core.models import JobEvent, JobRow, Shard, Worker
from core.spec import FinetuneSpec, GenerateSpec, LoadOptions
from tests.conftest import ROOT, qa_pairs, wait_for
from tests.test_finetune import FT_DATA, finished, ft_spec
from tests.test_recovery import job_state, long_spec, row_counts, write_dataset
from worker.progress import FLOOR_S, MEDIAN_FACTOR, Progress

STALL_S = 8  # the stalling worker's JOBS_STALL_SECONDS: far above any gap between its steps, even on a loaded CI


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# --- the tracker --------------------------------------------------------------------------------------------------


def test_auto_bound_is_the_larger_of_the_floor_and_50_median_steps():
    """With no step measured the bound is the 120 s floor; steps of 10 ms keep it there; steps of 4 s raise it to 50 ×
    the median (200 s), and an outlier step does not move the median."""
    clock = Clock()
    p = Progress(clock)
    assert p.bound(None, 1800) == FLOOR_S
    for _ in range(20):
        clock.t += 0.01
        p.beat("decode step")
    assert p.median_step() == pytest.approx(0.01) and p.bound(None, 1800) == FLOOR_S
    p.start()
    for gap in [4.0] * 9 + [90.0]:
        clock.t += gap
        p.beat("training step")
    assert p.median_step() == 4.0 and p.bound(None, 1800) == MEDIAN_FACTOR * 4.0
    assert p.bound(3.0, 1800) == 3.0  # a fixed JOBS_STALL_SECONDS is the bound, whatever the steps


def test_a_stall_is_reported_past_the_bound_with_what_the_engine_was_doing():
    """No stall up to the bound; past it, a Stall that says how long, the bound and the last unit of work."""
    clock = Clock()
    p = Progress(clock)
    p.start("the shard was claimed")
    clock.t += 2.9
    assert p.stalled(3.0, 1800) is None
    p.beat("decode step")
    clock.t += 3.5
    stall = p.stalled(3.0, 1800)
    assert stall is not None and stall.seconds == pytest.approx(3.5) and stall.bound == 3.0
    assert stall.phase is None and stall.beats == 1
    assert stall.describe() == (
        "no progress for 3.5 s (bound 3 s) since the last decode step (1 progress report so far)"
    )


def test_phases_count_as_progress_under_their_own_bound_and_are_not_steps():
    """A long compile inside a phase is no stall (the phase bound applies), its length is not a step, a nested
    phase returns to the outer one, and the end of a phase is progress."""
    clock = Clock()
    p = Progress(clock)
    changes: list[str | None] = []
    p.phase_changed = lambda: changes.append(p.phase_name)
    with p.phase("preparing training"):
        with p.phase("compiling"):
            clock.t += 600
            assert p.stalled(3.0, 1800) is None
            assert p.doing() == "in phase 'compiling' (for 600 s)"
        assert p.phase_name == "preparing training"
        clock.t += 1801
        stall = p.stalled(3.0, 1800)
        assert stall is not None and stall.phase == "preparing training" and stall.bound == 1800
    assert changes == ["preparing training", "compiling", None, "preparing training", None]
    assert p.median_step() is None  # no step was measured: phases are not steps
    assert p.stalled(3.0, 1800) is None  # the phase's end was progress
    clock.t += 0.5
    p.beat("training step")
    assert p.median_step() == 0.5


def test_stall_seconds_setting_is_auto_or_a_positive_number(monkeypatch):
    """JOBS_STALL_SECONDS: unset or `auto` is auto (None), a number is the bound, anything else is refused with the
    variable's name and what to give."""
    from core.settings import get_settings, reset

    for value, expected in (("auto", None), ("", None), ("2.5", 2.5)):
        monkeypatch.setenv("JOBS_STALL_SECONDS", value)
        reset()
        assert get_settings().stall_seconds == expected
    monkeypatch.setenv("JOBS_STALL_SECONDS", "-1")
    reset()
    with pytest.raises(ValueError, match="JOBS_STALL_SECONDS='-1': give a positive number of seconds, or auto"):
        get_settings()
    reset()


def test_stuck_at_names_the_innermost_frame_and_the_innermost_of_ours():
    """The stall event's one-line place: the innermost frame, and the innermost frame of this project's code."""
    from worker.tracebacks import stuck_at

    stack = (
        f'  File "{ROOT}/worker/runtime.py", line 10, in run_shard\n    x()\n'
        f'  File "{ROOT}/worker/faults.py", line 71, in _hang\n    threading.Event().wait()\n'
        '  File "/usr/lib/python3.12/threading.py", line 359, in wait\n    waiter.acquire()\n'
    )
    assert stuck_at(stack) == "threading.py:359 in wait, from worker/faults.py:71 in _hang"
    assert stuck_at(stack.split('  File "/usr')[0]) == "worker/faults.py:71 in _hang"


def test_exit_codes_say_whether_a_supervisor_restarts_the_worker():
    """Configuration errors (5, 6, 77: Redis refused the password, 78: the wrong artifacts directory) and a clean
    stop (0) are not restarted; a stall (70), a broken import (72), a crash (1) and a kill are."""
    assert [exits.restartable(c) for c in (0, 5, 6, 77, 78)] == [False, False, False, False, False]
    assert [exits.restartable(c) for c in (70, 72, 1, -9)] == [True, True, True, True]
    assert exits.describe(-9) == "killed by SIGKILL" and exits.describe(exits.STALLED) == "engine stalled"


# --- every engine reports its steps ---------------------------------------------------------------------------------


class Recorder(Progress):
    def __init__(self) -> None:
        super().__init__()
        self.kinds: list[str] = []
        self.phases: list[str | None] = []

    def beat(self, kind: str) -> None:
        super().beat(kind)
        self.kinds.append(kind)

    def phase_changed(self) -> None:
        self.phases.append(self.phase_name)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    from worker.loader import load

    return load(LoadOptions(model=str(tiny_model)), gpus=0)


@pytest.mark.parametrize("engine", ["padded", "fast", "static", "continuous"])
def test_every_generation_engine_reports_each_decode_step(loaded, tiny_model, engine):
    """Each engine reports its decode steps to the progress it is given (the fast engine its prefill chunks too):
    two rows of 8 tokens (EOS off) are at least 7 decode steps in every engine; the continuous engine, which
    decodes in its own thread, at least one step seen moving, after its warm-up phase."""
    from worker.generate import generate

    spec = GenerateSpec.model_validate(
        {"model": str(tiny_model), "input": "file_x", "max_new_tokens": 8, "ignore_eos": True, "engine": engine}
    )
    rows = [(i, {"prompt": q, "params": {}, "extra": {}}) for i, (q, _) in enumerate(qa_pairs()[:2])]
    recorder = Recorder()
    results = [r for batch in generate(loaded, spec, rows, batch_rows=2, progress=recorder) for r in batch]
    assert len(results) == 2 and all(r.error is None for r in results)
    steps = recorder.kinds.count("decode step")
    assert steps >= (1 if engine == "continuous" else 7), recorder.kinds
    if engine == "fast":
        assert "prefill chunk" in recorder.kinds
    if engine == "continuous":  # its manager's warm-up is a phase, ended by its first step
        assert recorder.phases[:2] == ["starting continuous batching", None]
    assert recorder.phase_name is None


def test_training_reports_each_step_and_its_loading_and_preparing_phases(tmp_path, base_model):
    """A 3-step fine-tune reports 3 training steps, and runs its load and its preparation as phases, the
    tokenizing and the packing as phases inside the preparation (the log gives each its seconds)."""
    from core.training_data import parse_training_jsonl
    from worker.training import finetune

    spec = FinetuneSpec.model_validate(
        {**ft_spec(base_model, max_steps=3), "model": str(base_model), "packing": True, "max_seq_length": 48}
    )
    with open(FT_DATA, "rb") as stream:
        rows = [(r.line, r.input) for r in parse_training_jsonl(stream, max_rows=100, max_row_bytes=1 << 20)]
    recorder = Recorder()
    finetune.finetune(LoadOptions(model=str(base_model)), spec, rows, tmp_path, progress=recorder)
    assert recorder.kinds.count("training step") == 3
    preparing = "preparing training"
    assert recorder.phases == [
        *("loading model", None, preparing),
        *("tokenizing 12 rows", None, preparing),
        *("packing", None, preparing),
        None,
    ]


# --- real workers ---------------------------------------------------------------------------------------------------


def stall_events(job_id: str) -> list[JobEvent]:
    with session_scope() as session:
        return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "stall")))


def worker_row(pid: int) -> Worker:
    with session_scope() as session:
        return session.scalars(select(Worker).where(Worker.pid == pid)).one()


def assert_stalled_and_exited(victim, job_id: str, stuck_in: str) -> JobEvent:
    """The victim wrote one stall event (with the stack of its engine thread, stuck in `stuck_in`), recorded the
    stall on its registration and exited with exits.STALLED."""
    assert STALL_S > 20 / 3, "a heartbeat (every lease / 3 s) must fall within the stall bound"
    wait_for(lambda: stall_events(job_id), 120, "the stall event")
    assert victim.popen.wait(60) == exits.STALLED, victim.tail()
    [event] = stall_events(job_id)
    data = event.data
    assert event.level == "error" and data["exit_code"] == exits.STALLED and data["bound_s"] == STALL_S
    # detected once the bound passed, at the heartbeat's next check (every second, after its database work)
    assert STALL_S <= data["seconds"] < STALL_S + 30
    assert "worker/faults.py" in data["stack"] and stuck_in in data["stack"]
    assert "worker/faults.py" in event.message and f"exits with code {exits.STALLED}" in event.message
    row = worker_row(victim.pid)
    assert (row.state, row.exit_code) == ("offline", exits.STALLED)
    assert row.reason.startswith("stalled: no progress for")
    assert row.reason.endswith(f"(job {job_id}, shard 0); exit code {exits.STALLED}")
    # the last heartbeat while it ran (one falls within any 8 s) showed its engine's progress and the bound
    assert row.capabilities["progress"]["stall_bound_s"] == STALL_S
    return event


def test_a_generation_step_that_never_returns_is_given_back_and_finished_by_another_worker(
    tmp_path, any_jobs_env, spawn_worker, tiny_model
):
    """Worker A's decode step hangs after 3 committed micro-batches (12 rows) while its heartbeat thread goes on.
    Within the bound A writes a stall event naming the step and its stack, stops renewing, hands the shard back
    (an attempt counted), records why on its registration and exits 70; worker B finishes the shard. A's 12 rows are
    kept, B runs only the others, and every row was executed exactly once. On SQLite and on Postgres."""
    victim = spawn_worker([], JOBS_TEST_FAULTS="hang_after_144@decode_step", JOBS_STALL_SECONDS=str(STALL_S))
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 48), shard_rows=48)
    )
    wait_for(lambda: row_counts(job["id"]).get("succeeded", 0) >= 12, 120, "A's committed rows", procs=[victim])
    rescuer = spawn_worker([])  # its stall bound is the default (auto)
    event = assert_stalled_and_exited(victim, job["id"], "in __call__")  # StopFlag.__call__: a decode step
    assert event.data["doing"].startswith("since the last decode step")
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "B to finish the job", procs=[rescuer])
    with session_scope() as session:
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"]).order_by(JobRow.idx)).all()
        shard = session.scalars(select(Shard).where(Shard.job_id == job["id"])).one()
    names = {worker_row(victim.pid).name: "A", worker_row(rescuer.pid).name: "B"}
    assert [names[r.worker] for r in rows] == ["A"] * 12 + ["B"] * 36
    assert {r.executions for r in rows} == {1}, "a row was executed twice"
    assert all(r.completion_tokens == 48 for r in rows)
    assert shard.attempts == 2  # the stall counted as A's attempt


def test_a_shard_that_stalls_on_its_last_attempt_fails_with_the_stall_as_its_reason(
    tmp_path, jobs_env, spawn_worker, tiny_model, monkeypatch
):
    """With one attempt per shard, a stall at the first decode step fails the shard and the job, saying it stalled;
    nothing was committed."""
    from core.settings import reset

    monkeypatch.setenv("JOBS_MAX_ATTEMPTS", "1")
    reset()
    victim = spawn_worker([], JOBS_TEST_FAULTS="hang@decode_step", JOBS_STALL_SECONDS=str(STALL_S))
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 4)))
    assert_stalled_and_exited(victim, job["id"], "in __call__")
    final = views.get(job["id"], owner=None)
    assert final["state"] == "failed" and "stalled on attempt 1 of 1" in final["error"], final["error"]
    assert row_counts(job["id"]) == {"failed": 4}


def test_a_commit_that_never_returns_stalls_and_the_report_shows_where_the_committer_is(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """The first commit never returns (a store that never answers): the engine hands its micro-batches over until it
    waits on the committer (a full queue, or the shard's end), and beats no more. The stall event says the engine
    waits on the committer and carries the committer thread's stack, stuck in the commit; the worker exits 70."""
    victim = spawn_worker([], JOBS_TEST_FAULTS="hang@commit", JOBS_STALL_SECONDS=str(STALL_S))
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 8)))
    event = assert_stalled_and_exited(victim, job["id"], "committer thread stack")
    engine_stack, committer_stack = event.data["stack"].split("committer thread stack:")
    assert "worker/committer.py" in engine_stack and "worker/faults.py" not in engine_stack
    assert "worker/faults.py" in committer_stack and "in commit" in committer_stack
    waiting = event.message.split("; waiting on the committer, at ", 1)
    assert len(waiting) == 2 and "worker/committer.py" in waiting[0] and "worker/faults.py" in waiting[1]
    assert row_counts(job["id"]).get("succeeded", 0) == 0


def test_a_job_cancelled_while_its_engine_hangs_ends_cancelled_at_the_stall(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """A cancel cannot reach an engine that never returns between steps; at the stall the worker cancels the shard
    (instead of queueing it again), the job ends cancelled, and the worker exits 70."""
    victim = spawn_worker([], JOBS_TEST_FAULTS="hang@decode_step", JOBS_STALL_SECONDS=str(STALL_S))
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 4)))

    def hung() -> bool:
        return "blocking this thread" in victim.log.read_text(errors="replace")

    wait_for(hung, 120, "the engine to hang", procs=[victim])
    service.cancel(job["id"], owner=None, by="t")
    event = assert_stalled_and_exited(victim, job["id"], "in __call__")
    assert "the job is stopping: the shard is cancelled" in event.message
    wait_for(lambda: job_state(job["id"]) == "cancelled", 30, "the job to end cancelled")
    with session_scope() as session:
        assert session.scalars(select(Shard.state).where(Shard.job_id == job["id"])).one() == "cancelled"


def test_a_training_step_that_never_returns_is_resumed_by_another_worker_from_its_checkpoint(
    tmp_path, jobs_env, spawn_worker, base_model
):
    """Worker A's training hangs after step 12 (checkpoints every 5 steps): A writes the stall event and exits 70; B
    resumes from checkpoint-10 and finishes the job; the fine-tune's rows are committed once."""
    victim = spawn_worker([], JOBS_TEST_FAULTS="hang_after_12@train_step", JOBS_STALL_SECONDS=str(STALL_S))
    ft = service.submit(owner="t", spec_data=ft_spec(base_model, max_steps=20, checkpoint_steps=5))
    wait_for(
        lambda: any(e.message.startswith("step 12/") for e in metric_events(ft["id"])), 180, "step 12", procs=[victim]
    )
    rescuer = spawn_worker([])
    event = assert_stalled_and_exited(victim, ft["id"], "in on_log")
    assert event.data["doing"].startswith("since the last training step")
    done = finished(ft["id"], 180, [rescuer])
    assert done["state"] == "succeeded", done["error"]
    assert done["metrics"]["training"]["resumed_from_step"] == 10
    with session_scope() as session:
        executions = session.scalars(select(JobRow.executions).where(JobRow.job_id == ft["id"])).all()
    assert set(executions) == {1}


def metric_events(job_id: str) -> list[JobEvent]:
    with session_scope() as session:
        return list(session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "metric")))


def test_out_of_memory_while_loading_is_a_failed_attempt_with_a_clear_event(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """A model load that runs out of memory fails the attempt with an event naming the model and the memory free;
    after its attempts the job fails with that reason, and the worker stays up for the next job."""
    worker = spawn_worker([], JOBS_TEST_FAULTS="oom@load")
    job = service.submit(owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 4)))
    wait_for(lambda: job_state(job["id"]) == "failed", 120, "the job to fail", procs=[worker])
    messages = [e["message"] for e in views.events(job["id"], owner=None) if e["level"] == "error"]
    assert any(f"out of memory loading {tiny_model} (on the CPU)" in m and "(attempt 1 of 3)" in m for m in messages), (
        messages
    )
    assert "out of memory loading" in views.get(job["id"], owner=None)["error"]
    assert worker.alive()


# --- workers that cannot run refuse to start --------------------------------------------------------------------------


def test_a_worker_whose_gpus_are_not_there_refuses_to_start_with_exit_6(tmp_path, jobs_env):
    """`gpujobs worker --gpus 2,0` on a host without those GPUs exits 6 with a message saying why and what to do; its
    registration is offline with that reason and code: it never counts as a live worker of queue gpu2."""
    from api.stack import detect_gpus

    if {"0", "2"} <= set(detect_gpus()):
        pytest.skip("this host has GPUs 0 and 2")
    result = subprocess.run(
        [sys.executable, "-m", "api", "worker", "--gpus", "2,0"],
        env=jobs_env.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == exits.SLICE_MISSING, result.stderr
    assert "refusing to start (exit 6): the slice 2,0 asks for 2 GPU(s)" in result.stderr
    assert "--gpus naming GPUs that `nvidia-smi` lists" in result.stderr
    with session_scope() as session:
        row = session.scalars(select(Worker).where(Worker.slice == "2,0")).one()
        assert (row.state, row.exit_code, row.queues) == ("offline", exits.SLICE_MISSING, ["gpu2"])
        assert row.reason.startswith("refused to start: the slice 2,0 asks for 2 GPU(s)")
        assert row.capabilities["cuda_visible_devices"] == "2,0"
        assert row.capabilities["cuda_device_order"] == "PCI_BUS_ID"
    with session_scope() as session:
        assert registry.live(session, 30) == []  # submit never counts it as serving gpu2
    [shown] = [w for w in views.workers() if w["slice"] == "2,0"]  # what `gpujobs workers` prints
    assert (shown["state"], shown["exit_code"], shown["reason"]) == ("offline", exits.SLICE_MISSING, row.reason)
