"""Packed-row attention for fine-tunes, alone: torch's flash varlen kernel (what `packed_attention: varlen` runs)
against cuDNN's ragged attention (`aten._cudnn_attention_forward` with cumulative row lengths, the kernel torch's
nested-tensor SDPA calls), on F1's shapes: 16 blocks of 2,048 tokens packed from rows of 65-1,025 tokens, Qwen3-0.6B's
16 query and 8 K/V heads of 128.

For each backend, in rounds that interleave them (`--repeat`): the forward alone and forward + backward, each the
median of `--iters` CUDA-event timings after warm-up; the output and the gradients against the flash kernel's
(relative norm of the difference); and the same call compiled (`torch.compile(fullgraph=True)`, forward and backward),
to see that Inductor traces it. A backend that fails records its error and the others go on.

    python ops/bench/varlen_attention.py --out /tmp/varlen-attention.json     # CUDA only (~1 minute)

Measured on an H100 (torch 2.11, 2026-12-07, results/2026-12-07-h100-session53): cuDNN's ragged attention took
49.6 ms forward and 105 ms forward + backward for the 16 blocks, where the flash kernel takes 0.60 and 2.43 ms in the
same job's profile (that run's flash call failed on a bench bug, fixed since); with grouped K/V heads cuDNN's key and
value gradients were wrong (relative difference 1.85). Not a lever: packed attention stays on the flash kernel.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from worker.training.data import Example, pack  # noqa: E402


def packed_lengths(blocks: int, seq: int, seed: int = 0) -> list[int]:
    """Row lengths of `blocks` packed blocks of `seq` tokens, as F1's corpus packs (rows of 64-1,024 words)."""
    rng = random.Random(seed)
    rows, total = [], 0
    while total < blocks * seq * 1.1:
        n = rng.randint(64, 1024) + 1
        rows.append(Example(list(range(n)), list(range(n))))
        total += n
    out = []
    for block in pack(rows, seq)[:blocks]:
        out.extend(block.segments)
    return out


def flash(q, k, v, cu, max_len):
    """What `packed_attention: varlen` runs (its call built from this torch release's varlen_attn signature)."""
    from worker.training import packed_attention

    if packed_attention.problem(q.device):
        raise RuntimeError(packed_attention.problem(q.device))
    return packed_attention.attend(q, k, v, cu, max_len, None)


def cudnn(q, k, v, cu, max_len):
    """cuDNN ragged attention with the K/V heads repeated to the query heads' count."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return cudnn_gqa(q, k, v, cu, max_len)


def cudnn_gqa(q, k, v, cu, max_len):
    """cuDNN ragged attention as called (its ragged path takes query, key and value head counts apart); autograd is
    the aten op's own (its backward passes no attention bias, which Python cannot)."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False)[0]


BACKENDS = {"flash": flash, "cudnn": cudnn, "cudnn-gqa": cudnn_gqa}


def timed(fn, iters: int) -> float:
    """Median milliseconds of `fn()` over `iters` calls, by CUDA events."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-6))


def compiled_check(entry: dict, fn, inputs: tuple, grad: torch.Tensor, reference: tuple) -> None:
    """The call compiled as one graph, else (its error kept) with the call left to eager (a graph break, as a
    compiled decoder layer would run it): its numbers against the reference."""
    for how in ("fullgraph", "graph-break"):
        try:
            torch._dynamo.reset()
            if how == "fullgraph":
                compiled = torch.compile(fn, fullgraph=True)
            else:
                eager = torch.compiler.disable(fn)
                compiled = torch.compile(lambda *a, eager=eager: eager(*a) * 1.0)
            out = compiled(*inputs)
            grads = torch.autograd.grad(out, inputs[:3], grad)
            entry["compiled"] = how
            entry["compiled_rel_diff"] = {
                n: round(rel(a, b), 5) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), reference)
            }
            return
        except Exception as exc:  # noqa: BLE001
            entry[f"compile_{how}_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"


def time_backend(entry: dict, fn, inputs: tuple, grad: torch.Tensor, iters: int) -> None:
    with torch.no_grad():
        for _ in range(3):
            fn(*inputs)
        entry["fwd_ms"].append(round(timed(lambda: fn(*inputs), iters), 3))

    def step():
        torch.autograd.grad(fn(*inputs), inputs[:3], grad)

    for _ in range(3):
        step()
    entry["fwd_bwd_ms"].append(round(timed(step, iters), 3))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("varlen_attention.py: CUDA only", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    lengths = packed_lengths(args.blocks, args.seq)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    tokens = int(cu[-1])
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(heads: int) -> torch.Tensor:
        x = torch.randn(tokens, heads, args.dim, device=device, dtype=torch.bfloat16, generator=gen)
        return x.requires_grad_()

    q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
    grad = torch.randn(tokens, args.heads, args.dim, device=device, dtype=torch.bfloat16, generator=gen)
    result: dict = {
        "shape": {
            "tokens": tokens,
            "rows": len(lengths),
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "dim": args.dim,
            "max_len": args.seq,
        },
        "device": torch.cuda.get_device_name(0),
        "versions": {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()},
        "backends": {},
    }
    reference = None
    for name, fn in BACKENDS.items():
        entry = result["backends"].setdefault(name, {"fwd_ms": [], "fwd_bwd_ms": []})
        try:
            out = fn(q, k, v, cu, args.seq)
            grads = torch.autograd.grad(out, (q, k, v), grad)
            if reference is None:
                reference = (out.detach(), *grads)
            else:
                entry["rel_diff"] = {
                    n: round(rel(a, b), 5) for n, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), reference)
                }
            compiled_check(entry, fn, (q, k, v, cu, args.seq), grad, reference)
        except Exception as exc:  # noqa: BLE001  a backend that fails here is a finding
            entry["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
            traceback.print_exc()
    for _ in range(args.repeat):
        for name, fn in BACKENDS.items():
            entry = result["backends"][name]
            if "error" not in entry:
                try:
                    time_backend(entry, fn, (q, k, v, cu, args.seq), grad, args.iters)
                except Exception as exc:  # noqa: BLE001
                    entry["error"] = f"timing: {type(exc).__name__}: {str(exc)[:500]}"
    flops = sum(n * n for n in lengths) / 2 * 4 * args.dim * args.heads  # causal: half of QK^T and PV
    for entry in result["backends"].values():
        if entry["fwd_ms"]:
            entry["fwd_median_ms"] = statistics.median(entry["fwd_ms"])
            entry["fwd_bwd_median_ms"] = statistics.median(entry["fwd_bwd_ms"])
            entry["fwd_tflops"] = round(flops / entry["fwd_median_ms"] / 1e9, 1)
            entry["fwd_bwd_tflops"] = round(3.5 * flops / entry["fwd_bwd_median_ms"] / 1e9, 1)
    base = result["backends"]["flash"].get("fwd_bwd_median_ms")
    print(f"{'backend':<8} {'fwd ms':>8} {'fwd+bwd ms':>11} {'vs flash':>9}  rel diff / error")
    for name, entry in result["backends"].items():
        if "error" in entry or not entry["fwd_ms"]:
            entry.setdefault("error", "not timed")
            print(f"{name:<8} {'-':>8} {'-':>11} {'-':>9}  {entry['error'][:150]}")
            continue
        ratio = f"{base / entry['fwd_bwd_median_ms']:.2f}x" if base else "-"
        errors = {k: v[:120] for k, v in entry.items() if k.startswith("compile_")}
        print(
            f"{name:<8} {entry['fwd_median_ms']:>8.3f} {entry['fwd_bwd_median_ms']:>11.3f} {ratio:>9}  "
            f"{entry.get('rel_diff', '')} compiled ({entry.get('compiled')}) {entry.get('compiled_rel_diff')} {errors}"
        )
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
