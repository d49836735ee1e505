"""A worker process's heavy imports: all of them once, in the main thread, before any other thread starts; and the
check that they are still whole.

Why (issue 27): torch._dynamo and torch._inductor import each other, and bitsandbytes, transformers' modeling code
and Trainer (through torchao), and Inductor's cache folder all start one of them. When two threads start them at
about the same time (the QLoRA probe importing bitsandbytes, the flex_attention probe reading Inductor's cache
folder, a task loading a model), each waits on a module lock the other holds; CPython breaks that deadlock by
handing one thread a half-imported module, its import fails, and what it leaves in sys.modules makes every later
import of transformers' modeling code or Trainer fail in that process. Such a worker stayed online and failed every
attempt of every shard it took within a second. Once everything is imported in one thread, a later `import` of
these modules is a dictionary lookup: nothing is left to race.

The start-up order (worker/main.py runs it; each step ends before the next begins):

1. main thread: settings, the environment and slice checks, the broker's credentials (worker/broker.py: one
   connection; refused, the worker exits 77), the artifacts directory (core/artifacts.py: not the store's, the
   worker exits 78), then `preload()`: REQUIRED, then OPTIONAL (where installed), then
   `check()`, then on a GPU host what Inductor's first compile would otherwise do in the first job: the source
   hashes its caches are keyed by (`hash_sources`), its code generators' registration and the modules it imports
   lazily (`import_compiler`). A failure ends the process at once (`Broken`): its registration says why and it
   exits with exits.BROKEN (72); a supervisor starts a fresh one.
2. main thread: the Hugging Face cache scan, then the models thread (worker/hubfetch.py); the QLoRA probe
   (bitsandbytes is imported: one small 4-bit matmul) and the registration; then the heartbeat and the
   flex_attention probe's thread (worker/runtime.py; the compile runs in a child process) and the stack watch.
   What these threads import, step 1 imported.
3. Celery's solo pool in the main thread: tasks run there, and so do imports first made at job time (a model's own
   modeling file, kernels, what a compile loads): in one thread, while the others import nothing. A generation
   shard's committer thread (worker/committer.py) calls only what step 1 imported.

A thread added to a worker must keep to this: import its heavy modules here (REQUIRED or OPTIONAL), never from its
own thread. tests/test_preload.py runs a worker under an import hook that makes any two threads' imports of
torch._dynamo and torch._inductor race (tests/importrace.py).

At job time, a shard that fails while `check()` finds these modules no longer import is the worker's fault, not the
job's: worker/runtime.py gives the shard back without counting the attempt and exits 72 (core/leases.py
`give_back_broken`).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from worker import faults

log = logging.getLogger(__name__)

# what a worker needs to run any job: generation and fine-tunes (their engines import these at job time)
REQUIRED = (
    "torch",
    "torch._dynamo",
    "torch._inductor.runtime.cache_dir_utils",  # the flex_attention probe's thread reads Inductor's cache folder
    # the fast engine's torch.compile(backend="inductor") imports it: 2.1 s of a restarted worker's first job on the
    # H200 (ops/bench/results/2026-12-05-h200-restart), paid here, at start-up, instead
    "torch._inductor.compile_fx",
    "transformers",
    "transformers.modeling_utils",  # with transformers' quantizers (and torchao where installed)
    "peft",
    "transformers.trainer",
    "httpx",  # the models thread's downloads (core/hub_download.py)
    "worker.loader",
    "worker.generate",
    "worker.training.finetune",
    "worker.training.setup",
    "worker.training.distributed",
    "worker.runtime",
)
# imported where installed; one that fails is what the probe that needs it reports (QLoRA: bitsandbytes)
OPTIONAL = ("bitsandbytes", "filelock")
# what the fast engine's first compile imports lazily, in the job: ~1 s of a restarted worker's first job on an H100
# (py-spy, ops/bench/results/2026-12-05-h100-session37); on a GPU host only (`import_compiler`), as nothing compiles
# with Inductor on a CPU host
COMPILE_IMPORTS = (
    "triton.experimental.gluon",  # Triton's kernel launcher, at a kernel's first launch
    "torch.distributed.tensor.experimental._func_map",  # Dynamo's local_map check
    "torch.export._trace",  # symbolic_shapes.uninteresting_files
    "torch._inductor.fx_passes.quantization",  # Inductor's pre-grad passes
    "torch._inductor.fx_passes.numeric_utils",
    "sympy.tensor.tensor",  # sympy's Add.flatten, at the first symbolic shape
)


class Broken(Exception):
    """This process cannot import its engine or training code (a fresh process may)."""


def preload() -> None:
    """Import REQUIRED and, where installed, OPTIONAL, in this thread (call it before starting any other); raise
    Broken naming the first module that does not import."""
    try:
        faults.hit("preload")  # test-only (worker/faults.py): break_MODULE@preload fails MODULE's import here
    except ImportError as exc:
        raise Broken(_cannot(exc.name, exc)) from exc
    for name in REQUIRED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  any error while importing: this process cannot run jobs
            raise Broken(_cannot(name, exc)) from exc
    for name in OPTIONAL:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  an optional backend: its probe says what it cannot do
            log.warning("optional %s", _cannot(name, exc))
    cause = check()
    if cause is not None:
        raise Broken(f"{cause} (after importing {', '.join(OPTIONAL)})")
    hash_sources()
    import_compiler()


def hash_sources() -> None:
    """On a GPU host, the hashes of torch's and Triton's sources that Inductor keys its caches by, computed now and
    kept for the process, instead of by the first job's first compile (Triton's took 0.45 s of a restarted worker's
    first job on the H200, 0.84 s on an H100: ops/bench/results/2026-12-05-h200-restart, -h100-session38). Not on a
    CPU host: the engines compile nothing with Inductor there. A failure is the first compile's to report, not the
    start-up's.

    Triton's hash is taken by Triton's own function, which keeps it (lru_cache) and which every torch version's
    `CacheBase.get_system` ends in; torch 2.11 has no `codecache.triton_key` (2.12 added it, with a cache of its
    own), so asking only for that failed on the GPU host until 2026-12-05."""
    import torch

    if not torch.cuda.is_available():
        return
    try:
        from torch._inductor import codecache
        from torch._inductor.runtime import triton_compat

        codecache.torch_key()
        triton_compat.triton_key()
        if hasattr(codecache, "triton_key"):
            codecache.triton_key()
    except Exception as exc:  # noqa: BLE001
        log.warning("hashing torch's and Triton's sources at start-up failed: %s: %s", type(exc).__name__, exc)


def import_compiler() -> None:
    """On a GPU host, Inductor's code generators registered and COMPILE_IMPORTS imported now, instead of by the first
    job's first compile. Not on a CPU host, for the reason `hash_sources` gives. A failure is the first compile's to
    report, not the start-up's."""
    import torch

    if not torch.cuda.is_available():
        return
    try:
        from torch._inductor.codegen.common import init_backend_registration

        init_backend_registration()
    except Exception as exc:  # noqa: BLE001
        log.warning("registering Inductor's code generators at start-up failed: %s: %s", type(exc).__name__, exc)
    for name in COMPILE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  the compile that needs it imports it again and reports it
            log.warning("importing %s at start-up failed: %s: %s", name, type(exc).__name__, exc)


def check() -> str | None:
    """None while every REQUIRED module imports (after `preload`, a dictionary lookup each) and none is half
    imported; else what fails, in one line."""
    for name in REQUIRED:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001
            return _cannot(name, exc)
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            return f"this process cannot import {name}: it is left half imported"
    return None


def _cannot(name: str, exc: BaseException) -> str:
    message = " ".join(str(exc).split())[:300]
    return f"this process cannot import {name}: {type(exc).__name__}: {message}"
