"""A worker of the local stack leaves when that stack is stopped.

A worker started by hand (`gpujobs worker`) beside `gpujobs up` uses the Redis that `up` started (its URL comes
from $JOBS_HOME/run/stack.json). After `gpujobs down` that Redis (and the API) are gone for good, and Celery would
retry it 100 times over about 45 minutes. Instead, a thread checks the stack every 2 s; when stack.json is gone,
names another Redis (a new stack), or the stack's Redis process has exited, the worker:

1. logs one line at ERROR and records it on its registration (offline, exit code 69 and the reason);
2. shuts down warm, as on SIGTERM: the engine stops at its next step (a decode step, a micro-batch, a training
   step) and the shard is handed back without counting an attempt (rows already committed stay; the store is the
   stack's SQLite file, which `down` leaves in place); its message died with Redis, so the shard stays queued,
   unsent, until the reaper of the next stack sends it;
3. exits with status 69 (EX_UNAVAILABLE; core/exits.py), with a last line `worker NAME exits with code 69 (...)`.

If the process has not ended LEAVE_GRACE_S after that (an engine step or a model load that takes longer, or a
call into the gone broker that never returns), this thread hands the shard back itself and ends the process with
69: the engine's later commits would find the lease gone and write nothing, so nothing runs twice.

Only a Redis that `up` started counts (stack.json has its pid): a worker of a cluster (JOBS_REDIS_URL of a Redis
nobody here owns) rides out Redis outages as before (tests/test_faults.py restarts Redis after 2 s and 10 s), and
Celery's own retry limit applies to it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from core import exits, registry
from core.db import session_scope
from core.settings import get_settings

log = logging.getLogger(__name__)
EXIT_STACK_GONE = exits.STACK_GONE
INTERVAL = 2.0
LEAVE_GRACE_S = 30.0  # the warm shutdown's time to stop the engine and hand back; then this thread does it


def joined_stack() -> dict | None:
    """The local stack whose Redis this worker uses, when `gpujobs up` started that Redis; else None."""
    stack = _read(get_settings().stack_file)
    if stack.get("redis") and stack.get("redis_url") == get_settings().redis_url:
        return stack
    return None


def gone(joined: dict, now: dict) -> str | None:
    """Why the stack this worker joined is gone (`now`: stack.json as it is, {} when removed), or None."""
    if not now:
        return f"the local stack in {joined.get('home')} was stopped (`gpujobs down`)"
    if now.get("redis_url") != joined.get("redis_url"):
        return f"the local stack in {joined.get('home')} was stopped and another one started (its Redis moved)"
    if not _alive(joined["redis"]):
        return (
            f"the local stack in {joined.get('home')} is stopping or stopped: its Redis (pid {joined['redis']}) exited"
        )
    return None


def watch(name: str, hand_back: Callable[[str], None]) -> None:
    """Start the watch when this worker joined a local stack; nothing otherwise. `hand_back(reason)` gives back the
    shard the worker holds, if any (the last resort of `leave`)."""
    joined = joined_stack()
    if joined is not None:
        threading.Thread(target=_loop, args=(name, joined, hand_back), name="stackwatch", daemon=True).start()


def _loop(name: str, joined: dict, hand_back: Callable[[str], None]) -> None:
    stack_file = get_settings().stack_file
    while True:
        threading.Event().wait(INTERVAL)
        why = gone(joined, _read(stack_file))
        if why:
            leave(name, why, hand_back)
            return


def leave(name: str, why: str, hand_back: Callable[[str], None], grace: float = LEAVE_GRACE_S) -> None:
    """Record why on the registration and ask Celery for a warm shutdown ending in EXIT_STACK_GONE; past `grace`,
    hand the shard back from here and end the process."""
    from celery import signals
    from celery.worker import state

    reason = f"{why}: this worker exits ({EXIT_STACK_GONE}); start it again once a stack runs (`gpujobs up`)"
    log.error("%s: %s", name, reason)
    try:
        with session_scope() as session:
            registry.stopped(session, name, exit_code=EXIT_STACK_GONE, reason=reason)
    except Exception:  # noqa: BLE001 - the exit matters more than its record
        log.exception("could not record why %s leaves", name)
    last_resort = threading.Timer(grace, _exit_now, [name, grace, hand_back])
    last_resort.daemon = True
    last_resort.start()
    # what Celery's own SIGTERM handler does: the runtime hands back a running shard, then the consumer stops
    signals.worker_shutting_down.send(sender=name, sig="stackwatch", how="Warm", exitcode=EXIT_STACK_GONE)
    state.should_stop = EXIT_STACK_GONE


def _exit_now(name: str, grace: float, hand_back: Callable[[str], None]) -> None:
    """The warm shutdown did not end within `grace`: hand the shard back (the engine may still be in a step; its
    next commit finds the lease gone) and end the process with EXIT_STACK_GONE, skipping Python's cleanup."""
    log.error(
        "%s: still running %.0f s after its stack went away: handing back its shard and exiting (%d) now",
        name,
        grace,
        EXIT_STACK_GONE,
    )
    try:
        hand_back(f"worker stopping: its local stack was stopped, and it did not stop within {grace:.0f} s")
    except Exception:  # noqa: BLE001 - the lease, no longer renewed, expires and a reaper re-queues the shard
        log.exception("%s could not hand back its shard: its lease expires and the reaper re-queues it", name)
    log.info("worker %s exits with code %d (%s)", name, EXIT_STACK_GONE, exits.describe(EXIT_STACK_GONE))
    for stream in [*(getattr(h, "stream", None) for h in logging.getLogger().handlers), sys.stdout, sys.stderr]:
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - no stream, or one that cannot flush now: exit anyway
            pass
    os._exit(EXIT_STACK_GONE)


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True
