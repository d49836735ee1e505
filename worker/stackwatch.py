"""A worker of the local stack leaves when that stack is stopped.

A worker started by hand (`gpujobs worker`) beside `gpujobs up` uses the Redis that `up` started (its URL comes
from $JOBS_HOME/run/stack.json). After `gpujobs down` that Redis is gone for good, and Celery would retry it 100
times over about 45 minutes. Instead, a thread checks the stack every 2 s; when stack.json is gone, names another
Redis (a new stack), or the stack's Redis process has exited, the worker records why on its registration and
shuts down warm with exit status 69 (EX_UNAVAILABLE; the README's worker exit codes), within seconds.

Only a Redis that `up` started counts (stack.json has its pid): a worker of a cluster (JOBS_REDIS_URL of a Redis
nobody here owns) rides out Redis outages as before (tests/test_faults.py restarts Redis after 2 s and 10 s), and
Celery's own retry limit applies to it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from core import exits, registry
from core.db import session_scope
from core.settings import get_settings

log = logging.getLogger(__name__)
EXIT_STACK_GONE = exits.STACK_GONE
INTERVAL = 2.0


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


def watch(name: str) -> None:
    """Start the watch when this worker joined a local stack; nothing otherwise."""
    joined = joined_stack()
    if joined is not None:
        threading.Thread(target=_loop, args=(name, joined), name="stackwatch", daemon=True).start()


def _loop(name: str, joined: dict) -> None:
    stack_file = get_settings().stack_file
    while True:
        threading.Event().wait(INTERVAL)
        why = gone(joined, _read(stack_file))
        if why:
            leave(name, why)
            return


def leave(name: str, why: str) -> None:
    """Record why on the registration and ask Celery for a warm shutdown ending in EXIT_STACK_GONE."""
    from celery import signals
    from celery.worker import state

    reason = f"{why}: this worker exits ({EXIT_STACK_GONE}); start it again once a stack runs (`gpujobs up`)"
    log.error("%s: %s", name, reason)
    try:
        with session_scope() as session:
            registry.stopped(session, name, exit_code=EXIT_STACK_GONE, reason=reason)
    except Exception:  # noqa: BLE001 - the exit matters more than its record
        log.exception("could not record why %s leaves", name)
    # what Celery's own SIGTERM handler does: the runtime hands back a running shard, then the consumer stops
    signals.worker_shutting_down.send(sender=name, sig="stackwatch", how="Warm", exitcode=EXIT_STACK_GONE)
    state.should_stop = EXIT_STACK_GONE


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
