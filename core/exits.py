"""Exit codes of a worker process (`python -m worker.main`, `gpujobs worker`): the one place they are defined.

A supervisor (`gpujobs up`, systemd, Kubernetes) reads them to decide what to do; the worker also writes the code
and its reason into its registration (`workers.exit_code`, `workers.reason`) before it exits, so `gpujobs workers`
says why a worker is gone. These numbers are a contract with supervisors and users' scripts: never reuse one for
another meaning.

| code | name            | meaning                                                              | restart? |
| ---- | --------------- | -------------------------------------------------------------------- | -------- |
| 0    | OK              | stopped when asked (SIGTERM, `gpujobs down`); shard handed back       | no (a)   |
| 1    | (Python)        | an unexpected crash (the traceback is in the worker's log)           | yes      |
| 2    | USAGE           | a bad command line (argparse)                                        | no       |
| 5    | ENV_MISMATCH    | CUDA_VISIBLE_DEVICES / CUDA_DEVICE_ORDER contradict the slice         | no       |
| 6    | SLICE_MISSING   | the slice's GPUs are not visible (no CUDA, or fewer devices)          | no       |
| 69   | STACK_GONE      | its local stack was stopped (`gpujobs down`: its Redis is gone)       | yes (b)  |
| 70   | STALLED         | no engine progress within the stall bound; the shard was handed back | yes      |
| 72   | BROKEN          | its engine or training code does not import in this process; the     | yes      |
|      |                 | shard it held was handed back without counting the attempt           |          |
| 77   | BROKER_REFUSED  | Redis refused the credentials of JOBS_REDIS_URL (a wrong password or | no       |
|      |                 | user, or none for a Redis that requires one): worker/broker.py       |          |
| 78   | WRONG_ARTIFACTS | its JOBS_ARTIFACTS is not the store's artifacts directory (core/     | no       |
|      |                 | artifacts.py): no marker, another store's, or another directory's    |          |

(a) `gpujobs up`'s supervisor restarts a worker that exited 0 without being asked to stop.
(b) under `gpujobs up` the whole stack stops with it (api/supervisor.py).

Why 70 for a stall: it is sysexits' EX_SOFTWARE (an internal error), far from the small codes of the CLI. A stalled
worker exits instead of going on: a CUDA context that hung once is not trusted again, and only a fresh process gets
a fresh one. Restart a stalled worker at once (with backoff if it stalls again). 69 is sysexits' EX_UNAVAILABLE. 72
(sysexits' EX_OSFILE: a file the program needs is missing or broken) is a process that cannot import its engine or
training code (worker/preload.py): at start-up, or at job time when a shard failed and the modules no longer import
(issue 27: two threads' imports raced and left sys.modules broken). The worker's fault, not the job's: the shard
goes back without counting the attempt, and a fresh process usually imports them whole (an install that is broken
for good exits 72 at every start, and the restart cap keeps its slot down). 77 is sysexits' EX_NOPERM: Redis
answered and refused this worker's credentials, at start-up or at a reconnect (its password changed meanwhile);
neither waiting nor a restart with the same JOBS_REDIS_URL fixes that (a Redis that is down or unreachable is not
this: Celery retries it, then 1). 78 (sysexits' EX_CONFIG) is a worker whose artifacts directory is not the one its
store's other processes use (the setting left unset, a mount missing): it would read no stored input and keep its
fine-tunes' checkpoints and adapters where nobody else sees them. Codes 2, 5, 6, 77 and 78 are configuration
errors: the same command on the same host fails the same way, so restarting it only loops; fix the host, the
launcher, JOBS_REDIS_URL or JOBS_ARTIFACTS. A process killed by a signal has no code of its own (the shell shows
128 + the signal: 137 for SIGKILL, e.g. the kernel's out-of-memory killer); restart it.
"""

from __future__ import annotations

OK = 0
CRASHED = 1
USAGE = 2
ENV_MISMATCH = 5
SLICE_MISSING = 6
STACK_GONE = 69
STALLED = 70
BROKEN = 72
BROKER_REFUSED = 77
WRONG_ARTIFACTS = 78

MEANINGS = {
    OK: "stopped",
    CRASHED: "crashed: see its log",
    USAGE: "bad command line",
    ENV_MISMATCH: "CUDA_VISIBLE_DEVICES contradicts its slice",
    SLICE_MISSING: "its GPU slice is not present",
    STACK_GONE: "its stack's Redis is gone",
    STALLED: "engine stalled",
    BROKEN: "its engine or training code does not import",
    BROKER_REFUSED: "Redis refused its password: fix JOBS_REDIS_URL",
    WRONG_ARTIFACTS: "its JOBS_ARTIFACTS is not the store's artifacts directory",
}
# restarting cannot fix these
CONFIGURATION = frozenset({USAGE, ENV_MISMATCH, SLICE_MISSING, BROKER_REFUSED, WRONG_ARTIFACTS})


def describe(code: int) -> str:
    """'killed by SIGKILL', 'engine stalled', ... for a worker's exit status (negative: the signal that ended it)."""
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return MEANINGS.get(code, "see its log")


def restartable(code: int) -> bool:
    """Whether a supervisor should start the worker again after it exited with `code` (the table above; a
    supervisor that did not ask for a stop restarts a worker that exited 0 too)."""
    return code != OK and code not in CONFIGURATION
