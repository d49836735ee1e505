"""Log-probabilities of the generated tokens (`logprobs`, `top_logprobs`), computed on the device beside sampling.

Which distribution: the log-softmax, in fp32, of the logits the engine samples from *before* temperature, top-k,
top-p and the grammar mask of a constrained row, that is the model's own next-token distribution (vLLM's default,
"raw" log-probabilities; a plain forward pass gives the same numbers, tests/test_engine_logprobs.py), except where
the row itself asks for a repetition_penalty or ignore_eos (EOS masked): those change the logits before any
engine could read them. One entry per completion token, EOS included where the row ended on it.

Shape: what a reader gets is OpenAI's chat `choices[].logprobs.content`, per token {"token": text, "logprob":
float, "bytes": [UTF-8 bytes], "top_logprobs": [{"token", "logprob", "bytes"}, … top_logprobs of them, most likely
first]}; the text of a token that is part of a character is that piece decoded with replacement, its bytes are exact
(llguidance's view of the tokenizer). The engines store it compact (`pack`, core/logprob_store.py: arrays and each
token's text once), and the dicts are built when the rows are read: the engine thread makes no Python object per
token. The fast engine's decode steps copy their log-probabilities into a host ring (`Ring`), and each sequence
gathers its own rows of it when it finishes.

Cost when no row asks: none. The padded and static engines add `Recorder` to `generate` only then; the fast
engine runs its plain CUDA graph, and a variant that also writes `step`'s outputs only for a batch where a row asks.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessor

from core import logprob_store
from worker.engines import decode_attention, grammar
from worker.engines.decode_attention import triton  # None where the install has no triton (CPU builds may lack it)

TOP = 20  # the most top_logprobs a row may ask for (core/structured.py TOP_LOGPROBS_MAX)
CHUNK = 128  # columns per chunk of `top_k`'s first pass
LSE_BLOCK = 2048  # columns per iteration of the logsumexp kernel


def step(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each row's chosen token (batch,), top-k logprobs (batch, k), their token ids (batch, k)), in
    fp32. The log-softmax is never materialized: logprob = logit - logsumexp (fp32), and the top k are picked
    from the logits in their own dtype (the same order; bf16 halves what the selection reads, which on G1's
    1,024 × 152k logits a step is most of the cost)."""
    lse = logsumexp(logits)
    picked = logits.gather(1, chosen[:, None].long())[:, 0].float() - lse
    if not k:
        return picked, picked[:, None][:, :0], chosen[:, None][:, :0].long()
    values, ids = top_k(logits, k)
    return picked, values.float() - lse[:, None], ids


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """`torch.logsumexp(logits.float(), dim=-1)` in fp32, of a (batch, vocab) tensor. CUDA (or TRITON_INTERPRET=1):
    one Triton program per row reads it once in its own dtype (torch's takes 1.5 ms on G1's 1,024 × 152k bf16
    logits on the H200: a fp32 copy, then several passes)."""
    if not decode_attention.available(logits.device):
        return torch.logsumexp(logits.float(), dim=-1)
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    _logsumexp_kernel[(logits.shape[0],)](logits, out, logits.shape[1], BLOCK=LSE_BLOCK)
    return out


if triton is not None:
    import triton.language as tl

    @triton.jit
    def _logsumexp_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        """Row `program_id`: a running max and sum of exp per lane over blocks of the row, merged at the end."""
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * n
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < n, other=float("-inf")).to(tl.float32)
            new = tl.maximum(m, x)
            safe = tl.where(new == float("-inf"), 0.0, new)  # a lane that saw only -inf adds nothing
            total = total * tl.exp(m - safe) + tl.exp(x - safe)
            m = new
        top = tl.max(m, 0)
        safe = tl.where(top == float("-inf"), 0.0, top)
        tl.store(out_ptr + row, safe + tl.log(tl.sum(total * tl.exp(m - safe), 0)))


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits.topk(k, dim=-1)` (values equal; among equal values the ids may differ), read once: the k largest
    of a row lie in the k chunks of CHUNK columns with the largest maxima (any other value has k chunk maxima at
    or above it), so one max per chunk picks k chunks and the top k comes from their k × CHUNK columns. torch's
    topk over G1's 152k-wide rows makes several passes over them; this reads them once."""
    batch, vocab = logits.shape
    full = vocab // CHUNK * CHUNK
    if full < 8 * k * CHUNK:  # a small vocabulary: the plain selection
        return logits.topk(k, dim=-1)
    maxima = logits[:, :full].unflatten(1, (-1, CHUNK)).amax(-1)
    if full < vocab:  # the last, partial chunk
        maxima = torch.cat([maxima, logits[:, full:].amax(-1, keepdim=True)], dim=1)
    chunks = maxima.topk(k, dim=-1).indices
    cols = (chunks[:, :, None] * CHUNK + torch.arange(CHUNK, device=logits.device)).flatten(1)
    candidates = logits.gather(1, cols.clamp(max=vocab - 1)).masked_fill(cols >= vocab, float("-inf"))
    values, at = candidates.topk(k, dim=-1)
    return values, cols.gather(1, at)


def wanted(params: dict[str, Any]) -> int | None:
    """None when the row asks for no log-probabilities, else how many alternatives per token (0-20)."""
    return (params.get("top_logprobs") or 0) if params.get("logprobs") else None


class Recorder(LogitsProcessor):
    """Log-probabilities inside `model.generate`: each call records the top-k of this step's distribution and, from
    the previous step's, the logprob of the token picked there (now the last column of `input_ids`); `finish` adds
    the last step's. Placed before the grammar mask (transformers runs custom processors after its penalties and
    before temperature, top-k and top-p)."""

    def __init__(self, k: int):
        self.k = k
        self.prev: torch.Tensor | None = None
        self.picked: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.ids: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev is not None:
            self.picked.append(self.prev.gather(1, input_ids[:, -1:])[:, 0])
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        if self.k:
            values, ids = self.prev.topk(self.k, dim=-1)
            self.values.append(values)
            self.ids.append(ids)
        return scores

    def finish(self, last: torch.Tensor) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Per sequence: its picked logprobs (steps,), top values and ids (steps, k), given the last step's tokens
        `last`."""
        if self.prev is None:
            return []
        self.picked.append(self.prev.gather(1, last[:, None].to(self.prev.device))[:, 0])
        picked = torch.stack(self.picked, dim=1).cpu().numpy()
        batch, steps = picked.shape
        if self.k:
            values = torch.stack(self.values, dim=1).cpu().numpy()
            ids = torch.stack(self.ids, dim=1).cpu().numpy()
        else:
            values, ids = np.zeros((batch, steps, 0), np.float32), np.zeros((batch, steps, 0), np.int64)
        return [(picked[i], values[i], ids[i]) for i in range(batch)]


class Ring:
    """Host copies of the fast engine's decode steps' log-probabilities, a row per step, the last `rows` steps kept.
    `put` copies a step into row `step % rows` (CUDA: pinned memory, without waiting); a sequence notes `code(row,
    slot)` per token and, when it finishes, `gather`s its own entries in one indexing. `rows` must exceed the
    longest sequence's steps (plus the steps launched before it is gathered)."""

    def __init__(self, rows: int, width: int, k: int, pinned: bool):
        self.rows, self.width, self.k = rows, width, k
        self.picked = torch.empty((rows, width), dtype=torch.float32, pin_memory=pinned)
        self.values = torch.empty((rows, width, k), dtype=torch.float32, pin_memory=pinned)
        self.ids = torch.empty((rows, width, k), dtype=torch.int32, pin_memory=pinned)
        self._flat = (
            self.picked.numpy().reshape(rows * width),
            self.values.numpy().reshape(rows * width, k),
            self.ids.numpy().reshape(rows * width, k),
        )

    def put(self, step: int, batch: int, picked: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> int:
        """Copy a step's outputs (its first `batch` slots; `values`/`ids` of TOP columns) into its row; returns the
        row's first code (add the slot)."""
        row, copy = step % self.rows, picked.is_cuda
        self.picked[row, :batch].copy_(picked[:batch], non_blocking=copy)
        if self.k:
            self.values[row, :batch].copy_(values[:batch, : self.k].contiguous(), non_blocking=copy)
            self.ids[row, :batch].copy_(ids[:batch, : self.k].to(torch.int32), non_blocking=copy)
        return row * self.width

    def gather(self, codes: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(picked (n,), top values (n, k), top ids (n, k)) of the entries at `codes`, copied out of the ring."""
        at = np.asarray(codes, dtype=np.int64)
        return tuple(part[at] for part in self._flat)


class Tokens:
    """Token texts and bytes (as hex) for the stored entries, each token looked up once per tokenizer and kept on
    the tokenizer object in arrays indexed by token id (a random model's G1 touches most of a 150k vocabulary)."""

    def __init__(self, tok, vocab: int, eos: set[int]):
        self.tok = tok
        self.lltok = grammar.lltokenizer(tok, vocab, eos)
        cache = tok.__dict__.setdefault("_gpujobs_token_texts", {})
        if vocab not in cache:
            cache[vocab] = (np.zeros(vocab, dtype=bool), np.empty(vocab, dtype=object), np.empty(vocab, dtype=object))
        self.known, self.text, self.raw = cache[vocab]

    def table(self, ids: np.ndarray) -> tuple[list[str], list[str]]:
        """The texts and hex bytes of `ids` (distinct token ids), looking up the ones not seen yet."""
        for token in ids[~self.known[ids]].tolist():
            self.text[token] = self.tok.decode([token])
            self.raw[token] = bytes(self.lltok.decode_bytes([token])).hex()
            self.known[token] = True
        return self.text[ids].tolist(), self.raw[ids].tolist()


def pack(
    tokens: Tokens, ids: list[int], picked: np.ndarray, values: np.ndarray, top_ids: np.ndarray, k: int
) -> dict[str, Any]:
    """One output's log-probabilities as a row stores them (core/logprob_store.py): `ids` its kept completion
    tokens, the per-step arrays (`picked` (steps,), `values`/`top_ids` (steps, ≥ k)) may run longer."""
    n = len(ids)
    chosen = np.asarray(ids, dtype=np.int32)
    top = np.ascontiguousarray(top_ids[:n, :k], dtype=np.int32)
    used = np.sort(np.concatenate([chosen, top.ravel()]))
    vocab = used[np.concatenate([[True], used[1:] != used[:-1]])] if n else used  # np.unique, 8x faster here
    text, raw = tokens.table(vocab)
    return {
        "format": logprob_store.FORMAT,
        "n": n,
        "k": k,
        "ids": _b64(chosen, "<i4"),
        "logprob": _b64(picked[:n], "<f4"),
        "top_ids": _b64(top, "<i4"),
        "top_logprob": _b64(values[:n, :k], "<f4"),
        "vocab": _b64(vocab, "<i4"),
        "text": text,
        "bytes": raw,
    }


def _b64(values: np.ndarray, dtype: str) -> str:
    return base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")
