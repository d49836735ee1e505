"""The fast engine's resident state and its sizing: the paged KV cache, the page table and the per-slot decode
inputs (`SlotState`), made once per model and kept on it between jobs (`model._gpujobs_fast`), so the next job
starts decoding at once; other engines call `release()` first to give its memory back.

- **The cache.** One preallocated tensor holds K and V of every layer in pages of `PAGE` positions:
  (2, layers, pages, kv_heads, PAGE, head_dim). Page 0 is a trash page: free slots point at it. Each slot (a place
  in the decode batch) has a row of the page table, `max_len` positions wide.
- **Its element type** (`kv_cache_dtype`, a job's spec field): `auto`, the model's dtype; `fp8` (float8 e4m3) or
  `int8`, with a float32 scale per position and head beside it (`scales`, decode_attention's docstring): 132 bytes
  per position and head instead of 256 at head_dim 128 in bf16, so about twice the pages fit and a decode step
  reads half. A job asking for another type than the resident state's gets a new state (`state_for`); the compiled
  layers carry over (the attention they call reads the cache, they do not).
- **Its size** (`size`): `MAX_SLOTS` slots and as many pages as the worker's share of the GPU leaves
  (`cache_budget`: JOBS_GPU_MEMORY_UTILIZATION × the GPU's memory, less what is in use, less the working memory
  beside the cache: `reserve` for prefill activations and the CUDA graphs' logits), sized once from the memory free
  after loading. On CPU (tests) `CPU_SLOTS` slots and `CPU_PAGES` pages. The resident cache of an earlier run
  counts as free: `state_for` frees it before allocating.

The engine that runs on it is worker/engines/fastgen.py; the attention that reads and writes it,
worker/engines/paged_attention.py; which pages are free, in use or cached prompt prefixes, worker/engines/pages.py.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.engines import pages as pages_mod
from worker.engines.decode_attention import PAGE, QUANTIZED

log = logging.getLogger(__name__)

MAX_SLOTS = 1024  # sequences in flight at most (G1's batch)
MAX_LEN = 16384  # the longest sequence (prompt + max_new_tokens) the page table holds, at most the model's context
CPU_SLOTS = 16  # on CPU (tests): a small batch
CPU_PAGES: int | None = None  # on CPU: pages in the cache (None: enough for every slot to hold the longest sequence)
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward (fastgen's chunks; their activations are reserved)
RESERVE_BYTES = 3 << 30  # kept free on the GPU for prefill activations and the allocator's slack
GRAPH_BYTES_PER_VOCAB = 32  # per slot and vocabulary entry: the CUDA graphs' logits and fp32 sampling temporaries


@dataclass
class SlotState:
    """The paged cache, the page table and the per-slot decode inputs, kept on the model between jobs."""

    cache: torch.Tensor  # (2, layers, pages, kv_heads, PAGE, head_dim); page 0 is the trash page
    scales: torch.Tensor | None  # a quantized cache's: (2, layers, pages, kv_heads, PAGE) float32; else None
    table: torch.Tensor  # (slots, width) long: the page of each block of PAGE positions of each slot
    tok: torch.Tensor  # (slots,) the token each slot feeds into the next decode step
    pos: torch.Tensor  # (slots,) where that token's K/V goes = its position (0 for a free slot)
    active: torch.Tensor  # (slots,) long 1/0
    temp: torch.Tensor  # (slots,) sampling temperature, 0 = greedy
    top_k: torch.Tensor  # (slots,) long: a sampled row's top_k, 0 = off (fastgen's "filtered" steps)
    top_p: torch.Tensor  # (slots,) float32: its top_p, 1.0 = off
    no_eos: torch.Tensor  # (slots,) bool: ignore_eos rows, whose EOS logits are masked (as min_new_tokens does)
    lengths: torch.Tensor  # (slots,) int32, attention length of the step being run
    write_page: torch.Tensor  # (slots,) long: the page the step writes each slot's K/V into
    write_offset: torch.Tensor  # (slots,) long: and the offset in it
    # the cascade (decode_attention's docstring): the shared pages (-1 past their end), how many, and per slot how
    # many of its first blocks they are
    shared: torch.Tensor  # (width,) long
    shared_n: torch.Tensor  # (1,) int32
    start: torch.Tensor  # (slots,) int32
    positions: torch.Tensor  # (max_len,) 0..max_len-1, the prefill's position ids (views of one normal tensor,
    # like the decode step's `pos`, so compiled code sees one kind of tensor: no recompile between the two)
    offsets: torch.Tensor  # (max_len,) positions % PAGE
    graphs: dict[tuple, Any] = field(default_factory=dict)  # (batch, sample) or (batch, sample, extras)
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)  # per-slot buffers of `extras`, made when asked
    graph_pool: Any = None  # the memory pool every captured CUDA graph of this state shares
    capture_s: float = 0.0
    compile_s: float = 0.0  # the first prefill and decode with compiled layers, mostly compiling
    prepare_s: float | None = None  # everything `prepare` did, once per state
    alloc_s: float = 0.0  # making this state: sizing it and allocating (and zeroing) the cache
    compiled: list | None = None  # one torch.compile wrapper per decoder layer (see fastgen.COMPILE)
    eos: tuple[int, ...] | None = None  # the EOS ids the captured graphs mask (`eos_index`, on the device)
    eos_index: torch.Tensor | None = None
    first_prefill_s: float | None = None  # the first prefill of this state
    utilization: float | None = None  # JOBS_GPU_MEMORY_UTILIZATION the cache was sized with (None on CPU)
    pool: pages_mod.Pool | None = None  # which pages are free, in use, or cached prompt prefixes (kept across runs)

    @property
    def slots(self) -> int:
        return self.table.shape[0]

    @property
    def pages(self) -> int:
        return self.cache.shape[2]

    @property
    def max_len(self) -> int:
        return self.table.shape[1] * PAGE

    @property
    def kv_cache_dtype(self) -> str:
        """The spec's name of the cache's type: auto, fp8 or int8."""
        if self.scales is None:
            return "auto"
        return next(name for name, dtype in QUANTIZED.items() if dtype == self.cache.dtype)

    def bytes(self) -> int:
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.itemsize
        return self.cache.numel() * self.cache.itemsize + scales


def release(model) -> None:
    """Drop the model's paged cache and graphs (other engines need the memory)."""
    if model.__dict__.pop("_gpujobs_fast", None) is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _text_config(model):
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def _shape(model) -> tuple[int, int, int]:
    text = _text_config(model)
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim


def page_bytes(model, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one page of every layer's K and V (and, quantized, their scales)."""
    layers, kv_heads, head_dim = _shape(model)
    per_vector = head_dim * model.dtype.itemsize if kv_cache_dtype == "auto" else head_dim + 4
    return 2 * layers * kv_heads * PAGE * per_vector


def device_memory(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes of `device`: free is what the driver has free once torch's allocator gave back the blocks
    it holds unused (blocks of CUDA-graph pools stay taken: no other allocation can use them). None on CPU (the
    cache size is CPU_SLOTS / CPU_PAGES there)."""
    if device.type != "cuda":
        return None
    import gc

    gc.collect()  # tensors of an earlier failed call held in reference cycles
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def resident_bytes(model) -> int:
    """Bytes of the paged cache kept on the model from an earlier run (0 if none)."""
    state = model.__dict__.get("_gpujobs_fast")
    return 0 if state is None else state.bytes()


def size(
    model,
    device: torch.device,
    vocab: int,
    fraction: float = 1.0,
    utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
) -> tuple[int, int]:
    """(slots, pages) of a new state: MAX_SLOTS slots (CPU_SLOTS on CPU) and as many pages as `cache_budget` gives
    (times `fraction`, which an out-of-memory retry halves).

    The resident cache of an earlier run counts as free: `state_for` frees it before allocating. (Counted as taken,
    a second large run on a resident engine saw only the slack beside it: a handful of slots, or none.)"""
    width = max_len(model) // PAGE
    memory = device_memory(device)
    if memory is None:
        slots = CPU_SLOTS
        return slots, CPU_PAGES or slots * width + 1
    slots = MAX_SLOTS
    free, total = memory
    free += resident_bytes(model)
    budget = int(
        cache_budget(total, free, reserve(model) + slots * vocab * GRAPH_BYTES_PER_VOCAB, utilization) * fraction
    )
    pages = budget // page_bytes(model, kv_cache_dtype)
    if pages < 2:
        raise torch.OutOfMemoryError(
            f"the fast engine has no room for its KV cache: JOBS_GPU_MEMORY_UTILIZATION={utilization} allows "
            f"{utilization * total / 2**30:.1f} GiB of this GPU's {total / 2**30:.1f} GiB, "
            f"{(total - free) / 2**30:.1f} GiB are in use and {reserve(model) / 2**30:.1f} GiB are kept for "
            "activations: raise the setting, use a GPU with more memory, or engine padded"
        )
    return slots, int(pages)


def cache_budget(total: int, free: int, working: int, utilization: float) -> int:
    """Bytes for the KV cache on a GPU of `total` bytes with `free` bytes free now: the worker's share
    (`utilization` × total) less what is in use (the model, the CUDA context, other processes) and the `working`
    memory the engine needs beside the cache (activations, the CUDA graphs' logits). Memory another process holds
    counts as in use: the share is of the whole GPU, not of what this worker found free."""
    return max(0, int(utilization * total) - (total - free) - working)


def reserve(model) -> int:
    """Bytes kept free beside the cache: RESERVE_BYTES plus a prefill chunk's largest activations (the MLP's
    three intermediate tensors and a few hidden-size ones per token)."""
    text = _text_config(model)
    per_token = 4 * text.hidden_size + 3 * (getattr(text, "intermediate_size", None) or 4 * text.hidden_size)
    return RESERVE_BYTES + PREFILL_TOKENS * per_token * model.dtype.itemsize


def state_for(
    model,
    device: torch.device,
    vocab: int,
    fraction: float = 1.0,
    utilization: float = 0.9,
    kv_cache_dtype: str = "auto",
) -> SlotState:
    """The resident state if its cache is of `kv_cache_dtype`, or a new one sized by `size` (an old one freed
    first, its compiled layers kept)."""
    state = model.__dict__.get("_gpujobs_fast")
    if state is not None and state.kv_cache_dtype == kv_cache_dtype:
        return state
    compiled = state and state.compiled
    if state is not None:
        log.info(
            "fast engine: a new cache for kv_cache_dtype %s (the resident one is %s)",
            kv_cache_dtype,
            state.kv_cache_dtype,
        )
        release(model)
        del state
    t = time.perf_counter()
    slots, pages = size(model, device, vocab, fraction, utilization, kv_cache_dtype)
    layers, kv_heads, head_dim = _shape(model)
    width = max_len(model) // PAGE
    shape = (2, layers, pages, kv_heads, PAGE)
    quantized = QUANTIZED.get(kv_cache_dtype)
    if quantized is None:
        cache, scales = torch.zeros((*shape, head_dim), dtype=model.dtype, device=device), None
    else:  # zero bytes, viewed as the type (+0.0 in fp8): no float8 fill kernel needed on any device
        cache = torch.zeros((*shape, head_dim), dtype=torch.uint8, device=device).view(quantized)
        scales = torch.zeros(shape, dtype=torch.float32, device=device)
    positions = torch.arange(width * PAGE, device=device)

    def zeros(dtype):
        return torch.zeros(slots, dtype=dtype, device=device)

    state = SlotState(
        cache=cache,
        scales=scales,
        table=torch.zeros((slots, width), dtype=torch.long, device=device),
        tok=zeros(torch.long),
        pos=zeros(torch.long),
        active=zeros(torch.long),
        temp=zeros(torch.float32),
        top_k=zeros(torch.long),
        top_p=torch.ones(slots, dtype=torch.float32, device=device),
        no_eos=zeros(torch.bool),
        lengths=zeros(torch.int32),
        write_page=zeros(torch.long),
        write_offset=zeros(torch.long),
        shared=torch.full((width,), -1, dtype=torch.long, device=device),
        shared_n=torch.zeros(1, dtype=torch.int32, device=device),
        start=zeros(torch.int32),
        positions=positions,
        offsets=positions % PAGE,
    )
    state.utilization = utilization if device.type == "cuda" else None
    state.compiled = compiled or None
    state.pool = pages_mod.Pool(pages)
    sync(state)
    state.alloc_s = time.perf_counter() - t
    model.__dict__["_gpujobs_fast"] = state
    log.info(
        "fast engine: %d slots, %d pages of %d positions (%.1f GiB of KV cache, %s), sequences up to %d",
        slots,
        pages,
        PAGE,
        state.bytes() / 2**30,
        str(cache.dtype).removeprefix("torch."),
        state.max_len,
    )
    return state


def max_len(model) -> int:
    """The longest sequence (prompt + max_new_tokens) the engine holds for this model: its context, at most
    MAX_LEN, in whole pages."""
    text = _text_config(model)
    context = getattr(text, "max_position_embeddings", None) or MAX_LEN
    return max(PAGE, min(context, MAX_LEN) // PAGE * PAGE)


def summary(state: SlotState) -> dict[str, Any]:
    """The state's size and what preparing it cost (for the load event and the job's engine record)."""
    return {
        "slots": state.slots,
        "pages": state.pages,
        "page": PAGE,
        "max_len": state.max_len,
        "cache_gib": round(state.bytes() / 2**30, 3),
        "kv_cache_dtype": state.kv_cache_dtype,
        "gpu_memory_utilization": state.utilization,
        "graphs": len(state.graphs),
        "compile_s": round(state.compile_s, 3),
        "capture_s": round(state.capture_s, 3),
        "prepare_s": state.prepare_s and round(state.prepare_s, 3),
        "alloc_s": round(state.alloc_s, 3),
    }


def sync(state: SlotState) -> None:
    """Wait for the state's device (CUDA) to finish what was launched."""
    if state.cache.is_cuda:
        torch.cuda.synchronize(state.cache.device)
