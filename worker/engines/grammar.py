"""Structured outputs in the engines: a row's grammar (core/structured.py) against the model's tokenizer, one
matcher per generated sequence, and the grammar's mask applied to the logits on the device before sampling.

- The tokenizer is converted for llguidance once per (tokenizer, vocabulary width, EOS ids) and kept on the
  tokenizer object (`lltokenizer`; about a second for a 150k vocabulary).
- A grammar is compiled once per (grammar, tokenizer, family): the compiled matchers are kept (least recently used
  out past COMPILED) and each sequence gets a copy of one of them (`deep_copy`, cheap), advanced by the tokens that
  sequence picks.
- Families: llguidance's copies of a matcher share its lexer behind one mutex, which a copy holds while it computes
  its mask (parser.rs, `Parser::with_shared`), so the executor's threads would compute the copies of one matcher
  one at a time. Each grammar is therefore compiled FAMILIES times (one per executor thread, ~0.5 ms each, when a
  family first needs it), sequences are dealt to families in turn, and `fill` hands the executor its rows grouped
  by family, so that each thread's contiguous share of the list is mostly one family's. With FAMILY_THREADS each
  family has an executor and a thread of its own instead (`by_family`).
- A step's masks are computed on the CPU for every constrained sequence at once by llguidance's executor (its own
  threads, without the GIL) into one int32 bitmask row per sequence (bit j of word w allows token 32·w + j), copied
  to the device and unpacked there into -inf on every token the grammar forbids (`apply`; or, for a greedy step
  with FUSED_PICK, read by the kernel that picks the tokens, `masked_argmax`). An unconstrained row's
  bitmask row is all ones: a batch mixing constrained and free rows needs no other flag.
- EOS: the EOS ids the engine stops on are the grammar's end: the mask allows them only where the grammar may end
  (an accepting state), and once the grammar can take nothing more they are all it allows.

The padded and static engines apply the mask as a transformers LogitsProcessor (`Processor`: after the
repetition penalty, before temperature, top-k and top-p, as `generate` orders a custom processor); the fast engine
calls `fill` and `apply` around its own sampling (worker/engines/fastgen.py). Nothing here runs for a batch that
asks for no constraint.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import os
import threading
from typing import Any

import torch
from transformers import LogitsProcessor

from core import structured
from worker.engines import decode_attention
from worker.engines.decode_attention import triton  # None where the install has no triton

COMPILED = 256  # compiled grammars kept per tokenizer (each with up to FAMILIES matchers)
_CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1  # (macOS: all)
THREADS = min(32, max(1, _CPUS * 80 // 100))  # llguidance's default: 80 % of the CPUs, 1 to 32
FAMILIES = THREADS  # independent compiled matchers per grammar (the module docstring says why)
# The fast engine books a decode step's tokens with `advance` (the executor's threads, each family's rows on one)
# instead of `Guide.take` row by row. Off until measured on a host with many CPUs: at 2 threads here it gained
# nothing (ops/bench/results/2026-12-05-cpu-families); gen.py g1json times both in one run.
PARALLEL_ADVANCE = False
# Each family's masks (and, with PARALLEL_ADVANCE, its tokens) on an executor of its own with one thread, the
# families at once from threads of ours (`by_family`), instead of one executor whose threads take any family's rows:
# those contend for a family's mutex (12 families on 12 threads made the masks only 3.3x faster than one on the
# H100 host). On: G1-JSON on a 151,936-token tokenizer ran 1.164 and 1.178x faster with it in two runs on an H100
# (spreads 8-13 %), and on the benchmark model's 640 tokens 0.975x, within that run's 17 % spread
# (ops/bench/results/2026-12-06-h100).
FAMILY_THREADS = True
# The fast engine picks a greedy step's tokens under a grammar with one Triton kernel (`masked_argmax`: it reads the
# bitmask and the logits the grammar allows, and writes only the tokens) instead of masking the logits (`apply`)
# and then taking torch's argmax. Off: 0.20 against 1.05 ms a step on an H100, but G1-JSON was no faster with it
# (`other_pick_gain` 0.909: the host is the critical path); worth timing again once a step's host work is shorter
# than its forward. Tested against those two steps in Triton's interpreter (tests/test_engine_structured.py).
FUSED_PICK = False
PICK_BLOCK = 2048  # tokens a program of the fused pick reads at a time (one program a row)
# The fast engine computes a step's masks while it books the tokens of the step before (`Masks`): it books the rows
# family by family, and each family's masks start on the family's own executor as soon as its rows are booked, so
# that the booking (Python, in the engine's thread) and the masks (llguidance's threads, without the GIL) overlap
# instead of following each other on the host's critical path (on the H100, booking ~3.1 ms then masks ~5.4 ms a
# G1-JSON step, against a ~6 ms forward). A family at a time, since booking a row likely takes its family's mutex too
# (the module docstring): masks sent every 128 rows in slot order made the booking slower. Off until a GPU host has
# timed it (gen.py g1json's `other_overlap_gain`; grammar_step.py).
OVERLAP = False
# Check first (the fast engine, rows without logprobs): a constrained row's token is picked without its mask and
# checked when it is booked (`Guide.check`, ~2-5 µs a row); only a refused token costs a mask, and that row redoes
# the position (fastgen `Engine._refused`: the step launched after it is dropped), its next CHECK_BACKOFF picks
# masked (doubled after each refusal, up to CHECK_BACKOFF_MAX). Exact: under greedy the allowed argmax is the masked
# one; under sampling (the fast engine samples with temperature alone), a refused draw redone from the masked
# distribution p/Z gives p(t) + (1 - Z) p(t) / Z = p(t) / Z.
# Why: a mask costs ~80 µs of one CPU a row inside a JSON string on a ~90k-token tokenizer, so 1,024 rows take
# ~78 ms of CPU a step, more than a 16-CPU host's threads can hide behind a ~5 ms forward
# (ops/bench/results/2026-12-05-cpu-mask-cache). On: on an H100, with an 89k-token BPE, a model that follows
# G1-JSON's schema ran 1.65x, 1.70x and 1.75x faster with it (compact JSON, a quarter and all of its objects spaced;
# no token refused, the same outputs; ops/bench/results/2026-12-06-h100-2).
# A row that was refused CHECK_ROW_GIVE_UP times is masked from then on (a model that writes a form its grammar
# refuses, a key order or a layout of its own, writes it again further on), and a run whose model writes what its
# grammars refuse stops checking: once CHECK_SAMPLE tokens were checked, if more than CHECK_GIVE_UP of them were
# refused, every row of the run is masked from then on (a random-weight model refuses most: G1-JSON's runs with the
# lever flipped on gave 0.97-1.13 of those without it in six H100 runs, within their spreads).
CHECK_FIRST = True
CHECK_BACKOFF = 4
CHECK_BACKOFF_MAX = 64
CHECK_ROW_GIVE_UP = 2  # refusals after which a row is masked for good (0: never)
CHECK_SAMPLE = 256
CHECK_GIVE_UP = 0.25
_executor = None
_family_executors: list = []  # FAMILY_THREADS and OVERLAP: one single-threaded executor per family
_pool = None  # FAMILY_THREADS and OVERLAP: the threads that make the families' calls
_lock = threading.Lock()
_dealt = itertools.count()  # sequences dealt to families in turn


def lltokenizer(tok, vocab: int, eos: set[int]):
    """llguidance's view of `tok` (fast tokenizers only), its vocabulary `vocab` wide (the logits' width: a model
    may pad its output layer past the tokenizer), ending on `eos`. Kept on the tokenizer object."""
    import llguidance.hf

    cache = tok.__dict__.setdefault("_gpujobs_lltok", {})
    key = (vocab, tuple(sorted(eos)))
    if key not in cache:
        eos_ids = sorted(eos) or [tok.eos_token_id]
        try:
            cache[key] = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos_ids)
        except ValueError as exc:
            raise ValueError(
                f"structured outputs and logprobs need a fast (Rust) tokenizer: {exc}; this model's tokenizer is "
                f"{type(tok).__name__}"
            ) from None
    return cache[key]


def compiled(tok, vocab: int, eos: set[int], text: str, family: int = 0):
    """The matcher compiled from grammar `text` for this tokenizer (its initial state) in `family`, or raise
    ValueError with llguidance's reason. Compiled once per (grammar, tokenizer, family); a grammar's matchers go
    together, least recently used out past COMPILED grammars."""
    from llguidance import LLMatcher

    cache: collections.OrderedDict = tok.__dict__.setdefault("_gpujobs_grammars", collections.OrderedDict())
    key = (vocab, tuple(sorted(eos)), text)
    with _lock:
        if key in cache:
            cache.move_to_end(key)
            if family in cache[key]:
                return cache[key][family]
    matcher = LLMatcher(lltokenizer(tok, vocab, eos), text, log_level=0)
    if matcher.is_error():
        raise ValueError(f"the grammar engine (llguidance) cannot compile this constraint: {matcher.get_error()}")
    with _lock:
        family_of = cache.setdefault(key, {})
        cache.move_to_end(key)
        matcher = family_of.setdefault(family, matcher)  # another thread may have compiled it meanwhile
        while len(cache) > COMPILED:
            cache.popitem(last=False)
    return matcher


def executor():
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor(num_threads=THREADS)
    return _executor


def by_family(groups: dict[int, list], call: str, *args) -> list:
    """`executor.call(items, *args)` for each family's items (FAMILY_THREADS: on the family's own single-threaded
    executor, every family at once: the first in this thread, the others on threads of the pool; llguidance drops
    the GIL in the call) and the results by family, in `groups`' order; otherwise all the items in one call to the
    shared executor, grouped by family. An error in any family's call is raised here, after every call ended."""
    if not FAMILY_THREADS:
        return [getattr(executor(), call)([item for items in groups.values() for item in items], *args)]
    (first, items), *others = groups.items()
    futures = [_on_family(family, call, these, *args) for family, these in others]
    try:
        results = [getattr(_family_executor(first), call)(items, *args)]
    finally:
        concurrent.futures.wait(futures)  # none still writes into the caller's memory
    return results + [future.result() for future in futures]


def _family_executor(family: int):
    """The single-threaded executor of `family` (FAMILY_THREADS, OVERLAP), made with the others on first use."""
    global _pool
    with _lock:
        while len(_family_executors) < FAMILIES:
            import llguidance

            _family_executors.append(llguidance.LLExecutor(num_threads=1))
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(FAMILIES, thread_name_prefix="grammar-family")
    return _family_executors[family % FAMILIES]


def _on_family(family: int, call: str, *args) -> concurrent.futures.Future:
    """`call(*args)` on `family`'s executor, from a thread of the pool."""
    method = getattr(_family_executor(family), call)  # (the pool made with it)
    return _pool.submit(method, *args)


class Guide:
    """The grammar state of one generated sequence: its matcher (a copy of its family's compiled one), whether it
    has ended (EOS taken) and why it failed (a token its grammar refused: the mask makes that impossible, so it is a
    bug, reported on the row)."""

    def __init__(self, matcher, eos: set[int], family: int = 0):
        self.matcher, self.eos, self.family = matcher, eos, family
        self.ended = False
        self.error: str | None = None
        self.checks = False  # CHECK_FIRST for this row (the engine sets it)
        self.masked_for = 0  # picks left to mask after a refusal
        self.refusals = 0

    @property
    def checking(self) -> bool:
        """Its next token is picked without its mask and checked when it is booked (CHECK_FIRST)."""
        return self.checks and self.masked_for == 0 and self.live

    def check(self, token: int) -> bool:
        """Advance by `token`, picked without the mask, if the grammar allows it. If not, nothing changes but the
        count of refusals, and the row's next picks are masked for a while (longer after each refusal), or for good
        after CHECK_ROW_GIVE_UP refusals."""
        if token in self.eos:
            ok = self.ended = self.matcher.is_accepting()
        else:
            ok = self.matcher.try_consume_tokens([token]) == 1
        if not ok:
            self.refusals += 1
            self.masked_for = min(CHECK_BACKOFF << (self.refusals - 1), CHECK_BACKOFF_MAX)
            if CHECK_ROW_GIVE_UP and self.refusals >= CHECK_ROW_GIVE_UP:
                self.checks = False
        return ok

    def take(self, token: int) -> None:
        """Advance by the token the engine picked under the mask (nothing once the sequence ended or failed)."""
        self.masked_for = max(0, self.masked_for - 1)
        if self.ended or self.error:
            return
        if token in self.eos:
            self.ended = True
            return
        if not self.matcher.consume_token(token):
            self.error = f"the constrained output left its grammar at a token it refused: {self.matcher.get_error()}"

    @property
    def live(self) -> bool:
        return not (self.ended or self.error)

    def reset(self) -> None:
        self.matcher.reset()
        self.ended, self.error = False, None
        self.masked_for = self.refusals = 0


def guides(tok, vocab: int, eos: set[int], params_list: list[dict[str, Any]]) -> list[Guide | None]:
    """One Guide per sequence (None where its parameters ask for no constraint), dealt to the FAMILIES in turn;
    raises ValueError for a grammar the engine cannot compile (the engines fail that row with the reason)."""
    out: list[Guide | None] = []
    for params in params_list:
        text = structured.grammar(params)
        if text is None:
            out.append(None)
            continue
        family = next(_dealt) % FAMILIES
        out.append(Guide(compiled(tok, vocab, eos, text, family).deep_copy(), eos, family))
    return out


def advance(steps: list[tuple[Guide, int]]) -> None:
    """Advance each Guide by its token, like `Guide.take` on each, with one call: the matchers consume their tokens
    in llguidance's executor (its threads, without the GIL; FAMILY_THREADS: a call per family, all at once)."""
    guides: dict[int, list[Guide]] = {}  # by family, as in `fill`
    tokens: dict[int, list] = {}
    for guide, token in steps:
        guide.masked_for = max(0, guide.masked_for - 1)
        if not guide.live:
            continue
        if token in guide.eos:
            guide.ended = True
            continue
        guides.setdefault(guide.family, []).append(guide)
        tokens.setdefault(guide.family, []).append((guide.matcher, token))
    if not tokens:
        return
    taken = (ok for oks in by_family(tokens, "consume_token_par") for ok in oks)
    for guide, ok in zip((guide for these in guides.values() for guide in these), taken):
        if not ok:
            guide.error = f"the constrained output left its grammar at a token it refused: {guide.matcher.get_error()}"


def failure(seq_guides: list[Guide | None]) -> str | None:
    return next((g.error for g in seq_guides if g is not None and g.error), None)


def words(vocab: int) -> int:
    return (vocab + 31) // 32


def fill(bitmask: torch.Tensor, rows: list[tuple[int, Guide]]) -> None:
    """Each live Guide's next mask into its row of `bitmask` (a CPU int32 (batch, words) tensor, contiguous); the
    other rows are set to all ones (every token allowed). The executor writes a live row whole, so only the others
    are filled (G1-JSON's 1,024 rows: 19 MB a step not written twice; 2.3 ms on a 2-core CPU). The executor gets
    the live rows grouped by family (the module docstring says why)."""
    groups: dict[int, list] = {}
    for i, g in rows:
        if g.live:
            groups.setdefault(g.family, []).append((g.matcher, i))
    _allow_all_but(bitmask, [i for items in groups.values() for _, i in items])
    if groups:
        by_family(groups, "unsafe_compute_mask_ptr", bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


def _allow_all_but(bitmask: torch.Tensor, rows: list[int]) -> None:
    """Every row of `bitmask` but `rows` (those the executor writes whole) set to all ones."""
    if len(rows) < bitmask.shape[0]:
        others = torch.ones(bitmask.shape[0], dtype=torch.bool)
        others[rows] = False
        bitmask[others] = -1


class Masks:
    """A step's masks into `bitmask` (as `fill`), computed while the caller books the step before (OVERLAP): the
    caller books the rows family by family and calls `add(row, guide)` as each one's guide takes its token; when a
    family's rows are all added (the next row is another family's, or `finish`), their masks start on that
    family's executor. `finish()` waits for every family (raising the first error) and sets the rows no live guide
    asked for to all ones; `wait()` only waits (a caller that stops early calls it before the bitmask is written
    again)."""

    def __init__(self, bitmask: torch.Tensor):
        self.bitmask = bitmask
        self.family: int | None = None
        self.pending: list[tuple] = []  # (matcher, row) of the family being added
        self.asked: list[int] = []
        self.sent: list[concurrent.futures.Future] = []

    def add(self, row: int, guide: Guide) -> None:
        if not guide.live:
            return
        if guide.family != self.family:
            self._send()
            self.family = guide.family
        self.pending.append((guide.matcher, row))
        self.asked.append(row)

    def _send(self) -> None:
        if self.pending:
            bits = self.bitmask
            args = (self.pending, bits.data_ptr(), bits.shape[1] * 4, len(bits))
            self.sent.append(_on_family(self.family, "unsafe_compute_mask_ptr", *args))
            self.pending = []

    def finish(self) -> None:
        self._send()
        _allow_all_but(self.bitmask, self.asked)
        self.wait()
        for future in self.sent:
            future.result()

    def wait(self) -> None:
        concurrent.futures.wait(self.sent)


def apply(logits: torch.Tensor, bitmask: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """`logits` (batch, vocab) with -inf on every token the device `bitmask` (batch, words) forbids: a new tensor
    (the caller may still read the unmasked logits), or `logits` itself with `inplace`. The bitmask is unpacked
    bytewise into a (batch, vocab) uint8 temporary. On G1-JSON's 1,024 × 152k bf16 logits on an H100 this took
    ~1 ms in place and 4.0 ms into a new tensor. A Triton kernel that wrote only the -inf was no faster (1.1 ms;
    ops/bench/results/2026-12-05-h100-session37) and was removed."""
    batch, vocab = logits.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    raw = bitmask.view(torch.uint8)  # little-endian: byte b of word w holds tokens 32w + 8b … 32w + 8b + 7
    allowed = ((raw[:, :, None] >> shifts) & 1).view(batch, -1)[:, :vocab]
    forbidden = allowed == 0
    return logits.masked_fill_(forbidden, float("-inf")) if inplace else logits.masked_fill(forbidden, float("-inf"))


def fused_pick(device: torch.device) -> bool:
    """Whether a greedy step under a grammar picks with `masked_argmax` here (FUSED_PICK, and the kernel runs
    here: CUDA, or Triton's interpreter)."""
    return FUSED_PICK and decode_attention.available(device)


def masked_argmax(logits: torch.Tensor, bitmask: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`apply(logits, bitmask).argmax(-1)` into `out` (batch,) int64 without writing the mask: one Triton kernel,
    one program a row, reads the bitmask and only the logits it allows. Ties go to the first token, as torch's
    argmax; a row that allows nothing (or only -inf) gets token 0, as torch's argmax of all -inf; a NaN logit is
    passed over where torch's argmax would pick it."""
    if logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("grammar.masked_argmax: the logits and the bitmask must be contiguous along the vocabulary")
    _argmax_kernel[(logits.shape[0],)](
        logits, bitmask, out, logits.shape[1], logits.stride(0), bitmask.stride(0), BLOCK=PICK_BLOCK
    )
    return out


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _argmax_kernel(logits_ptr, bits_ptr, out_ptr, vocab, logits_stride, bits_stride, BLOCK: tl.constexpr):
        """Row `program_id(0)`: each lane keeps the best allowed logit it has read and that token (the first of
        equal ones: a later block replaces it only when greater); then the first token of the best lane's value."""
        row = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK)
        best = tl.full((BLOCK,), float("-inf"), tl.float32)
        at = lane  # where nothing allowed beats -inf, the first block's tokens: the row's answer is then 0
        for start in range(0, vocab, BLOCK):
            token = start + lane
            inside = token < vocab
            word = tl.load(bits_ptr + row * bits_stride + (token >> 5), mask=inside, other=0)
            allowed = inside & (((word >> (token & 31)) & 1) != 0)
            x = tl.load(logits_ptr + row * logits_stride + token, mask=allowed, other=float("-inf")).to(tl.float32)
            better = x > best
            best = tl.where(better, x, best)
            at = tl.where(better, token, at)
        top = tl.max(best, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(best == top, at, vocab), axis=0).to(tl.int64))


class Processor(LogitsProcessor):
    """The grammar mask inside `model.generate` (padded and static engines): each call first advances every
    sequence by the token picked at the previous step (the last column of `input_ids`; the first call sees the
    prompt), then masks this step's scores. `guides` are in the batch's row order (None: no constraint)."""

    def __init__(self, seq_guides: list[Guide | None], vocab: int):
        self.guides = seq_guides
        self.rows = [(i, g) for i, g in enumerate(seq_guides) if g is not None]
        self.bitmask = torch.full((len(seq_guides), words(vocab)), -1, dtype=torch.int32)
        self.first = True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.first:
            last = input_ids[:, -1].tolist()
            for i, g in self.rows:
                g.take(last[i])
        self.first = False
        fill(self.bitmask, self.rows)
        return apply(scores, self.bitmask.to(scores.device, non_blocking=True))

    def finish(self, sequences: list[list[int]]) -> None:
        """Advance by the last generated token (`generate` asks no processor after its last step): a sequence
        whose last token the grammar refused fails like any other."""
        for i, g in self.rows:
            if sequences[i]:
                g.take(sequences[i][-1])
