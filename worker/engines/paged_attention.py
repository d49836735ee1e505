"""The attention the fast engine puts in transformers' models (`gpujobs_fast`, registered through
`AttentionInterface`): it reads and writes the paged KV cache of the step the engine is running.

worker/engines/fastgen.py keeps the model a transformers model and replaces only its attention: while it runs a
prefill or a decode step it sets the model's `_attn_implementation` to `NAME` and the running `Step` here
(`running`), and every decoder layer calls `fast_attention` with its layer index:

- **prefill** writes the K/V of the chunk's prompts into their pages (`Step.pages`: the page of each position of
  each row; `decode_attention.write_prefill`, one Triton kernel under `PREFILL_WRITE`), then runs causal SDPA over
  them (FlashAttention on CUDA in half precision, `_prefill_backend`), after the rows' shared prefix pages when a
  cached prompt prefix is reused (`Step.prefix`, lower-right causal);
- **decode** writes each slot's one new K/V at `write_page`/`write_offset` of the state and attends over each
  slot's real length only (worker/engines/decode_attention.py: a Triton kernel over the pages on CUDA, which also
  does the write under `FOLD_WRITE`), with `Step.cascade` reading the pages many rows share once for all of them.

A quantized cache (`state.scales` set: `kv_cache_dtype: fp8` or `int8`) is written quantized, a scale per position
and head, and read dequantized (decode_attention's docstring). The prefill attends over the dequantized values too,
its own chunk's as well as a reused prefix's, so an output does not depend on whether its prefix came from the
cache.

The function runs outside the compiled layers (`torch.compiler.disable`, wrapped at `register`), so it reads the
running step from this module at call time. The cache and the slot inputs are the resident state's
(worker/engines/slot_state.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from worker.engines import decode_attention
from worker.engines.decode_attention import PAGE, read_pages, write_prefill

if TYPE_CHECKING:
    from worker.engines.slot_state import SlotState

NAME = "gpujobs_fast"

_step: Step | None = None  # what the attention function reads during a forward of the fast engine
_registered = None  # fast_attention as registered (wrapped by torch.compiler.disable)


@dataclass
class Step:
    """The step being run: what `fast_attention` reads and writes."""

    mode: str  # "prefill" or "decode"
    state: SlotState
    pages: torch.Tensor | None = None  # prefill: (rows, width) the page of each position of each row
    splits: int = 1
    prefix: torch.Tensor | None = None  # prefill after a shared prefix: (rows, prefix pages) of each row's table
    cascade: bool = False  # decode: the state's shared pages are read once for all rows (decode_attention)


@contextlib.contextmanager
def running(step: Step) -> Iterator[None]:
    """Every forward inside runs `step`: the attention reads its cache and pages."""
    global _step
    _step = step
    try:
        yield
    finally:
        _step = None


def fast_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention contract (q/k/v as (batch, heads, seq, dim), output (batch, seq, heads, dim)),
    reading and writing the paged cache of the running step."""
    step = _step
    if step is None:
        raise RuntimeError(f"attention {NAME!r} runs only inside the fast engine: load the model with sdpa")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    state = step.state
    layer = module.layer_idx
    k_cache, v_cache = state.cache[0, layer], state.cache[1, layer]
    k_scales, v_scales = (None, None) if state.scales is None else (state.scales[0, layer], state.scales[1, layer])
    if step.mode == "prefill":
        length = key.shape[2]
        at = (step.pages[:, :length], state.offsets[:length])
        # attend over what the cache holds (a quantized cache: the values dequantized), as a later prefill that reuses
        # these pages will: outputs do not depend on whether a prefix came from the cache
        key = write_prefill(k_cache, k_scales, *at, key.transpose(1, 2)).transpose(1, 2)  # as (rows, length, ...)
        value = write_prefill(v_cache, v_scales, *at, value.transpose(1, 2)).transpose(1, 2)
        causal: Any = True
        if step.prefix is not None:  # the rows' shared prefix pages come first: (rows, kv_heads, prefix, dim)
            key = torch.cat((_gather(k_cache, step.prefix, k_scales, key.dtype), key), dim=2)
            value = torch.cat((_gather(v_cache, step.prefix, v_scales, value.dtype), value), dim=2)
            causal = causal_lower_right(query.shape[2], key.shape[2])  # query i sees keys up to prefix + i
        with _prefill_backend(query):
            out = torch.nn.functional.scaled_dot_product_attention(
                query,
                key,
                value,
                attn_mask=None if causal is True else causal,
                is_causal=causal is True,
                scale=scale,
                enable_gqa=query.shape[1] != key.shape[1],
            )
        return out.transpose(1, 2), None
    batch = query.shape[0]
    new = (key[:, :, 0], value[:, :, 0], state.write_page[:batch], state.write_offset[:batch])  # written first
    cascade = (state.shared, state.shared_n, state.start[:batch]) if step.cascade else None
    out = decode_attention.decode(
        query[:, :, 0],
        k_cache,
        v_cache,
        state.table[:batch],
        state.lengths[:batch],
        scale,
        step.splits,
        cascade,
        k_scales,
        v_scales,
        new,
    )
    return out[:, None], None


def _gather(cache: torch.Tensor, pages: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The K or V of `pages` (rows, n) of one layer's cache (pages, kv_heads, PAGE, dim) as (rows, kv_heads,
    n * PAGE, dim), positions in order (quantized pages dequantized into `dtype`)."""
    rows, n = pages.shape
    got = read_pages(cache, pages, scales, dtype)  # (rows, n, kv_heads, PAGE, dim)
    return got.permute(0, 2, 1, 3, 4).reshape(rows, got.shape[2], n * PAGE, got.shape[4])


def causal_lower_right(queries: int, keys: int):
    from torch.nn.attention.bias import causal_lower_right as bias

    return bias(queries, keys)


def _prefill_backend(query: torch.Tensor):
    """The prefill's attention runs FlashAttention on CUDA in half precision. SDPA's default there is cuDNN, which
    builds an execution plan on the host for every new shape: a prefill chunk's width is its longest prompt, so a
    job of mixed lengths met a new shape per chunk and paid ~2 s of plan building on G2 (py-spy in the worker,
    ops/bench/results/2026-12-04-h200-diagnose; a warm engine rerun on the same shapes did not)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and query.shape[-1] <= 256:
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    return contextlib.nullcontext()


def register() -> str:
    """Register `gpujobs_fast` in transformers' AttentionInterface (not in the mask interface: the model then
    builds no mask at all, which this attention does not need)."""
    from transformers import AttentionInterface

    # left out of the compiled layers (fastgen.COMPILE) as an opaque call; wrapped here, not at import, because
    # torch.compiler.disable imports torch._dynamo (1.3 s), which a worker that never runs this engine need not pay
    global _registered
    if _registered is None:  # once: compiled layers guard on the function object they call
        _registered = torch.compiler.disable(fast_attention)
        AttentionInterface.register(NAME, _registered)
    return NAME
