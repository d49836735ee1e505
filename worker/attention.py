"""`sdpa_gqa`: transformers' SDPA attention without repeating K/V heads, registered through `AttentionInterface`.

transformers' `sdpa` path repeats the K/V heads of a grouped-query model (`repeat_kv`) whenever a mask is passed,
which a padded batch always does: at G1's decode (Qwen3-0.6B, batch 1024, context 512) one layer took 5.8 ms on an
H200, against 0.61 ms for `scaled_dot_product_attention(..., attn_mask=mask, enable_gqa=True)` (issue 6). This
module registers that call under the name `sdpa_gqa` (and transformers' own `sdpa_mask` for it in
`AttentionMaskInterface`, so masks are built exactly as for `sdpa`), so the model stays a transformers model and
every other attention choice keeps working.

Used by the padded engine (worker/engines/padded.py) by default on CUDA, and by the static engine on every device, when
the model has grouped K/V heads and loaded with `sdpa`; selectable anywhere as `attn_implementation: sdpa_gqa`.
Under the static engine's torch.compile it is traced like any function (the masks are built outside the graph). The job records the attention that ran.
transformers' continuous batching does not take it (it accepts sdpa, eager and flash kernels only).
"""

from __future__ import annotations

import torch

NAME = "sdpa_gqa"
_registered = False


def sdpa_gqa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Same contract as transformers' `sdpa_attention_forward` (query/key/value as (batch, heads, seq, dim),
    output as (batch, seq, heads, dim)), with `enable_gqa=True` instead of `repeat_kv`."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError("sdpa_gqa supports neither softcap nor position_bias: use sdpa or eager for this model")
    q_length = query.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_length:
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    gqa = query.shape[1] != key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
        enable_gqa=gqa,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `sdpa_gqa` once per process (idempotent); returns its name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionInterface.register(NAME, sdpa_gqa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
        _registered = True
    return NAME


def applies(model) -> bool:
    """True where sdpa_gqa helps: a grouped-query model (fewer K/V heads than query heads) now on `sdpa`."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    return config._attn_implementation == "sdpa" and bool(heads and kv_heads and kv_heads < heads)
