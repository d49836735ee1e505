"""The fast engine's log-probability step (worker/engines/logprobs.py `step`) on G1's shape, timed per part:
what a decode step with logprobs adds on the GPU. Prints a table and writes JSON.

    python ops/bench/logprob_step.py --out ops/bench/results/logprob-step.json     # CUDA; --batch, --vocab
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from worker.engines import logprobs  # noqa: E402


def timed(fn, reps: int) -> float:
    """Milliseconds per call, CUDA graphs aside (events around `reps` calls after 3 warm-up calls)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--k", type=int, default=logprobs.TOP)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.manual_seed(0)
    logits = (torch.randn(args.batch, args.vocab, device="cuda") * 3).to(torch.bfloat16)
    chosen = logits.argmax(-1)
    parts = {
        "float copy": lambda: logits.float(),
        "logsumexp (fp32 copy)": lambda: torch.logsumexp(logits.float(), dim=-1),
        "log_softmax fp32 (before)": lambda: torch.log_softmax(logits.float(), dim=-1),
        "topk fp32 log_softmax (before)": lambda: torch.log_softmax(logits.float(), dim=-1).topk(args.k, dim=-1),
        "topk bf16 logits": lambda: logits.topk(args.k, dim=-1),
        "logsumexp (triton)": lambda: logprobs.logsumexp(logits),
        "top_k (chunked)": lambda: logprobs.top_k(logits, args.k),
        "step": lambda: logprobs.step(logits, chosen, args.k),
    }
    results = {name: round(timed(fn, args.reps), 3) for name, fn in parts.items()}
    want_v, want_i = logits.topk(args.k, dim=-1)
    got_v, got_i = logprobs.top_k(logits, args.k)
    equal = bool(torch.equal(got_v, want_v))
    lse_diff = (logprobs.logsumexp(logits) - torch.logsumexp(logits.float(), dim=-1)).abs().max().item()
    out = {"batch": args.batch, "vocab": args.vocab, "k": args.k, "ms": results, "top_k_values_equal": equal, "logsumexp_max_abs_diff": lse_diff,
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__}  # fmt: skip
    print(f"logprob step parts, {args.batch} x {args.vocab} bf16 logits, k {args.k}, {out['device']}")
    for name, ms in results.items():
        print(f"  {name:34s} {ms:8.3f} ms")
    print(f"  chunked top_k values equal torch.topk's: {equal}; logsumexp kernel vs torch: {lse_diff:.2e}")
    if args.out:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
