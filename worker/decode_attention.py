"""Decode attention over a slot KV cache with a length per row: the fast engine's attention kernel.

The fast engine (worker/fastgen.py) keeps one KV cache row ("slot") per running sequence, shaped
(slots, kv_heads, max_len, head_dim) per layer, and a length per slot. A decode step has one query token per slot;
this attention reads each slot's K/V only up to that slot's length, so a short row never pays for a long one and
nothing is padded. Grouped-query heads share one read of K/V: a program handles one (slot, kv head) and all the
query heads of its group together, so each K/V byte is read once per step (the memory-bandwidth bound of G1 in
DESIGN.md assumes exactly that).

Two implementations with one contract, `decode(q, k, v, lengths, scale, splits)`:

- `_triton_decode`: a Triton flash-decoding kernel (online softmax over blocks of positions; optionally split
  over the context in `splits` parts, merged by `_merge`, so a small batch still fills the GPU). Lengths are read
  from a device tensor, so the launch has fixed shapes and is captured in a CUDA graph once per batch size. It also
  runs under `TRITON_INTERPRET=1` on CPU tensors, which is how the CPU tests check it against the reference.
- `reference_decode`: the same result with `scaled_dot_product_attention` and a length mask; what runs on CPU
  (there is no Triton CPU backend outside the interpreter), and the yardstick of the tests.

A slot of length 0 (a free slot in a padded batch) returns zeros and reads nothing.
"""

from __future__ import annotations

import math
import os

import torch

# launch configuration of the kernel: (positions per inner step, warps, pipeline stages); ops/bench/fast_tune.py
# measures the alternatives on a GPU
CONFIG = {"block": 64, "warps": 4, "stages": 3}  # best at G1 decode on the H200: 3.94 TB/s (ops/bench/results)

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


def decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor, scale: float,
           splits: int = 1) -> torch.Tensor:
    """Attention of one query token per slot. q: (B, H, D); k, v: (B, KVH, L, D) (any strides, last dim
    contiguous); lengths: (B,) int, the positions of each slot to attend to (0..length-1). Returns (B, H, D) in
    q's dtype. The Triton kernel where it runs (see `available`), else the reference."""
    if available(q.device):
        return _triton_decode(q, k, v, lengths, scale, splits)
    return reference_decode(q, k, v, lengths, scale)


def reference_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`decode` with SDPA and a length mask (reads every position up to the longest slot; zeros where length 0)."""
    longest = k.shape[2]
    mask = torch.arange(longest, device=q.device)[None, :] < lengths[:, None].to(q.device)  # (B, L)
    empty = ~mask.any(dim=1)
    mask = mask | empty[:, None]  # SDPA gives NaN on an all-masked row; such rows are zeroed below
    out = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[:, :, 0].masked_fill(empty[:, None, None], 0)


def splits_for(batch: int, kv_heads: int, max_len: int, programs: int) -> int:
    """How many parts to split each slot's context into so about `programs` kernel programs run (at least one
    block of positions per part)."""
    if batch * kv_heads >= programs:
        return 1
    return max(1, min(math.ceil(programs / (batch * kv_heads)), math.ceil(max_len / CONFIG["block"])))


def _triton_decode(q, k, v, lengths, scale: float, splits: int) -> torch.Tensor:
    """One split: the kernel writes the normalized output in q's dtype. Several: fp32 partial results per split,
    merged by `_merge`."""
    batch, heads, dim = q.shape
    kv_heads, max_len = k.shape[1], k.shape[2]
    group = heads // kv_heads
    block = CONFIG["block"]
    split_len = math.ceil(math.ceil(max_len / splits) / block) * block
    direct = splits == 1
    if direct:
        acc = torch.empty((batch, heads, 1, dim), dtype=q.dtype, device=q.device)
        stats = acc  # unused
    else:
        acc = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=q.device)
        stats = torch.empty((batch, heads, splits, 2), dtype=torch.float32, device=q.device)  # running max, sum
    _decode_kernel[(batch, kv_heads, splits)](
        q, k, v, lengths, acc, stats,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        scale * 1.4426950408889634,  # log2(e): the kernel works in base 2
        split_len, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=dim, BLOCK=block,
        DIRECT=direct, num_warps=CONFIG["warps"], num_stages=CONFIG["stages"])
    if direct:
        return acc[:, :, 0]
    return _merge(acc, stats).to(q.dtype)


def _merge(acc: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Combine the per-split partial results (unnormalized acc, max m and sum l in base 2) into (B, H, D)."""
    m, l = stats[..., 0], stats[..., 1]
    top = m.amax(dim=2, keepdim=True)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w = torch.exp2(m - top)  # exp2(-inf) = 0 for empty splits
    total = (l * w).sum(dim=2)
    out = (acc * w[..., None]).sum(dim=2)
    return out / torch.where(total > 0, total, torch.ones_like(total))[..., None]


if triton is not None:

    @triton.jit
    def _decode_kernel(Q, K, V, Lengths, Acc, Stats,
                       stride_qb, stride_qh, stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn,
                       scale_log2, split_len,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr,
                       DIRECT: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        splits = tl.num_programs(2)
        length = tl.load(Lengths + b).to(tl.int32)
        start = split * split_len
        end = tl.minimum(start + split_len, length)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kvh * GROUP + g
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g[:, None] < GROUP, other=0.0)
        m_i = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        l_i = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, HEAD_DIM), tl.float32)
        k_base = K + b * stride_kb + kvh * stride_kh
        v_base = V + b * stride_vb + kvh * stride_vh
        for n0 in range(start, end, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            valid = n < end
            k = tl.load(k_base + n[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2  # (GROUP_PAD, BLOCK), base-2 logits
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * stride_vn + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        row = (b * GROUP * tl.num_programs(1) + heads) * splits + split  # index into (B, H, splits)
        keep = g < GROUP
        if DIRECT:  # one split: normalize here (a slot of length 0 gives zeros)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(Acc + row[:, None] * HEAD_DIM + d[None, :], out.to(Acc.dtype.element_ty), mask=keep[:, None])
        else:
            tl.store(Acc + row[:, None] * HEAD_DIM + d[None, :], acc, mask=keep[:, None])
            tl.store(Stats + row * 2, m_i, mask=keep)
            tl.store(Stats + row * 2 + 1, l_i, mask=keep)
