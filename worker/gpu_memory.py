"""Memory, as worker/runtime.py reports and frees it: a shard's peak (reset before it, read after: what torch
allocated on the GPU, or on the CPU the process's peak resident set), each GPU's allocated and reserved bytes for
the registration (GET /metrics; never initialises CUDA itself), and freeing memory when the resident model is
dropped. torch is imported when called, never at import.
"""

from __future__ import annotations


def reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def peak_memory() -> int:
    import resource

    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: peak resident set of the process


def per_gpu() -> list[dict[str, int]]:
    """What this process's torch holds on each of its GPUs (GET /metrics); never initialises CUDA itself."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [
        {
            "index": i,
            "allocated_bytes": int(torch.cuda.memory_allocated(i)),
            "reserved_bytes": int(torch.cuda.memory_reserved(i)),
        }
        for i in range(torch.cuda.device_count())
    ]


def free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
