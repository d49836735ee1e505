"""The worker registry: what each live worker is, holds and can run, renewed by its heartbeat."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.models import Worker
from core.store import now


def register(session: Session, *, name: str, host: str, pid: int, slice: str, queues: list[str],
             gpus: list[dict[str, Any]], capabilities: dict[str, Any]) -> None:
    t = now()
    worker = session.get(Worker, name) or Worker(name=name, started_at=t)
    worker.host, worker.pid, worker.slice, worker.queues = host, pid, slice, queues
    worker.gpus, worker.capabilities = gpus, capabilities
    worker.state, worker.started_at, worker.heartbeat_at, worker.current_shard_id = "online", t, t, None
    session.merge(worker)


def heartbeat(session: Session, name: str, *, current_shard_id: int | None, extra: dict[str, Any] | None = None) -> None:
    values: dict[str, Any] = {"heartbeat_at": now(), "state": "online", "current_shard_id": current_shard_id}
    session.execute(update(Worker).where(Worker.name == name).values(**values))
    if extra:
        worker = session.get(Worker, name)
        if worker is not None:
            worker.capabilities = {**worker.capabilities, **extra}


def stopped(session: Session, name: str) -> None:
    session.execute(update(Worker).where(Worker.name == name).values(state="offline", current_shard_id=None))


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
