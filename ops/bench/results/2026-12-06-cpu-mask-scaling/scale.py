"""Do llguidance's executor threads scale on G1-JSON's masks? 1,024 rows in lockstep along G1-JSON's output, each
state's first mask; threads x families (independently compiled matchers) x bitmask width (the notes beside this file).

    python ops/bench/results/2026-12-06-cpu-mask-scaling/scale.py [--tokenizer-size 640]
"""

import argparse
import time

import llguidance
import llguidance.hf
import torch
from g1json_setup import g1json

p = argparse.ArgumentParser()
p.add_argument("--tokenizer-size", type=int, default=640)
p.add_argument("--rows", type=int, default=1024)
args = p.parse_args()
tok, trace, eos, text = g1json(args.tokenizer_size)
print(f"tokenizer {len(tok)} tokens, output {len(trace)} tokens, {args.rows} rows")
for width in (None, 151936):
    lltok = llguidance.hf.from_tokenizer(tok, eos_token=eos, **({"n_vocab": width} if width else {}))
    words = (lltok.vocab_size + 31) // 32
    for threads, families in ((1, 1), (2, 1), (2, 2), (2, 8)):
        ex = llguidance.LLExecutor(num_threads=threads)
        firsts = [llguidance.LLMatcher(lltok, text, log_level=0) for _ in range(families)]
        rows = [firsts[i % families].deep_copy() for i in range(args.rows)]
        order = sorted(range(args.rows), key=lambda i: i % families)  # grouped by family, as grammar.fill
        bits = torch.empty((args.rows, words), dtype=torch.int32)
        total = 0.0
        for token in trace:
            t = time.perf_counter()
            ex.unsafe_compute_mask_ptr([(rows[i], i) for i in order], bits.data_ptr(), words * 4, len(bits))
            total += time.perf_counter() - t
            for m in rows:
                assert m.consume_token(token)
        print(
            f"width {lltok.vocab_size:>6}  threads {threads}  families {families}: {total / len(trace) * 1e3:6.2f} ms a step"
        )
