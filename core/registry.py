"""The worker registry: what each live worker is, holds and can run, renewed by its heartbeat.

One state vocabulary everywhere (CLI, dashboard, API, /metrics), from `state_of`:

    online   registered and beating
    lost     registered, no heartbeat for JOBS_WORKER_TIMEOUT seconds and no record of stopping (killed, host down)
    offline  stopped: by itself (with a reason when it was not asked to) or seen exiting by its supervisor

A stopped worker keeps its exit code, reason and stop time; `restarts` counts its slot's restarts before it.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.models import Worker
from core.slices import parse_slice
from core.store import now


def register(
    session: Session,
    *,
    name: str,
    host: str,
    pid: int,
    slice: str,
    queues: list[str],
    gpus: list[dict[str, Any]],
    capabilities: dict[str, Any],
    restarts: int = 0,
) -> None:
    t = now()
    worker = session.get(Worker, name) or Worker(name=name, started_at=t)
    worker.host, worker.pid, worker.slice, worker.queues = host, pid, slice, queues
    worker.gpus, worker.capabilities = gpus, capabilities
    worker.state, worker.started_at, worker.heartbeat_at, worker.current_shard_id = "online", t, t, None
    worker.stopped_at, worker.exit_code, worker.reason, worker.restarts = None, None, None, restarts
    session.merge(worker)


def heartbeat(
    session: Session, name: str, *, current_shard_id: int | None, extra: dict[str, Any] | None = None
) -> None:
    """The worker `name` is alive (and holds `current_shard_id`). A worker that recorded its stop (it is on its way
    out: its stack went away, it stalled) stays offline with its reason: a beat of its heartbeat thread in the
    seconds before the process ends must not mark it online again."""
    values: dict[str, Any] = {"heartbeat_at": now(), "state": "online", "current_shard_id": current_shard_id}
    beat = session.execute(update(Worker).where(Worker.name == name, Worker.stopped_at.is_(None)).values(**values))
    if (
        extra and beat.rowcount
    ):  # merged under a row lock (Postgres): the heartbeat and the QLoRA probe both merge into capabilities
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


def exited(
    session: Session, *, host: str, pid: int, exit_code: int, reason: str | None, outcome: str | None = None
) -> None:
    """What a supervisor saw: the worker process `pid` on `host` exited with `exit_code`. Keeps a reason the worker
    wrote itself on its way out (a stall, a missing slice), and the moment it stopped; `outcome` (what the
    supervisor does about it, e.g. "stays down: ...") is added after the reason."""
    worker = find(session, host=host, pid=pid)
    if worker is None:
        return
    worker.state, worker.current_shard_id, worker.exit_code = "offline", None, exit_code
    worker.stopped_at = worker.stopped_at or now()
    worker.reason = "; ".join(r for r in (worker.reason or reason, outcome) if r) or None


def find(session: Session, *, host: str, pid: int) -> Worker | None:
    """The latest registration of process `pid` on `host`, if it registered."""
    return session.scalars(
        select(Worker).where(Worker.host == host, Worker.pid == pid).order_by(Worker.started_at.desc())
    ).first()


def default_name(pid: int, devices: list[str], host: str) -> str:
    """A worker's name unless it is given one: w<pid>-<gpu0-1|cpu>@<host> (worker/main.py spells it the same)."""
    return f"w{pid}-{'gpu' + '-'.join(devices) if devices else 'cpu'}@{host}"


def never_registered(
    session: Session, *, host: str, pid: int, slice: str, exit_code: int, reason: str, restarts: int
) -> None:
    """A supervised worker that exited before it registered (bad arguments, a GPU conflict, an import error): an
    offline row under its default name, so `gpujobs workers` still says why its slot is down."""
    t = now()
    devices = parse_slice(slice)
    session.merge(
        Worker(
            name=default_name(pid, devices, host),
            host=host,
            pid=pid,
            slice=slice,
            queues=[],
            gpus=[],
            capabilities={},
            state="offline",
            started_at=t,
            heartbeat_at=t,
            current_shard_id=None,
            stopped_at=t,
            exit_code=exit_code,
            reason=reason,
            restarts=restarts,
        )
    )


def state_of(worker: Worker, t: float, timeout: float) -> str:
    """online, lost or offline (see the module docstring): the one state every view shows."""
    if worker.state == "offline":
        return "offline"
    return "online" if worker.state == "online" and t - worker.heartbeat_at < timeout else "lost"


def shown(workers: list[Worker], t: float, *, timeout: float, stopped_for: float) -> list[Worker]:
    """The default list: every worker but one that stopped (or was lost) and has been replaced by a newer worker on
    its host and slice, or that stopped more than `stopped_for` seconds ago (lost: a day without a heartbeat)."""
    newest: dict[tuple[str, str], float] = {}
    for w in workers:
        newest[(w.host, w.slice)] = max(newest.get((w.host, w.slice), 0.0), w.started_at)
    keep = []
    for w in workers:
        state = state_of(w, t, timeout)
        replaced = newest[(w.host, w.slice)] > w.started_at
        old = (state == "offline" and t - (w.stopped_at or w.heartbeat_at) > stopped_for) or (
            state == "lost" and t - w.heartbeat_at > 86400
        )
        if state == "online" or not (replaced or old):
            keep.append(w)
    return keep


def live(session: Session, timeout: float) -> list[Worker]:
    stmt = select(Worker).where(Worker.state == "online", Worker.heartbeat_at > now() - timeout).order_by(Worker.name)
    return list(session.scalars(stmt).all())


def all_workers(session: Session) -> list[Worker]:
    return list(session.scalars(select(Worker).order_by(Worker.name)).all())


def mark_lost(session: Session, timeout: float) -> None:
    stmt = update(Worker).where(Worker.state == "online", Worker.heartbeat_at < now() - timeout).values(state="lost")
    session.execute(stmt)


def slice_size(worker: Worker) -> int:
    return len(parse_slice(worker.slice))


def can_serve(worker: Worker, gpus: int) -> bool:
    """A worker serves the queue of its own slice size, and only if it really sees that many GPUs."""
    if gpus == 0:
        return "cpu" in worker.queues
    return f"gpu{gpus}" in worker.queues and worker.capabilities.get("device_count", 0) >= gpus
