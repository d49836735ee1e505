"""Can this worker run this spec? Checked at submit against every live worker's registration, so a job that no
worker could run is refused at once with what is missing, instead of failing on a GPU at night.

Nothing falls back silently: a backend that is missing is a refusal, never a quiet switch to `sdpa`.
"""

from __future__ import annotations

from typing import Any

from core.spec import LoadOptions

BUILTIN_ATTENTION = ("sdpa", "eager", "flex_attention")


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
    return problems
