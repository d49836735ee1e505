"""LoRA and QLoRA fine-tuning: one plain function, `finetune()`, that the worker runtime (and the GPU check script)
call. It runs without a queue: give it a base model, the spec, the training rows and a work directory.

How a run goes, top to bottom:

1. Load the base (quantized to 4 bits with bitsandbytes for QLoRA, then `prepare_model_for_kbit_training`) and
   wrap it with a PEFT `LoraConfig` (target modules checked against the model's module names first).
2. Tokenize: the loss is on completion/assistant tokens only (labels -100 elsewhere); chat rows go through the
   tokenizer's chat template turn by turn, so the tokens trained are exactly those generation produces after the
   template's generation prompt. A sequence longer than `max_seq_length` is truncated or refused, as the spec says.
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

Under several processes (`strategy` ddp, fsdp2, deepspeed_*: worker/distributed.py launches them, each runs this
function) the Trainer gets the strategy's arguments, tokens/s counts every process's tokens, and only the main
process marks checkpoints complete (after a barrier: every rank's files are written) and saves the adapter.

Speed (workload F1, ops/bench/f1.py; the spec's `liger`, `compile`, `packed_attention`; what ran is in
`metrics.speed`), all inside the Trainer so events, checkpoints and resume are unchanged:

- Packing is best fit decreasing into blocks of exactly `max_seq_length`, rows whole (cut only when longer than a
  block), each row's positions restarting at 0 and its first label dropped, so no row sees another and a block's
  loss is the sum of its rows' losses. Rows are kept apart by `packed_varlen` (flash-attention over each row,
  worker/packed_attention.py) on CUDA, else by transformers' block-diagonal mask built from the position_ids.
- The loss is computed from the decoder's last hidden states by worker/linear_ce.py (chunked, or liger-kernel's
  fused linear cross-entropy called as a function: never liger's process-wide monkey patches, nor Trainer's
  `use_liger_kernel`, which applies them), so the 151,936-wide logits never exist at once. It is the sum over the
  step's target tokens divided by their count (`num_items_in_batch`), as transformers' own loss.
- Each decoder layer is compiled in place (`layer.compile()`: state_dict keys unchanged, one layer's code serves
  all), and one warm-up forward/backward compiles it before `Trainer.train()`, timed apart (`compile_seconds`).
  Not Trainer's `torch_compile`, which wraps the whole PEFT model (its keys gain `_orig_mod.`, and every shape or
  mode change recompiles all 28 layers).
- bf16 weights stay bf16 (no fp32 copy of frozen weights); PEFT's per-layer copy of each LoRA input to fp32 is off
  under autocast; fused AdamW and TF32 on CUDA; no gradient checkpointing unless the spec asks.
"""

from __future__ import annotations

import bisect
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

from core.errors import InvalidInput
from core.spec import FinetuneSpec, LoadOptions
from worker.progress import Progress

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE"  # marker file: the checkpoint folder was fully written
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    # packed blocks only: each row's positions restart at 0; `segments` are the rows' lengths (the last may be padding)
    position_ids: list[int] | None = None
    segments: list[int] | None = None
    real_tokens: int | None = None  # tokens that are not padding


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


# --- data -------------------------------------------------------------------------------------------------------


def _encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) if text else []


def _chat_text(tok, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def tokenize_row(tok, row: dict[str, Any]) -> Example:
    """Token ids and labels of one training row; labels are -100 except on what the model must learn to say."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    if "text" in row:
        ids = _encode(tok, row["text"]) + eos
        return Example(ids, list(ids))
    if "prompt" in row:
        prompt, completion = _encode(tok, row["prompt"]), _encode(tok, row["completion"]) + eos
        return Example(prompt + completion, [IGNORE] * len(prompt) + completion)
    if not getattr(tok, "chat_template", None):
        raise InvalidInput("the dataset has chat `messages` rows but the model's tokenizer has no chat template: "
                           "use prompt/completion rows, or a model whose tokenizer_config.json has one")
    # Turn by turn: an assistant turn's tokens are what follows the generation prompt of the turns before it.
    messages, ids, labels, done = row["messages"], [], [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = _chat_text(tok, messages[:i], generation_prompt=True)
            part = _encode(tok, head[len(done):])
            ids, labels, done = ids + part, labels + [IGNORE] * len(part), head
        text = _chat_text(tok, messages[: i + 1])
        part = _encode(tok, text[len(done):])
        ids += part
        labels += part if message["role"] == "assistant" else [IGNORE] * len(part)
        done = text
    return Example(ids, labels)


def build_examples(tok, rows: list[tuple[int, dict[str, Any]]], spec: FinetuneSpec) -> tuple[list[Example], int]:
    """Tokenized rows; a too-long row is truncated or refused (InvalidInput naming the rows), as the spec says.

    Returns (examples, truncated count). `rows` are (line, row) pairs, so a refusal names the input lines. With
    packing, rows are concatenated and cut into blocks of max_seq_length, so a long row is split, never refused.
    """
    examples, too_long = [], []
    for line, row in rows:
        ex = tokenize_row(tok, row)
        if len(ex.input_ids) > spec.max_seq_length and not spec.packing:
            too_long.append((line, len(ex.input_ids)))
            ex = Example(ex.input_ids[: spec.max_seq_length], ex.labels[: spec.max_seq_length])
        if any(label != IGNORE for label in ex.labels):
            examples.append(ex)
    if too_long and spec.truncation == "refuse":
        shown = ", ".join(f"line {line} ({n} tokens)" for line, n in too_long[:5])
        more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
        raise InvalidInput(f"{len(too_long)} row(s) are longer than max_seq_length={spec.max_seq_length} tokens: "
                           f"{shown}{more}. Raise max_seq_length, shorten the rows, or set truncation: truncate")
    if not examples:
        raise InvalidInput("no training row has a token to learn (every completion/assistant turn was empty or cut "
                           "off by max_seq_length)")
    return examples, len(too_long)


def pack(examples: list[Example], length: int, pad_id: int = 0) -> list[Example]:
    """Pack rows into blocks of exactly `length` tokens, best fit decreasing, with no row attending to another.

    A row longer than `length` is cut into pieces of `length` first (so it is split, never refused). Whole pieces
    go, longest first, into the fullest block they fit (best fit), so rows are not cut at block edges. Each piece
    keeps its own positions (position_ids restart at 0), and its first label is dropped: run alone, a row's first
    token is never a target either, so a block's loss is exactly the sum of its rows' losses. A block is topped up
    to `length` with one padding segment (its own positions, no labels).
    """
    pieces = []
    for ex in examples:
        for i in range(0, len(ex.input_ids), length):
            labels = [IGNORE] + ex.labels[i + 1:i + length]
            if any(label != IGNORE for label in labels):
                pieces.append((ex.input_ids[i:i + length], labels))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, block index), sorted: the first with room >= n is the best fit
    for i in sorted(range(len(pieces)), key=lambda j: -len(pieces[j][0])):
        n = len(pieces[i][0])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            blocks.append([])
            room, b = length, len(blocks) - 1
        else:
            room, b = free.pop(at)
        blocks[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return [_block([pieces[i] for i in members], length, pad_id) for members in blocks]


def _block(pieces: list[tuple[list[int], list[int]]], length: int, pad_id: int) -> Example:
    ids = [t for piece, _ in pieces for t in piece]
    labels = [t for _, piece in pieces for t in piece]
    positions = [p for piece, _ in pieces for p in range(len(piece))]
    segments = [len(piece) for piece, _ in pieces]
    real, pad = len(ids), length - len(ids)
    if pad:
        ids, labels, positions = ids + [pad_id] * pad, labels + [IGNORE] * pad, positions + list(range(pad))
        segments.append(pad)
    return Example(ids, labels, positions, segments, real)


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ex = self.examples[i]
        item: dict[str, Any] = {"input_ids": ex.input_ids, "labels": ex.labels}
        if ex.position_ids is not None:
            item.update(position_ids=ex.position_ids, segments=ex.segments)
        return item


def _collate(pad_id: int):
    def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        labels = torch.tensor([b["labels"] + [IGNORE] * (width - len(b["labels"])) for b in batch])
        labels[:, 0] = IGNORE  # never a target (nothing precedes it); so every way of counting targets agrees
        return {  # right padding: positions start at 0, as after left padding in generation
            "input_ids": torch.tensor([b["input_ids"] + [pad_id] * (width - len(b["input_ids"])) for b in batch]),
            "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (width - len(b["input_ids"]))
                                            for b in batch]),
            "labels": labels,
        }
    return collate


def _collate_packed(varlen: bool):
    """Packed blocks (all the same length): no attention_mask, per-row position_ids; with `varlen`, the rows'
    cumulative lengths over the flattened batch for the packed_varlen attention (worker/packed_attention.py)."""
    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"input_ids": torch.tensor([b["input_ids"] for b in batch]),
               "position_ids": torch.tensor([b["position_ids"] for b in batch]),
               "labels": torch.tensor([b["labels"] for b in batch])}
        if varlen:  # keys only need cu_seq_lens_q (no _k: one tensor less for a compiled layer to guard on)
            cu = torch.tensor([0] + [n for b in batch for n in b["segments"]]).cumsum(0).to(torch.int32)
            out.update(cu_seq_lens_q=cu, max_length_q=out["input_ids"].shape[1])
        return out
    return collate


def split_validation(rows: list[tuple[int, dict[str, Any]]], fraction: float | None, seed: int):
    """(train, validation): rows marked `split: validation`, or a seeded random fraction of the training rows."""
    train = [(line, r) for line, r in rows if r.get("split") != "validation"]
    valid = [(line, r) for line, r in rows if r.get("split") == "validation"]
    if fraction and not valid:
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
        n = max(1, round(len(train) * fraction))
        if n >= len(train):
            raise InvalidInput(f"validation_split={fraction} leaves no training row of {len(train)}: lower it")
        picked = set(order[:n])
        valid = [train[i] for i in sorted(picked)]
        train = [row for i, row in enumerate(train) if i not in picked]
    return train, valid


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
        if name and "lm_head" not in name and (isinstance(module, torch.nn.Linear)
                                              or type(module).__name__ in ("Linear4bit", "Linear8bitLt")):
            names.add(name.rsplit(".", 1)[-1])
    return names


def check_target_modules(model, spec: FinetuneSpec) -> None:
    """Refuse target modules or modules_to_save that the model does not have, naming the ones it has."""
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name}
    if spec.target_modules != "all-linear":
        missing = [m for m in spec.target_modules if m not in leaf_names]
        if missing:
            raise InvalidInput(f"target_modules {missing} do not exist in {spec.model}: its linear layers are "
                               f"{sorted(linear_module_names(model))} (or use 'all-linear')")
    missing = [m for m in spec.modules_to_save or [] if m not in leaf_names]
    if missing:
        raise InvalidInput(f"modules_to_save {missing} do not exist in {spec.model}; e.g. embed_tokens or lm_head")


def lora_config(spec: FinetuneSpec):
    from peft import LoraConfig

    return LoraConfig(r=spec.lora_r, lora_alpha=spec.lora_alpha, lora_dropout=spec.lora_dropout,
                      target_modules=spec.target_modules, modules_to_save=spec.modules_to_save, task_type="CAUSAL_LM")


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
    cannot run raises InvalidInput (before any step); an `auto` that cannot takes the next choice and notes why.

    Under a distributed strategy the loss and compile stay the Trainer's own: the lean loss calls the decoder
    directly, past the DDP/FSDP/DeepSpeed wrapper's forward that those strategies rely on.
    """
    speed = Speed()
    if strategy != "single":
        if spec.liger == "on" or spec.compile == "on":
            raise InvalidInput(f"liger=on and compile=on run with strategy single only (this job runs {strategy}): "
                               "use auto or off")
        speed.notes.append(f"strategy {strategy}: the model's own loss, not compiled")
    else:
        speed.loss = _choose_loss(spec, device, model, speed.notes)
    if spec.packing:
        speed.packed_attention = _choose_attention(spec, device, model, speed.notes)
    cuda = device.type == "cuda"
    speed.compile = strategy == "single" and (spec.compile == "on" or (
        spec.compile == "auto" and cuda and spec.packing and spec.quantization is None))
    if spec.compile == "auto" and cuda and strategy == "single" and not speed.compile:
        speed.notes.append("compile auto: off (it compiles packed training without quantization only: fixed shapes)")
    return speed


def speed_record(speed: Speed, compile_s: float | None) -> dict[str, Any]:
    """What ran, for the job's metrics: loss kernel, packed attention, compile (and its seconds), auto's notes."""
    record = {"loss": speed.loss, "packed_attention": speed.packed_attention, "compile": speed.compile,
              "compile_seconds": None if compile_s is None else round(compile_s, 2)}
    return {**record, "notes": speed.notes} if speed.notes else record


def _apply_speed(speed: Speed, model, mixed: str, spec: FinetuneSpec) -> None:
    from worker import packed_attention

    if speed.packed_attention == "varlen":
        model.get_base_model().set_attn_implementation(packed_attention.register())
    if mixed in ("bf16", "fp16") and spec.quantization is None:
        _no_input_casting(model)


def _fast_args(strategy: str, device: torch.device) -> dict[str, Any]:
    """TrainingArguments for speed on a GPU: fused AdamW (one kernel for every LoRA tensor), TF32 matmuls on
    Ampere+ (only fp32 matmuls change: LoRA weights under autocast are cast to bf16 anyway). CPU: as before."""
    if device.type != "cuda" or strategy != "single":
        return {}
    return {"optim": "adamw_torch_fused", "tf32": torch.cuda.get_device_capability(device)[0] >= 8}


def _compile(speed: Speed, spec: FinetuneSpec, trainer, model, batch: dict[str, Any],
             device: torch.device, progress: Progress) -> float | None:
    """Compile the decoder layers and run the warm-up step (compile time, returned); None when not compiling. With
    compile auto a failure falls back to eager (noted); with compile on it fails the job."""
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
        if spec.compile == "on":
            raise RuntimeError(f"compile=on: torch.compile failed on this model ({type(exc).__name__}: {exc}); "
                               "use compile auto or off") from exc
        speed.compile = False
        speed.notes.append(f"compile auto: off, torch.compile failed ({type(exc).__name__}: {str(exc)[:300]})")
        log.warning("%s: torch.compile failed, training eagerly: %s", spec.model, exc)
        return None


def _lean_loss_problem(model) -> str | None:
    """Why the loss cannot be computed from the decoder's hidden states and lm_head's weight, if it cannot."""
    config = model.config
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) \
            or getattr(config, "logits_scaling", None):
        return f"{type(model).__name__} scales or caps its logits"
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"its lm_head is a {type(head).__name__}, not a plain Linear without bias (e.g. modules_to_save lm_head)"
    return None


def _choose_loss(spec: FinetuneSpec, device: torch.device, model, notes: list[str]) -> str:
    from worker import linear_ce

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    problem = _lean_loss_problem(base)
    if problem:
        if spec.liger == "on":
            raise InvalidInput(f"liger=on cannot run: {problem}. Use liger auto or off")
        notes.append(f"loss: the model's own (all logits), since {problem}")
        return "model"
    if spec.liger == "off":
        return "chunked"
    if spec.liger == "auto" and spec.quantization is not None:
        return "chunked"  # QLoRA upcasts lm_head to fp32; liger was checked on bf16 weights only
    problem = linear_ce.liger_problem(device)
    if problem and spec.liger == "on":
        raise InvalidInput(f"liger=on cannot run: {problem}. Use liger auto or off (our chunked cross-entropy)")
    if problem and device.type == "cuda":
        notes.append(f"liger auto: chunked cross-entropy, since {problem}")
    return "chunked" if problem else "liger"


def _choose_attention(spec: FinetuneSpec, device: torch.device, model, notes: list[str]) -> str:
    from worker import packed_attention

    if spec.packed_attention == "mask":
        return "mask"
    config = model.config
    problem = None
    if spec.attn_implementation not in ("sdpa", "sdpa_gqa"):
        problem = f"it replaces attn_implementation {spec.attn_implementation}"
    elif getattr(config, "attention_dropout", 0.0) or set(getattr(config, "layer_types", None) or ["full_attention"]) \
            != {"full_attention"}:
        problem = "the model has attention dropout or sliding-window layers"
    problem = problem or packed_attention.problem(device)
    if problem and spec.packed_attention == "varlen":
        raise InvalidInput(f"packed_attention=varlen cannot run: {problem}. Use packed_attention auto or mask")
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
        raise InvalidInput(f"compile=on: {type(decoder).__name__} has no `layers` to compile: use compile auto or off")
    # all layers share one code object: room for their guards plus the train and eval variants
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for layer in layers:
        layer.compile()
    return len(layers)


def _uncompile_layers(model) -> None:
    for layer in model.get_base_model().get_decoder().layers:
        layer._compiled_call_impl = None


def _lean_trainer(speed: Speed):
    """A Trainer whose loss comes from the decoder's last hidden states through `linear_ce` (chunked or liger): the
    logits are never materialized. The loss is the sum over target tokens divided by the step's count of them
    (`num_items_in_batch`), so gradient accumulation weighs every token alike and Trainer adds no 1/steps."""
    from transformers import Trainer

    from worker import linear_ce

    class LeanLossTrainer(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.model_accepts_loss_kwargs = True  # our loss is already divided by num_items_in_batch

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            if speed.loss == "model":
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            inputs = dict(inputs)
            labels = inputs.pop("labels")
            if speed.compile and "cu_seq_lens_q" in inputs:  # the row count varies per batch: one dynamic graph
                torch._dynamo.maybe_mark_dynamic(inputs["cu_seq_lens_q"], 0)
            causal = self.accelerator.unwrap_model(model).get_base_model()
            with self.accelerator.autocast():
                hidden = causal.get_decoder()(**inputs, use_cache=False).last_hidden_state
                total, count = linear_ce.causal_lm_loss(hidden, causal.get_output_embeddings().weight, labels,
                                                        kernel=speed.loss, compiled=speed.compile)
            loss = total / (num_items_in_batch if num_items_in_batch is not None else count.clamp_min(1))
            return (loss, {"loss": loss}) if return_outputs else loss

    return LeanLossTrainer


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


# --- training ---------------------------------------------------------------------------------------------------


def _memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"gpu_memory_bytes": int(torch.cuda.memory_allocated(device)),
            "gpu_peak_memory_bytes": int(torch.cuda.max_memory_allocated(device))}


def _callback(*, should_stop: Callable[[], bool], on_log: Callable[[dict[str, Any]], None], device: torch.device,
              tokens_per_step: float, progress: Progress):
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
            if should_stop():
                control.should_training_stop = True
                control.should_save = False

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = dict(logs or {})
            t = time.perf_counter()
            steps = state.global_step - (self.step_last or 0)
            record = {"step": state.global_step, "max_steps": state.max_steps,
                      "epoch": round(state.epoch or 0.0, 4), **_memory(device)}
            for key in ("loss", "learning_rate", "grad_norm", "eval_loss", "train_loss"):
                if key in logs:
                    record[key] = float(logs[key])
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


def finetune(base: LoadOptions, spec: FinetuneSpec, rows: list[tuple[int, dict[str, Any]]], workdir: Path, *,
             gpus: int = 0, should_stop: Callable[[], bool] = lambda: False,
             on_log: Callable[[dict[str, Any]], None] = lambda record: None,
             resume: bool = True, strategy: str = "single", progress: Progress | None = None) -> FinetuneResult:
    """Train a LoRA adapter on `rows` ((line, row) pairs) and save it under `workdir/adapter`.

    Checkpoints go to `workdir/checkpoints`; with `resume`, the newest complete one is picked up. Raises
    InvalidInput for data or settings that cannot train (before any step runs). `result.stopped` is True when
    `should_stop()` ended training early (cancel, shutdown, lost lease): no adapter is saved then. `strategy` is
    `single`, or the distributed strategy of the process group this process is a rank of (worker/distributed.py).
    `progress` receives each step (and the loading and preparing phases) for the stall watchdog.
    """
    from transformers import Trainer, TrainingArguments

    from worker.distributed import training_args

    workdir = Path(workdir)
    checkpoints = workdir / "checkpoints"
    progress = Progress() if progress is None else progress
    with progress.phase("loading model"):
        loaded = load_base(base, gpus)
    progress.begin("preparing training")  # tokenizing, LoRA, the Trainer, compiling: until on_train_begin
    tok, device = loaded.tokenizer, loaded.device
    train_rows, valid_rows = split_validation(rows, spec.validation_split, spec.seed)
    if not train_rows:
        raise InvalidInput("the dataset has no training rows")
    examples, truncated = build_examples(tok, train_rows, spec)
    valid = build_examples(tok, valid_rows, spec)[0] if valid_rows else []
    if spec.packing:
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        examples, valid = pack(examples, spec.max_seq_length, pad), pack(valid, spec.max_seq_length, pad)
        if not examples:
            raise InvalidInput("no training row has a token to learn after its first one (a row's first token is "
                               "never a target): give rows longer completions")
    model = wrap_lora(loaded.model, spec)
    trainable, total = model.get_nb_trainable_parameters()
    mixed = precision(device)
    speed = choose_speed(spec, device, model, strategy)
    _apply_speed(speed, model, mixed, spec)
    resume_from = latest_checkpoint(checkpoints) if resume else None
    real_tokens = sum(e.real_tokens if e.real_tokens is not None else len(e.input_ids) for e in examples)
    tokens_per_step = real_tokens / len(examples) * spec.batch_size * spec.gradient_accumulation
    eval_every = spec.checkpoint_steps if valid else None
    args = TrainingArguments(
        output_dir=str(checkpoints), per_device_train_batch_size=spec.batch_size,
        per_device_eval_batch_size=spec.batch_size, gradient_accumulation_steps=spec.gradient_accumulation,
        learning_rate=spec.learning_rate, lr_scheduler_type=spec.lr_scheduler, warmup_steps=spec.warmup_steps,
        num_train_epochs=spec.epochs, max_steps=spec.max_steps or -1, seed=spec.seed, data_seed=spec.seed,
        bf16=mixed == "bf16", fp16=mixed == "fp16", use_cpu=device.type == "cpu",
        gradient_checkpointing=spec.gradient_checkpointing and spec.quantization is None,
        logging_steps=1, save_strategy="steps", save_steps=spec.checkpoint_steps,
        eval_strategy="steps" if valid else "no", eval_steps=eval_every,
        report_to="none", disable_tqdm=True, dataloader_num_workers=0, remove_unused_columns=False,
        weight_decay=0.0, prediction_loss_only=True, **_fast_args(strategy, device),
        **training_args(strategy, device.type),
    )
    tokens_per_step *= args.world_size  # every process trains on its own batches
    reporter = _callback(should_stop=should_stop, on_log=on_log, device=device, tokens_per_step=tokens_per_step,
                         progress=progress)
    collate = _collate_packed(speed.packed_attention == "varlen") if spec.packing else _collate(tok.pad_token_id)
    trainer = (_lean_trainer(speed) if speed.loss != "model" else Trainer)(
        model=model, args=args, train_dataset=_Dataset(examples), eval_dataset=_Dataset(valid) if valid else None,
        data_collator=collate, callbacks=[reporter])
    if strategy == "fsdp2" and not trainer.is_fsdp_enabled:  # never a quiet fallback to plain data parallel
        raise InvalidInput("strategy fsdp2 did not enable FSDP in this process (accelerate shards only on GPUs)")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compile_s = _compile(speed, spec, trainer, model, collate([_Dataset(examples)[i] for i in
                                                                 range(min(spec.batch_size, len(examples)))]), device,
                        progress)
    log.info("%s: %d examples (%d validation), %d/%d trainable parameters, %s, resume from %s, %s", spec.model,
             len(examples), len(valid), trainable, total, mixed, resume_from, speed_record(speed, compile_s))
    t0 = time.perf_counter()
    output = trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
    seconds = time.perf_counter() - t0
    steps = trainer.state.global_step
    resumed_step = int(CHECKPOINT.match(resume_from.name)[1]) if resume_from else None
    trained_steps = steps - (resumed_step or 0)
    stopped = should_stop() or (trainer.state.max_steps and steps < trainer.state.max_steps)
    metrics = {
        "steps": steps, "max_steps": trainer.state.max_steps, "epoch": round(trainer.state.epoch or 0.0, 4),
        "train_loss": round(float(output.training_loss), 6) if not math.isnan(output.training_loss) else None,
        "final_loss": _last(trainer, "loss"), "eval_loss": _last(trainer, "eval_loss"),
        "train_seconds": round(seconds, 3), "examples": len(examples), "validation_examples": len(valid),
        "truncated_rows": truncated, "trainable_parameters": trainable, "parameters": total,
        "precision": mixed, "device": str(device), "load": loaded.resolved, "packing": spec.packing,
        "speed": {**speed_record(speed, compile_s), "tokens_per_step": round(tokens_per_step, 1),
                  **({"fill": round(real_tokens / (len(examples) * spec.max_seq_length), 4)} if spec.packing else {})},
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
