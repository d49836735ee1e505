"""Celery tasks: thin. They pass ids to the runtime; everything else is plain functions."""

from __future__ import annotations

from core.queue import TASK_RUN_SHARD, get_app

app = get_app()
runtime = None  # set by worker.main before the Celery worker starts


@app.task(name=TASK_RUN_SHARD, acks_late=True, reject_on_worker_lost=True, ignore_result=True)
def run_shard(shard_id: int) -> None:
    runtime.run_shard(int(shard_id))
