"""Families compiled from one LLTokenizer (the engine's) or from an LLTokenizer each: is anything shared between
families through the tokenizer? 1,024 rows, G1-JSON's output in lockstep, the tokenizer's own width.

    python ops/bench/results/2026-12-06-cpu-mask-scaling/one_or_many_lltokenizers.py [TOKENIZER_SIZE]
"""

import sys
import time

import llguidance
import llguidance.hf
import torch
from g1json_setup import g1json

tok, trace, eos, text = g1json(int(sys.argv[1]) if len(sys.argv) > 1 else 640)
N = 1024


def run(threads, families, separate):
    toks = [llguidance.hf.from_tokenizer(tok, eos_token=eos) for _ in range(families if separate else 1)]
    words = (toks[0].vocab_size + 31) // 32
    ex = llguidance.LLExecutor(num_threads=threads)
    firsts = [llguidance.LLMatcher(toks[f % len(toks)], text, log_level=0) for f in range(families)]
    rows = [firsts[i % families].deep_copy() for i in range(N)]
    order = sorted(range(N), key=lambda i: i % families)
    bits = torch.empty((N, words), dtype=torch.int32)
    total = 0.0
    for token in trace:
        t = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(rows[i], i) for i in order], bits.data_ptr(), words * 4, N)
        total += time.perf_counter() - t
        for m in rows:
            m.consume_token(token)
    return total / len(trace) * 1e3


for _ in range(2):
    print(
        f"tokenizer {len(tok)}: 1 thread {run(1, 1, False):.2f} | 2 threads 2 families, one LLTokenizer {run(2, 2, False):.2f} | "
        f"2 threads 2 families, an LLTokenizer each {run(2, 2, True):.2f} ms a step"
    )
