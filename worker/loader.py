"""Load a model the way a job's spec asks: dtype, attention backend, quantization, device map, adapter.

Every resolved choice is returned and recorded on the job; nothing falls back silently. transformers itself never
reaches the Hub (`local_files_only`): a Hub id is read from its snapshot folder in this host's Hugging Face cache,
fetched and verified before the load by worker/hubfetch.py (core/hub_download.py), and recorded with its commit. Safetensors
only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.errors import InvalidInput, JobsError
from core.spec import LoadOptions
from worker import faults, hubfetch

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Loaded:
    model: Any
    tokenizer: Any
    device: torch.device
    resolved: dict[str, Any]


def resolve_dtype(name: str, on_gpu: bool) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if not on_gpu:
        return torch.float32
    major, _ = torch.cuda.get_device_capability(0)
    return torch.bfloat16 if major >= 8 else torch.float16


def resolve_device_map(opts: LoadOptions, gpus: int) -> str:
    on_gpu = gpus > 0 and torch.cuda.is_available()
    if gpus > 0 and not torch.cuda.is_available():
        raise InvalidInput(
            f"the job asks for {gpus} GPU(s) but this worker sees no CUDA device "
            "(check the worker's --gpus and CUDA_VISIBLE_DEVICES)"
        )
    wanted = opts.device_map or ("cuda" if on_gpu else "cpu")
    if wanted in ("cuda", "auto") and not on_gpu:
        raise InvalidInput(f"device_map={wanted!r} needs a GPU slice: submit with --gpus 1 or device_map cpu")
    return wanted


def quantization_config(opts: LoadOptions, dtype: torch.dtype):
    q = opts.quantization
    if q is None:
        return None
    compute = dtype if q.compute_dtype == "auto" else DTYPES[q.compute_dtype]
    if q.method.startswith("bnb-"):
        from transformers import BitsAndBytesConfig

        if q.method == "bnb-8bit":
            return BitsAndBytesConfig(load_in_8bit=True)
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=q.quant_type,
            bnb_4bit_use_double_quant=q.double_quant,
            bnb_4bit_compute_dtype=compute,
        )
    if q.method.startswith("torchao-"):
        from torchao.quantization import Float8WeightOnlyConfig, Int4WeightOnlyConfig, Int8WeightOnlyConfig
        from transformers import TorchAoConfig

        config = {
            "torchao-int8": Int8WeightOnlyConfig,
            "torchao-int4": Int4WeightOnlyConfig,
            "torchao-float8": Float8WeightOnlyConfig,
        }[q.method]()
        return TorchAoConfig(quant_type=config)
    from transformers import FineGrainedFP8Config

    return FineGrainedFP8Config()


def _quant_record(opts: LoadOptions) -> dict[str, Any] | None:
    """The quantization that ran, with only the options that apply to its method."""
    q = opts.quantization
    if q is None:
        return None
    if q.method == "bnb-4bit":
        return q.model_dump()
    return {"method": q.method} | ({"compute_dtype": q.compute_dtype} if q.method.startswith("bnb") else {})


def load(opts: LoadOptions, *, gpus: int) -> Loaded:
    """The model and tokenizer as `opts` asks, on this worker's slice. Out of memory while loading raises
    torch.OutOfMemoryError with a message naming the model and the memory free (a failed attempt: the shard is
    retried, and fails after JOBS_MAX_ATTEMPTS with that message)."""
    try:
        faults.hit("load")
        return _load(opts, gpus=gpus)
    except torch.OutOfMemoryError as exc:
        adapter = f" with adapter {opts.adapter}" if opts.adapter else ""
        raise torch.OutOfMemoryError(
            f"out of memory loading {opts.model}{adapter} ({_free_memory()}): a smaller model, quantization, or a "
            f"slice with more GPU memory (device_map auto) would fit. {exc}"
        ) from exc


def _free_memory() -> str:
    if not torch.cuda.is_available():
        return "on the CPU"
    parts = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        parts.append(f"cuda:{i} {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    return ", ".join(parts)


def _load(opts: LoadOptions, *, gpus: int) -> Loaded:
    if opts.use_kernels or opts.kernel_config:
        raise InvalidInput("use_kernels needs the `kernels` package and Hub access, which this worker lacks")
    device_map = resolve_device_map(opts, gpus)
    on_gpu = device_map != "cpu"
    dtype = resolve_dtype(opts.dtype, on_gpu)
    source = hubfetch.model_path(opts)  # a Hub id's verified snapshot folder, or the local directory
    kwargs: dict[str, Any] = dict(
        revision=None if source != opts.model else opts.revision,
        dtype=dtype,
        attn_implementation=opts.attn_implementation,
        device_map=device_map,
        trust_remote_code=opts.trust_remote_code,
        use_safetensors=True,
        local_files_only=True,
    )
    quant = quantization_config(opts, dtype)
    if quant is not None:
        kwargs["quantization_config"] = quant
    if opts.attn_implementation == "sdpa_gqa":
        from worker import attention

        attention.register()  # our AttentionInterface entry (worker/attention.py) must exist before loading
    try:
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=kwargs["revision"], local_files_only=True, trust_remote_code=opts.trust_remote_code
        )
    except OSError as exc:
        raise InvalidInput(f"cannot load model {opts.model!r}: {exc}") from exc
    adapter = apply_adapter(model, opts) if opts.adapter else None
    if adapter is not None:
        model = adapter.pop("model")
    model.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    device = next(model.parameters()).device
    resolved = {
        "model": opts.model,
        "revision": opts.revision,
        "dtype": str(dtype).removeprefix("torch."),
        "attn_implementation": model.config._attn_implementation,
        "device_map": device_map,
        "device": str(device),
        "devices": _devices(model),
        "quantization": _quant_record(opts),
        "adapter": adapter,
        "use_kernels": opts.use_kernels,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    if hubfetch.hub_record(opts):
        resolved["hub"] = hubfetch.hub_record(opts)  # repo, commit, endpoint, host and cache it was read from
    log.info("loaded %s: %s", opts.model, resolved)
    return Loaded(model, tokenizer, device, resolved)


def _devices(model: Any) -> list[str]:
    """Where the weights are: with device_map auto, every GPU of the slice that got layers (cuda:0 = the slice's
    first GPU, in its order); else the one device."""
    placed = getattr(model, "hf_device_map", None) or {"": next(model.parameters()).device}
    names = {f"cuda:{d}" if isinstance(d, int) else str(d) for d in placed.values()}
    return sorted(names)


def adapter_path(ref: str, revision: str | None = None) -> Path:
    """The adapter's folder for `ref`: a fine-tune job id (its registered folder), a stored file id (extracted
    once per file into the artifacts store, `core.adapters.extract_file`), or a Hub LoRA repo (its verified snapshot
    in this host's cache, fetched by hubfetch.prepare); the submit checked owner and base."""
    from core import adapters, files, hub, hub_download
    from core.db import session_scope
    from core.models import Adapter, File

    if hub.is_hub_id(ref):
        return hub_download.ensure(ref, revision, kind="adapter").path
    with session_scope() as session:
        if adapters.is_file_ref(ref):
            file = session.get(File, ref)
            if file is None:
                raise InvalidInput(f"adapter file {ref} no longer exists: upload the adapter again and resubmit")
            if not adapters.file_dir(file.id).is_dir():
                _on_this_host(files.absolute(file), f"adapter file {ref}")
            return adapters.extract_file(file)
        row = session.get(Adapter, ref)
        if row is None:
            raise InvalidInput(
                f"adapter {ref!r} is not registered (its fine-tune has not succeeded): list adapters "
                "with `gpujobs adapters list`"
            )
        return _on_this_host(adapters.absolute(row), f"adapter {ref}")


def _on_this_host(path: Path, what: str) -> Path:
    """`path`, a stored artifact the store lists, if this host sees it. If not, this worker's JOBS_ARTIFACTS is not
    the directory every host mounts (docs/cluster.md): the worker's fault, not the job's, so a plain error (the
    attempt fails and is retried, perhaps on a worker that sees it) rather than InvalidInput (the rows fail)."""
    from core.hub import host
    from core.settings import get_settings

    if path.exists():
        return path
    artifacts = get_settings().artifacts
    raise JobsError(
        f"{what} is stored, but not in this worker's artifacts directory {artifacts} on host {host()} "
        f"(no {path}): set JOBS_ARTIFACTS on every worker to the artifacts directory all hosts mount, the one the "
        "API stores into (docs/cluster.md), restart this worker, then `gpujobs retry` the job"
    )


def apply_adapter(model: Any, opts: LoadOptions) -> dict[str, Any]:
    """Load the LoRA adapter onto the base. Unquantized, it is merged (`merge_and_unload`): the engine then runs a
    plain transformers model at full speed. On a quantized base it stays a PeftModel (merging would dequantize)."""
    from peft import PeftConfig, PeftModel

    from core import adapters

    path = adapter_path(opts.adapter, opts.adapter_revision)
    try:
        config = PeftConfig.from_pretrained(str(path))
        config.init_lora_weights = False  # every tensor comes from the file (checked below): no init runs on the base
        peft_model = PeftModel.from_pretrained(model, str(path), is_trainable=False, config=config)
    except torch.OutOfMemoryError:
        raise  # a RuntimeError too, but no fault of the adapter's: a failed attempt, retried
    except (OSError, ValueError, RuntimeError) as exc:
        raise InvalidInput(f"adapter {opts.adapter} does not load onto {opts.model}: {exc}") from exc
    _check_complete(peft_model, path, opts)
    merged = opts.quantization is None
    source = "file" if adapters.is_file_ref(opts.adapter) else "finetune" if opts.adapter.startswith("job_") else "hub"
    return {
        "id": opts.adapter,
        "source": source,
        "path": str(path),
        "sha256": adapters.digest(path)[1],
        "merged": merged,
        **({"revision": opts.adapter_revision} if source == "hub" else {}),
        "model": peft_model.merge_and_unload() if merged else peft_model,
    }


def _check_complete(peft_model: Any, path: Path, opts: LoadOptions) -> None:
    """PEFT only warns when the file lacks weights for LoRA modules it created (an adapter of another model whose
    config happens to name modules this one has): those would run as untrained no-ops, so the job fails instead."""
    from peft.utils import get_peft_model_state_dict, load_peft_weights

    expected = set(get_peft_model_state_dict(peft_model))
    missing = sorted(expected - set(load_peft_weights(str(path), device="cpu")))
    if missing:
        raise InvalidInput(
            f"adapter {opts.adapter} does not fit {opts.model}: its weights lack {len(missing)} of the "
            f"{len(expected)} LoRA tensors its config asks for (e.g. {missing[0]}); it was trained on "
            "another model: use that base, or train an adapter on this one"
        )
