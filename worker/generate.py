"""Generation over rows: plain functions, runnable without a queue.

`generate()` yields one micro-batch of `RowResult`s at a time; the caller commits each before asking for the
next, so a crash loses at most one micro-batch. Rows with different sampling parameters never share a
`model.generate` call. Sampling with a `seed` reseeds torch per call, so a job is reproducible for the same
batching.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from core.leases import RowResult
from core.spec import GenerateSpec, sampling_of
from worker import faults
from worker.loader import Loaded

log = logging.getLogger(__name__)


class StopFlag(StoppingCriteria):
    """Ends a running `generate` between decode steps when the job is cancelled or the worker shuts down."""

    def __init__(self, should_stop: Callable[[], bool]):
        self.should_stop = should_stop

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.should_stop(), dtype=torch.bool, device=input_ids.device)


def render(loaded: Loaded, row_input: dict[str, Any]) -> list[int]:
    tok = loaded.tokenizer
    if "messages" in row_input:
        text = tok.apply_chat_template(row_input["messages"], add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(row_input["prompt"])["input_ids"]


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
) -> Iterator[list[RowResult]]:
    """Yield results micro-batch by micro-batch for `rows` = [(idx, stored row input)].

    A CUDA out-of-memory splits the failing group in halves and retries them (down to one row, then the error
    propagates and the shard's attempt fails); each split is reported through `on_event`.
    """
    for start in range(0, len(rows), batch_rows):
        if should_stop():
            return
        started = time.time()
        batch = rows[start : start + batch_rows]
        results: list[RowResult] = []
        groups: dict[str, list[tuple[int, dict[str, Any], dict[str, Any], list[int]]]] = {}
        for idx, row_input in batch:
            params = sampling_of(spec, row_input.get("params"))
            try:
                ids = render(loaded, row_input)
            except Exception as exc:  # e.g. a chat template that refuses these messages: this row fails alone
                results.append(RowResult(idx, started_at=started, error=f"cannot build the prompt: {exc}"))
                continue
            limit = context_limit(loaded)
            if limit and len(ids) + params["max_new_tokens"] > limit:
                results.append(RowResult(idx, prompt_tokens=len(ids), started_at=started, error=(
                    f"prompt of {len(ids)} tokens + max_new_tokens {params['max_new_tokens']} exceeds the model's "
                    f"context of {limit} tokens: shorten the prompt or lower max_new_tokens")))
                continue
            groups.setdefault(repr(sorted(params.items())), []).append((idx, row_input, params, ids))
        for group in groups.values():
            results.extend(_run_splitting(loaded, group, started, should_stop, on_event))
        if should_stop():
            return  # a cancelled or interrupted batch is not committed; its rows stay pending
        results.sort(key=lambda r: r.idx)
        yield results


def _run_splitting(loaded: Loaded, group, started: float, should_stop, on_event) -> list[RowResult]:
    try:
        return _run_group(loaded, group, started, should_stop)
    except torch.OutOfMemoryError:
        if len(group) == 1:
            raise
        _free_cuda_cache()
        half = len(group) // 2
        on_event(f"out of memory generating {len(group)} rows together: retrying as {half} + {len(group) - half}")
        return (_run_splitting(loaded, group[:half], started, should_stop, on_event)
                + _run_splitting(loaded, group[half:], started, should_stop, on_event))


def _free_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_group(loaded: Loaded, group, started: float, should_stop) -> list[RowResult]:
    faults.hit("generate", rows=len(group))
    tok, model = loaded.tokenizer, loaded.model
    params = group[0][2]
    enc = tok.pad({"input_ids": [g[3] for g in group]}, padding=True, return_tensors="pt").to(loaded.device)
    kwargs = dict(max_new_tokens=params["max_new_tokens"], do_sample=params["do_sample"],
                  pad_token_id=tok.pad_token_id, stopping_criteria=StoppingCriteriaList([StopFlag(should_stop)]))
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
    if params["seed"] is not None:
        torch.manual_seed(params["seed"])
    with torch.inference_mode():
        out = model.generate(**enc, **kwargs)
    new = out[:, enc["input_ids"].shape[1] :].tolist()
    eos = set() if params["ignore_eos"] else _eos_ids(loaded)
    return [_result(tok, idx, len(ids), tokens, eos, p["stop"], started) for (idx, _, p, ids), tokens in zip(group, new)]


def _eos_ids(loaded: Loaded) -> set[int]:
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def _result(tok, idx: int, prompt_len: int, tokens: list[int], eos: set[int], stop: list[str] | None,
            started: float) -> RowResult:
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
    return RowResult(idx, output=text, finish_reason=finish, prompt_tokens=prompt_len,
                     completion_tokens=len(kept), started_at=started)


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
