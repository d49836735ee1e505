"""One fine-tune over several processes of one slice: the strategy, the launcher (torchrun), the children's env.

`finetune()` is what the worker runtime calls (through worker/training/__init__.py): with strategy `single` it
trains in this process (`worker.training.finetune.finetune`); otherwise it launches `python -m
worker.training.distributed --standalone --nproc-per-node=N --max-restarts=0 -m worker.training.rank RUN_DIR`, which
is torchrun (`torch.distributed.run.main`) after one line of setup, and waits for it while it reports progress.
Decisions, and why:

- **The worker stays the only writer to SQL.** The children never open the database or the broker: the worker holds
  the shard's lease and heartbeat as for one process, and writes the events. Parent and children talk through files
  in a run folder (`workdir/run`, fresh per attempt), simpler than pipes and still there after a crash:
  `request.json` (what to train, written by the parent), `progress.jsonl` (rank 0 appends one JSON line per logged
  step; `{"phase": NAME}` / `{"phase": null}` lines when it starts and ends a phase such as loading or compiling, and
  `{"progress": KIND}` lines, at most one a second, for its steps, evaluation steps and checkpoints; the parent tails
  it, writes each logged step as an event and feeds all of them to the stall watchdog: rank 0's progress is the
  run's progress), `stop` (created by the parent to cancel or hand back:
  every rank checks it after each step and the ranks agree through an all-reduce, so they stop at the same step),
  `result.json` (rank 0, at the end), `error-rank<R>.json` (a rank that raised), `children.log` (their output).
- **Rank 0 alone writes** the progress lines, the checkpoints' COMPLETE markers (after a barrier, so every rank's
  part of the checkpoint is on disk), the adapter and the result. Checkpoints and resume are the Trainer's, as for
  one process: the newest complete checkpoint is resumed, whatever number of processes wrote it.
- **Never a hang.** torchrun runs with `--max-restarts=0`: one failed rank ends the group (torchrun stops the others)
  and the attempt fails with that rank's error text. Collectives time out (worker/training/setup.py). torchrun
  gets SIGTERM from the kernel when the worker dies and each child gets SIGKILL when torchrun dies
  (PR_SET_PDEATHSIG), so a killed worker leaves no training behind to race the worker that resumes its job. On every
  way out the parent stops torchrun itself (SIGTERM, then SIGKILL), and a stop request that the children do not
  honour within `STOP_GRACE_S` ends them.
- **Each child's environment** (`child_env`): the worker's, with the slice unchanged in CUDA_VISIBLE_DEVICES (torchrun
  gives LOCAL_RANK; rank r uses `cuda:r` of the slice), CUDA_DEVICE_ORDER=PCI_BUS_ID and NVLink multicast off
  (core/slices.py), one OpenMP thread unless the worker set another count. Backend: nccl on CUDA, gloo on the CPU.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core.errors import CANNOT_TRAIN, CannotTrain, ChildFailed, InvalidInput
from core.slices import pinned_env, plan
from core.spec import FinetuneSpec, LoadOptions
from worker.progress import Progress

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[2]  # the repository: the children import our packages from it
STOP_GRACE_S = 60.0  # after `stop` is created, the children have this long to reach a step's end and exit
KILL_GRACE_S = 15.0  # torchrun's own shutdown of its children, before SIGKILL
POLL_S = 0.2
PR_SET_PDEATHSIG = 1
PARENT_VAR = "JOBS_DIST_PARENT"
TORCHRUN_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


# --- strategy ---------------------------------------------------------------------------------------------------


def strategy_for(spec: FinetuneSpec, gpus: int) -> tuple[str, int]:
    """(strategy, processes) for this worker's slice; InvalidInput (the job fails, no retry) when it cannot run."""
    strategy, world = plan(
        spec.strategy, spec.nproc, gpus=gpus, device_map=spec.device_map, quantized=spec.quantization is not None
    )
    if strategy.startswith("deepspeed"):
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            raise InvalidInput(
                f"strategy {strategy} needs the deepspeed package on the worker (pip install "
                "deepspeed), and it is missing: use ddp or fsdp2"
            )
    return strategy, world


# --- the environment and command of the children -----------------------------------------------------------------


def child_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What torchrun and every rank get: the worker's environment, its slice kept as it is (order included), PCI bus
    order, NVLink multicast off, this checkout importable, one OpenMP thread unless set."""
    env = dict(os.environ if base is None else base)
    devices = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    env = pinned_env(devices, env)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env[PARENT_VAR] = str(os.getpid())
    return env


def launch_command(nproc: int, module: str, *args: str) -> list[str]:
    """torchrun for one host (`--standalone`: its own rendezvous on a free local port), no restarts."""
    return [
        sys.executable,
        "-m",
        "worker.training.distributed",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]


def die_with_parent(sig: int) -> None:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux), and exit now if the parent that
    launched it ($JOBS_DIST_PARENT: each level writes its own pid there for the next) is already gone. Not pid 1:
    in a container the worker itself may be pid 1."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's own shutdown still ends us
        return
    expected = os.environ.get(PARENT_VAR)
    if expected and os.getppid() != int(expected):
        os._exit(1)
    os.environ[PARENT_VAR] = str(os.getpid())  # what this process's own children check


# --- the parent: launch, watch, end -------------------------------------------------------------------------------


def launch(
    nproc: int,
    module: str,
    run_dir: Path,
    *,
    should_stop: Callable[[], bool] = lambda: False,
    should_yield: Callable[[], bool] = lambda: False,
    on_record: Callable[[dict[str, Any]], None] = lambda record: None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any] | None:
    """Run `module RUN_DIR` on `nproc` processes and wait; return rank 0's result.json (None: stopped before one).
    `should_stop()` creates RUN_DIR/stop, `should_yield()` RUN_DIR/yield (the children save a checkpoint first; no
    grace limit then: a save takes what it takes, and the stall watchdog watches it).

    Each line rank 0 appends to progress.jsonl goes to `on_record` as it comes. Raises ChildFailed (or InvalidInput,
    when a rank refused the input) with the failing rank's error text.
    """
    log_path = run_dir / "children.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            launch_command(nproc, module, str(run_dir)),
            env=child_env(env),
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    log.info("launched %d processes (torchrun pid %d) for %s", nproc, proc.pid, run_dir)
    try:
        stopped = _watch(proc, run_dir, should_stop, should_yield, on_record)
    finally:
        end(proc)
    result = run_dir / "result.json"
    if result.is_file():
        return json.loads(result.read_text())
    if stopped:
        return None
    raise _failure(run_dir, proc.returncode)


def _watch(
    proc: subprocess.Popen,
    run_dir: Path,
    should_stop: Callable[[], bool],
    should_yield: Callable[[], bool],
    on_record: Callable[[dict[str, Any]], None],
) -> bool:
    """Forward progress until torchrun exits; create `stop` or `yield` when asked. True when a stop was asked."""
    offset, stop_at = 0, None
    while proc.poll() is None:
        offset = _forward(run_dir / "progress.jsonl", offset, on_record)
        if should_yield() and not (run_dir / "yield").exists():
            (run_dir / "yield").touch()
        if stop_at is None and should_stop():
            (run_dir / "stop").touch()
            stop_at = time.monotonic()
        elif stop_at is not None and time.monotonic() - stop_at > STOP_GRACE_S:
            log.warning(
                "the processes of %s did not stop within %.0f s of the request: ending them", run_dir, STOP_GRACE_S
            )
            break
        time.sleep(POLL_S)
    _forward(run_dir / "progress.jsonl", offset, on_record)
    return stop_at is not None


def _forward(path: Path, offset: int, on_record: Callable[[dict[str, Any]], None]) -> int:
    """Hand on every complete line past `offset`; return the new offset (a half-written line waits)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    end_of_lines = data.rfind(b"\n") + 1
    for line in data[:end_of_lines].splitlines():
        if line.strip():
            on_record(json.loads(line))
    return offset + end_of_lines


def end(proc: subprocess.Popen) -> None:
    """Stop torchrun (it stops its children; each child also dies with it), then anything left in its group."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _failure(run_dir: Path, returncode: int | None) -> Exception:
    """The cause, from the rank that failed first: a rank killed by a signal (torchrun's summary says which; it
    writes no error, and its peers then fail in a collective), else the earliest error a rank recorded; else
    torchrun's own last lines."""
    output = (run_dir / "children.log").read_text(errors="replace")
    tail = "\n".join(output.splitlines()[-30:])
    errors = {e["rank"]: e for e in (json.loads(p.read_text()) for p in run_dir.glob("error-rank*.json"))}
    killed = [
        (int(rank), int(code))
        for rank, code in TORCHRUN_FAILURE.findall(output)
        if int(code) < 0 and int(code) != -signal.SIGTERM and int(rank) not in errors
    ]
    if killed:
        rank, code = killed[0]
        return ChildFailed(
            f"{tail}\ndistributed run failed: rank {rank} was killed by "
            f"{signal.Signals(-code).name} (out of host memory? see dmesg); its peers then failed; "
            f"output in {run_dir / 'children.log'}"
        )
    if errors:
        first = min(errors.values(), key=lambda e: e["time"])
        if first["invalid_input"]:  # a CannotTrain's message keeps its mark (core/errors.py), so its class too
            refusal = CannotTrain if first["message"].startswith(CANNOT_TRAIN) else InvalidInput
            return refusal(first["message"])
        return ChildFailed(
            f"{first['traceback'].rstrip()}\ndistributed run failed: rank {first['rank']} failed "
            f"first: {first['type']}: {first['message']}"
        )
    return ChildFailed(
        f"{tail}\ndistributed run failed: torchrun exited with status {returncode} and no rank "
        f"recorded an error; output in {run_dir / 'children.log'}"
    )


# --- the fine-tune ------------------------------------------------------------------------------------------------


def finetune(
    base: LoadOptions,
    spec: FinetuneSpec,
    rows: list[tuple[int, dict[str, Any]]],
    workdir: Path,
    *,
    gpus: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
    should_yield: Callable[[], bool] = lambda: False,
    on_log: Callable[[dict[str, Any]], None] = lambda record: None,
    progress: Progress | None = None,
):
    """`worker.training.finetune.finetune`, in this process or over the slice as the spec's strategy says.
    `progress` gets each step (in this process, or rank 0's as it reports them) for the stall watchdog."""
    # not at the top: `python -m worker.training.distributed` needs no fine-tune code
    from worker.training import finetune as single

    progress = Progress() if progress is None else progress
    strategy, world = strategy_for(spec, gpus)
    if strategy == "single":
        result = single.finetune(
            base,
            spec,
            rows,
            workdir,
            gpus=gpus,
            should_stop=should_stop,
            should_yield=should_yield,
            on_log=on_log,
            progress=progress,
        )
        result.metrics.update(strategy="single", processes=1)
        return result
    run_dir = Path(workdir) / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    (run_dir / "request.json").write_text(
        json.dumps(
            {
                "base": base.model_dump(mode="json"),
                "spec": spec.model_dump(mode="json"),
                "rows": rows,
                "workdir": str(Path(workdir).resolve()),
                "strategy": strategy,
            }
        )
    )
    t0, last = time.perf_counter(), {}

    def forward(record: dict[str, Any]) -> None:
        if "phase" in record:  # rank 0 started or ended a phase (loading, compiling): progress, not a step
            progress.end()
            if record["phase"]:
                progress.begin(f"{record['phase']} (rank 0 of {world})")
            return
        if "progress" in record:  # a step, evaluation step or checkpoint of rank 0 (at most one line a second)
            progress.beat(f"{record['progress']} (rank 0 of {world})")
            return
        progress.beat("training step (rank 0)")
        last.update(step=record.get("step"))
        on_log(record)

    progress.begin(f"starting {world} training processes")  # until rank 0 reports its first phase or step
    done = launch(
        world, "worker.training.rank", run_dir, should_stop=should_stop, should_yield=should_yield, on_record=forward
    )
    progress.end()
    if done is None:  # stopped before rank 0 wrote a result: the last complete checkpoint is where to resume
        return single.FinetuneResult(
            Path(workdir) / "adapter",
            {"steps": last.get("step"), "strategy": strategy, "processes": world, "load": None},
            stopped=True,
        )
    done["metrics"].update(strategy=strategy, processes=world, launch_seconds=round(time.perf_counter() - t0, 3))
    return single.FinetuneResult(
        Path(done["adapter_dir"]), done["metrics"], done["resumed_from"], done["stopped"], done["lora_config"]
    )


def main(argv: list[str] | None = None) -> None:
    """`python -m worker.training.distributed TORCHRUN-ARGS`: torchrun that ends with the worker that started it."""
    die_with_parent(signal.SIGTERM)
    from torch.distributed.run import main as torchrun

    torchrun(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
