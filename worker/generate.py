"""Generation over rows: plain functions, runnable without a queue.

`generate()` yields one micro-batch of `RowResult`s at a time; the caller commits each before asking for the
next, so a crash loses at most one micro-batch. Four engines run the rows (spec field `engine`):

- `fast` (worker/fastgen.py): continuous batching over a paged KV cache sized once from free memory (a row takes
  the pages its prompt + max_new_tokens need), a Triton decode attention that reads each row's real context only,
  decode steps captured as CUDA graphs and the decoder layers compiled, all prepared when the worker loads the
  model (`prepare_engine`). Greedy and temperature sampling; rows asking for top_p, top_k or repetition_penalty, or
  longer than the cache holds, run padded under `auto` and fail under `fast`. Finished rows are yielded
  `batch_rows` at a time as they finish.
- `padded`: micro-batches of `batch_rows` rows, left-padded, through `model.generate`. Rows with different
  sampling parameters never share a call. Sampling with a `seed` reseeds torch per call, so a job is reproducible
  for the same batching.
- `continuous`: transformers' continuous batching (the engine of `model.generate_batch`, driven through its
  manager so results stream out as rows finish): a paged KV cache, requests admitted as others finish, one
  manager per group of rows that share the manager-wide sampling parameters (do_sample, temperature, top_p,
  top_k, seed); `max_new_tokens` and EOS are per request. A micro-batch is yielded each time `batch_rows` rows
  have finished (in finishing order, sorted within the micro-batch). Every output's `error` is checked: a request
  that failed inside the engine is a failed row with that error, never an empty success. Stop strings are cut
  after the fact (the request runs to EOS or `max_new_tokens`). `repetition_penalty` is not supported there
  (transformers drops that processor silently): such a row fails under `engine: continuous`.
- `static`: `model.generate` with a static KV cache on `sdpa_gqa`, compiled on CUDA once per shape: calls of
  exactly `batch_rows` sequence slots (dummy rows fill the last call and are dropped), cache length bucketed
  (`cache_bucket`), rows grouped over the shard and sorted by length; compile time measured apart in a warm-up
  call and recorded (`info["static"]`). Details and reasons: `_generate_static` and docs/design.md.

`auto` picks `fast` on CUDA for an unquantized model it can run, else `padded` (see `choose_engine`). Measured on
an H200 (G1, transformers 5.17, ops/bench/results/2026-12-03-h200): fast 54,772 output tok/s warm, the padded
engine ~5–7k, transformers' continuous batching 1,470 (session 2). On CUDA the padded engine runs a
grouped-query model loaded with `sdpa` on `sdpa_gqa` (worker/attention.py). What ran (engine, the attention that
really ran, CUDA graphs, cache size, compile and capture times) is written into the `info` dict the caller passes,
for the shard's metrics and the job's load options. An engine other than `fast` first releases the fast engine's
resident cache (`fastgen.release`).

`num_return_sequences` n > 1 gives a row n samples: its `output` is a list of n strings, `finish_reason` a list
of n reasons and `completion_tokens` their sum; n == 1 keeps a plain string.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from core.errors import InvalidInput
from core.leases import RowResult
from core.spec import GenerateSpec, sampling_of
from worker import attention, fastgen, faults
from worker.loader import Loaded
from worker.progress import Progress

log = logging.getLogger(__name__)

RENDER_BATCH = 1024  # prompts tokenized in one call (see render_many)


class StopFlag(StoppingCriteria):
    """Called by `generate` after each decode step: reports the step to `progress` (the stall watchdog) and ends
    the call when the job is cancelled or the worker shuts down."""

    def __init__(self, should_stop: Callable[[], bool], progress: Progress):
        self.should_stop, self.progress = should_stop, progress

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.progress.beat("decode step")
        faults.hit("decode_step")
        return torch.full((input_ids.shape[0],), self.should_stop(), dtype=torch.bool, device=input_ids.device)


def render_many(loaded: Loaded, row_inputs: list[dict[str, Any]]) -> list[list[int] | Exception]:
    """The prompt token ids of each row (`messages` through the chat template, with the generation prompt), or the
    exception that row's prompt raised. Prompts are tokenized as one batch (one call, which the Rust tokenizer
    spreads over the cores, instead of one Python call per row); a batch that raises is tokenized row by row, so a
    bad row fails alone."""
    tok = loaded.tokenizer
    out: list[list[int] | Exception | None] = [None] * len(row_inputs)
    texts: dict[bool, list[tuple[int, str]]] = {True: [], False: []}  # by add_special_tokens
    for i, row_input in enumerate(row_inputs):
        if "messages" not in row_input:
            texts[True].append((i, row_input["prompt"]))
            continue
        try:
            text = tok.apply_chat_template(row_input["messages"], add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # e.g. a template that refuses these messages
            out[i] = exc
            continue
        texts[False].append((i, text))
    for special, items in texts.items():
        if not items:
            continue
        try:
            ids = tok([text for _, text in items], add_special_tokens=special)["input_ids"]
        except Exception:
            ids = []
            for _, text in items:
                try:
                    ids.append(tok(text, add_special_tokens=special)["input_ids"])
                except Exception as exc:
                    ids.append(exc)
        for (i, _), row_ids in zip(items, ids):
            out[i] = row_ids
    return out


def context_limit(loaded: Loaded) -> int | None:
    return getattr(loaded.model.config, "max_position_embeddings", None)


def generate(
    loaded: Loaded,
    spec: GenerateSpec,
    rows: list[tuple[int, dict[str, Any]]],
    *,
    batch_rows: int,
    should_stop: Callable[[], bool] = lambda: False,
    on_event: Callable[[str], None] = lambda message: None,
    info: dict[str, Any] | None = None,
    progress: Progress | None = None,
) -> Iterator[list[RowResult]]:
    """Yield results micro-batch by micro-batch for `rows` = [(idx, stored row input)].

    A CUDA out-of-memory is retried smaller (padded: the failing group split in halves, down to one row;
    continuous: the unfinished rows again with half the concurrent requests), each retry reported through
    `on_event`; past the smallest size the error propagates and the shard's attempt fails. `info` receives what
    ran (engine, attention, CUDA graphs, async batching, cache). Every engine reports each decode step (and the
    fast engine each prefill chunk; compiling and graph capture as phases) to `progress`, the stall watchdog's
    clock (worker/progress.py).
    """
    info = {} if info is None else info
    progress = Progress() if progress is None else progress
    engine, reason = choose_engine(spec, loaded)
    info.update(engine=engine, engine_reason=reason)
    kwargs = dict(batch_rows=batch_rows, should_stop=should_stop, on_event=on_event, progress=progress)
    if engine == "fast":
        yield from _generate_fast(loaded, spec, rows, info=info, **kwargs)
        return
    fastgen.release(loaded.model)  # the fast engine's resident cache would take the memory this engine needs
    if engine == "continuous":
        yield from _generate_continuous(loaded, spec, rows, info=info, **kwargs)
        return
    if engine == "static":
        # sdpa_gqa on every device here (not only CUDA): the CPU tests then run the attention the GPU runs
        with padded_attention(loaded, on_cuda=True) as attn:
            info["attn_implementation"] = attn
            yield from _generate_static(loaded, spec, rows, info=info, **kwargs)
        return
    with padded_attention(loaded, on_cuda=loaded.device.type == "cuda") as attn:
        info["attn_implementation"] = attn
        yield from _generate_padded(loaded, spec, rows, **kwargs)


@contextlib.contextmanager
def padded_attention(loaded: Loaded, *, on_cuda: bool) -> Iterator[str]:
    """The attention the padded engine runs: `sdpa_gqa` (worker/attention.py) instead of `sdpa` on CUDA for a
    grouped-query model, switched back afterwards (the resident model may serve a continuous job next)."""
    model = loaded.model
    before = model.config._attn_implementation
    if not (on_cuda and attention.applies(model)):
        yield before
        return
    model.set_attn_implementation(attention.register())
    try:
        yield attention.NAME
    finally:
        model.set_attn_implementation(before)


def _generate_padded(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int, should_stop, on_event,
                     progress: Progress) -> Iterator[list[RowResult]]:
    for start in range(0, len(rows), batch_rows):
        if should_stop():
            return
        started = time.time()
        results: list[RowResult] = []
        groups: dict[str, list[Prepared]] = {}
        for item in prepare(loaded, spec, rows[start : start + batch_rows], started):
            if isinstance(item, RowResult):
                results.append(item)
            else:
                groups.setdefault(repr(sorted(item.params.items())), []).append(item)
        for group in groups.values():
            results.extend(_run_splitting(loaded, group, started, should_stop, on_event, progress))
        if should_stop():
            return  # a cancelled or interrupted batch is not committed; its rows stay pending
        results.sort(key=lambda r: r.idx)
        yield results


@dataclass
class Prepared:
    """A row ready for an engine: its effective sampling parameters and prompt token ids."""

    idx: int
    params: dict[str, Any]
    ids: list[int]

    @property
    def n(self) -> int:
        return self.params.get("num_return_sequences") or 1


def prepare(loaded: Loaded, spec: GenerateSpec, rows, started: float) -> Iterator[Prepared | RowResult]:
    """Render each row; a row that cannot run (bad template, too long, n > 1 greedy) is a failed RowResult."""
    limit = context_limit(loaded)
    rows = list(rows)
    for start in range(0, len(rows), RENDER_BATCH):
        chunk = rows[start:start + RENDER_BATCH]
        for (idx, row_input), ids in zip(chunk, render_many(loaded, [r for _, r in chunk])):
            yield _prepared(idx, row_input, ids, spec, limit, started)


def _prepared(idx: int, row_input: dict[str, Any], ids: list[int] | Exception, spec: GenerateSpec,
              limit: int | None, started: float) -> Prepared | RowResult:
    params = sampling_of(spec, row_input.get("params"))
    if isinstance(ids, Exception):  # e.g. a chat template that refuses these messages: this row fails alone
        return RowResult(idx, started_at=started, error=f"cannot build the prompt: {ids}")
    if limit and len(ids) + params["max_new_tokens"] > limit:
        return RowResult(idx, prompt_tokens=len(ids), started_at=started, error=(
            f"prompt of {len(ids)} tokens + max_new_tokens {params['max_new_tokens']} exceeds the model's "
            f"context of {limit} tokens: shorten the prompt or lower max_new_tokens"))
    if (params.get("num_return_sequences") or 1) > 1 and not params["do_sample"]:
        return RowResult(idx, prompt_tokens=len(ids), started_at=started, error=(
            f"num_return_sequences {params['num_return_sequences']} needs sampling (greedy decoding returns "
            "the same text each time): set temperature > 0 or do_sample true for this row"))
    return Prepared(idx, params, ids)


# Attention implementations transformers' continuous batching runs (others it refuses or silently changes).
CONTINUOUS_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def choose_engine(spec: GenerateSpec, loaded: Loaded) -> tuple[str, str]:
    """The engine for this spec on this model, and why. `auto`: `fast` on CUDA for an unquantized model it can run,
    else `padded` (see the module docstring). `fast`, `static` and `continuous` refuse a model or attention they
    cannot run (InvalidInput, before any GPU work)."""
    if spec.engine == "padded":
        return "padded", "asked for"
    problem = fastgen.model_problem(loaded.model)
    if spec.engine == "auto":
        if loaded.device.type != "cuda":
            return "padded", "auto: padded on CPU (the fast engine's kernels and CUDA graphs need a GPU)"
        if getattr(loaded.model, "hf_quantizer", None) is not None:
            return "padded", "auto: padded for a quantized model (the fast engine captures CUDA graphs)"
        if problem:
            return "padded", f"auto: padded, because {problem}"
        return "fast", "auto: fast on CUDA (paged KV cache, Triton decode attention, CUDA graphs)"
    if spec.engine == "fast":
        if problem:
            raise InvalidInput(problem)
        return "fast", "asked for"
    attn = loaded.model.config._attn_implementation
    if spec.engine == "static":
        if attn.startswith("paged|") or attn not in STATIC_ATTENTION:
            raise InvalidInput(f"engine static cannot run attention {attn!r}: use one of "
                               f"{', '.join(STATIC_ATTENTION)}, or engine padded")
        return "static", "asked for"
    attn = attn.removeprefix("paged|")
    if attn not in CONTINUOUS_ATTENTION:
        raise InvalidInput(f"engine continuous cannot run attention {attn!r}: use one of "
                           f"{', '.join(CONTINUOUS_ATTENTION)}, or engine padded")
    return "continuous", "asked for"


def _run_splitting(loaded: Loaded, group, started: float, should_stop, on_event,
                   progress: Progress) -> list[RowResult]:
    try:
        return _run_group(loaded, group, started, should_stop, progress)
    except torch.OutOfMemoryError:
        if len(group) == 1:
            raise
    # retried here, after the except block: inside it the exception's traceback would keep the failed call's
    # tensors alive (on an H200 each retry then failed for lack of the memory the previous one still held)
    _free_cuda_cache()
    half = len(group) // 2
    on_event(f"out of memory generating {len(group)} rows together: retrying as {half} + {len(group) - half}")
    return (_run_splitting(loaded, group[:half], started, should_stop, on_event, progress)
            + _run_splitting(loaded, group[half:], started, should_stop, on_event, progress))


def _free_cuda_cache() -> None:
    if torch.cuda.is_available():
        import gc

        gc.collect()  # tensors of a failed call held in reference cycles (frames, tracebacks) go first
        torch.cuda.empty_cache()


def _run_group(loaded: Loaded, group: list[Prepared], started: float, should_stop,
               progress: Progress) -> list[RowResult]:
    faults.hit("generate", rows=len(group))
    tok, model = loaded.tokenizer, loaded.model
    params = group[0].params
    n = group[0].n
    enc = tok.pad({"input_ids": [g.ids for g in group]}, padding=True, return_tensors="pt").to(loaded.device)
    kwargs = _generate_kwargs(tok, params, [StopFlag(should_stop, progress)])
    if n > 1:
        kwargs["num_return_sequences"] = n  # outputs come back row by row: row 0's n samples, then row 1's
    if params["seed"] is not None:
        torch.manual_seed(params["seed"])
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    eos = set() if params["ignore_eos"] else _eos_ids(loaded)
    return [_row_result(tok, g, [_sequence(tok, t, eos, g.params["stop"]) for t in new[i * n : (i + 1) * n]],
                        started) for i, g in enumerate(group)]


def _generate_kwargs(tok, params: dict[str, Any], criteria: list[StoppingCriteria]) -> dict[str, Any]:
    """`model.generate` keyword arguments for one group's sampling parameters (padded and static engines)."""
    kwargs = dict(max_new_tokens=params["max_new_tokens"], do_sample=params["do_sample"],
                  pad_token_id=tok.pad_token_id, stopping_criteria=StoppingCriteriaList(criteria))
    if params["do_sample"]:
        kwargs.update({k: params[k] for k in ("temperature", "top_p", "top_k") if params[k] is not None})
    else:
        kwargs.update(temperature=None, top_p=None, top_k=None)
    if params["ignore_eos"]:
        kwargs["min_new_tokens"] = params["max_new_tokens"]  # EOS is masked until the last token
    if params["repetition_penalty"] is not None:
        kwargs["repetition_penalty"] = params["repetition_penalty"]
    if params["stop"]:
        kwargs.update(stop_strings=params["stop"], tokenizer=tok)
    return kwargs


def _eos_ids(loaded: Loaded) -> set[int]:
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _sequence(tok, tokens: list[int], eos: set[int], stop: list[str] | None) -> tuple[str, str, int]:
    """One generated sequence as (text, finish_reason, completion tokens): cut at EOS or before a stop string."""
    end = next((i for i, t in enumerate(tokens) if t in eos), None)
    finish = "stop" if end is not None else "length"
    kept = tokens[: end + 1] if end is not None else tokens
    text = tok.decode(kept, skip_special_tokens=True)
    hits = [s for s in stop or [] if s in text]
    if hits:
        # `generate` ends a row on the token that completes a stop string and pads it after that (with a pad token
        # that may be an EOS): count the tokens through the stop string, not the padding, whatever the batch.
        kept = kept[: min(_tokens_through(tok, kept, s) for s in hits)]
        text, finish = text[: min(text.index(s) for s in hits)], "stop"
    return text, finish, len(kept)


def _row_result(tok, row: Prepared, sequences: list[tuple[str, str, int]], started: float) -> RowResult:
    """A row's result: one sequence stores plain text; n > 1 store a list of texts and a list of finish reasons."""
    texts, finishes, counts = zip(*sequences)
    if len(sequences) == 1:
        return RowResult(row.idx, output=texts[0], finish_reason=finishes[0], prompt_tokens=len(row.ids),
                         completion_tokens=counts[0], started_at=started)
    return RowResult(row.idx, output=list(texts), finish_reason=list(finishes), prompt_tokens=len(row.ids),
                     completion_tokens=sum(counts), started_at=started)


def _tokens_through(tok, tokens: list[int], stop: str) -> int:
    """Length of the shortest prefix of `tokens` whose text contains `stop` (binary search: few decodes)."""
    lo, hi = 1, len(tokens)
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tok.decode(tokens[:mid], skip_special_tokens=True):
            hi = mid
        else:
            lo = mid + 1
    return lo


# --- the fast engine (worker/fastgen.py) ------------------------------------------------------------------------


def _generate_fast(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int, should_stop, on_event,
                   info: dict[str, Any], progress: Progress) -> Iterator[list[RowResult]]:
    """Rows through `fastgen.Engine`, one run per distinct seed; finished rows are yielded once at least
    `batch_rows` are ready, in finishing order (sorted within a micro-batch): rows that finish in the same decode
    step share a micro-batch, however many (G1's 1024 rows all end at its last step: one commit, not 64). Rows
    whose sampling the fast engine cannot do, or longer than its cache holds, run on the padded engine afterwards
    under `auto` and fail under `fast`. Out of memory: the unfinished sequences run again with half the slots and
    half the cache (reported through `on_event`)."""
    started = time.time()
    ready: list[RowResult] = []
    inputs = dict(rows)
    others: list[tuple[int, dict[str, Any]]] = []
    groups: dict[Any, list[fastgen.Seq]] = {}
    eos = _eos_ids(loaded)
    state = prepare_fast(loaded, eos, progress=progress)
    for item in prepare(loaded, spec, rows, started):
        if isinstance(item, RowResult):
            ready.append(item)
        elif (unsupported := fastgen.row_problem(item.params) or _too_long(state, item)) and spec.engine == "auto":
            others.append((item.idx, inputs[item.idx]))
        elif unsupported:
            ready.append(RowResult(item.idx, prompt_tokens=len(item.ids), started_at=started, error=(
                f"{unsupported} is not supported by the fast engine: use engine auto (which runs such rows "
                "padded) or padded")))
        else:
            groups.setdefault(item.params["seed"], []).extend(fastgen.Seq(item, k) for k in range(item.n))
    stats = info.setdefault("fast", {"runs": 0, "steps": 0, "prefill_s": 0.0, "decode_s": 0.0})
    info["attn_implementation"] = f"{fastgen.NAME} (decode: " + (
        "triton" if fastgen.decode_attention.available(loaded.device) else "sdpa reference") + ")"
    for seed, group in groups.items():
        done: dict[int, dict[int, fastgen.Seq]] = {}
        for finished in _run_fast(loaded, group, seed, eos, should_stop, on_event, stats, progress):
            for seq in finished:
                got = done.setdefault(seq.row.idx, {})
                got[seq.k] = seq
                if len(got) == seq.row.n:
                    row_eos = set() if seq.row.params["ignore_eos"] else eos
                    sequences = [_sequence(loaded.tokenizer, got[k].tokens, row_eos, seq.row.params["stop"])
                                 for k in range(seq.row.n)]
                    ready.append(_row_result(loaded.tokenizer, seq.row, sequences, started))
                    del done[seq.row.idx]
            if len(ready) >= batch_rows:  # rows that finished in one step are committed together
                yield _sorted(ready)
                ready = []
        if should_stop():
            return  # finished rows not yet yielded stay pending
    if ready:
        yield _sorted(ready)
    if others:
        fastgen.release(loaded.model)  # the padded engine needs the memory of the fast engine's cache
        with padded_attention(loaded, on_cuda=loaded.device.type == "cuda"):
            yield from _generate_padded(loaded, spec, others, batch_rows=batch_rows, should_stop=should_stop,
                                        on_event=on_event, progress=progress)


def prepare_engine(loaded: Loaded, spec: GenerateSpec, progress: Progress | None = None) -> dict[str, Any] | None:
    """Prepare what the engine for `spec` keeps on the model, right after loading, so that no job pays for it:
    the fast engine's cache, compiled layers and CUDA graphs (phases of `progress`). Returns what it did (for the
    load event), or None."""
    try:
        name, _ = choose_engine(spec, loaded)
    except InvalidInput:
        return None  # the job fails with that reason when it runs
    if name != "fast":
        return None
    return fastgen.summary(prepare_fast(loaded, progress=progress))


def prepare_fast(loaded: Loaded, eos: set[int] | None = None, fraction: float = 1.0,
                 progress: Progress | None = None) -> fastgen.SlotState:
    """The fast engine's state for this model, prepared once (cache, compiled layers, CUDA graphs: see
    `fastgen.prepare`). The worker calls it right after loading a model the fast engine will run, so that cost
    is load time, not a job's."""
    graphs = _fast_graphs(loaded)
    return fastgen.prepare(loaded, _eos_ids(loaded) if eos is None else eos, graphs=graphs,
                           compiled=graphs and fastgen.COMPILE, fraction=fraction, progress=progress)


def _fast_graphs(loaded: Loaded) -> bool:
    return loaded.device.type == "cuda" and getattr(loaded.model, "hf_quantizer", None) is None


def _too_long(state: fastgen.SlotState, item: Prepared) -> str | None:
    need = len(item.ids) + item.params["max_new_tokens"]
    if need <= state.max_len and math.ceil(need / fastgen.PAGE) < state.pages:
        return None
    room = min(state.max_len, (state.pages - 1) * fastgen.PAGE)
    return (f"a sequence of {need} tokens (prompt {len(item.ids)} + max_new_tokens "
            f"{item.params['max_new_tokens']}, more than the {room} the fast engine holds here)")


def _run_fast(loaded: Loaded, group: list[fastgen.Seq], seed, eos: set[int], should_stop, on_event,
              stats: dict[str, Any], progress: Progress) -> Iterator[list[fastgen.Seq]]:
    """One group (same seed) to the end, yielding the sequences that finish together; an out-of-memory halves the
    slots and the cache and reruns the unfinished sequences."""
    model = loaded.model
    cap, fraction = fastgen.MAX_SLOTS, 1.0
    todo = list(group)
    while todo and not should_stop():
        if seed is not None:
            torch.manual_seed(seed)
        for seq in todo:
            seq.tokens, seq.slot, seq.pages, seq.done = [], -1, [], False
        finished: set[int] = set()
        engine = None
        try:
            state = prepare_fast(loaded, eos, fraction, progress)
            graphs = _fast_graphs(loaded)
            engine = fastgen.Engine(loaded, state, eos, slots=min(state.slots, len(todo), cap), graphs=graphs,
                                    compiled=graphs and fastgen.COMPILE)
            with torch.inference_mode():
                for seqs in engine.run(todo, should_stop, progress):
                    finished.update(id(seq) for seq in seqs)
                    yield seqs
        except torch.OutOfMemoryError:
            was = engine.slots if engine else cap
            if was <= 1:
                raise
            fastgen.release(model)
            _free_cuda_cache()
            cap, fraction = was // 2, fraction / 2
            on_event(f"out of memory in the fast engine with {was} slots: retrying the "
                     f"{len(todo) - len(finished)} unfinished sequences with at most {cap}")
        finally:
            if engine is not None:
                engine.record(stats)
        todo = [s for s in todo if id(s) not in finished]


# --- the continuous engine -----------------------------------------------------------------------------------

# Keys of the sampling parameters one continuous-batching manager shares (its GenerationConfig and seed).
MANAGER_WIDE = ("do_sample", "temperature", "top_p", "top_k", "seed")
CPU_PAGE_TOKENS = 32  # CPU: small explicit pages and cache (transformers sizes its cache from free GPU memory)
CPU_MAX_REQUESTS = 32
CPU_MAX_BATCH_TOKENS = 512
GPU_WINDOW = 8192  # requests queued in the manager at once on a GPU (transformers picks how many run together)


def _generate_continuous(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int, should_stop, on_event,
                         info: dict[str, Any], progress: Progress) -> Iterator[list[RowResult]]:
    started = time.time()
    ready: list[RowResult] = []  # finished rows not yet yielded
    groups: dict[str, list[Prepared]] = {}
    for item in prepare(loaded, spec, rows, started):
        if isinstance(item, RowResult):
            ready.append(item)
        elif item.params["repetition_penalty"] is not None:
            ready.append(RowResult(item.idx, prompt_tokens=len(item.ids), started_at=started, error=(
                "repetition_penalty is not supported by the continuous engine (transformers drops it): "
                "use engine padded or auto")))
        else:
            groups.setdefault(repr([item.params[k] for k in MANAGER_WIDE]), []).append(item)
    for group in groups.values():
        pending = {g.idx: g for g in group}
        concurrency = None if loaded.device.type == "cuda" else min(CPU_MAX_REQUESTS, sum(g.n for g in group))
        while pending:
            try:
                with contextlib.closing(_drive(loaded, spec, list(pending.values()), concurrency, should_stop,
                                                info, progress)) as it:
                    for result in it:
                        pending.pop(result.idx, None)
                        ready.append(result)
                        if len(ready) >= batch_rows:
                            yield _sorted(ready)
                            ready = []
                if should_stop():
                    return  # finished rows not yet yielded stay pending, like a cancelled padded batch
            except torch.OutOfMemoryError:
                was = concurrency or sum(g.n for g in pending.values())
                if was <= 1:
                    raise
                _free_cuda_cache()
                concurrency = max(1, was // 2)
                on_event(f"out of memory in continuous batching with up to {was} concurrent requests: retrying "
                         f"the {len(pending)} unfinished rows with up to {concurrency}")
    if ready and not should_stop():
        yield _sorted(ready)


def _sorted(results: list[RowResult]) -> list[RowResult]:
    return sorted(results, key=lambda r: r.idx)


def _drive(loaded: Loaded, spec: GenerateSpec, group: list[Prepared], concurrency: int | None, should_stop,
           info: dict[str, Any], progress: Progress) -> Iterator[RowResult]:
    """Run `group` through one continuous-batching manager; yield each row's result once all its n sequences are
    done. Raises torch.OutOfMemoryError (after stopping the manager) when the engine ran out of memory.

    The manager decodes in its own thread: progress is its step counter (`current_batch`) moving, read each time
    this loop polls (and each output it hands over). Until its first step the manager is warming up (cache, CUDA
    graphs): a phase for the stall watchdog."""
    tok, model = loaded.tokenizer, loaded.model
    requests = sum(g.n for g in group)
    faults.hit("generate", rows=concurrency or requests)
    config = _cb_config(loaded, spec, group, concurrency)
    manager = model.init_continuous_batching(generation_config=_manager_generation_config(loaded, group[0].params),
                                             continuous_batching_config=config)
    eos = _eos_ids(loaded)
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
                        g.ids, request_id=f"{g.idx}#{k}", max_new_tokens=g.params["max_new_tokens"],
                        eos_token_id=-1 if g.params["ignore_eos"] else sorted(eos))
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
        return RowResult(row.idx, prompt_tokens=len(row.ids), started_at=started,
                         error=f"failed inside the continuous engine: {errors[0]}")
    eos = set() if row.params["ignore_eos"] else eos
    return _row_result(tok, row, [_sequence(tok, list(o.generated_tokens), eos, row.params["stop"]) for o in outputs],
                       started)


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
        kwargs.update(use_cuda_graph=False, use_async_batching=False, num_blocks=pages * concurrency + 1,
                      max_batch_tokens=CPU_MAX_BATCH_TOKENS, max_requests_per_batch=concurrency)
        kwargs["page_size" if "page_size" in accepted else "block_size"] = CPU_PAGE_TOKENS  # 5.24 / 5.17 name
    return ContinuousBatchingConfig(**kwargs)


def _record_runtime(manager, config, info: dict[str, Any]) -> None:
    """What the manager resolved: CUDA graphs (varlen, decode), async batching, cache size."""
    processor = getattr(manager, "batch_processor", None)
    if processor is None:
        return
    runner = getattr(processor, "model_runner", None)
    cache = getattr(processor, "cache", None)
    info["cuda_graphs"] = {"varlen": getattr(runner, "use_cuda_graph_varlen", None),
                           "decode": getattr(runner, "use_cuda_graph_decode", None)}
    info["async_batching"] = getattr(processor, "use_async_batching", None)
    info["cache"] = {k: getattr(cache, k, None) for k in ("num_blocks", "max_batch_tokens", "block_size", "page_size")
                     if getattr(cache, k, None) is not None}
    info["max_requests_per_batch"] = getattr(config, "max_requests_per_batch", None)


# --- the static engine ---------------------------------------------------------------------------------------

# Attention implementations the static engine runs (a static KV cache, its 4D mask built outside the compiled step).
STATIC_ATTENTION = ("sdpa", "sdpa_gqa", "eager")
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


def _generate_static(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int, should_stop, on_event,
                     info: dict[str, Any], progress: Progress) -> Iterator[list[RowResult]]:
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
            groups.setdefault(repr(sorted(item.params.items())), []).append(item)
    compile_config, compile_reason = _static_compile_config(loaded)
    stats = info.setdefault("static", {"slots": batch_rows, "compiled": compile_config is not None,
                                       "compile_reason": compile_reason, "compile_s": 0.0, "compiles": [],
                                       "calls": 0, "dummy_rows": 0, "shapes": []})
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
                results = _static_call(loaded, call, width, started, should_stop, compile_config, stats, progress)
            except torch.OutOfMemoryError:
                if width <= 1 or width // 2 < call[0].n:
                    raise
                _free_cuda_cache()
                slots = width // 2
                stats["slots"] = slots
                on_event(f"out of memory generating {width} sequences together (static engine): retrying as "
                         f"calls of {slots}")
                todo.extendleft(reversed(call))
                continue
            if should_stop():
                return  # a cancelled call is not committed; its rows stay pending
            yield _sorted(ready + results)
            ready = []
    if ready and not should_stop():
        yield _sorted(ready)


def _static_compile_config(loaded: Loaded):
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
        return CPU_COMPILE, "cpu: compiled with the CompileConfig set in worker.generate.CPU_COMPILE"
    return None, "not compiled: CPU (torch.compile takes minutes there; the static cache runs uncompiled)"


def _raise_recompile_limit() -> None:
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < RECOMPILE_LIMIT:
        setattr(config, name, RECOMPILE_LIMIT)


def _static_call(loaded: Loaded, call: list[Prepared], slots: int, started: float, should_stop, compile_config,
                 stats: dict[str, Any], progress: Progress) -> list[RowResult]:
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
    kwargs = _generate_kwargs(tok, params, [StopFlag(should_stop, progress), DummyRows(real)])
    if params["seed"] is not None:
        torch.manual_seed(params["seed"])
    model._previous_max_cache_length = cache_len  # transformers would otherwise keep the longest cache seen
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs, **fixed)
    new = out[:real, enc["input_ids"].shape[1] :].tolist()
    stats["calls"] += 1
    stats["dummy_rows"] += slots - real
    if shape not in stats["shapes"]:
        stats["shapes"].append(shape)
    cache = _cache_size(model, slots, cache_len)
    if cache["bytes"] >= stats.get("cache", {}).get("bytes", 0):
        stats["cache"] = cache  # the largest cache this shard allocated
    eos = set() if params["ignore_eos"] else _eos_ids(loaded)
    results, at = [], 0
    for g in call:
        results.append(_row_result(tok, g, [_sequence(tok, t, eos, g.params["stop"]) for t in new[at : at + g.n]],
                                   started))
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
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=WARM_UP_STEPS,
                       min_new_tokens=WARM_UP_STEPS, do_sample=False, temperature=None, top_p=None, top_k=None,
                       pad_token_id=loaded.tokenizer.pad_token_id, **fixed)
    _sync(loaded.device)
    seconds = time.perf_counter() - t
    log.info("static engine: compiled and captured %d slots × %d cache tokens in %.1f s", slots,
             fixed["max_cache_len"], seconds)
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
    return {"slots": slots, "cache_len": cache_len, "bytes": slots * cache_len * per_token,
            "bytes_per_token": per_token}
