"""`packed_varlen`: attention over packed rows with no attention across rows, registered through `AttentionInterface`.

Packed fine-tunes put several training rows in one block of `max_seq_length` tokens; each row keeps its own positions
(`position_ids` restart at 0). transformers can keep rows apart itself: with position_ids and no attention_mask its
masking code detects the restarts and builds a block-diagonal causal mask (`packed_attention: mask`). For `sdpa` that
is a (batch, 1, seq, seq) boolean mask, which rules out the flash kernel and makes transformers repeat the K/V heads.

This attention (`packed_attention: varlen`) instead runs torch's flash-attention varlen kernel
(`torch.nn.attention.varlen.varlen_attn`, torch 2.10+) once over every row of the batch, from the cumulative row
lengths the collator computes on the CPU (`cu_seq_lens_q`, a keyword argument transformers' own flash-attention
path takes too, passed down to every attention call). No mask is built at all: the name has no
`AttentionMaskInterface` entry, which transformers' masking reads as "this attention needs no mask". `max_length_q`
is the block length, a constant, so a compiled layer never recompiles for it (it only sizes the kernel's grid); the
row count varies per batch, so the fine-tune marks `cu_seq_lens_q`'s length dynamic (one graph for all batches).

varlen_attn's signature moved between torch releases (is_causal → window_size, enable_gqa added); the call is built
from the signature once, and `problem()` checks its numbers (forward and gradients, grouped K/V heads) against SDPA
on a small case before a fine-tune relies on it. On the CPU (tests) the same function computes each row with SDPA:
the same semantics, slowly.
"""

from __future__ import annotations

import inspect
import itertools
from functools import cache

import torch

NAME = "packed_varlen"
_registered = False


def register() -> str:
    """Register `packed_varlen` once per process (idempotent); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, packed_varlen_forward)
        _registered = True
    return NAME


def packed_varlen_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract (query/key/value as (batch, heads, seq, dim), output (batch, seq, heads,
    dim)); causal attention inside each row given by `cu_seq_lens_q` over the flattened batch."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or attention_mask is not None:
        raise ValueError(
            "packed_varlen attention needs cu_seq_lens_q and no attention mask (the fine-tune collator "
            "of packed rows passes them): use attn_implementation sdpa for other inputs"
        )
    if dropout:
        raise ValueError("packed_varlen attention has no attention dropout: set the model's attention_dropout to 0")
    b, heads, s, d = query.shape
    q = query.transpose(1, 2).reshape(b * s, heads, d)
    k = key.transpose(1, 2).reshape(b * s, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * s, value.shape[1], d)
    out = attend(q, k, v, cu, int(kwargs.get("max_length_q") or s), scaling)
    return out.reshape(b, s, heads, d), None


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scaling: float | None
) -> torch.Tensor:
    """Causal attention within each segment [cu[i], cu[i+1]) of (tokens, heads, dim) tensors."""
    flash = _flash
    if flash is None or not q.is_cuda:
        return _per_row_sdpa(q, k, v, cu, scaling)
    kwargs = dict(flash["causal"])
    if scaling is not None and flash["scale"]:
        kwargs["scale"] = scaling
    elif scaling is not None and scaling != q.shape[-1] ** -0.5:
        q = q * (scaling * q.shape[-1] ** 0.5)
    grouped = q.shape[1] != k.shape[1]
    if grouped and not flash["native_gqa"]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    elif grouped and flash["gqa_keyword"]:
        kwargs["enable_gqa"] = True
    return flash["fn"](q, k, v, cu, cu, max_len, max_len, **kwargs)


def _per_row_sdpa(q, k, v, cu, scaling):
    """The CPU (tests) and no-varlen path: one causal SDPA call per row."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    for start, end in itertools.pairwise(bounds):
        if end > start:
            rows = [t[start:end].transpose(0, 1) for t in (q, k, v)]
            out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                *rows, is_causal=True, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]
            ).transpose(0, 1)
    return out


# varlen_attn and the keyword arguments this torch release takes; set by problem() (outside any compiled region, so
# a compiled layer reads a plain module global)
_flash: dict | None = None


def _flash_call() -> dict | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return {
        "fn": varlen_attn,
        "causal": {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True},
        "scale": "scale" in params,
        "gqa_keyword": "enable_gqa" in params,
        "native_gqa": True,
    }


def problem(device: torch.device) -> str | None:
    """None if the varlen kernel runs on `device` and matches per-row SDPA (output and gradients, with grouped K/V
    heads as Qwen3 has); else why not. Cached per device; must run before a fine-tune uses `packed_varlen`."""
    return _problem(str(device))


@cache
def _problem(device: str) -> str | None:
    global _flash
    if not device.startswith("cuda"):
        return "the varlen kernel runs on CUDA only (this fine-tune runs on the CPU)"
    flash = _flash_call()
    if flash is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10+)"
    if torch.cuda.get_device_capability(torch.device(device))[0] < 8:
        return "the varlen flash kernel needs compute capability 8.0 or newer"
    _flash = flash
    first = _check(device)
    if first is None:
        return None
    flash["native_gqa"] = False  # an older kernel may want as many K/V heads as query heads: try with them repeated
    second = _check(device)
    if second is None:
        return None
    _flash = None
    return f"{first}; with K/V heads repeated: {second}"


def _check(device: str) -> str | None:
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        shape = {"q": (300, 8, 64), "kv": (300, 2, 64)}
        q, k, v = (
            torch.randn(
                shape["q" if n == "q" else "kv"], device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True
            )
            for n in ("q", "k", "v")
        )
        cu = torch.tensor([0, 100, 130, 300], device=device, dtype=torch.int32)
        got = attend(q, k, v, cu, 256, None)
        want = _per_row_sdpa(q, k, v, cu, None)
        grads_got = torch.autograd.grad(got.float().square().sum(), (q, k, v))
        grads_want = torch.autograd.grad(want.float().square().sum(), (q, k, v))
        worst = max(_rel(a, b) for a, b in zip((got, *grads_got), (want, *grads_want)))
        if worst > 0.05:
            return f"varlen attention disagrees with SDPA (relative difference {worst:.3f})"
    except Exception as exc:  # noqa: BLE001  any failure means: not usable here, and why
        return f"varlen attention fails here: {type(exc).__name__}: {str(exc)[:300]}"
    return None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))
