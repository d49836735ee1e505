"""What a worker imports before it takes work, in one thread, and how it tells a broken process from a bad job.

The order (`Runtime.start_heartbeat` starts the thread; `Runtime.run_shard` waits for `ready`):

1. `import_heavy()`: the packages whose imports reach deep into torch (IMPORTS: torch's compiler stack, the
   quantization packages, transformers' model code), in this thread, one after another.
2. The QLoRA probe (bitsandbytes 4-bit on the worker's device), still in this thread.
3. `ready` is set: from here on the runner takes shards.
4. The flex_attention probe (on CPU a compile in a child process, which this thread only waits for).

Why: when two threads import a package that imports itself in a circle, CPython breaks the would-be deadlock by
handing one of them the partially initialized module. That import fails ("partially initialized module
'torch._dynamo' has no attribute 'utils'", "cannot import name 'IndentedBuffer' from partially initialized module
'torch._inductor.utils'"), and what it left in sys.modules breaks every later import of that code in the process.
A worker used to start its two probes in two threads while its first task imported the training code: both probes
and the fine-tune's `Trainer` import went through torch._dynamo at once (issue 27; two threads importing
torch._dynamo and bitsandbytes on a barrier failed 5 times out of 5 on the CI's torch). Now one thread imports
everything the probes and a job's first steps reach, and nothing else imports until it is done.

A job's own code (`import_for`) is imported when its shard is claimed. An import that fails there although its
package is installed is the process's fault, not the job's: `BrokenImport`; the runner hands the shard back without
counting the attempt and the worker leaves with `core.exits.BROKEN` for its supervisor to start a fresh process. A
package that is not installed at all is the job's problem on this host (InvalidInput: it names what to install).
"""

from __future__ import annotations

import importlib
import importlib.util
import logging

from core.errors import InvalidInput
from worker import faults

log = logging.getLogger(__name__)

# imported by import_heavy, in this order; a package that is not installed is skipped
IMPORTS = (
    "torch",
    "torch._dynamo",
    "torch._inductor.utils",
    "torch._inductor.runtime.cache_dir_utils",  # the flex_attention probe's marker
    "bitsandbytes",  # the QLoRA probe
    "torchao",  # transformers' quantizers import it when it is installed
    "transformers.modeling_utils",
)
# what a job of each kind imports first (`import_for`): modules, or (module, attribute) for transformers' lazy names
JOB_IMPORTS: dict[str, tuple] = {
    "generate": (("transformers", "AutoModelForCausalLM"), ("transformers", "AutoTokenizer"), "worker.generate"),
    "finetune": (
        ("transformers", "AutoModelForCausalLM"),
        ("transformers", "Trainer"),
        ("transformers", "TrainingArguments"),
        "peft",
        "worker.finetune",
        "worker.distributed",
    ),
}


class BrokenImport(Exception):
    """Code this process needs cannot be imported although its package is installed: the process is broken."""


def broken(exc: BaseException) -> bool:
    """Whether `exc` says this process's modules are broken (a partially initialized module left behind by a
    circular import), rather than a package being absent or unusable on this host."""
    text = str(exc)
    return isinstance(exc, ImportError | AttributeError) and (
        "partially initialized module" in text or "circular import" in text
    )


def import_heavy() -> str | None:
    """Import IMPORTS in this thread. Returns why the process is broken (see `broken`), or None. Any other failure
    of an optional package (bitsandbytes without its CUDA library, say) is logged and left to its probe."""
    for name in IMPORTS:
        if importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  any import may fail; only a broken process stops the worker
            if broken(exc):
                return f"importing {name} left a broken module: {type(exc).__name__}: {exc}"
            log.warning(
                "importing %s failed (its features stay off on this worker): %s: %s", name, type(exc).__name__, exc
            )
    return None


def import_for(kind: str) -> None:
    """Import what a job of `kind` runs. Raises BrokenImport when an installed package fails to import (the
    process's fault), InvalidInput when a package is not installed on this worker."""
    for item in JOB_IMPORTS[kind]:
        module, attribute = item if isinstance(item, tuple) else (item, None)
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None:
            raise InvalidInput(f"{top} is not installed on this worker: install it there (pip install {top})")
        try:
            faults.hit("import")
            loaded = importlib.import_module(module)
            if attribute is not None:
                getattr(loaded, attribute)  # transformers resolves its lazy names here
        except Exception as exc:  # noqa: BLE001  an installed package that does not import: a broken process
            where = f"{module}.{attribute}" if attribute else module
            raise BrokenImport(f"cannot import {where}: {type(exc).__name__}: {exc}") from exc
