"""The host side of a structured-output decode step (worker/engines/grammar.py) on G1-JSON's shape, timed per part:
what the fast engine's host does between a step's tokens and the next step's masked sampling. Prints a table and
writes JSON. CPU or CUDA (the copy, the device mask and the greedy pick are timed on CUDA only: the mask then
torch's argmax against `grammar.masked_argmax`'s one Triton kernel at three block sizes, their tokens checked equal
at the first step).

    python ops/bench/grammar_step.py --out ops/bench/results/grammar-step.json     # --batch, --vocab, --threads

Every row follows one valid output of G1-JSON's schema (ops/bench/gen.py SCHEMA_G1JSON) token by token, on the
benchmark model's tokenizer (worker/tinymodel.py, 640 tokens) or, with `--tokenizer-size N`, on a byte-level BPE of
N tokens trained on the Python standard library's sources (a real model's tokenizer is ~150k tokens, and a mask's
cost grows with them); each part is timed at every step of that output and averaged.
Two sets of rows: *lockstep* (every row at the same token, as in the first steps of a job) and *staggered* (each
row starts at a token drawn at random and starts over when its output is done, as rows are once a job runs). Each
order is timed three ways in the same steps, each on rows of its own: their matchers copied from one compiled
matcher (one family, the engine before families), dealt to `--threads` families (the engine now: grammar.FAMILIES),
and the same with each family on an executor and a thread of its own (`grammar.FAMILY_THREADS`); the same sets then
time their booking (`take` row by row, or in one call: `grammar.advance`, with FAMILY_THREADS on the third). Two
more sets time a step's booking and the next step's masks together, as the fast engine's host does them: one after
the other, or with each row's mask started as soon as it is booked (`grammar.OVERLAP`). A last set times
`grammar.CHECK_FIRST`'s host work where the model picks what the grammar allows: a check a row, no mask.

Every way runs every step, on rows of its own: an llguidance matcher keeps its last mask, and a second call in the
same state copies it (a JSON string's mask on a 89k-token BPE: ~100 µs a row, then ~2 µs), and a state's cost varies
~100× along the output. Until 2026-12-05 the FAMILY_THREADS masks ran on the rows just timed without them, so both
numbers averaged a computed mask with a copied one, and the booking and OVERLAP comparisons took their two ways on
alternate steps, so each saw other states (ops/bench/results/2026-12-05-cpu-mask-cache).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ops" / "bench"))
from gen import SCHEMA_G1JSON  # noqa: E402

from ops.bench import harness  # noqa: E402
from worker import tinymodel  # noqa: E402
from worker.engines import grammar  # noqa: E402

OUTPUT = '{"name":"the people of the world","count":12345,"kind":"beta"}'
PICK_BLOCKS = (1024, 2048, 4096)  # grammar.PICK_BLOCK's candidates, the engine's 2048 among them


class Rows:
    """`batch` constrained rows on `trace`, all at its first token or (`stagger`) each at a token drawn at random
    (seeded: the same for every set; until 2026-12-05 row i was at token i mod the trace's length, which put each
    family's rows, dealt in turn, at the same few tokens and made the families' work unequal), in `families` families
    (compiled for a tokenizer of their own, so that no two sets share a lexer)."""

    def __init__(self, tok, vocab: int, batch: int, trace: list[int], stagger: bool, families: int):
        self.eos = {tok.convert_tokens_to_ids(tinymodel.EOS)}
        fmt = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
        grammar.FAMILIES = families
        self.guides = grammar.guides(tok, vocab, self.eos, [{"response_format": fmt}] * batch)
        self.rows = list(enumerate(self.guides))
        self.trace = trace
        draw = random.Random(0)
        self.pos = [draw.randrange(len(trace)) if stagger else 0 for _ in range(batch)]
        for g, pos in zip(self.guides, self.pos):
            for token in trace[:pos]:
                g.take(token)

    def pairs(self) -> list:
        """(guide, the token it takes next) for each row."""
        return [(g, self.trace[pos]) for g, pos in zip(self.guides, self.pos)]

    def moved(self) -> None:
        """After the rows took their tokens: a row past its output's end starts over."""
        for i, g in enumerate(self.guides):
            self.pos[i] += 1
            if self.pos[i] == len(self.trace):
                if not g.matcher.is_accepting():
                    raise SystemExit("the trace did not end in an accepting state")
                g.reset()
                self.pos[i] = 0
        failed = grammar.failure(self.guides)
        if failed:
            raise SystemExit(f"the trace left its grammar: {failed}")


def book_then_mask(rows: Rows, pairs: list, bits: torch.Tensor) -> None:
    """What the fast engine's host does between a step's tokens and the next step's masks: each row takes its token,
    then every mask is computed (`grammar.fill`)."""
    for guide, token in pairs:
        guide.take(token)
    grammar.fill(bits, rows.rows)


def book_and_mask(pairs: list, bits: torch.Tensor) -> None:
    """The same with OVERLAP: the rows booked family by family, each family's masks started once its rows are
    (`grammar.Masks`)."""
    masks = grammar.Masks(bits)
    for row, (guide, token) in sorted(enumerate(pairs), key=lambda item: item[1][0].family):
        guide.take(token)
        masks.add(row, guide)
    masks.finish()


def check_all(pairs: list) -> None:
    """Each row checks its token as grammar.CHECK_FIRST books it (the trace's tokens: all allowed)."""
    for g, t in pairs:
        if not g.check(t):
            raise SystemExit(f"the grammar refused a token of the trace: {t}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936, help="the logits' width (the model's output layer)")
    p.add_argument("--threads", type=int, default=grammar.THREADS, help="the executor's threads and the families")
    p.add_argument("--tokenizer-size", type=int, default=640, help="640: the benchmark model's; more: a trained BPE")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    grammar.THREADS = args.threads
    cuda = torch.cuda.is_available()
    if args.tokenizer_size > args.vocab:
        raise SystemExit(f"--tokenizer-size {args.tokenizer_size} is wider than --vocab {args.vocab}")
    base = harness.tokenizer(args.tokenizer_size)
    words = grammar.words(args.vocab)
    bits = torch.empty((args.batch, words), dtype=torch.int32, pin_memory=cuda)
    device_bits = torch.empty((args.batch, words), dtype=torch.int32, device="cuda") if cuda else None
    logits = torch.randn(args.batch, args.vocab, device="cuda", dtype=torch.bfloat16) if cuda else None
    work = logits.clone() if cuda else None  # masked in place step after step (`logits` stays the model's)
    picked = torch.empty(args.batch, dtype=torch.long, device="cuda") if cuda else None
    pick_block = grammar.PICK_BLOCK
    n = args.threads
    orders = (("lockstep", False), ("staggered", True))
    ways = [(1, False)] + ([(n, False), (n, True)] if n > 1 else [])  # (families, FAMILY_THREADS)
    kinds = [(order, stagger, fam, threads) for order, stagger in orders for fam, threads in ways]
    tokenizers = [copy.deepcopy(base) for _ in range(len(kinds) + 3 * len(orders))]  # one per set of rows
    trace = tokenizers[0](OUTPUT, add_special_tokens=False)["input_ids"]
    sets = {  # a set per way, none timed twice in a step: a matcher keeps its last mask (the second call copies it)
        (order, fam, threads): Rows(tok, args.vocab, args.batch, trace, stagger, fam)
        for tok, (order, stagger, fam, threads) in zip(tokenizers, kinds)
    }
    booked = {  # booking and masks timed together, one way (OVERLAP off, on) per set, every step
        (order, overlap): Rows(tok, args.vocab, args.batch, trace, stagger, n)
        for tok, (order, stagger, overlap) in zip(
            tokenizers[len(kinds) :], [(o, st, ov) for o, st in orders for ov in (False, True)]
        )
    }
    checked = {  # grammar.CHECK_FIRST's host work for a model whose picks the grammar allows: a check a row, no mask
        order: Rows(tok, args.vocab, args.batch, trace, stagger, n)
        for tok, (order, stagger) in zip(tokenizers[len(kinds) + 2 * len(orders) :], orders)
    }
    ms: dict[str, list[float]] = {}

    def timed(name: str, fn, sync: bool = False) -> None:
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        ms.setdefault(name, []).append((time.perf_counter() - t) * 1e3)

    for step in range(len(trace)):
        timed("ones into the whole bitmask (fill_)", lambda: bits.fill_(-1))
        for (order, fam, threads), rows in sorted(sets.items(), reverse=step % 2 == 1):  # each first every other step
            label = f"{fam} famil{'y' if fam == 1 else 'ies'}"
            grammar.FAMILY_THREADS = threads  # each family on an executor and a thread of its own
            how = ", a thread each (FAMILY_THREADS)" if threads else " (grammar.fill)"
            timed(f"masks, {order}, {label}{how}", lambda r=rows: grammar.fill(bits, r.rows))
            grammar.FAMILY_THREADS = False
        if cuda:
            timed("bitmask to the device", lambda: device_bits.copy_(bits, non_blocking=True), sync=True)
            if step == 0:  # the fused pick's tokens are torch's at each block size (compiled here, not when timed)
                want = grammar.apply(logits, device_bits).argmax(dim=-1)
                for block in PICK_BLOCKS:
                    grammar.PICK_BLOCK = block
                    if not torch.equal(grammar.masked_argmax(logits, device_bits, picked), want):
                        raise SystemExit(f"grammar.masked_argmax (block {block}) picked other tokens than the mask "
                                         "and torch's argmax")  # fmt: skip
                grammar.PICK_BLOCK = pick_block
            timed("mask applied on the device, in place (grammar.apply)",
                  lambda: grammar.apply(work, device_bits, inplace=True), sync=True)  # fmt: skip
            timed("greedy pick: mask in place, then torch's argmax",
                  lambda: grammar.apply(work, device_bits, inplace=True).argmax(dim=-1), sync=True)  # fmt: skip
            for block in PICK_BLOCKS:
                grammar.PICK_BLOCK = block
                timed(f"greedy pick: fused (grammar.masked_argmax, block {block})",
                      lambda: grammar.masked_argmax(logits, device_bits, picked), sync=True)  # fmt: skip
            grammar.PICK_BLOCK = pick_block
        for (order, fam, threads), rows in sets.items():  # the engine's booking: `take` row by row, or one call
            pairs = rows.pairs()
            if fam == 1:
                timed(f"advance, {order}: take() per row (Python loop)", lambda p=pairs: [g.take(t) for g, t in p])
            else:
                grammar.FAMILY_THREADS = threads
                how = ", a thread each (FAMILY_THREADS)" if threads else ""
                timed(f"advance, {order}: grammar.advance, {n} families{how}", lambda p=pairs: grammar.advance(p))
                grammar.FAMILY_THREADS = False
            rows.moved()
        for (order, overlap), rows in booked.items():  # a step's booking, then the next masks, or both at once
            pairs = rows.pairs()
            if overlap:
                name = f"masks while booking, {order}, {n} families (grammar.Masks, OVERLAP)"
                timed(name, lambda p=pairs: book_and_mask(p, bits))
            else:
                name = f"book then masks, {order}, {n} families (take per row, grammar.fill)"
                timed(name, lambda r=rows, p=pairs: book_then_mask(r, p, bits))
            rows.moved()
        for order, rows in checked.items():
            pairs = rows.pairs()
            timed(f"check per row, {order} (Guide.check: CHECK_FIRST, no masks)", lambda p=pairs: check_all(p))
            rows.moved()
    results = {name: round(sum(v) / len(v), 3) for name, v in ms.items()}
    out = {
        "batch": args.batch,
        "vocab": args.vocab,
        "tokenizer_size": len(tokenizers[0]),
        "steps": len(trace),
        "cpus": os.cpu_count(),
        "threads": n,
        "ms_per_step": results,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
    }
    print(f"grammar step parts, {args.batch} rows, vocab {args.vocab} ({out['tokenizer_size']} tokens), "
          f"{len(trace)} steps, {out['cpus']} CPUs, executor threads {n}, {out['device']}")  # fmt: skip
    for name, value in results.items():
        print(f"  {name:58s} {value:8.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
