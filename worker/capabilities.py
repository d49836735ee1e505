"""What this worker process can run: devices it really got and installed backends. Stored in its registration
and used at submit to refuse jobs no live worker could run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from functools import cache
from typing import Any

from core.slices import NVLINK_MULTICAST_OFF

PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "torchao", "flash-attn", "kernels",
            "liger-kernel", "triton", "deepspeed")


@cache
def versions() -> dict[str, str | None]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpus() -> list[dict[str, Any]]:
    """Per visible device: name, UUID, memory and compute capability, in CUDA order (= the slice's order)."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        found.append({
            "index": i,
            "name": p.name,
            "uuid": f"GPU-{p.uuid}" if getattr(p, "uuid", None) else None,
            "memory_bytes": p.total_memory,
            "compute_capability": f"{p.major}.{p.minor}",
        })
    return found


def probe() -> dict[str, Any]:
    import torch

    devices = gpus()
    return {
        "cuda_available": bool(devices),
        "device_count": len(devices),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_device_order": os.environ.get("CUDA_DEVICE_ORDER"),
        "multicast_off": {k: os.environ.get(k) for k in NVLINK_MULTICAST_OFF},
        "torch_cuda": torch.version.cuda,
        "min_compute_capability": min((float(d["compute_capability"]) for d in devices), default=None),
        "versions": versions(),
        "attention": attention_backends(devices),
        "varlen_attention": varlen_attention(devices),
        "hub": hub_settings(),
        "model_types": causal_lm_types(),
    }


def slice_problem(devices: list[str]) -> str | None:
    """Why this process cannot run the slice `devices` (CUDA_VISIBLE_DEVICES as the launcher set it), or None.

    CUDA shows only the devices of CUDA_VISIBLE_DEVICES that exist, up to the first that does not: `--gpus 2,0` on
    a host whose only GPU is 0 sees none. A worker that started anyway would register on the queue of its slice
    size and take (then fail) that queue's jobs, or make submit list a worker that serves nothing."""
    if not devices:
        return None
    import torch

    wanted = ",".join(devices)
    fix = ("start it with --gpus naming GPUs that `nvidia-smi` lists on this host (indices or UUIDs), or --gpus "
           "none for a CPU worker")
    if not torch.cuda.is_available():
        return (f"the slice {wanted} asks for {len(devices)} GPU(s) but CUDA is not available in this process (no "
                f"NVIDIA driver or GPU here, or none of those GPUs exists): {fix}")
    seen = torch.cuda.device_count()
    if seen < len(devices):
        return (f"the slice {wanted} asks for {len(devices)} GPU(s) but CUDA sees {seen} of them (a GPU of the "
                f"slice does not exist on this host, and CUDA hides it and every one after it): {fix}")
    return None


def hub_settings() -> dict[str, Any]:
    """How this worker reaches the Hub (core/hub.py): never the token itself, only whether one is set."""
    from core import hub
    from core.settings import get_settings

    settings = get_settings()
    value, source = hub.token()
    return {"offline": settings.hub_offline, "endpoint": hub.endpoint(), "cache": str(settings.hub_cache),
            "token": source if value else None}


def causal_lm_types() -> list[str]:
    """The config `model_type`s this transformers loads with AutoModelForCausalLM (submit checks a model's)."""
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return []
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def attention_backends(devices: list[dict[str, Any]]) -> list[str]:
    """Backends this process could load. flash-attn needs its package and an Ampere+ GPU."""
    backends = ["sdpa", "eager", "flex_attention"]
    if devices and importlib.util.find_spec("flash_attn") and min(float(d["compute_capability"]) for d in devices) >= 8.0:
        backends.append("flash_attention_2")
    return backends


def varlen_attention(devices: list[dict[str, Any]]) -> bool:
    """Can packed fine-tunes use torch's flash-attention varlen kernel here (`packed_attention: varlen`)? It needs
    torch.nn.attention.varlen (torch 2.10+) and an Ampere or newer GPU. finetune() checks its numbers on first use."""
    return bool(devices and importlib.util.find_spec("torch.nn.attention.varlen")
                and min(float(d["compute_capability"]) for d in devices) >= 8.0)


def probe_qlora(devices: list[dict[str, Any]]) -> dict[str, Any]:
    """Can bitsandbytes 4-bit (QLoRA) run on this worker's device? Quantize a small matrix and multiply with it.

    Importing bitsandbytes takes seconds, so the runtime calls this in a thread after registration and merges the
    answer into the registration (`qlora`); until then submit says the probe is pending.
    """
    if importlib.util.find_spec("bitsandbytes") is None:
        return {"ok": False, "reason": "bitsandbytes is not installed (pip install bitsandbytes)"}
    try:
        import bitsandbytes as bnb
        import torch

        device = "cuda" if devices else "cpu"
        weight = torch.randn(64, 64, device=device)
        packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4")
        out = bnb.matmul_4bit(torch.randn(2, 64, device=device), packed.t(), quant_state=state)
        if out.shape != (2, 64) or not torch.isfinite(out).all():
            raise RuntimeError("4-bit matmul gave a wrong result")
    except Exception as exc:  # noqa: BLE001  any failure means: no QLoRA here, and why
        return {"ok": False, "reason": f"bitsandbytes 4-bit does not run on this worker's {device}: "
                                       f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "reason": None, "device": device}
