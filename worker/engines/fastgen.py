"""The fast engine (`engine: fast`): continuous batching over a paged KV cache, decode steps as CUDA graphs.

Why: on an H200 the engines that go through `model.generate` leave the GPU idle (Python launches each kernel, a
static cache reads every padded position, a batch waits for its longest row). This engine keeps the model a
transformers model and replaces only the attention (worker/engines/paged_attention.py, registered through
`AttentionInterface` as `gpujobs_fast`), so every weight, norm, RoPE and LoRA layer is transformers' own:

- **Paged cache** (worker/engines/slot_state.py: the resident state and its sizing). One preallocated tensor holds
  K and V of every layer in pages of `PAGE` positions, sized once from the memory free after loading. A sequence
  takes the pages its prompt + max_new_tokens need when it is admitted and gives them back when it finishes, so
  short rows leave room for more rows (G2's mixed lengths), and the cache never depends on a job's shape. Each
  slot (a place in the decode batch) has a row of the page table. Page 0 is a trash page: free slots point at it.
- **Prepared once per model** (`prepare`, called when the worker loads the model): the cache, the compiled layers
  and a CUDA graph of the decode step for every batch bucket, greedy and sampling. A job then pays for none of it;
  the seconds are reported apart (`compile_s`, `capture_s`).
- **Prefill** runs newly admitted rows through the model in chunks of about `PREFILL_TOKENS` padded tokens (right
  padding, causal SDPA with grouped K/V), writes their K/V into their pages and samples their first token.
- **Decode** runs one token for every running slot: K/V written at each slot's position, attention over each
  slot's real length only (worker/engines/decode_attention.py: a Triton kernel over the pages on CUDA), the next token
  picked on the GPU (greedy argmax, or temperature sampling by the exponential race `argmax(p / E)`, E ~ Exp(1);
  with top_k / top_p, over the distribution they leave, `_filter`).
  On CUDA the whole step is a CUDA graph per batch bucket, replayed: one launch per step. Rows whose prompts start
  from one cached prefix (the prefix cache, worker/engines/pages.py) have its K/V read once a step for all of them
  (the cascade: `CASCADE`, `Engine._choose_shared`), not once per row.
- **Scheduling.** Rows are queued longest first (prompt + max_new_tokens) so the last rows to finish are short.
  Free slots are refilled from the queue as rows finish and pages come back (in groups of at least
  `slots // ADMIT_DIVISOR` rows, so prefill runs on useful batch sizes); once the queue is empty, running rows are
  moved down into free low slots (their page-table rows move, not their K/V) so the decode step shrinks to a
  smaller bucket. The host books each step's tokens one step behind the GPU (see `Engine.run`).

What it does not do (rows that ask for it run on the padded engine under `engine: auto`, and fail with a message
saying so under `engine: fast`): repetition_penalty, and top_p and top_k unless `FILTERED_SAMPLING`; rows longer
than the page table (`slot_state.max_len`); models with sliding-window layers, split over several GPUs (device_map auto) or
post-processing their logits; attention kernels other than sdpa/sdpa_gqa/eager (the job asked for a specific kernel,
which this engine would replace). Stop strings are cut after the fact, as in the continuous engine. `seed` reseeds
torch before each group of rows with the same seed; sampled outputs depend on how rows share steps, as in every
batched engine.

The state (cache, graphs) stays on the resident model, so the next job starts decoding at once; other engines call
`slot_state.release()` first to give its memory back.

This file is one concern, the engine: what it can run, its sequences, and `Engine`, whose model calls (prefill, the
decode step and its CUDA graphs) and loop (admit, launch, book, compact) share one state and one clock, and read
best together: the loop launches step k+1 before it books step k, and only the two side by side show why that is
safe (`Engine.run`).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from core.dataset import fast_unsupported
from worker import faults
from worker.engines import decode_attention, grammar, logprobs, paged_attention, slot_state
from worker.engines import pages as pages_mod
from worker.engines.decode_attention import PAGE
from worker.engines.slot_state import PREFILL_TOKENS, SlotState
from worker.progress import Progress

log = logging.getLogger(__name__)

PREFIX_TOKENS = 4 * PREFILL_TOKENS  # cached prefix positions a prefill chunk reads (their K/V gathered per layer)
# The slot state written without waiting for the GPU (a prefill chunk's active slots, a compaction's moves). On
# torch 2.11 (the GPU host's) a Python number assigned to one element of a CUDA tensor or through a tensor index
# (`pos[src] = 0`, `active[slots] = 1`) is copied to the device synchronously (pytorch/pytorch#186482, #188267): each
# prefill chunk so waited for itself (41 of its ~85 ms on the H200, ops/bench/results/2026-12-06-h200-session48), and
# each compaction for the step in flight. On: no wait left in G1's run (`profile_gen.py --syncs`), and with
# decode_attention.PREFILL_WRITE G2 1.030x, G1 1.025x on an H100 (ops/bench/results/2026-12-07-h100-session50).
SYNC_FREE = True
ADMIT_DIVISOR = 8  # refill once at least slots // ADMIT_DIVISOR rows can be admitted (or nothing runs)
REPLACEABLE_ATTENTION = ("sdpa", "sdpa_gqa", "eager")  # what the job may have asked for: no specific kernel
# CUDA: the decoder layers run compiled (torch.compile, dynamic shapes, the attention left out as an opaque call),
# which fuses the norms, RoPE and activations that eager mode launches as dozens of small kernels per layer. Once
# per model and process (prefill and decode compile apart), in `prepare`; the time shows in `compile_s`.
COMPILE = True
COMPILE_BACKEND = "inductor"  # tests set "eager" (dynamo traces for real, runs the graphs eagerly)
SIZE_OBLIVIOUS = True  # compile every size alike (`_size_oblivious`); turned off if that fails for a model
# Cascade decode (worker/engines/decode_attention.py): pages of a cached prompt prefix that many running rows hold
# are read once a step for all of them. Used while the running rows holding them × their pages (the page reads a
# step saves) is at least CASCADE_MIN_READS: on the H200 every shape at or past that product gained and every loss
# lay below it (1024 rows × 4 pages 1.05×, 256 × 16 1.46×, 128 × 32 1.63×; 128 × 4 0.42×: the kernel grid in
# ops/bench/results/2026-12-05-h200-host). ops/bench/gen.py g3 turns CASCADE off to measure it.
CASCADE = True
CASCADE_MIN_READS = 4096
CAPTURE_WARMUPS = 2  # runs of a step on a side stream before it is captured (the first compiles its Triton kernels)
# On: rows sampling with top_k or top_p run here (`row_problem`) rather than padded (~15x slower on a GPU). Their
# steps are a third mode ("filtered", `_filter`: a sort over the vocabulary per step, captured per bucket when first
# needed), so greedy and plain sampling steps stay as they were. Off: built and checked on CPU only, in a session with
# no GPU, so neither its CUDA-graph capture nor its cost has been measured: the sort at G1's 1024 slots x 151,936
# fp32 logits, and its temporaries beyond the GRAPH_BYTES_PER_VOCAB reserved (docs/design.md, the fast engine's
# "top_k and top_p", says what to measure before turning it on). core/dataset.py's submit check refuses top_p/top_k under
# `engine: fast` as this flag's default does (`fast_unsupported`'s `filtered`).
FILTERED_SAMPLING = False


# --- what the engine can run ----------------------------------------------------------------------------------


def model_problem(model) -> str | None:
    """Why this model cannot run on the fast engine, or None."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    attn = config._attn_implementation
    if attn not in REPLACEABLE_ATTENTION:
        return (
            f"engine fast replaces the attention and cannot honour attn_implementation {attn!r}: use sdpa, or "
            "engine padded/continuous for that kernel"
        )
    layer_types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(text, "use_sliding_window", False):
        return "engine fast supports full-attention models only (this one has sliding-window layers)"
    if getattr(model, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        return "engine fast runs decoder-only models"
    placed = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(placed) > 1:
        return (
            "engine fast runs a model on one device (device_map auto split this one over "
            f"{len(placed)}): use engine padded"
        )
    if any(getattr(text, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale")):
        return "engine fast applies the output layer alone (this model post-processes its logits): use engine padded"
    return None


def row_problem(params: dict[str, Any]) -> str | None:
    """Why a row's sampling parameters need another engine, or None. core/dataset.py makes the same check at submit
    (core imports no worker code, so it cannot read FILTERED_SAMPLING: it judges top_p/top_k by the flag's default,
    and a test keeps the two in step)."""
    return fast_unsupported(params, filtered=FILTERED_SAMPLING)


def buckets(slots: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two up to 128, then steps of 128, and `slots` itself."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < slots]
    sizes += list(range(256, slots, 128))
    return sizes + [slots]


def bucket(sizes: list[int], n: int) -> int:
    return next(b for b in sizes if b >= n)


def prepare(
    loaded,
    eos: set[int],
    *,
    graphs: bool,
    compiled: bool,
    fraction: float = 1.0,
    utilization: float = 0.9,
    progress: Progress | None = None,
    sampling: tuple[bool, ...] = (False, True),
    kv_cache_dtype: str = "auto",
) -> SlotState:
    """The model's state, ready: the paged cache (of `kv_cache_dtype`: `slot_state.state_for`), the compiled layers
    (warm-up prefills of two rows and of one, and decode steps) and, with `graphs`, a CUDA graph of the decode step
    for every batch bucket in each mode of `sampling` (False: greedy, True: sampling; a mode left out is captured
    per bucket when a step first needs it). The work is done once per state (`state.prepare_s`);
    `slot_state.summary` says what it cost. Compiling and capturing are phases of `progress` (the stall watchdog's
    clock)."""
    global SIZE_OBLIVIOUS
    model = loaded.model
    state = slot_state.state_for(
        model, loaded.device, model.get_output_embeddings().weight.shape[0], fraction, utilization, kv_cache_dtype
    )
    if state.prepare_s is None:
        t = time.perf_counter()
        engine = Engine(loaded, state, eos, slots=state.slots, graphs=graphs, compiled=compiled)
        engine.progress = progress or engine.progress
        with torch.inference_mode():
            try:
                engine.warm_up(sampling)
            except Exception as exc:  # noqa: BLE001  compiling size-oblivious failed: compile as torch does by default
                if not (engine.compiled and SIZE_OBLIVIOUS) or isinstance(exc, torch.OutOfMemoryError):
                    raise
                log.warning(
                    "fast engine: compiling the layers size-oblivious failed (%s: %s); compiling them again with "
                    "sizes of 1 apart",
                    type(exc).__name__,
                    str(exc).splitlines()[0] if str(exc) else "",
                )
                SIZE_OBLIVIOUS = False
                torch._dynamo.reset()
                engine.warm_up(sampling)
        slot_state.sync(state)
        state.prepare_s = time.perf_counter() - t
    return state


# --- one sequence ---------------------------------------------------------------------------------------------


@dataclass
class Seq:
    """One sequence in the engine: row `row` (a common.Prepared), sample `k` of its n."""

    row: Any
    k: int
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    guide: Any = None  # grammar.Guide of a constrained row (worker/engines/grammar.py)
    # logprobs asked: the prefill's entry then a `logprobs.Ring` code per decode token; once it finished, its arrays
    # (picked, top values, top ids), gathered by `Engine._gather_lp` (worker/engines/logprobs.py)
    lp: Any = None
    prefix: int = 0  # pages shared with earlier prompts: the prefill starts at prefix * PAGE
    wave: int = 0  # its prefill runs after the prefills that write the shared pages it reads (Engine._admit)
    discard: int = 0  # steps launched after a token its grammar refused (grammar.CHECK_FIRST): dropped when booked
    _blocks: list | None = None

    @property
    def blocks(self) -> list[tuple]:
        """Its prompt's full pages (the keys of the prefix cache)."""
        if self._blocks is None:
            self._blocks = pages_mod.blocks(self.row.ids, PAGE)
        return self._blocks

    @property
    def reusable(self) -> int:
        """At most this many pages can come from the cache: its prompt's last token is always prefilled (its logits
        give the first new token)."""
        return (len(self.row.ids) - 1) // PAGE

    @property
    def need(self) -> int:
        return len(self.row.ids) + self.row.params["max_new_tokens"]

    @property
    def filtered(self) -> bool:
        """It samples with top_k or top_p: its steps are "filtered" ones (`_filter`)."""
        return _filters(self.row.params) != NO_FILTER

    @property
    def pages_needed(self) -> int:
        return math.ceil(self.need / PAGE)


# --- the engine -----------------------------------------------------------------------------------------------


class Engine:
    """Runs sequences to completion on one model; `run` yields the sequences that finish together."""

    def __init__(self, loaded, state: SlotState, eos: set[int], *, slots: int, graphs: bool, compiled: bool = False):
        paged_attention.register()
        self.loaded = loaded
        self.slots = slots  # this run uses slots 0..slots-1 of the state's
        model = loaded.model
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = causal.get_decoder()
        self.head = causal.get_output_embeddings()
        self.state = state
        self.eos = eos
        self.use_graphs = graphs
        if compiled and state.compiled is None:
            _raise_recompile_limit()
            state.compiled = [
                torch.compile(layer._call_impl, dynamic=True, backend=COMPILE_BACKEND) for layer in self.decoder.layers
            ]
        self.compiled = state.compiled if compiled else None
        self.sizes = buckets(state.slots)
        self.pad = loaded.tokenizer.pad_token_id or 0
        self.vocab = self.head.weight.shape[0]
        self.prefill_lp: Any = None  # the last prefill's log-probabilities (device tensors), where a row asked
        self._host_bits: torch.Tensor | None = None
        if state.eos != tuple(sorted(eos)):  # graphs read the state's tensors only: new EOS ids, new graphs
            state.eos = tuple(sorted(eos))
            state.eos_index = torch.tensor(state.eos, device=state.cache.device) if eos else None
            state.graphs.clear()
        self.eos_index = state.eos_index
        self.pool = state.pool
        self.reuse = True  # share cached prompt prefixes (spec prefix_cache; `off` prefills every prompt whole)
        self.cascade = CASCADE
        self._cascade_pages: tuple[int, ...] = ()  # the pages the cascade reads once (state.shared on the device)
        self._sharing = 0  # running sequences whose tables start with them
        self.cascade_steps = 0
        self._unlaunched: set[int] = set()  # pages registered whose prefill is not launched yet
        self.prompt_tokens = 0  # prompt tokens of this run's sequences, and those read from cached prefixes
        self.reused_tokens = 0
        self._host: torch.Tensor | None = None  # two pinned buffers the decode steps' tokens go into, in turn
        self._ring: logprobs.Ring | None = None  # the decode steps' log-probabilities, where a row asks (`run`)
        self.progress = Progress()  # the stall watchdog's clock (worker/progress.py), given by `run` or `prepare`
        self.steps = 0
        self.prefill_chunks = 0  # prefill forwards (a chunk holds rows of one wave and one cached prefix length)
        self.checked_tokens = 0  # grammar.CHECK_FIRST: tokens picked without a mask and allowed, and those refused
        self.refused_tokens = 0
        self._redo: list[Seq] = []  # refused since the last launch: their slots go back to their last token
        self._choose_due = False  # a grammar step's forward is launched and its choosing is not
        self.check_first = False  # some sequence of this run is checked (`run`)
        self._checked_seqs: list[Seq] = []
        self.check_stopped = False  # the run's model refused too many checked tokens: masked from then on
        self.filtering = False  # some sequence of this run samples with top_k or top_p (`run`)
        self.prefill_s = 0.0
        self.decode_s = 0.0
        # where the host's time goes (`record`): waiting for a decode step's tokens (part of decode_s), booking them
        # (appending each row's token, advancing its grammar, freeing the finished), computing grammar masks, and in
        # the caller's hands (each batch of finished sequences, until it asks for the next)
        self.wait_s = 0.0
        self.book_s = 0.0
        self.mask_s = 0.0
        self.caller_s = 0.0

    # -- model calls --

    @contextlib.contextmanager
    def _mode(
        self,
        mode: str,
        pages: torch.Tensor | None = None,
        splits: int = 1,
        prefix: torch.Tensor | None = None,
        cascade: bool = False,
    ):
        model = self.loaded.model
        before = model.config._attn_implementation
        model.config._attn_implementation = paged_attention.NAME  # every layer reads the config at call time
        layers = self.decoder.layers
        if self.compiled:
            for layer, fn in zip(layers, self.compiled):
                layer._compiled_call_impl = fn  # what nn.Module.compile() sets; removed again below
        try:
            with (
                paged_attention.running(paged_attention.Step(mode, self.state, pages, splits, prefix, cascade)),
                _size_oblivious() if self.compiled and SIZE_OBLIVIOUS else contextlib.nullcontext(),
            ):
                yield
        finally:
            model.config._attn_implementation = before
            if self.compiled:
                for layer in layers:
                    layer._compiled_call_impl = None

    def _mask_eos(self, logits: torch.Tensor, no_eos: torch.Tensor) -> torch.Tensor:
        """EOS can never be picked in ignore_eos rows (the padded engine's min_new_tokens does the same)."""
        if self.eos_index is not None:
            cols = logits[:, self.eos_index]
            logits[:, self.eos_index] = cols.masked_fill(no_eos[:, None], float("-inf"))
        return logits

    @staticmethod
    def _pick(
        logits: torch.Tensor,
        temp: torch.Tensor,
        sample: bool,
        top_k: torch.Tensor | None = None,
        top_p: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Next tokens: argmax (on the model's logits: bf16 to fp32 is exact, so the same token as plain generate's
        fp32 argmax), or for rows with temp > 0 a sample from softmax(logits / temp) in fp32; given each row's
        `top_k` and `top_p` (a "filtered" step), from what they leave of it (`_filter`)."""
        if not sample:
            return logits.argmax(dim=-1)
        scaled = logits.float() / temp.clamp_min(1e-6)[:, None]
        order = None
        if top_k is not None:
            scaled, order = _filter(scaled, top_k, top_p)
        race = scaled - torch.empty_like(scaled).exponential_().log()  # argmax(p / E) samples p
        picked = race.argmax(dim=-1)
        if order is not None:  # a place in the sorted row: its token
            picked = order.gather(1, picked[:, None])[:, 0]
        return torch.where(temp > 0, picked, logits.argmax(dim=-1))

    def prefill(self, seqs: list[Seq]) -> torch.Tensor:
        """Run the prompts of `seqs` (slots and pages already assigned), fill their pages, page-table rows and
        slot inputs; returns their first tokens (on the device, not waited for).

        The host builds each input as one tensor from padded lists (a tensor per row cost 0.26 s of host time
        per G1 run, during which the GPU waited) and copies it without waiting."""
        st = self.state
        device = st.cache.device
        shared = seqs[0].prefix  # every row of a chunk shares as many cached pages (Engine._admit)
        start = shared * PAGE
        lengths = [len(s.row.ids) - start for s in seqs]
        width, cols = max(lengths), st.table.shape[1]
        ids = _to(device, [s.row.ids[start:] + [self.pad] * (width - n) for s, n in zip(seqs, lengths)], torch.long)
        # unused blocks of a row's table: the trash page
        table = _to(device, [s.pages + [0] * (cols - len(s.pages)) for s in seqs], torch.long)
        slots_last = _to(device, [[s.slot for s in seqs], [n - 1 for n in lengths]], torch.long)
        slots, last = slots_last[0], slots_last[1]
        temps = _to(device, [_temperature(s.row.params, self.loaded) for s in seqs], torch.float32)
        filters = [_filters(s.row.params) for s in seqs]
        top_k = _to(device, [k for k, _ in filters], torch.long)
        top_p = _to(device, [p for _, p in filters], torch.float32)
        no_eos = _to(device, [bool(s.row.params["ignore_eos"]) for s in seqs], torch.bool)
        # a tensor of its own, as in decode steps (`logits`): Dynamo guards on whether a layer's input is a view and
        # on its strides, and an expanded view here made every compiled layer compile once more per layout
        positions = st.positions[start : start + width].repeat(len(seqs), 1)
        # (rows, width): the page of each position; padding past a row's pages goes to the trash page
        pages = table[:, st.positions[start : start + width] // PAGE]
        t = time.perf_counter()
        with self._mode("prefill", pages, prefix=table[:, :shared] if shared else None):
            hidden = self.decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        if st.first_prefill_s is None:
            slot_state.sync(st)
            st.first_prefill_s = time.perf_counter() - t
        logits = self._mask_eos(self.head(hidden[torch.arange(len(seqs), device=device), last]), no_eos)
        masked = logits
        if any(s.guide for s in seqs):  # the first token's grammar mask, computed here for the chunk
            bits = torch.empty((len(seqs), grammar.words(logits.shape[1])), dtype=torch.int32)
            grammar.fill(bits, [(i, s.guide) for i, s in enumerate(seqs) if s.guide])
            masked = grammar.apply(logits, bits.to(device))
        sample = any(s.row.params["do_sample"] for s in seqs)
        first = self._pick(masked, temps, sample, *((top_k, top_p) if any(f != NO_FILTER for f in filters) else ()))
        self.prefill_lp = None  # read by _launch_prefill right after this call
        if any(s.lp is not None for s in seqs):
            self.prefill_lp = logprobs.step(logits, first, logprobs.TOP)
        st.table[slots] = table
        st.tok[slots] = first
        st.pos[slots] = start + last + 1
        if SYNC_FREE:
            st.active.index_fill_(0, slots, 1)
        else:
            st.active[slots] = 1  # waits for the GPU on torch 2.11 (SYNC_FREE)
        st.temp[slots] = temps
        st.top_k[slots] = top_k
        st.top_p[slots] = top_p
        st.no_eos[slots] = no_eos
        return first

    def logits(self, batch: int, cascade: bool = False) -> torch.Tensor:
        """The next-token logits (the model's dtype) of slots 0..batch-1 after writing their current token's K/V
        (free slots write into the trash page and compute garbage that nothing reads). Leaves `tok` and `pos` as
        they were. `cascade`: the attention reads `state.shared` once for the slots whose tables start with it."""
        st = self.state
        pos = st.pos[:batch]
        st.lengths[:batch] = ((pos + 1) * st.active[:batch]).to(torch.int32)
        st.write_page[:batch] = st.table[:batch].gather(1, (pos // PAGE)[:, None])[:, 0]
        st.write_offset[:batch] = pos % PAGE
        if cascade:
            st.start[:batch] = decode_attention.cascade_start(st.table[:batch], st.shared)
        splits = decode_attention.splits_for(batch, st.cache.shape[3])
        with self._mode("decode", splits=splits, cascade=cascade):  # position_ids: a copy, not a view (`prefill`)
            hidden = self.decoder(
                input_ids=st.tok[:batch, None], position_ids=pos[:, None].clone(), use_cache=False
            ).last_hidden_state[:, 0]
        return self.head(hidden)

    def _decode(self, batch: int, sample: bool, extras: tuple[str, ...] = (), phase: str | None = None) -> None:
        """One decode step over slots 0..batch-1: the next token of every active slot fed back as its input.

        With `extras` (only for a batch where some row asks): "grammar" masks the logits with the bitmask the host
        put in `outputs["bitmask"]`, "logprobs" writes the unmasked logits' log-probabilities into `outputs` (the
        model's distribution, before any mask, temperature, top_k or top_p), "filtered" samples with each slot's
        top_k and top_p (`_filter`). A step with a grammar runs in two phases (`Engine.run`): "forward" (the logits, kept in `outputs["logits"]`),
        then "choose" (mask, pick, logprobs) once the host has the masks: its grammar work overlaps the forward."""
        st = self.state
        if phase == "choose":
            logits = st.outputs["logits"][:batch]
        else:
            logits = self._mask_eos(self.logits(batch, "cascade" in extras), st.no_eos[:batch])
            if phase == "forward":
                st.outputs["logits"][:batch] = logits
                return
        if "grammar" in extras and not sample and "logprobs" not in extras and grammar.fused_pick(logits.device):
            grammar.masked_argmax(logits, st.outputs["bitmask"][:batch], st.tok[:batch])  # mask and argmax at once
        else:  # the mask in place unless the logprobs read the unmasked logits below
            bits = st.outputs["bitmask"][:batch] if "grammar" in extras else None
            masked = logits if bits is None else grammar.apply(logits, bits, inplace="logprobs" not in extras)
            filters = (st.top_k[:batch], st.top_p[:batch]) if "filtered" in extras else ()
            st.tok[:batch] = self._pick(masked, st.temp[:batch], sample, *filters)
        if "logprobs" in extras:
            for name, value in zip(("picked", "values", "ids"), logprobs.step(logits, st.tok[:batch], logprobs.TOP)):
                st.outputs[name][:batch] = value
        st.pos[:batch] += st.active[:batch]

    def step(self, batch: int, sample: bool, extras: tuple[str, ...] = (), phase: str | None = None) -> None:
        if not self.use_graphs:
            self._decode(batch, sample, extras, phase)
            return
        key = (batch, sample, *extras) if phase is None else (phase, batch, sample, *extras)
        graph = self.state.graphs.get(key)
        if graph is None:
            with self.progress.phase("capturing CUDA graphs"):
                graph = self._capture(batch, sample, extras, phase)
        graph.replay()

    def _capture(self, batch: int, sample: bool, extras: tuple[str, ...] = (), phase: str | None = None):
        """Capture the decode step (or a `phase` of it) for `batch` slots as a CUDA graph (after warm-up runs on a
        side stream, which compile the Triton kernel); the slot inputs are restored afterwards, so capturing
        changes nothing."""
        st = self.state
        t = time.perf_counter()
        saved = (st.tok.clone(), st.pos.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(CAPTURE_WARMUPS):
                self._decode(batch, sample, extras, phase)
        torch.cuda.current_stream().wait_stream(stream)
        st.graph_pool = st.graph_pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=st.graph_pool):
            self._decode(batch, sample, extras, phase)
        st.tok.copy_(saved[0])
        st.pos.copy_(saved[1])
        torch.cuda.synchronize()
        st.graphs[(batch, sample, *extras) if phase is None else (phase, batch, sample, *extras)] = graph
        seconds = time.perf_counter() - t
        st.capture_s += seconds
        log.info(
            "fast engine: captured the decode step%s for %d slots%s%s in %.2f s",
            f" ({phase})" if phase else "",
            batch,
            " (sampling)" if sample else "",
            "".join(f" ({e})" for e in extras),
            seconds,
        )
        return graph

    def warm_up(self, sampling: tuple[bool, ...] = (False, True)) -> None:
        """Compile the layers (a prefill of two rows and of one, a decode step) and capture the decode graph of
        every bucket in each mode of `sampling` (`prepare`), with every slot free (their writes go to the trash
        page)."""
        st = self.state
        st.active.zero_()
        st.pos.zero_()
        st.table.zero_()
        t = time.perf_counter()
        params = {"max_new_tokens": 1, "do_sample": False, "temperature": None, "ignore_eos": True}
        with self.progress.phase("compiling") if self.compiled else contextlib.nullcontext():
            for rows in sorted({min(2, st.slots), 1}, reverse=True):
                dummy = [
                    Seq(_Dummy(params, [self.pad] * min(PAGE + 1, st.max_len - 1)), 0, slot=i) for i in range(rows)
                ]
                self.prefill(dummy)
            self._deactivate(dummy)
            if self.compiled:  # the decode variants (batch 1 is specialized apart)
                for batch in (1, 2):
                    self._decode(min(batch, st.slots), False)
            slot_state.sync(st)
        st.compile_s += time.perf_counter() - t
        if self.use_graphs:
            with self.progress.phase("capturing CUDA graphs"):
                for sample in sampling:
                    for batch in self.sizes:
                        if (batch, sample) not in st.graphs:
                            self._capture(batch, sample)
        st.active.zero_()

    def move(self, src: list[int], dst: list[int]) -> None:
        """Move the sequences in slots `src` to the free slots `dst` (pairwise; no slot in both): their page-table
        rows and inputs (their K/V stay). Under SYNC_FREE a dozen kernels for any number of slots, without
        waiting for the GPU; else slot by slot."""
        st = self.state
        bufs = (st.table, st.tok, st.pos, st.active, st.temp, st.top_k, st.top_p, st.no_eos)
        if SYNC_FREE:
            index = _to(st.tok.device, [src, dst], torch.long)
            for buf in bufs:
                buf.index_copy_(0, index[1], buf.index_select(0, index[0]))
            for buf in (st.active, st.pos, st.table):  # a free slot writes at position 0 of the trash page
                buf.index_fill_(0, index[0], 0)
            return
        for a, b in zip(src, dst):
            for buf in bufs:
                buf[b] = buf[a]
            st.active[a] = 0
            st.pos[a] = 0  # a free slot writes at position 0 of the trash page (see _deactivate)
            st.table[a] = 0

    def record(self, stats: dict[str, Any]) -> None:
        """Add this run's figures to the job's `info["fast"]`."""
        st = self.state
        stats.update(
            slots=self.slots,
            pages=st.pages,
            page=PAGE,
            max_len=st.max_len,
            cuda_graphs=self.use_graphs,
            compiled=self.compiled is not None,
            graphs=len(st.graphs),
            capture_s=round(st.capture_s, 3),
            compile_s=round(st.compile_s, 3),
            first_prefill_s=st.first_prefill_s and round(st.first_prefill_s, 3),
            cache_gib=round(st.bytes() / 2**30, 3),
            kv_cache_dtype=st.kv_cache_dtype,
            gpu_memory_utilization=st.utilization,
        )
        stats["runs"] += 1
        stats["steps"] += self.steps
        stats["prompt_tokens"] = stats.get("prompt_tokens", 0) + self.prompt_tokens
        stats["prefix_tokens_reused"] = stats.get("prefix_tokens_reused", 0) + self.reused_tokens
        stats["prefix_cache"] = self.reuse
        stats["cascade_steps"] = stats.get("cascade_steps", 0) + self.cascade_steps
        stats["prefill_chunks"] = stats.get("prefill_chunks", 0) + self.prefill_chunks
        if grammar.CHECK_FIRST:
            stats["grammar_checked"] = stats.get("grammar_checked", 0) + self.checked_tokens
            stats["grammar_refused"] = stats.get("grammar_refused", 0) + self.refused_tokens
            stats["grammar_check_stopped"] = stats.get("grammar_check_stopped", False) or self.check_stopped
        stats["prefill_s"] = round(stats["prefill_s"] + self.prefill_s, 3)
        stats["decode_s"] = round(stats["decode_s"] + self.decode_s, 3)
        for name in ("wait_s", "book_s", "mask_s", "caller_s"):
            stats[name] = round(stats.get(name, 0.0) + getattr(self, name), 3)

    # -- the loop --

    def run(
        self, seqs: list[Seq], should_stop: Callable[[], bool], progress: Progress | None = None
    ) -> Iterator[list[Seq]]:
        """Run every sequence to the end; yield the ones that finish, as a list per decode step (or prefill chunk)
        that finished any (not yielded: those cut off by `should_stop`). Every sequence must fit in the cache
        (`pages_needed` < the state's pages, `need` <= its max_len). Each decode step and prefill chunk is reported
        to `progress` (a graph captured during a run, for new EOS ids, as a phase).

        The host works one step behind the GPU: step k+1 is launched before the tokens of step k are read and
        booked, so that bookkeeping (and the caller's work on each finished sequence) overlaps the GPU's step. A
        sequence that finished at step k so runs one more step, whose token is dropped: its pages hold `need`
        positions, and that extra step writes at most position need - 1."""
        st = self.state
        self.progress = progress or self.progress
        st.active.zero_()
        st.pos.zero_()  # every free slot writes at position 0 of the trash page
        st.table.zero_()
        queue = collections.deque(sorted(seqs, key=lambda s: -s.need))
        asking = [s.row.params for s in seqs if s.lp is not None]
        if asking:  # a ring row per step of the longest sequence, and the steps launched before it is gathered
            longest, k = max(p["max_new_tokens"] for p in asking), max(logprobs.wanted(p) for p in asking)
            self._ring = logprobs.Ring(longest + 4, st.slots, k, pinned=st.tok.is_cuda)
        free = list(range(self.slots))
        self._cascade_pages, self._sharing = (), 0
        self._checked_seqs = [s for s in seqs if s.guide is not None and s.guide.checks]  # grammar.CHECK_FIRST
        self.check_first = bool(self._checked_seqs)
        self.filtering = any(s.filtered for s in seqs)
        self.pool.start_run()
        loop = self._loop(queue, free, should_stop)
        try:
            for finished in loop:
                t = time.perf_counter()
                yield finished
                self.caller_s += time.perf_counter() - t
        finally:
            loop.close()
            # pages registered for a prefill that never launched (an error, a stop) hold no K/V: forget them
            self.pool.forget(self._unlaunched)
            self._unlaunched.clear()

    def _loop(self, queue, free: list[int], should_stop: Callable[[], bool]) -> Iterator[list[Seq]]:
        running: dict[int, Seq] = {}
        admit_min = max(1, self.slots // ADMIT_DIVISOR)
        pending: tuple[Callable[[], list[int]], list[tuple[int, Seq]]] | None = None  # launched, not yet booked
        while queue or running:
            if should_stop():
                return
            if queue and (not running or self._admissible(queue, free) >= min(admit_min, len(queue))):
                if pending:  # the slots of sequences that finished in the launched step are free too
                    yield from self._book(*pending, running, free, in_flight=False)
                    pending = None
                yield from self._admit(queue, free, running)
                if not running:
                    continue
            if pending and not any(len(s.tokens) + 1 < s.row.params["max_new_tokens"] for s in running.values()):
                yield from self._book(*pending, running, free, in_flight=False)  # the last step any needs
                pending = None
                continue
            batch = bucket(self.sizes, max(running) + 1)
            sample = any(s.row.params["do_sample"] for s in running.values())
            extras = self._extras(running)
            stepped = list(running.items())
            if "grammar" in extras:  # the masks need the last tokens: the host books them while the forward runs
                self._forward(batch, extras)
                if pending and grammar.OVERLAP and not grammar.PARALLEL_ADVANCE:  # a family's masks once it is booked
                    yield from self._book(*pending, running, free, masks=self._mask_buffer(batch))
                    pending = None
                else:
                    if pending:
                        yield from self._book(*pending, running, free)
                        pending = None
                    self._fill_masks(running, batch)
            # which rows this step picks for without their mask (grammar.CHECK_FIRST), decided with the masks
            unmasked = itertools.repeat(False)
            if self.check_first:
                unmasked = [bool(s.guide and ("grammar" not in extras or s.guide.checking)) for _, s in stepped]
            launched = (self._launch(batch, sample, extras), stepped, unmasked)
            if pending:
                yield from self._book(*pending, running, free)
            pending = launched
            if not queue and running:
                self._compact(running, free, batch)
        # a step still pending here ran only sequences that had finished before it (EOS): its tokens are dropped

    def _admissible(self, queue, free: list[int]) -> int:
        """How many sequences at the head of the queue fit in the free slots and pages now (counted up to the
        admission group size; pages a cached prefix gives are not needed again)."""
        pages, n = self.pool.available(), 0
        for seq in queue:
            if n == len(free) or n >= self.slots // ADMIT_DIVISOR:
                break
            new = seq.pages_needed - len(self._shared(seq))
            if new > pages:
                break
            pages -= new
            n += 1
        return n

    def _shared(self, seq: Seq) -> list[int]:
        """The cached pages `seq`'s prompt can start from (none when reuse is off)."""
        return self.pool.match(seq.blocks[: seq.reusable]) if self.reuse and seq.reusable else []

    def _extras(self, running: dict[int, Seq]) -> tuple[str, ...]:
        """What the next step computes beyond tokens, for the rows it runs (nothing, mostly: the plain graph)."""
        seqs = running.values()
        return tuple(
            name
            for name, asked in (
                ("grammar", any(s.guide and not s.guide.checking for s in seqs)),
                ("logprobs", any(s.lp is not None for s in seqs)),
                ("cascade", len(self._cascade_pages) * self._sharing >= CASCADE_MIN_READS),
                ("filtered", self.filtering and any(s.filtered for s in seqs)),
            )
            if asked
        )

    def _choose_shared(self, running: dict[int, Seq]) -> None:
        """After an admission: the pages the cascade reads once a step. Of the cached prefixes the running
        sequences started from, the one that saves the most reads (rows holding it × its pages); written to the
        state when it changes. Any choice gives the same outputs (decode_attention's docstring)."""
        if not (self.cascade and self.reuse):
            return
        counts = collections.Counter(tuple(s.pages[: s.prefix]) for s in running.values() if s.prefix)
        best = max(counts, key=lambda key: counts[key] * len(key), default=())
        if best != self._cascade_pages:
            st = self.state
            self._cascade_pages = best
            st.shared.copy_(_to(st.shared.device, list(best) + [-1] * (st.shared.shape[0] - len(best)), torch.long))
            st.shared_n.fill_(len(best))
        self._sharing = sum(tuple(s.pages[: len(best)]) == best for s in running.values()) if best else 0

    def _mask_buffer(self, batch: int) -> torch.Tensor:
        """The host's bitmask of the next step's `batch` slots (pinned on CUDA), and its device copy in `outputs`
        (kept with the state: a captured graph reads it), made on first use."""
        st = self.state
        if "bitmask" not in st.outputs:
            st.outputs["bitmask"] = torch.full(
                (st.slots, grammar.words(self.vocab)), -1, dtype=torch.int32, device=st.tok.device
            )
        if self._host_bits is None:
            shape = st.outputs["bitmask"].shape
            self._host_bits = torch.empty(shape, dtype=torch.int32, pin_memory=st.tok.is_cuda)
        return self._host_bits[:batch]

    def _fill_masks(self, running: dict[int, Seq], batch: int) -> None:
        """The grammar masks of the next step, by slot, computed on the host and copied into `outputs`."""
        t = time.perf_counter()
        host = self._mask_buffer(batch)
        rows = [(slot, s.guide) for slot, s in running.items() if s.guide]
        if self.check_first:  # a checked row's bitmask row stays all ones
            rows = [(slot, g) for slot, g in rows if not g.checking]
        grammar.fill(host, rows)
        self.state.outputs["bitmask"][:batch].copy_(host, non_blocking=True)
        self.mask_s += time.perf_counter() - t

    def _forward(self, batch: int, extras: tuple[str, ...]) -> None:
        """Launch a grammar step's forward phase (its logits into `outputs["logits"]`, made on first use); of the
        step's `extras` only "cascade" concerns it."""
        st = self.state
        if "logits" not in st.outputs:
            st.outputs["logits"] = torch.empty(
                (st.slots, self.vocab), dtype=self.head.weight.dtype, device=st.tok.device
            )
        t = time.perf_counter()
        self.step(batch, False, tuple(e for e in extras if e == "cascade"), phase="forward")
        self._choose_due = True
        self.decode_s += time.perf_counter() - t

    def _launch(self, batch: int, sample: bool, extras: tuple[str, ...] = ()) -> Callable[[], tuple[list[int], Any]]:
        """Launch one decode step; returns a function that waits for the step and gives its tokens by slot and, with
        "logprobs", the step's first code in the log-probability ring (CUDA: the tokens are copied into one of two
        pinned host buffers, the log-probabilities into the ring's row, so the host does not wait at launch)."""
        st = self.state
        t = time.perf_counter()
        if "logprobs" in extras and "picked" not in st.outputs:
            zeros = {
                "picked": (torch.float32, ()),
                "values": (torch.float32, (logprobs.TOP,)),
                "ids": (torch.long, (logprobs.TOP,)),
            }
            for name, (dtype, tail) in zeros.items():
                st.outputs[name] = torch.zeros((st.slots, *tail), dtype=dtype, device=st.tok.device)
        if "grammar" in extras:  # the forward phase ran the model (and the cascade): choosing reads its logits
            self.step(batch, sample, tuple(e for e in extras if e != "cascade"), "choose")
        else:
            self.step(batch, sample, extras)
        self._choose_due = False
        self._redo_refused()
        self.steps += 1
        self.cascade_steps += "cascade" in extras
        self.progress.beat("decode step")  # launched: a step that never completes stalls the booking of the next
        faults.hit("decode_step")
        lp = None
        if "logprobs" in extras:
            lp = self._ring.put(self.steps, batch, *(st.outputs[n] for n in ("picked", "values", "ids")))
        if st.tok.device.type != "cuda":
            values = st.tok[:batch].tolist()
            self.decode_s += time.perf_counter() - t
            return lambda: (values, lp)
        if self._host is None:  # a step's bucket may pass this run's slots (up to the state's)
            self._host = torch.empty((2, *st.tok.shape), dtype=st.tok.dtype, pin_memory=True)
        host = self._host[self.steps % 2, :batch]
        host.copy_(st.tok[:batch], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.decode_s += time.perf_counter() - t

        def tokens() -> tuple[list[int], Any]:
            t = time.perf_counter()
            done.synchronize()
            waited = time.perf_counter() - t
            self.decode_s += waited
            self.wait_s += waited
            return host.tolist(), lp

        return tokens

    def _book(
        self,
        tokens: Callable[[], tuple[list[int], Any]],
        stepped: list[tuple[int, Seq]],
        unmasked: list[bool],
        running: dict[int, Seq],
        free: list[int],
        masks: torch.Tensor | None = None,
        in_flight: bool = True,
    ) -> Iterator[list[Seq]]:
        """Append a launched step's token to each sequence it ran (`stepped`: (slot, sequence) at launch; a
        compaction since may have moved it); free and yield the ones that finish. With `masks` (the host bitmask of
        the next step, which runs the sequences left: grammar.OVERLAP) the sequences are booked family by family,
        each family's next masks start as soon as its sequences are booked (grammar.Masks), and the masks are
        copied to the device once all are done (`mask_s` is then the wait for the last).

        A token picked without its mask (`unmasked`, grammar.CHECK_FIRST) is checked first; one its grammar refuses
        is not booked (`_refused`). `in_flight`: a later step is launched (it ran every sequence here)."""
        by_slot, lp = tokens()
        t = time.perf_counter()
        finished = []
        advance = [] if grammar.PARALLEL_ADVANCE else None  # (guide, token): advanced in one call below
        pending = grammar.Masks(masks) if masks is not None else None
        booked = zip(stepped, unmasked)
        if pending is not None:  # a family's masks start once its rows are booked (grammar.Masks)
            booked = sorted(booked, key=lambda item: item[0][1].guide.family if item[0][1].guide else -1)
        try:
            for (slot, seq), checked in booked:
                if seq.done:  # finished in the step before: this step was its extra one
                    continue
                if seq.discard:  # launched after a refused token: its input was that token
                    seq.discard -= 1
                elif checked and not seq.guide.check(by_slot[slot]):
                    self._refused(seq, in_flight)
                else:
                    self._take(seq, by_slot[slot], advance, checked)
                    if seq.lp is not None:
                        seq.lp.append(lp + slot)
                    if self._finished(seq):
                        del running[seq.slot]
                        self._free(seq, free)
                        finished.append(seq)
                        continue
                if pending is not None and seq.guide and not seq.guide.checking:
                    pending.add(seq.slot, seq.guide)
            if advance:
                grammar.advance(advance)
            if finished:
                self._deactivate(finished)
            if not self._choose_due:  # else after the choosing (`_launch`), which would write over it
                self._redo_refused()
            if self.check_first:
                self._judge_checks()
            self.book_s += time.perf_counter() - t
            if finished:
                yield finished  # the caller's work overlaps the masks too
            if pending is not None:
                t = time.perf_counter()
                pending.finish()
                self.state.outputs["bitmask"][: len(masks)].copy_(masks, non_blocking=True)
                self.mask_s += time.perf_counter() - t
        finally:
            if pending is not None:
                pending.wait()  # none still writes into the host bitmask

    def _admit(self, queue, free: list[int], running: dict[int, Seq]) -> Iterator[list[Seq]]:
        """Prefill queued sequences into free slots and pages, in chunks of about PREFILL_TOKENS padded tokens.
        Takes the queue's head while it fits: a long row is never passed over by shorter ones.

        A sequence whose prompt starts with cached pages shares them and prefills only the rest; its full prompt
        pages are registered for the rows after it. A row that shares a page a row of this same round registers
        goes in a later *wave*: its chunk is launched after the chunk that writes that page (one CUDA stream, so
        the write comes first). Chunks hold rows of one wave and one shared length."""
        if not running and self.pool.cost(self._shared(queue[0]), queue[0].pages_needed) is None:
            raise RuntimeError(
                f"a sequence of {queue[0].need} positions needs {queue[0].pages_needed} pages of "
                f"the fast engine's cache, which has {self.pool.available()}"
            )
        take, written_in = [], {}  # pages registered in this round -> the wave whose prefill writes them
        while queue and free:
            seq = queue[0]
            shared = self._shared(seq)
            new = self.pool.cost(shared, seq.pages_needed)
            if new is None:
                break
            queue.popleft()
            seq.slot = heapq.heappop(free)
            seq.pages = self.pool.take(shared, new)
            seq.prefix = len(shared)
            seq.wave = 1 + max((written_in[p] for p in shared if p in written_in), default=-1)
            if self.reuse:
                for page in self.pool.register(seq.pages, seq.blocks):
                    written_in[page] = seq.wave
                    self._unlaunched.add(page)
            self.prompt_tokens += len(seq.row.ids)
            self.reused_tokens += seq.prefix * PAGE
            take.append(seq)
        # similar lengths share a chunk: little padding
        take.sort(key=lambda s: (s.wave, s.prefix, len(s.row.ids) - s.prefix * PAGE))
        t = time.perf_counter()
        # every chunk is launched before the first one's tokens are read: the host prepares chunk k+1 while the
        # GPU runs chunk k (reading each chunk's tokens as it was launched left the GPU idle in between)
        launched, chunk = [], []
        for seq in take:
            width = len(seq.row.ids) - seq.prefix * PAGE
            if chunk and (
                (chunk[0].wave, chunk[0].prefix) != (seq.wave, seq.prefix)
                or (len(chunk) + 1) * width > PREFILL_TOKENS
                or (len(chunk) + 1) * seq.prefix * PAGE > PREFIX_TOKENS
            ):
                launched.append(self._launch_prefill(chunk))
                chunk = []
            chunk.append(seq)
        if chunk:
            launched.append(self._launch_prefill(chunk))
        for chunk, first in launched:
            yield from self._start(chunk, *first(), running, free)
        self.prefill_s += time.perf_counter() - t
        self._choose_shared(running)

    def _launch_prefill(self, chunk: list[Seq]) -> tuple[list[Seq], Callable[[], tuple[list[int], Any]]]:
        """Launch the prefill of `chunk`; returns it with a function that waits for its first tokens (and their
        log-probabilities, where a row of the chunk asked)."""
        faults.hit("generate", rows=len(chunk))
        first = self.prefill(chunk)
        self.prefill_chunks += 1
        lp = self.prefill_lp
        for seq in chunk:
            self._unlaunched.difference_update(seq.pages)
        if not first.is_cuda:
            tokens = first.tolist(), lp and [t.numpy() for t in lp]
            return chunk, lambda: tokens
        host = torch.empty(first.shape, dtype=first.dtype, pin_memory=True)
        host.copy_(first, non_blocking=True)
        done = torch.cuda.Event()
        done.record()

        def tokens() -> tuple[list[int], Any]:
            done.synchronize()
            return host.tolist(), lp and [t.cpu().numpy() for t in lp]

        return chunk, tokens

    def _start(
        self, chunk: list[Seq], first: list[int], lp: list | None, running: dict[int, Seq], free: list[int]
    ) -> Iterator[list[Seq]]:
        """Book a prefilled chunk's first tokens; yield the sequences that already finished."""
        self.progress.beat("prefill chunk")
        faults.hit("prefill")
        finished = []
        for i, (seq, token) in enumerate(zip(chunk, first)):
            self._take(seq, token)
            if seq.lp is not None:
                seq.lp.append(tuple(part[i] for part in lp))
            if self._finished(seq):
                self._free(seq, free)
                finished.append(seq)
            else:
                running[seq.slot] = seq
        if finished:
            self._deactivate(finished)
            yield finished

    def _take(self, seq: Seq, token: int, advance: list | None = None, checked: bool = False) -> None:
        """Book `token` on `seq`: its grammar advances (or, given `advance`, is listed there to be advanced with the
        step's others in one call: grammar.PARALLEL_ADVANCE; `checked`: it already took it, `Guide.check`)."""
        seq.tokens.append(token)
        if seq.guide is None:
            return
        if checked:
            self.checked_tokens += 1
        elif advance is None:
            seq.guide.take(token)
        else:
            advance.append((seq.guide, token))

    def _refused(self, seq: Seq, in_flight: bool) -> None:
        """`seq`'s grammar refused the token picked without its mask (grammar.CHECK_FIRST): nothing is booked, and
        the sequence goes back to its last booked token (`_redo_refused`), so that its next step picks that position
        again, under the mask (`Guide.check` set it). A step already launched after the refused one ran on it: its
        token is dropped when booked."""
        self.refused_tokens += 1
        seq.discard = int(in_flight)
        self._redo.append(seq)

    def _judge_checks(self) -> None:
        """Stop checking (every row masked from the next step on) once the run's model has shown that it refuses
        too much: more than grammar.CHECK_GIVE_UP of the tokens checked, judged from grammar.CHECK_SAMPLE of them
        on. Steps already launched are booked as they were picked."""
        tried = self.checked_tokens + self.refused_tokens
        if tried >= grammar.CHECK_SAMPLE and self.refused_tokens > grammar.CHECK_GIVE_UP * tried:
            for seq in self._checked_seqs:
                seq.guide.checks = False
            self.check_first, self._checked_seqs, self.check_stopped = False, [], True
            log.info(
                "fast engine: %d of %d tokens picked without their masks were refused: masking every row",
                self.refused_tokens,
                tried,
            )

    def _redo_refused(self) -> None:
        """Point each refused sequence's slot back at its last booked token and that token's position (after the
        last launch, before the next: a step reads `tok` and `pos`, and writes K/V at `pos`, so the refused token's
        K/V is written over and never read)."""
        if not self._redo:
            return
        seqs, self._redo = self._redo, []  # (none finished: a refused token is not booked)
        st = self.state
        slots, last, position = _to(
            st.tok.device,
            [[s.slot for s in seqs], [s.tokens[-1] for s in seqs], [len(s.row.ids) + len(s.tokens) - 1 for s in seqs]],
            torch.long,
        )
        st.tok[slots] = last.to(st.tok.dtype)
        st.pos[slots] = position.to(st.pos.dtype)

    def _free(self, seq: Seq, free: list[int]) -> None:
        """A finished sequence gives back its slot and pages (on the host; `_deactivate` points the slot at the
        trash page on the device before any later step or prefill)."""
        seq.done = True
        if self._cascade_pages and tuple(seq.pages[: len(self._cascade_pages)]) == self._cascade_pages:
            self._sharing -= 1
        if seq.lp is not None:
            self._gather_lp(seq)
        heapq.heappush(free, seq.slot)
        self.pool.give_back(seq.pages)  # its registered prompt pages stay cached for later rows
        seq.pages = []

    def _gather_lp(self, seq: Seq) -> None:
        """A finished sequence's log-probabilities as arrays, from its prefill's entry and its codes in the ring
        (gathered now: the steps after it reuse the ring's rows)."""
        (picked, values, ids), codes = seq.lp[0], seq.lp[1:]
        k = self._ring.k
        rest = self._ring.gather(codes)
        seq.lp = tuple(np.concatenate([first[None], more]) for first, more in zip((picked, values[:k], ids[:k]), rest))

    def _deactivate(self, seqs: list[Seq]) -> None:
        """Mark the slots of `seqs` inactive, at position 0 of the trash page, without waiting for the GPU (a list
        index would be copied to the device synchronously, so the index goes through pinned memory).

        A free slot stays in the decode batch until it is refilled or compacted away, and the step writes its K/V
        at its position: pointed at the trash page it never writes into pages handed to another row, nor past its
        own (a row filling its pages exactly ends at pos = need after its extra step)."""
        st = self.state
        slots = torch.tensor([s.slot for s in seqs], pin_memory=st.active.is_cuda).to(
            st.active.device, non_blocking=True
        )
        st.active.index_fill_(0, slots, 0)
        st.pos.index_fill_(0, slots, 0)
        st.table.index_fill_(0, slots, 0)

    def _finished(self, seq: Seq) -> bool:
        params = seq.row.params
        if len(seq.tokens) >= params["max_new_tokens"]:
            return True
        return not params["ignore_eos"] and seq.tokens[-1] in self.eos

    def _compact(self, running: dict[int, Seq], free: list[int], batch: int) -> None:
        """Move the highest running slots down into free low slots when that lets the step use a smaller
        bucket (the queue is empty: only draining is left)."""
        target = bucket(self.sizes, len(running))
        if target >= batch:
            return
        src = sorted((s for s in running if s >= target), reverse=True)  # none if the rows above it just finished
        if not src:
            return
        dst = [heapq.heappop(free) for _ in src]  # each below target: fewer rows run than it holds
        for a, b in zip(src, dst):
            seq = running.pop(a)
            seq.slot = b
            running[b] = seq
        for a in src:
            heapq.heappush(free, a)
        self.move(src, dst)


def _to(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """`values` (nested lists) as one tensor on `device`, copied from pinned memory without waiting on CUDA."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class _Dummy:
    """A row of the warm-up prefill."""

    params: dict[str, Any]
    ids: list[int]


def _size_oblivious():
    """Compile the layers for any batch size and width, 1 included: with dynamic shapes Dynamo specializes a size of
    1 apart (its "0/1 specialization"), so the warm-up compiled a prefill of one row and one of two, and decode
    steps at batch 1 and 2: 16 graphs for the tiny Qwen3 model where 8 serve them all. Size-oblivious sizes
    (torch's `backed_size_oblivious`, patched only around the engine's compiled calls) drop the size-1 variants.
    Measured on this repository's 2-core CPU (tiny model, `prepare` with Inductor's C++ backend, one run each):
    35.9 -> 25.5 s with an empty compile cache, 11.2 -> 10.0 s with a full one. A torch without the option compiles
    as before, and so does a model whose warm-up fails to compile size-oblivious (`prepare` logs why and compiles
    it again)."""
    try:
        import torch.fx.experimental._config as fx_config
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(fx_config, "backed_size_oblivious"):  # patch() would raise only when entered
        return contextlib.nullcontext()
    return fx_config.patch(backed_size_oblivious=True)


def _raise_recompile_limit(limit: int = 64) -> None:
    """Dynamo recompiles a layer for a few shape and tensor-kind variants (prefill and decode apart, sizes 1);
    its default limit (8) would silently fall back to eager past that."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)


NO_FILTER = (0, 1.0)  # (top_k, top_p) that filter nothing


def _filters(params: dict[str, Any]) -> tuple[int, float]:
    """A row's (top_k, top_p): NO_FILTER unless it samples (generate ignores them in greedy decoding). Its own
    parameters only, as `row_problem` judges them: None is off, not the model's generation_config."""
    if not params["do_sample"]:
        return NO_FILTER
    return int(params.get("top_k") or 0), float(params.get("top_p") or 1.0)


def _filter(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `scaled` (fp32 logits / temperature, grammar-masked ones -inf) sorted descending, with -inf where
    transformers' TopKLogitsWarper then TopPLogitsWarper filter it (generate's order, after the temperature), and
    the token at each sorted place. top_k > 0 keeps the values at least its k-th largest (ties with it too, as the
    warper's `<`); top_p < 1 then keeps, of what is left, the smallest most probable prefix whose probabilities
    reach top_p: each token whose more probable ones sum to less than top_p (the first always). One sort of static
    shape, no host sync: a CUDA graph captures it."""
    scaled, order = scaled.sort(dim=-1, descending=True)
    kth = scaled.gather(1, (top_k - 1).clamp(0, scaled.shape[1] - 1)[:, None])
    scaled.masked_fill_((top_k > 0)[:, None] & (scaled < kth), float("-inf"))
    probs = scaled.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the probability of the tokens sorted before each
    scaled.masked_fill_((top_p < 1)[:, None] & (before >= top_p[:, None]), float("-inf"))
    return scaled, order


def _temperature(params: dict[str, Any], loaded) -> float:
    if not params["do_sample"]:
        return 0.0
    if params["temperature"] is not None:
        return float(params["temperature"])
    return float(getattr(loaded.model.generation_config, "temperature", None) or 1.0)
