"""Decode attention over a paged KV cache with a length per row: the fast engine's attention kernel.

The fast engine (fastgen.py) keeps K and V of every running sequence in pages of `PAGE` positions, one pool
of pages per layer shaped (pages, kv_heads, PAGE, head_dim), and a page table per slot: position p of the sequence
in slot s lives in page `table[s, p // PAGE]` at offset `p % PAGE`. A sequence holds only the pages its own prompt
and max_new_tokens need, so short rows leave room for more rows. A decode step has one query token per slot; this
attention reads each slot's K/V only up to that slot's length, page by page, so a short row never pays for a long
one and nothing is padded. Grouped-query heads share one read of K/V: a program handles one (slot, kv head) and all
the query heads of its group together, so each K/V byte is read once per step (the memory-bandwidth bound of G1 in
DESIGN.md assumes exactly that).

**Cascade** (a prompt prefix many rows share, issue 26): rows whose prompts start with the same cached pages hold
the same physical pages at the start of their tables (worker/engines/pages.py). Read per row, a 1,024-token shared
instruction costs every row its whole K/V each step (G3: ~31 ms of a step on the H200). With `cascade`, the engine
names one run of shared pages (`shared`, its length `shared_n`) and each row's `start`: how many of its first
blocks are those pages (`cascade_start`). `_prefix_kernel` then reads each shared page once per (block of query
rows, kv head) and attends the queries of all rows to it in one product; the row kernel reads only the blocks from
`start` on; the parts are merged by log-sum-exp (`_merge`). The result is the plain decode's whatever `shared`
holds: a row's `start` counts only blocks its own table lists, and positions past its length are masked.

**Quantized pages** (`kv_cache_dtype: fp8` or `int8`): K and V may be kept as float8 e4m3 or int8 with a float32
scale per (page, kv head, position), `k_scales`/`v_scales` shaped (pages, kv_heads, PAGE): each head's vector of a
position is divided by its largest magnitude / the type's largest value (448, 127) when it is written (`quantize`;
int8 rounds half away from zero), so no vector overflows, whatever the model's range. A decode step then reads 132
bytes per position and head instead of 256 (head_dim 128, bf16). The kernels convert a page to q's dtype after
loading it and apply the scales to the logits (K) and to the probabilities (V), which is the same product as
attending over the dequantized pages. int8 keeps a vector's large values more precisely (a uniform step of
amax / 127) and fp8 its small ones (3 mantissa bits each); on Gaussian vectors int8's error is ~4× smaller, with
rare 20× outliers fp8's is smaller (ops/bench/results/2026-12-05-cpu-kv-quant).

Two implementations with one contract, `decode(q, k_pages, v_pages, table, lengths, scale, splits, cascade,
k_scales, v_scales)`:

- `_triton_decode`: a Triton flash-decoding kernel (online softmax over the pages of a slot, `CONFIG["pages"]`
  pages per inner step where a row is one part; optionally split over the context in `splits` parts that take every
  splits-th page, merged by `_merge`, so a small batch still fills the GPU whatever the lengths), and the cascade's
  `_prefix_kernel`.
  Lengths, the page table and the shared pages are read from device tensors, so the launch has fixed shapes and is
  captured in a CUDA graph once per batch size. Both also run under `TRITON_INTERPRET=1` on CPU tensors, which is
  how the CPU tests check them against the reference.
- `reference_decode`: the same result by gathering the pages and running `scaled_dot_product_attention` with a
  length mask; what runs on CPU (there is no Triton CPU backend outside the interpreter), and the yardstick of the
  tests.

A slot of length 0 (a free slot in a padded batch) returns zeros and reads nothing. A head whose width is not a
power of two (tl.arange's; 80 or 96, as some models have) is padded with zero lanes inside the kernels
(`_head_mask`); before, such a model failed in the kernel's compile on engine auto instead of running.
"""

from __future__ import annotations

import math
import os

import torch

PAGE = 64  # positions per page of the KV cache; the row kernel's inner step takes CONFIG["pages"] of them
# launch configuration of the row kernel: warps, pipeline stages and pages per inner step (its block of positions:
# pages x PAGE, each page found in the table; a power of two, and used only where a row is one part: splits 1);
# ops/bench/decode_kernel.py measures the alternatives on a GPU.
# warps 4, stages 3: best at G1 decode on the H200 (contiguous cache): 3.94 TB/s (ops/bench/results)
CONFIG = {"warps": 4, "stages": 3, "pages": 1}
# the same for fp8 and int8 pages: a page of them is half the bytes of a bf16 one, so one page per inner step put
# half as many bytes in flight (2026-12-06, H100: ~1.7 TB/s, 1.07-1.19x bf16's time where the bytes allow ~1.9x).
# Two pages a step at batch 1024 x context 512 on an H100 (ops/bench/results/2026-12-07-h100-session56): fp8 0.555
# against 0.659 ms (1.19x), int8 0.532 against 0.600 (1.13x); 4 pages won int8 there by 0.2 % but waste a half step
# at contexts of 6 pages (int8 at 384: 1.02x bf16). bf16 pages stay at one: two ran 0.694 against 0.692 ms, the
# kernel already at 3.11 TB/s.
QUANTIZED_CONFIG = {"warps": 4, "stages": 3, "pages": 2}
TARGET_PROGRAMS = 1024  # kernel programs to aim for when splitting short batches over the context
MAX_SPLITS = 32  # the most parts a slot's context is cut into (the merge reads every part)
BLOCK_M = 64  # query vectors (row, head of a kv group) per program of the cascade's prefix kernel
# A decode step's K/V write in the row kernel (bf16/fp16/fp32 pages): the kernel attends to the new vectors from its
# registers and stores them, two index_put launches per layer fewer. Off: no gain at G1's and G2's batches on the
# GPU (docs/design.md)
FOLD_WRITE = False
# A prefill chunk's K/V write (bf16/fp16/fp32 pages) by one Triton kernel storing whole vectors, instead of torch's
# index_put, which indexes element by element: 432 ms of G2's prefill on the H200 (2026-12-06, ~10 ms of each ~83 ms
# chunk), where the bytes take ~1 ms. On: with SYNC_FREE, G2 1.030x and G1 1.025x on an H100, outside the spreads
# (ops/bench/results/2026-12-07-h100-session50; alone it did not gain: the host waited inside each chunk anyway)
PREFILL_WRITE = True
# The same for quantized pages (fp8, int8): the chunk quantized, its scales and values stored, and the dequantized
# values the prefill attends over, in one kernel, where `write_pages` chains a dozen torch operations over the chunk
# (index_put element by element among them). On: on an H100 its bytes, scales and values equal write_pages' and it
# takes 1/16 (fp8) and 1/22 (int8) of the chain's time; G1's prefill 1.03 s -> 0.61 s with an fp8 cache, and G1 with
# an fp8/int8 cache went from 0.945x/0.950x of the bf16 cache's rate to 1.081x/1.093x
# (ops/bench/results/2026-12-08-h100-session58)
QUANT_PREFILL_WRITE = True
FP8 = torch.float8_e4m3fn  # the element type of an fp8 cache (`kv_cache_dtype: fp8`)
QUANTIZED = {"fp8": FP8, "int8": torch.int8}  # kv_cache_dtype -> the cache's element type
LARGEST = {FP8: 448.0, torch.int8: 127.0}  # each one's largest magnitude (a vector's scale maps its amax there)

try:  # triton ships with CUDA builds of torch; CPU builds may lack it (the reference runs there)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


def available(device: torch.device) -> bool:
    """The Triton kernel runs here: a CUDA device with triton, or any device under TRITON_INTERPRET=1."""
    if triton is None:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    splits: int = 1,
    cascade: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    new: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of one query token per slot. q: (B, H, D); k_pages, v_pages: (pages, KVH, PAGE, D) (last dim
    contiguous); table: (B, W) long, the page of each block of PAGE positions of each slot; lengths: (B,) int, the
    positions of each slot to attend to (0..length-1); `splits` parts per slot (see `splits_for`); `cascade`:
    (shared (W,) long, shared_n (1,) int32, start (B,) int32), see the module docstring; `k_scales`, `v_scales`:
    (pages, KVH, PAGE) float32, the scales of quantized pages (see the module docstring); `new`: (k, v, page,
    offset), the step's K and V of each slot (B, KVH, D), written at `page[b]`, `offset[b]` (its position
    length - 1) before it is attended to: in the kernel itself where `FOLD_WRITE` applies (see there), else by
    `write_step`. Returns (B, H, D) in q's dtype. The Triton kernels where they run (see `available`), else the
    reference (which reads every row's table whole: the same result with or without `cascade`)."""
    if new is not None and not (FOLD_WRITE and k_scales is None and available(q.device)):
        k, v, page, offset = new
        write_step(k_pages, k_scales, page, offset, k)
        write_step(v_pages, v_scales, page, offset, v)
        new = None
    if available(q.device):
        return _triton_decode(q, k_pages, v_pages, table, lengths, scale, splits, cascade, k_scales, v_scales, new)
    return reference_decode(q, k_pages, v_pages, table, lengths, scale, k_scales, v_scales)


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (..., D) as vectors of `dtype` (FP8 or int8) and their float32 scales (...,): each vector divided by its
    largest magnitude / LARGEST[dtype] (a zero vector by a tiny scale, giving zeros); int8 rounds half away from
    zero (as `_write_kernel` does: the same bytes). The scale is the largest magnitude times the float32 reciprocal
    of LARGEST: that is what torch's CUDA `tensor / python_scalar` computes, where its CPU divides, so written this
    way it is one number on both, and the kernel's."""
    x, largest = x.float(), LARGEST[dtype]
    scales = (x.abs().amax(dim=-1) * (1.0 / largest)).clamp(min=1e-30)
    values = x / scales[..., None]
    if dtype == torch.int8:
        values = values.sign() * (values.abs() + 0.5).floor()
    return values.clamp(-largest, largest).to(dtype), scales


def dequantize(x: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Quantized vectors `x` (..., D) times their `scales` (...,), in `dtype`."""
    return (x.float() * scales[..., None]).to(dtype)


def cascade_start(table: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """(B,) int32: how many leading blocks of each row of `table` (B, W) are the pages `shared` (W,) lists (-1
    past its end: no table entry matches)."""
    return (table == shared[None, :]).to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)


def gather(
    pages: torch.Tensor, table: torch.Tensor, scales: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The contiguous cache (B, KVH, W * PAGE, D) of the slots whose pages `table` (B, W) lists; quantized pages
    with their `scales` come back dequantized, in `dtype`."""
    b, w = table.shape
    blocks = read_pages(pages, table.reshape(-1), scales, dtype)  # (B * W, KVH, PAGE, D)
    kvh, page, dim = blocks.shape[1:]
    return blocks.view(b, w, kvh, page, dim).permute(0, 2, 1, 3, 4).reshape(b, kvh, w * page, dim)


def read_pages(
    pages: torch.Tensor, index: torch.Tensor, scales: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """`pages[index]`; quantized pages (with their `scales`) dequantized into `dtype`. They are indexed as bytes
    (not every torch indexes float8 on every device)."""
    if scales is None:
        return pages[index]
    return dequantize(pages.view(torch.uint8)[index].view(pages.dtype), scales[index], dtype)


def write_pages(pages: torch.Tensor, scales: torch.Tensor | None, index: tuple, x: torch.Tensor) -> torch.Tensor:
    """`pages[index] = x`; into quantized pages, `x` quantized and its scales written to `scales[index]`. Returns
    what the pages now hold, as `x`'s dtype: `x`, or its quantized values dequantized."""
    if scales is None:
        pages[index] = x
        return x
    values, values_scales = quantize(x, pages.dtype)
    pages.view(torch.uint8)[index] = values.view(torch.uint8)
    scales[index] = values_scales
    return dequantize(values, values_scales, x.dtype)


def write_step(pages: torch.Tensor, scales: torch.Tensor | None, page: torch.Tensor, offset: torch.Tensor, x) -> None:
    """A decode step's write: row b's `x[b]` (B, KVH, D) at `pages[page[b], :, offset[b]]`. Quantized pages where
    the Triton kernels run: one kernel (`_write_kernel`: each vector's scale, its values and the scale stored in
    one pass) instead of `write_pages`' chain of torch operations (a dozen kernels per layer in a decode step's
    graph); the same bytes."""
    if scales is None or not available(x.device):
        write_pages(pages, scales, (page, slice(None), offset), x)
        return
    batch, kv_heads, dim = x.shape
    _write_kernel[(batch, kv_heads)](
        x,
        pages,
        scales,
        page,
        offset,
        *x.stride()[:2],
        *pages.stride()[:3],
        *scales.stride()[:2],
        LARGEST[pages.dtype],
        1.0 / LARGEST[pages.dtype],
        HEAD_DIM=dim,
        HEAD_PAD=triton.next_power_of_2(dim),
        INT=pages.dtype == torch.int8,
    )


def write_prefill(
    pages: torch.Tensor, scales: torch.Tensor | None, page: torch.Tensor, offset: torch.Tensor, x: torch.Tensor
) -> torch.Tensor:
    """A prefill chunk's write: row r's `x[r, i]` (R, L, KVH, D) at `pages[page[r, i], :, offset[i]]`; returns what
    the pages now hold, as `write_pages` does. Where the Triton kernels run, one kernel (`_prefill_write_kernel`: a
    block of positions of one head a program, whole vectors): unquantized pages under `PREFILL_WRITE`, quantized ones
    (the bytes and scales of `quantize`, and the dequantized values returned) under `QUANT_PREFILL_WRITE`; otherwise
    `write_pages`. Rows may write the same page (the trash page, past their own pages): what it then holds is garbage
    either way, which nothing reads."""
    quant = scales is not None
    kernel = QUANT_PREFILL_WRITE if quant else PREFILL_WRITE
    if not (kernel and available(x.device) and x.stride(-1) == 1 and page.stride(-1) == 1):
        return write_pages(pages, scales, (page, slice(None), offset), x)
    rows, length, kv_heads, dim = x.shape
    # what the pages hold, laid out as the layers' (rows, kv heads, length, dim) seen through x's transpose
    out = torch.empty((rows, kv_heads, length, dim), dtype=x.dtype, device=x.device).transpose(1, 2) if quant else x
    _prefill_write_kernel[(rows, triton.cdiv(length, PAGE), kv_heads)](
        x,
        pages,
        scales if quant else pages,  # unread unless QUANT
        out,
        page,
        offset,
        length,
        *x.stride()[:3],
        *pages.stride()[:3],
        *(scales.stride()[:2] if quant else (0, 0)),
        *out.stride()[:3],
        page.stride(0),
        offset.stride(0),
        LARGEST.get(pages.dtype, 1.0),
        1.0 / LARGEST.get(pages.dtype, 1.0),
        HEAD_DIM=dim,
        HEAD_PAD=triton.next_power_of_2(dim),
        BLOCK=PAGE,
        QUANT=quant,
        INT=pages.dtype == torch.int8,
    )
    return out


def reference_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """`decode` with the pages gathered (quantized ones dequantized into q's dtype) and SDPA with a length mask (zeros
    where length 0)."""
    k, v = gather(k_pages, table, k_scales, q.dtype), gather(v_pages, table, v_scales, q.dtype)
    return masked_decode(q, k, v, lengths, scale)


def masked_decode(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of q (B, H, D) over a contiguous cache k, v (B, KVH, L, D), each row up to its length."""
    longest = k.shape[2]
    mask = torch.arange(longest, device=q.device)[None, :] < lengths[:, None].to(q.device)  # (B, L)
    empty = ~mask.any(dim=1)
    mask = mask | empty[:, None]  # SDPA gives NaN on an all-masked row; such rows are zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[:, :, 0].masked_fill(empty[:, None, None], 0)


def splits_for(batch: int, kv_heads: int) -> int:
    """How many parts to split each slot's context into so that about TARGET_PROGRAMS kernel programs run: one for
    large batches, up to MAX_SPLITS for small ones. Part j of `splits` reads pages j, j + splits, j + 2 splits, ...
    of its slot (a split row's kernel takes one page a step, whatever CONFIG["pages"]), so the parts share any
    length evenly (and parts past a short slot's last page exit at once)."""
    return max(1, min(MAX_SPLITS, math.ceil(TARGET_PROGRAMS / (batch * kv_heads))))


def prefix_splits(batch: int, heads: int, kv_heads: int) -> int:
    """How many parts the cascade's shared pages are cut into (part j reads shared pages j, j + parts, ...), so
    that about TARGET_PROGRAMS programs of `_prefix_kernel` run."""
    blocks = math.ceil(batch * (heads // kv_heads) / BLOCK_M)
    return max(1, min(MAX_SPLITS, math.ceil(TARGET_PROGRAMS / (blocks * kv_heads))))


def _triton_decode(
    q, k_pages, v_pages, table, lengths, scale: float, splits: int, cascade=None, k_scales=None, v_scales=None, new=None
) -> torch.Tensor:
    """One split and no cascade: the kernel writes the normalized output in q's dtype. Otherwise fp32 partial
    results per part (the row kernel's splits, then the prefix kernel's), merged by `_merge`. Quantized pages: the
    kernels read `k_scales`, `v_scales` (else they are passed K and V again, unread). `new` (unquantized pages
    only): the step's K/V, written by the row kernel (`decode`)."""
    batch, heads, dim = q.shape
    kv_heads = k_pages.shape[1]
    group = heads // kv_heads
    direct = splits == 1 and cascade is None
    prefix_parts = 0 if cascade is None else prefix_splits(batch, heads, kv_heads)
    parts = splits + prefix_parts
    if direct:
        acc = torch.empty((batch, heads, 1, dim), dtype=q.dtype, device=q.device)
        stats = acc  # unused
    else:
        acc = torch.empty((batch, heads, parts, dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((batch, heads, parts, 2), dtype=torch.float32, device=q.device)  # running max, sum
    start = lengths if cascade is None else cascade[2]  # unread without a cascade
    quant = k_scales is not None
    if not quant:
        k_scales, v_scales = k_pages, v_pages
    scale_strides = k_scales.stride()[:2] if quant else (0, 0)  # v_scales' are the same
    config = QUANTIZED_CONFIG if quant else CONFIG
    # several pages a step only where one part takes a row: the parts of a split row take whole steps, and a short
    # context would leave most of them empty (splits_for counts pages)
    pages = config["pages"] if splits == 1 else 1
    assert pages in (1, 2, 4, 8), f"pages per step {pages}: give a power of two (tl.arange's block)"
    # both kernels take these
    strides = (*q.stride()[:2], *k_pages.stride()[:3], *v_pages.stride()[:3], *scale_strides)
    scale_log2 = scale * 1.4426950408889634  # log2(e): the kernels work in base 2
    assert new is None or not quant, "quantized pages are written by write_step"
    k_new, v_new, page, offset = new if new is not None else (q, q, lengths, lengths)  # unread without `new`
    k_new, v_new = (x if x.stride(-1) == 1 else x.contiguous() for x in (k_new, v_new))  # the kernel's lanes
    _decode_kernel[(batch, kv_heads, splits)](
        q,
        k_pages,
        v_pages,
        k_scales,
        v_scales,
        table,
        lengths,
        start,
        acc,
        stats,
        k_new,
        v_new,
        page,
        offset,
        parts,
        *strides,
        table.stride(0),
        *k_new.stride()[:2],
        *v_new.stride()[:2],
        scale_log2,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=dim,
        HEAD_PAD=triton.next_power_of_2(dim),
        BLOCK=PAGE,
        PAGES=pages,
        DIRECT=direct,
        START=cascade is not None,
        QUANT=quant,
        WRITE=new is not None,
        num_warps=config["warps"],
        num_stages=config["stages"],
    )
    if direct:
        return acc[:, :, 0]
    if cascade is not None:
        shared, shared_n, start = cascade
        _prefix_kernel[(math.ceil(batch * group / BLOCK_M), kv_heads, prefix_parts)](
            q,
            k_pages,
            v_pages,
            k_scales,
            v_scales,
            shared,
            shared_n,
            start,
            lengths,
            acc,
            stats,
            *strides,
            batch,
            parts,
            splits,
            scale_log2,
            GROUP=group,
            HEAD_DIM=dim,
            HEAD_PAD=triton.next_power_of_2(dim),
            BLOCK=PAGE,
            BLOCK_M=BLOCK_M,
            QUANT=quant,
            WRITE=new is not None,
            num_warps=config["warps"],
            num_stages=config["stages"],
        )
    return _merge(acc, stats).to(q.dtype)


def _merge(acc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Combine the per-split partial results (unnormalized acc, max m and sum s in base 2) into (B, H, D)."""
    m, s = stats[..., 0], stats[..., 1]
    top = m.amax(dim=2, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(m - top)  # exp2(-inf) = 0 for empty splits
    total = (s * w).sum(dim=2)
    out = (acc * w[..., None]).sum(dim=2)
    return out / torch.where(total > 0, total, torch.ones_like(total))[..., None]


if triton is not None:

    @triton.jit
    def _head_mask(d, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
        """Which of the HEAD_PAD lanes `d` hold a head's HEAD_DIM values: a head whose width is not a power of two
        (tl.arange's) is padded with zeros, which add nothing to the products. A constant where no lane is padding,
        so the loads of the common widths (64, 128, 256) stay unmasked along the head."""
        if HEAD_PAD == HEAD_DIM:
            return tl.full((HEAD_PAD,), 1, tl.int1)
        return d < HEAD_DIM

    @triton.jit
    def _decode_kernel(
        Q,
        K,
        V,
        KS,
        VS,
        Table,
        Lengths,
        Start,
        Acc,
        Stats,
        KNew,
        VNew,
        WritePage,
        WriteOffset,
        parts,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_kh,
        stride_kn,
        stride_vp,
        stride_vh,
        stride_vn,
        stride_sp,
        stride_sh,
        stride_tb,
        stride_knb,
        stride_knh,
        stride_vnb,
        stride_vnh,
        scale_log2,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        PAGES: tl.constexpr,
        DIRECT: tl.constexpr,
        START: tl.constexpr,
        QUANT: tl.constexpr,
        WRITE: tl.constexpr,
    ):
        """Program (slot b, kv head, split): its part of slot b's pages, PAGES of them (PAGES * BLOCK positions) per
        inner step, each found in the table; part `split` takes steps split, split + splits, .... WRITE: position
        length - 1 is the step's new K/V (KNew, VNew), not in the pages yet: the loop reads positions
        0..length - 2, and part 0 then adds the new position to its online softmax from registers and stores the
        vectors at (WritePage[b], WriteOffset[b]). (Substituting the new vectors inside the loop, a `where` on every
        block, cost 9-10 % of the kernel on an H100.)"""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        length = tl.load(Lengths + b).to(tl.int32)
        first = 0
        if START:  # the blocks before it are the prefix kernel's
            first = tl.load(Start + b).to(tl.int32)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_PAD)
        dim = _head_mask(d, HEAD_DIM, HEAD_PAD)[None, :]
        offs = tl.arange(0, PAGES * BLOCK)  # the inner step's positions
        within = offs  # each one's offset in its page
        if PAGES > 1:
            within = offs % BLOCK
        heads = kvh * GROUP + g
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=(g[:, None] < GROUP) & dim, other=0.0
        )
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_PAD), tl.float32)
        cached = length
        if WRITE:  # the last position is the step's new K/V: attended to after the loop, from registers
            cached = length - 1
        # this part's steps, by their first page: first + PAGES * (split, split + splits, ...)
        for block in range(first + split * PAGES, tl.cdiv(cached, BLOCK), splits * PAGES):
            valid = block * BLOCK + offs < cached
            if PAGES == 1:
                page = tl.load(Table + b * stride_tb + block).to(tl.int64)
                row_page = page
            else:  # each position's page (past the slot's last one: masked, never read)
                page = tl.load(Table + b * stride_tb + block + offs // BLOCK, mask=valid, other=0).to(tl.int64)
                row_page = page[:, None]
            k = tl.load(
                K + row_page * stride_kp + kvh * stride_kh + within[:, None] * stride_kn + d[None, :],
                mask=valid[:, None] & dim,
                other=0.0,
            )
            if QUANT:  # fp8 pages: q's dtype for the product, each position's scale on its logit
                scale_at = page * stride_sp + kvh * stride_sh + within
                ks = tl.load(KS + scale_at, mask=valid, other=0.0)
                s = tl.dot(q, tl.trans(k.to(q.dtype))) * (ks * scale_log2)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * scale_log2  # (GROUP_PAD, PAGES * BLOCK), base-2 logits
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + row_page * stride_vp + kvh * stride_vh + within[:, None] * stride_vn + d[None, :],
                mask=valid[:, None] & dim,
                other=0.0,
            )
            if QUANT:  # each position's scale on its probability
                vs = tl.load(VS + scale_at, mask=valid, other=0.0)
                acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        if WRITE:
            if length > 0:
                if split == 0:  # one part per slot: the new position's logit and value, then its store
                    lanes = _head_mask(d, HEAD_DIM, HEAD_PAD)
                    k_new = tl.load(KNew + b * stride_knb + kvh * stride_knh + d, mask=lanes, other=0.0)
                    v_new = tl.load(VNew + b * stride_vnb + kvh * stride_vnh + d, mask=lanes, other=0.0)
                    s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * scale_log2
                    m_new = tl.maximum(m_i, s_new)
                    alpha = tl.exp2(m_i - m_new)
                    p_new = tl.exp2(s_new - m_new)
                    l_i = l_i * alpha + p_new
                    # p in v's dtype, as the loop's product takes it
                    p_v = p_new.to(v_new.dtype).to(tl.float32)
                    acc = acc * alpha[:, None] + p_v[:, None] * v_new.to(tl.float32)[None, :]
                    m_i = m_new
                    at = tl.load(WritePage + b).to(tl.int64)
                    offset = tl.load(WriteOffset + b).to(tl.int64)
                    tl.store(K + at * stride_kp + kvh * stride_kh + offset * stride_kn + d, k_new, mask=lanes)
                    tl.store(V + at * stride_vp + kvh * stride_vh + offset * stride_vn + d, v_new, mask=lanes)

        row = (b * GROUP * tl.num_programs(1) + heads) * parts + split  # index into (B, H, parts)
        keep = g < GROUP
        if DIRECT:  # one split: normalize here (a slot of length 0 gives zeros)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Acc + row[:, None] * HEAD_DIM + d[None, :], out.to(Acc.dtype.element_ty), mask=keep[:, None] & dim)
        else:
            tl.store(Acc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None] & dim)
            tl.store(Stats + row * 2, m_i, mask=keep)
            tl.store(Stats + row * 2 + 1, l_i, mask=keep)

    @triton.jit
    def _write_kernel(
        X,
        Pages,
        Scales,
        Page,
        Offset,
        stride_xb,
        stride_xh,
        stride_pp,
        stride_ph,
        stride_pn,
        stride_sp,
        stride_sh,
        largest,
        inverse,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        INT: tl.constexpr,
    ):
        """Row `program_id(0)`'s vector of kv head `program_id(1)`, as `quantize` does it: divided by its largest
        magnitude / `largest` (times `inverse`, at least 1e-30), rounded (INT: half away from zero; fp8: the
        conversion's nearest even), clamped, stored at its page and offset, its scale beside it."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, HEAD_PAD)
        dim = _head_mask(d, HEAD_DIM, HEAD_PAD)
        x = tl.load(X + b * stride_xb + h * stride_xh + d, mask=dim, other=0.0).to(tl.float32)
        # as `quantize`: the scale times the reciprocal `inverse` (1 / largest, a float32 argument), the values an
        # IEEE division, as torch's tensor / tensor on CUDA (Triton's `/` on float32 is the GPU's approximate one,
        # within 2 ulp: int8_write_equal was False on an H100, 2026-12-06)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) * inverse, 1e-30)
        values = tl.math.div_rn(x, scale)
        if INT:
            values = tl.where(values < 0, -tl.floor(0.5 - values), tl.floor(values + 0.5))
        values = tl.minimum(tl.maximum(values, -largest), largest)
        page = tl.load(Page + b).to(tl.int64)
        offset = tl.load(Offset + b).to(tl.int64)
        if INT:
            stored = values.to(Pages.dtype.element_ty)
        else:
            stored = values.to(Pages.dtype.element_ty, fp_downcast_rounding="rtne")
        tl.store(Pages + page * stride_pp + h * stride_ph + offset * stride_pn + d, stored, mask=dim)
        tl.store(Scales + page * stride_sp + h * stride_sh + offset, scale)

    @triton.jit
    def _prefill_write_kernel(
        X,
        Pages,
        Scales,
        Out,
        Page,
        Offset,
        length,
        stride_xr,
        stride_xl,
        stride_xh,
        stride_pp,
        stride_ph,
        stride_pn,
        stride_sp,
        stride_sh,
        stride_or,
        stride_ol,
        stride_oh,
        stride_gr,
        stride_o,
        largest,
        inverse,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        QUANT: tl.constexpr,
        INT: tl.constexpr,
    ):
        """Positions BLOCK * `program_id(1)` onward (below `length`) of row `program_id(0)`, kv head
        `program_id(2)`: each vector stored whole at its page (`Page`, a row of pages per row) and offset. QUANT:
        each vector quantized as `_write_kernel` does it, its scale stored beside it, and the dequantized vector
        (what the pages now hold) stored in `Out` for the prefill's attention."""
        r = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        h = tl.program_id(2).to(tl.int64)
        d = tl.arange(0, HEAD_PAD)
        keep = i < length
        mask = keep[:, None] & _head_mask(d, HEAD_DIM, HEAD_PAD)[None, :]
        x = tl.load(X + r * stride_xr + i[:, None] * stride_xl + h * stride_xh + d[None, :], mask=mask, other=0.0)
        page = tl.load(Page + r * stride_gr + i, mask=keep, other=0).to(tl.int64)
        offset = tl.load(Offset + i * stride_o, mask=keep, other=0).to(tl.int64)
        at = page[:, None] * stride_pp + h * stride_ph + offset[:, None] * stride_pn + d[None, :]
        if QUANT:
            x = x.to(tl.float32)
            scale = tl.maximum(tl.max(tl.abs(x), axis=1) * inverse, 1e-30)
            values = tl.math.div_rn(x, scale[:, None])
            if INT:
                values = tl.where(values < 0, -tl.floor(0.5 - values), tl.floor(values + 0.5))
            values = tl.minimum(tl.maximum(values, -largest), largest)
            if INT:
                stored = values.to(Pages.dtype.element_ty)
            else:
                stored = values.to(Pages.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(Pages + at, stored, mask=mask)
            tl.store(Scales + page * stride_sp + h * stride_sh + offset, scale, mask=keep)
            held = stored.to(tl.float32) * scale[:, None]
            to = r * stride_or + i[:, None] * stride_ol + h * stride_oh + d[None, :]
            tl.store(Out + to, held.to(Out.dtype.element_ty), mask=mask)
        else:
            tl.store(Pages + at, x.to(Pages.dtype.element_ty), mask=mask)

    @triton.jit
    def _prefix_kernel(
        Q,
        K,
        V,
        KS,
        VS,
        Shared,
        SharedN,
        Start,
        Lengths,
        Acc,
        Stats,
        stride_qb,
        stride_qh,
        stride_kp,
        stride_kh,
        stride_kn,
        stride_vp,
        stride_vh,
        stride_vn,
        stride_sp,
        stride_sh,
        batch,
        parts,
        part0,
        scale_log2,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HEAD_PAD: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_M: tl.constexpr,
        QUANT: tl.constexpr,
        WRITE: tl.constexpr,
    ):
        """The cascade's shared pages: a program takes BLOCK_M query vectors (row b, query head of kv head `kvh`)
        and reads its part's shared pages once for all of them; a row attends only to blocks before its `start`
        and positions before its length. Writes part `part0 + split` of each row's partial results."""
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        i = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        b = i // GROUP
        heads = kvh * GROUP + i % GROUP
        inside = b < batch
        first = tl.load(Start + b, mask=inside, other=0).to(tl.int32)
        length = tl.load(Lengths + b, mask=inside, other=0).to(tl.int32)
        if WRITE:  # the last position is the step's new K/V, which the row kernel adds
            length = length - 1
        n = tl.load(SharedN).to(tl.int32)

        d = tl.arange(0, HEAD_PAD)
        dim = _head_mask(d, HEAD_DIM, HEAD_PAD)[None, :]
        offs = tl.arange(0, BLOCK)
        q = tl.load(
            Q + b[:, None] * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=inside[:, None] & dim, other=0.0
        )
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, HEAD_PAD), tl.float32)
        for block in range(split, n, splits):
            page = tl.load(Shared + block).to(tl.int64)
            k = tl.load(
                K + page * stride_kp + kvh * stride_kh + offs[:, None] * stride_kn + d[None, :], mask=dim, other=0.0
            )
            if QUANT:  # as in _decode_kernel
                ks = tl.load(KS + page * stride_sp + kvh * stride_sh + offs)
                s = tl.dot(q, tl.trans(k.to(q.dtype))) * (ks * scale_log2)[None, :]
            else:
                s = tl.dot(q, tl.trans(k)) * scale_log2  # (BLOCK_M, BLOCK), base-2 logits
            valid = (block < first)[:, None] & (block * BLOCK + offs[None, :] < length[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing valid yet stays at 0
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                V + page * stride_vp + kvh * stride_vh + offs[:, None] * stride_vn + d[None, :], mask=dim, other=0.0
            )
            if QUANT:
                vs = tl.load(VS + page * stride_sp + kvh * stride_sh + offs)
                acc = acc * alpha[:, None] + tl.dot((p * vs[None, :]).to(q.dtype), v.to(q.dtype))
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        row = (b * GROUP * tl.num_programs(1) + heads) * parts + part0 + split
        tl.store(Acc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=inside[:, None] & dim)
        tl.store(Stats + row * 2, m_i, mask=inside)
        tl.store(Stats + row * 2 + 1, l_i, mask=inside)
