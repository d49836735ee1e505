"""LoRA and QLoRA fine-tuning: one plain function, `finetune()`, that the worker runtime (through
worker/training/__init__.py), each rank of a distributed run and the F1 benchmark call. It runs without a queue: give
it a base model, the spec, the training rows and a work directory.

How a run goes, top to bottom:

1. Load the base (quantized to 4 bits with bitsandbytes for QLoRA, then `prepare_model_for_kbit_training`) and
   wrap it with a PEFT `LoraConfig` (target modules checked against the model's module names first).
2. Tokenize (worker/training/data.py): the loss is on completion/assistant tokens only (labels -100 elsewhere);
   chat rows go through the tokenizer's chat template turn by turn, so the tokens trained are exactly those
   generation produces after the template's generation prompt. A sequence longer than `max_seq_length` is truncated
   or refused, as the spec says.
3. Train with transformers' `Trainer`: bf16 mixed precision on compute capability >= 8.0, fp16 below, fp32 on CPU.
   A callback reports every logged step (loss, learning rate, grad norm, tokens/s, eval loss, GPU memory) through
   `on_log`, stops training when `should_stop()` says so, and marks each checkpoint complete. Each training step,
   evaluation step and saved checkpoint is progress for the stall watchdog (`progress`, worker/progress.py);
   loading, preparing (tokenizing, wrapping, compiling) are phases.
4. Save the adapter (safetensors) and return the metrics.

Checkpoints are `checkpoint-N` folders written by the Trainer every `checkpoint_steps`; a `COMPLETE` marker is
written into one only after the Trainer finished saving it. A resume takes the newest folder with the marker, so a
folder half-written by a kill during save is skipped (and removed). The Trainer restores optimizer, scheduler and
RNG state, so the resumed run's first logged step is the checkpoint's step + 1 with the loss of an unbroken run.

Under several processes (`strategy` ddp, fsdp2, deepspeed_*: worker/training/distributed.py launches them, each
runs this function) the Trainer gets the strategy's arguments, tokens/s counts every process's tokens, and only the main
process marks checkpoints complete (after a barrier: every rank's files are written) and saves the adapter.

The run's parts live beside it: the data (tokenizing, packing, batches, the validation split) in
worker/training/data.py; the model, LoRA, precision, speed levers (workload F1: `liger`, `compile`,
`packed_attention`; what ran is in `metrics.speed`) and a strategy's TrainingArguments in worker/training/setup.py.
"""

from __future__ import annotations

import logging
import math
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.errors import CannotTrain, InvalidInput
from core.spec import FinetuneSpec, LoadOptions
from worker.progress import Progress
from worker.training.data import ExampleDataset, build_examples, pack, packed_collate, padded_collate, split_validation
from worker.training.setup import (
    MERGE_REFUSED,
    activation_budget,
    apply_speed,
    choose_speed,
    compile_model,
    fast_args,
    lean_trainer,
    load_base,
    merged_out_of_memory,
    plan_micro_batches,
    precision,
    speed_record,
    training_args,
    wrap_lora,
)

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE"  # marker file: the checkpoint folder was fully written
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


@dataclass
class FinetuneResult:
    adapter_dir: Path
    metrics: dict[str, Any]
    resumed_from: int | None = None
    stopped: bool = False
    lora_config: dict[str, Any] = field(default_factory=dict)


# --- checkpoints ------------------------------------------------------------------------------------------------


def complete_checkpoints(checkpoints: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint, oldest first."""
    found = []
    for path in checkpoints.glob("checkpoint-*") if checkpoints.is_dir() else []:
        match = CHECKPOINT.match(path.name)
        if match and (path / COMPLETE).is_file():
            found.append((int(match[1]), path))
    return sorted(found)


def latest_checkpoint(checkpoints: Path) -> Path | None:
    """The newest complete checkpoint; incomplete folders (a kill during save) are removed so none is reused."""
    done = complete_checkpoints(checkpoints)
    for path in checkpoints.glob("checkpoint-*") if checkpoints.is_dir() else []:
        if CHECKPOINT.match(path.name) and not (path / COMPLETE).is_file():
            log.warning("skipping incomplete checkpoint %s (written when the worker died?)", path)
            shutil.rmtree(path, ignore_errors=True)
    return done[-1][1] if done else None


# --- training ---------------------------------------------------------------------------------------------------


def _memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {
        "gpu_memory_bytes": int(torch.cuda.memory_allocated(device)),
        "gpu_peak_memory_bytes": int(torch.cuda.max_memory_allocated(device)),
    }


def _callback(
    *,
    should_stop: Callable[[], bool],
    should_yield: Callable[[], bool],
    on_log: Callable[[dict[str, Any]], None],
    device: torch.device,
    tokens_per_step: float,
    progress: Progress,
    step_ended: Callable[[], float | None] = lambda: None,
):
    """The callback that reports the run. `step_ended()`: when the step being logged ended its work (the lean
    trainer logs a step one step late), None for now."""
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):
        """Reports each logged step, stops on request, marks checkpoints complete once saved, and reports progress
        (steps, evaluation steps, checkpoints) to the stall watchdog."""

        def __init__(self):
            self.t_last, self.step_last, self.first_step = time.perf_counter(), None, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.t_last, self.step_last = time.perf_counter(), state.global_step
            progress.end()  # "preparing training" lasts through the Trainer's own setup (wrapping, resume)
            progress.beat("training start")

        def on_prediction_step(self, args, state, control, **kwargs):
            progress.beat("evaluation step")

        def on_step_end(self, args, state, control, **kwargs):
            progress.beat("training step")
            if should_yield():  # a complete checkpoint of this step, then stop: the next attempt resumes from it
                control.should_training_stop = True
                control.should_save = True
            elif should_stop():
                control.should_training_stop = True
                control.should_save = False

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            t = step_ended() or time.perf_counter()
            steps = state.global_step - (self.step_last or 0)
            record = {
                "step": state.global_step,
                "max_steps": state.max_steps,
                "epoch": round(state.epoch or 0.0, 4),
                **_memory(device),
            }
            for key in ("loss", "learning_rate", "grad_norm", "eval_loss", "train_loss"):
                if key in logs:
                    value = float(logs[key])
                    if math.isfinite(value):
                        record[key] = value
                    else:  # JSON has no NaN (Postgres refuses it): null, and the value named apart
                        record[key] = None
                        record.setdefault("non_finite", {})[key] = str(value)
            if "loss" in logs and steps > 0:
                record["tokens_per_s"] = round(steps * tokens_per_step / max(t - self.t_last, 1e-9), 1)
                record["step_seconds"] = round((t - self.t_last) / steps, 4)
                self.t_last, self.step_last = t, state.global_step
            on_log(record)

        def on_save(self, args, state, control, **kwargs):
            folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            _barrier()  # every process has written its part of the checkpoint
            if state.is_world_process_zero and folder.is_dir():
                (folder / COMPLETE).write_text(f"{state.global_step}\n")
            progress.beat("checkpoint saved")

    return Reporter()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_adapter(trainer, model, tok, adapter_dir: Path) -> None:
    """The adapter (safetensors) and tokenizer, written once. FSDP's and DeepSpeed ZeRO's sharded weights are gathered
    by the Trainer (a collective: every process calls this), which also leaves a pickled training_args.bin that we
    remove."""
    if trainer.is_fsdp_enabled or trainer.is_deepspeed_enabled:
        trainer.save_model(str(adapter_dir))
        if trainer.is_world_process_zero():
            (adapter_dir / "training_args.bin").unlink(missing_ok=True)
            tok.save_pretrained(adapter_dir)
        return
    if trainer.is_world_process_zero():
        shutil.rmtree(adapter_dir, ignore_errors=True)
        model.save_pretrained(adapter_dir, safe_serialization=True)
        tok.save_pretrained(adapter_dir)


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
    resume: bool = True,
    strategy: str = "single",
    progress: Progress | None = None,
) -> FinetuneResult:
    """Train a LoRA adapter on `rows` ((line, row) pairs) and save it under `workdir/adapter`.

    Checkpoints go to `workdir/checkpoints`; with `resume`, the newest complete one is picked up. Before any step
    runs, raises CannotTrain for data or settings that cannot train on any worker, and InvalidInput for what this
    worker cannot run (a package, a kernel or GPUs it lacks; another worker may). `result.stopped` is True when
    `should_stop()` ended training early (cancel, shutdown, lost lease), or `should_yield()` did (the scheduler gives
    the GPU to other work: a complete checkpoint of the step that just ended is saved first): no adapter is saved
    then. Both are asked at each step's end, on every process at the same step. `strategy` is `single`, or the
    distributed strategy of the process group this process is a rank of (worker/training/distributed.py).
    `progress` receives each step (and the loading and preparing phases) for the stall watchdog.
    """
    from transformers import Trainer, TrainingArguments

    workdir = Path(workdir)
    checkpoints = workdir / "checkpoints"
    progress = Progress() if progress is None else progress
    with progress.phase("loading model"):
        loaded = load_base(base, gpus)
    progress.begin("preparing training")  # tokenizing, LoRA, the Trainer, compiling: until on_train_begin
    tok, device = loaded.tokenizer, loaded.device
    train_rows, valid_rows = split_validation(rows, spec.validation_split, spec.seed)
    if not train_rows:
        raise CannotTrain("the dataset has no training rows (every row is a validation row): give training rows")
    with progress.phase(f"tokenizing {len(train_rows) + len(valid_rows)} rows"):  # in the log with its seconds
        examples, truncated = build_examples(tok, train_rows, spec)
        valid = build_examples(tok, valid_rows, spec)[0] if valid_rows else []
    if spec.packing:
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        with progress.phase("packing"):
            examples, valid = pack(examples, spec.max_seq_length, pad), pack(valid, spec.max_seq_length, pad)
        if not examples:
            raise CannotTrain(
                "no training row has a token to learn after its first one (a row's first token is "
                "never a target): give rows longer completions"
            )
    model = wrap_lora(loaded.model, spec)
    trainable, total = model.get_nb_trainable_parameters()
    mixed = precision(device)
    speed = choose_speed(spec, device, model, strategy)
    apply_speed(speed, model, mixed, spec)
    resume_from = latest_checkpoint(checkpoints) if resume else None
    real_tokens = sum(e.real_tokens if e.real_tokens is not None else len(e.input_ids) for e in examples)
    tokens_per_step = real_tokens / len(examples) * spec.batch_size * spec.gradient_accumulation
    eval_every = spec.checkpoint_steps if valid else None
    collate = packed_collate(speed.packed_attention == "varlen") if spec.packing else padded_collate(tok.pad_token_id)

    def batch(rows: int) -> dict[str, Any]:  # the first `rows` examples, collated: what the probe and warm-up run
        dataset = ExampleDataset(examples)
        return collate([dataset[i] for i in range(min(rows, len(examples)))])

    def make_trainer(rows: int, accumulation: int):
        args = TrainingArguments(
            output_dir=str(checkpoints),
            per_device_train_batch_size=rows,
            per_device_eval_batch_size=spec.batch_size,
            gradient_accumulation_steps=accumulation,
            learning_rate=spec.learning_rate,
            lr_scheduler_type=spec.lr_scheduler,
            warmup_steps=spec.warmup_steps,
            num_train_epochs=spec.epochs,
            max_steps=spec.max_steps or -1,
            seed=spec.seed,
            data_seed=spec.seed,
            bf16=mixed == "bf16",
            fp16=mixed == "fp16",
            use_cpu=device.type == "cpu",
            gradient_checkpointing=spec.gradient_checkpointing and spec.quantization is None,
            logging_steps=1,
            # a NaN or infinite loss is logged as it is (not replaced by the running mean); and testing each
            # micro-batch's loss for it would wait on the GPU every micro-batch
            logging_nan_inf_filter=False,
            save_strategy="steps",
            save_steps=spec.checkpoint_steps,
            eval_strategy="steps" if valid else "no",
            eval_steps=eval_every,
            report_to="none",
            disable_tqdm=True,
            dataloader_num_workers=0,
            remove_unused_columns=False,
            weight_decay=0.0,
            prediction_loss_only=True,
            **fast_args(strategy, device),
            **training_args(strategy, device.type),
        )
        return (lean_trainer(speed) if speed.loss != "model" else Trainer)(
            model=model,
            args=args,
            train_dataset=ExampleDataset(examples),
            eval_dataset=ExampleDataset(valid) if valid else None,
            data_collator=collate,
        )

    trainer = make_trainer(spec.batch_size, spec.gradient_accumulation)
    if strategy == "fsdp2" and not trainer.is_fsdp_enabled:  # never a quiet fallback to plain data parallel
        raise InvalidInput("strategy fsdp2 did not enable FSDP in this process (accelerate shards only on GPUs)")
    refused = (workdir / MERGE_REFUSED).exists()
    micro = plan_micro_batches(spec, speed, trainer, batch, device, strategy, refused)
    if micro.merged:  # the same rows a step, in one forward and backward
        trainer = make_trainer(micro.rows, micro.accumulation)
    tokens_per_step *= trainer.args.world_size  # every process trains on its own batches
    trainer.add_callback(
        _callback(
            should_stop=should_stop,
            should_yield=should_yield,
            on_log=on_log,
            device=device,
            tokens_per_step=tokens_per_step,
            progress=progress,
            step_ended=lambda: getattr(trainer, "step_ended", None),
        )
    )
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with merged_out_of_memory(micro, workdir), activation_budget(micro, speed):
        compile_s = compile_model(speed, spec, trainer, model, batch(micro.rows), device, progress, micro.merged)
        log.info(
            "%s: %d examples (%d validation), %d/%d trainable parameters, %s, resume from %s, %s",
            spec.model,
            len(examples),
            len(valid),
            trainable,
            total,
            mixed,
            resume_from,
            speed_record(speed, compile_s, micro),
        )
        t0 = time.perf_counter()
        output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        seconds = time.perf_counter() - t0
    steps = trainer.state.global_step
    resumed_step = int(CHECKPOINT.match(resume_from.name)[1]) if resume_from else None
    trained_steps = steps - (resumed_step or 0)
    stopped = should_stop() or (trainer.state.max_steps and steps < trainer.state.max_steps)
    metrics = {
        "steps": steps,
        "max_steps": trainer.state.max_steps,
        "epoch": round(trainer.state.epoch or 0.0, 4),
        "train_loss": round(float(output.training_loss), 6) if not math.isnan(output.training_loss) else None,
        "final_loss": _last(trainer, "loss"),
        "eval_loss": _last(trainer, "eval_loss"),
        "train_seconds": round(seconds, 3),
        "examples": len(examples),
        "validation_examples": len(valid),
        "truncated_rows": truncated,
        "trainable_parameters": trainable,
        "parameters": total,
        "precision": mixed,
        "device": str(device),
        "load": loaded.resolved,
        "packing": spec.packing,
        "speed": {
            **speed_record(speed, compile_s, micro),
            "tokens_per_step": round(tokens_per_step, 1),
            **({"fill": round(real_tokens / (len(examples) * spec.max_seq_length), 4)} if spec.packing else {}),
        },
        "train_tokens_per_s": round(trained_steps * tokens_per_step / seconds, 1) if seconds > 0 else None,
        **({"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device))} if device.type == "cuda" else {}),
    }
    adapter_dir = workdir / "adapter"
    config = model.peft_config["default"].to_dict()
    if not stopped:
        save_adapter(trainer, model, tok, adapter_dir)
    return FinetuneResult(adapter_dir, metrics, resumed_step, bool(stopped), _jsonable(config))


def _last(trainer, key: str) -> float | None:
    values = [h[key] for h in trainer.state.log_history if key in h]
    return round(float(values[-1]), 6) if values else None


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def verify_adapter(opts: LoadOptions, folder: Path, *, gpus: int = 0) -> None:
    """The registry's check: the saved adapter loads onto a fresh copy of its base and generates a few tokens."""
    from peft import PeftModel
    from safetensors import safe_open

    with safe_open(str(folder / "adapter_model.safetensors"), framework="pt") as weights:
        for key in weights.keys():
            weights.get_tensor(key)
    loaded = load_base(opts, gpus)
    model = PeftModel.from_pretrained(loaded.model, str(folder), is_trainable=False)
    probe = loaded.tokenizer("Hello", return_tensors="pt").to(loaded.device)
    with torch.no_grad():
        out = model.generate(**probe, max_new_tokens=2, do_sample=False)
    if out.shape[1] <= probe["input_ids"].shape[1]:
        raise RuntimeError("the adapted model generated no token")
