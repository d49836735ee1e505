"""Python threads with an executor, an LLTokenizer and a family each, their masks at the same moment: each
thread's own call timed (not the step until both are done), against one thread alone.

    python ops/bench/results/2026-12-06-cpu-mask-scaling/own_calls.py
"""

import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
sys.path[:0] = [str(ROOT), str(ROOT / "ops" / "bench")]

import llguidance  # noqa: E402
import llguidance.hf  # noqa: E402
import torch  # noqa: E402
from gen import SCHEMA_G1JSON  # noqa: E402

from core import structured  # noqa: E402
from ops.bench import harness  # noqa: E402
from worker import tinymodel  # noqa: E402

tok = harness.tokenizer(640)
trace = tok('{"name":"the people of the world","count":12345,"kind":"beta"}', add_special_tokens=False)["input_ids"]
eos = [tok.convert_tokens_to_ids(tinymodel.EOS)]
fmt = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
text = structured.grammar({"response_format": fmt})


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
