"""What this worker process can run: devices it really got and installed backends. Stored in its registration
and used at submit to refuse jobs no live worker could run."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from core.slices import NVLINK_MULTICAST_OFF

PACKAGES = (
    "torch",
    "transformers",
    "peft",
    "accelerate",
    "bitsandbytes",
    "torchao",
    "flash-attn",
    "kernels",
    "liger-kernel",
    "triton",
    "deepspeed",
)


@cache
def versions() -> dict[str, str | None]:
    """The versions of PACKAGES installed (None: not installed), read once per process (a copy each call)."""
    return dict(_versions())


@cache  # packages do not change under a running worker; reading their metadata cost ms per job
def _versions() -> dict[str, str | None]:
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
        found.append(
            {
                "index": i,
                "name": p.name,
                "uuid": f"GPU-{p.uuid}" if getattr(p, "uuid", None) else None,
                "memory_bytes": p.total_memory,
                "compute_capability": f"{p.major}.{p.minor}",
            }
        )
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
        "flex_attention": FLEX_PENDING,  # until probe_flex answers (worker/runtime.py)
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
    fix = (
        "start it with --gpus naming GPUs that `nvidia-smi` lists on this host (indices or UUIDs), or --gpus "
        "none for a CPU worker"
    )
    if not torch.cuda.is_available():
        return (
            f"the slice {wanted} asks for {len(devices)} GPU(s) but CUDA is not available in this process (no "
            f"NVIDIA driver or GPU here, or none of those GPUs exists): {fix}"
        )
    seen = torch.cuda.device_count()
    if seen < len(devices):
        return (
            f"the slice {wanted} asks for {len(devices)} GPU(s) but CUDA sees {seen} of them (a GPU of the "
            f"slice does not exist on this host, and CUDA hides it and every one after it): {fix}"
        )
    return None


def hub_settings() -> dict[str, Any]:
    """How this worker reaches the Hub (core/hub.py): never the token itself, only whether one is set."""
    from core import hub
    from core.settings import get_settings

    settings = get_settings()
    value, source = hub.token()
    return {
        "offline": settings.hub_offline,
        "endpoint": hub.endpoint(),
        "cache": str(settings.hub_cache),
        "token": source if value else None,
    }


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
    if (
        devices
        and importlib.util.find_spec("flash_attn")
        and min(float(d["compute_capability"]) for d in devices) >= 8.0
    ):
        backends.append("flash_attention_2")
    return backends


def varlen_attention(devices: list[dict[str, Any]]) -> bool:
    """Can packed fine-tunes use torch's flash-attention varlen kernel here (`packed_attention: varlen`)? It needs
    torch.nn.attention.varlen (torch 2.10+) and an Ampere or newer GPU. finetune() checks its numbers on first use."""
    return bool(
        devices
        and importlib.util.find_spec("torch.nn.attention.varlen")
        and min(float(d["compute_capability"]) for d in devices) >= 8.0
    )


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
        return {
            "ok": False,
            "reason": f"bitsandbytes 4-bit does not run on this worker's {device}: {type(exc).__name__}: {exc}",
        }
    return {"ok": True, "reason": None, "device": device}


# the child of probe_flex_isolated: its CPU priority first (argv[1], JOBS_PROBE_NICE: by default 19, the lowest; the
# compiler it starts inherits it, and a job never competes with it), then one JSON line on stdout
FLEX_CHILD = (
    "import json, os, sys; os.nice(int(sys.argv[1])); from worker import capabilities as c; "
    "print(json.dumps(c.probe_flex(c.gpus())), flush=True)"
)
FLEX_PENDING = {"ok": None, "reason": "the probe runs just after the worker starts"}


def probe_flex(devices: list[dict[str, Any]]) -> dict[str, Any]:
    """Can flex_attention run on this worker's device? Compile and run a small flex_attention call, as a job's
    model would (torch.compile: Inductor's C++ compiler on the CPU, Triton on CUDA); on the CPU, a one-line C++
    build first (check_cxx), which fails fast where the compiler cannot build anything.

    The first compile takes up to a minute on a busy CPU, so the runtime calls this in a thread after
    registration, like the QLoRA probe; until it answers, the registration says `flex_attention: FLEX_PENDING`
    and submit says the probe is pending. A success is remembered in Inductor's cache folder (keyed by torch's
    version, the device and the C++ compiler), where the compiled kernel lives too; a failure is probed again at
    the next start (the compiler may have been fixed)."""
    device = "cuda" if devices else "cpu"
    marker = _flex_marker(device, devices)
    if marker is not None and marker.is_file():
        return {"ok": True, "reason": None, "device": device, "remembered": True}
    try:
        if device == "cpu":
            check_cxx()
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        q = torch.randn(1, 2, 16, 16, device=device)
        out = torch.compile(flex_attention)(q, q, q)
        if out.shape != q.shape or not torch.isfinite(out).all():
            raise RuntimeError("flex_attention gave a wrong result")
    except Exception as exc:  # noqa: BLE001  any failure means: no flex_attention here, and why
        from worker.failures import final_cause

        cause = final_cause(exc) or f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return {"ok": False, "reason": f"flex_attention does not compile on this worker's {device}: {cause}"}
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text(json.dumps({"device": device}))
        except OSError:
            pass  # not remembered: probed again next time
    return {"ok": True, "reason": None, "device": device}


# a C++ file as small as one that still needs what every Inductor CPU kernel needs: Python's headers and a shared
# library linked against torch
CXX_PROBE = '#include <Python.h>\nextern "C" int gpujobs_probe() { return Py_IsInitialized(); }\n'


def check_cxx() -> None:
    """Build CXX_PROBE with Inductor's own C++ builder, compiler and flags (torch._inductor.cpp_builder, as its CPU
    kernels are built); raise its error (CppCompileError, InvalidCxxCompiler) when that fails.

    A compiler that fails every build (no Python headers, a broken CXX) fails here, naming its own error line
    (`fatal error: Python.h: No such file or directory`), and the probe's child ends after about 2.7 s of CPU
    (importing torch and Dynamo, mostly). Without this check the flex_attention compile got as far as lowering
    and failed there with `LoweringException: AssertionError: target: flex_attention` (no vector ISA check had
    compiled), which names nothing to fix, after about 6 s of CPU: at the probe's lowest priority on a busy host,
    every CPU-second of it is a minute or more. With a working compiler this adds one small build (~0.3 s)."""
    import tempfile

    # a private torch module: where it moved or its signature changed, there is no quick check, and the
    # flex_attention compile that follows is the check (only the build's own errors are the compiler's)
    try:
        from torch._inductor.cpp_builder import CppBuilder, CppTorchOptions
    except ImportError:
        return
    with tempfile.TemporaryDirectory(prefix="gpujobs-cxx-probe-") as tmp:
        source = Path(tmp) / "probe.cpp"
        source.write_text(CXX_PROBE)
        try:
            builder = CppBuilder("probe", [str(source)], CppTorchOptions(warning_all=False), tmp)
        except TypeError:
            return
        builder.build()


def probe_flex_isolated(
    devices: list[dict[str, Any]],
    *,
    nice: int = 19,
    started: Callable[[subprocess.Popen], None] = lambda p: None,
    timeout: float = 900.0,
) -> dict[str, Any]:
    """`probe_flex` in a child process at niceness `nice` (FLEX_CHILD; JOBS_PROBE_NICE, by default the lowest).

    Not in the worker's own interpreter: the compile leaves threads that abort the interpreter at exit
    ("terminate called without an active exception"), which would turn a clean stop into a crash, and a compiler
    that crashes must not take the worker with it. `started` receives the child (the runtime ends it when the
    worker stops); a remembered success answers without one.

    GPU workers are not probed by compiling: the child's CUDA context (~0.5 GiB) would sit on the worker's GPU while
    the first job loads and sizes its KV cache from free memory (worker/engines/slot_state.py). There flex_attention
    compiles with Triton, so its presence is the answer; a compile that still fails fails its shard once, naming
    the cause (worker/failures.py)."""
    if devices:
        import importlib.util

        if importlib.util.find_spec("triton") is None:
            return {"ok": False, "reason": "flex_attention needs Triton on CUDA, and it is not installed"}
        return {"ok": True, "reason": None, "device": "cuda", "probed": False}
    marker = _flex_marker("cpu", devices)
    if marker is not None and marker.is_file():
        return {"ok": True, "reason": None, "device": "cpu", "remembered": True}
    proc = subprocess.Popen(
        [sys.executable, "-c", FLEX_CHILD, str(nice)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    started(proc)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"ok": False, "reason": f"the flex_attention compile probe took more than {timeout:.0f} s"}
    lines = out.strip().splitlines()
    if proc.returncode != 0 or not lines:
        last = (err.strip().splitlines() or ["no output"])[-1]
        return {"ok": False, "reason": f"the flex_attention compile probe exited with code {proc.returncode}: {last}"}
    return json.loads(lines[-1])


def _flex_marker(device: str, devices: list[dict[str, Any]]) -> Path | None:
    """Where a successful flex_attention probe is remembered, or None when Inductor's cache folder is unknown."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    key = json.dumps(
        [
            versions().get("torch"),
            versions().get("triton"),
            device,
            [d.get("name") for d in devices],
            os.environ.get("CXX"),
        ]
    )
    return Path(cache_dir()) / "gpujobs-probes" / f"flex-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
