"""Test-only fault injection, so recovery paths run for real in CPU tests.

`JOBS_TEST_FAULTS` is a comma-separated list of `action@point`:

    kill@batch           SIGKILL this worker just before it commits a micro-batch
    oom_over_N@generate  raise torch.cuda.OutOfMemoryError when `model.generate` gets more than N rows at once
    oom@load             raise torch.cuda.OutOfMemoryError at that point (load: every model load, worker/loader.py)
    truncate@adapter_saved  cut the file at `path` to half its size (a fine-tune's adapter, before its check)
    sleep_S@train_step   sleep S seconds after each logged training step (slow training down for kill tests;
                         also at rankR_step)
    raise@rank1_step     raise RuntimeError at that point (rankR_step: each step's end in rank R of a distributed
                         fine-tune, worker/training/rank.py)
    exit_N@start         end this worker at once with exit status N just after it registered (os._exit: no
                         cleanup, as a crash or the stall watchdog would), e.g. exit_70@start, exit_6@start; for
                         the supervisor's restart policy (tests/test_supervisor.py)
    hang@decode_step     block the calling thread forever at that point, while the heartbeat thread goes on: the
    hang_after_N@POINT   stall the watchdog must catch (worker/progress.py). hang_after_N lets N hits pass first.
                         Points: decode_step (every decode step of every engine), prefill (a prefill chunk of the
                         fast engine), commit (each micro-batch's commit, on the committer's thread), train_step
                         (each logged training step), rankR_step.
    break_MODULE@POINT   make MODULE fail to import in this process from then on, and import it there (it raises
                         ModuleNotFoundError): the state a race of two threads' imports left a worker in (issue 27),
                         e.g. once_break_torch._dynamo@load (every model load) or once_break_peft@preload (a worker's
                         start-up imports, worker/preload.py)
    once_ACTION@POINT    ACTION in the first process of the stack (same JOBS_HOME) to reach it, and in no other:
                         e.g. once_hang_after_30@decode_step stalls one worker and not the one restarted after it

Unset (always, outside tests) it costs one dict lookup per call.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import threading
from functools import cache

log = logging.getLogger(__name__)
_hits: collections.Counter[str] = collections.Counter()


@cache
def _faults() -> frozenset[str]:
    return frozenset(f.strip() for f in os.environ.get("JOBS_TEST_FAULTS", "").split(",") if f.strip())


def hit(point: str, *, rows: int = 0, path=None) -> None:
    faults = _faults()
    if not faults:
        return
    for fault in faults:
        action, _, where = fault.partition("@")
        if where != point:
            continue
        once = action.startswith("once_")
        action = action.removeprefix("once_")
        if once and not _first(fault, action):
            continue
        if action == "raise":
            raise RuntimeError(f"injected failure (JOBS_TEST_FAULTS {fault})")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if action.startswith("break_"):
            _break(action.removeprefix("break_"))
        if action.startswith("exit_"):
            os._exit(int(action.removeprefix("exit_")))
        if action == "truncate" and path is not None:
            os.truncate(path, os.path.getsize(path) // 2)
        if action.startswith("sleep_"):
            import time

            time.sleep(float(action.removeprefix("sleep_")))
        if action == "hang" or action.startswith("hang_after_"):
            _hang(fault, int(action.removeprefix("hang_after_")) if action != "hang" else 0)
        if action == "oom" or (action.startswith("oom_over_") and rows > int(action.removeprefix("oom_over_"))):
            import torch

            raise torch.OutOfMemoryError(f"CUDA out of memory (injected by JOBS_TEST_FAULTS at {point}, {rows} rows)")


def _break(module: str) -> None:
    """Every later import of `module` in this process fails (None in sys.modules), and so does this one."""
    import importlib
    import sys

    log.warning("JOBS_TEST_FAULTS: %s no longer imports in this process", module)
    sys.modules[module] = None
    importlib.import_module(module)


def _first(fault: str, action: str) -> bool:
    """Whether this process is the first of its stack to fire `fault` (a marker file under JOBS_HOME, created
    once). A hang_after_N counts its own hits first: only the hit that would block claims the marker."""
    if action.startswith("hang_after_") and _hits[fault] + 1 <= int(action.removeprefix("hang_after_")):
        return True  # not firing yet: _hang counts the hit
    from core.settings import get_settings

    marker = get_settings().home / f"fault-fired-{fault.replace('@', '-at-')}"
    marker.parent.mkdir(parents=True, exist_ok=True)  # a fault at start-up may come before anything made it
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def _hang(fault: str, after: int) -> None:
    _hits[fault] += 1
    if _hits[fault] <= after:
        return
    log.warning(
        "JOBS_TEST_FAULTS %s: hit %d, blocking this thread (%s) forever",
        fault,
        _hits[fault],
        threading.current_thread().name,
    )
    threading.Event().wait()
