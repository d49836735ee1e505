"""Failures that would fail the same way again are not retried, and say what they were: a real worker whose C++
compiler is broken (a stand-in `CXX` that answers `--version` and fails every compile, as a worker without Python
headers does) takes a flex_attention job queued before it started, fails each shard once with the root cause in
one line (the traceback in an event), and its flex_attention probe then makes submit refuse such jobs."""

from __future__ import annotations

import json
import shutil

import pytest
from sqlalchemy import select

from api import service
from core.db import session_scope
from core.errors import Unschedulable
from core.models import Job, JobEvent, Shard, Worker
from tests.conftest import wait_for

BROKEN_CXX = """#!/bin/sh
case "$1" in --version|-v|-dumpversion|-dumpfullversion) exec {gxx} "$@";; esac
echo "probe.cpp:1:10: fatal error: Python.h: No such file or directory" >&2
exit 1
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to answer --version for the broken stand-in")
def test_a_kernel_that_does_not_compile_fails_once_naming_the_cause_and_is_refused_after_the_probe(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """Each shard fails on its first attempt (not 3); the job's error is one line naming the compile failure, not
    Dynamo's "Set TORCHDYNAMO_VERBOSE=1"; an error event holds the traceback; once the worker's probe answered,
    a new flex_attention submit is refused with the reason and what to use instead."""
    cxx = tmp_path / "cxx"
    cxx.write_text(BROKEN_CXX.format(gxx=shutil.which("g++")))
    cxx.chmod(0o755)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Row {i}"}) + "\n" for i in range(4)))
    spec = {
        "model": str(tiny_model),
        "input": str(data),
        "gpus": 0,
        "max_new_tokens": 4,
        "attn_implementation": "flex_attention",
        "shard_rows": 2,
    }
    job = service.submit(owner="t", spec_data=spec)  # no worker is live yet: queued for the CPU queue
    # JOBS_PROBE_NICE=0: the probe at the worker's own priority. At its default 19 it gets about 1 % of a core
    # while the suite's other processes keep both of CI's cores busy: 2.7 s of CPU took 165 s on a quiet CI run
    # and 342 s under two spin loops, all of it waiting for CPU
    worker = spawn_worker([], CXX=str(cxx), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), JOBS_PROBE_NICE="0")
    wait_for(lambda: _job(job["id"]).state == "failed", 300, "the job to fail", procs=[worker])
    final = _job(job["id"])
    with session_scope() as session:
        shards = session.scalars(select(Shard).where(Shard.job_id == job["id"])).all()
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job["id"], JobEvent.level == "error")).all()
    assert [(s.state, s.attempts) for s in shards] == [("failed", 1), ("failed", 1)]
    assert "\n" not in final.error and "TORCHDYNAMO_VERBOSE" not in final.error
    assert final.error.startswith("2 shards (0, 1): torch.compile failed on this worker, "), final.error
    assert "not retried: it fails the same way on every attempt" in final.error
    assert events and all("Traceback" in e.data["traceback"] and "not retried" in e.message for e in events)

    # the probe builds with a compiler that fails (about 2.7 s of CPU); the bound only ends a stuck test
    wait_for(lambda: (_probe(worker.pid) or {}).get("ok") is False, 300, "the flex_attention probe", procs=[worker])
    with pytest.raises(
        Unschedulable,
        match=r"flex_attention does not compile on this worker's cpu: torch.compile "
        r"failed on this worker, .*: use attn_implementation sdpa or eager",
    ):
        service.submit(owner="t", spec_data=spec)


def _job(job_id: str) -> Job:
    with session_scope() as session:
        return session.get(Job, job_id)


def _probe(pid: int) -> dict | None:
    with session_scope() as session:
        caps = session.scalar(select(Worker.capabilities).where(Worker.pid == pid))
    return (caps or {}).get("flex_attention")


def test_an_out_of_memory_is_retried_even_inside_a_compilers_error():
    """final_cause: a compile error is final, but one raised from running out of memory is not (the next attempt may
    find the memory, or run smaller micro-batches: setup.MERGE_REFUSED), nor the out-of-memory that the fine-tune
    raises again from it (setup.compile_model, merged)."""
    import torch

    from worker.failures import final_cause

    class InductorError(RuntimeError):  # torch._inductor's, by the name final_cause knows it by
        pass

    def raised(make):
        try:
            make()
        except BaseException as exc:
            return exc

    def compile_fails():
        raise InductorError("LoweringException: a kernel that does not compile")

    def compile_runs_out_of_memory():
        try:
            raise torch.OutOfMemoryError("CUDA out of memory while autotuning")
        except torch.OutOfMemoryError as oom:
            raise InductorError("LoweringException") from oom

    wrapped = raised(compile_runs_out_of_memory)
    assert final_cause(raised(compile_fails)).startswith("torch.compile failed on this worker, InductorError")
    assert final_cause(wrapped) is None

    def raised_again():
        raise torch.OutOfMemoryError(str(wrapped.__cause__)) from wrapped

    assert final_cause(raised(raised_again)) is None
