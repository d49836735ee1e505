"""Can this worker run this spec? Checked at submit against every live worker's registration, so a job that no
worker could run is refused at once with what is missing, instead of failing on a GPU at night.

Nothing falls back silently: a backend that is missing is a refusal, never a quiet switch to `sdpa`.
"""

from __future__ import annotations

from typing import Any

from core.errors import InvalidInput
from core.slices import plan
from core.spec import LoadOptions

BUILTIN_ATTENTION = ("sdpa", "sdpa_gqa", "eager", "flex_attention")


def missing(opts: LoadOptions, caps: dict[str, Any], gpus: int) -> list[str]:
    """What `caps` (a worker's registered capabilities) lacks to load `opts` on a slice of `gpus` GPUs."""
    versions = caps.get("versions") or {}
    cc = caps.get("min_compute_capability")
    problems: list[str] = []
    attn = opts.attn_implementation.removeprefix("paged|")
    if attn not in BUILTIN_ATTENTION and attn not in caps.get("attention", []):
        if "/" in attn:
            problems.append(
                f"attention kernel {attn!r} comes from the Hub: needs the `kernels` package and Hub "
                "access, and the worker is offline"
                if versions.get("kernels")
                else f"attention kernel {attn!r} needs the `kernels` package"
            )
        else:
            problems.append(
                f"{attn} needs the flash-attn package ({'installed' if versions.get('flash-attn') else 'missing'})"
                f" and an Ampere or newer GPU (worker has {'compute capability ' + str(cc) if cc else 'no GPU'})"
            )
    if attn == "flex_attention":
        problems += _flex_problems(caps)
    if opts.use_kernels or opts.kernel_config:
        problems.append(
            "use_kernels needs the `kernels` package and Hub access"
            if not versions.get("kernels")
            else "use_kernels fetches kernels from the Hub, and the worker is offline"
        )
    q = opts.quantization
    if q is not None:
        if q.method.startswith("bnb-") and not versions.get("bitsandbytes"):
            problems.append(f"{q.method} needs bitsandbytes (pip install bitsandbytes)")
        if q.method.startswith("torchao-") and not versions.get("torchao"):
            problems.append(f"{q.method} needs torchao (pip install torchao)")
        if q.method in ("torchao-float8", "fp8") and not (cc and cc >= 8.9):
            problems.append(
                f"{q.method} needs a GPU of compute capability 8.9 or newer (worker has "
                f"{'compute capability ' + str(cc) if cc else 'no GPU'})"
            )
        if q.method == "fp8" and not versions.get("kernels"):
            problems.append("fp8 (FineGrainedFP8Config) needs the `kernels` package and Hub access")
    if getattr(opts, "kv_cache_dtype", "auto") == "fp8" and cc and cc < 8.9:
        problems.append(
            f"kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper: Triton's fp8 type), "
            f"and the worker has compute capability {cc}: use kv_cache_dtype int8 or auto"
        )
    if opts.device_map in ("cuda", "auto") and gpus == 0:
        problems.append(f"device_map={opts.device_map!r} needs a GPU slice (gpus >= 1)")
    problems += _engine_problems(opts, gpus)
    problems += _finetune_problems(opts, caps)
    problems += _slice_problems(opts, caps, gpus)
    return problems


def _flex_problems(caps: dict[str, Any]) -> list[str]:
    """flex_attention is compiled (torch.compile: a C++ compiler on the CPU, Triton on CUDA): each worker probes it
    after it registers (`flex_attention` in its capabilities; a registration without it predates the probe)."""
    probe = caps.get("flex_attention")
    if probe is None or probe.get("ok"):
        return []
    if probe.get("ok") is None:
        return [
            "its flex_attention compile probe has not finished yet (it runs just after the worker starts; the "
            "first compile on a CPU takes up to a minute): submit again shortly"
        ]
    return [f"{probe.get('reason')}: use attn_implementation sdpa or eager"]


def _slice_problems(opts: LoadOptions, caps: dict[str, Any], gpus: int) -> list[str]:
    """How a job uses a slice of several GPUs: a fine-tune's strategy (core/slices.py) and DeepSpeed's package; a
    generation's tp_plan, which the workers do not run yet (docs/design.md 'Several GPUs')."""
    if getattr(opts, "tp_plan", None):
        if gpus < 2:
            return [f"tp_plan {opts.tp_plan} needs a slice of 2 or more GPUs (gpus >= 2), this one has {gpus}"]
        return [
            "tp_plan auto (tensor parallel under torchrun) is not supported by the workers yet: use device_map "
            "auto to split the model over the slice, or one 1-GPU worker per GPU for data-parallel generation"
        ]
    strategy = getattr(opts, "strategy", None)
    if strategy is None:
        return []
    try:
        strategy, _ = plan(
            strategy, opts.nproc, gpus=gpus, device_map=opts.device_map, quantized=opts.quantization is not None
        )
    except InvalidInput as exc:
        return [str(exc)]
    if strategy.startswith("deepspeed") and not (caps.get("versions") or {}).get("deepspeed"):
        return [
            f"strategy {strategy} needs the deepspeed package on the worker (pip install deepspeed), and it is "
            "missing: use ddp or fsdp2"
        ]
    return []


def _finetune_problems(opts: LoadOptions, caps: dict[str, Any]) -> list[str]:
    """A fine-tune needs peft; QLoRA needs bitsandbytes 4-bit working on the worker's device (probed after it
    registers: `qlora` in its capabilities)."""
    if getattr(opts, "kind", None) != "finetune":
        return []
    problems = []
    if not (caps.get("versions") or {}).get("peft"):
        problems.append("fine-tunes need peft (pip install peft)")
    problems += _finetune_speed_problems(opts, caps)
    q = opts.quantization
    if q is not None and q.method == "bnb-4bit" and (caps.get("versions") or {}).get("bitsandbytes"):
        qlora = caps.get("qlora")
        if qlora is None:
            problems.append(
                "its bitsandbytes 4-bit probe has not finished yet (it runs just after the worker "
                "starts): submit again in a few seconds"
            )
        elif not qlora.get("ok"):
            problems.append(f"QLoRA (bnb-4bit) cannot run: {qlora.get('reason')}")
    return problems


def _finetune_speed_problems(opts: LoadOptions, caps: dict[str, Any]) -> list[str]:
    """Speed levers asked for explicitly (`on`, `varlen`) that this worker cannot honour; `auto` never refuses."""
    problems = []
    cuda = bool(caps.get("cuda_available"))
    if getattr(opts, "liger", None) == "on" and not ((caps.get("versions") or {}).get("liger-kernel") and cuda):
        problems.append(
            "liger=on needs the liger-kernel package and a GPU (worker has "
            f"{'liger-kernel' if (caps.get('versions') or {}).get('liger-kernel') else 'no liger-kernel'}"
            f", {'a GPU' if cuda else 'no GPU'}): pip install liger-kernel on a GPU worker, or use "
            "liger auto/off (off: our chunked cross-entropy, same result)"
        )
    if getattr(opts, "packed_attention", None) == "varlen" and not caps.get("varlen_attention"):
        problems.append(
            "packed_attention=varlen needs a GPU of compute capability 8.0 or newer and a torch with "
            "torch.nn.attention.varlen (2.10+): use packed_attention auto or mask"
        )
    return problems


def _engine_problems(opts: LoadOptions, gpus: int) -> list[str]:
    """Engine options (generation specs only) that no worker of this slice size can honour."""
    problems = []
    engine = getattr(opts, "engine", None)
    attn = opts.attn_implementation.removeprefix("paged|")
    paged = opts.attn_implementation.startswith("paged|")
    if paged and engine == "padded":  # it would run the plain backend: nothing falls back silently
        problems.append(
            f"engine padded cannot run {opts.attn_implementation} (paged attention is the attention of "
            f"transformers' continuous batching, engine continuous): use engine continuous (or auto, which "
            f"runs paged attention there), or attn_implementation {attn}"
        )
    if (engine == "continuous" or paged and engine == "auto") and attn in ("flex_attention", "sdpa_gqa"):
        problems.append(
            f"engine continuous cannot run {attn} (transformers' continuous batching takes sdpa, "
            "eager or flash attention): use engine padded or another attn_implementation"
        )
    if engine == "fast" and opts.attn_implementation not in ("sdpa", "sdpa_gqa", "eager"):
        problems.append(
            f"engine fast cannot honour {opts.attn_implementation} (it replaces the attention with its "
            "own slot-cache kernel): use attn_implementation sdpa, or engine padded for that kernel"
        )
    if engine == "static" and opts.attn_implementation not in ("sdpa", "sdpa_gqa", "eager"):
        problems.append(
            f"engine static cannot run {opts.attn_implementation} (it runs sdpa, sdpa_gqa or eager with "
            "a static KV cache): use engine padded or one of those attn_implementations"
        )
    kv = getattr(opts, "kv_cache_dtype", "auto")
    if kv != "auto" and (engine not in ("auto", "fast") or paged):
        problems.append(
            f"kv_cache_dtype {kv} is the fast engine's cache, and engine {engine} "
            f"{'with ' + opts.attn_implementation + ' ' if paged else ''}does not run the fast engine: use engine "
            "fast or auto (and attn_implementation sdpa), or kv_cache_dtype auto"
        )
    if kv != "auto" and engine == "auto" and gpus == 0:
        problems.append(
            f"kv_cache_dtype {kv} is the fast engine's cache, and on a CPU slice engine auto runs padded: set "
            "engine fast (it runs on CPU too), or kv_cache_dtype auto"
        )
    for knob in ("cuda_graphs", "async_batching"):
        if getattr(opts, knob, None) == "on" and gpus == 0:
            problems.append(f"{knob}=on needs a GPU slice (gpus >= 1); use auto or off on CPU")
        if getattr(opts, knob, None) == "on" and engine != "continuous":
            problems.append(f"{knob}=on applies to engine continuous only: set engine continuous")
    return problems
