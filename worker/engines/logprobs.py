"""Log-probabilities of the generated tokens (`logprobs`, `top_logprobs`), computed on the device beside sampling.

Which distribution: the log-softmax, in fp32, of the logits the engine samples from *before* temperature, top-k,
top-p and the grammar mask of a constrained row, that is the model's own next-token distribution (vLLM's default,
"raw" log-probabilities; a plain forward pass gives the same numbers, tests/test_engine_logprobs.py), except where
the row itself asks for a repetition_penalty or ignore_eos (EOS masked): those change the logits before any
engine could read them. One entry per completion token, EOS included where the row ended on it.

Shape (OpenAI's chat `choices[].logprobs.content`): per token {"token": text, "logprob": float, "bytes": [UTF-8
bytes], "top_logprobs": [{"token", "logprob", "bytes"}, … top_logprobs of them, most likely first]}; the text of a
token that is part of a character is that piece decoded with replacement, its bytes are exact (llguidance's view of
the tokenizer). core/openai_batch.py turns it into /v1/completions' shape.

Cost when no row asks: none. The padded and static engines add `Recorder` to `generate` only then; the fast
engine runs its plain CUDA graph, and a variant that also writes `step`'s outputs only for a batch where a row asks.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from worker.engines import grammar

TOP = 20  # the most top_logprobs a row may ask for (core/structured.py TOP_LOGPROBS_MAX)
# JSON has no -inf: a token the model gave no probability at all (a masked EOS) is reported as -9999.0, as OpenAI's
# API reports one
NO_PROBABILITY = -9999.0


def step(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each row's chosen token (batch,), top-k logprobs (batch, k), their token ids (batch, k))."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    picked = lsm.gather(1, chosen[:, None].long())[:, 0]
    values, ids = lsm.topk(k, dim=-1) if k else (lsm[:, :0], chosen[:, None][:, :0].long())
    return picked, values, ids


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

    def finish(self, last: torch.Tensor) -> list[tuple[list[float], list[list[float]], list[list[int]]]]:
        """Per sequence: (picked logprobs, top values, top ids) per step, given the last step's tokens `last`."""
        if self.prev is None:
            return []
        self.picked.append(self.prev.gather(1, last[:, None].to(self.prev.device))[:, 0])
        picked = torch.stack(self.picked, dim=1).tolist()
        batch = len(picked)
        values = torch.stack(self.values, dim=1).tolist() if self.k else [[[]] * len(picked[0])] * batch
        ids = torch.stack(self.ids, dim=1).tolist() if self.k else [[[]] * len(picked[0])] * batch
        return [(picked[i], values[i], ids[i]) for i in range(batch)]


class Tokens:
    """Token texts and bytes for the entries, each token looked up once per tokenizer (kept on the tokenizer
    object: a random model's G1 touches most of a 150k vocabulary once)."""

    def __init__(self, tok, vocab: int, eos: set[int]):
        self.tok = tok
        self.lltok = grammar.lltokenizer(tok, vocab, eos)
        self.cache: dict[int, tuple[str, list[int]]] = tok.__dict__.setdefault("_gpujobs_token_texts", {})

    def __call__(self, token: int) -> tuple[str, list[int]]:
        found = self.cache.get(token)
        if found is None:
            found = self.cache[token] = (self.tok.decode([token]), list(self.lltok.decode_bytes([token])))
        return found


def content(
    tokens: Tokens, ids: list[int], picked: list[float], values: list[list[float]], top_ids: list[list[int]], k: int
) -> list[dict[str, Any]]:
    """The entries of one output (`ids` its kept completion tokens; the per-step lists may run longer). Written for
    speed: G1 with logprobs builds 1024 × 256 of them, with top-5 each, as its rows finish."""
    out = []
    for step_i, token in enumerate(ids):
        text, raw = tokens(token)
        top = (
            [
                {"token": alt[0], "logprob": value if value > NO_PROBABILITY else NO_PROBABILITY, "bytes": alt[1]}
                for value, alt in zip(values[step_i][:k], map(tokens, top_ids[step_i][:k]))
            ]
            if k
            else []
        )
        value = picked[step_i]
        out.append(
            {
                "token": text,
                "logprob": value if value > NO_PROBABILITY else NO_PROBABILITY,
                "bytes": raw,
                "top_logprobs": top,
            }
        )
    return out
