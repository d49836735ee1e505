"""Fine-tune jobs end to end on CPU with real workers: LoRA memorizes six answers and a generation job with the
adapter reproduces them; events and metrics are recorded; chaining; QLoRA; the registry's check; cancel."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from api import results, service, views
from core.db import session_scope
from core.errors import Conflict, InvalidInput, NothingToRetry
from core.models import Adapter, JobEvent
from tests.conftest import ROOT, qa_pairs, wait_for

FT_DATA = ROOT / "examples" / "finetune_qa.jsonl"
PROMPTS = ROOT / "examples" / "prompts.jsonl"
TERMINAL = ("succeeded", "failed", "cancelled")


ROOT = Path(__file__).resolve().parents[1]
UNBROKEN = """
import json, sys
from core.spec import FinetuneSpec, LoadOptions
from core.training_data import parse_training_jsonl
from worker.training import finetune
spec = FinetuneSpec.model_validate_json(sys.argv[1])
with open(sys.argv[2], "rb") as stream:
    rows = [(r.line, r.input) for r in parse_training_jsonl(stream, max_rows=100, max_row_bytes=1 << 20)]
logs = []
finetune.finetune(LoadOptions(model=spec.model), spec, rows, sys.argv[3], on_log=logs.append)
open(sys.argv[4], "w").write(json.dumps({e["step"]: e["loss"] for e in logs if "loss" in e}))
"""


def ft_spec(model: Path, **extra) -> dict:
    """60 steps over the 12 rows (one batch): enough for the tiny base to learn every answer."""
    return {
        "kind": "finetune",
        "model": str(model),
        "input": str(FT_DATA),
        "gpus": 0,
        "max_steps": 60,
        "learning_rate": 1e-2,
        "lr_scheduler": "constant",
        "batch_size": 12,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "checkpoint_steps": 20,
        **extra,
    }


def qa_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "qa_prompts.jsonl"
    rows = [{"custom_id": f"q{i}", "prompt": q} for i, (q, _) in enumerate(qa_pairs())]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def finished(job_id: str, timeout: float, procs) -> dict:
    return wait_for(
        lambda: (j := views.get(job_id, owner=None))["state"] in TERMINAL and j,
        timeout,
        f"job {job_id} to finish",
        procs=procs,
    )


def metric_events(job_id: str) -> list[dict]:
    with session_scope() as session:
        rows = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "metric").order_by(JobEvent.id)
        ).all()
        return [e.data for e in rows]


def test_lora_finetune_memorizes_answers_and_generation_with_its_adapter_reproduces_them(
    tmp_path, jobs_env, spawn_worker, base_model, capsys
):
    """A fine-tune on the untrained base registers an adapter; a generation job naming it answers >= 5 of 6 exactly;
    training events (loss, learning rate, grad norm, tokens/s) are recorded, `status` shows the step and epoch
    and, once ended, the run's training tok/s (while running: the last step's, so labelled), and the precision is
    fp32 on CPU; adapters are listed to their owner only."""
    from api.cli_jobs import describe

    worker = spawn_worker([])
    ft = service.submit(owner="alice", spec_data=ft_spec(base_model))
    ft = finished(ft["id"], 120, [worker])
    assert ft["state"] == "succeeded", ft["error"]
    describe(ft)
    training, out = ft["metrics"]["training"], capsys.readouterr().out
    assert "training step 60/60, epoch 60.00, loss 0.0" in out
    assert f", {training['train_tokens_per_s']} training tok/s (whole run)\n" in out, out
    assert "(last step)" not in out  # ended: the run's figure, not the last step's
    describe({**ft, "state": "running"})  # as `status` showed it before the end
    assert f", {ft['training']['tokens_per_s']} training tok/s (last step)" in capsys.readouterr().out
    assert training["steps"] == 60 and training["precision"] == "fp32"
    events = metric_events(ft["id"])
    steps = [e["step"] for e in events if "loss" in e]
    assert steps == list(range(1, 61))
    assert all(
        {"loss", "learning_rate", "grad_norm", "tokens_per_s", "epoch"} <= e.keys() for e in events if "loss" in e
    )
    assert [e for e in events if "loss" in e][-1]["loss"] < 0.05
    with session_scope() as session:
        adapter = session.get(Adapter, ft["id"])
        assert adapter.owner == "alice" and adapter.base_model == str(base_model.resolve())
        assert adapter.lora_config["r"] == 16 and adapter.metrics["steps"] == 60

    gen = service.submit(
        owner="alice",
        spec_data={
            "model": str(base_model),
            "input": str(qa_prompts(tmp_path)),
            "adapter": ft["id"],
            "gpus": 0,
            "max_new_tokens": 16,
        },
    )
    gen = finished(gen["id"], 120, [worker])
    assert gen["state"] == "succeeded", gen["error"]
    assert gen["load_options"]["adapter"]["id"] == ft["id"]
    outputs = [r["output"] for r in results.results(gen["id"], owner=None)]
    right = sum(o == a for o, (_, a) in zip(outputs, qa_pairs()))
    assert right >= 5, outputs

    # The registry is owner-isolated (the merged export is tested through the CLI, tests/test_finetune_cli.py).
    assert [a["id"] for a in views.list_adapters(owner="alice")] == [ft["id"]]
    assert views.list_adapters(owner="bob") == []
    with pytest.raises(Exception, match="no adapter"):
        views.get_adapter(ft["id"], owner="bob")


def test_then_generate_waits_for_the_finetune_and_runs_with_its_adapter(tmp_path, jobs_env, spawn_worker, base_model):
    """`then_generate` makes a generation job that stays queued (no shards) while training runs, then runs with the
    new adapter; a generation job naming another owner's adapter, or one on another base, is refused."""
    worker = spawn_worker([])
    ft = service.submit(owner="alice", spec_data=ft_spec(base_model, then_generate=str(qa_prompts(tmp_path))))
    gen_id = ft["metrics"]["then_generate_job"]
    assert views.get(gen_id, owner=None)["state"] == "queued"
    with pytest.raises(Exception, match="no adapter"):
        service.submit(
            owner="bob", spec_data={"model": str(base_model), "input": str(PROMPTS), "adapter": ft["id"], "gpus": 0}
        )
    gen = finished(gen_id, 180, [worker])
    assert gen["state"] == "succeeded", gen["error"]
    assert views.get(ft["id"], owner=None)["state"] == "succeeded"
    outputs = [r["output"] for r in results.results(gen_id, owner=None)]
    assert sum(o == a for o, (_, a) in zip(outputs, qa_pairs())) >= 5, outputs


def test_killed_worker_training_is_resumed_by_another_from_the_last_complete_checkpoint(
    tmp_path, jobs_env, spawn_worker, base_model
):
    """SIGKILL the training worker after checkpoint 20: another worker skips a half-written later checkpoint,
    resumes from checkpoint-20 (first logged step 21, loss within 5 % of an unbroken run) and finishes the job."""
    import signal

    from core import adapters
    from core.spec import FinetuneSpec
    from worker.training import finetune

    # a learning rate at which step 21's loss is still far from 0, so 5 % of it is more than rounding noise
    spec_data = ft_spec(base_model, max_steps=40, learning_rate=2e-3)
    fast = dict(JOBS_LEASE_SECONDS="3")
    victim = spawn_worker([], JOBS_TEST_FAULTS="sleep_0.15@train_step", **fast)
    ft = service.submit(owner="alice", spec_data=spec_data)
    wait_for(
        lambda: any(e.get("step", 0) >= 22 for e in metric_events(ft["id"])),
        60,
        "step 22",
        interval=0.05,
        procs=[victim],
    )
    os.kill(victim.pid, signal.SIGKILL)
    checkpoints = adapters.workdir(ft["id"]) / "checkpoints"
    assert [step for step, _ in finetune.complete_checkpoints(checkpoints)] == [20]
    half = checkpoints / "checkpoint-30"  # as if killed while saving step 30: files, but no COMPLETE marker
    half.mkdir()
    (half / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    rescuer = spawn_worker([], **fast)
    done = finished(ft["id"], 120, [rescuer])
    assert done["state"] == "succeeded", done["error"]
    assert done["metrics"]["training"]["resumed_from_step"] == 20
    with session_scope() as session:
        resumed_at = session.scalar(
            select(JobEvent.id).where(
                JobEvent.job_id == ft["id"], JobEvent.message.like("%resuming from checkpoint-20")
            )
        )
        after = session.scalars(
            select(JobEvent)
            .where(JobEvent.job_id == ft["id"], JobEvent.kind == "metric", JobEvent.id > resumed_at)
            .order_by(JobEvent.id)
        ).all()
    resumed = [e.data for e in after if "loss" in e.data]
    assert resumed[0]["step"] == 21 and resumed[-1]["step"] == 40
    # the current view shows each step once (the victim's steps after 20 ran again: superseded, kept for --all-runs)
    current = [e for e in views.events(ft["id"], owner=None, run="current", limit=5000) if e["kind"] == "metric"]
    assert [e["data"]["step"] for e in current if "loss" in e["data"]] == list(range(1, 41))
    written = views.events(ft["id"], owner=None, superseded=True, limit=5000)
    superseded = sorted(e["data"]["step"] for e in written if e["superseded"])
    assert superseded and superseded[0] == 21 and all(e["run"] == 1 for e in written)
    assert any("training resumes after step 20" in e["message"] for e in current + written)
    assert done["training"]["step"] == 40 and done["run"] == 1

    # The same 40 steps unbroken, in a fresh process set up like a worker (one torch thread), so nothing this test
    # process did before can change the reference: the resumed step 21 has the same loss (within 5 %).
    spec = FinetuneSpec.model_validate({**spec_data, "model": str(base_model)})
    reference = tmp_path / "unbroken.json"
    subprocess.run(
        [
            sys.executable,
            "-c",
            UNBROKEN,
            spec.model_dump_json(),
            str(FT_DATA),
            str(tmp_path / "unbroken"),
            str(reference),
        ],
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    unbroken = {int(step): loss for step, loss in json.loads(reference.read_text()).items()}
    assert resumed[0]["loss"] == pytest.approx(unbroken[21], rel=0.05)


def test_finetune_refuses_bad_input_at_submit_with_the_line_and_what_to_do(tmp_path, jobs_env, base_model):
    """Empty dataset, rows without their format's fields, a bad scheduler, untrainable quantization, both validation
    options: each refused before anything is stored, with a message that says what is wrong."""

    def refused(rows: list, match: str, **extra) -> None:
        path = tmp_path / "bad.jsonl"
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
        with pytest.raises(InvalidInput, match=match):
            service.submit(owner="alice", spec_data=ft_spec(base_model, input=str(path), **extra))

    refused([], "is empty")
    refused(["", "  "], "is empty")
    refused([{"prompt": "Q"}], r"line 1: a prompt_completion row needs 'prompt' and 'completion'; 'completion' is")
    refused([{"text": "ok"}, {"question": "Q"}], r"line 2: a training row needs 'messages'")
    refused(
        [{"messages": [{"role": "user", "content": "hi"}]}],
        "line 1: a chat row needs at least one non-empty assistant message",
    )
    refused([{"text": "ok"}, "{not json"], "line 2: invalid JSON")
    refused([{"text": "ok"}], "a messages row needs 'messages'", input_format="messages")
    refused([{"text": "ok"}], "unknown lr_scheduler 'cosinus'", lr_scheduler="cosinus")
    refused([{"text": "ok"}], "fine-tunes take bnb-4bit", quantization="bnb-8bit")
    refused([{"text": "ok"}], "not both", validation_split=0.2, validation_input=str(FT_DATA))
    refused([{"text": "ok"}], "target_modules", target_modules=[])
    # a split that would hold out every training row: the worker would refuse it only after loading the model
    refused(
        [{"text": "ok"}, {"text": "fine"}],
        r"^invalid finetune spec: validation_split=0.75 leaves no training row of 2: lower it",
        validation_split=0.75,
    )
    # the chained generation spec, checked as a generation job's: refused before the fine-tune is stored (a chained
    # spec refused after it would leave it failed), its errors naming then_generate
    prompts = str(PROMPTS)
    refused(
        [{"text": "ok"}],
        r"then_generate: unknown field 'temprature'",
        then_generate={"input": prompts, "temprature": 1},
    )
    refused(
        [{"text": "ok"}],
        r"^invalid finetune spec: then_generate: give one constraint",
        then_generate={"input": prompts, "guided_choice": ["a", "b"], "response_format": {"type": "json_object"}},
    )
    refused([{"text": "ok"}], "then_generate: top_logprobs", then_generate={"input": prompts, "top_logprobs": 2})
    refused(
        [{"text": "ok"}],
        r"then_generate: model, adapter: the chained job is a generation job on the fine-tune's base model",
        then_generate={"input": prompts, "model": "org/other", "adapter": "job_x"},
    )
    from sqlalchemy import func

    from core.models import Job

    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0


def test_finetune_refused_for_its_spec_and_input_fails_before_training_and_a_retry_is_refused(
    tmp_path, jobs_env, spawn_worker, base_model
):
    """On the worker, before any step: target modules the model lacks, rows longer than max_seq_length (with
    truncation: refuse), rows whose every learned token truncation cuts off, and chat rows on a model without a chat
    template fail the job naming what to change (`cannot train as submitted: …`), and a retry of each is refused
    (NothingToRetry: 409, the CLI exits 2) saying why and to submit a new job, since the same spec on the same rows
    fails the same way; a truncated adapter file fails the registry's check. A fine-tune that failed otherwise (out
    of memory, a lost worker) stays retryable: test_recovery.py
    test_a_row_the_worker_refused_for_its_parameters_cannot_change_on_retry, test_finetune_cli.py
    test_a_finetune_refused_for_its_spec_is_not_retried_but_one_out_of_memory_is."""
    worker = spawn_worker([], JOBS_TEST_FAULTS="truncate@adapter_saved")
    no_template = tmp_path / "no-template"
    shutil.copytree(base_model, no_template, ignore=shutil.ignore_patterns("chat_template.jinja"))
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in qa_pairs()
        )
    )
    long_prompts = tmp_path / "long_prompts.jsonl"  # each prompt fills max_seq_length=8: no completion token is left
    long_prompts.write_text("".join(json.dumps({"prompt": q * 3, "completion": a}) + "\n" for q, a in qa_pairs()))
    refused = {
        "bad_modules": ft_spec(base_model, target_modules=["q_proj", "w_nope"]),
        "too_long": ft_spec(base_model, max_seq_length=12),
        "no_labels": ft_spec(base_model, input=str(long_prompts), max_seq_length=8, truncation="truncate"),
        "no_template": ft_spec(no_template, input=str(chat)),
    }
    submitted = {name: service.submit(owner="alice", spec_data=spec) for name, spec in refused.items()}
    truncated = service.submit(
        owner="alice", spec_data=ft_spec(base_model, max_steps=3, max_seq_length=12, truncation="truncate")
    )
    errors = {name: finished(job["id"], 60, [worker]) for name, job in submitted.items()}
    assert all(job["state"] == "failed" for job in errors.values()), errors
    errors = {name: re.sub(r"^shard 0 \(rows 0-\d+\): ", "", job["error"]) for name, job in errors.items()}
    assert errors["bad_modules"].startswith("cannot train as submitted: target_modules ['w_nope'] do not exist")
    assert "q_proj" in errors["bad_modules"]  # it names the modules the model has
    assert errors["too_long"].startswith("cannot train as submitted: 9 row(s) are longer than max_seq_length=12")
    assert "line 7" in errors["too_long"]
    assert errors["no_labels"].startswith("cannot train as submitted: no training row has a token to learn")
    assert errors["no_template"].startswith("cannot train as submitted: the dataset has chat `messages` rows but")
    for name, job in submitted.items():
        reason = errors[name].removeprefix("cannot train as submitted: ")
        for failed_only in (True, False):
            with pytest.raises(NothingToRetry) as refusal:
                service.retry(job["id"], owner=None, failed_only=failed_only, by="alice")
            assert str(refusal.value) == (
                f"fine-tune {job['id']} cannot be retried: the worker refused its spec and input before training "
                f"({reason}), and a retry runs the same spec on the same rows, so it would be refused the same way. "
                f"Submit a new fine-tune with the change the error names (`gpujobs status {job['id']} --json` "
                "shows this one's spec)"
            )
        assert views.get(job["id"], owner=None)["retries"] == 0
        assert not metric_events(job["id"])  # refused before the first step
    job = finished(truncated["id"], 60, [worker])
    assert job["state"] == "failed" and "registry error" in job["error"]
    with session_scope() as session:
        assert session.get(Adapter, truncated["id"]) is None


def test_cancel_stops_training_within_seconds_keeps_its_checkpoint_and_a_qlora_job_trains(
    jobs_env, spawn_worker, base_model
):
    """Cancel ends a long fine-tune within a few seconds and keeps its last complete checkpoint, and its chained
    generation job fails with that reason; then a QLoRA job
    (bitsandbytes 4-bit base on this CPU) trains, lowers the loss and records its quantization."""
    from core import adapters
    from core.models import Worker
    from worker.training import finetune

    worker = spawn_worker([])
    ft = service.submit(
        owner="alice",
        spec_data=ft_spec(
            base_model, max_steps=100000, checkpoint_steps=5, then_generate={"input": str(PROMPTS), "max_new_tokens": 4}
        ),
    )
    gen_id = ft["metrics"]["then_generate_job"]
    wait_for(lambda: any(e.get("step", 0) >= 7 for e in metric_events(ft["id"])), 120, "step 7", procs=[worker])
    t0 = time.monotonic()
    service.cancel(ft["id"], owner=None, by="test")
    assert finished(ft["id"], 30, [worker])["state"] == "cancelled"
    assert time.monotonic() - t0 < 5
    assert finetune.complete_checkpoints(adapters.workdir(ft["id"]) / "checkpoints")
    # the chained generation job fails with the fine-tune's outcome; a new one naming it is refused
    gen = finished(gen_id, 30, [worker])
    assert gen["state"] == "failed" and "cancelled" in gen["error"]
    with pytest.raises(Conflict, match="cancelled"):
        service.submit(
            owner="alice", spec_data={"model": str(base_model), "input": str(PROMPTS), "adapter": ft["id"], "gpus": 0}
        )

    def probed():
        with session_scope() as session:
            return all("qlora" in w.capabilities for w in session.scalars(select(Worker)).all())

    wait_for(probed, 60, "the QLoRA probe", procs=[worker])
    q = service.submit(owner="alice", spec_data=ft_spec(base_model, max_steps=20, quantization="bnb-4bit"))
    q = finished(q["id"], 120, [worker])
    assert q["state"] == "succeeded", q["error"]
    assert q["load_options"]["quantization"]["method"] == "bnb-4bit"
    losses = [e["loss"] for e in metric_events(q["id"]) if "loss" in e]
    assert losses[-1] < losses[0] / 2


def test_a_user_cannot_name_server_paths_for_validation_or_chained_datasets(jobs_env, base_model):
    """Over HTTP a user's fine-tune may name server paths in neither `validation_input` nor `then_generate`
    (only under JOBS_DATA_ROOTS, as for `input`): 403, and nothing is stored."""
    from fastapi.testclient import TestClient

    from api.app import app
    from core import auth

    with session_scope() as session:
        token = auth.create_token(session, owner="carol", scopes=["user"])
    client = TestClient(app)
    headers = {"Authorization": f"Bearer {token}"}
    uploaded = client.post("/files", headers=headers, files={"file": ("t.jsonl", FT_DATA.read_bytes())}).json()["id"]
    for extra in (
        {"validation_input": "/etc/passwd"},
        {"then_generate": "/etc/passwd"},
        {"then_generate": {"input": "/etc/passwd"}},
    ):
        response = client.post("/jobs", headers=headers, json=ft_spec(base_model, input=uploaded, **extra))
        assert response.status_code == 403 and "server-side dataset paths" in response.text, response.text


def test_a_step_whose_loss_is_nan_is_logged_as_nan_and_its_event_stored_on_sqlite_and_postgres(
    tmp_path, any_jobs_env, base_model
):
    """Trainer no longer tests each micro-batch's loss for NaN (a wait on the GPU), so a diverged run logs NaN as it
    is. JSON has no NaN and Postgres refuses it: the metric event's data holds null and names the value apart, and
    its line says `loss nan`. (A model whose final norm holds a NaN: every step's loss and gradient norm are NaN.)"""
    import shutil

    from safetensors.torch import load_file, save_file

    from core import jobs
    from core.spec import FinetuneSpec, LoadOptions
    from worker.runtime import finetune_line
    from worker.training import finetune

    model = tmp_path / "nan-model"
    shutil.copytree(base_model, model)
    (weights,) = model.glob("*.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, weights, metadata={"format": "pt"})
    logs: list[dict] = []
    rows = [(i, {"prompt": f"Q{i}?", "completion": f"A{i} the sky is blue"}) for i in range(1, 9)]
    spec = FinetuneSpec(model=str(model), input="file_x", max_steps=2, batch_size=2, lr_scheduler="constant")
    finetune.finetune(LoadOptions(model=str(model)), spec, rows, tmp_path / "work", on_log=logs.append)
    steps = [r for r in logs if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["loss"] is None and record["grad_norm"] is None, record
        assert record["non_finite"] == {"loss": "nan", "grad_norm": "nan"}, record
    job_id = service.submit(owner="alice", spec_data=ft_spec(base_model, max_steps=2))["id"]
    for record in steps:
        jobs.event(job_id, finetune_line(record), kind="metric", data=record)
    with session_scope() as session:
        stored = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "metric").order_by(JobEvent.id)
        ).all()
        assert [e.data["non_finite"] for e in stored] == [{"loss": "nan", "grad_norm": "nan"}] * 2
        assert all("loss nan" in e.message and "grad_norm nan" in e.message for e in stored), stored[0].message
