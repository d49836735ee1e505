"""What every generation engine shares: rows rendered to token ids (`Prepared`, `prepare`, `render_many`), the
`model.generate` pieces of the padded and static engines (`StopFlag`, `generate_kwargs`, `padded_attention`), a
generated sequence cut and counted (`sequence`) and turned into the row's result (`row_result`), what a batch asks
beyond tokens (`Extras`: grammar masks and log-probabilities, worker/engines/grammar.py and logprobs.py), EOS ids,
and the allocator's cache given back after an out-of-memory (`free_cuda_cache`). Engines import this module, never
each other (worker/engines/__init__.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from core import structured
from core.dataset import several_greedy, too_long
from core.leases import RowResult
from core.spec import GenerateSpec, sampling_of
from worker import attention, faults
from worker.engines import grammar, logprobs
from worker.loader import Loaded
from worker.progress import Progress

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
        chunk = rows[start : start + RENDER_BATCH]
        for (idx, row_input), ids in zip(chunk, render_many(loaded, [r for _, r in chunk])):
            item = _prepared(idx, row_input, ids, spec, limit, started)
            problem = isinstance(item, Prepared) and _grammar_problem(loaded, item.params)
            yield RowResult(idx, prompt_tokens=len(ids), started_at=started, error=problem) if problem else item


def _grammar_problem(loaded: Loaded, params: dict[str, Any]) -> str | None:
    """Why the row's constraint does not compile against this model's tokenizer (it compiled without one at
    submit), or None; the compiled grammar is kept for the engine (worker/engines/grammar.py)."""
    text = structured.grammar(params)
    if text is None:
        return None
    try:
        grammar.compiled(loaded.tokenizer, vocab_width(loaded), eos_ids(loaded), text)
    except ValueError as exc:
        return str(exc)
    return None


def vocab_width(loaded: Loaded) -> int:
    """The width of the model's logits (its output layer may be padded past the tokenizer's vocabulary)."""
    head = loaded.model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return weight.shape[0] if weight is not None and weight.dim() == 2 else loaded.model.config.vocab_size


def _prepared(
    idx: int,
    row_input: dict[str, Any],
    ids: list[int] | Exception,
    spec: GenerateSpec,
    limit: int | None,
    started: float,
) -> Prepared | RowResult:
    params = sampling_of(spec, row_input.get("params"))
    if isinstance(ids, Exception):  # e.g. a chat template that refuses these messages: this row fails alone
        return RowResult(idx, started_at=started, error=f"cannot build the prompt: {ids}")
    if limit and len(ids) + params["max_new_tokens"] > limit:
        return RowResult(
            idx, prompt_tokens=len(ids), started_at=started, error=too_long(len(ids), params["max_new_tokens"], limit)
        )
    if (params.get("num_return_sequences") or 1) > 1 and not params["do_sample"]:
        return RowResult(
            idx, prompt_tokens=len(ids), started_at=started, error=several_greedy(params["num_return_sequences"])
        )
    return Prepared(idx, params, ids)


def free_cuda_cache() -> None:
    if torch.cuda.is_available():
        import gc

        gc.collect()  # tensors of a failed call held in reference cycles (frames, tracebacks) go first
        torch.cuda.empty_cache()


def generate_kwargs(tok, params: dict[str, Any], criteria: list[StoppingCriteria]) -> dict[str, Any]:
    """`model.generate` keyword arguments for one group's sampling parameters (padded and static engines)."""
    kwargs = dict(
        max_new_tokens=params["max_new_tokens"],
        do_sample=params["do_sample"],
        pad_token_id=tok.pad_token_id,
        stopping_criteria=StoppingCriteriaList(criteria),
    )
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


def eos_ids(loaded: Loaded) -> set[int]:
    eos = loaded.model.generation_config.eos_token_id
    if eos is None:
        eos = loaded.tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos])


def sequence(tok, tokens: list[int], eos: set[int], stop: list[str] | None) -> tuple[str, str, int]:
    """One generated sequence as (text, finish_reason, completion tokens): cut at EOS or before a stop string."""
    return sequences(tok, [(tokens, eos, stop)])[0]


def sequences(tok, items: list[tuple[list[int], set[int], list[str] | None]]) -> list[tuple[str, str, int]]:
    """`sequence` for many (tokens, eos, stop) at once: the texts are decoded in one batch (`decode_many`)."""
    cut = []
    for tokens, eos, _ in items:
        end = next((i for i, t in enumerate(tokens) if t in eos), None)
        cut.append((tokens[: end + 1] if end is not None else tokens, "stop" if end is not None else "length"))
    out = []
    for (kept, finish), text, (_, _, stop) in zip(cut, decode_many(tok, [k for k, _ in cut]), items):
        hits = [s for s in stop or [] if s in text]
        if hits:
            # `generate` ends a row on the token that completes a stop string and pads it after that (with a pad
            # token that may be an EOS): count the tokens through the stop string, not the padding, whatever the
            # batch.
            kept = kept[: min(_tokens_through(tok, kept, s) for s in hits)]
            text, finish = text[: min(text.index(s) for s in hits)], "stop"
        out.append((text, finish, len(kept)))
    return out


def decode_many(tok, token_lists: list[list[int]]) -> list[str]:
    """`tok.decode(tokens, skip_special_tokens=True)` of each list, in one call to the Rust tokenizer where that
    gives the same text (a fast tokenizer that cleans up no spaces): it decodes in parallel and skips transformers'
    per-token conversion, which cost 0.2 s of host time per 1,024 rows of 256 tokens (G1 on the H200)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or getattr(tok, "clean_up_tokenization_spaces", False) or len(token_lists) < 2:
        return [tok.decode(tokens, skip_special_tokens=True) for tokens in token_lists]
    return backend.decode_batch(token_lists, skip_special_tokens=True)


def row_result(
    tok, row: Prepared, sequences: list[tuple[str, str, int]], started: float, lps: list | None = None
) -> RowResult:
    """A row's result: one sequence stores plain text; n > 1 store a list of texts and a list of finish reasons
    (and `lps`, one log-probability list per sequence, alike)."""
    texts, finishes, counts = zip(*sequences)
    if len(sequences) == 1:
        return RowResult(
            row.idx,
            output=texts[0],
            finish_reason=finishes[0],
            prompt_tokens=len(row.ids),
            completion_tokens=counts[0],
            started_at=started,
            logprobs=None if lps is None else lps[0],
        )
    return RowResult(
        row.idx,
        output=list(texts),
        finish_reason=list(finishes),
        prompt_tokens=len(row.ids),
        completion_tokens=sum(counts),
        started_at=started,
        logprobs=lps,
    )


class Extras:
    """What a batch of sequences asks beyond its tokens, in the batch's row order (`params`: each sequence's
    effective parameters): grammar masks (`guides`) and log-probabilities. Empty, and adds nothing to a step, when
    no sequence asks. `processors()` go into `model.generate` (padded and static engines); the fast engine fills
    `guides` and `lp` itself (worker/engines/fast.py)."""

    def __init__(self, loaded: Loaded, params: list[dict[str, Any]]):
        self.tok, self.eos, self.vocab = loaded.tokenizer, eos_ids(loaded), vocab_width(loaded)
        self.k = [logprobs.wanted(p) for p in params]
        constrained = any(structured.constraint(p) for p in params)
        self.guides = grammar.guides(self.tok, self.vocab, self.eos, params) if constrained else [None] * len(params)
        self.asked = any(k is not None for k in self.k)
        self.tokens = logprobs.Tokens(self.tok, self.vocab, self.eos) if self.asked else None
        self.lp: list[Any] = [None] * len(params)  # per sequence: arrays of picked, top values, top ids per step
        self._recorder = logprobs.Recorder(max(k or 0 for k in self.k)) if self.asked else None
        self._mask = grammar.Processor(self.guides, self.vocab) if constrained else None

    def processors(self) -> list:
        return [p for p in (self._recorder, self._mask) if p is not None]  # logprobs see the unmasked logits

    def finish(self, new: list[list[int]], last: torch.Tensor) -> None:
        """After `generate`: `new` the generated tokens per sequence, `last` the last step's tokens (a tensor)."""
        if self._mask is not None:
            self._mask.finish(new)
        if self._recorder is not None:
            self.lp = self._recorder.finish(last)

    def result(self, row: Prepared, seqs: list[int], tokens: list[list[int]], eos: set[int], started: float):
        """The RowResult of `row` from its sequences (`seqs`: their places in the batch, `tokens`: theirs)."""
        error = grammar.failure([self.guides[i] for i in seqs])
        if error:
            return RowResult(row.idx, prompt_tokens=len(row.ids), started_at=started, error=error)
        cut = [sequence(self.tok, t, eos, row.params["stop"]) for t in tokens]
        k = self.k[seqs[0]]
        lps = None
        if k is not None:
            lps = [
                logprobs.pack(self.tokens, t[:count], *self.lp[i], k) for i, t, (_, _, count) in zip(seqs, tokens, cut)
            ]
        return row_result(self.tok, row, cut, started, lps)


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


PER_SEQUENCE = (*structured.CONSTRAINT_KEYS, "logprobs", "top_logprobs")  # parameters a shared call runs per row


def group_key(params: dict[str, Any]) -> str:
    """Rows whose keys are equal can share one `model.generate` call: their parameters differ at most in what
    runs per sequence (constraints, log-probabilities)."""
    return repr(sorted((k, v) for k, v in params.items() if k not in PER_SEQUENCE))


def idx_sorted(results: list[RowResult]) -> list[RowResult]:
    return sorted(results, key=lambda r: r.idx)
