"""Slices of several GPUs, everything a CPU can show: the strategy plan, the NCCL safety env of workers and of the
children they launch, the children's pinning env (slices kept in order), a real 2-process DDP fine-tune over gloo
through a real worker, stop and resume, a crashing rank, routing by slice size, and the refusals at submit.

Run as a module (`python -m tests.test_distributed RUN_DIR`, what `launch` starts under torchrun), this file is a
probe that records the environment each child got.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROBED = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "NCCL_NVLS_ENABLE",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST",
    "NVSHMEM_DISABLE_NVLS",
    "OMP_NUM_THREADS",
)


def probe(run_dir: Path) -> None:
    """One child: write the variables it got; rank 0 also writes the result the launcher returns."""
    rank = os.environ["RANK"]
    (run_dir / f"env-rank{rank}.json").write_text(json.dumps({k: os.environ.get(k) for k in PROBED}))
    if rank == "0":
        (run_dir / "result.json").write_text(json.dumps({"ok": True}))


if __name__ == "__main__":
    probe(Path(sys.argv[1]))
    sys.exit(0)

import pytest
from sqlalchemy import select

from api import service, views
from api.stack import detect_gpus
from core import exits, registry
from core.db import session_scope
from core.errors import ChildFailed, InvalidInput, Unschedulable
from core.models import Adapter, JobEvent, Worker
from core.slices import NVLINK_MULTICAST_OFF, plan
from tests.conftest import ROOT, wait_for

FT_DATA = ROOT / "examples" / "finetune_qa.jsonl"
TERMINAL = ("succeeded", "failed", "cancelled")


def ft_spec(model: Path, **extra) -> dict:
    return {
        "kind": "finetune",
        "model": str(model),
        "input": str(FT_DATA),
        "gpus": 0,
        "max_steps": 8,
        "learning_rate": 1e-2,
        "lr_scheduler": "constant",
        "batch_size": 6,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "checkpoint_steps": 4,
        "strategy": "ddp",
        "nproc": 2,
        **extra,
    }


def rows() -> list[tuple[int, dict]]:
    return [(i + 1, json.loads(line)) for i, line in enumerate(FT_DATA.read_text().splitlines()) if line.strip()]


# --- the plan: strategy and processes for a slice ------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, nproc, gpus, device_map, expected",
    [
        ("auto", None, 0, None, ("single", 1)),
        ("auto", None, 1, None, ("single", 1)),
        ("auto", None, 2, None, ("ddp", 2)),
        ("auto", None, 4, "auto", ("single", 1)),  # one process splits one copy over the slice
        ("auto", 2, 0, None, ("ddp", 2)),  # several CPU processes only when nproc asks
        ("ddp", None, 2, None, ("ddp", 2)),
        ("fsdp2", None, 3, None, ("fsdp2", 3)),
        ("single", None, 2, None, ("single", 1)),
        ("deepspeed_zero3", None, 2, None, ("deepspeed_zero3", 2)),
    ],
)
def test_plan_gives_the_strategy_and_process_count_of_a_slice(strategy, nproc, gpus, device_map, expected):
    """auto is one process on one GPU or the CPU and DDP over a slice of 2+ (single with device_map auto)."""
    assert plan(strategy, nproc, gpus=gpus, device_map=device_map) == expected


@pytest.mark.parametrize(
    "strategy, nproc, gpus, extra, message",
    [
        ("ddp", None, 1, {}, "needs 2 or more processes, and a slice of 1 GPU gives one: submit with gpus: 2"),
        ("ddp", None, 0, {}, "the CPU without nproc gives one"),
        ("ddp", 4, 2, {}, "nproc=4 on a slice of 2 GPU"),
        ("ddp", None, 2, {"device_map": "auto"}, "use one or the other"),
        ("fsdp2", 2, 0, {}, "strategy fsdp2 needs a slice of GPUs"),
        ("deepspeed_zero2", 2, 0, {}, "strategy deepspeed_zero2 needs a slice of GPUs"),
        ("fsdp2", None, 2, {"quantized": True}, "QLoRA (a bnb-4bit base) runs with strategy ddp or single"),
        ("single", 2, 0, {}, "strategy single runs one process, but nproc=2"),
    ],
)
def test_plan_refuses_what_cannot_run_saying_what_to_do(strategy, nproc, gpus, extra, message):
    """Each impossible combination is refused with its reason and the fix."""
    with pytest.raises(InvalidInput, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan(strategy, nproc, gpus=gpus, **extra)


# --- environment of workers and of their children ------------------------------------------------------------------


@pytest.mark.parametrize("slice_", ["0,1", "2,0"])
def test_each_child_gets_the_slice_in_order_pci_order_its_rank_and_nvlink_multicast_off(tmp_path, slice_):
    """The launcher the worker uses starts 2 real children under torchrun; each sees CUDA_VISIBLE_DEVICES exactly as
    the worker's slice (order kept), CUDA_DEVICE_ORDER=PCI_BUS_ID, its own LOCAL_RANK/RANK, WORLD_SIZE=2 and the
    three NVLink multicast variables, even when the worker's own environment lacked them."""
    from worker.training.distributed import launch

    base = {k: v for k, v in os.environ.items() if k not in NVLINK_MULTICAST_OFF and k != "CUDA_DEVICE_ORDER"}
    base["CUDA_VISIBLE_DEVICES"] = slice_
    assert launch(2, "tests.test_distributed", tmp_path, env=base) == {"ok": True}
    envs = {r: json.loads((tmp_path / f"env-rank{r}.json").read_text()) for r in (0, 1)}
    for rank, env in envs.items():
        assert env["CUDA_VISIBLE_DEVICES"] == slice_ and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert (env["LOCAL_RANK"], env["RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "2")
        assert {k: env[k] for k in NVLINK_MULTICAST_OFF} == NVLINK_MULTICAST_OFF


def test_overlapping_slices_are_refused_by_jobs_up_before_anything_starts(tmp_path):
    """`jobs up --gpus "0,1;1"` exits non-zero naming the shared GPU; no stack file, no process is left."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(JOBS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "api", "up", "--gpus", "0,1;1"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "share GPU(s) ['1']: two workers never share a GPU" in result.stderr
    assert not (tmp_path / "home" / "stack.json").exists()


def test_a_worker_of_a_two_gpu_slice_without_those_gpus_refuses_and_a_two_gpu_job_is_refused(
    jobs_env, spawn_worker, base_model
):
    """A real worker pinned to "0,1" on this CPU host: it records what it got (the slice, queue gpu2, no GPU, PCI
    order, NVLink multicast off, the deepspeed version key) and refuses to start (exit 6: its GPUs are not there);
    with a live CPU worker, a 2-GPU job is then refused: no live worker serves gpu2."""
    if {"0", "1"} <= set(detect_gpus()):
        pytest.skip("this host has GPUs 0 and 1")
    worker = spawn_worker(["0", "1"], wait=False)
    assert worker.popen.wait(120) == exits.SLICE_MISSING, worker.tail()
    with session_scope() as session:
        row = session.scalars(select(Worker).where(Worker.pid == worker.pid)).one()
        assert (row.slice, row.queues, row.gpus, row.state) == ("0,1", ["gpu2"], [], "offline")
        assert row.capabilities["cuda_visible_devices"] == "0,1"
        assert row.capabilities["cuda_device_order"] == "PCI_BUS_ID"
        assert row.capabilities["multicast_off"] == NVLINK_MULTICAST_OFF
        assert row.capabilities["device_count"] == 0 and "deepspeed" in row.capabilities["versions"]
    spawn_worker([])
    with pytest.raises(
        Unschedulable,
        match=r"no live worker serves jobs of 2 GPU\(s\) \(queue gpu2\); live workers: "
        r"w\d+-cpu@\S+ \(cpu\)\. ",
    ):
        service.submit(owner="t", spec_data={"model": str(base_model), "input": str(FT_DATA), "gpus": 2})


def load_multi_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("multi_gpu_check", ROOT / "ops" / "gpu" / "multi_gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_gpu_script_compares_registered_uuids_with_nvidia_smi_in_slice_order():
    """ops/gpu/multi_gpu_check.py reads `nvidia-smi --query-gpu=index,uuid --format=csv` and matches each worker's
    registered UUIDs against its slice in order: "1,0" must register GPU 1's UUID first; a swap is a mismatch; a CPU
    worker's empty list matches. Its first slice is reversed so that the order check means something."""
    check = load_multi_gpu_check()
    smi = check.smi_gpus("index, uuid\n0, GPU-aaa\n1, GPU-bbb\n2, GPU-ccc\n")
    assert smi == {"0": "GPU-aaa", "1": "GPU-bbb", "2": "GPU-ccc"}
    workers = [
        {"name": "a", "slice": "1,0", "queues": ["gpu2"], "gpus": [{"uuid": "GPU-bbb"}, {"uuid": "GPU-aaa"}]},
        {"name": "b", "slice": "2", "queues": ["gpu1"], "gpus": [{"uuid": "GPU-aaa"}]},
        {"name": "c", "slice": "", "queues": ["cpu"], "gpus": []},
    ]
    assert [r["match"] for r in check.compare_uuids(workers, smi)] == [True, False, True]
    assert check.slices_for(4) == "1,0;2;3" and check.slices_for(2) == "1,0"
    assert subprocess.run(["bash", "-n", str(ROOT / "ops" / "gpu" / "multi_gpu.sh")]).returncode == 0


# --- routing by slice size and refusals at submit ------------------------------------------------------------------

GPU_CAPS = {
    "device_count": 2,
    "min_compute_capability": 9.0,
    "attention": ["sdpa", "eager", "flex_attention"],
    "versions": {"torch": "2.13.0", "peft": "0.21.2", "deepspeed": None},
}


def register(name: str, slice_: str, devices: int) -> None:
    queue = f"gpu{len(slice_.split(','))}" if slice_ else "cpu"
    with session_scope() as session:
        registry.register(
            session,
            name=name,
            host="h",
            pid=1,
            slice=slice_,
            queues=[queue],
            gpus=[],
            capabilities={**GPU_CAPS, "device_count": devices},
        )


def test_jobs_go_to_the_slice_size_they_ask_for_and_impossible_slice_uses_are_refused(tmp_path, jobs_env, base_model):
    """With a 2-GPU worker ("0,1") and a 1-GPU worker ("2") registered: gpus 2 goes to gpu2 only, gpus 1 to gpu1,
    a ddp fine-tune without gpus picks the 2-GPU slice; 3 GPUs, DeepSpeed without the package, and tp_plan (not run
    by the workers yet, and needing 2+ GPUs) are refused with what to do."""
    register("two", "0,1", 2)
    register("one", "2", 1)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    gen = {"model": str(base_model), "input": str(data)}
    assert service.submit(owner="t", spec_data={**gen, "gpus": 2})["queue"] == "gpu2"
    assert service.submit(owner="t", spec_data={**gen, "gpus": 1})["queue"] == "gpu1"
    assert service.submit(owner="t", spec_data=gen)["queue"] == "gpu1"  # the smallest slice that can run it
    ft = ft_spec(base_model, gpus=None, nproc=None)
    assert service.submit(owner="t", spec_data=ft)["queue"] == "gpu2"
    with pytest.raises(Unschedulable, match=r"no live worker serves jobs of 3 GPU\(s\)"):
        service.submit(owner="t", spec_data={**gen, "gpus": 3})
    with pytest.raises(Unschedulable, match="strategy deepspeed_zero2 needs the deepspeed package on the worker"):
        service.submit(owner="t", spec_data={**ft, "strategy": "deepspeed_zero2"})
    with pytest.raises(
        Unschedulable,
        match="two \\(gpu2\\): tp_plan auto \\(tensor parallel under torchrun\\) is not supported by the workers yet",
    ):
        service.submit(owner="t", spec_data={**gen, "gpus": 2, "tp_plan": "auto"})
    with pytest.raises(Unschedulable, match="tp_plan auto needs a slice of 2 or more GPUs"):
        service.submit(owner="t", spec_data={**gen, "gpus": 1, "tp_plan": "auto"})
    with pytest.raises(InvalidInput, match="device_map auto places whole layers"):
        service.submit(owner="t", spec_data={**gen, "gpus": 2, "tp_plan": "auto", "device_map": "auto"})
    with pytest.raises(InvalidInput, match="strategy ddp needs 2 or more processes, and a slice of 1 GPU"):
        service.submit(owner="t", spec_data={**ft, "gpus": 1})


# --- distributed fine-tunes on the CPU (gloo) ----------------------------------------------------------------------


def metric_events(job_id: str) -> list[dict]:
    with session_scope() as session:
        return [
            e.data
            for e in session.scalars(
                select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "metric").order_by(JobEvent.id)
            ).all()
        ]


def test_ddp_finetune_on_two_gloo_processes_through_a_real_worker(jobs_env, spawn_worker, base_model):
    """A CPU worker runs `strategy: ddp, nproc: 2`: two ranks train (each checkpoint holds both ranks' RNG state and
    a COMPLETE marker), every step's event is recorded once and came from rank 0 of 2, the loss falls, the adapter
    is saved once and registered, and the worker records strategy and process count."""
    from core import adapters

    worker = spawn_worker([])
    job = service.submit(owner="alice", spec_data=ft_spec(base_model))
    job = wait_for(
        lambda: (j := views.get(job["id"], owner=None))["state"] in TERMINAL and j,
        120,
        "the ddp fine-tune",
        procs=[worker],
    )
    assert job["state"] == "succeeded", job["error"]
    training = job["metrics"]["training"]
    assert (training["strategy"], training["processes"], training["steps"]) == ("ddp", 2, 8)
    events = [e for e in metric_events(job["id"]) if "loss" in e]
    assert [e["step"] for e in events] == list(range(1, 9))
    assert {(e["rank"], e["world_size"]) for e in events} == {(0, 2)}
    assert events[-1]["loss"] < events[0]["loss"] / 2
    workdir = adapters.workdir(job["id"])
    for step in (4, 8):
        checkpoint = workdir / "checkpoints" / f"checkpoint-{step}"
        assert {"COMPLETE", "rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}
    assert len(list(workdir.rglob("adapter_model.safetensors"))) == 3  # the adapter, and one per checkpoint
    with session_scope() as session:
        assert session.get(Adapter, job["id"]) is not None


def test_a_stopped_ddp_run_resumes_from_its_last_complete_checkpoint(tmp_path, base_model, monkeypatch):
    """Through the launcher the worker calls: a stop request after step 5 ends both ranks at the same step with no
    adapter (checkpoint-4 complete); the next run resumes there (first logged step 5) and finishes at step 8.

    Rank 0 sleeps 1 s before each step's stop check (five of the parent's polls), so the request made on seeing step
    5 is read at step 6 or 7 however fast the machine trains; unslowed, a fast machine finished all 8 steps first."""
    from core.spec import FinetuneSpec, LoadOptions
    from worker.training import distributed

    spec = FinetuneSpec.model_validate(ft_spec(base_model))
    seen: list[dict] = []
    monkeypatch.setenv("JOBS_TEST_FAULTS", "sleep_1@rank0_step")
    stopped = distributed.finetune(
        LoadOptions(model=spec.model),
        spec,
        rows(),
        tmp_path,
        on_log=seen.append,
        should_stop=lambda: any(r["step"] >= 5 for r in seen),
    )
    monkeypatch.delenv("JOBS_TEST_FAULTS")
    assert stopped.stopped and not (tmp_path / "adapter").exists()
    assert (tmp_path / "checkpoints" / "checkpoint-4" / "COMPLETE").is_file()
    resumed: list[dict] = []
    done = distributed.finetune(LoadOptions(model=spec.model), spec, rows(), tmp_path, on_log=resumed.append)
    assert not done.stopped and done.resumed_from == 4 and done.metrics["steps"] == 8
    steps = [r["step"] for r in resumed if "loss" in r]
    assert steps[0] == 5 and steps[-1] == 8
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()


def test_a_yielding_ddp_run_saves_a_checkpoint_at_one_step_on_both_ranks_and_resumes_from_it(
    tmp_path, base_model, monkeypatch
):
    """Through the launcher the worker calls: a yield request after step 5 (the scheduler's, worker/runtime.py)
    makes both ranks save a complete checkpoint of the same step N (6 or 7: rank 0 sleeps 1 s before each step's
    check, as in the stop test) and stop with no adapter; the next run resumes from N and finishes at step 8."""
    from core.spec import FinetuneSpec, LoadOptions
    from worker.training import distributed

    spec = FinetuneSpec.model_validate(ft_spec(base_model))
    seen: list[dict] = []
    monkeypatch.setenv("JOBS_TEST_FAULTS", "sleep_1@rank0_step")
    yielded = distributed.finetune(
        LoadOptions(model=spec.model),
        spec,
        rows(),
        tmp_path,
        on_log=seen.append,
        should_yield=lambda: any(r["step"] >= 5 for r in seen),
    )
    monkeypatch.delenv("JOBS_TEST_FAULTS")
    step = yielded.metrics["steps"]
    assert yielded.stopped and 5 < step < 8 and not (tmp_path / "adapter").exists(), yielded.metrics
    checkpoint = tmp_path / "checkpoints" / f"checkpoint-{step}"
    assert {"COMPLETE", "rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in checkpoint.iterdir()}
    resumed: list[dict] = []
    done = distributed.finetune(LoadOptions(model=spec.model), spec, rows(), tmp_path, on_log=resumed.append)
    assert not done.stopped and done.resumed_from == step and done.metrics["steps"] == 8
    assert [r["step"] for r in resumed if "loss" in r] == list(range(step + 1, 9))


def test_rank_zero_reports_its_phases_and_steps_to_the_parents_stall_watchdog(tmp_path, base_model):
    """The parent's progress (what the worker's stall watchdog reads) sees the launch as a phase, then rank 0's own
    phases (loading, preparing) and each of its 8 training steps: a long load in a child is no stall, and a hung
    rank (no more lines) is one."""
    from core.spec import FinetuneSpec, LoadOptions
    from worker.progress import Progress
    from worker.training import distributed

    class Recorder(Progress):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def beat(self, kind: str) -> None:
            super().beat(kind)
            self.seen.append(kind)

        def phase_changed(self) -> None:
            self.seen.append(f"phase {self.phase_name}")

    spec = FinetuneSpec.model_validate(ft_spec(base_model))
    recorder = Recorder()
    done = distributed.finetune(LoadOptions(model=spec.model), spec, rows(), tmp_path, progress=recorder)
    assert done.metrics["steps"] == 8
    phases = [s for s in recorder.seen if s.startswith("phase ") and s != "phase None"]
    assert phases[:3] == [
        "phase starting 2 training processes",
        "phase loading model (rank 0 of 2)",
        "phase preparing training (rank 0 of 2)",
    ]
    assert recorder.seen.count("training step (rank 0)") == 9  # each step's log line, and the summary at the end
    assert recorder.phase_name is None


@pytest.mark.parametrize(
    "fault, expected",
    [
        ("raise@rank1_step", "rank 1 failed first: RuntimeError: injected failure (JOBS_TEST_FAULTS raise@rank1_step)"),
        ("kill@rank1_step", "rank 1 was killed by SIGKILL"),
    ],
)
def test_a_failing_rank_fails_the_attempt_promptly_with_its_error_and_leaves_no_process(
    tmp_path, base_model, monkeypatch, fault, expected
):
    """Rank 1 raising (or SIGKILLed) at its first step: the launcher raises ChildFailed with that rank's error text
    within a minute (torchrun ends rank 0, which would otherwise wait in a collective), and no child survives."""
    import psutil

    from core.spec import FinetuneSpec, LoadOptions
    from worker.training import distributed

    monkeypatch.setenv("JOBS_TEST_FAULTS", fault)
    spec = FinetuneSpec.model_validate(ft_spec(base_model))
    t0 = time.monotonic()
    with pytest.raises(ChildFailed) as failed:
        distributed.finetune(LoadOptions(model=spec.model), spec, rows(), tmp_path)
    assert time.monotonic() - t0 < 60
    assert expected in str(failed.value)
    left = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path / "run") in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_a_rank_that_refused_the_spec_fails_the_run_as_cannot_train_and_one_this_worker_lacks_as_invalid_input(
    tmp_path,
):
    """A rank's CannotTrain (the spec and input fail the same way anywhere: no retry) reaches the worker as
    CannotTrain, with its mark once; a rank's other InvalidInput (this worker lacks something) stays retryable."""
    from core.errors import CannotTrain, InvalidInput
    from worker.training import distributed

    (tmp_path / "children.log").write_text("")
    for message in (str(CannotTrain("target_modules ['w_nope'] do not exist in m")), "strategy ddp needs CUDA"):
        error = {"rank": 0, "time": 1.0, "type": "X", "message": message, "invalid_input": True, "traceback": ""}
        (tmp_path / "error-rank0.json").write_text(json.dumps(error))
        failure = distributed._failure(tmp_path, 1)
        assert type(failure) is (CannotTrain if message.startswith("cannot train") else InvalidInput)
        assert str(failure) == message


def test_a_killed_worker_leaves_no_training_process_behind(jobs_env, spawn_worker, base_model):
    """SIGKILL a worker while its two ranks train: torchrun (told by the kernel that its parent died) and both ranks
    are gone within seconds, so none can go on writing checkpoints that another worker resumes from."""
    import signal

    import psutil

    from core import adapters

    worker = spawn_worker([])
    job = service.submit(owner="alice", spec_data=ft_spec(base_model, max_steps=100000, checkpoint_steps=1000))
    wait_for(lambda: any(e.get("step", 0) >= 2 for e in metric_events(job["id"])), 90, "step 2", procs=[worker])
    run_dir = str(adapters.workdir(job["id"]) / "run")

    def training() -> list:
        return [p for p in psutil.process_iter(["cmdline"]) if run_dir in " ".join(p.info["cmdline"] or [])]

    assert len(training()) == 3  # torchrun and its two ranks
    os.kill(worker.pid, signal.SIGKILL)
    worker.popen.wait()
    wait_for(lambda: not training(), 30, "torchrun and the ranks to exit")
