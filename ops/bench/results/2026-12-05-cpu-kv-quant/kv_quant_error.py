"""How much a quantized KV cache (kv_cache_dtype fp8 or int8, a float32 scale per position and head) moves K/V and
an attention's output, on the CPU: worker/engines/decode_attention.py's `quantize`, on Gaussian vectors and on
vectors with rare large outliers (1 % of the values 20x larger, as some models' keys have in a few channels).

    python ops/bench/results/2026-12-05-cpu-kv-quant/kv_quant_error.py > kv_quant_error.txt   # from the repo root

Relative error = ||dequantized - exact|| / ||exact||, over 64 rows x 8 kv heads x 512 positions x head_dim 128;
attention: one query per (row, head) over the 512 positions, softmax(q k / sqrt(128)) v, quantized K and V against
exact ones. Deterministic (seed 0)."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from worker.engines import decode_attention as da  # noqa: E402


def relative(x: torch.Tensor, exact: torch.Tensor) -> float:
    return round(((x - exact).norm() / exact.norm()).item(), 5)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    weights = torch.softmax(torch.einsum("bhd,bhld->bhl", q, k) * q.shape[-1] ** -0.5, dim=-1)
    return torch.einsum("bhl,bhld->bhd", weights, v)


def main() -> None:
    torch.manual_seed(0)
    shape = (64, 8, 512, 128)
    cases = {
        "gaussian": lambda: torch.randn(shape),
        "outliers_1pct_20x": lambda: torch.randn(shape) * (1 + 19 * (torch.rand(shape) < 0.01)),
    }
    out = {}
    for name, make in cases.items():
        k, v, q = make(), make(), torch.randn(shape[0], shape[1], shape[3])

        exact = attend(q, k, v)
        row = {}
        for kind, dtype in da.QUANTIZED.items():
            kq, vq = (da.dequantize(*da.quantize(x, dtype), torch.float32) for x in (k, v))
            row[kind] = {
                "kv_relative_error": relative(kq, k),
                "attention_relative_error": relative(attend(q, kq, vq), exact),
            }
        out[name] = row
    print(json.dumps(out, indent=1))
    print(f"{'vectors':<20}{'kind':<6}{'K/V rel. error':>16}{'attention rel. error':>22}")
    for name, row in out.items():
        for kind, r in row.items():
            print(f"{name:<20}{kind:<6}{r['kv_relative_error']:>16.5f}{r['attention_relative_error']:>22.5f}")


if __name__ == "__main__":
    main()
