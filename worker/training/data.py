"""Fine-tune data: training rows to token ids and labels, packing, batches, the validation split.

The loss is on completion/assistant tokens only (labels -100 elsewhere); chat rows go through the tokenizer's chat
template turn by turn, so the tokens trained are exactly those generation produces after the template's generation
prompt. A sequence longer than `max_seq_length` is truncated or refused, as the spec says. Packing is best fit
decreasing into blocks of exactly `max_seq_length`, rows whole (cut only when longer than a block), each row's
positions restarting at 0 and its first label dropped, so no row sees another and a block's loss is the sum of its
rows' losses (worker/training/finetune.py runs it; worker/training/setup.py picks how packed rows are kept apart).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from core.dataset import too_long_to_train
from core.errors import CannotTrain
from core.spec import FinetuneSpec
from core.training_data import split_problem, validation_rows

IGNORE = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    # packed blocks only: each row's positions restart at 0; `segments` are the rows' lengths (the last may be padding)
    position_ids: list[int] | None = None
    segments: list[int] | None = None
    real_tokens: int | None = None  # tokens that are not padding


ENCODE_BATCH = 4096  # texts per tokenizer call: a fast tokenizer spreads each call over the CPUs


def _encode(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, in batches: a fast tokenizer encodes a batch on all the CPUs, where one call per text
    runs on one (F1's 13,423 rows, 7.3M tokens: 5.2 s instead of 11.0 on 2 cores; ops/bench/finetune_data.py)."""
    ids: list[list[int]] = []
    for i in range(0, len(texts), ENCODE_BATCH):
        ids += tok(texts[i : i + ENCODE_BATCH], add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return ids


def _chat_text(tok, messages: list[dict[str, str]], *, generation_prompt: bool = False) -> str:
    if not messages:
        return ""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _texts(tok, row: dict[str, Any]) -> tuple[list[tuple[str, bool]], bool]:
    """A training row as texts in order, each with whether the model learns its tokens, and whether a learned EOS
    ends the row (text and prompt/completion rows; a chat template writes its own turn ends)."""
    if "text" in row:
        return [(row["text"], True)], True
    if "prompt" in row:
        return [(row["prompt"], False), (row["completion"], True)], True
    if not getattr(tok, "chat_template", None):
        raise CannotTrain(
            "the dataset has chat `messages` rows but the model's tokenizer has no chat template: "
            "use prompt/completion rows, or a model whose tokenizer_config.json has one"
        )
    # Turn by turn: an assistant turn's tokens are what follows the generation prompt of the turns before it.
    messages, texts, done = row["messages"], [], ""
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            head = _chat_text(tok, messages[:i], generation_prompt=True)
            texts.append((head[len(done) :], False))
            done = head
        text = _chat_text(tok, messages[: i + 1])
        texts.append((text[len(done) :], message["role"] == "assistant"))
        done = text
    return texts, False


def tokenize_rows(tok, rows: list[dict[str, Any]]) -> list[Example]:
    """Token ids and labels of training rows; labels are -100 except on what the model must learn to say. Every
    row's texts are encoded together (`_encode`), each text on its own, so a row's tokens are what encoding it alone
    gives."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    layouts = [_texts(tok, row) for row in rows]
    encoded = iter(_encode(tok, [text for texts, _ in layouts for text, _ in texts]))
    examples = []
    for texts, ends in layouts:
        ids, labels = [], []
        for _, learned in texts:
            part = next(encoded)
            ids += part
            labels += part if learned else [IGNORE] * len(part)
        if ends:
            ids, labels = ids + eos, labels + eos
        examples.append(Example(ids, labels))
    return examples


def tokenize_row(tok, row: dict[str, Any]) -> Example:
    """Token ids and labels of one training row (tokenize_rows)."""
    return tokenize_rows(tok, [row])[0]


def build_examples(tok, rows: list[tuple[int, dict[str, Any]]], spec: FinetuneSpec) -> tuple[list[Example], int]:
    """Tokenized rows; a too-long row is truncated or refused (CannotTrain naming the rows), as the spec says.

    Returns (examples, truncated count). `rows` are (line, row) pairs, so a refusal names the input lines. With
    packing, rows are concatenated and cut into blocks of max_seq_length, so a long row is split, never refused.
    """
    examples, too_long = [], []
    for (line, _), ex in zip(rows, tokenize_rows(tok, [row for _, row in rows]), strict=True):
        if len(ex.input_ids) > spec.max_seq_length and not spec.packing:
            too_long.append((line, len(ex.input_ids)))
            ex = Example(ex.input_ids[: spec.max_seq_length], ex.labels[: spec.max_seq_length])
        if any(label != IGNORE for label in ex.labels):
            examples.append(ex)
    if too_long and spec.truncation == "refuse":
        raise CannotTrain(too_long_to_train(too_long, spec.max_seq_length))
    if not examples:
        raise CannotTrain(
            "no training row has a token to learn (every completion/assistant turn was empty or cut "
            "off by max_seq_length): raise max_seq_length or shorten the prompts"
        )
    return examples, len(too_long)


def pack(examples: list[Example], length: int, pad_id: int = 0) -> list[Example]:
    """Pack rows into blocks of exactly `length` tokens, best fit decreasing, with no row attending to another.

    A row longer than `length` is cut into pieces of `length` first (so it is split, never refused). Whole pieces
    go, longest first, into the fullest block they fit (best fit), so rows are not cut at block edges. Each piece
    keeps its own positions (position_ids restart at 0), and its first label is dropped: run alone, a row's first
    token is never a target either, so a block's loss is exactly the sum of its rows' losses. A block is topped up
    to `length` with one padding segment (its own positions, no labels).
    """
    pieces = []
    for ex in examples:
        for i in range(0, len(ex.input_ids), length):
            labels = [IGNORE] + ex.labels[i + 1 : i + length]
            if any(label != IGNORE for label in labels):
                pieces.append((ex.input_ids[i : i + length], labels))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, block index), sorted: the first with room >= n is the best fit
    for i in sorted(range(len(pieces)), key=lambda j: -len(pieces[j][0])):
        n = len(pieces[i][0])
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            blocks.append([])
            room, b = length, len(blocks) - 1
        else:
            room, b = free.pop(at)
        blocks[b].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, b))
    return [_block([pieces[i] for i in members], length, pad_id) for members in blocks]


def _block(pieces: list[tuple[list[int], list[int]]], length: int, pad_id: int) -> Example:
    ids = [t for piece, _ in pieces for t in piece]
    labels = [t for _, piece in pieces for t in piece]
    positions = [p for piece, _ in pieces for p in range(len(piece))]
    segments = [len(piece) for piece, _ in pieces]
    real, pad = len(ids), length - len(ids)
    if pad:
        ids, labels, positions = ids + [pad_id] * pad, labels + [IGNORE] * pad, positions + list(range(pad))
        segments.append(pad)
    return Example(ids, labels, positions, segments, real)


class ExampleDataset(torch.utils.data.Dataset):
    def __init__(self, examples: list[Example]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, Any]:
        ex = self.examples[i]
        item: dict[str, Any] = {"input_ids": ex.input_ids, "labels": ex.labels}
        if ex.position_ids is not None:
            item.update(position_ids=ex.position_ids, segments=ex.segments)
        return item


def _tensor(rows: list[list[int]]) -> torch.Tensor:
    """int64 (rows, width) from equal-length lists, through numpy: 9× faster than torch.tensor on nested lists
    (1.4 against 12 ms for 24 lists of 2,048). The Trainer collates a step's micro-batches right after the step's
    loss is read, while the GPU waits."""
    return torch.from_numpy(np.array(rows, dtype=np.int64))


def padded_collate(pad_id: int):
    def collate(batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        width = max(len(b["input_ids"]) for b in batch)
        labels = _tensor([b["labels"] + [IGNORE] * (width - len(b["labels"])) for b in batch])
        labels[:, 0] = IGNORE  # never a target (nothing precedes it); so every way of counting targets agrees
        return {  # right padding: positions start at 0, as after left padding in generation
            "input_ids": _tensor([b["input_ids"] + [pad_id] * (width - len(b["input_ids"])) for b in batch]),
            "attention_mask": _tensor([[1] * len(b["input_ids"]) + [0] * (width - len(b["input_ids"])) for b in batch]),
            "labels": labels,
        }

    return collate


def packed_collate(varlen: bool):
    """Packed blocks (all the same length): no attention_mask, per-row position_ids; with `varlen`, the rows'
    cumulative lengths over the flattened batch for the packed_varlen attention
    (worker/training/packed_attention.py)."""

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        out = {
            "input_ids": _tensor([b["input_ids"] for b in batch]),
            "position_ids": _tensor([b["position_ids"] for b in batch]),
            "labels": _tensor([b["labels"] for b in batch]),
        }
        if varlen:  # keys only need cu_seq_lens_q (no _k: one tensor less for a compiled layer to guard on)
            cu = torch.tensor([0] + [n for b in batch for n in b["segments"]]).cumsum(0).to(torch.int32)
            out.update(cu_seq_lens_q=cu, max_length_q=out["input_ids"].shape[1])
        return out

    return collate


def split_validation(rows: list[tuple[int, dict[str, Any]]], fraction: float | None, seed: int):
    """(train, validation): rows marked `split: validation`, or a seeded random fraction of the training rows."""
    train = [(line, r) for line, r in rows if r.get("split") != "validation"]
    valid = [(line, r) for line, r in rows if r.get("split") == "validation"]
    if fraction and not valid:
        if problem := split_problem(len(train), fraction):  # refused at submit too: a job stored before that check
            raise CannotTrain(problem)
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
        n = validation_rows(len(train), fraction)
        picked = set(order[:n])
        valid = [train[i] for i in sorted(picked)]
        train = [row for i, row in enumerate(train) if i not in picked]
    return train, valid
