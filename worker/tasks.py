"""Celery tasks: thin. They pass ids to the runtime; everything else is plain functions.

The runtime is this process's one `worker.runtime.Runtime`, handed over by worker/main.py (`use`) before Celery
starts; a task reaches it through `current()`, which says what is wrong when a task runs in a process that has none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.errors import ServiceUnavailable
from core.queue import TASK_RUN_SHARD, get_app

if TYPE_CHECKING:
    from worker.runtime import Runtime

app = get_app()
_runtime: Runtime | None = None


def use(runtime: Runtime) -> None:
    """Make `runtime` the one this process's tasks run on (worker/main.py, at start)."""
    global _runtime
    _runtime = runtime


def current() -> Runtime:
    if _runtime is None:
        raise RuntimeError(
            "no worker runtime in this process: tasks run in a worker started by `python -m "
            "worker.main` (gpujobs worker)"
        )
    return _runtime


@app.task(name=TASK_RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_shard(self, shard_id: int) -> None:
    try:
        current().run_shard(int(shard_id))
    except ServiceUnavailable as exc:
        # The database (or Redis) is down: the message must outlive the outage, or a queued shard would wait for a
        # message that was consumed and acknowledged. Send it again later; a claim is idempotent.
        raise self.retry(exc=exc, countdown=5, max_retries=None) from exc
