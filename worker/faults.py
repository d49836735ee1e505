"""Test-only fault injection, so recovery paths run for real in CPU tests.

`JOBS_TEST_FAULTS` is a comma-separated list of `action@point`:

    kill@batch   SIGKILL this worker just before it commits a micro-batch
    oom@batch    raise torch.cuda.OutOfMemoryError where the engine runs a micro-batch

Unset (always, outside tests) it costs one dict lookup per call.
"""

from __future__ import annotations

import os
import signal
from functools import cache


@cache
def _faults() -> frozenset[str]:
    return frozenset(f.strip() for f in os.environ.get("JOBS_TEST_FAULTS", "").split(",") if f.strip())


def hit(point: str) -> None:
    faults = _faults()
    if not faults:
        return
    if f"kill@{point}" in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if f"oom@{point}" in faults:
        import torch

        raise torch.cuda.OutOfMemoryError(f"injected by JOBS_TEST_FAULTS at {point}")
