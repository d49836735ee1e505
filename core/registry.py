"""The worker registry: what each live worker is, holds and can run, renewed by its heartbeat."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.models import Worker
from core.store import now


def register(session: Session, *, name: str, host: str, pid: int, slice: str, queues: list[str],
             gpus: list[dict[str, Any]], capabilities: dict[str, Any], restarts: int = 0) -> None:
    t = now()
    worker = session.get(Worker, name) or Worker(name=name, started_at=t)
    worker.host, worker.pid, worker.slice, worker.queues = host, pid, slice, queues
    worker.gpus, worker.capabilities = gpus, capabilities
    worker.state, worker.started_at, worker.heartbeat_at, worker.current_shard_id = "online", t, t, None
    worker.stopped_at, worker.exit_code, worker.reason, worker.restarts = None, None, None, restarts
    session.merge(worker)


def heartbeat(session: Session, name: str, *, current_shard_id: int | None, extra: dict[str, Any] | None = None) -> None:
    values: dict[str, Any] = {"heartbeat_at": now(), "state": "online", "current_shard_id": current_shard_id}
    session.execute(update(Worker).where(Worker.name == name).values(**values))
    if extra:  # merged under a row lock (Postgres): the heartbeat and the QLoRA probe both merge into capabilities
        worker = session.get(Worker, name, with_for_update=True, populate_existing=True)
        if worker is not None:
            worker.capabilities = {**worker.capabilities, **extra}


def stopped(session: Session, name: str, *, exit_code: int | None = None, reason: str | None = None) -> None:
    """The worker `name` ended (cleanly when exit_code is None or 0); `reason` says why when it was not asked to."""
    values: dict[str, Any] = {"state": "offline", "current_shard_id": None, "stopped_at": now()}
    if exit_code is not None:
        values["exit_code"] = exit_code
    if reason is not None:
        values["reason"] = reason
    session.execute(update(Worker).where(Worker.name == name).values(**values))


def exited(session: Session, *, host: str, pid: int, exit_code: int, reason: str | None) -> None:
    """What a supervisor saw: the worker process `pid` on `host` exited with `exit_code`. Keeps a reason the worker
    wrote itself on its way out (a stall, a missing slice), and the moment it stopped."""
    worker = session.scalars(select(Worker).where(Worker.host == host, Worker.pid == pid)
                             .order_by(Worker.started_at.desc())).first()
    if worker is None:
        return
    worker.state, worker.current_shard_id, worker.exit_code = "offline", None, exit_code
    worker.stopped_at = worker.stopped_at or now()
    worker.reason = worker.reason or reason


def live(session: Session, timeout: float) -> list[Worker]:
    stmt = select(Worker).where(Worker.state == "online", Worker.heartbeat_at > now() - timeout).order_by(Worker.name)
    return list(session.scalars(stmt).all())


def all_workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.name)).all())


def mark_lost(session: Session, timeout: float) -> None:
    stmt = update(Worker).where(Worker.state == "online", Worker.heartbeat_at < now() - timeout).values(state="lost")
    session.execute(stmt)


def slice_size(worker: Worker) -> int:
    return len([d for d in worker.slice.split(",") if d])


def can_serve(worker: Worker, gpus: int) -> bool:
    """A worker serves the queue of its own slice size, and only if it really sees that many GPUs."""
    if gpus == 0:
        return "cpu" in worker.queues
    return f"gpu{gpus}" in worker.queues and worker.capabilities.get("device_count", 0) >= gpus
