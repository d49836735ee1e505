"""The host side of a structured-output decode step (worker/engines/grammar.py) on G1-JSON's shape, timed per part:
what the fast engine's host does between a step's tokens and the next step's masked sampling. Prints a table and
writes JSON. CPU or CUDA (the copy and the device mask are timed on CUDA only).

    python ops/bench/grammar_step.py --out ops/bench/results/grammar-step.json     # --batch, --vocab, --threads

Every row follows one valid output of G1-JSON's schema (ops/bench/gen.py SCHEMA_G1JSON) token by token, on the
benchmark model's tokenizer (worker/tinymodel.py); each part is timed at every step of that output and averaged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ops" / "bench"))
from gen import SCHEMA_G1JSON  # noqa: E402

from worker import tinymodel  # noqa: E402
from worker.engines import grammar  # noqa: E402

OUTPUT = '{"name":"the people of the world","count":12345,"kind":"beta"}'


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936, help="the logits' width (the model's output layer)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    tok = tinymodel.build_tokenizer([])
    eos = {tok.convert_tokens_to_ids(tinymodel.EOS)}
    fmt = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
    params = [{"response_format": fmt}] * args.batch
    trace = tok(OUTPUT, add_special_tokens=False)["input_ids"]
    by_loop = grammar.guides(tok, args.vocab, eos, params)  # advanced one take() at a time
    by_par = grammar.guides(tok, args.vocab, eos, params)  # advanced by grammar.advance (the executor)
    words = grammar.words(args.vocab)
    bits = torch.empty((args.batch, words), dtype=torch.int32, pin_memory=cuda)
    device_bits = torch.empty((args.batch, words), dtype=torch.int32, device="cuda") if cuda else None
    logits = torch.randn(args.batch, args.vocab, device="cuda", dtype=torch.bfloat16) if cuda else None
    rows_loop = list(enumerate(by_loop))
    live = [(g.matcher, i) for i, g in rows_loop]
    row_bytes = words * 4
    ms: dict[str, list[float]] = {}

    def timed(name: str, fn, sync: bool = False) -> None:
        if sync:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        ms.setdefault(name, []).append((time.perf_counter() - t) * 1e3)

    for token in trace:
        timed("ones into the whole bitmask (fill_)", lambda: bits.fill_(-1))
        timed("masks, every row (grammar.fill)", lambda: grammar.fill(bits, rows_loop))
        timed(
            "masks, the executor alone",
            lambda: grammar.executor().unsafe_compute_mask_ptr(live, bits.data_ptr(), row_bytes, args.batch),
        )
        if cuda:
            timed("bitmask to the device", lambda: device_bits.copy_(bits, non_blocking=True), sync=True)
            timed("mask applied on the device (grammar.apply)", lambda: grammar.apply(logits, device_bits), sync=True)
        timed("advance: take() per row (Python loop)", lambda t=token: [g.take(t) for g in by_loop])
        timed("advance: grammar.advance (one call)", lambda t=token: grammar.advance([(g, t) for g in by_par]))
    failed = [g.error for g in by_loop + by_par if g.error]
    if failed:
        raise SystemExit(f"the trace left its grammar: {failed[0]}")
    if not all(g.matcher.is_accepting() for g in by_loop + by_par):
        raise SystemExit("the trace did not end in an accepting state")
    results = {name: round(sum(v) / len(v), 3) for name, v in ms.items()}
    out = {
        "batch": args.batch,
        "vocab": args.vocab,
        "tokenizer_size": len(tok),
        "steps": len(trace),
        "cpus": os.cpu_count(),
        "ms_per_step": results,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
    }
    print(f"grammar step parts, {args.batch} rows, vocab {args.vocab} ({len(tok)} tokens), {len(trace)} steps, "
          f"{out['cpus']} CPUs, {out['device']}")  # fmt: skip
    for name, value in results.items():
        print(f"  {name:44s} {value:8.3f} ms")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
