"""The padded engine (`engine: padded`, and `auto` off CUDA): micro-batches of `batch_rows` rows, left-padded,
through `model.generate`.

Rows with different sampling parameters never share a call. Sampling with a `seed` reseeds torch per call, so a job
is reproducible for the same batching. On CUDA a grouped-query model loaded with `sdpa` runs `sdpa_gqa`
(worker/attention.py). A CUDA out-of-memory splits the failing group in halves, down to one row, each retry reported
through `on_event`. It also runs the rows the fast engine leaves under `auto` (worker/generate.py `run_engine`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from transformers import LogitsProcessorList

from core.leases import RowResult
from core.spec import GenerateSpec
from worker import faults
from worker.engines.common import (
    Extras,
    Prepared,
    StopFlag,
    eos_ids,
    free_cuda_cache,
    generate_kwargs,
    group_key,
    padded_attention,
    prepare,
)
from worker.loader import Loaded
from worker.progress import Progress


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
    """The engine's entry (worker/engines/__init__.py): `rows` under the padded attention, recorded in `info`."""
    with padded_attention(loaded, on_cuda=loaded.device.type == "cuda") as attn:
        info["attn_implementation"] = attn
        yield from _generate_padded(
            loaded, spec, rows, batch_rows=batch_rows, should_stop=should_stop, on_event=on_event, progress=progress
        )


def _generate_padded(
    loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int, should_stop, on_event, progress: Progress
) -> Iterator[list[RowResult]]:
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
                groups.setdefault(group_key(item.params), []).append(item)
        for group in groups.values():
            results.extend(_run_splitting(loaded, group, started, should_stop, on_event, progress))
        if should_stop():
            return  # a cancelled or interrupted batch is not committed; its rows stay pending
        results.sort(key=lambda r: r.idx)
        yield results


def _run_splitting(loaded: Loaded, group, started: float, should_stop, on_event, progress: Progress) -> list[RowResult]:
    try:
        return _run_group(loaded, group, started, should_stop, progress)
    except torch.OutOfMemoryError:
        if len(group) == 1:
            raise
    # retried here, after the except block: inside it the exception's traceback would keep the failed call's
    # tensors alive (on an H200 each retry then failed for lack of the memory the previous one still held)
    free_cuda_cache()
    half = len(group) // 2
    on_event(f"out of memory generating {len(group)} rows together: retrying as {half} + {len(group) - half}")
    return _run_splitting(loaded, group[:half], started, should_stop, on_event, progress) + _run_splitting(
        loaded, group[half:], started, should_stop, on_event, progress
    )


def _run_group(
    loaded: Loaded, group: list[Prepared], started: float, should_stop, progress: Progress
) -> list[RowResult]:
    faults.hit("generate", rows=len(group))
    tok, model = loaded.tokenizer, loaded.model
    params = group[0].params
    n = group[0].n
    enc = tok.pad({"input_ids": [g.ids for g in group]}, padding=True, return_tensors="pt").to(loaded.device)
    kwargs = generate_kwargs(tok, params, [StopFlag(should_stop, progress)])
    extras = Extras(loaded, [g.params for g in group for _ in range(n)])  # grammar masks, logprobs: if asked
    if extras.processors():
        kwargs["logits_processor"] = LogitsProcessorList(extras.processors())
    if n > 1:
        kwargs["num_return_sequences"] = n  # outputs come back row by row: row 0's n samples, then row 1's
    if params["seed"] is not None:
        torch.manual_seed(params["seed"])
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    extras.finish(new, out[:, -1])
    eos = set() if params["ignore_eos"] else eos_ids(loaded)
    return [
        extras.result(g, list(range(i * n, (i + 1) * n)), new[i * n : (i + 1) * n], eos, started)
        for i, g in enumerate(group)
    ]
