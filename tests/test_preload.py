"""A worker's imports (worker/preload.py, worker/main.py): the heavy ones run once, in one thread, before any other
thread starts, so no two threads race on them (issue 27); and a worker whose engine or training code does not
import is the worker's fault, not the job's: it gives its shard back without counting the attempt, says why on its
registration, exits 72, and its supervisor starts a fresh one. Real worker processes, real Redis and SQLite, the tiny
model; tests/importrace.py turns the race, which unforced needs luck, into a certainty wherever it can happen, and
JOBS_TEST_FAULTS=break_MODULE@POINT leaves a worker in the state that race left it in."""

from __future__ import annotations

import os
import subprocess
import sys

from sqlalchemy import select

from api import service, views
from api.supervisor import Policy, Supervisor
from core import exits, leases
from core.db import session_scope
from core.models import JobEvent, JobRow, Shard
from core.slices import worker_env
from tests import importrace
from tests.conftest import ROOT, Proc, registered, started, stop_all, wait_for
from tests.test_recovery import job_state, write_dataset
from worker import preload


def spawn_raced(tmp_path, name: str, **extra: str) -> Proc:
    """A CPU worker (`python -m worker.main --slice ''`) run under tests/importrace.py's gate."""
    env = worker_env([], {**os.environ, **extra})
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-c", "from tests import importrace; importrace.run('worker.main')", "--slice", ""],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return Proc(popen, log)


def finished(job_id: str) -> str | None:
    state = job_state(job_id)
    return state if state in ("succeeded", "failed", "cancelled") else None


def test_a_worker_whose_start_up_imports_would_race_starts_whole_and_runs_a_job(tmp_path, jobs_env, tiny_model):
    """Under an import hook that makes any two threads' imports of torch._dynamo and torch._inductor race
    (tests/importrace.py), a fresh worker imports them in one thread only (the hook never saw two at once), and a
    generation job, which imports transformers' modeling code to load its model, succeeds on its first attempt.
    Before the fix the QLoRA and flex_attention probe threads imported them side by side at start-up, one of them got
    a half-imported torch._dynamo, and every attempt of every shard failed to import transformers' modeling code."""
    worker = spawn_raced(tmp_path, "worker")
    try:
        url = jobs_env.database_url
        wait_for(lambda: registered(url, worker.pid), 120, "worker registration", procs=[worker])
        wait_for(lambda: started(url, worker.pid), 180, "worker start-up", procs=[worker])
        spec = {"model": str(tiny_model), "input": write_dataset(tmp_path / "d.jsonl", 3), "gpus": 0}
        job = service.submit(owner="t", spec_data={**spec, "max_new_tokens": 4})
        state = wait_for(lambda: finished(job["id"]), 180, "the job to end", procs=[worker])
        log = worker.log.read_text(errors="replace")
        raced = [line for line in log.splitlines() if line.startswith(importrace.MARK)]
        assert not raced, f"two threads imported torch._dynamo and torch._inductor at once: {raced}\n{worker.tail()}"
        assert state == "succeeded", worker.tail(60)
        with session_scope() as session:
            shard = session.scalars(select(Shard).where(Shard.job_id == job["id"])).one()
            rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"])).all()
        assert shard.attempts == 1 and [r.executions for r in rows] == [1, 1, 1]
    finally:
        stop_all([worker])


# --- a broken worker is the worker's fault --------------------------------------------------------------------------


# a fresh process: CUDA said to be there, the hashes taken at start-up, then the code that takes them broken
HASHES = """
import sys
import torch
torch.cuda.is_available = lambda: True
from torch._inductor import codecache
from torch._inductor.codegen.common import get_scheduling_for_device
from torch._inductor.runtime import triton_compat
from worker import preload
lazy = [name for name in preload.COMPILE_IMPORTS if name not in sys.modules]
assert lazy and get_scheduling_for_device("cuda") is None, lazy  # what the call below has to do
kept = codecache.triton_key
del codecache.triton_key  # as on torch 2.11 (the GPU host's): CacheBase.get_system calls Triton's own function
preload.hash_sources()
assert triton_compat.triton_key.cache_info().currsize == 1  # Triton's hash, kept where get_system will look
codecache.triton_key = kept
preload.hash_sources()  # torch >= 2.12 keeps it in a cache of its own as well
preload.import_compiler()
assert [name for name in preload.COMPILE_IMPORTS if name not in sys.modules] == []
assert get_scheduling_for_device("cuda") is not None  # Inductor's code generators registered
def broken(*args, **kwargs):
    raise AssertionError("hashed again")
codecache.build_code_hash = triton_compat.triton_key = broken
assert codecache.torch_key() and codecache.triton_key() is not None
print("kept")
"""


def test_a_gpu_worker_prepares_inductor_at_start_up_and_its_first_compile_does_not_again():
    """Inductor keys its caches by hashes of torch's and Triton's sources (0.45 s for Triton's in a restarted
    worker's first job on the H200, 0.84 s on an H100): on a GPU host `preload` takes them, also on a torch without
    `codecache.triton_key` (2.11, the GPU host's), and a compile later reads them back without hashing a file
    again. It also registers Inductor's code generators and imports what a first compile imports lazily
    (COMPILE_IMPORTS, ~1 s of a restarted worker's first job on an H100)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", HASHES], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("kept"), done.stderr[-2000:]


def test_check_names_a_required_module_that_no_longer_imports(monkeypatch):
    """check() is None while every required module imports, and names the first that does not (None in sys.modules:
    what a failed import of a half-imported module leaves), with the error. (Light modules stand in for REQUIRED:
    the worker tests import the real ones.)"""
    monkeypatch.setattr(preload, "REQUIRED", ("json", "email.mime.text"))
    assert preload.check() is None
    monkeypatch.setitem(sys.modules, "email.mime.text", None)
    assert preload.check() == (
        "this process cannot import email.mime.text: ModuleNotFoundError: import of email.mime.text halted; None in "
        "sys.modules"
    )


def test_a_worker_whose_code_does_not_import_never_costs_the_job_an_attempt(tmp_path, jobs_env, tiny_model):
    """Under a supervisor, with two faults that each fire once in the stack (JOBS_TEST_FAULTS): the first worker's
    peft does not import at start-up, so it refuses to start with exit 72 and the cause on its registration, before
    it could take anything; the second's torch._dynamo stops importing at its first model load (the state issue 27's
    race left a worker in), so its shard fails, the worker finds its own code broken, gives the shard back without
    counting the attempt (a worker_broken event with the cause), records why and exits 72. The third runs the job:
    every row once, on its one counted attempt; each exit was restarted."""
    faults = "once_break_peft@preload,once_break_torch._dynamo@load"
    policy = Policy(limit=5, window=600, backoff=0.2, backoff_max=1)
    sup = Supervisor([[]], env={**os.environ, "JOBS_TEST_FAULTS": faults}, logs_dir=tmp_path, hint="-", policy=policy)
    sup.start()
    try:
        spec = {"model": str(tiny_model), "input": write_dataset(tmp_path / "d.jsonl", 6), "gpus": 0}
        job = service.submit(owner="t", spec_data={**spec, "max_new_tokens": 4, "batch_rows": 2})

        def ended():
            sup.step()
            assert not sup.slots[0].down, sup.slots[0].down
            return finished(job["id"])

        try:
            state = wait_for(ended, 300, "the job to end", interval=0.5)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{(tmp_path / 'worker-0.log').read_text(errors='replace')[-4000:]}") from None
        assert state == "succeeded", (tmp_path / "worker-0.log").read_text(errors="replace")[-4000:]
        with session_scope() as session:
            shard = session.scalars(select(Shard).where(Shard.job_id == job["id"])).one()
            rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"])).all()
            [event] = session.scalars(
                select(JobEvent).where(JobEvent.job_id == job["id"], JobEvent.kind == leases.BROKEN_EVENT)
            ).all()
        every = sorted(views.workers(all=True), key=lambda w: w["restarts"])
        assert [(w["exit_code"], w["restarts"]) for w in every] == [(72, 0), (72, 1), (None, 2)]
        first, second, third = every
        assert first["reason"].startswith(
            "refused to start: this process cannot import peft: ModuleNotFoundError: import of peft halted"
        )
        cause = "this process cannot import torch._dynamo: ModuleNotFoundError: import of torch._dynamo halted"
        assert second["reason"].startswith(f"broken: {cause}") and second["reason"].endswith(
            f"(job {job['id']}, shard 0); exit code {exits.BROKEN}"
        )
        assert event.level == "error" and event.data["cause"].startswith(cause)
        assert (event.data["counted"], event.data["exit_code"], event.data["worker"]) == (False, 72, second["name"])
        assert "the attempt not counted (0 of 3 used)" in event.message
        assert {r.worker for r in rows} == {third["name"]} and [r.executions for r in rows] == [1] * 6
        assert shard.attempts == 1  # the third worker's: the broken one's was given back uncounted
    finally:
        sup.stop(20)


def test_broken_workers_stop_being_free_after_max_attempts_hand_backs(jobs_env, tmp_path, tiny_model, monkeypatch):
    """A cause that follows a shard from worker to worker must not send it round for ever: the first max_attempts
    broken-worker hand-backs of a shard leave its attempts alone, later ones count, and the shard fails once they
    are used, naming the cause."""
    from core.settings import reset

    monkeypatch.setenv("JOBS_MAX_ATTEMPTS", "2")
    reset()
    spec = {"model": str(tiny_model), "input": write_dataset(tmp_path / "d.jsonl", 2), "gpus": 0}
    job = service.submit(owner="t", spec_data=spec)
    counted = []
    for n in range(4):
        with session_scope() as session:
            shard = session.scalars(select(Shard).where(Shard.job_id == job["id"])).one()
        claim = leases.take(shard.id, f"w{n}", 30)
        assert claim is not None, f"hand-back {n}: the shard is {shard.state}"
        leases.give_back_broken(shard.id, f"w{n}", cause="cannot import x", error="Traceback ...", exit_code=72)
        with session_scope() as session:
            shard = session.get(Shard, shard.id)
            counted.append((shard.state, shard.attempts))
    assert counted == [("queued", 0), ("queued", 0), ("queued", 1), ("failed", 2)]
    assert shard.error == "failed on attempt 2 of 2 (w3): cannot import x"
