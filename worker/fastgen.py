"""The fast engine (`engine: fast`): continuous batching over a slot KV cache, decode steps as CUDA graphs.

Why: on an H200 the engines that go through `model.generate` leave the GPU idle (Python launches each kernel, a
static cache reads every padded position, a batch waits for its longest row). This engine keeps the model a
transformers model and replaces only the attention (registered through `AttentionInterface` as `gpujobs_fast`),
so every weight, norm, RoPE and LoRA layer is transformers' own:

- **Slot cache.** One preallocated tensor holds K and V of every layer for `slots` sequences of up to `max_len`
  tokens: (2, layers, slots, kv_heads, max_len, head_dim). Its size comes from the memory free after loading (see
  `plan`): more queued rows than slots wait in the engine's queue (admission control), never an out-of-memory.
- **Prefill** runs newly admitted rows through the model in chunks of about `PREFILL_TOKENS` padded tokens (right
  padding, causal SDPA with grouped K/V), writes their K/V into their slots and samples their first token.
- **Decode** runs one token for every running slot: K/V written at each slot's position, attention over each
  slot's real length only (worker/decode_attention.py: a Triton kernel on CUDA), the next token picked on the GPU
  (greedy argmax, or temperature sampling by the exponential race `argmax(p / E)`, E ~ Exp(1)). On CUDA the whole
  step is captured once per batch bucket as a CUDA graph and replayed: one launch per step.
- **Scheduling.** Rows are queued longest first (prompt + max_new_tokens) so the last rows to finish are short.
  Free slots are refilled from the queue as rows finish (in groups of at least `slots // ADMIT_DIVISOR`, so prefill
  runs on useful batch sizes); once the queue is empty, running rows are moved down into free low slots so the
  decode step shrinks to a smaller bucket. The host books each step's tokens one step behind the GPU (see `run`).

What it does not do (rows that ask for it run on the padded engine under `engine: auto`, and fail with a message
saying so under `engine: fast`): top_p, top_k and repetition_penalty; models with sliding-window layers, split over
several GPUs (device_map auto) or post-processing their logits; attention kernels other than sdpa/sdpa_gqa/eager
(the job asked for a specific kernel, which this engine would replace).
Stop strings are cut after the fact, as in the continuous engine. `seed` reseeds torch before each group of rows
with the same seed; sampled outputs depend on how rows share steps, as in every batched engine.

The state (cache, graphs) stays on the resident model (`model._gpujobs_fast`), so a second job on the same model
and options starts decoding at once; other engines call `release()` first to give its memory back.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from worker import decode_attention, faults
from worker.progress import Progress

log = logging.getLogger(__name__)

NAME = "gpujobs_fast"
MAX_SLOTS = 1024  # sequences in flight at most (G1's batch); fewer when memory is short
CPU_SLOTS = 16  # on CPU (tests): a small cache
PREFILL_TOKENS = 32768  # padded prompt tokens per prefill forward
ADMIT_DIVISOR = 8  # refill free slots once at least slots // ADMIT_DIVISOR are free (or nothing runs)
LEN_ALIGN = 64  # max_len is rounded up to a multiple of this
RESERVE_BYTES = 3 << 30  # kept free on the GPU for prefill activations and the allocator's slack
PROGRAMS = 1024  # decode kernel programs to aim for when splitting short batches over the context
REPLACEABLE_ATTENTION = ("sdpa", "sdpa_gqa", "eager")  # what the job may have asked for: no specific kernel
# CUDA: the decoder layers run compiled (torch.compile, dynamic shapes, the attention left out as an opaque call),
# which fuses the norms, RoPE and activations that eager mode launches as dozens of small kernels per layer. Once
# per model and process (prefill and decode compile apart); the time shows in `first_prefill_s` and `capture_s`.
COMPILE = True
COMPILE_BACKEND = "inductor"  # tests set "eager" (dynamo traces for real, runs the graphs eagerly)

_step: _Step | None = None  # what the attention function reads during a forward of this engine
_registered = None  # fast_attention as registered (wrapped by torch.compiler.disable)


@dataclass
class _Step:
    mode: str  # "prefill" or "decode"
    state: SlotState
    slots: torch.Tensor | None = None  # prefill: the slot of each row
    splits: int = 1


def fast_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention contract (q/k/v as (batch, heads, seq, dim), output (batch, seq, heads, dim)),
    reading and writing the slot cache of the running step."""
    step = _step
    if step is None:
        raise RuntimeError(f"attention {NAME!r} runs only inside the fast engine: load the model with sdpa")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    k_cache, v_cache = step.state.cache[0, module.layer_idx], step.state.cache[1, module.layer_idx]
    if step.mode == "prefill":
        length = key.shape[2]
        k_cache[step.slots, :, :length] = key
        v_cache[step.slots, :, :length] = value
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2), None
    batch = query.shape[0]
    state = step.state
    rows, pos = state.arange[:batch], state.pos[:batch]
    k_cache[rows, :, pos] = key[:, :, 0]
    v_cache[rows, :, pos] = value[:, :, 0]
    out = decode_attention.decode(query[:, :, 0], k_cache[:batch], v_cache[:batch], state.lengths[:batch], scale,
                                  step.splits)
    return out[:, None], None


def register() -> str:
    """Register `gpujobs_fast` in transformers' AttentionInterface (not in the mask interface: the model then
    builds no mask at all, which this attention does not need)."""
    from transformers import AttentionInterface

    # left out of the compiled layers (COMPILE) as an opaque call; wrapped here, not at import, because
    # torch.compiler.disable imports torch._dynamo (1.3 s), which a worker that never runs this engine need not pay
    global _registered
    if _registered is None:  # once: compiled layers guard on the function object they call
        _registered = torch.compiler.disable(fast_attention)
        AttentionInterface.register(NAME, _registered)
    return NAME


# --- what the engine can run ----------------------------------------------------------------------------------


def model_problem(model) -> str | None:
    """Why this model cannot run on the fast engine, or None."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    attn = config._attn_implementation
    if attn not in REPLACEABLE_ATTENTION:
        return (f"engine fast replaces the attention and cannot honour attn_implementation {attn!r}: use sdpa, or "
                "engine padded/continuous for that kernel")
    layer_types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types) or getattr(text, "use_sliding_window", False):
        return "engine fast supports full-attention models only (this one has sliding-window layers)"
    if getattr(model, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        return "engine fast runs decoder-only models"
    placed = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(placed) > 1:
        return ("engine fast runs a model on one device (device_map auto split this one over "
                f"{len(placed)}): use engine padded")
    if any(getattr(text, k, None) not in (None, 1, 1.0) for k in ("final_logit_softcapping", "logit_scale")):
        return "engine fast applies the output layer alone (this model post-processes its logits): use engine padded"
    return None


def row_problem(params: dict[str, Any]) -> str | None:
    """Why a row's sampling parameters need another engine, or None."""
    if params["repetition_penalty"] is not None:
        return "repetition_penalty"
    if params["do_sample"] and params["top_p"] not in (None, 1, 1.0):
        return "top_p"
    if params["do_sample"] and params["top_k"] not in (None, 0):
        return "top_k"
    return None


# --- the resident state ---------------------------------------------------------------------------------------


@dataclass
class SlotState:
    """The slot cache and the per-slot decode inputs, kept on the model between jobs."""

    cache: torch.Tensor  # (2, layers, slots, kv_heads, max_len, head_dim)
    tok: torch.Tensor  # (slots,) the token each slot feeds into the next decode step
    pos: torch.Tensor  # (slots,) where that token's K/V goes = its position
    active: torch.Tensor  # (slots,) long 1/0
    temp: torch.Tensor  # (slots,) sampling temperature, 0 = greedy
    no_eos: torch.Tensor  # (slots,) bool: ignore_eos rows, whose EOS logits are masked (as min_new_tokens does)
    lengths: torch.Tensor  # (slots,) int32, attention length of the step being run
    arange: torch.Tensor  # (slots,) 0..slots-1
    positions: torch.Tensor  # (max_len,) 0..max_len-1, the prefill's position ids (views of one normal tensor,
    # like the decode step's `pos`, so compiled code sees one kind of tensor: no recompile between the two)
    graphs: dict[tuple[int, bool], Any] = field(default_factory=dict)
    pool: Any = None
    capture_s: float = 0.0
    compiled: list | None = None  # one torch.compile wrapper per decoder layer (see COMPILE)
    eos: tuple[int, ...] | None = None  # the EOS ids the captured graphs mask (`eos_index`, on the device)
    eos_index: torch.Tensor | None = None
    first_prefill_s: float | None = None  # the first prefill of this state: with COMPILE, mostly compiling

    @property
    def slots(self) -> int:
        return self.cache.shape[2]

    @property
    def max_len(self) -> int:
        return self.cache.shape[4]


def release(model) -> None:
    """Drop the model's slot cache and graphs (other engines need the memory)."""
    if model.__dict__.pop("_gpujobs_fast", None) is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def _shape(model) -> tuple[int, int, int]:
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, kv_heads, head_dim


def device_free(device: torch.device) -> int | None:
    """Bytes the engine could allocate on `device` now: free in the driver plus what torch's allocator holds
    unused. None on CPU (the slot count is CPU_SLOTS there)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def resident_bytes(model) -> int:
    """Bytes of the slot cache kept on the model from an earlier run (0 if none)."""
    state = model.__dict__.get("_gpujobs_fast")
    return 0 if state is None else state.cache.numel() * state.cache.itemsize


def plan(model, device: torch.device, sequences: int, max_len: int, vocab: int,
         cap: int = MAX_SLOTS) -> tuple[int, int]:
    """(slots, max_len) for `sequences` sequences of at most `max_len` tokens: as many slots as fit in the memory
    free now (after the model and RESERVE_BYTES, and the step's logits), at most `cap` (CPU_SLOTS on CPU).

    The resident slot cache of an earlier run counts as free: `state_for` either reuses it or frees it before
    allocating. Counting it as taken left a second large run on a resident engine only the slack beside that
    cache: a handful of slots, or none (an out-of-memory retry at half the cap)."""
    max_len = math.ceil(max_len / LEN_ALIGN) * LEN_ALIGN
    layers, kv_heads, head_dim = _shape(model)
    per_slot = 2 * layers * kv_heads * max_len * head_dim * model.dtype.itemsize
    free = device_free(device)
    if free is None:
        return max(1, min(sequences, CPU_SLOTS, cap)), max_len
    free += resident_bytes(model)
    per_slot += vocab * 16  # fp32 logits, the sampling noise and their temporaries per row of a step
    fit = (free - RESERVE_BYTES) // per_slot
    if fit < 1:
        raise torch.OutOfMemoryError(
            f"the fast engine has no room for one sequence of {max_len} tokens ({per_slot / 2**20:.0f} MiB of KV "
            f"cache) in the {free / 2**30:.1f} GiB free: lower max_new_tokens or use a GPU with more memory")
    return int(min(sequences, cap, fit)), max_len


def state_for(model, device: torch.device, slots: int, max_len: int) -> SlotState:
    """The resident state if it is big enough, else a new one (the old one freed first)."""
    state = model.__dict__.get("_gpujobs_fast")
    if state is not None and state.slots >= slots and state.max_len >= max_len:
        return state
    release(model)
    layers, kv_heads, head_dim = _shape(model)
    cache = torch.zeros((2, layers, slots, kv_heads, max_len, head_dim), dtype=model.dtype, device=device)
    state = SlotState(
        cache=cache, tok=torch.zeros(slots, dtype=torch.long, device=device),
        pos=torch.zeros(slots, dtype=torch.long, device=device),
        active=torch.zeros(slots, dtype=torch.long, device=device),
        temp=torch.zeros(slots, dtype=torch.float32, device=device),
        no_eos=torch.zeros(slots, dtype=torch.bool, device=device),
        lengths=torch.zeros(slots, dtype=torch.int32, device=device),
        arange=torch.arange(slots, device=device), positions=torch.arange(max_len, device=device))
    model.__dict__["_gpujobs_fast"] = state
    return state


def buckets(slots: int) -> list[int]:
    """Decode batch sizes with a graph each: powers of two up to 128, then steps of 128, and `slots` itself."""
    sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b < slots]
    sizes += list(range(256, slots, 128))
    return sizes + [slots]


def bucket(sizes: list[int], n: int) -> int:
    return next(b for b in sizes if b >= n)


# --- one sequence ---------------------------------------------------------------------------------------------


@dataclass
class Seq:
    """One sequence in the engine: row `row` (a generate.Prepared), sample `k` of its n."""

    row: Any
    k: int
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def need(self) -> int:
        return len(self.row.ids) + self.row.params["max_new_tokens"]


# --- the engine -----------------------------------------------------------------------------------------------


class Engine:
    """Runs sequences to completion on one model; `run` yields the sequences that finish together."""

    def __init__(self, loaded, state: SlotState, eos: set[int], *, slots: int, graphs: bool,
                 compiled: bool = False):
        register()
        self.loaded = loaded
        self.slots = slots  # the state may be bigger (kept from an earlier job): this run uses slots 0..slots-1
        model = loaded.model
        causal = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.decoder = causal.get_decoder()
        self.head = causal.get_output_embeddings()
        self.state = state
        self.eos = eos
        self.use_graphs = graphs
        if compiled and state.compiled is None:
            _raise_recompile_limit()
            state.compiled = [torch.compile(layer._call_impl, dynamic=True, backend=COMPILE_BACKEND)
                              for layer in self.decoder.layers]
        self.compiled = state.compiled if compiled else None
        self.sizes = buckets(slots)
        self.pad = loaded.tokenizer.pad_token_id or 0
        if state.eos != tuple(sorted(eos)):  # graphs read the state's tensors only: new EOS ids, new graphs
            state.eos = tuple(sorted(eos))
            state.eos_index = torch.tensor(state.eos, device=state.cache.device) if eos else None
            state.graphs.clear()
        self.eos_index = state.eos_index
        self._host: torch.Tensor | None = None  # pinned buffers the decode steps' tokens are copied into
        self.progress = Progress()  # the stall watchdog's clock (worker/progress.py), given by `run`
        self.steps = 0
        self.prefill_s = 0.0
        self.decode_s = 0.0

    # -- model calls --

    @contextlib.contextmanager
    def _mode(self, mode: str, slots: torch.Tensor | None = None, splits: int = 1):
        global _step
        model = self.loaded.model
        before = model.config._attn_implementation
        model.config._attn_implementation = NAME  # every layer reads the config at call time
        _step = _Step(mode, self.state, slots, splits)
        layers = self.decoder.layers
        if self.compiled:
            for layer, fn in zip(layers, self.compiled):
                layer._compiled_call_impl = fn  # what nn.Module.compile() sets; removed again below
        try:
            yield
        finally:
            _step = None
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

    def _pick(self, logits: torch.Tensor, temp: torch.Tensor, sample: bool) -> torch.Tensor:
        """Next tokens: argmax (on the model's logits: bf16 to fp32 is exact, so the same token as plain generate's
        fp32 argmax), or for rows with temp > 0 a sample from softmax(logits / temp) in fp32."""
        if not sample:
            return logits.argmax(dim=-1)
        scaled = logits.float() / temp.clamp_min(1e-6)[:, None]
        race = scaled - torch.empty_like(scaled).exponential_().log()  # argmax(p / E) samples p
        return torch.where(temp > 0, race.argmax(dim=-1), logits.argmax(dim=-1))

    def prefill(self, seqs: list[Seq]) -> torch.Tensor:
        """Run the prompts of `seqs` (slots already assigned), fill their cache and slot inputs; returns their
        first tokens (on the device)."""
        st = self.state
        device = st.cache.device
        lengths = [len(s.row.ids) for s in seqs]
        width = max(lengths)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lengths[i]] = torch.tensor(s.row.ids)
        ids = ids.to(device)
        slots = torch.tensor([s.slot for s in seqs], device=device)
        last = torch.tensor(lengths, device=device) - 1
        temps = torch.tensor([_temperature(s.row.params, self.loaded) for s in seqs], device=device)
        no_eos = torch.tensor([bool(s.row.params["ignore_eos"]) for s in seqs], device=device)
        positions = st.positions[None, :width].expand(len(seqs), width)
        t = time.perf_counter()
        compiling = self.compiled is not None and st.first_prefill_s is None
        with self.progress.phase("compiling") if compiling else contextlib.nullcontext():
            with self._mode("prefill", slots):
                hidden = self.decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        if st.first_prefill_s is None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            st.first_prefill_s = time.perf_counter() - t
        logits = self.head(hidden[torch.arange(len(seqs), device=device), last])
        first = self._pick(self._mask_eos(logits, no_eos), temps, bool((temps > 0).any()))
        st.tok[slots] = first
        st.pos[slots] = last + 1
        st.active[slots] = 1
        st.temp[slots] = temps
        st.no_eos[slots] = no_eos
        return first

    def logits(self, batch: int) -> torch.Tensor:
        """The next-token logits (the model's dtype) of slots 0..batch-1 after writing their current token's K/V
        (inactive slots compute garbage that nothing reads). Leaves `tok` and `pos` as they were."""
        st = self.state
        st.lengths[:batch] = ((st.pos[:batch] + 1) * st.active[:batch]).to(torch.int32)
        splits = decode_attention.splits_for(batch, st.cache.shape[3], st.max_len, PROGRAMS)
        with self._mode("decode", splits=splits):
            hidden = self.decoder(input_ids=st.tok[:batch, None], position_ids=st.pos[:batch, None],
                                  use_cache=False).last_hidden_state[:, 0]
        return self.head(hidden)

    def _decode(self, batch: int, sample: bool) -> None:
        """One decode step over slots 0..batch-1: the next token of every active slot fed back as its input."""
        st = self.state
        logits = self._mask_eos(self.logits(batch), st.no_eos[:batch])
        st.tok[:batch] = self._pick(logits, st.temp[:batch], sample)
        st.pos[:batch] += st.active[:batch]

    def step(self, batch: int, sample: bool) -> None:
        if not self.use_graphs:
            self._decode(batch, sample)
            return
        graph = self.state.graphs.get((batch, sample))
        if graph is None:
            graph = self._capture(batch, sample)
        graph.replay()

    def _capture(self, batch: int, sample: bool):
        """Capture the decode step for `batch` slots as a CUDA graph (after warm-up runs on a side stream, which
        compile the Triton kernel); the slot inputs are restored afterwards, so capturing changes nothing."""
        with self.progress.phase("capturing CUDA graphs"):
            return self._capture_graph(batch, sample)

    def _capture_graph(self, batch: int, sample: bool):
        st = self.state
        t = time.perf_counter()
        saved = (st.tok.clone(), st.pos.clone())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._decode(batch, sample)
        torch.cuda.current_stream().wait_stream(stream)
        st.pool = st.pool or torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=st.pool):
            self._decode(batch, sample)
        st.tok.copy_(saved[0])
        st.pos.copy_(saved[1])
        torch.cuda.synchronize()
        st.graphs[(batch, sample)] = graph
        seconds = time.perf_counter() - t
        st.capture_s += seconds
        log.info("fast engine: captured the decode step for %d slots%s in %.2f s", batch,
                 " (sampling)" if sample else "", seconds)
        return graph

    def move(self, src: int, dst: int) -> None:
        """Move the sequence in slot `src` to the free slot `dst` (cache, inputs)."""
        st = self.state
        st.cache[:, :, dst] = st.cache[:, :, src]
        for buf in (st.tok, st.pos, st.active, st.temp, st.no_eos):
            buf[dst] = buf[src]
        st.active[src] = 0
        st.pos[src] = 0  # a free slot writes at position 0 (see _deactivate)

    def record(self, stats: dict[str, Any]) -> None:
        """Add this run's figures to the job's `info["fast"]`."""
        st = self.state
        stats.update(slots=self.slots, max_len=st.max_len, cuda_graphs=self.use_graphs,
                     compiled=self.compiled is not None,
                     graphs=[list(k) for k in sorted(st.graphs)], capture_s=round(st.capture_s, 3),
                     first_prefill_s=st.first_prefill_s and round(st.first_prefill_s, 3),
                     cache_gib=round(st.cache.numel() * st.cache.itemsize / 2**30, 3))
        stats["runs"] += 1
        stats["steps"] += self.steps
        stats["prefill_s"] = round(stats["prefill_s"] + self.prefill_s, 3)
        stats["decode_s"] = round(stats["decode_s"] + self.decode_s, 3)

    # -- the loop --

    def run(self, seqs: list[Seq], should_stop: Callable[[], bool],
            progress: Progress | None = None) -> Iterator[list[Seq]]:
        """Run every sequence to the end; yield the ones that finish, as a list per decode step (or prefill chunk)
        that finished any (not yielded: those cut off by `should_stop`). Each decode step and prefill chunk is
        reported to `progress` (compiling and graph capture as phases).

        The host works one step behind the GPU: step k+1 is launched before the tokens of step k are read and
        booked, so that bookkeeping (and the caller's work on each finished sequence) overlaps the GPU's step. A
        sequence that finished at step k so runs one more step, whose token is dropped: its slot's cache holds
        `need` positions, and that extra step writes at most position need - 1."""
        st = self.state
        if progress is not None:
            self.progress = progress
        st.active.zero_()
        st.pos.zero_()  # slots kept from an earlier run: every free slot writes at position 0
        queue = collections.deque(sorted(seqs, key=lambda s: -s.need))
        free = list(range(self.slots))
        running: dict[int, Seq] = {}
        admit_min = max(1, self.slots // ADMIT_DIVISOR)
        pending: tuple[Callable[[], list[int]], list[tuple[int, Seq]]] | None = None  # launched, not yet booked
        while queue or running:
            if should_stop():
                return
            if queue and (not running or len(free) >= admit_min):
                if pending:  # the slots of sequences that finished in the launched step are free too
                    yield from self._book(*pending, running, free)
                    pending = None
                yield from self._admit(queue, free, running)
                if not running:
                    continue
            if pending and not any(len(s.tokens) + 1 < s.row.params["max_new_tokens"] for s in running.values()):
                yield from self._book(*pending, running, free)  # the launched step is the last one any needs
                pending = None
                continue
            batch = bucket(self.sizes, max(running) + 1)
            sample = any(s.row.params["do_sample"] for s in running.values())
            launched = (self._launch(batch, sample), list(running.items()))
            if pending:
                yield from self._book(*pending, running, free)
            pending = launched
            if not queue and running:
                self._compact(running, free, batch)
        # a step still pending here ran only sequences that had finished before it (EOS): its tokens are dropped

    def _launch(self, batch: int, sample: bool) -> Callable[[], list[int]]:
        """Launch one decode step; returns a function that waits for the step and gives its tokens by slot (CUDA:
        copied into one of two pinned host buffers, so the host does not wait at launch)."""
        st = self.state
        t = time.perf_counter()
        self.step(batch, sample)
        self.steps += 1
        self.progress.beat("decode step")  # launched: a step that never completes stalls the booking of the next
        faults.hit("decode_step")
        if st.tok.device.type != "cuda":
            tokens = st.tok[:batch].tolist()
            self.decode_s += time.perf_counter() - t
            return lambda: tokens
        if self._host is None:
            self._host = torch.empty((2, self.slots), dtype=st.tok.dtype, pin_memory=True)
        host = self._host[self.steps % 2, :batch]
        host.copy_(st.tok[:batch], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self.decode_s += time.perf_counter() - t

        def tokens() -> list[int]:
            t = time.perf_counter()
            done.synchronize()
            self.decode_s += time.perf_counter() - t
            return host.tolist()

        return tokens

    def _book(self, tokens: Callable[[], list[int]], stepped: list[tuple[int, Seq]], running: dict[int, Seq],
              free: list[int]) -> Iterator[list[Seq]]:
        """Append a launched step's token to each sequence it ran (`stepped`: (slot, sequence) at launch; a
        compaction since may have moved it); free and yield the ones that finish."""
        by_slot = tokens()
        finished = []
        for slot, seq in stepped:
            if seq.done:  # finished in the step before: this step was its extra one
                continue
            seq.tokens.append(by_slot[slot])
            if self._finished(seq):
                seq.done = True
                del running[seq.slot]
                heapq.heappush(free, seq.slot)
                finished.append(seq)
        if finished:
            self._deactivate(finished)
            yield finished

    def _admit(self, queue, free: list[int], running: dict[int, Seq]) -> Iterator[list[Seq]]:
        """Prefill queued sequences into free slots, in chunks of about PREFILL_TOKENS padded tokens."""
        take = []
        while queue and free:
            seq = queue.popleft()
            seq.slot = heapq.heappop(free)
            take.append(seq)
        take.sort(key=lambda s: len(s.row.ids))  # similar lengths share a chunk: little padding
        t = time.perf_counter()
        chunk: list[Seq] = []
        for seq in take:
            if chunk and (len(chunk) + 1) * len(seq.row.ids) > PREFILL_TOKENS:
                yield from self._start(chunk, running, free)
                chunk = []
            chunk.append(seq)
        if chunk:
            yield from self._start(chunk, running, free)
        self.prefill_s += time.perf_counter() - t

    def _start(self, chunk: list[Seq], running: dict[int, Seq], free: list[int]) -> Iterator[list[Seq]]:
        faults.hit("generate", rows=len(chunk))
        first = self.prefill(chunk).tolist()
        self.progress.beat("prefill chunk")
        faults.hit("prefill")
        finished = []
        for seq, token in zip(chunk, first):
            seq.tokens.append(token)
            if self._finished(seq):
                seq.done = True
                heapq.heappush(free, seq.slot)
                finished.append(seq)
            else:
                running[seq.slot] = seq
        if finished:
            self._deactivate(finished)
            yield finished

    def _deactivate(self, seqs: list[Seq]) -> None:
        """Mark the slots of `seqs` inactive and point them at position 0, without waiting for the GPU (a list
        index would be copied to the device synchronously, so the index goes through pinned memory).

        Position 0 matters: a free slot stays in the decode batch until it is refilled or compacted away, and the
        step writes its K/V at its `pos`. A row whose prompt + max_new_tokens fills the cache ends with pos =
        max_len after its extra step: left there, the next step would write one past the cache (an IndexError on
        CPU, an out-of-bounds write on the GPU)."""
        st = self.state
        slots = torch.tensor([s.slot for s in seqs], pin_memory=st.active.is_cuda).to(st.active.device,
                                                                                       non_blocking=True)
        st.active.index_fill_(0, slots, 0)
        st.pos.index_fill_(0, slots, 0)

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
        for src in sorted((s for s in running if s >= target), reverse=True):
            dst = heapq.heappop(free)
            self.move(src, dst)
            seq = running.pop(src)
            seq.slot = dst
            running[dst] = seq
            heapq.heappush(free, src)


def _raise_recompile_limit(limit: int = 64) -> None:
    """Dynamo recompiles a layer for a few shape and tensor-kind variants (prefill and decode apart, sizes 1);
    its default limit (8) would silently fall back to eager past that."""
    import torch._dynamo

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    if getattr(config, name) < limit:
        setattr(config, name, limit)


def _temperature(params: dict[str, Any], loaded) -> float:
    if not params["do_sample"]:
        return 0.0
    if params["temperature"] is not None:
        return float(params["temperature"])
    return float(getattr(loaded.model.generation_config, "temperature", None) or 1.0)
