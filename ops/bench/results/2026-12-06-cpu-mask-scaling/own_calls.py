"""Python threads with an executor, an LLTokenizer and a family each, their masks at the same moment: each
thread's own call timed (not the step until both are done), against one thread alone.

    python ops/bench/results/2026-12-06-cpu-mask-scaling/own_calls.py
"""

import threading
import time

import llguidance
import llguidance.hf
import torch
from g1json_setup import g1json

tok, trace, eos, text = g1json()


def worker(n, out, key, barrier, consume):
    lltok = llguidance.hf.from_tokenizer(tok, eos_token=eos)
    words = (lltok.vocab_size + 31) // 32
    ex = llguidance.LLExecutor(num_threads=1)
    first = llguidance.LLMatcher(lltok, text, log_level=0)
    rounds = []
    for rep in range(6):
        rows = [first.deep_copy() for _ in range(n)]
        bits = torch.empty((n, words), dtype=torch.int32)
        for token in trace:
            barrier.wait()
            t = time.perf_counter()
            ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(rows)], bits.data_ptr(), words * 4, n)
            if rep:
                rounds.append(time.perf_counter() - t)
            barrier.wait()
            if consume:
                for m in rows:
                    m.consume_token(token)
    out[key] = sum(rounds) / len(rounds) * 1e3


for n, k in ((1024, 1), (512, 2), (512, 1)):
    out = {}
    barrier = threading.Barrier(k)
    ts = [threading.Thread(target=worker, args=(n, out, i, barrier, True)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    print(
        f"{k} Python thread(s), {n} rows each: "
        + ", ".join(f"{v:.2f}" for v in out.values())
        + " ms a step (the masks alone)"
    )
