"""Fine-tune setup: the base model and its LoRA, mixed precision, the speed levers, and the TrainingArguments a
distributed strategy needs. worker/training/finetune.py calls these in its run, top to bottom.

Speed (workload F1, ops/bench/f1.py; the spec's `liger`, `compile`, `packed_attention`; what ran is in
`metrics.speed`), all inside the Trainer so events, checkpoints and resume are unchanged:

- Packed rows (worker/training/data.py `pack`) are kept apart by `packed_varlen` (flash-attention over each row,
  worker/training/packed_attention.py) on CUDA, else by transformers' block-diagonal mask built from the position_ids.
- The loss is computed from the decoder's last hidden states by worker/training/linear_ce.py (chunked, or liger-kernel's
  fused linear cross-entropy called as a function: never liger's process-wide monkey patches, nor Trainer's
  `use_liger_kernel`, which applies them), so the 151,936-wide logits never exist at once. It is the sum over the
  step's target tokens divided by their count (`num_items_in_batch`), as transformers' own loss.
- Each decoder layer is compiled in place (`layer.compile()`: state_dict keys unchanged, one layer's code serves
  all), and one warm-up forward/backward compiles it before `Trainer.train()`, timed apart (`compile_seconds`).
  Not Trainer's `torch_compile`, which wraps the whole PEFT model (its keys gain `_orig_mod.`, and every shape or
  mode change recompiles all 28 layers).
- bf16 weights stay bf16 (no fp32 copy of frozen weights); PEFT's per-layer copy of each LoRA input to fp32 is off
  under autocast; fused AdamW and TF32 on CUDA; no gradient checkpointing unless the spec asks.

Under a distributed strategy (ddp, fsdp2, deepspeed_*: worker/training/distributed.py launches the processes) the
Trainer gets the strategy's arguments (`training_args`); collectives time out after `COLLECTIVE_TIMEOUT_S`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from core.errors import CannotTrain, InvalidInput
from core.settings import get_settings
from core.spec import FinetuneSpec, LoadOptions
from worker.failures import exception_chain
from worker.progress import Progress

log = logging.getLogger(__name__)
COLLECTIVE_TIMEOUT_S = 600  # a collective that waits longer than this on a peer fails the attempt


# --- model ------------------------------------------------------------------------------------------------------


def precision(device: torch.device) -> str:
    """bf16 mixed precision on compute capability >= 8.0, fp16 below, fp32 on CPU."""
    if device.type != "cuda":
        return "fp32"
    major, _ = torch.cuda.get_device_capability(device)
    return "bf16" if major >= 8 else "fp16"


def linear_module_names(model) -> set[str]:
    """Last name parts of the model's Linear-like layers (4-bit bitsandbytes layers included), lm_head excluded."""
    names = set()
    for name, module in model.named_modules():
        if (
            name
            and "lm_head" not in name
            and (isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"))
        ):
            names.add(name.rsplit(".", 1)[-1])
    return names


def check_target_modules(model, spec: FinetuneSpec) -> None:
    """Refuse target modules or modules_to_save that the model does not have, naming the ones it has."""
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    if spec.target_modules != "all-linear":
        missing = [m for m in spec.target_modules if m not in leaf_names]
        if missing:
            raise CannotTrain(
                f"target_modules {missing} do not exist in {spec.model}: its linear layers are "
                f"{sorted(linear_module_names(model))} (or use 'all-linear')"
            )
    missing = [m for m in spec.modules_to_save or [] if m not in leaf_names]
    if missing:
        raise CannotTrain(f"modules_to_save {missing} do not exist in {spec.model}; e.g. embed_tokens or lm_head")


def lora_config(spec: FinetuneSpec):
    from peft import LoraConfig

    return LoraConfig(
        r=spec.lora_r,
        lora_alpha=spec.lora_alpha,
        lora_dropout=spec.lora_dropout,
        target_modules=spec.target_modules,
        modules_to_save=spec.modules_to_save,
        task_type="CAUSAL_LM",
    )


def load_base(opts: LoadOptions, gpus: int):
    from worker import loader

    loaded = loader.load(opts, gpus=gpus)
    loaded.tokenizer.padding_side = "right"
    return loaded


def wrap_lora(model, spec: FinetuneSpec):
    """The base wrapped with the spec's LoRA. The LoRA weights are initialized from `spec.seed`, not from whatever
    the process's random state happens to be, so a job (and a resumed one's reference run) is reproducible."""
    from peft import get_peft_model, prepare_model_for_kbit_training
    from transformers import set_seed

    check_target_modules(model, spec)
    set_seed(spec.seed)
    if spec.quantization is not None:  # QLoRA: fp32 norms, input grads, gradient checkpointing as configured
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=spec.gradient_checkpointing)
    elif spec.gradient_checkpointing:
        model.enable_input_require_grads()
    return get_peft_model(model, lora_config(spec))


# --- speed levers -----------------------------------------------------------------------------------------------


@dataclass
class Speed:
    """The speed levers a fine-tune runs with, resolved from the spec's auto/on/off; recorded in its metrics."""

    loss: str = "model"  # chunked | liger: from the hidden states, logits never held; model: the model's own loss
    packed_attention: str | None = None  # varlen | mask (packed rows only)
    compile: bool = False
    notes: list[str] = field(default_factory=list)  # where an `auto` did not take its first choice, and why


def choose_speed(spec: FinetuneSpec, device: torch.device, model, strategy: str = "single") -> Speed:
    """Resolve liger / packed_attention / compile for this model on this device. An explicit `on`/`varlen` that
    cannot run raises (before any step) CannotTrain where the spec or the model is why, InvalidInput where this
    worker is (no CUDA, a kernel missing: another worker may run it); an `auto` that cannot takes the next choice
    and notes why.

    Under a distributed strategy the loss and compile stay the Trainer's own: the lean loss calls the decoder
    directly, past the DDP/FSDP/DeepSpeed wrapper's forward that those strategies rely on.
    """
    speed = Speed()
    if strategy != "single":
        if spec.liger == "on" or spec.compile == "on":
            raise CannotTrain(  # the strategy is the spec's on the job's slice, whichever worker runs it
                f"liger=on and compile=on run with strategy single only (this job runs {strategy}): use auto or off"
            )
        speed.notes.append(f"strategy {strategy}: the model's own loss, not compiled")
    else:
        speed.loss = _choose_loss(spec, device, model, speed.notes)
    if spec.packing:
        speed.packed_attention = _choose_attention(spec, device, model, speed.notes)
    cuda = device.type == "cuda"
    speed.compile = strategy == "single" and (
        spec.compile == "on" or (spec.compile == "auto" and cuda and spec.packing and spec.quantization is None)
    )
    if spec.compile == "auto" and cuda and strategy == "single" and not speed.compile:
        speed.notes.append("compile auto: off (it compiles packed training without quantization only: fixed shapes)")
    return speed


# --- micro-batches ----------------------------------------------------------------------------------------------

# A step's micro-batches (`gradient_accumulation` of `batch_size` rows) run as one micro-batch of all the step's rows
# when the GPU has room: F1's 8 x 2 as one micro-batch of 16 ran 1.056x faster through finetune() on an H100
# (ops/bench/results/2026-12-07-h100-session51; 1.034x as session 46's batch16-budget experiment; the loss is the same
# sum over the step's target tokens over their count, the curve moved 0.07 %), with each compiled layer's partitioner
# held to MERGE_ACTIVATION_BUDGET of its saved activations (recomputing cheap ones in the backward): 32.7 GiB where 16
# rows would take 41.8. Packed rows only, and the room is probed, not assumed (`plan_micro_batches`). The rows of a
# step, their order and the checkpoints' step numbers stay the spec's, so a run resumed on a GPU that decides
# otherwise trains on the same rows.
MERGE_MICRO_BATCHES = True
MERGE_ACTIVATION_BUDGET = 0.8  # torch._functorch.config.activation_memory_budget while a merged step compiles
# a file in the job's work directory, written when a merged run ran out of memory: the next attempt (which resumes
# from the last checkpoint) runs the spec's micro-batches, so a wrong prediction costs one attempt, not the job
MERGE_REFUSED = "merged-micro-batches-ran-out-of-memory"
GIB = 1 << 30


@dataclass
class MicroBatches:
    """How a step's rows are run: `rows` per forward and backward, `accumulation` of them; `record` (for
    metrics.speed.micro_batches) when merging was considered."""

    rows: int
    accumulation: int
    record: dict[str, Any] | None = None

    @property
    def merged(self) -> bool:
        return bool(self.record and self.record["merged"])


def gpu_memory(device: torch.device) -> tuple[int, int, int, int] | None:
    """(bytes allocated now, the peak since the last reset, the GPU's total, what the CUDA context and other
    processes hold: the GPU's used bytes less this process's cache); None off CUDA. Resets the peak."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    stats = (
        torch.cuda.memory_allocated(device),
        torch.cuda.max_memory_allocated(device),
        total,
        max(0, total - free - torch.cuda.memory_reserved(device)),
    )
    torch.cuda.reset_peak_memory_stats(device)
    return stats


def plan_micro_batches(
    spec: FinetuneSpec,
    speed: Speed,
    trainer,
    batch: Callable[[int], dict[str, Any]],
    device: torch.device,
    strategy: str,
    refused: bool = False,
) -> MicroBatches:
    """The spec's micro-batches, or all of a step's rows in one when MERGE_MICRO_BATCHES is on, the run is on one
    GPU, its rows are packed, no earlier attempt of the job ran out of memory merged (`refused`: MERGE_REFUSED), and
    the step is predicted to fit. Packed, every micro-batch has the same shape (blocks of max_seq_length), so one
    probe speaks for every step; padded micro-batches are as long as their longest row, and a probe on the first
    rows could not promise that a later step of long ones fits. The probe: one eager forward and backward of a spec
    micro-batch (`batch(rows)` collates the first rows) before anything is compiled; the merged step is predicted to
    hold what was allocated before it plus `gradient_accumulation` times what it added at its peak. Eager saves at
    least what the compiled layers save, so the prediction errs high. It fits when that, beside what the CUDA
    context and other processes hold, is within the worker's share of the GPU (JOBS_GPU_MEMORY_UTILIZATION, as the
    generation cache's budget counts them). A step predicted not to fit keeps the spec's micro-batches, with a note;
    so does one whose probe ran out of memory (eager holds more than compiled layers, so a job that fits compiled
    may not fit eager: the probe must never be what fails it). The probe's blocks leave PyTorch's cache after it:
    beside the merged step's blocks of other sizes they held 45.7 GiB reserved for 32.7 allocated on an H100."""
    if not (MERGE_MICRO_BATCHES and strategy == "single" and spec.packing) or spec.gradient_accumulation == 1:
        return MicroBatches(spec.batch_size, spec.gradient_accumulation)
    before = gpu_memory(device)
    if before is None:
        return MicroBatches(spec.batch_size, spec.gradient_accumulation)
    asked, rows = f"{spec.batch_size} x {spec.gradient_accumulation}", spec.batch_size * spec.gradient_accumulation

    def kept(why: str, **record) -> MicroBatches:
        speed.notes.append(f"micro-batches kept at {asked}: {why}")
        return MicroBatches(spec.batch_size, spec.gradient_accumulation, {"merged": False, "asked": asked, **record})

    if refused:
        return kept(f"an earlier attempt ran {rows} rows at once out of memory", probe="skipped")
    try:
        _warm_up(trainer, batch(spec.batch_size), device)
    except torch.OutOfMemoryError:
        trainer.model.zero_grad(set_to_none=True)
        return kept("the memory probe (one eager micro-batch) ran out of memory", probe="out of memory")
    finally:
        torch.cuda.empty_cache()
    _, peak, total, others = gpu_memory(device)
    predicted = before[0] + spec.gradient_accumulation * (peak - before[0])
    share = get_settings().gpu_memory_utilization
    limit = share * total - others
    figures = {"predicted_gib": round(predicted / GIB, 2), "limit_gib": round(limit / GIB, 2)}
    if predicted > limit:
        held = f", less {others / GIB:.1f} held by other processes and the CUDA context" if others >= GIB else ""
        return kept(
            f"{rows} rows at once were predicted to take {predicted / GIB:.1f} GiB, over {share:.0%} of the GPU's "
            f"{total / GIB:.1f} (JOBS_GPU_MEMORY_UTILIZATION){held}",
            **figures,
        )
    return MicroBatches(rows, 1, {"merged": True, "asked": asked, **figures})


@contextlib.contextmanager
def activation_budget(micro: MicroBatches, speed: Speed) -> Iterator[None]:
    """While a merged step's layers compile (and train: a later recompile too), their partitioner keeps at most
    MERGE_ACTIVATION_BUDGET of the activations (process-wide torch config, restored after)."""
    if not (micro.merged and speed.compile):
        yield
        return
    from torch._functorch import config

    with config.patch(activation_memory_budget=MERGE_ACTIVATION_BUDGET):
        yield


@contextlib.contextmanager
def merged_out_of_memory(micro: MicroBatches, workdir: Path) -> Iterator[None]:
    """A merged run that runs out of memory (the probe's prediction was wrong) leaves MERGE_REFUSED in its work
    directory and fails this attempt, as any out-of-memory does: the retry resumes from the last checkpoint with the
    spec's micro-batches."""
    try:
        yield
    except torch.OutOfMemoryError:
        if micro.merged:
            log.warning("%d rows at once ran out of memory: the next attempt runs the spec's micro-batches", micro.rows)
            workdir.mkdir(parents=True, exist_ok=True)
            (workdir / MERGE_REFUSED).write_text(f"{micro.rows} rows at once ran out of memory\n")
        raise


def speed_record(speed: Speed, compile_s: float | None, micro: MicroBatches | None = None) -> dict[str, Any]:
    """What ran, for the job's metrics: loss kernel, packed attention, compile (and its seconds), the micro-batches
    where merging them was considered, auto's notes."""
    record = {
        "loss": speed.loss,
        "packed_attention": speed.packed_attention,
        "compile": speed.compile,
        "compile_seconds": None if compile_s is None else round(compile_s, 2),
    }
    if micro is not None and micro.record is not None:
        record["micro_batches"] = {"rows": micro.rows, "accumulation": micro.accumulation, **micro.record}
    return {**record, "notes": speed.notes} if speed.notes else record


def apply_speed(speed: Speed, model, mixed: str, spec: FinetuneSpec) -> None:
    from worker.training import packed_attention

    if speed.packed_attention == "varlen":
        model.get_base_model().set_attn_implementation(packed_attention.register())
    if mixed in ("bf16", "fp16") and spec.quantization is None:
        _no_input_casting(model)


def fast_args(strategy: str, device: torch.device) -> dict[str, Any]:
    """TrainingArguments for speed on a GPU: fused AdamW (one kernel for every LoRA tensor), TF32 matmuls on
    Ampere+ (only fp32 matmuls change: LoRA weights under autocast are cast to bf16 anyway), batches copied to the
    GPU asynchronously. CPU: as before."""
    if device.type != "cuda" or strategy != "single":
        return {}
    return {
        "optim": "adamw_torch_fused",
        "tf32": torch.cuda.get_device_capability(device)[0] >= 8,
        # batches are copied from pinned memory without waiting for the GPU (a blocking copy is a sync per batch)
        "dataloader_pin_memory": True,
        "accelerator_config": {"non_blocking": True},
    }


def compile_model(
    speed: Speed,
    spec: FinetuneSpec,
    trainer,
    model,
    batch: dict[str, Any],
    device: torch.device,
    progress: Progress,
    merged: bool = False,
) -> float | None:
    """Compile the decoder layers and run the warm-up step (compile time, returned); None when not compiling. With
    compile auto a failure falls back to eager (noted); with compile on it fails the job. A `merged` step that runs
    out of memory while it compiles or warms up fails the attempt as that out-of-memory (merged_out_of_memory: the
    retry runs the spec's micro-batches, compiled), never as eager: eager holds more than the compiled layers, and
    ran F1 at half their speed."""
    if not speed.compile:
        return None
    try:
        _compile_layers(model)
        with progress.phase("compiling"):
            return _warm_up(trainer, batch, device)
    except InvalidInput:
        raise
    except Exception as exc:  # torch.compile raises many kinds; the message says which
        _uncompile_layers(model)
        oom = next((e for e in exception_chain(exc) if isinstance(e, torch.OutOfMemoryError)), None)
        if merged and oom is not None:
            if oom is exc:
                raise
            raise torch.OutOfMemoryError(str(oom)) from exc  # Inductor wraps what its compile caught
        if spec.compile == "on":
            raise RuntimeError(
                f"compile=on: torch.compile failed on this model ({type(exc).__name__}: {exc}); use compile auto or off"
            ) from exc
        speed.compile = False
        speed.notes.append(f"compile auto: off, torch.compile failed ({type(exc).__name__}: {str(exc)[:300]})")
        log.warning("%s: torch.compile failed, training eagerly: %s", spec.model, exc)
        return None


def _lean_loss_problem(model) -> str | None:
    """Why the loss cannot be computed from the decoder's hidden states and lm_head's weight, if it cannot."""
    config = model.config
    if (
        getattr(config, "final_logit_softcapping", None)
        or getattr(config, "logit_scale", None)
        or getattr(config, "logits_scaling", None)
    ):
        return f"{type(model).__name__} scales or caps its logits"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"its lm_head is a {type(head).__name__}, not a plain Linear without bias (e.g. modules_to_save lm_head)"
    return None


def _choose_loss(spec: FinetuneSpec, device: torch.device, model, notes: list[str]) -> str:
    from worker.training import linear_ce

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    problem = _lean_loss_problem(base)
    if problem:
        if spec.liger == "on":
            raise CannotTrain(f"liger=on cannot run: {problem}. Use liger auto or off")
        notes.append(f"loss: the model's own (all logits), since {problem}")
        return "model"
    if spec.liger != "on":
        # auto too: on an H100, F1 ran 1.09x faster chunked (ops/bench/results/2026-12-06-h100-f1): liger's
        # function reads two values back from the GPU every micro-batch, which stalls it; ours reads none
        return "chunked"
    problem = linear_ce.liger_problem(device)
    if problem:
        raise InvalidInput(f"liger=on cannot run: {problem}. Use liger auto or off (our chunked cross-entropy)")
    return "liger"


def _choose_attention(spec: FinetuneSpec, device: torch.device, model, notes: list[str]) -> str:
    from worker.training import packed_attention

    if spec.packed_attention == "mask":
        return "mask"
    config = model.config
    fixed = None  # a problem of the spec or the model, on any worker
    if spec.attn_implementation not in ("sdpa", "sdpa_gqa"):
        fixed = f"it replaces attn_implementation {spec.attn_implementation}"
    elif getattr(config, "attention_dropout", 0.0) or set(
        getattr(config, "layer_types", None) or ["full_attention"]
    ) != {"full_attention"}:
        fixed = "the model has attention dropout or sliding-window layers"
    problem = fixed or packed_attention.problem(device)
    if problem and spec.packed_attention == "varlen":
        refusal = CannotTrain if fixed else InvalidInput
        raise refusal(f"packed_attention=varlen cannot run: {problem}. Use packed_attention auto or mask")
    if problem and device.type == "cuda":
        notes.append(f"packed_attention auto: mask, since {problem}")
    return "mask" if problem else "varlen"


def _no_input_casting(model) -> None:
    """Under autocast, keep PEFT from copying every LoRA layer's input to fp32 (the adapter weights' dtype) before
    autocast casts it back to bf16: one full copy of each linear layer's input per layer, saved for backward too."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


def _compile_layers(model) -> int:
    """torch.compile each decoder layer in place (state_dict keys unchanged, so checkpoints and the adapter save as
    before). One layer's graph serves all of them (regional compilation), compiled in seconds, not minutes."""
    import torch._dynamo

    decoder = model.get_base_model().get_decoder()
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise CannotTrain(f"compile=on: {type(decoder).__name__} has no `layers` to compile: use compile auto or off")
    # all layers share one code object: room for their guards plus the train and eval variants
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile()
    return len(layers)


def _uncompile_layers(model) -> None:
    for layer in model.get_base_model().get_decoder().layers:
        layer._compiled_call_impl = None


def lean_trainer(speed: Speed):
    """A Trainer whose loss comes from the decoder's last hidden states through `linear_ce` (chunked or liger): the
    logits are never materialized. The loss is the sum over target tokens divided by the step's count of them
    (`num_items_in_batch`), so gradient accumulation weighs every token alike and Trainer adds no 1/steps."""
    from transformers import Trainer

    from worker.training import linear_ce

    class LeanLossTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = True  # our loss is already divided by num_items_in_batch
            self._flos_per_token: int | None = None
            self._causal: tuple[Any, Any] | None = None  # (the model compute_loss was given, its causal LM)
            self._pending: collections.deque[_PendingLog] = collections.deque()
            self._clock: tuple[Any, float] | None = None  # (a step's CUDA event, perf_counter when it was seen done)
            self.step_ended: float | None = None  # perf_counter when the step being logged ended its work

        # A step's loss and gradient norm are read back one step late. Trainer's own logging reads them at once
        # (`.item()` at every step's end, with logging_steps=1), so the CPU waits for the GPU there and the GPU then
        # idles while the CPU logs, collates the next batch and launches its first kernels: ~18 ms of a 347 ms F1
        # step on an H100 (ops/bench/results/2026-12-07-h100-session53). Here the values are copied to the host
        # behind the step's work; the next step's end, already queued behind it, reads them. Every step is still
        # logged, in order, with its own step number, epoch and learning rate; all are read before a checkpoint, an
        # evaluation, the last step, a stop and a failure, so a checkpoint's log history is complete.

        def train(self, *args, **kwargs):
            try:
                return super().train(*args, **kwargs)
            finally:  # a run that fails still logs the steps it finished
                with contextlib.suppress(Exception):
                    self._log_pending(True)

        def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, learning_rate=None, **kwargs):
            snapped = self.control.should_log and self.state.global_step > self._globalstep_last_logged
            if snapped:
                self._snapshot(tr_loss, grad_norm, learning_rate)
            control = self.control  # Trainer stops at max_steps with should_training_stop
            self._log_pending(
                not snapped or control.should_save or control.should_evaluate or control.should_training_stop
            )
            self.control.should_log = False  # logged above; Trainer's own evaluates and saves
            super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, learning_rate=learning_rate, **kwargs)

        def _snapshot(self, tr_loss, grad_norm, learning_rate) -> None:
            norm = grad_norm.detach() if isinstance(grad_norm, torch.Tensor) else torch.tensor(float(grad_norm or 0))
            values = torch.stack([tr_loss.detach().float().reshape(()), norm.float().reshape(()).to(tr_loss.device)])
            host = values.to("cpu", non_blocking=True)  # into pinned memory, behind the step's kernels
            done, ended = self._end_marker(values.is_cuda)
            tr_loss -= tr_loss
            self._pending.append(
                _PendingLog(
                    step=self.state.global_step,
                    epoch=self.state.epoch,
                    steps=self.state.global_step - self._globalstep_last_logged,
                    learning_rate=learning_rate if learning_rate is not None else self._get_learning_rate(),
                    has_norm=grad_norm is not None,
                    values=host,
                    done=done,
                    ended=ended,
                )
            )
            self._globalstep_last_logged = self.state.global_step
            self.store_flos()

        def _end_marker(self, on_gpu: bool) -> tuple[Any, float | None]:
            """(a timing CUDA event recorded behind the step's work, None) on a GPU, (None, now) off it. The first
            step's event is waited for at once: its end is the clock that later steps which had ended before they
            were looked at are timed from (taking the moment it was looked at instead put up to a step's time into
            the next step waited for: F1's 30-step variants read ~3 % too fast on an H100, session 54)."""
            if not on_gpu:
                return None, time.perf_counter()  # computed already
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            if self._clock is not None:
                return done, None
            done.synchronize()
            ended = time.perf_counter()
            self._clock = (done, ended)
            return done, ended

        def _log_pending(self, everything: bool) -> None:
            """Log the pending steps, in order: all of them, or all but the newest (whose values may still be on their
            way). `step_ended` is when each step's work ended, for the step times the callbacks report: the moment
            a wait for it returned, or, for one that had ended before it was looked at, the last such moment (or the
            first step's end) plus the GPU time between the two."""
            while len(self._pending) > (0 if everything else 1):
                entry = self._pending.popleft()
                if entry.ended is None and entry.done.query():
                    event, at = self._clock
                    entry.ended = at + event.elapsed_time(entry.done) / 1000
                elif entry.ended is None:
                    entry.done.synchronize()
                    entry.ended = time.perf_counter()
                    self._clock = (entry.done, entry.ended)
                self.step_ended = entry.ended
                loss, norm = entry.values.tolist()
                self._total_loss_scalar += loss
                logs = {"loss": loss / entry.steps}
                if entry.has_norm:
                    logs["grad_norm"] = norm
                logs["learning_rate"] = entry.learning_rate
                now = self.state.global_step, self.state.epoch
                self.state.global_step, self.state.epoch = entry.step, entry.epoch  # Trainer.log reads them
                try:
                    self.log(logs)
                finally:
                    self.state.global_step, self.state.epoch = now

        def _causal_lm(self, model):
            """The causal LM inside `model`, found once: accelerate's unwrap_model walks every module looking for
            compiled ones (15 ms a step for Qwen3-0.6B's PEFT model, while the GPU waited)."""
            if self._causal is None or self._causal[0] is not model:
                self._causal = (model, self.accelerator.unwrap_model(model).get_base_model())
            return self._causal[1]

        # Two pieces of Trainer's per-micro-batch host work walk the whole PEFT model (~2,400 modules and 700
        # parameters for Qwen3-0.6B: 8 and 6 ms on a CPU core), the first while the GPU waits for its next batch.

        def training_step(self, model, *args, **kwargs):
            """Trainer's own step, without its `model.train()` walk when the model is in training mode already."""
            if not model.training:
                return super().training_step(model, *args, **kwargs)
            model.train = lambda mode=True: model if mode else type(model).train(model, mode)
            try:
                return super().training_step(model, *args, **kwargs)
            finally:
                del model.train

        def floating_point_ops(self, inputs):
            """Trainer's count (6 × tokens × parameters), the parameters counted once instead of every micro-batch."""
            name = getattr(self.model, "main_input_name", "input_ids")
            if self._flos_per_token is None:
                self._flos_per_token = super().floating_point_ops({name: torch.zeros(1, 1, dtype=torch.long)})
            main = inputs.get(name)
            return self._flos_per_token * main.numel() if isinstance(main, torch.Tensor) else 0

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if speed.loss == "model":
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            if speed.compile and "cu_seq_lens_q" in inputs:  # the row count varies per batch: one dynamic graph
                torch._dynamo.maybe_mark_dynamic(inputs["cu_seq_lens_q"], 0)
            causal = self._causal_lm(model)
            with self.accelerator.autocast():
                hidden = causal.get_decoder()(**inputs, use_cache=False).last_hidden_state
                total, count = linear_ce.causal_lm_loss(
                    hidden, causal.get_output_embeddings().weight, labels, kernel=speed.loss, compiled=speed.compile
                )
            loss = total / (num_items_in_batch if num_items_in_batch is not None else count.clamp_min(1))
            return (loss, {"loss": loss}) if return_outputs else loss

    return LeanLossTrainer


@dataclass
class _PendingLog:
    """A step's loss (summed over `steps`) and gradient norm, on their way to the host (`done` once there)."""

    step: int
    epoch: float | None
    steps: int
    learning_rate: float
    has_norm: bool
    values: torch.Tensor
    done: Any  # torch.cuda.Event (timing) recorded behind the step's work; None off CUDA
    ended: float | None = None  # perf_counter when the step's work ended, once known


def _warm_up(trainer, batch: dict[str, Any], device: torch.device) -> float:
    """One forward and backward on a training batch before `Trainer.train()`: every compiled region compiles now
    (its time reported apart from the steps') and a compile failure surfaces before any step. Gradients and the RNG
    state are left as they were."""
    rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    t0 = time.perf_counter()
    trainer.model.train()
    trainer.compute_loss(trainer.model, batch).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    trainer.model.zero_grad(set_to_none=True)
    torch.random.set_rng_state(rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    return seconds


# --- distributed strategies -------------------------------------------------------------------------------------


def training_args(strategy: str, device_type: str) -> dict[str, Any]:
    """TrainingArguments for a strategy (none for `single`). FSDP2 through the Trainer's accelerate plugin; DeepSpeed
    through a config dict whose batch sizes and precision the Trainer fills in ("auto")."""
    if strategy == "single":
        return {}
    args: dict[str, Any] = {
        "ddp_backend": "nccl" if device_type == "cuda" else "gloo",
        "ddp_timeout": COLLECTIVE_TIMEOUT_S,
        "ddp_find_unused_parameters": False,
    }
    if strategy == "fsdp2":
        from transformers import TrainingArguments

        # transformers >= 5.20 takes fsdp=True and everything in fsdp_config; 5.17 takes the option string
        modern = hasattr(TrainingArguments, "_apply_legacy_fsdp_to_config")
        args.update(fsdp=True if modern else "full_shard", fsdp_config={"version": 2})
    elif strategy.startswith("deepspeed"):
        args["deepspeed"] = {
            "zero_optimization": {"stage": int(strategy[-1])},
            "bf16": {"enabled": "auto"},
            "fp16": {"enabled": "auto"},
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto",
        }
    return args
