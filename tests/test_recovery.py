"""Recovery with real processes: a SIGKILLed worker's shard is finished by another worker, nothing runs twice;
cancel stops work and keeps finished rows; retry re-opens the same job id."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest
from sqlalchemy import func, select

from api import results, service
from core.dataset import retry_can_change, too_long_to_train
from core.db import session_scope
from core.errors import CannotTrain, NothingToRetry
from core.models import Job, JobRow, Shard, Worker
from core.spec import GenerateSpec
from tests.conftest import wait_for
from tests.test_leases import messages


def write_dataset(path, n: int) -> str:
    path.write_text(
        "".join(
            json.dumps({"prompt": f"Row {i}: tell me about the sky.", "custom_id": f"r{i}"}) + "\n" for i in range(n)
        )
    )
    return str(path)


def long_spec(model, data: str, **extra) -> dict:
    """Every row generates exactly 48 tokens (EOS off), 4 rows per committed micro-batch."""
    return {
        "model": str(model),
        "input": data,
        "gpus": 0,
        "max_new_tokens": 48,
        "ignore_eos": True,
        "batch_rows": 4,
        **extra,
    }


def row_counts(job_id: str) -> dict[str, int]:
    with session_scope() as session:
        return dict(
            session.execute(
                select(JobRow.state, func.count()).where(JobRow.job_id == job_id).group_by(JobRow.state)
            ).all()
        )


def strict_template_model(tmp_path, tiny_model):
    """A copy of the tiny model whose chat template refuses a conversation that starts with a tool message: such a
    row fails in the engine, on the worker, while the others run."""
    model = tmp_path / "strict-template"
    shutil.copytree(tiny_model, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(
        "{%- if messages[0]['role'] == 'tool' %}{{ raise_exception('a conversation cannot start with a tool "
        "message') }}{%- endif %}" + template
    )
    return model


def job_state(job_id: str) -> str:
    with session_scope() as session:
        return session.get(Job, job_id).state


def test_sigkilled_worker_shard_is_finished_by_another_within_60s(tmp_path, jobs_env, spawn_worker, tiny_model):
    """SIGKILL the worker holding a half-committed shard (its pid read from its registration): with default
    settings the other worker finishes the job in under 60 s, every row has one result, and every row,
    including those committed before the kill, was executed exactly once.

    64 rows: the 60 s are for the lease to run out, the reaper to re-queue the shard and the survivor to load the
    model; the few rows left take seconds even on a loaded machine (with 480 rows, computing the 400-odd left
    took most of the bound there)."""
    n = 64
    workers = [spawn_worker([]), spawn_worker([])]
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", n), shard_rows=n)
    )

    def half_done():
        counts = row_counts(job["id"])
        return counts.get("succeeded", 0) >= 8 and counts.get("pending", 0) >= 40

    wait_for(half_done, 120, "a shard with committed and uncommitted rows", interval=0.05, procs=workers)
    with session_scope() as session:
        shard = session.scalars(select(Shard).where(Shard.job_id == job["id"])).one()
        victim = session.get(Worker, shard.lease_owner)
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    dead = next(w for w in workers if w.pid == victim.pid)
    dead.popen.wait(10)
    assert not dead.alive()
    with session_scope() as session:
        committed_before = set(
            session.scalars(select(JobRow.idx).where(JobRow.job_id == job["id"], JobRow.state == "succeeded")).all()
        )
    assert 8 <= len(committed_before) < n

    survivor = next(w for w in workers if w.pid != victim.pid)
    wait_for(lambda: job_state(job["id"]) in ("succeeded", "failed"), 60, "the job to finish", procs=[survivor])
    assert time.monotonic() - killed_at < 60
    assert job_state(job["id"]) == "succeeded"
    with session_scope() as session:
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"])).all()
    assert len(rows) == n and all(r.state == "succeeded" and r.completion_tokens == 48 for r in rows)
    assert {r.executions for r in rows} == {1}, "a row was executed twice"
    with session_scope() as session:
        survivor_name = session.scalar(select(Worker.name).where(Worker.pid == survivor.pid))
    assert {r.worker for r in rows if r.idx not in committed_before} == {survivor_name}


def test_cancel_stops_running_work_and_keeps_finished_rows(tmp_path, jobs_env, spawn_worker, tiny_model):
    """Cancel while a shard runs: no row is committed later than cancel + 5 s (read from SQL), the running
    `generate` stops between decode steps, finished rows stay, the job ends cancelled, and the worker claims its
    next task within 5 s of that task being queued."""
    worker = spawn_worker([])
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 480), shard_rows=120)
    )
    wait_for(lambda: row_counts(job["id"]).get("succeeded", 0) >= 8, 120, "first rows", procs=[worker])
    cancelled_at = time.time()
    service.cancel(job["id"], owner=None, by="t")
    wait_for(lambda: job_state(job["id"]) == "cancelled", 10, "the job to be cancelled", procs=[worker])
    done = row_counts(job["id"]).get("succeeded", 0)
    time.sleep(2)
    assert row_counts(job["id"]).get("succeeded", 0) == done, "rows were committed after the cancel"
    assert 8 <= done < 480
    with session_scope() as session:
        last_commit = session.scalar(select(func.max(JobRow.finished_at)).where(JobRow.job_id == job["id"]))
    assert last_commit <= cancelled_at + 5, f"a row was committed {last_commit - cancelled_at:.1f} s after cancel"
    finished = list(results.results(job["id"], owner=None))
    assert len(finished) == done

    small = service.submit(
        owner="t",
        spec_data={
            "model": str(tiny_model),
            "gpus": 0,
            "max_new_tokens": 4,
            "input": write_dataset(tmp_path / "s.jsonl", 3),
        },
    )
    wait_for(lambda: job_state(small["id"]) == "succeeded", 15, "the next job", procs=[worker])
    with session_scope() as session:
        shard = session.scalars(select(Shard).where(Shard.job_id == small["id"])).one()
    waited = shard.started_at - shard.enqueued_at
    assert waited < 5, f"the next task was claimed {waited:.1f} s after it was queued"


def test_retry_reopens_the_same_job_id(tmp_path, jobs_env, spawn_worker, tiny_model):
    """After a cancel, `retry` re-runs the unfinished rows under the same id; `--failed-only` has nothing to do
    for rows a cancel left pending, and its refusal says how many there are and that the plain retry runs them."""
    worker = spawn_worker([])
    job = service.submit(
        owner="t", spec_data=long_spec(tiny_model, write_dataset(tmp_path / "d.jsonl", 120), shard_rows=40)
    )
    wait_for(lambda: row_counts(job["id"]).get("succeeded", 0) >= 4, 120, "first rows", procs=[worker])
    service.cancel(job["id"], owner=None, by="t")
    wait_for(lambda: job_state(job["id"]) == "cancelled", 15, "cancelled", procs=[worker])
    left = row_counts(job["id"])["pending"]
    with pytest.raises(NothingToRetry) as refused:  # no failed row: says what a plain retry would run
        service.retry(job["id"], owner=None, failed_only=True, by="t")
    assert str(refused.value) == (
        f"job {job['id']} has no rows to retry (--failed-only); its {left} rows a cancel left unfinished run with "
        f"`gpujobs retry {job['id']}` (without --failed-only)"
    )
    retried = service.retry(job["id"], owner=None, failed_only=False, by="t")
    assert retried["id"] == job["id"] and retried["retries"] == 1
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the retried job", procs=[worker])
    assert row_counts(job["id"]) == {"succeeded": 120}


def test_retry_failed_only_reruns_rows_that_failed_in_the_engine(tmp_path, jobs_env, spawn_worker, tiny_model):
    """A row that failed in the engine (a chat template that refuses its messages on the worker) lives in a
    succeeded shard; `retry --failed-only` re-opens that shard, re-runs only that row (it fails again, for the same
    reason) and the job ends succeeded with retries=1; structurally invalid rows are never re-run."""
    worker = spawn_worker([])
    model = strict_template_model(tmp_path, tiny_model)
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "What is the capital of France?"}),
                json.dumps({"messages": [{"role": "tool", "content": "hi"}]}),
                "{broken",
            ]
        )
        + "\n"
    )
    job = service.submit(owner="t", spec_data={"model": str(model), "input": str(data), "gpus": 0, "max_new_tokens": 8})
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the job", procs=[worker])
    retried = service.retry(job["id"], owner=None, failed_only=True, by="t")
    assert retried["retries"] == 1
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the retried job", procs=[worker])
    errors = {r["line"]: r["error"] for r in results.results(job["id"], owner=None, errors=True)}
    assert errors[2].startswith("line 2: cannot build the prompt") and "cannot start with a tool message" in errors[2]
    assert errors[3].startswith("line 3: invalid JSON")
    with session_scope() as session:
        executions = dict(
            session.execute(select(JobRow.idx, JobRow.executions).where(JobRow.job_id == job["id"])).all()
        )
    assert executions == {0: 1, 1: 2, 2: 0}


def test_retry_failed_only_of_a_cancelled_job_ends_cancelled_while_rows_it_left_are_not_run(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """A job cancelled with a row failed in the engine and rows still pending: `retry --failed-only` re-runs the
    failed row's shard only, and the job ends `cancelled` again, saying how many rows are not run and how to run
    them, not `succeeded` with rows no run will ever do; a plain `retry` then runs them."""
    worker = spawn_worker([])
    model = strict_template_model(tmp_path, tiny_model)
    data = tmp_path / "d.jsonl"
    rows = [{"prompt": f"Row {i}: tell me about the sky.", "custom_id": f"r{i}"} for i in range(120)]
    rows[1] = {"messages": [{"role": "tool", "content": "hi"}], "custom_id": "r1"}
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    job = service.submit(owner="t", spec_data=long_spec(model, str(data), shard_rows=40))
    wait_for(lambda: row_counts(job["id"]).get("failed", 0) == 1, 120, "the failed row", procs=[worker])
    service.cancel(job["id"], owner=None, by="t")
    wait_for(lambda: job_state(job["id"]) == "cancelled", 15, "cancelled", procs=[worker])
    pending = row_counts(job["id"]).get("pending", 0)
    assert pending > 40  # shards 1 and 2 never ran

    service.retry(job["id"], owner=None, failed_only=True, by="t")
    wait_for(lambda: job_state(job["id"]) in ("succeeded", "failed", "cancelled"), 120, "the retry", procs=[worker])
    with session_scope() as session:
        state = session.get(Job, job["id"]).state
    assert state == "cancelled"
    assert row_counts(job["id"]).get("pending", 0) > 0
    last = messages(job["id"], "state")[-1]
    assert last.startswith("job → cancelled: ") and "rows were not run" in last, last
    assert f"`gpujobs retry {job['id']}` runs them" in last, last

    service.retry(job["id"], owner=None, failed_only=False, by="t")
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the full retry", procs=[worker])
    assert row_counts(job["id"]) == {"succeeded": 119, "failed": 1}


def test_retry_failed_only_keeps_rows_that_fail_the_same_way_and_says_so(tmp_path, jobs_env, spawn_worker, tiny_model):
    """Rows refused for their input (n=2 under greedy decoding, broken JSON: refused at submit, each naming its
    line) are never re-run: `retry --failed-only` with only those left says how many and to fix the input, and
    changes nothing; a row the worker refused for its own input is kept too (a job stored before the check)."""
    worker = spawn_worker([])
    data = tmp_path / "d.jsonl"
    data.write_text(
        "\n".join(
            [
                json.dumps({"prompt": "What is the capital of France?", "tag": "a"}),
                json.dumps({"prompt": "x", "num_return_sequences": 2, "tag": "b"}),
                "{broken",
            ]
        )
        + "\n"
    )
    job = service.submit(
        owner="t", spec_data={"model": str(tiny_model), "input": str(data), "gpus": 0, "max_new_tokens": 4}
    )
    wait_for(lambda: job_state(job["id"]) == "succeeded", 120, "the job", procs=[worker])
    errors = {r["line"]: r for r in results.results(job["id"], owner=None, errors=True)}
    assert errors[2]["error"].startswith("line 2: num_return_sequences 2 needs sampling") and errors[2]["tag"] == "b"
    with pytest.raises(
        NothingToRetry,
        match=rf"job {job['id']}: 2 failed rows were refused for their input \(at "
        r"submit, or by the worker\) and cannot be retried; fix the input",
    ):
        service.retry(job["id"], owner=None, failed_only=True, by="t")
    assert job_state(job["id"]) == "succeeded" and row_counts(job["id"]) == {"succeeded": 1, "failed": 2}


def test_a_row_the_worker_refused_for_its_parameters_cannot_change_on_retry():
    """`retry_can_change`: a row whose parameters the submit checks refuse (stored before the check existed, then
    refused by the worker) or that the worker found too long fails the same way again, as does a fine-tune's row
    refused for rows longer than max_seq_length or for any other reason of its spec and input (CannotTrain); an
    engine failure may not, nor a fine-tune's lost worker or out of memory."""
    spec = GenerateSpec(model="m", input="file_x")

    def row(params, error, executions=1):
        return JobRow(line=4, input={"prompt": "x", "params": params, "extra": {}}, error=error, executions=executions)

    assert not retry_can_change(row({"num_return_sequences": 2}, "line 4: num_return_sequences 2 needs sampling"), spec)
    assert not retry_can_change(
        row(
            {},
            "line 4: prompt of 900 tokens + max_new_tokens 9 exceeds the model's context "
            "of 512 tokens: shorten the prompt or lower max_new_tokens",
        ),
        spec,
    )
    assert not retry_can_change(row({}, "line 4: prompt too long", executions=0), spec)  # refused at submit
    assert retry_can_change(row({}, "line 4: cannot build the prompt: bad template"), spec)
    assert retry_can_change(row({}, "failed 3 times; last error: RuntimeError: CUDA error", executions=0), spec)

    def training_row(error):  # a fine-tune's: no generation spec, the shard's reason on every row it failed
        return JobRow(line=3, input={"prompt": "q", "completion": "a", "extra": {}}, error=error, executions=0)

    assert not retry_can_change(training_row(too_long_to_train([(7, 20), (9, 31)], 12)), None)  # stored unmarked
    for refusal in (  # any refusal the worker marks CannotTrain
        too_long_to_train([(7, 20)], 12),
        "target_modules ['w_nope'] do not exist in m: its linear layers are ['q_proj'] (or use 'all-linear')",
        "no training row has a token to learn (...): raise max_seq_length or shorten the prompts",
    ):
        assert not retry_can_change(training_row(str(CannotTrain(refusal))), None)
    assert retry_can_change(
        training_row("failed 3 times; last error: torch.OutOfMemoryError: CUDA out of memory"), None
    )
    assert retry_can_change(training_row("the worker doing this stopped (lost its lease)"), None)
