"""Generation over rows: plain functions, runnable without a queue. This module picks the engine and runs it; the
engines are worker/engines/ (one module each, one interface: worker/engines/__init__.py).

`generate()` yields one micro-batch of `RowResult`s at a time; the caller commits each before asking for the
next, so a crash loses at most one micro-batch. Four engines run the rows (spec field `engine`):

- `fast` (worker/engines/fast.py, the engine itself worker/engines/fastgen.py): continuous batching over a paged
  KV cache sized once from free memory, a Triton decode attention that reads each row's real context only, decode
  steps captured as CUDA graphs and the decoder layers compiled, all prepared when the worker loads the model
  (`prepare_engine`). Rows asking for repetition_penalty (or top_p or top_k while `fastgen.FILTERED_SAMPLING` is
  off), or longer than the cache holds, run padded under `auto` (`run_engine`) and fail under `fast`.
- `padded` (worker/engines/padded.py): micro-batches of `batch_rows` rows, left-padded, through `model.generate`.
- `continuous` (worker/engines/continuous.py): transformers' continuous batching, driven through its manager so
  results stream out as rows finish.
- `static` (worker/engines/static.py): `model.generate` with a static KV cache on `sdpa_gqa`, compiled on CUDA
  once per shape.

`auto` picks `fast` on CUDA for an unquantized model it can run, else `padded` (see `choose_engine`); with a
`paged|…` attention it picks `continuous`, the one engine that runs paged attention. Measured on
an H200 (G1, transformers 5.17, ops/bench/results/2026-12-03-h200): fast 54,772 output tok/s warm, the padded
engine ~5–7k, transformers' continuous batching 1,470 (session 2). What ran (engine, the attention that really
ran, CUDA graphs, cache size, compile and capture times) is written into the `info` dict the caller passes, for
the shard's metrics and the job's load options. An engine other than `fast` first releases the fast engine's
resident cache (`slot_state.release`).

`num_return_sequences` n > 1 gives a row n samples: its `output` is a list of n strings, `finish_reason` a list
of n reasons and `completion_tokens` their sum; n == 1 keeps a plain string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from core.errors import InvalidInput
from core.leases import RowResult
from core.spec import GenerateSpec, sampling_of
from worker.engines import continuous, fast, fastgen, padded, slot_state, static
from worker.loader import Loaded
from worker.progress import Progress

ENGINES = {"fast": fast, "padded": padded, "static": static, "continuous": continuous}


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
    if spec.kv_cache_dtype != "auto" and engine != "fast":  # engine auto chose another (others are refused at submit)
        on_event(
            f"kv_cache_dtype {spec.kv_cache_dtype} not applied: the rows run on engine {engine} with the model's "
            f"dtype ({reason})"
        )
    yield from run_engine(
        engine,
        loaded,
        spec,
        rows,
        batch_rows=batch_rows,
        should_stop=should_stop,
        on_event=on_event,
        info=info,
        progress=progress,
    )


def run_engine(
    name: str,
    loaded: Loaded,
    spec: GenerateSpec,
    rows: list[tuple[int, dict[str, Any]]],
    *,
    batch_rows: int,
    should_stop: Callable[[], bool],
    on_event: Callable[[str], None],
    info: dict[str, Any],
    progress: Progress,
) -> Iterator[list[RowResult]]:
    """`rows` through engine `name` (worker/engines/__init__.py: the interface). The rows the fast engine returns
    (those it cannot run under `auto`) run on the padded engine after it."""
    kwargs = dict(batch_rows=batch_rows, should_stop=should_stop, on_event=on_event, progress=progress)
    if name != "fast":
        slot_state.release(loaded.model)  # the fast engine's resident cache would take the memory this engine needs
    left = yield from ENGINES[name].run(loaded, spec, rows, info=info, **kwargs)
    if left:
        if spec.kv_cache_dtype != "auto":
            on_event(f"kv_cache_dtype {spec.kv_cache_dtype} not applied to {len(left)} rows the fast engine cannot run")
        slot_state.release(loaded.model)  # the padded engine needs the memory of the fast engine's cache
        # a scratch `info`: the job's keeps what the fast engine recorded (its attention among it)
        yield from padded.run(loaded, spec, left, info={}, **kwargs)


def choose_engine(spec: GenerateSpec, loaded: Loaded) -> tuple[str, str]:
    """The engine for this spec on this model, and why. `auto`: `continuous` for a `paged|…` attention, `fast` on
    CUDA for an unquantized model it can run, else `padded` (see the module docstring). `fast`, `static` and
    `continuous` refuse a model or attention they cannot run, `padded` a paged attention (InvalidInput, before any
    GPU work)."""
    if spec.engine == "padded":
        if spec.attn_implementation.startswith("paged|"):  # refused at submit too (core/capability.py)
            raise InvalidInput(f"engine padded cannot run {spec.attn_implementation}: use engine continuous or auto")
        return "padded", "asked for"
    problem = fastgen.model_problem(loaded.model)
    paged = spec.attn_implementation.startswith("paged|")  # under auto: the continuous engine, the one that runs it
    if spec.engine == "auto" and not paged:
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
        if attn.startswith("paged|") or attn not in static.ATTENTION:
            raise InvalidInput(
                f"engine static cannot run attention {attn!r}: use one of "
                f"{', '.join(static.ATTENTION)}, or engine padded"
            )
        return "static", "asked for"
    attn = attn.removeprefix("paged|")
    if attn not in continuous.ATTENTION:
        raise InvalidInput(
            f"engine continuous cannot run attention {attn!r}: use one of "
            f"{', '.join(continuous.ATTENTION)}, or engine padded"
        )
    if spec.engine == "auto":
        return "continuous", f"auto: continuous, the engine that runs {spec.attn_implementation}"
    return "continuous", "asked for"


def prepare_engine(loaded: Loaded, spec: GenerateSpec, progress: Progress | None = None) -> dict[str, Any] | None:
    """Prepare what the engine for `spec` keeps on the model, right after loading, so that no job pays for it:
    the fast engine's cache, compiled layers and the CUDA graphs of `spec`'s mode, greedy or sampling (the other
    mode's are captured when a step first needs them: a restarted worker's first row comes sooner). Phases of
    `progress`. Returns what it did (for the load event), or None."""
    try:
        name, _ = choose_engine(spec, loaded)
    except InvalidInput:
        return None  # the job fails with that reason when it runs
    if name != "fast":
        return None
    state = fast.prepared_state(
        loaded,
        progress=progress,
        sampling=(sampling_of(spec, None)["do_sample"],),
        kv_cache_dtype=spec.kv_cache_dtype,
    )
    summary = slot_state.summary(state)
    if state.compiled:
        from worker import compile_cache

        summary["compile_cache"] = compile_cache.stats()  # hits: compiled code read from JOBS_HOME, not compiled
    return summary
