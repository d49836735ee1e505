"""Training: LoRA and QLoRA fine-tunes, one concern per module, behind one small interface that worker/runtime.py
calls (as it calls worker/generate.py for the generation engines of worker/engines/).

    finetune.py          the run, top to bottom: load, tokenize, train with transformers' Trainer, save; checkpoints
                         and resume. `finetune()` runs in one process, without a queue
    data.py              training rows to token ids and labels, packing, batches, the validation split
    setup.py             the base model and its LoRA, precision, the speed levers, a strategy's TrainingArguments
    linear_ce.py         the loss from the decoder's last hidden states, never holding the logits (chunked, or liger)
    packed_attention.py  `packed_varlen`: attention over packed rows, none across them (flash-attention varlen)
    distributed.py       one fine-tune over the processes of a slice: the strategy, torchrun, the children's env
    rank.py              one rank of it (`python -m worker.training.rank RUN_DIR`, started by torchrun)

The interface, all the runtime calls:

    import_code()                                   the training code, imported (inside a watched phase)
    resume_point(checkpoints) -> (folder, step)     the newest complete checkpoint and its step, or (None, 0)
    train(base, spec, rows, workdir, *, gpus, should_stop, should_yield, on_log, progress) -> FinetuneResult
    verify_adapter(base, folder, *, gpus)           the registry's check: the adapter loads and generates

`train` trains in this process under strategy `single`, else over the slice under torchrun; either way this
process alone writes SQL (the caller does, from `on_log` and the result).

Nothing is imported here at the top, on purpose: `python -m worker.training.distributed` (torchrun's launcher, in
every distributed fine-tune) and `python -m worker.training.rank` run this file first, and the launcher needs no
training code (peft and transformers' Trainer cost seconds to import). Each function imports what it calls. No
function here is named after a module of the package: importing `worker.training.finetune` sets that attribute of the
package to the module, which would replace a function of the same name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from core.spec import FinetuneSpec, LoadOptions
    from worker.progress import Progress
    from worker.training.finetune import FinetuneResult


def import_code() -> None:
    """Import the training code (peft, transformers' Trainer). After worker/preload.py this is a dictionary lookup;
    the runtime calls it inside a phase of its stall watchdog, since a busy host once took longer than a step's bound
    to import peft."""
    from worker.training import distributed, finetune  # noqa: F401


def resume_point(checkpoints: Path) -> tuple[Path | None, int]:
    """The newest complete checkpoint under `checkpoints` and its step; (None, 0) when there is none."""
    from worker.training import finetune

    checkpoint = finetune.latest_checkpoint(checkpoints)
    return checkpoint, int(finetune.CHECKPOINT.match(checkpoint.name)[1]) if checkpoint else 0


def train(
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
) -> FinetuneResult:
    """Train `rows` on `base` as `spec` says, resuming from the newest complete checkpoint under `workdir`: in this
    process, or over the slice's GPUs as the spec's strategy says (worker/training/distributed.py)."""
    from worker.training import distributed

    return distributed.finetune(
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


def verify_adapter(base: LoadOptions, folder: Path, *, gpus: int = 0) -> None:
    """The registry's check: the adapter saved in `folder` loads onto a fresh copy of `base` and generates."""
    from worker.training import finetune

    finetune.verify_adapter(base, folder, gpus=gpus)
