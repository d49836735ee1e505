"""The fast engine's decode attention (worker/engines/decode_attention.py, paged) at G1's and G2's decode shapes,
against SDPA with `enable_gqa` over a contiguous cache (0.61 ms per layer at batch 1024, context 512 on an H200;
bound 0.50 ms at 4.3 TB/s). Every time is of a CUDA graph's replay, as the engine runs the step (results before
2026-12-05 timed eager launches, Python included: ~0.23 ms at any batch of 64 rows or fewer).

    python ops/bench/decode_kernel.py --out ops/bench/results/decode-kernel.json    # on a GPU

1. configs: every (warps, stages, pages per inner step) of CONFIGS at batch 1024 × context 512 (before 2026-12-07:
   384, six pages, which a step of 4 pages covers in two steps, half of one empty), for bf16 pages (the engine's
   CONFIG; the rest of the run uses the best) and for fp8 and int8 pages (QUANTIZED_CONFIG; `best_quantized`, each
   kind's used for its own times below: on an H100 they read their half of the bytes at ~1.7 TB/s with bf16's
   config and one page a step, 2026-12-06; more pages a step put more bytes in flight). Each config's output is
   checked (bf16 against SDPA, fp8 and int8 against the first config's over the same pages); one that disagrees or
   fails is recorded and never chosen, and the configs are written before anything else runs;
2. shapes: with the best config, for each (batch, context): max |diff| against SDPA on the same K/V laid out
   contiguously, the kernel's time per layer (CUDA events, median of 50 after warm-up), SDPA's time, and the
   bandwidth each reaches (K and V bytes read / time). Pages are shuffled, as after many admissions. Also the
   same K/V as fp8 and as int8 pages with a scale per position and head (`kv_cache_dtype`): each one's kernel
   time, its gain over the bf16 pages (`fp8_gain`, `int8_gain`), the bandwidth it reaches over the bytes it reads
   (values and scales), and its max |diff| against SDPA over the bf16 K/V (the rounding, not a kernel error: the
   CPU tests check the kernel against the reference over the same pages).
3. cascade: for each (batch, shared, own) of CASCADE_SHAPES, rows whose tables start with the same `shared`
   positions of pages (a cached prompt prefix, G3: 1,024) and go on with `own` positions of their own: the plain
   kernel (every row reads the shared pages) against the cascade (the shared pages read once for all rows, the
   merge included), max |diff| between them, and the bytes each must read at least. The grid of batch and shared
   length places the engine's CASCADE_MIN_READS.
4. K/V write: a decode step's write of each row's new K and V into its page (worker/engines/paged_attention.py:
   `cache[page, :, offset] = key[:, :, 0]`, a generic index_put, ~5 % of G1's CUDA time on 2026-12-04) against
   `index_copy_` into a flat (pages × kv_heads × PAGE, dim) view, its index computed in the layer or once a step;
   the caches they leave must be equal. Per layer, K and V. Also a quantized cache's write (fp8, int8), each vector
   quantized and its scale written beside it: the engine's kernel (`write_step`, `fp8_write_ms`) against torch's
   operations (`write_pages`, `fp8_write_torch_ms`), the same bytes (`fp8_write_equal`; `int8_…` likewise).

5. The K/V write folded into the kernel (`decode_attention.FOLD_WRITE`): per layer, `write_step` for K and V then the
   kernel, against the kernel that attends to the new vectors from its registers and stores them (`fold_write`:
   both times, `gain`, whether the pages are the same, and the outputs' max |diff|: the new position is summed last).

6. A prefill chunk's K/V write (`decode_attention.PREFILL_WRITE`): per layer, K and V of a chunk of `rows` prompts of
   `length` positions into shuffled pages, by torch's index_put (`write_pages`, the default) against the Triton
   kernel (`write_prefill`): both times, `gain`, the bandwidth each reaches over the bytes written, and whether
   the pages are the same. Shapes of G1's chunks (128 × 256), G2's (64 × 512) and long prompts (16 × 2048). The same
   chunks into fp8 and int8 pages (`QUANT_PREFILL_WRITE`): `write_pages`' torch chain against the kernel, their
   times and whether the bytes, the scales and the returned values are the same (`fp8_same`, `int8_same`).

`--writes-only` runs sections 4 to 6 alone (seconds: a check of the writes after a change to them); `--configs-only`
sections 1 and 2 (the configs, then the shapes with the best of them).
"""

from __future__ import annotations

import statistics
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench import harness  # after the repository root is on sys.path

CONFIGS = [(w, s, p) for p in (1, 2, 4) for w, s in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))]  # warps, stages, pages
SWEEP = (1024, 512)  # the configs' (batch, context): 8 pages a row, whole steps of 1, 2 and 4 pages
SWEEP_TOLERANCE = 0.02  # a config's largest difference from its reference, over the reference's largest value
SHAPES = ((1024, 512), (1024, 384), (1024, 256), (512, 800), (256, 1024), (64, 1024), (8, 1024), (1, 1024))
# (batch, shared, own): G3's (1024, 1024, 64), and the grid that places the engine's CASCADE_MIN_READS
CASCADE_SHAPES = ((1024, 1024, 64),) + tuple(
    (b, s, 128) for b in (16, 64, 128, 256, 512, 1024) for s in (256, 512, 1024, 2048)
)
HEADS, KV_HEADS, DIM, WIDTH = 16, 8, 128, 16384
KV_WRITE_BATCHES = (1024, 256, 64)
FOLD_SHAPES = ((1024, 384), (1024, 256), (256, 1024), (64, 1024), (8, 1024))  # (batch, context) of fold_row
PREFILL_SHAPES = ((128, 256), (64, 512), (16, 2048))  # (rows, length) of a prefill chunk: prefill_write_row
CACHE_PAGES = 16384  # one layer's cache in the K/V write (2.1 GB of K and V in bf16)


def timed(torch, fn, reps: int = 50) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph, as the engine runs it (eager launches would time
    Python: ~0.23 ms at any small batch), median of `reps` replays after warm-up."""
    for _ in range(3):  # Triton compiles outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def paged(torch, da, batch: int, ctx: int):
    """q, contiguous k/v (B, KVH, ctx, D), the same K/V as shuffled pages, the page table and lengths."""
    q = torch.randn(batch, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, KV_HEADS, ctx, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    per = -(-ctx // da.PAGE)
    table = torch.zeros((batch, WIDTH // da.PAGE), dtype=torch.long, device="cuda")
    table[:, :per] = (torch.randperm(batch * per, device="cuda") + 1).view(batch, per)
    pad = per * da.PAGE - ctx

    def pages(x):
        x = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(batch, KV_HEADS, per, da.PAGE, DIM)
        out = torch.zeros((batch * per + 1, KV_HEADS, da.PAGE, DIM), device="cuda", dtype=x.dtype)
        out[table[:, :per].reshape(-1)] = x.permute(0, 2, 1, 3, 4).reshape(batch * per, KV_HEADS, da.PAGE, DIM)
        return out

    lengths = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    return q, k, v, pages(k), pages(v), table, lengths


def kv_writes(torch, page_size: int, batch: int, pages: int, device: str) -> dict:
    """One layer's K and V caches (pages, KV_HEADS, page_size, DIM), a step's new K/V (batch, KV_HEADS, 1, DIM) and
    each row's page and offset (distinct pages, random offsets); the ways to write them, by name."""
    k_cache = torch.zeros((pages, KV_HEADS, page_size, DIM), device=device, dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn((batch, KV_HEADS, 1, DIM), device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    page = torch.randperm(pages - 1, device=device)[:batch] + 1
    offset = torch.randint(0, page_size, (batch,), device=device)
    heads = torch.arange(KV_HEADS, device=device)

    def flat_index():
        return ((page[:, None] * KV_HEADS + heads) * page_size + offset[:, None]).reshape(-1)

    index = flat_index()  # once a step, shared by the layers

    def index_put():  # the engine's write
        k_cache[page, :, offset] = key[:, :, 0]
        v_cache[page, :, offset] = value[:, :, 0]

    def index_copy(idx=None):
        idx = flat_index() if idx is None else idx
        k_cache.view(-1, DIM).index_copy_(0, idx, key.reshape(-1, DIM))
        v_cache.view(-1, DIM).index_copy_(0, idx, value.reshape(-1, DIM))

    return {
        "caches": (k_cache, v_cache),
        "index_put": index_put,
        "index_copy_in_layer": index_copy,
        "index_copy_step_index": partial(index_copy, index),
    }


def quantized_writes(torch, da, batch: int, kind: str) -> dict:
    """A quantized cache's write per layer, K and V: the engine's (`write_step`, one Triton kernel each) and torch's
    operations (`write_pages`), and whether they leave the same bytes and scales (for fp8 the CPU tests cannot check
    the rounding: Triton's interpreter converts to fp8 without carrying into the exponent)."""
    dtype = da.QUANTIZED[kind]
    pages = [torch.zeros((CACHE_PAGES, KV_HEADS, da.PAGE, DIM), device="cuda", dtype=torch.uint8) for _ in range(4)]
    pages = [p.view(dtype) for p in pages]  # zero bytes, as slot_state allocates them
    scales = [torch.zeros(pages[0].shape[:-1], device="cuda") for _ in range(4)]
    key, value = (torch.randn((batch, KV_HEADS, DIM), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    page = torch.randperm(CACHE_PAGES - 1, device="cuda")[:batch] + 1
    offset = torch.randint(0, da.PAGE, (batch,), device="cuda")

    def kernel() -> None:
        da.write_step(pages[0], scales[0], page, offset, key)
        da.write_step(pages[1], scales[1], page, offset, value)

    def ops() -> None:
        da.write_pages(pages[2], scales[2], (page, slice(None), offset), key)
        da.write_pages(pages[3], scales[3], (page, slice(None), offset), value)

    kernel()
    ops()
    differ = sum(int((pages[i].view(torch.uint8) != pages[i + 2].view(torch.uint8)).sum()) for i in (0, 1))
    scales_differ = sum(int((scales[i] != scales[i + 2]).sum()) for i in (0, 1))
    return {
        f"{kind}_write_ms": round(timed(torch, kernel), 4),
        f"{kind}_write_torch_ms": round(timed(torch, ops), 4),
        f"{kind}_write_equal": differ == 0 and scales_differ == 0,
        f"{kind}_write_bytes_differ": differ,  # of 2 * batch * KV_HEADS * DIM written
        f"{kind}_write_scales_differ": scales_differ,
    }


def kv_write_row(torch, da, batch: int) -> dict:
    """Section 4 at one batch: each way's time per layer (graph replays) and whether its caches equal the engine's."""
    ways = kv_writes(torch, da.PAGE, batch, CACHE_PAGES, "cuda")
    k_cache, v_cache = ways.pop("caches")
    row: dict = {"batch": batch}
    want = None
    for name, fn in ways.items():
        k_cache.zero_()
        v_cache.zero_()
        fn()
        got = (k_cache.clone(), v_cache.clone())
        if want is None:  # the engine's write, first
            want = got
        row[f"{name}_equal"] = all(torch.equal(a, b) for a, b in zip(got, want))
        row[f"{name}_ms"] = round(timed(torch, fn), 4)
    del k_cache, v_cache, ways, want, got
    torch.cuda.empty_cache()
    for kind in da.QUANTIZED:
        row.update(quantized_writes(torch, da, batch, kind))
        torch.cuda.empty_cache()
    torch.cuda.empty_cache()
    print(row, flush=True)
    return row


def main() -> int:
    import torch

    from worker.engines import decode_attention as da

    p = harness.parser(__doc__, out=harness.RESULTS / "decode-kernel.json")
    p.add_argument("--writes-only", action="store_true", help="sections 4 to 6 alone: the K/V writes")
    p.add_argument("--configs-only", action="store_true", help="sections 1 and 2 alone: the configs and the shapes")
    args = p.parse_args()
    scale = DIM**-0.5
    torch.manual_seed(0)
    info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, **harness.commit_info()}
    if args.writes_only:
        kv_write = [kv_write_row(torch, da, batch) for batch in KV_WRITE_BATCHES]
        fold = [fold_row(torch, da, scale, *shape) for shape in FOLD_SHAPES]
        prefill = [prefill_write_row(torch, da, *shape) for shape in PREFILL_SHAPES]
        harness.write_json(args.out, {**info, "kv_write": kv_write, "fold_write": fold, "prefill_write": prefill})
        print_writes(kv_write, fold, prefill)
        return 0
    q, k, v, kp, vp, table, lengths = paged(torch, da, *SWEEP)
    exact = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
    quant_pages = {kind: (*da.quantize(kp, dtype), *da.quantize(vp, dtype)) for kind, dtype in da.QUANTIZED.items()}
    configs, refs = [], {"bf16": exact[:, :, 0].float()}
    for warps, stages, pages in CONFIGS:
        da.CONFIG.update(warps=warps, stages=stages, pages=pages)
        da.QUANTIZED_CONFIG.update(da.CONFIG)
        config = {"warps": warps, "stages": stages, "pages": pages}
        runs = {"bf16": partial(da._triton_decode, q, kp, vp, table, lengths, scale, 1)}
        for kind, (kq, ks, vq, vs) in quant_pages.items():  # quantized pages: is another config theirs?
            runs[kind] = partial(da._triton_decode, q, kq, vq, table, lengths, scale, 1, None, ks, vs)
        for kind, run in runs.items():
            key = "ms" if kind == "bf16" else f"{kind}_ms"
            try:  # a config that fails to compile or launch is recorded, and the sweep goes on
                out = run().float()
                ref = refs.setdefault(kind, out)  # quantized: the first config's output over the same pages
                config[f"{kind}_rel_diff"] = round(((out - ref).abs().max() / ref.abs().max()).item(), 5)
                config[key] = round(timed(torch, run), 4)
            except Exception as exc:  # noqa: BLE001  (the record says what it was)
                config[f"{kind}_error"] = repr(exc)[:300]
        configs.append(config)
        print(config, flush=True)
        harness.write_json(args.out, {**info, "configs": configs})  # kept if the time box ends the sweep
    del quant_pages

    def fastest(kind: str) -> dict:
        """The fastest config whose output agrees (a wrong one is never chosen, however fast)."""
        key = "ms" if kind == "bf16" else f"{kind}_ms"
        agree = [c for c in configs if key in c and c[f"{kind}_rel_diff"] <= SWEEP_TOLERANCE]
        if not agree:
            raise SystemExit(
                f"no config ran {kind} pages within {SWEEP_TOLERANCE:.0%} of the reference: see {args.out}"
            )
        return min(agree, key=lambda c: c[key])

    best = fastest("bf16")
    best_quantized = {kind: fastest(kind) for kind in da.QUANTIZED}
    launch = ("warps", "stages", "pages")
    da.CONFIG.update({k: best[k] for k in launch})
    results = []
    for batch, ctx in SHAPES:
        q, k, v, kp, vp, table, lengths = paged(torch, da, batch, ctx)
        splits = da.splits_for(batch, KV_HEADS)
        ours = da._triton_decode(q, kp, vp, table, lengths, scale, splits)
        ref = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)
        diff = (ours.float() - ref[:, :, 0].float()).abs().max().item()
        t_ours = timed(torch, partial(da._triton_decode, q, kp, vp, table, lengths, scale, splits))
        read = 2 * batch * KV_HEADS * ctx * DIM * 2  # bf16 K and V bytes
        quantized = {}
        for kind, dtype in da.QUANTIZED.items():
            da.QUANTIZED_CONFIG.update({k: best_quantized[kind][k] for k in launch})
            (kq, ks), (vq, vs) = da.quantize(kp, dtype), da.quantize(vp, dtype)
            run = partial(da._triton_decode, q, kq, vq, table, lengths, scale, splits, None, ks, vs)
            ms = timed(torch, run)
            quantized |= {
                f"{kind}_ms": round(ms, 4),
                f"{kind}_gain": round(t_ours / ms, 3),
                f"{kind}_tb_s": round(read * (DIM + 4) / (2 * DIM) / ms / 1e9, 2),
                f"{kind}_max_abs_diff": (run().float() - ref[:, :, 0].float()).abs().max().item(),
            }
            del kq, vq, ks, vs
        t_sdpa = timed(
            torch,
            partial(
                torch.nn.functional.scaled_dot_product_attention, q[:, :, None], k, v, scale=scale, enable_gqa=True
            ),
        )
        row = {
            "batch": batch,
            "context": ctx,
            "splits": splits,
            "max_abs_diff": diff,
            "ours_ms": round(t_ours, 4),
            "sdpa_gqa_ms": round(t_sdpa, 4),
            "ours_tb_s": round(read / t_ours / 1e9, 2),
            "sdpa_tb_s": round(read / t_sdpa / 1e9, 2),
            "bound_ms_at_4.3": round(read / 4.3e12 * 1e3, 4),
            **quantized,
        }
        results.append(row)
        print(row, flush=True)
        del q, k, v, kp, vp
        torch.cuda.empty_cache()
    if args.configs_only:
        cascade = kv_write = fold = prefill = []
    else:
        cascade = [cascade_row(torch, da, scale, *shape) for shape in CASCADE_SHAPES]
        kv_write = [kv_write_row(torch, da, batch) for batch in KV_WRITE_BATCHES]
        fold = [fold_row(torch, da, scale, *shape) for shape in FOLD_SHAPES]
        prefill = [prefill_write_row(torch, da, *shape) for shape in PREFILL_SHAPES]
    harness.write_json(
        args.out,
        {
            **info,
            "configs": configs,
            "best": best,
            "best_quantized": best_quantized,
            "results": results,
            "cascade": cascade,
            "kv_write": kv_write,
            "fold_write": fold,
            "prefill_write": prefill,
        },
    )
    print(f"{'warps':>6}{'stages':>7}{'pages':>6}{'bf16 ms':>9}{'fp8 ms':>8}{'int8 ms':>9}  (batch x context {SWEEP})")
    for c in configs:
        times = "".join(
            f"{c.get(key, float('nan')):>{width}.4f}" for key, width in (("ms", 9), ("fp8_ms", 8), ("int8_ms", 9))
        )
        print(
            f"{c['warps']:>6}{c['stages']:>7}{c['pages']:>6}{times}"
            + ("  ERROR" if any("_error" in k for k in c) else "")
        )
    print(f"best config: {best}")
    for kind, config in best_quantized.items():
        print(f"best config for {kind} pages: {config}")
    print(
        f"{'batch':>6}{'ctx':>6}{'splits':>7}{'ours ms':>9}{'sdpa ms':>9}{'ours TB/s':>10}{'sdpa TB/s':>10}"
        f"{'max diff':>10}{'fp8 ms':>8}{'gain':>6}{'TB/s':>6}{'diff':>8}{'int8 ms':>9}{'gain':>6}{'TB/s':>6}{'diff':>8}"
    )
    for r in results:
        print(
            f"{r['batch']:>6}{r['context']:>6}{r['splits']:>7}{r['ours_ms']:>9.3f}{r['sdpa_gqa_ms']:>9.3f}"
            f"{r['ours_tb_s']:>10.2f}{r['sdpa_tb_s']:>10.2f}{r['max_abs_diff']:>10.4f}"
            + "".join(
                f"{r[k + '_ms']:>{w}.3f}{r[k + '_gain']:>6.2f}{r[k + '_tb_s']:>6.2f}{r[k + '_max_abs_diff']:>8.4f}"
                for k, w in (("fp8", 8), ("int8", 9))
            )
        )
    if cascade:
        print(f"{'batch':>6}{'shared':>7}{'own':>5}{'plain ms':>10}{'cascade ms':>11}{'gain':>7}{'max diff':>10}")
    for r in cascade:
        print(
            f"{r['batch']:>6}{r['shared']:>7}{r['own']:>5}{r['plain_ms']:>10.3f}{r['cascade_ms']:>11.3f}"
            f"{r['gain']:>7.2f}{r['max_abs_diff']:>10.4f}"
        )
    if not args.configs_only:
        print_writes(kv_write, fold, prefill)
    return 0


def print_writes(kv_write: list[dict], fold: list[dict], prefill: list[dict]) -> None:
    print(
        f"{'batch':>6}{'index_put ms':>14}{'index_copy ms':>15}{'(index once) ms':>17}{'equal':>7}"
        f"{'fp8 kernel ms':>15}{'fp8 torch ms':>14}{'fp8 equal':>10}{'int8 kernel ms':>16}{'int8 torch ms':>15}"
        f"{'int8 equal':>11}"
    )
    for r in kv_write:
        equal = r["index_copy_in_layer_equal"] and r["index_copy_step_index_equal"]
        print(
            f"{r['batch']:>6}{r['index_put_ms']:>14.4f}{r['index_copy_in_layer_ms']:>15.4f}"
            f"{r['index_copy_step_index_ms']:>17.4f}{str(equal):>7}{r['fp8_write_ms']:>15.4f}"
            f"{r['fp8_write_torch_ms']:>14.4f}{str(r['fp8_write_equal']):>10}{r['int8_write_ms']:>16.4f}"
            f"{r['int8_write_torch_ms']:>15.4f}{str(r['int8_write_equal']):>11}"
        )
    print(f"{'batch':>6}{'ctx':>6}{'write + kernel ms':>19}{'kernel writing ms':>19}{'gain':>7}{'pages':>7}{'diff':>9}")
    for r in fold:
        print(
            f"{r['batch']:>6}{r['context']:>6}{r['separate_ms']:>19.4f}{r['fold_ms']:>19.4f}{r['gain']:>7.3f}"
            f"{str(r['same_pages']):>7}{r['max_abs_diff']:>9.4f}"
        )
    print(
        f"{'rows':>6}{'length':>7}{'index_put ms':>14}{'kernel ms':>11}{'gain':>7}{'TB/s':>7}{'kernel TB/s':>13}"
        f"{'pages':>7}{'fp8 torch ms':>14}{'fp8 kernel ms':>15}{'same':>6}{'int8 torch ms':>15}{'int8 kernel ms':>16}"
        f"{'same':>6}"
    )
    for r in prefill:
        print(
            f"{r['rows']:>6}{r['length']:>7}{r['index_put_ms']:>14.4f}{r['kernel_ms']:>11.4f}{r['gain']:>7.2f}"
            f"{r['index_put_tb_s']:>7.2f}{r['kernel_tb_s']:>13.2f}{str(r['same_pages']):>7}"
            f"{r['fp8_torch_ms']:>14.4f}{r['fp8_kernel_ms']:>15.4f}{str(r['fp8_same']):>6}"
            f"{r['int8_torch_ms']:>15.4f}{r['int8_kernel_ms']:>16.4f}{str(r['int8_same']):>6}"
        )


def fold_row(torch, da, scale: float, batch: int, ctx: int) -> dict:
    """A decode step's K/V write and attention at (batch, ctx): the write by `write_step` (torch's index_put, K and V)
    then the kernel, against the kernel that writes them itself (`decode(..., new=...)` with FOLD_WRITE on):
    milliseconds of each (a graph of the layer's part), whether the pages are the same, and the outputs' max |diff|."""
    q, _, _, kp, vp, table, lengths = paged(torch, da, batch, ctx)
    splits = da.splits_for(batch, KV_HEADS)
    last = lengths.long() - 1
    page, offset = table.gather(1, (last // da.PAGE)[:, None])[:, 0], last % da.PAGE
    k_new = torch.randn(batch, KV_HEADS, DIM, device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    pages = {way: (kp.clone(), vp.clone()) for way in ("separate", "fold")}
    del kp, vp
    out = {}

    def separate():
        k, v = pages["separate"]
        da.write_step(k, None, page, offset, k_new)
        da.write_step(v, None, page, offset, v_new)
        out["separate"] = da._triton_decode(q, k, v, table, lengths, scale, splits)

    def fold():
        out["fold"] = da.decode(q, *pages["fold"], table, lengths, scale, splits, new=(k_new, v_new, page, offset))

    before, da.FOLD_WRITE = da.FOLD_WRITE, True
    try:
        separate_ms, fold_ms = timed(torch, separate), timed(torch, fold)
        separate(), fold()
    finally:
        da.FOLD_WRITE = before
    torch.cuda.synchronize()
    same_pages = all(torch.equal(a, b) for a, b in zip(pages["separate"], pages["fold"]))
    diff = (out["separate"].float() - out["fold"].float()).abs().max().item()  # the new position is summed last
    row = {"batch": batch, "context": ctx, "splits": splits, "separate_ms": round(separate_ms, 4)}
    row |= {"fold_ms": round(fold_ms, 4), "gain": round(separate_ms / fold_ms, 3), "same_pages": same_pages}
    row["max_abs_diff"] = diff
    print(row, flush=True)
    return row


def prefill_write_row(torch, da, rows: int, length: int) -> dict:
    """A prefill chunk's K and V write at (rows, length), laid out as the layers hand them over (a view of the
    projection's (rows, length, kv_heads × dim)): index_put against the kernel, each into its own shuffled pages."""
    per = -(-length // da.PAGE)
    page = (torch.randperm(rows * per, device="cuda") + 1).view(rows, per)[
        :, torch.arange(length, device="cuda") // da.PAGE
    ]
    offset = torch.arange(length, device="cuda") % da.PAGE
    k, v = (torch.randn(rows, length, KV_HEADS * DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (x.view(rows, length, KV_HEADS, DIM) for x in (k, v))
    pages = {
        way: [
            torch.zeros((rows * per + 1, KV_HEADS, da.PAGE, DIM), device="cuda", dtype=torch.bfloat16) for _ in range(2)
        ]
        for way in ("index_put", "kernel")
    }

    def write(way: str) -> None:
        for cache, x in zip(pages[way], (k, v)):
            da.write_prefill(cache, None, page, offset, x)

    put_ms, kernel_ms = timed_off_on(torch, da, "PREFILL_WRITE", partial(write, "index_put"), partial(write, "kernel"))
    same = all(torch.equal(a, b) for a, b in zip(pages["index_put"], pages["kernel"]))
    gb = 8 * k.numel() / 1e9  # K and V, 2 bytes a value, read once and written once
    row = {"rows": rows, "length": length, "index_put_ms": round(put_ms, 4), "kernel_ms": round(kernel_ms, 4)}
    row |= {"gain": round(put_ms / kernel_ms, 2), "index_put_tb_s": round(gb / put_ms, 2)}
    row |= {"kernel_tb_s": round(gb / kernel_ms, 2), "same_pages": same}
    pages.clear()  # the bf16 pages freed before the quantized ones
    for kind, dtype in da.QUANTIZED.items():  # QUANT_PREFILL_WRITE: the kernel against write_pages' torch chain
        row |= quantized_prefill_write(torch, da, kind, dtype, k, v, page, offset, rows * per + 1)
    print(row, flush=True)
    return row


def timed_off_on(torch, da, flag: str, off, on) -> tuple[float, float]:
    """Milliseconds of `off` with decode_attention's `flag` off, then of `on` with it on; the flag as it was after."""
    before = getattr(da, flag)
    try:
        setattr(da, flag, False)
        off_ms = timed(torch, off)
        setattr(da, flag, True)
        on_ms = timed(torch, on)
    finally:
        setattr(da, flag, before)
    torch.cuda.synchronize()
    return off_ms, on_ms


def quantized_prefill_write(torch, da, kind: str, dtype, k, v, page, offset, n_pages: int) -> dict:
    """The same chunk into `kind` pages: torch's chain (`write_pages`) against the kernel (`QUANT_PREFILL_WRITE`),
    each into pages of its own; whether the bytes, the scales and the returned (dequantized) values are the same."""
    shape = (n_pages, KV_HEADS, da.PAGE, DIM)
    caches = {
        way: [(torch.zeros(shape, device="cuda", dtype=dtype), torch.zeros(shape[:3], device="cuda")) for _ in range(2)]
        for way in ("torch", "kernel")
    }
    held = {}

    def write(way: str) -> None:
        held[way] = [da.write_prefill(*cache, page, offset, x) for cache, x in zip(caches[way], (k, v))]

    torch_ms, kernel_ms = timed_off_on(
        torch, da, "QUANT_PREFILL_WRITE", partial(write, "torch"), partial(write, "kernel")
    )
    pairs = list(zip(caches["torch"], caches["kernel"]))
    same_bytes = all(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) for a, b in pairs)
    same_scales = all(torch.equal(a[1], b[1]) for a, b in pairs)
    same_held = all(torch.equal(a, b) for a, b in zip(held["torch"], held["kernel"]))
    out = {f"{kind}_torch_ms": round(torch_ms, 4), f"{kind}_kernel_ms": round(kernel_ms, 4)}
    out |= {f"{kind}_gain": round(torch_ms / kernel_ms, 2), f"{kind}_same": same_bytes and same_scales and same_held}
    out[f"{kind}_same_parts"] = {"bytes": same_bytes, "scales": same_scales, "held": same_held}
    return out


def cascade_row(torch, da, scale: float, batch: int, shared: int, own: int) -> dict:
    """Rows sharing their first `shared` positions' pages, then `own` positions each: plain kernel vs cascade."""
    q, _, _, kp, vp, table, lengths = paged(torch, da, batch, shared + own)
    n = shared // da.PAGE
    table[:, :n] = table[0, :n]  # every row's first pages are row 0's (the others are never read)
    common = torch.full((table.shape[1],), -1, dtype=torch.long, device="cuda")
    common[:n] = table[0, :n]
    count = torch.tensor([n], dtype=torch.int32, device="cuda")
    start = da.cascade_start(table, common)
    splits = da.splits_for(batch, KV_HEADS)
    plain = partial(da._triton_decode, q, kp, vp, table, lengths, scale, splits)
    cascaded = partial(da._triton_decode, q, kp, vp, table, lengths, scale, splits, (common, count, start))
    diff = (plain().float() - cascaded().float()).abs().max().item()
    t_plain, t_cascade = timed(torch, plain), timed(torch, cascaded)
    per_position = 2 * KV_HEADS * DIM * 2
    row = {
        "batch": batch,
        "shared": shared,
        "own": own,
        "splits": splits,
        "prefix_splits": da.prefix_splits(batch, HEADS, KV_HEADS),
        "max_abs_diff": diff,
        "plain_ms": round(t_plain, 4),
        "cascade_ms": round(t_cascade, 4),
        "gain": round(t_plain / t_cascade, 2),
        "plain_bound_ms_at_4.3": round(batch * (shared + own) * per_position / 4.3e9, 4),
        "cascade_bound_ms_at_4.3": round((shared + batch * own) * per_position / 4.3e9, 4),
    }
    print(row, flush=True)
    del q, kp, vp
    torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    sys.exit(main())
