"""Does a decode step gain from running its batch as two halves on two CUDA streams? An experiment for issue 25's
G1 target, before any engine change.

Why: a G1 decode step on an H100 is 70 % decode attention, which reads K/V at 89 % of the GPU's bandwidth, and
~25 % matmuls, norms and writes, which mostly compute (ops/bench/results/2026-12-06-h100-session46). The engine runs
them one after the other on one stream, so the bandwidth idles during the matmuls and the tensor cores during the
attention. Two halves of the batch on two streams, captured in one CUDA graph, let the GPU run one half's attention
beside the other half's matmuls where the block scheduler finds room (NanoFlow's nano-batches, without its SM
partitioning). The same question for a prefill chunk (compute-bound) beside a decode step (bandwidth-bound): issue
25's "prefill beside decode". Answered on an H100 (ops/bench/results/2026-12-06-h100-session47): two halves 0.985×
the whole batch, a prefill beside a decode step 1.043×; neither was built into the engine.

The layers are Qwen3-0.6B's decode step built from torch operations and the engine's own decode attention
(worker/engines/decode_attention.py) and K/V write, not the compiled transformers layers the engine runs: the
ratio between the ways is the result, not their absolute times (the engine's norms and RoPE are fused by Inductor;
here they are a few eager kernels each, in the graph).

    python ops/bench/overlap.py --out ops/bench/results/overlap.json    # on a GPU (~1 minute)
    python ops/bench/overlap.py --smoke --out /tmp/overlap.json         # CPU: tiny shapes, every way runs once

For each (batch, context) of SHAPES, the milliseconds of one decode step (all layers and the output layer's argmax)
replayed from a CUDA graph, median of REPS, each way:
- `one`: the whole batch on one stream (the engine today);
- `halves_serial`: two halves one after the other on one stream (what halving costs without overlap);
- `halves_streams`: two halves on two streams, forked and joined inside the graph;
- `quarters_streams`: four quarters on four streams.
`gain.*` is `one`'s time over the way's (> 1: faster). Then a decode step of G1's shape beside a prefill chunk of
PREFILL rows × 256 tokens through the same layers (FlashAttention, causal): `serial` one after the other, `streams`
side by side; `gain` = serial / streams. Outputs of the ways are compared (they compute the same rows).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench import decode_kernel, harness  # after the repository root is on sys.path

# Qwen3-0.6B (ops/bench/gen.py's model)
HIDDEN, HEADS, KV_HEADS, DIM, INTER, LAYERS, VOCAB = 1024, 16, 8, 128, 3072, 28, 151936
SHAPES = ((1024, 384), (1024, 256), (512, 512), (2048, 300))  # (batch, context): G1's mean and start, G2-like
PREFILL = (32, 256)  # rows × tokens of the prefill chunk beside a decode step
REPS = 30
SMOKE = dict(hidden=64, heads=4, kv_heads=2, dim=16, inter=128, layers=2, vocab=97, shapes=((8, 100),), prefill=(2, 16))


class Model:
    """Random bf16 weights of the layers, one K/V cache shared by the layers (each layer reads and writes the same
    pages: every step reads more than the L2 holds, so the bytes are the engine's)."""

    def __init__(self, torch, device, dtype, *, hidden, heads, kv_heads, dim, inter, layers, vocab, pages, page):
        self.torch, self.heads, self.kv_heads, self.dim = torch, heads, kv_heads, dim

        def w(n, m):
            return (torch.randn(n, m, device=device, dtype=dtype) * n**-0.5).contiguous()

        self.layers = [
            {
                "norm": torch.ones(hidden, device=device, dtype=dtype),
                "qkv": w(hidden, (heads + 2 * kv_heads) * dim),
                "o": w(heads * dim, hidden),
                "norm2": torch.ones(hidden, device=device, dtype=dtype),
                "gate_up": w(hidden, 2 * inter),
                "down": w(inter, hidden),
            }
            for _ in range(layers)
        ]
        self.head = w(hidden, vocab)
        self.k = torch.randn(pages, kv_heads, page, dim, device=device, dtype=dtype)
        self.v = torch.randn_like(self.k)

    def split(self, x):
        t = self.torch
        q, k, v = x.split((self.heads * self.dim, self.kv_heads * self.dim, self.kv_heads * self.dim), dim=-1)
        q = t.nn.functional.rms_norm(q.unflatten(-1, (self.heads, self.dim)), (self.dim,))
        k = t.nn.functional.rms_norm(k.unflatten(-1, (self.kv_heads, self.dim)), (self.dim,))
        return q * 0.5 + q.roll(1, -1) * 0.5, k * 0.5 + k.roll(1, -1) * 0.5, v.unflatten(-1, (self.kv_heads, self.dim))

    def mlp(self, x, layer):
        t = self.torch
        h = t.nn.functional.rms_norm(x, (x.shape[-1],), layer["norm2"])
        gate, up = (h @ layer["gate_up"]).chunk(2, dim=-1)
        return x + (t.nn.functional.silu(gate) * up) @ layer["down"]

    def decode(self, da, x, table, lengths, page, offset, splits):
        """One decode step of rows x (B, hidden): every layer, then the output layer and the greedy pick."""
        t = self.torch
        for layer in self.layers:
            h = t.nn.functional.rms_norm(x, (x.shape[-1],), layer["norm"])
            q, k, v = self.split(h @ layer["qkv"])
            da.write_step(self.k, None, page, offset, k)
            da.write_step(self.v, None, page, offset, v)
            att = da.decode(q, self.k, self.v, table, lengths, self.dim**-0.5, splits)
            x = self.mlp(x + att.flatten(1) @ layer["o"], layer)
        return (x @ self.head).argmax(-1)

    def prefill(self, x):
        """A prefill chunk (rows, tokens, hidden) through every layer (causal attention within each row; its K/V
        are not written: the cost is the matmuls and the attention)."""
        t = self.torch
        for layer in self.layers:
            h = t.nn.functional.rms_norm(x, (x.shape[-1],), layer["norm"])
            q, k, v = self.split(h @ layer["qkv"])
            att = t.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            x = self.mlp(x + att.transpose(1, 2).flatten(2) @ layer["o"], layer)
        return x[:, -1] @ self.head


def rows(torch, da, batch: int, ctx: int, hidden: int, pages: int, device):
    """A decode step's slot inputs for `batch` rows of context `ctx`: hidden states, shuffled page tables, lengths,
    the page and offset of each row's new position."""
    per = -(-(ctx + 1) // da.PAGE)
    table = (torch.randperm(pages - 1, device=device)[: batch * per] + 1).view(batch, per)
    x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
    lengths = torch.full((batch,), ctx + 1, device=device, dtype=torch.int32)
    page = table[:, ctx // da.PAGE].contiguous()
    offset = torch.full((batch,), ctx % da.PAGE, device=device, dtype=torch.long)
    return x, table, lengths, page, offset


def ways(torch, da, model, inputs, streams: list) -> dict:
    """The decode step of `inputs` as each way runs it: name -> (function, its output buffer)."""
    batch = inputs[0].shape[0]

    def part(lo, hi):
        x, table, lengths, page, offset = (a[lo:hi] for a in inputs)
        return lambda: model.decode(da, x, table, lengths, page, offset, da.splits_for(hi - lo, model.kv_heads))

    def on_streams(parts, out):
        def run():
            if not streams:  # CPU: one after the other
                out.copy_(torch.cat([p() for p in parts]))
                return
            main = torch.cuda.current_stream()
            got = []
            for p, s in zip(parts, streams):
                s.wait_stream(main)
                with torch.cuda.stream(s):
                    got.append(p())
            for s in streams[: len(parts)]:
                main.wait_stream(s)
            out.copy_(torch.cat(got))

        return run

    def serial(parts, out):
        return lambda: out.copy_(torch.cat([p() for p in parts]))

    half, quarter = batch // 2, batch // 4
    out = {name: torch.empty(batch, dtype=torch.long, device=inputs[0].device) for name in NAMES}
    return {
        "one": (serial([part(0, batch)], out["one"]), out["one"]),
        "halves_serial": (serial([part(0, half), part(half, batch)], out["halves_serial"]), out["halves_serial"]),
        "halves_streams": (
            on_streams([part(0, half), part(half, batch)], out["halves_streams"]),
            out["halves_streams"],
        ),
        "quarters_streams": (
            on_streams([part(i * quarter, (i + 1) * quarter) for i in range(4)], out["quarters_streams"]),
            out["quarters_streams"],
        ),
    }


NAMES = ("one", "halves_serial", "halves_streams", "quarters_streams")


def timed(torch, fn, reps: int, cuda: bool) -> float:
    """Milliseconds of `fn`, replayed from a CUDA graph (decode_kernel.py's `timed`: median of `reps`), or one eager
    call off CUDA."""
    if cuda:
        return decode_kernel.timed(torch, fn, reps)
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main() -> int:
    import torch

    from worker.engines import decode_attention as da

    p = harness.parser(__doc__, out=harness.RESULTS / "overlap.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device, every way once")
    p.add_argument("--reps", type=int, default=REPS)
    args = p.parse_args()
    log = harness.logger("overlap")
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    dims = (
        SMOKE
        if args.smoke
        else dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, dim=DIM, inter=INTER, layers=LAYERS, vocab=VOCAB)
    )
    shapes, prefill_shape = dims.pop("shapes", SHAPES), dims.pop("prefill", PREFILL)
    torch.manual_seed(harness.SEED)
    pages = 1 + max(b * -(-(c + 1) // da.PAGE) for b, c in shapes)
    model = Model(torch, device, torch.bfloat16, pages=pages, page=da.PAGE, **dims)
    streams = [torch.cuda.Stream() for _ in range(4)] if cuda else []
    result = {**harness.commit_info(), "machine": harness.machine(), "smoke": args.smoke, "dims": dims, "decode": []}
    log(f"device {torch.cuda.get_device_name(0) if cuda else 'cpu'}; {len(shapes)} shapes, reps {args.reps}")
    for batch, ctx in shapes:
        inputs = rows(torch, da, batch, ctx, dims["hidden"], pages, device)
        row = {"batch": batch, "context": ctx}
        runs = ways(torch, da, model, inputs, streams)
        for name, (fn, _) in runs.items():
            row[f"{name}_ms"] = round(timed(torch, fn, args.reps, cuda), 4)
        # the ways pick the same tokens (the halves' attention splits differ: bf16 sums in another order may
        # move an argmax between near-equal logits, so this is a count, not an assertion)
        ref = runs["one"][1]
        row["same_tokens"] = {name: int((out == ref).sum()) for name, (_, out) in runs.items() if name != "one"}
        row["gain"] = {name: round(row["one_ms"] / row[f"{name}_ms"], 3) for name in NAMES[1:]}
        result["decode"].append(row)
        log(f"{row}")
        del inputs, runs
    # a prefill chunk beside a decode step of G1's shape
    batch, ctx = shapes[0]
    inputs = rows(torch, da, batch, ctx, dims["hidden"], pages, device)
    chunk = torch.randn(*prefill_shape, dims["hidden"], device=device, dtype=torch.bfloat16)
    splits = da.splits_for(batch, dims["kv_heads"])
    step_out = torch.empty(batch, dtype=torch.long, device=device)
    chunk_out = torch.empty(prefill_shape[0], dims["vocab"], device=device, dtype=torch.bfloat16)

    def decode():
        step_out.copy_(model.decode(da, *inputs, splits))

    def prefill():
        chunk_out.copy_(model.prefill(chunk))

    def serial():
        decode()
        prefill()

    def beside():
        if not streams:
            serial()
            return
        main = torch.cuda.current_stream()
        for s, fn in zip(streams, (decode, prefill)):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                fn()
        main.wait_stream(streams[0])
        main.wait_stream(streams[1])

    mixed = {"batch": batch, "context": ctx, "prefill_rows": prefill_shape[0], "prefill_tokens": prefill_shape[1]}
    for name, fn in (("decode", decode), ("prefill", prefill), ("serial", serial), ("streams", beside)):
        mixed[f"{name}_ms"] = round(timed(torch, fn, args.reps, cuda), 4)
    mixed["gain"] = round(mixed["serial_ms"] / mixed["streams_ms"], 3)
    result["prefill_beside_decode"] = mixed
    log(f"{mixed}")
    harness.write_json(args.out, result)
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print("\n| batch × context | one ms | halves, one stream | halves, two streams | quarters, four streams |")
    print("| --- | --- | --- | --- | --- |")
    for r in result["decode"]:
        cells = [f"{r[f'{n}_ms']:.3f} ({r['gain'][n]}×)" for n in NAMES[1:]]
        print(f"| {r['batch']} × {r['context']} | {r['one_ms']:.3f} | " + " | ".join(cells) + " |")
    m = result["prefill_beside_decode"]
    print(
        f"\nprefill {m['prefill_rows']} × {m['prefill_tokens']} beside decode {m['batch']} × {m['context']}: "
        f"decode {m['decode_ms']:.3f} ms, prefill {m['prefill_ms']:.3f} ms, one after the other "
        f"{m['serial_ms']:.3f} ms, side by side {m['streams_ms']:.3f} ms ({m['gain']}×)"
    )


if __name__ == "__main__":
    sys.exit(main())
