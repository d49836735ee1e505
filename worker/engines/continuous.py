"""The continuous engine (`engine: continuous`): transformers' continuous batching (the engine of
`model.generate_batch`), driven through its manager so results stream out as rows finish.

A paged KV cache, requests admitted as others finish, one manager per group of rows that share the manager-wide
sampling parameters (do_sample, temperature, top_p, top_k, seed); `max_new_tokens` and EOS are per request. A
micro-batch is yielded each time `batch_rows` rows have finished (in finishing order, sorted within the
micro-batch). Every output's `error` is checked: a request that failed inside the engine is a failed row with that
error, never an empty success. Stop strings are cut after the fact (the request runs to EOS or `max_new_tokens`).
`repetition_penalty` is not supported there (transformers drops that processor silently), nor structured outputs
or logprobs (its manager builds its own logits processors: none of ours can mask a row or read its distribution;
docs/design.md "Structured outputs"): such a row fails, and is refused at submit. Its
cache is sized by transformers from the GPU memory free after loading, and explicitly and small on CPU.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import GenerationConfig

from core.dataset import engine_problem
from core.leases import RowResult
from core.spec import GenerateSpec
from worker import faults
from worker.engines.common import Prepared, eos_ids, free_cuda_cache, idx_sorted, prepare, row_result, sequence
from worker.loader import Loaded
from worker.progress import Progress

# Attention implementations transformers' continuous batching runs (others it refuses or silently changes).
ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")
# Keys of the sampling parameters one continuous-batching manager shares (its GenerationConfig and seed).
MANAGER_WIDE = ("do_sample", "temperature", "top_p", "top_k", "seed")
CPU_PAGE_TOKENS = 32  # CPU: small explicit pages and cache (transformers sizes its cache from free GPU memory)
CPU_MAX_REQUESTS = 32
CPU_MAX_BATCH_TOKENS = 512
GPU_WINDOW = 8192  # requests queued in the manager at once on a GPU (transformers picks how many run together)


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
    """The engine's entry (worker/engines/__init__.py): `rows` through one manager per group of manager-wide
    sampling parameters; a CUDA out-of-memory reruns the unfinished rows with half the concurrent requests."""
    started = time.time()
    ready: list[RowResult] = []  # finished rows not yet yielded
    groups: dict[str, list[Prepared]] = {}
    for item in prepare(loaded, spec, rows, started):
        if isinstance(item, RowResult):
            ready.append(item)
        elif problem := engine_problem("continuous", item.params):
            ready.append(RowResult(item.idx, prompt_tokens=len(item.ids), started_at=started, error=problem))
        else:
            groups.setdefault(repr([item.params[k] for k in MANAGER_WIDE]), []).append(item)
    for group in groups.values():
        pending = {g.idx: g for g in group}
        concurrency = None if loaded.device.type == "cuda" else min(CPU_MAX_REQUESTS, sum(g.n for g in group))
        while pending:
            try:
                with contextlib.closing(
                    _drive(loaded, spec, list(pending.values()), concurrency, should_stop, info, progress)
                ) as it:
                    for result in it:
                        pending.pop(result.idx, None)
                        ready.append(result)
                        if len(ready) >= batch_rows:
                            yield idx_sorted(ready)
                            ready = []
                if should_stop():
                    return  # finished rows not yet yielded stay pending, like a cancelled padded batch
            except torch.OutOfMemoryError:
                was = concurrency or sum(g.n for g in pending.values())
                if was <= 1:
                    raise
                free_cuda_cache()
                concurrency = max(1, was // 2)
                on_event(
                    f"out of memory in continuous batching with up to {was} concurrent requests: retrying "
                    f"the {len(pending)} unfinished rows with up to {concurrency}"
                )
    if ready and not should_stop():
        yield idx_sorted(ready)


def _drive(
    loaded: Loaded,
    spec: GenerateSpec,
    group: list[Prepared],
    concurrency: int | None,
    should_stop,
    info: dict[str, Any],
    progress: Progress,
) -> Iterator[RowResult]:
    """Run `group` through one continuous-batching manager; yield each row's result once all its n sequences are
    done. Raises torch.OutOfMemoryError (after stopping the manager) when the engine ran out of memory.

    The manager decodes in its own thread: progress is its step counter (`current_batch`) moving, read each time
    this loop polls (and each output it hands over). Until its first step the manager is warming up (cache, CUDA
    graphs): a phase for the stall watchdog."""
    tok, model = loaded.tokenizer, loaded.model
    requests = sum(g.n for g in group)
    faults.hit("generate", rows=concurrency or requests)
    config = _cb_config(loaded, spec, group, concurrency)
    manager = model.init_continuous_batching(
        generation_config=_manager_generation_config(loaded, group[0].params), continuous_batching_config=config
    )
    eos = eos_ids(loaded)
    done: dict[int, list] = {g.idx: [None] * g.n for g in group}
    by_idx = {g.idx: g for g in group}
    todo = collections.deque((g, k) for g in group for k in range(g.n))
    # requests handed to the manager ahead of what it runs (its scheduler admits them as its cache allows)
    window = 4 * concurrency if concurrency else GPU_WINDOW
    in_flight = 0
    started: dict[int, float] = {}
    steps_seen = 0
    progress.begin("starting continuous batching")  # ends at the manager's first step
    try:
        with torch.inference_mode():
            manager.start()
            info["attn_implementation"] = model.config._attn_implementation  # after transformers' own switch
            while todo or in_flight:
                while todo and in_flight < window:
                    g, k = todo.popleft()
                    added = manager.add_request(
                        g.ids,
                        request_id=f"{g.idx}#{k}",
                        max_new_tokens=g.params["max_new_tokens"],
                        eos_token_id=-1 if g.params["ignore_eos"] else sorted(eos),
                    )
                    if added is None:
                        raise RuntimeError("the continuous-batching manager refused a request (it is stopping)")
                    in_flight += 1
                    started.setdefault(g.idx, time.time())
                if should_stop():
                    return
                out = manager.get_result(timeout=0.2)
                steps = getattr(manager, "current_batch", None) or 0
                if out is not None or steps > steps_seen:
                    steps_seen = steps
                    if progress.phase_name is not None:
                        progress.end()
                    progress.beat("decode step")
                    faults.hit("decode_step")
                if out is None:
                    if not manager.is_running():
                        fatal = getattr(manager.background_thread_status, "fatal_error", None)
                        raise RuntimeError(f"continuous batching stopped with {in_flight} requests unfinished: {fatal}")
                    continue
                if not out.is_finished():
                    continue
                in_flight -= 1
                idx, k = (int(x) for x in out.request_id.split("#"))
                if out.error is not None and "out of memory" in str(out.error).lower():
                    raise torch.OutOfMemoryError(f"continuous batching: {out.error}")
                done[idx][k] = out
                if all(o is not None for o in done[idx]):
                    _record_runtime(manager, config, info)
                    yield _continuous_result(tok, by_idx[idx], done.pop(idx), eos, started[idx])
    finally:
        if progress.phase_name is not None:
            progress.end()
        _record_runtime(manager, config, info)
        manager.stop(block=True, timeout=60, hard_stop=True)


def _continuous_result(tok, row: Prepared, outputs: list, eos: set[int], started: float) -> RowResult:
    errors = [str(o.error) for o in outputs if o.error is not None]
    if errors:
        return RowResult(
            row.idx,
            prompt_tokens=len(row.ids),
            started_at=started,
            error=f"failed inside the continuous engine: {errors[0]}",
        )
    eos = set() if row.params["ignore_eos"] else eos
    return row_result(
        tok, row, [sequence(tok, list(o.generated_tokens), eos, row.params["stop"]) for o in outputs], started
    )


def _manager_generation_config(loaded: Loaded, params: dict[str, Any]) -> GenerationConfig:
    """The model's generation config with this group's manager-wide sampling parameters."""
    config = copy.deepcopy(loaded.model.generation_config)
    config.max_new_tokens = params["max_new_tokens"]  # the default; each request passes its own
    config.do_sample = params["do_sample"]
    for key in ("temperature", "top_p", "top_k"):
        setattr(config, key, params[key] if params["do_sample"] else None)
    config.num_return_sequences = 1  # n samples are n requests, so n can differ per row
    config.pad_token_id = loaded.tokenizer.pad_token_id
    return config


_SWITCH = {"auto": None, "on": True, "off": False}


def _cb_config(loaded: Loaded, spec: GenerateSpec, group: list[Prepared], concurrency: int | None):
    """The ContinuousBatchingConfig for this device. GPU: cache sized by transformers from the memory free after
    loading. CPU: explicit small pages and a cache for `concurrency` requests of the group's longest row."""
    from transformers import ContinuousBatchingConfig

    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    kwargs: dict[str, Any] = {}
    seed = group[0].params["seed"]
    if seed is not None:
        kwargs["seed"] = seed
        torch.manual_seed(seed)
    if loaded.device.type == "cuda":
        kwargs.update(use_cuda_graph=_SWITCH[spec.cuda_graphs], use_async_batching=_SWITCH[spec.async_batching])
        if concurrency:
            kwargs["max_requests_per_batch"] = concurrency
    else:
        longest = max(len(g.ids) + g.params["max_new_tokens"] for g in group)
        pages = math.ceil(longest / CPU_PAGE_TOKENS)
        kwargs.update(
            use_cuda_graph=False,
            use_async_batching=False,
            num_blocks=pages * concurrency + 1,
            max_batch_tokens=CPU_MAX_BATCH_TOKENS,
            max_requests_per_batch=concurrency,
        )
        kwargs["page_size" if "page_size" in accepted else "block_size"] = CPU_PAGE_TOKENS  # 5.24 / 5.17 name
    return ContinuousBatchingConfig(**kwargs)


def _record_runtime(manager, config, info: dict[str, Any]) -> None:
    """What the manager resolved: CUDA graphs (varlen, decode), async batching, cache size."""
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return
    runner = getattr(processor, "model_runner", None)
    cache = getattr(processor, "cache", None)
    info["cuda_graphs"] = {
        "varlen": getattr(runner, "use_cuda_graph_varlen", None),
        "decode": getattr(runner, "use_cuda_graph_decode", None),
    }
    info["async_batching"] = getattr(processor, "use_async_batching", None)
    info["cache"] = {
        k: getattr(cache, k, None)
        for k in ("num_blocks", "max_batch_tokens", "block_size", "page_size")
        if getattr(cache, k, None) is not None
    }
    info["max_requests_per_batch"] = getattr(config, "max_requests_per_batch", None)
