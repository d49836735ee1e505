"""Celery tasks: thin. They pass ids to the runtime; everything else is plain functions."""

from __future__ import annotations

from core.errors import ServiceUnavailable
from core.queue import TASK_RUN_SHARD, get_app

app = get_app()
runtime = None  # set by worker.main before the Celery worker starts


@app.task(name=TASK_RUN_SHARD, bind=True, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_shard(self, shard_id: int) -> None:
    try:
        runtime.run_shard(int(shard_id))
    except ServiceUnavailable as exc:
        # The database (or Redis) is down: the message must outlive the outage, or a queued shard would wait for a
        # message that was consumed and acknowledged. Send it again later; a claim is idempotent.
        raise self.retry(exc=exc, countdown=5, max_retries=None) from exc
