"""The static engine (`engine: static`, opt-in): `model.generate` with a static KV cache on `sdpa_gqa`, compiled on
CUDA once per shape.

Calls of exactly `batch_rows` sequence slots (dummy rows fill the last call and are dropped), cache length bucketed
(`cache_bucket`), rows grouped over the shard and sorted by length; compile time measured apart in a warm-up call
and recorded (`info["static"]`). Details and reasons: `_generate_static` and docs/design.md "Generation engines".
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import LogitsProcessorList, StoppingCriteria

from core.leases import RowResult
from core.spec import GenerateSpec
from worker import faults
from worker.engines.common import (
    Extras,
    Prepared,
    StopFlag,
    context_limit,
    eos_ids,
    free_cuda_cache,
    generate_kwargs,
    group_key,
    idx_sorted,
    padded_attention,
    prepare,
)
from worker.loader import Loaded
from worker.progress import Progress

log = logging.getLogger(__name__)

# Attention implementations the static engine runs (a static KV cache, its 4D mask built outside the compiled step).
ATTENTION = ("sdpa", "sdpa_gqa", "eager")
# Cache lengths are rounded up to one of 128·2^k or 192·2^k tokens (128, 192, 256, 384, 512, 768, 1024, …):
# each distinct (slots, cache length) is one compile, so a shard of mixed lengths compiles a handful of shapes,
# and a cache is at most 1.5× longer than needed (the decode step reads every slot of it, masked or not).
BUCKET_MIN = 128
WARM_UP_STEPS = 4  # decode steps of the warm-up call at a new shape: compile, CUDA-graph warm-up, record, replay
RECOMPILE_LIMIT = 64  # torch._dynamo's per-function limit (8 by default) is raised to this: one entry per shape
# Tests set a CompileConfig here (with `_compile_all_devices = True`) to compile on CPU, e.g. with a counting
# backend. Left None, the static engine on CPU runs uncompiled (inductor takes minutes there) and records so.
CPU_COMPILE = None
_CUDA_COMPILE = None  # one CompileConfig object per process: transformers recompiles when the config changes


def cache_bucket(tokens: int, limit: int | None = None) -> int:
    """The static cache length for a call whose longest row needs `tokens` (prompt + max_new_tokens) slots: the
    smallest 128·2^k or 192·2^k at or above it, but never past the model's context when that still fits."""
    size = BUCKET_MIN
    while size < tokens:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3  # 128, 192, 256, 384, 512, 768, …
    return max(tokens, min(size, limit)) if limit else size


class DummyRows(StoppingCriteria):
    """Marks the padding rows of a static call finished from their first token, so they never keep the call
    running (their outputs are dropped anyway)."""

    def __init__(self, real: int):
        self.real = real

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        done[self.real :] = True
        return done


def run(
    loaded: Loaded,
    spec: GenerateSpec,
    rows,
    *,
    batch_rows: int,
    should_stop,
    on_event,
    info: dict[str, Any],
    progress: Progress,
) -> Iterator[list[RowResult]]:
    """The engine's entry (worker/engines/__init__.py): `rows` on `sdpa_gqa`, recorded in `info`."""
    # sdpa_gqa on every device here (not only CUDA): the CPU tests then run the attention the GPU runs
    with padded_attention(loaded, on_cuda=True) as attn:
        info["attn_implementation"] = attn
        yield from _generate_static(
            loaded,
            spec,
            rows,
            batch_rows=batch_rows,
            should_stop=should_stop,
            on_event=on_event,
            info=info,
            progress=progress,
        )


def _generate_static(
    loaded: Loaded,
    spec: GenerateSpec,
    rows,
    *,
    batch_rows: int,
    should_stop,
    on_event,
    info: dict[str, Any],
    progress: Progress,
) -> Iterator[list[RowResult]]:
    """Static KV cache + torch.compile through `model.generate`, shapes fixed so compiling happens once per shape.

    Rows are grouped over the whole shard by their sampling parameters (as the padded engine groups a micro-batch),
    sorted by prompt length within a group, and cut into calls of exactly `slots` sequences (`batch_rows`; a row
    with n samples takes n slots; the last call is filled with dummy rows that are finished from their first token
    and dropped). Each call's results are yielded as one micro-batch (idx-sorted), so micro-batches follow the
    groups, not the input order. On CUDA the decode step is compiled (inductor, CUDA graphs, dynamic=False): the
    first call at a new (slots, cache length) first runs a short warm-up call at that shape, timed apart as
    `compile_s`. Out of memory halves the slots for the rest of the shard (a new shape, so a new compile).
    """
    started = time.time()
    ready: list[RowResult] = []
    groups: dict[str, list[Prepared]] = {}
    for item in prepare(loaded, spec, rows, started):
        if isinstance(item, RowResult):
            ready.append(item)
        else:
            groups.setdefault(group_key(item.params), []).append(item)
    compile_config, compile_reason = _compile_config(loaded)
    stats = info.setdefault(
        "static",
        {
            "slots": batch_rows,
            "compiled": compile_config is not None,
            "compile_reason": compile_reason,
            "compile_s": 0.0,
            "compiles": [],
            "calls": 0,
            "dummy_rows": 0,
            "shapes": [],
        },
    )
    slots = batch_rows
    for group in groups.values():
        todo = collections.deque(sorted(group, key=lambda g: len(g.ids)))
        while todo:
            if should_stop():
                return
            call = [todo.popleft()]
            width = max(slots, call[0].n)  # a row's n samples always share a call
            while todo and sum(g.n for g in call) + todo[0].n <= width:
                call.append(todo.popleft())
            try:
                results = _call(loaded, call, width, started, should_stop, compile_config, stats, progress)
            except torch.OutOfMemoryError:
                if width <= 1 or width // 2 < call[0].n:
                    raise
                free_cuda_cache()
                slots = width // 2
                stats["slots"] = slots
                on_event(
                    f"out of memory generating {width} sequences together (static engine): retrying as calls of {slots}"
                )
                todo.extendleft(reversed(call))
                continue
            if should_stop():
                return  # a cancelled call is not committed; its rows stay pending
            yield idx_sorted(ready + results)
            ready = []
    if ready and not should_stop():
        yield idx_sorted(ready)


def _compile_config(loaded: Loaded):
    """(CompileConfig or None, why): CUDA compiles (unless the quantization cannot); CPU only if a test asks."""
    global _CUDA_COMPILE
    quantizer = getattr(loaded.model, "hf_quantizer", None)
    if quantizer is not None and not getattr(quantizer, "is_compileable", False):
        return None, f"not compiled: {type(quantizer).__name__} quantization cannot be compiled"
    if loaded.device.type == "cuda":
        from transformers import CompileConfig

        _CUDA_COMPILE = _CUDA_COMPILE or CompileConfig(dynamic=False)  # inductor, reduce-overhead (CUDA graphs)
        _raise_recompile_limit()
        return _CUDA_COMPILE, "cuda: torch.compile (inductor, reduce-overhead), one graph per (slots, cache length)"
    if CPU_COMPILE is not None:
        _raise_recompile_limit()
        return CPU_COMPILE, "cpu: compiled with the CompileConfig set in worker.engines.static.CPU_COMPILE"
    return None, "not compiled: CPU (torch.compile takes minutes there; the static cache runs uncompiled)"


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < RECOMPILE_LIMIT:
        setattr(config, name, RECOMPILE_LIMIT)


def _call(
    loaded: Loaded,
    call: list[Prepared],
    slots: int,
    started: float,
    should_stop,
    compile_config,
    stats: dict[str, Any],
    progress: Progress,
) -> list[RowResult]:
    """One `model.generate` over `slots` sequences (the call's rows, each n times, then dummy rows)."""
    faults.hit("generate", rows=slots)
    tok, model = loaded.tokenizer, loaded.model
    params = call[0].params
    sequences = [g.ids for g in call for _ in range(g.n)]  # n samples of a row = n sequences, as generate expands
    real = len(sequences)
    sequences += [call[0].ids] * (slots - real)
    longest = max(len(s) for s in sequences)
    cache_len = cache_bucket(longest + params["max_new_tokens"], context_limit(loaded))
    shape = [slots, cache_len, model.config._attn_implementation, str(model.dtype)]
    fixed = dict(cache_implementation="static", max_cache_len=cache_len)
    if compile_config is not None:
        fixed["compile_config"] = compile_config
    else:
        fixed["disable_compile"] = True
    compiled_shapes = model.__dict__.setdefault("_gpujobs_static_shapes", set())
    if compile_config is not None and tuple(shape) not in compiled_shapes:
        with progress.phase("compiling"):
            seconds = _warm_up(loaded, slots, call[0].ids[-1], fixed)
        compiled_shapes.add(tuple(shape))
        stats["compiles"].append({"slots": slots, "cache_len": cache_len, "seconds": round(seconds, 3)})
        stats["compile_s"] = round(stats["compile_s"] + seconds, 3)
    enc = tok.pad({"input_ids": sequences}, padding=True, return_tensors="pt").to(loaded.device)
    kwargs = generate_kwargs(tok, params, [StopFlag(should_stop, progress), DummyRows(real)])
    # grammar masks and logprobs where asked (the dummy rows ask for neither)
    extras = Extras(loaded, [g.params for g in call for _ in range(g.n)] + [{}] * (slots - real))
    if extras.processors():
        kwargs["logits_processor"] = LogitsProcessorList(extras.processors())
    if params["seed"] is not None:
        torch.manual_seed(params["seed"])
    model._previous_max_cache_length = cache_len  # transformers would otherwise keep the longest cache seen
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs, **fixed)
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    extras.finish(new, out[:, -1])
    new = new[:real]
    stats["calls"] += 1
    stats["dummy_rows"] += slots - real
    if shape not in stats["shapes"]:
        stats["shapes"].append(shape)
    cache = _cache_size(model, slots, cache_len)
    if cache["bytes"] >= stats.get("cache", {}).get("bytes", 0):
        stats["cache"] = cache  # the largest cache this shard allocated
    eos = set() if params["ignore_eos"] else eos_ids(loaded)
    results, at = [], 0
    for g in call:
        results.append(extras.result(g, list(range(at, at + g.n)), new[at : at + g.n], eos, started))
        at += g.n
    return results


def _warm_up(loaded: Loaded, slots: int, token: int, fixed: dict[str, Any]) -> float:
    """A short greedy call at the new shape (1-token prompts, WARM_UP_STEPS decode steps): pays torch.compile and
    CUDA-graph capture there, so the real call's time is generation only. Returns its wall seconds."""
    model = loaded.model
    ids = torch.full((slots, 1), token, dtype=torch.long, device=loaded.device)
    _sync(loaded.device)
    t = time.perf_counter()
    model._previous_max_cache_length = fixed["max_cache_len"]
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=WARM_UP_STEPS,
            min_new_tokens=WARM_UP_STEPS,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=loaded.tokenizer.pad_token_id,
            **fixed,
        )
    _sync(loaded.device)
    seconds = time.perf_counter() - t
    log.info(
        "static engine: compiled and captured %d slots × %d cache tokens in %.1f s",
        slots,
        fixed["max_cache_len"],
        seconds,
    )
    return seconds


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cache_size(model, slots: int, cache_len: int) -> dict[str, Any]:
    """The static KV cache of a call: shape and bytes (K and V of every layer)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize
    return {
        "slots": slots,
        "cache_len": cache_len,
        "bytes": slots * cache_len * per_token,
        "bytes_per_token": per_token,
    }
