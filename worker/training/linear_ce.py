"""Next-token cross-entropy computed from a causal LM's last hidden states, without ever holding the logits.

A 151,936-token vocabulary makes the logits of a 16 × 2,048-token batch 5 GB in bf16, then 10 GB more in fp32 for the
loss, its softmax and their gradients: most of plain PEFT's 136 GiB peak on workload F1. Two ways to avoid them:

- `chunked` (ours, any device, exact): the hidden states are cut into chunks of rows; each chunk's logits are the
  same matmul the model's `lm_head` does, upcast to fp32 as transformers' `ForCausalLMLoss` does; the loss and the
  gradient with respect to the hidden states (softmax − one-hot, times `lm_head`'s weight) are computed right there in
  the forward pass and the chunk's logits are dropped. Backward only scales the kept gradient. Peak extra memory is
  one chunk of logits (`CHUNK_BYTES` of fp32). On CUDA the per-chunk softmax/gradient is one compiled kernel when the
  fine-tune compiles (`compiled=True`).
- `liger`: liger-kernel's fused linear cross-entropy (Triton, CUDA), called as a function. Never through liger's
  monkey patching (`apply_liger_kernel_to_*`, or Trainer's `use_liger_kernel`): that replaces RoPE, RMSNorm and MLP
  classes in transformers' modeling modules for the whole process, and a long-lived worker would then load every later
  generation model with them.

Both return the *sum* of the token losses and the number of target tokens, so the caller divides by the count of the
whole optimizer step (gradient accumulation then weighs every token alike, as transformers' `num_items_in_batch`).
"""

from __future__ import annotations

from functools import cache

import torch

IGNORE = -100
CHUNK_BYTES = 1 << 30  # fp32 logits of one chunk: ~1,700 rows of a 151,936-token vocabulary


def chunk_rows(vocab: int) -> int:
    """Rows per chunk: CHUNK_BYTES of fp32 logits, a multiple of 128 (at least 128)."""
    return max(128, CHUNK_BYTES // (4 * vocab) // 128 * 128)


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Flattened targets: position t predicts labels[t + 1]; the last position of each row predicts nothing."""
    return torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE).reshape(-1)


def chunk_loss_and_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the losses, d(sum)/d(logits) in the logits' dtype) of one chunk; rows whose target is IGNORE add 0."""
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 → fp32, as ForCausalLMLoss
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != IGNORE
    target = torch.where(valid, targets, 0)
    picked = x.gather(1, target[:, None]).squeeze(1)
    loss = torch.where(valid, lse - picked, 0.0).sum()
    columns = torch.arange(x.shape[1], device=x.device)
    grad = torch.exp(x - lse[:, None]) - (columns[None, :] == target[:, None]).to(x.dtype)
    return loss, torch.where(valid[:, None], grad, 0.0).to(logits.dtype)


@cache
def _compiled_chunk():
    return torch.compile(chunk_loss_and_grad)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """sum over rows of CE(hidden @ weight.T, targets), gradients computed chunk by chunk in the forward pass."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, rows: int, compiled: bool):
        step = _compiled_chunk() if compiled else chunk_loss_and_grad
        grad_hidden = torch.empty_like(hidden) if hidden.requires_grad else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        )
        total = torch.zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for start in range(0, hidden.shape[0], rows):
            h = hidden[start : start + rows]
            loss, grad_logits = step(h @ weight.t(), targets[start : start + rows])
            total += loss
            if grad_hidden is not None:
                grad_hidden[start : start + rows] = grad_logits.to(h.dtype) @ weight.to(h.dtype)
            if grad_weight is not None:
                grad_weight += (grad_logits.t().to(h.dtype) @ h).float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grad_hidden, grad_weight = ctx.saved_tensors
        return (
            grad_hidden * grad_total.to(grad_hidden.dtype) if grad_hidden is not None else None,
            (grad_weight * grad_total).to(ctx.weight_dtype) if grad_weight is not None else None,
            None,
            None,
            None,
        )


def causal_lm_loss(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, kernel: str = "chunked", compiled: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token losses, number of target tokens) for `hidden` (batch, seq, dim) under `lm_head` weight.

    `kernel`: "chunked" (ours) or "liger". Same targets as transformers' causal LM loss (labels shifted left by one,
    IGNORE = -100 skipped).
    """
    targets = shift_labels(labels)
    flat = hidden.reshape(-1, hidden.shape[-1])
    count = (targets != IGNORE).sum()
    if kernel == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(flat, weight, targets, ignore_index=IGNORE, reduction="sum"), count
    if kernel != "chunked":
        raise ValueError(f"unknown loss kernel {kernel!r}: use chunked or liger")
    return ChunkedLinearCrossEntropy.apply(flat, weight, targets, chunk_rows(weight.shape[0]), compiled), count


def reference_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain computation (all logits at once, fp32), summed: what the tests and the liger probe compare with."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.t()
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits, shift_labels(labels), ignore_index=IGNORE, reduction="sum")


def liger_problem(device: torch.device) -> str | None:
    """None if liger's fused linear cross-entropy runs here and matches `reference_loss` (loss and gradient, on a
    small random case); else why not. Checked once per process before a fine-tune relies on it."""
    return _liger_problem(str(device))


@cache
def _liger_problem(device: str) -> str | None:
    if not device.startswith("cuda"):
        return "liger-kernel runs on CUDA only (this fine-tune runs on the CPU)"
    try:
        import liger_kernel  # noqa: F401
    except ImportError:
        return "liger-kernel is not installed on this worker"
    except Exception as exc:  # noqa: BLE001  an install that does not import (e.g. a triton it does not know)
        return f"liger-kernel does not import here: {type(exc).__name__}: {exc}"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        hidden = torch.randn(2, 96, 64, device=device, dtype=torch.bfloat16, generator=gen, requires_grad=True)
        weight = torch.randn(1000, 64, device=device, dtype=torch.bfloat16, generator=gen) * 0.1
        labels = torch.randint(0, 1000, (2, 96), device=device, generator=gen)
        labels[0, :10] = IGNORE
        got, _ = causal_lm_loss(hidden, weight, labels, kernel="liger")
        (grad_got,) = torch.autograd.grad(got, hidden)
        want = reference_loss(hidden, weight, labels)
        (grad_want,) = torch.autograd.grad(want, hidden)
        if not torch.allclose(got.float(), want, rtol=2e-2) or not torch.allclose(
            grad_got.float(), grad_want.float(), rtol=5e-2, atol=5e-3
        ):
            return (
                f"liger's fused cross-entropy disagrees with the plain one here ({got.item():.4f} vs {want.item():.4f})"
            )
    except Exception as exc:  # noqa: BLE001  any failure means: not usable here, and why
        return f"liger's fused cross-entropy fails here: {type(exc).__name__}: {exc}"
    return None
