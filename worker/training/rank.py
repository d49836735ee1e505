"""One rank of a distributed fine-tune: `python -m worker.training.rank RUN_DIR`, started by torchrun (never by
hand: worker/training/distributed.py launches it and documents the run folder's files).

Every rank runs the same `worker.training.finetune.finetune()` on the same rows (the Trainer's sampler gives each
rank its part); rank 0 alone reports progress and writes the result. A rank that raises writes its error for the
parent, then exits non-zero, which makes torchrun end the others.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.errors import InvalidInput
from core.spec import FinetuneSpec, LoadOptions
from worker import faults
from worker.progress import Progress
from worker.training.distributed import die_with_parent

log = logging.getLogger("worker.training.rank")


def synced_flag(flag_file: Path, device, rank: int, *, step_fault: bool = True) -> Callable[[], bool]:
    """True on every rank at the same step once the parent created `flag_file` (`stop`, `yield`): the ranks' answers
    are all-reduced (MAX), so no rank leaves a collective that the others still wait in, and a yield's checkpoint is
    saved by all of them at one step. Called at each step's end on every rank; `step_fault`: the test fault point
    rankR_step is hit here (once per step: by the `stop` flag)."""
    import torch
    import torch.distributed as dist

    decided = False

    def should_stop() -> bool:
        nonlocal decided
        if decided:
            return True
        if step_fault:
            faults.hit(f"rank{rank}_step")
        flag = torch.tensor([1.0 if flag_file.exists() else 0.0], device=device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        decided = bool(flag.item())
        return decided

    return should_stop


def progress_writer(path: Path, world: int) -> Callable[[dict[str, Any]], None]:
    def write(record: dict[str, Any]) -> None:
        with open(path, "a") as f:  # one complete line per write: the parent reads only whole lines
            f.write(json.dumps({**record, "rank": 0, "world_size": world}) + "\n")

    return write


class RankProgress(Progress):
    """Rank 0's progress, for the parent's stall watchdog: phases as `{"phase": NAME}` / `{"phase": null}` lines (a
    long load or compile is not a hang), and its beats (training and evaluation steps, checkpoints) as `{"progress":
    KIND}` lines, at most one a second."""

    def __init__(self, write: Callable[[dict[str, Any]], None]) -> None:
        self.write = write
        self.sent = 0.0
        super().__init__()

    def beat(self, kind: str) -> None:
        super().beat(kind)
        if self.last - self.sent >= 1.0:
            self.sent = self.last
            self.write({"progress": kind})

    def phase_changed(self) -> None:
        self.write({"phase": self.phase_name})


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def train(run_dir: Path, rank: int, local_rank: int, world: int) -> dict[str, Any]:
    import torch

    from worker.training import finetune

    request = json.loads((run_dir / "request.json").read_text())
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(local_rank)  # rank r trains on cuda:r of the slice
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    write = progress_writer(run_dir / "progress.jsonl", world)
    result = finetune.finetune(
        LoadOptions.model_validate(request["base"]),
        FinetuneSpec.model_validate(request["spec"]),
        [(line, row) for line, row in request["rows"]],
        Path(request["workdir"]),
        gpus=1 if on_gpu else 0,
        should_stop=synced_flag(run_dir / "stop", device, rank),
        should_yield=synced_flag(run_dir / "yield", device, rank, step_fault=False),
        on_log=write if rank == 0 else lambda record: None,
        strategy=request["strategy"],
        progress=RankProgress(write) if rank == 0 else Progress(),
    )
    return {
        "adapter_dir": str(result.adapter_dir),
        "metrics": result.metrics,
        "resumed_from": result.resumed_from,
        "stopped": result.stopped,
        "lora_config": result.lora_config,
    }


def main(argv: list[str] | None = None) -> int:
    die_with_parent(signal.SIGKILL)  # torchrun gone: nothing may go on writing checkpoints
    run_dir = Path((argv if argv is not None else sys.argv[1:])[0])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world = int(os.environ["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    try:
        result = train(run_dir, rank, local_rank, world)
    except BaseException as exc:
        write_json(
            run_dir / f"error-rank{rank}.json",
            {
                "rank": rank,
                "time": time.time(),
                "type": type(exc).__name__,
                "message": str(exc),
                "invalid_input": isinstance(exc, InvalidInput),
                "traceback": traceback.format_exc(),
            },
        )
        raise
    if rank == 0:
        write_json(run_dir / "result.json", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
