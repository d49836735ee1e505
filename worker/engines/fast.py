"""The fast engine (`engine: fast`, and `auto` on CUDA) as the dispatcher runs it: rows in, results out.

The engine itself is worker/engines/fastgen.py (continuous batching over a paged KV cache sized once from free
memory, decode steps captured as CUDA graphs, the decoder layers compiled, all prepared when the worker loads the
model: `prepared_state`), its resident state worker/engines/slot_state.py, its attention
worker/engines/paged_attention.py with the decode kernel worker/engines/decode_attention.py. Greedy and temperature sampling
(top_k and top_p under `fastgen.FILTERED_SAMPLING`); rows asking for repetition_penalty, or for top_p or top_k
while that flag is off, or longer than the cache holds, are returned to the dispatcher to run padded under `auto`
(worker/generate.py `run_engine`), and fail under `fast`. Finished rows are yielded `batch_rows` at a time as they
finish.
"""

from __future__ import annotations

import math
import time
from collections.abc import Generator, Iterator
from typing import Any

import torch

from core.leases import RowResult
from core.settings import get_settings
from core.spec import GenerateSpec
from worker.engines import decode_attention, fastgen, grammar, logprobs, paged_attention, slot_state
from worker.engines.common import (
    Prepared,
    eos_ids,
    free_cuda_cache,
    idx_sorted,
    prepare,
    row_result,
    sequences,
    vocab_width,
)
from worker.loader import Loaded
from worker.progress import Progress

Rows = list[tuple[int, dict[str, Any]]]


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
) -> Generator[list[RowResult], None, Rows]:
    """Rows through `fastgen.Engine`, one run per distinct seed; finished rows are yielded once at least
    `batch_rows` are ready, in finishing order (sorted within a micro-batch): rows that finish in the same decode
    step share a micro-batch, however many (G1's 1024 rows all end at its last step: one commit, not 64). Rows
    whose sampling the fast engine cannot do, or longer than its cache holds, are returned under `auto` (the
    dispatcher runs them on the padded engine afterwards) and fail under `fast`; nothing is returned once
    `should_stop()` ended the run. Out of memory: the unfinished sequences run again with half the slots and half
    the cache (reported through `on_event`)."""
    started = time.time()
    ready: list[RowResult] = []
    inputs = dict(rows)
    others: Rows = []
    groups: dict[Any, list[fastgen.Seq]] = {}
    eos = eos_ids(loaded)
    state = prepared_state(loaded, eos, progress=progress, sampling=(), kv_cache_dtype=spec.kv_cache_dtype)
    for item in prepare(loaded, spec, rows, started):
        if isinstance(item, RowResult):
            ready.append(item)
        elif (unsupported := fastgen.row_problem(item.params) or _too_long(state, item)) and spec.engine == "auto":
            others.append((item.idx, inputs[item.idx]))
        elif unsupported:
            ready.append(
                RowResult(
                    item.idx,
                    prompt_tokens=len(item.ids),
                    started_at=started,
                    error=(
                        f"{unsupported} is not supported by the fast engine: use engine auto (which runs such rows "
                        "padded) or padded"
                    ),
                )
            )
        else:
            groups.setdefault(item.params["seed"], []).extend(_seqs(loaded, item, eos))
    stats = info.setdefault(
        "fast",
        {"runs": 0, "steps": 0, "prefill_s": 0.0, "decode_s": 0.0, "prompt_tokens": 0, "prefix_tokens_reused": 0},
    )
    info["attn_implementation"] = (
        f"{paged_attention.NAME} (decode: "
        + ("triton" if decode_attention.available(loaded.device) else "sdpa reference")
        + ")"
    )
    for seed, group in groups.items():
        done: dict[int, dict[int, fastgen.Seq]] = {}
        for finished in _run_fast(
            loaded,
            group,
            seed,
            eos,
            should_stop,
            on_event,
            stats,
            progress,
            spec.prefix_cache != "off",
            spec.kv_cache_dtype,
        ):
            complete = []  # rows whose every sample finished: their texts are decoded in one batch
            for seq in finished:
                got = done.setdefault(seq.row.idx, {})
                got[seq.k] = seq
                if len(got) == seq.row.n:
                    complete.append([got[k] for k in range(seq.row.n)])
                    del done[seq.row.idx]
            row_eos = lambda row: set() if row.params["ignore_eos"] else eos  # noqa: E731
            texts = iter(
                sequences(
                    loaded.tokenizer,
                    [(s.tokens, row_eos(s.row), s.row.params["stop"]) for row in complete for s in row],
                )
            )
            for row in complete:
                ready.append(_result(loaded, row, [next(texts) for _ in row], eos, started))
            if len(ready) >= batch_rows:  # rows that finished in one step are committed together
                yield idx_sorted(ready)
                ready = []
        if should_stop():
            return []  # finished rows not yet yielded stay pending
    if ready:
        yield idx_sorted(ready)
    return others


def _seqs(loaded: Loaded, item: Prepared, eos: set[int]) -> list[fastgen.Seq]:
    """The row's n sequences, each with its grammar (constrained rows) and a log-probability list (where asked)."""
    seqs = [fastgen.Seq(item, k) for k in range(item.n)]
    guides = grammar.guides(loaded.tokenizer, vocab_width(loaded), eos, [item.params] * item.n)
    for seq, guide in zip(seqs, guides):
        seq.guide = guide
        seq.lp = [] if logprobs.wanted(item.params) is not None else None
        if guide is not None:  # a row with logprobs books them every step: always masked
            guide.checks = grammar.CHECK_FIRST and seq.lp is None
    return seqs


def _result(loaded: Loaded, seqs: list[fastgen.Seq], cut: list, eos: set[int], started: float) -> RowResult:
    """A row's result from its finished sequences and their texts (`cut`: `sequences`), with its log-probabilities."""
    row, tok = seqs[0].row, loaded.tokenizer
    error = grammar.failure([s.guide for s in seqs])
    if error:
        return RowResult(row.idx, prompt_tokens=len(row.ids), started_at=started, error=error)
    k = logprobs.wanted(row.params)
    lps = None
    if k is not None:
        names = logprobs.Tokens(tok, vocab_width(loaded), eos)
        lps = [logprobs.pack(names, s.tokens[:n], *s.lp, k) for s, (_, _, n) in zip(seqs, cut)]
    return row_result(tok, row, cut, started, lps)


def prepared_state(
    loaded: Loaded,
    eos: set[int] | None = None,
    fraction: float = 1.0,
    progress: Progress | None = None,
    sampling: tuple[bool, ...] = (False, True),
    kv_cache_dtype: str = "auto",
) -> slot_state.SlotState:
    """The fast engine's state for this model, prepared once per cache type (cache, compiled layers, CUDA graphs of
    the modes in `sampling`: see `fastgen.prepare`). The worker calls it right after loading a model the fast
    engine will run (through `generate.prepare_engine`, with the loading job's mode and cache type), so that cost is
    load time, not a job's. A run that finds no state (another engine released it, or the job asks for another
    cache type) makes one with no graph captured ahead (`sampling=()`): each bucket's is captured when a step first
    needs it, so a shard pays only for the buckets its rows use. A job mixing greedy rows with rows the padded
    engine runs (top_p, top_k, repetition_penalty) builds the state again in every shard: capturing all 32 graphs
    each time took 8.2 s of each ~22 s shard of the GPU soak's `mixed` step on an H100
    (ops/bench/results/2026-12-08-h100-session58), where its 64 greedy rows used 7 buckets."""
    graphs = _fast_graphs(loaded)
    return fastgen.prepare(
        loaded,
        eos_ids(loaded) if eos is None else eos,
        graphs=graphs,
        compiled=graphs and fastgen.COMPILE,
        fraction=fraction,
        utilization=get_settings().gpu_memory_utilization,
        progress=progress,
        sampling=sampling,
        kv_cache_dtype=kv_cache_dtype,
    )


def _fast_graphs(loaded: Loaded) -> bool:
    return loaded.device.type == "cuda" and getattr(loaded.model, "hf_quantizer", None) is None


def _too_long(state: slot_state.SlotState, item: Prepared) -> str | None:
    need = len(item.ids) + item.params["max_new_tokens"]
    if need <= state.max_len and math.ceil(need / decode_attention.PAGE) < state.pages:
        return None
    room = min(state.max_len, (state.pages - 1) * decode_attention.PAGE)
    return (
        f"a sequence of {need} tokens (prompt {len(item.ids)} + max_new_tokens "
        f"{item.params['max_new_tokens']}, more than the {room} the fast engine holds here)"
    )


def _run_fast(
    loaded: Loaded,
    group: list[fastgen.Seq],
    seed,
    eos: set[int],
    should_stop,
    on_event,
    stats: dict[str, Any],
    progress: Progress,
    prefix_cache: bool = True,
    kv_cache_dtype: str = "auto",
) -> Iterator[list[fastgen.Seq]]:
    """One group (same seed) to the end, yielding the sequences that finish together; an out-of-memory halves the
    slots and the cache and reruns the unfinished sequences. `prefix_cache`: prompts share cached prefix pages;
    `kv_cache_dtype`: the cache's element type (`slot_state.state_for`)."""
    model = loaded.model
    cap, fraction = slot_state.MAX_SLOTS, 1.0
    todo = list(group)
    while todo and not should_stop():
        if seed is not None:
            torch.manual_seed(seed)
        for seq in todo:
            seq.tokens, seq.slot, seq.pages, seq.done, seq.prefix = [], -1, [], False, 0
            seq.lp = None if seq.lp is None else []
            if seq.guide is not None:
                seq.guide.reset()
        finished: set[int] = set()
        engine = None
        try:
            state = prepared_state(loaded, eos, fraction, progress, sampling=(), kv_cache_dtype=kv_cache_dtype)
            graphs = _fast_graphs(loaded)
            engine = fastgen.Engine(
                loaded,
                state,
                eos,
                slots=min(state.slots, len(todo), cap),
                graphs=graphs,
                compiled=graphs and fastgen.COMPILE,
            )
            engine.reuse = prefix_cache
            with torch.inference_mode():
                for seqs in engine.run(todo, should_stop, progress):
                    finished.update(id(seq) for seq in seqs)
                    yield seqs
        except torch.OutOfMemoryError:
            was = engine.slots if engine else cap
            if was <= 1:
                raise
            slot_state.release(model)
            free_cuda_cache()
            cap, fraction = was // 2, fraction / 2
            on_event(
                f"out of memory in the fast engine with {was} slots: retrying the "
                f"{len(todo) - len(finished)} unfinished sequences with at most {cap}"
            )
        finally:
            if engine is not None:
                engine.record(stats)
        todo = [s for s in todo if id(s) not in finished]
