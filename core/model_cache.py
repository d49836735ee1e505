"""What each host's Hugging Face cache holds (table `cached_models`), the progress of its downloads, and the
pull/remove requests left for its workers. The files themselves are core/hub_download.py's and
core/hub_cache.py's business; this is the record.

A place is (host, cache directory). Rows are written by the workers of that place: at start (a scan of the cache),
when a download starts, every second while it runs (bytes done and rate), when it ends, and when a job loads the
model (`last_used_at`). `gpujobs models pull/rm --workers` writes a request row (`pull_requested`,
`remove_requested`) per place; one worker of the place claims it with a conditional UPDATE (so one acts) and does it
in its models thread (worker/hubfetch.py). Requests live in SQL rather than in a Celery broadcast: a worker busy
with a shard still serves them, and a place with no live worker gets its request when one starts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from core.models import CachedModel
from core.store import now

REQUESTS = ("pull_requested", "remove_requested")
STALE_SECONDS = 60.0  # a download row not updated for this long lost its worker; another worker may take over


def place_of(capabilities: dict[str, Any] | None, host: str) -> tuple[str, str] | None:
    """A worker's place, from its registration (None for a worker registered before 0006)."""
    hub = (capabilities or {}).get("hub") or {}
    return (host, hub["cache"]) if hub.get("cache") else None


def upsert(session: Session, *, host: str, cache_dir: str, repo: str, commit: str, **values: Any) -> CachedModel:
    """The row of (place, repo, commit), created if missing (two workers of a place may race: one insert wins)."""
    where = (
        CachedModel.host == host,
        CachedModel.cache_dir == cache_dir,
        CachedModel.repo == repo,
        CachedModel.commit == commit,
    )
    row = session.scalar(select(CachedModel).where(*where))
    if row is None:
        try:
            with session.begin_nested():
                row = CachedModel(
                    host=host,
                    cache_dir=cache_dir,
                    repo=repo,
                    commit=commit,
                    state="ready",
                    files=0,
                    bytes=0,
                    bytes_done=0,
                    bytes_total=0,
                    kind="model",
                    created_at=now(),
                    updated_at=now(),
                )
                session.add(row)
                session.flush()
        except IntegrityError:
            row = session.scalar(select(CachedModel).where(*where))
    for key, value in values.items():
        setattr(row, key, value)
    row.updated_at = now()
    return row


def find(session: Session, *, host: str, cache_dir: str, repo: str, commit: str) -> CachedModel | None:
    return session.scalar(
        select(CachedModel).where(
            CachedModel.host == host,
            CachedModel.cache_dir == cache_dir,
            CachedModel.repo == repo,
            CachedModel.commit == commit,
        )
    )


def update_row(session: Session, row_id: int, **values: Any) -> None:
    session.execute(update(CachedModel).where(CachedModel.id == row_id).values(**values, updated_at=now()))


def sync(session: Session, *, host: str, cache_dir: str, records: Iterable[dict[str, Any]]) -> None:
    """Make the place's rows match a scan of its cache (core.hub_cache.scan): found snapshots upserted, vanished ones
    dropped. Rows of downloads and requests in flight are left alone. A failed request's row keeps its state and
    error (its figures follow the scan) until a later pull or removal replaces it: the worker scans right after a
    failure, and `models pull --wait` and `models list` must still see why."""
    seen = set()
    for r in records:
        seen.add((r["repo"], r["commit"]))
        row = upsert(session, host=host, cache_dir=cache_dir, repo=r["repo"], commit=r["commit"])
        if row.state in ("downloading", *REQUESTS):
            continue
        row.kind, row.refs, row.files, row.bytes = r["kind"], r["refs"], r["files"], r["bytes"]
        if row.state != "failed":
            row.state, row.error = r["state"], None
    for row in session.scalars(
        select(CachedModel).where(CachedModel.host == host, CachedModel.cache_dir == cache_dir)
    ).all():
        if (row.repo, row.commit) not in seen and row.state in ("ready", "partial"):
            session.delete(row)


def record(session: Session, *, host: str, cache_dir: str, snapshot: dict[str, Any], **values: Any) -> CachedModel:
    """One snapshot's row after a fetch (core.hub_cache.scan's record of it) plus `values`."""
    return upsert(
        session,
        host=host,
        cache_dir=cache_dir,
        repo=snapshot["repo"],
        commit=snapshot["commit"],
        kind=snapshot["kind"],
        refs=snapshot["refs"],
        files=snapshot["files"],
        bytes=snapshot["bytes"],
        state=snapshot["state"],
        **values,
    )


def live_places(workers: list) -> set[tuple[str, str]]:
    return {p for w in workers if (p := place_of(w.capabilities, w.host))}


def ready_in(session: Session, repo: str, places: set[tuple[str, str]]) -> list[CachedModel]:
    """Complete snapshots of `repo` in the given places."""
    rows = session.scalars(select(CachedModel).where(CachedModel.repo == repo, CachedModel.state == "ready")).all()
    return [r for r in rows if (r.host, r.cache_dir) in places]


def matches(row: CachedModel, revision: str | None) -> bool:
    rev = revision or "main"
    return row.commit == rev or rev in (row.refs or [])


def downloads(session: Session, repo: str, commits: Iterable[str] | None = None) -> list[CachedModel]:
    """Downloads of `repo` in progress (on any host), for a job's status."""
    stmt = select(CachedModel).where(CachedModel.repo == repo, CachedModel.state == "downloading")
    rows = session.scalars(stmt.order_by(CachedModel.host)).all()
    wanted = set(commits or ())
    return [r for r in rows if not wanted or r.commit in wanted]


def download_view(row: CachedModel) -> dict[str, Any]:
    left = max(row.bytes_total - row.bytes_done, 0)
    return {
        "host": row.host,
        "repo": row.repo,
        "commit": row.commit,
        "worker": row.worker,
        "bytes_done": row.bytes_done,
        "bytes_total": row.bytes_total,
        "rate_bytes_per_s": row.rate,
        "eta_s": round(left / row.rate, 1) if row.rate else None,
        "started_at": row.started_at,
        "updated_at": row.updated_at,
    }


def view(row: CachedModel) -> dict[str, Any]:
    data = {
        "id": row.id,
        "host": row.host,
        "cache_dir": row.cache_dir,
        "repo": row.repo,
        "commit": row.commit or None,
        "revision": row.revision,
        "refs": row.refs or [],
        "kind": row.kind,
        "state": row.state,
        "files": row.files,
        "bytes": row.bytes,
        "last_used_at": row.last_used_at,
        "updated_at": row.updated_at,
        "finished_at": row.finished_at,
        "worker": row.worker,
        "requested_by": row.requested_by,
        "error": row.error,
    }
    if row.state == "downloading":
        data["download"] = download_view(row)
    return data


def listing(session: Session, repo: str | None = None) -> list[CachedModel]:
    stmt = select(CachedModel).order_by(CachedModel.host, CachedModel.cache_dir, CachedModel.repo, CachedModel.commit)
    if repo:
        stmt = stmt.where(CachedModel.repo == repo)
    return list(session.scalars(stmt).all())


def request(
    session: Session,
    *,
    places: Iterable[tuple[str, str]],
    repo: str,
    action: str,
    by: str,
    revision: str | None = None,
    commit: str = "",
) -> list[CachedModel]:
    """Leave a pull (or remove) request for each place; a place's workers act on it (see the module docstring)."""
    state = {"pull": "pull_requested", "remove": "remove_requested"}[action]
    rows = []
    for host, cache_dir in sorted(set(places)):
        row = upsert(session, host=host, cache_dir=cache_dir, repo=repo, commit=commit)
        if row.state == "downloading" and action == "pull":
            rows.append(row)  # already on its way
            continue
        row.state, row.revision, row.requested_by, row.error, row.worker = state, revision, by, None, None
        row.finished_at = None
        rows.append(row)
    return rows


def claim(session: Session, *, host: str, cache_dir: str, worker: str) -> CachedModel | None:
    """The oldest request of this place, taken by `worker` (a conditional UPDATE: one worker wins each)."""
    candidates = session.scalars(
        select(CachedModel)
        .where(CachedModel.host == host, CachedModel.cache_dir == cache_dir, CachedModel.state.in_(REQUESTS))
        .order_by(CachedModel.updated_at)
    ).all()
    for row in candidates:
        taken = session.execute(
            update(CachedModel)
            .where(CachedModel.id == row.id, CachedModel.state == row.state, CachedModel.updated_at == row.updated_at)
            .values(
                worker=worker,
                updated_at=now(),
                started_at=now(),
                state="downloading" if row.state == "pull_requested" else "removing",
            )
        ).rowcount
        if taken:
            session.refresh(row)
            row.revision = row.revision or (row.commit or None)
            return row
    return None


def reclaim_stale(session: Session) -> int:
    """Downloads and removals whose worker stopped updating them (it died): failed, so they can be asked again."""
    stale = now() - STALE_SECONDS
    return session.execute(
        update(CachedModel)
        .where(CachedModel.state.in_(("downloading", "removing")), CachedModel.updated_at < stale)
        .values(
            state="failed",
            error="the worker doing this stopped (no progress for a minute): ask again",
            updated_at=now(),
        )
    ).rowcount


def drop(session: Session, row_id: int) -> None:
    session.execute(delete(CachedModel).where(CachedModel.id == row_id))
