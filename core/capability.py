"""Can this worker run this spec? Checked at submit against every live worker's registration, so a job that no
worker could run is refused at once with what is missing, instead of failing on a GPU at night.

Nothing falls back silently: a backend that is missing is a refusal, never a quiet switch to `sdpa`.
"""

from __future__ import annotations

from typing import Any

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
            problems.append(f"attention kernel {attn!r} comes from the Hub: needs the `kernels` package and Hub "
                            "access, and the worker is offline" if versions.get("kernels") else
                            f"attention kernel {attn!r} needs the `kernels` package")
        else:
            problems.append(f"{attn} needs the flash-attn package ({'installed' if versions.get('flash-attn') else 'missing'})"
                            f" and an Ampere or newer GPU (worker has {'compute capability ' + str(cc) if cc else 'no GPU'})")
    if opts.use_kernels or opts.kernel_config:
        problems.append("use_kernels needs the `kernels` package and Hub access" if not versions.get("kernels")
                        else "use_kernels fetches kernels from the Hub, and the worker is offline")
    q = opts.quantization
    if q is not None:
        if q.method.startswith("bnb-") and not versions.get("bitsandbytes"):
            problems.append(f"{q.method} needs bitsandbytes (pip install bitsandbytes)")
        if q.method.startswith("torchao-") and not versions.get("torchao"):
            problems.append(f"{q.method} needs torchao (pip install torchao)")
        if q.method in ("torchao-float8", "fp8") and not (cc and cc >= 8.9):
            problems.append(f"{q.method} needs a GPU of compute capability 8.9 or newer (worker has "
                            f"{'compute capability ' + str(cc) if cc else 'no GPU'})")
        if q.method == "fp8" and not versions.get("kernels"):
            problems.append("fp8 (FineGrainedFP8Config) needs the `kernels` package and Hub access")
    if opts.device_map in ("cuda", "auto") and gpus == 0:
        problems.append(f"device_map={opts.device_map!r} needs a GPU slice (gpus >= 1)")
    problems += _engine_problems(opts, gpus)
    problems += _finetune_problems(opts, caps)
    return problems


def _finetune_problems(opts: LoadOptions, caps: dict[str, Any]) -> list[str]:
    """A fine-tune needs peft; QLoRA needs bitsandbytes 4-bit working on the worker's device (probed after it
    registers: `qlora` in its capabilities)."""
    if getattr(opts, "kind", None) != "finetune":
        return []
    problems = []
    if not (caps.get("versions") or {}).get("peft"):
        problems.append("fine-tunes need peft (pip install peft)")
    q = opts.quantization
    if q is not None and q.method == "bnb-4bit" and (caps.get("versions") or {}).get("bitsandbytes"):
        qlora = caps.get("qlora")
        if qlora is None:
            problems.append("its bitsandbytes 4-bit probe has not finished yet (it runs just after the worker "
                            "starts): submit again in a few seconds")
        elif not qlora.get("ok"):
            problems.append(f"QLoRA (bnb-4bit) cannot run: {qlora.get('reason')}")
    return problems


def _engine_problems(opts: LoadOptions, gpus: int) -> list[str]:
    """Engine options (generation specs only) that no worker of this slice size can honour."""
    problems = []
    engine = getattr(opts, "engine", None)
    attn = opts.attn_implementation.removeprefix("paged|")
    if engine == "continuous" and attn in ("flex_attention", "sdpa_gqa"):
        problems.append(f"engine continuous cannot run {attn} (transformers' continuous batching takes sdpa, "
                        "eager or flash attention): use engine padded or another attn_implementation")
    if engine == "static" and opts.attn_implementation not in ("sdpa", "sdpa_gqa", "eager"):
        problems.append(f"engine static cannot run {opts.attn_implementation} (it runs sdpa, sdpa_gqa or eager with "
                        "a static KV cache): use engine padded or one of those attn_implementations")
    for knob in ("cuda_graphs", "async_batching"):
        if getattr(opts, knob, None) == "on" and gpus == 0:
            problems.append(f"{knob}=on needs a GPU slice (gpus >= 1); use auto or off on CPU")
        if getattr(opts, knob, None) == "on" and engine != "continuous":
            problems.append(f"{knob}=on applies to engine continuous only: set engine continuous")
    return problems
