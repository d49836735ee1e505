"""Exit codes of a worker process (`python -m worker.main`, `gpujobs worker`): the one place they are defined.

A supervisor (`gpujobs up`, systemd, Kubernetes) reads them to decide what to do; the worker also writes the code
and its reason into its registration (`workers.exit_code`, `workers.reason`) before it exits, so `gpujobs workers`
says why a worker is gone. These numbers are a contract with supervisors and users' scripts: never reuse one for
another meaning.

| code | name          | meaning                                                              | restart? |
| ---- | ------------- | -------------------------------------------------------------------- | -------- |
| 0    | OK            | stopped when asked (SIGTERM, `gpujobs down`); shard handed back       | no       |
| 1    | (Python)      | an unexpected crash (the traceback is in the worker's log)           | yes      |
| 5    | ENV_MISMATCH  | CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER contradict the slice         | no       |
| 6    | SLICE_MISSING | the slice's GPUs are not visible (no CUDA, or fewer devices)          | no       |
| 70   | STALLED       | no engine progress within the stall bound; the shard was handed back | yes      |

Why 70 for a stall: it is sysexits' EX_SOFTWARE (an internal error), far from the small codes of the CLI. A stalled
worker exits instead of going on: a CUDA context that hung once is not trusted again, and only a fresh process
gets a fresh one. Restart a stalled worker at once (with backoff if it stalls again). Codes 5 and 6 are start
refusals: the same command on the same host fails the same way, so restarting it only loops; fix the host or the
launcher. A process killed by a signal has no code of its own (the shell shows 128 + the signal: 137 for SIGKILL,
e.g. the kernel's out-of-memory killer); restart it.
"""

from __future__ import annotations

OK = 0
ENV_MISMATCH = 5
SLICE_MISSING = 6
STALLED = 70

MEANINGS = {
    OK: "stopped when asked",
    ENV_MISMATCH: "CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER contradict the worker's slice",
    SLICE_MISSING: "the GPUs of the worker's slice are not visible on this host",
    STALLED: "the engine made no progress within the stall bound; shard handed back",
}


def describe(code: int) -> str:
    """What an exit code of a worker means, in words (a signal's negative returncode included)."""
    if code < 0:
        return f"killed by signal {-code}"
    return MEANINGS.get(code, "crashed (see the worker's log)")


def restartable(code: int) -> bool:
    """Whether a supervisor should start the worker again after it exited with `code` (see the table above)."""
    return code not in (OK, ENV_MISMATCH, SLICE_MISSING)
