"""Slices of several GPUs: the environment every GPU process gets, and how a job uses its slice.

Light on purpose (no torch): the launchers (api/stack.py, api/supervisor.py), the submit-time checks
(core/capability.py) and the worker (worker/training/distributed.py) all use these, so they can never disagree.

- NVLink multicast stays off in every process we start (`NVLINK_MULTICAST_OFF`): on shared hosts NCCL's NVLS and
  torch's symmetric-memory multicast can take GPUs out of service. The launcher sets it on every worker, the worker
  again on every child it launches (a worker started by hand or by another launcher still passes it on).
- `plan()` turns a fine-tune's `strategy` and `nproc` into (strategy, processes) for a slice of `gpus` GPUs:
  `auto` is one process on one GPU or the CPU, and one process per GPU (DDP) on a slice of 2 or more, unless the
  spec asks `device_map: auto` (one process that splits one copy of the model over the slice). On the CPU several
  processes (gloo) run only when `nproc` asks for them, and only as ddp: that is for tests and debugging.
- A worker serves one slice (`parse_slice`: `2,0`, GPU UUIDs, or none for the CPU), started as `worker_command`
  with `worker_env` (the slice pinned, as `pinned_env` says).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from core.errors import InvalidInput

NVLINK_MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
DISTRIBUTED = ("ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3")


def nccl_safety_env() -> dict[str, str]:
    """The variables every process the service starts gets (a copy: callers may update it)."""
    return dict(NVLINK_MULTICAST_OFF)


def pinned_env(devices: list[str], base: Mapping[str, str]) -> dict[str, str]:
    """`base` plus the pinning of one slice: PCI bus order (indices as nvidia-smi shows them), the slice's devices in
    the given order ('' for the CPU), and NVLink multicast off."""
    env = dict(base)
    env.update(nccl_safety_env())
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def plan(
    strategy: str, nproc: int | None, *, gpus: int, device_map: str | None = None, quantized: bool = False
) -> tuple[str, int]:
    """(strategy, processes) of a fine-tune on a slice of `gpus` GPUs (0 = CPU); InvalidInput says why not."""
    if gpus > 0 and nproc is not None and nproc != gpus:
        raise InvalidInput(
            f"nproc={nproc} on a slice of {gpus} GPU(s): on GPUs a distributed fine-tune runs one "
            "process per GPU of the slice; leave nproc out, or set gpus to the slice size you want"
        )
    world = gpus if gpus > 0 else (nproc or 1)
    if strategy == "auto":
        return ("single", 1) if world == 1 or device_map == "auto" else ("ddp", world)
    if strategy == "single":
        if gpus == 0 and (nproc or 1) > 1:
            raise InvalidInput(
                f"strategy single runs one process, but nproc={nproc}: use strategy ddp or leave nproc out"
            )
        return "single", 1
    if world < 2:
        where = f"a slice of {gpus} GPU" if gpus else "the CPU without nproc"
        raise InvalidInput(
            f"strategy {strategy} needs 2 or more processes, and {where} gives one: submit with "
            "gpus: 2 (or more) for a slice of several GPUs, or use strategy auto/single"
        )
    if device_map == "auto":
        raise InvalidInput(
            f"strategy {strategy} runs one copy of the model per GPU, device_map auto splits one copy "
            "over the slice in one process: use one or the other (strategy single with device_map "
            "auto for a model that does not fit one GPU)"
        )
    if quantized and strategy != "ddp":
        raise InvalidInput(f"QLoRA (a bnb-4bit base) runs with strategy ddp or single, not {strategy}")
    if strategy != "ddp" and gpus == 0:  # accelerate runs FSDP only on GPUs: on the CPU it would quietly be DDP
        raise InvalidInput(
            f"strategy {strategy} needs a slice of GPUs (accelerate shards only on GPUs): on the CPU "
            "use strategy ddp with nproc"
        )
    return strategy, world


# --- a worker's slice, and the process that serves it -------------------------------------------------------


def parse_slice(text: str) -> list[str]:
    """'2,0' -> ['2', '0']; 'none' or '' -> [] (CPU). Indices or GPU-/MIG- UUIDs, no duplicates."""
    text = text.strip()
    if text.lower() in ("", "none", "cpu"):
        return []
    devices = [d.strip() for d in text.split(",")]
    for d in devices:
        if not (d.isdigit() or d.startswith(("GPU-", "MIG-"))):
            raise InvalidInput(
                f"bad GPU {d!r} in {text!r}: use indices as nvidia-smi shows them (e.g. 0,1), "
                "GPU UUIDs, or 'none' for a CPU worker"
            )
    if len(set(devices)) != len(devices):
        raise InvalidInput(f"GPU slice {text!r} names a device twice")
    return devices


def parse_slices(text: str) -> list[list[str]]:
    """'0,1;2;3' -> [['0','1'], ['2'], ['3']]; two slices may not share a GPU."""
    slices = [parse_slice(part) for part in text.split(";")]
    seen: set[str] = set()
    for s in slices:
        if seen & set(s):
            raise InvalidInput(f"slices {text!r} share GPU(s) {sorted(seen & set(s))}: two workers never share a GPU")
        seen |= set(s)
    return slices


def worker_env(devices: list[str], base: dict[str, str] | None = None) -> dict[str, str]:
    env = pinned_env(devices, os.environ if base is None else base)  # HF_HUB_OFFLINE only if the operator set it
    # a job's prompts are tokenized in one batch that the Rust tokenizer spreads over the host's cores: G2's 2,048
    # prompts took 1.7 s single-threaded in an H200 worker, ~0.25 s in parallel (ops/bench/results/
    # 2026-12-04-h200-diagnose). The worker forks nothing that tokenizes (its children exec), so no deadlock risk.
    env.setdefault("TOKENIZERS_PARALLELISM", "true")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env


def worker_command(devices: list[str]) -> list[str]:
    return [sys.executable, "-m", "worker.main", "--slice", ",".join(devices)]
