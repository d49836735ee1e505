"""This box's own two-core scaling, without llguidance's executor in between: one process computing 1,024 rows'
masks on one thread, two processes computing 512 each at once, and one computing 512 alone. Each process starts
its timed rounds at one wall-clock moment given to all (after their imports), and times 10 rounds along the output
(the first one untimed), so the two processes' timed parts overlap.

    python ops/bench/results/2026-12-06-cpu-mask-scaling/processes.py
"""

import subprocess
import sys
import time
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
CODE = r"""
import sys, time
HERE, START = sys.argv[2], float(sys.argv[3])
sys.path.insert(0, HERE)
import llguidance, llguidance.hf, torch
from g1json_setup import g1json
rows_n = int(sys.argv[1])
tok, trace, eos, text = g1json()
lltok = llguidance.hf.from_tokenizer(tok, eos_token=eos)
words = (lltok.vocab_size + 31) // 32
ex = llguidance.LLExecutor(num_threads=1)
first = llguidance.LLMatcher(lltok, text, log_level=0)
time.sleep(max(0.0, START - time.time()))
total = 0.0
for rep in range(11):
    rows = [first.deep_copy() for _ in range(rows_n)]
    bits = torch.empty((rows_n, words), dtype=torch.int32)
    if rep == 1:
        total, began = 0.0, time.time()
    for token in trace:
        t = time.perf_counter()
        ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(rows)], bits.data_ptr(), words * 4, rows_n)
        total += time.perf_counter() - t
        for m in rows:
            m.consume_token(token)
print(f"{rows_n} rows: {total / len(trace) / 10 * 1e3:.2f} ms a step, timed {began - START:.1f} to {time.time() - START:.1f} s")
"""
for n, procs in ((1024, 1), (512, 2), (512, 1)):
    ps = [
        subprocess.Popen(
            [sys.executable, "-c", CODE, str(n), HERE, str(time.time() + 30)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(procs)
    ]
    print(f"{procs} process(es) at once:", [p.communicate()[0].strip() for p in ps])
