"""The fast engine's decode attention (worker/decode_attention.py) at G1's decode shapes, against SDPA with
`enable_gqa` (the issue's reference: 0.61 ms per layer at batch 1024, context 512 on an H200; bound 0.50 ms).

    python ops/bench/decode_kernel.py --out ops/bench/results/decode-kernel.json    # on a GPU

For each (batch, context): max |diff| against `reference_decode`, the kernel's time per layer (CUDA events, median
of 50 after warm-up), SDPA's time on the same cache sliced to the context (no mask: every row has that length),
and the bandwidth each reaches (K and V bytes read / time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def timed(torch, fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> int:
    import torch

    from worker import decode_attention as da

    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=ROOT / "ops" / "bench" / "results" / "decode-kernel.json")
    args = p.parse_args()
    heads, kv_heads, dim, max_len = 16, 8, 128, 1536
    results = []
    for batch, ctx in ((1024, 512), (1024, 384), (1024, 256), (256, 1024), (64, 1024), (8, 1024), (1, 1024)):
        torch.manual_seed(0)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        cache = torch.randn(2, batch, kv_heads, max_len, dim, device="cuda", dtype=torch.bfloat16)
        k, v = cache[0], cache[1]
        lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        splits = da.splits_for(batch, kv_heads, max_len, 1024)
        ours = da._triton_decode(q, k, v, lengths, dim ** -0.5, splits)
        ref = da.reference_decode(q, k[:, :, :ctx], v[:, :, :ctx], lengths, dim ** -0.5)
        diff = (ours.float() - ref.float()).abs().max().item()
        t_ours = timed(torch, lambda: da._triton_decode(q, k, v, lengths, dim ** -0.5, splits))
        ks, vs = k[:, :, :ctx], v[:, :, :ctx]
        t_sdpa = timed(torch, lambda: torch.nn.functional.scaled_dot_product_attention(
            q[:, :, None], ks, vs, scale=dim ** -0.5, enable_gqa=True))
        read = 2 * batch * kv_heads * ctx * dim * 2
        row = {"batch": batch, "context": ctx, "splits": splits, "max_abs_diff": diff, "ours_ms": round(t_ours, 4),
               "sdpa_gqa_ms": round(t_sdpa, 4), "ours_tb_s": round(read / t_ours / 1e9, 2),
               "sdpa_tb_s": round(read / t_sdpa / 1e9, 2), "bound_ms_at_4.3": round(read / 4.3e12 * 1e3, 4)}
        results.append(row)
        print(row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                    "results": results}, indent=2))
    print(f"{'batch':>6}{'ctx':>6}{'splits':>7}{'ours ms':>9}{'sdpa ms':>9}{'ours TB/s':>10}{'sdpa TB/s':>10}"
          f"{'max diff':>10}")
    for r in results:
        print(f"{r['batch']:>6}{r['context']:>6}{r['splits']:>7}{r['ours_ms']:>9.3f}{r['sdpa_gqa_ms']:>9.3f}"
              f"{r['ours_tb_s']:>10.2f}{r['sdpa_tb_s']:>10.2f}{r['max_abs_diff']:>10.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
