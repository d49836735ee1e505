"""Compiled code kept on disk under JOBS_HOME, so a fresh worker on a model it has run before does not compile again
(issue 25, cold start).

A worker compiles its engine's decoder layers (torch.compile: Dynamo, AOTAutograd, Inductor's Triton kernels) and
our Triton decode kernel when it prepares a model: 20-40 s on an H200 (ops/bench/results/2026-12-04-h200-service:
the first job after `up` took 47 s, 36 s of it compiling). Inductor keeps what it compiled in a content-addressed
cache (its FX graph cache: the key covers the graph, its shapes and dynamic dimensions, the device and the compiler
configuration) and Triton its kernels; by default both live under /tmp, which a reboot or a container restart
empties. `use()` points both at `JOBS_HOME/compile-cache/<versions>/` before torch is imported:

- keyed by the versions that change what is compiled (torch, triton, transformers, Python): a new version gets a
  new folder, so nothing compiled by another version is ever looked at (old folders can be deleted at will);
- within a folder the model and its shapes are in Inductor's own keys: another model or other shapes miss;
- a corrupt entry (a truncated file, a half-written one) is a miss: Inductor logs it, compiles again and writes the
  entry anew (tests/test_compile_cache.py truncates every file and gets the right results);
- an operator's own TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR win (a shared cache on fast disk, say), but not
  torch's own default (/tmp/torchinductor_<user>): torch writes that into the environment of any process that imports
  `torch._dynamo` (transformers does when it builds a model), and every process that one starts inherits it. A
  benchmark or a script that built a model and then started the stack gave its workers /tmp instead of JOBS_HOME
  (ops/bench/results/2026-12-05-h100-session38, `compile_cache.dir`); `use()` replaces that value.

`stats()` says what the cache did for a preparation: hits and misses of Inductor's FX graph cache since the process
started, in the load event and the job's engine record.
"""

from __future__ import annotations

import getpass
import os
import platform
import re
import tempfile
from pathlib import Path
from typing import Any

PACKAGES = ("torch", "triton", "transformers")


def folder(home: Path) -> Path:
    """JOBS_HOME/compile-cache/<torch, triton, transformers and Python versions>."""
    from importlib.metadata import PackageNotFoundError, version

    parts = []
    for name in PACKAGES:
        try:
            parts.append(f"{name}-{version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name}-none")
    parts.append(f"py-{platform.python_version()}")
    return home / "compile-cache" / re.sub(r"[^A-Za-z0-9._+-]", "_", "_".join(parts))


def use(home: Path) -> Path:
    """Point Inductor's and Triton's caches under `home` (unless the operator set them); returns the folder. Call
    before torch compiles anything (the worker calls it at start)."""
    where = folder(home)
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") == torch_default():  # inherited from torch, not an operator's
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(where / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(where / "triton"))
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent


def torch_default() -> str:
    """The folder Inductor uses when TORCHINDUCTOR_CACHE_DIR is unset, as torch computes it
    (torch/_inductor/runtime/cache_dir_utils.py `default_cache_dir`), without importing torch."""
    try:
        user = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        user = f"uid_{os.getuid()}" if hasattr(os, "getuid") else "unknown_user"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


def stats() -> dict[str, Any]:
    """Where the compiled code is kept and what Inductor's FX graph cache did in this process so far."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {
        "dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "hits": int(inductor.get("fxgraph_cache_hit", 0)),
        "misses": int(inductor.get("fxgraph_cache_miss", 0)),
    }
