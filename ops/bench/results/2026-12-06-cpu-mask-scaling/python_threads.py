"""One executor's two threads against two Python threads with an executor and a family each (the masks of a step
at the same moment, the step's time until both are done), 1,024 rows in lockstep along G1-JSON's output.

    python ops/bench/results/2026-12-06-cpu-mask-scaling/python_threads.py
"""

import threading
import time

import llguidance
import llguidance.hf
import torch
from g1json_setup import g1json

tok, trace, eos, text = g1json()
shared_tok = llguidance.hf.from_tokenizer(tok, eos_token=eos)
WORDS = (shared_tok.vocab_size + 31) // 32
N = 1024


def python_threads(k, own_tok):
    """k Python threads, each its own single-thread executor and family, N/k rows each, masks at the same moment."""
    out, barrier = {}, threading.Barrier(k)

    def worker(i):
        lltok = llguidance.hf.from_tokenizer(tok, eos_token=eos) if own_tok else shared_tok
        ex = llguidance.LLExecutor(num_threads=1)
        first = llguidance.LLMatcher(lltok, text, log_level=0)
        n, rounds = N // k, []
        for rep in range(4):
            rows = [first.deep_copy() for _ in range(n)]
            bits = torch.empty((n, WORDS), dtype=torch.int32)
            for token in trace:
                barrier.wait()
                t0 = time.perf_counter()
                ex.unsafe_compute_mask_ptr([(m, j) for j, m in enumerate(rows)], bits.data_ptr(), WORDS * 4, n)
                barrier.wait()
                if rep and i == 0:
                    rounds.append(time.perf_counter() - t0)  # until the slower thread is done too
                for m in rows:
                    m.consume_token(token)
        out[i] = rounds

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(k)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(out[0]) / len(out[0]) * 1e3


def one_executor(threads, families):
    ex = llguidance.LLExecutor(num_threads=threads)
    firsts = [llguidance.LLMatcher(shared_tok, text, log_level=0) for _ in range(families)]
    rounds = []
    for rep in range(4):
        rows = [firsts[i % families].deep_copy() for i in range(N)]
        order = sorted(range(N), key=lambda i: i % families)
        bits = torch.empty((N, WORDS), dtype=torch.int32)
        for token in trace:
            t0 = time.perf_counter()
            ex.unsafe_compute_mask_ptr([(rows[i], i) for i in order], bits.data_ptr(), WORDS * 4, N)
            if rep:
                rounds.append(time.perf_counter() - t0)
            for m in rows:
                m.consume_token(token)
    return sum(rounds) / len(rounds) * 1e3


for _ in range(2):
    print(
        f"1 thread: {one_executor(1, 1):.2f} | one executor, 2 threads, 2 families: {one_executor(2, 2):.2f} | "
        f"2 Python threads, an executor and family each, shared LLTokenizer: {python_threads(2, False):.2f} | "
        f"own LLTokenizer: {python_threads(2, True):.2f} ms a step, 1,024 rows"
    )
