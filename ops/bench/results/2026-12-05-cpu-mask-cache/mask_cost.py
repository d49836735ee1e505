"""What one llguidance mask costs on G1-JSON's schema, single thread (the notes beside this file):

1. the same 64 rows (copies of one matcher, inside the "name" string) three times: a matcher keeps its last mask;
2. 256 rows in lockstep along G1-JSON's output, the first mask of each state, a row at a time on average, with the
   logits' width as the vocabulary (the engine's), without llguidance's slices, and at the tokenizer's own width.

    python ops/bench/results/2026-12-05-cpu-mask-cache/mask_cost.py [--tokenizer-size 151936]
"""

import argparse
import sys
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

OUTPUT = '{"name":"the people of the world","count":12345,"kind":"beta"}'
VOCAB = 151936


def masks(executor, matchers, words: int) -> float:
    """µs a row to compute `matchers`' masks in one call."""
    bits = torch.empty((len(matchers), words), dtype=torch.int32)
    t = time.perf_counter()
    executor.unsafe_compute_mask_ptr([(m, k) for k, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(bits))
    return (time.perf_counter() - t) / len(matchers) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer-size", type=int, default=151936)
    args = p.parse_args()
    tok = harness.tokenizer(args.tokenizer_size)
    trace = tok(OUTPUT, add_special_tokens=False)["input_ids"]
    eos = [tok.convert_tokens_to_ids(tinymodel.EOS)]
    fmt = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
    text = structured.grammar({"response_format": fmt})
    executor = llguidance.LLExecutor(num_threads=1)
    print(f"tokenizer of {len(tok)} tokens; G1-JSON's output is {len(trace)} tokens; one thread")

    lltok = llguidance.hf.from_tokenizer(tok, eos_token=eos, n_vocab=VOCAB)
    words = (VOCAB + 31) // 32
    first = llguidance.LLMatcher(lltok, text, log_level=0)
    for token in trace[:5]:  # inside the "name" string
        first.consume_token(token)
    rows = [first.deep_copy() for _ in range(64)]
    for n in range(3):
        print(f"1. the same 64 rows, call {n + 1}: {masks(executor, rows, words):.1f} µs a row")
    print(f"1. 64 new copies of that state: {masks(executor, [first.deep_copy() for _ in range(64)], words):.1f} µs")

    for label, kw in (
        ("logits' width, llguidance's slices (the engine's)", {"n_vocab": VOCAB}),
        ("logits' width, no slices", {"n_vocab": VOCAB, "slices": []}),
        ("the tokenizer's width, slices", {}),
    ):
        lltok = llguidance.hf.from_tokenizer(tok, eos_token=eos, **kw)
        words = (lltok.vocab_size + 31) // 32
        first = llguidance.LLMatcher(lltok, text, log_level=0)
        rows = [first.deep_copy() for _ in range(256)]
        per = []
        for token in trace:
            per.append(masks(executor, rows, words))
            for m in rows:
                assert m.consume_token(token)
        print(
            f"2. {label}: µs a row at each token:",
            " ".join(f"{x:.0f}" for x in per),
            f"| mean {sum(per) / len(per):.1f}",
        )


if __name__ == "__main__":
    main()
