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
   `on_log`, stops training when `should_stop()` says so, and marks each checkpoint complete.
4. Save the adapter (safetensors) and return the metrics.

Checkpoints are `checkpoint-N` folders written by the Trainer every `checkpoint_steps`; a `COMPLETE` marker is
written into one only after the Trainer finished saving it. A resume takes the newest folder with the marker, so a
folder half-written by a kill during save is skipped (and removed). The Trainer restores optimizer, scheduler and
RNG state, so the resumed run's first logged step is the checkpoint's step + 1 with the loss of an unbroken run.
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

from core.errors import InvalidInput
from core.spec import FinetuneSpec, LoadOptions

log = logging.getLogger(__name__)
COMPLETE = "COMPLETE"  # marker file: the checkpoint folder was fully written
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


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


def pack(examples: list[Example], length: int) -> list[Example]:
    """Concatenate examples and cut the stream into blocks of `length` tokens (labels travel with their tokens)."""
    ids = [t for ex in examples for t in ex.input_ids]
    labels = [t for ex in examples for t in ex.labels]
    blocks = [Example(ids[i:i + length], labels[i:i + length]) for i in range(0, len(ids), length)]
    return [b for b in blocks if any(label != IGNORE for label in b.labels)]


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return {"input_ids": self.examples[i].input_ids, "labels": self.examples[i].labels}


def _collate(pad_id: int):
    def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        return {  # right padding: positions start at 0, as after left padding in generation
            "input_ids": torch.tensor([b["input_ids"] + [pad_id] * (width - len(b["input_ids"])) for b in batch]),
            "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * (width - len(b["input_ids"]))
                                            for b in batch]),
            "labels": torch.tensor([b["labels"] + [IGNORE] * (width - len(b["labels"])) for b in batch]),
        }
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


# --- training ---------------------------------------------------------------------------------------------------


def _memory(device: torch.device) -> dict[str, int]:
    if device.type != "cuda":
        return {}
    return {"gpu_memory_bytes": int(torch.cuda.memory_allocated(device)),
            "gpu_peak_memory_bytes": int(torch.cuda.max_memory_allocated(device))}


def _callback(*, should_stop: Callable[[], bool], on_log: Callable[[dict[str, Any]], None], device: torch.device,
              tokens_per_step: float):
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):
        """Reports each logged step, stops on request, and marks checkpoints complete once saved."""

        def __init__(self):
            self.t_last, self.step_last, self.first_step = time.perf_counter(), None, None

        def on_train_begin(self, args, state, control, **kwargs):
            self.t_last, self.step_last = time.perf_counter(), state.global_step

        def on_step_end(self, args, state, control, **kwargs):
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
            if folder.is_dir():
                (folder / COMPLETE).write_text(f"{state.global_step}\n")

    return Reporter()


def finetune(base: LoadOptions, spec: FinetuneSpec, rows: list[tuple[int, dict[str, Any]]], workdir: Path, *,
             gpus: int = 0, should_stop: Callable[[], bool] = lambda: False,
             on_log: Callable[[dict[str, Any]], None] = lambda record: None,
             resume: bool = True) -> FinetuneResult:
    """Train a LoRA adapter on `rows` ((line, row) pairs) and save it under `workdir/adapter`.

    Checkpoints go to `workdir/checkpoints`; with `resume`, the newest complete one is picked up. Raises
    InvalidInput for data or settings that cannot train (before any step runs). `result.stopped` is True when
    `should_stop()` ended training early (cancel, shutdown, lost lease): no adapter is saved then.
    """
    from transformers import Trainer, TrainingArguments

    workdir = Path(workdir)
    checkpoints = workdir / "checkpoints"
    loaded = load_base(base, gpus)
    tok, device = loaded.tokenizer, loaded.device
    train_rows, valid_rows = split_validation(rows, spec.validation_split, spec.seed)
    if not train_rows:
        raise InvalidInput("the dataset has no training rows")
    examples, truncated = build_examples(tok, train_rows, spec)
    valid = build_examples(tok, valid_rows, spec)[0] if valid_rows else []
    if spec.packing:
        examples, valid = pack(examples, spec.max_seq_length), pack(valid, spec.max_seq_length)
    model = wrap_lora(loaded.model, spec)
    trainable, total = model.get_nb_trainable_parameters()
    mixed = precision(device)
    resume_from = latest_checkpoint(checkpoints) if resume else None
    tokens_per_step = (sum(len(e.input_ids) for e in examples) / len(examples)) * spec.batch_size \
        * spec.gradient_accumulation
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
        weight_decay=0.0,
    )
    reporter = _callback(should_stop=should_stop, on_log=on_log, device=device, tokens_per_step=tokens_per_step)
    trainer = Trainer(model=model, args=args, train_dataset=_Dataset(examples),
                      eval_dataset=_Dataset(valid) if valid else None, data_collator=_collate(tok.pad_token_id),
                      callbacks=[reporter])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    log.info("%s: %d examples (%d validation), %d/%d trainable parameters, %s, resume from %s", spec.model,
             len(examples), len(valid), trainable, total, mixed, resume_from)
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
        "train_tokens_per_s": round(trained_steps * tokens_per_step / seconds, 1) if seconds > 0 else None,
        **({"peak_memory_bytes": int(torch.cuda.max_memory_allocated(device))} if device.type == "cuda" else {}),
    }
    adapter_dir = workdir / "adapter"
    config = model.peft_config["default"].to_dict()
    if not stopped:
        shutil.rmtree(adapter_dir, ignore_errors=True)
        model.save_pretrained(adapter_dir, safe_serialization=True)
        tok.save_pretrained(adapter_dir)
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
