"""Which store an artifacts directory belongs to.

Every process of a store must use one artifacts directory (JOBS_ARTIFACTS; in a cluster a shared mount,
docs/cluster.md). A worker on another one (the setting left unset: that host's own `$JOBS_HOME/artifacts`; a mount
missing) reads no stored input, finds no adapter, and keeps its fine-tunes' checkpoints and adapters where the API
and the other workers never see them. So the store and its directory share an identity, checked when a worker, the
API or `gpujobs up` starts (docs/design.md, "The artifacts directory belongs to one store"):

- the store's id, `store_…`: random, made once by the migration that made its table (0011), in `store_identity`;
- the directory's marker `JOBS_ARTIFACTS/.gpujobs-store`: JSON with that store id and the directory's own random
  `mark` (`dir_…`), which the store records when it adopts the directory.

A directory is the store's when its marker holds the store's id and the mark the store recorded. A store that has
adopted no directory yet adopts the first one a process checks (a fresh single-host setup needs nothing), unless it
lacks the newest file or adapter the store records (a store from before this check: a worker host with the wrong
directory must not be the one that adopts). Each step is safe against a process doing the same at once: the marker
is created with a hard link that never replaces one another process wrote first, and the store records a mark only
where it has none (a conditional UPDATE), so of two directories adopted at once exactly one wins and the other is
refused. `gpujobs db adopt-artifacts` makes a directory the store's on purpose (a repair).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select, update

from core.db import get_engine, session_scope
from core.errors import WrongArtifacts
from core.models import Adapter, File, StoreIdentity
from core.settings import get_settings
from core.store import new_id, now

MARKER = ".gpujobs-store"
FIX = "mount the shared artifacts directory on this host and set JOBS_ARTIFACTS to it (docs/cluster.md)"
REPAIR = "if that directory is lost for good, `gpujobs db adopt-artifacts` on this host makes this one the store's"


@dataclass(frozen=True)
class Marker:
    store: str
    mark: str


def verify(artifacts: Path | None = None, *, host: str | None = None) -> str:
    """The store's id, once `artifacts` (JOBS_ARTIFACTS) is known to be its artifacts directory, adopting it when
    the store has none yet; raises WrongArtifacts, naming both directories and what to do, when it is not."""
    artifacts, host = artifacts or get_settings().artifacts, host or _host()
    with session_scope() as session:
        ident = _identity(session)
    found = read_marker(artifacts)
    if found is None and ident.artifacts_mark is None:
        _require_the_stores_files(artifacts, ident, host)
        found = _create(artifacts, Marker(ident.id, new_id("dir")), host)
    if found is not None and found.store == ident.id and ident.artifacts_mark is None:
        ident = _record(found, artifacts, host, only_if_unmarked=True)  # a crash between the two steps too
    if found is None or (found.store, found.mark) != (ident.id, ident.artifacts_mark):
        raise WrongArtifacts(_mismatch(artifacts, host, found, ident))
    return ident.id


def adopt(artifacts: Path | None = None, *, host: str | None = None, force: bool = False) -> str:
    """Make `artifacts` the store's artifacts directory (`gpujobs db adopt-artifacts`): a new marker, recorded by
    the store, so every other directory is refused from now on. Refuses a directory of another store's unless
    `force` (two live stores must never share one). Returns the store's id."""
    artifacts, host = artifacts or get_settings().artifacts, host or _host()
    with session_scope() as session:
        ident = _identity(session)
    try:
        found = read_marker(artifacts)
    except WrongArtifacts:
        if not force:
            raise
        found = None
    if found is not None and (found.store, found.mark) == (ident.id, ident.artifacts_mark):
        return ident.id
    if found is not None and found.store != ident.id and not force:
        raise WrongArtifacts(
            f"{artifacts} holds the marker of another store ({found.store}), not of this one ({ident.id}, "
            f"{_database()}): two stores must not share one artifacts directory; give this store a directory of "
            "its own, or pass --force if that other store is gone for good"
        )
    marker = Marker(ident.id, new_id("dir"))
    artifacts.mkdir(parents=True, exist_ok=True)
    tmp = artifacts / f"{MARKER}.{marker.mark}.part"
    tmp.write_text(_content(marker, artifacts, host))
    os.replace(tmp, artifacts / MARKER)
    _record(marker, artifacts, host, only_if_unmarked=False)
    return ident.id


def read_marker(artifacts: Path) -> Marker | None:
    """The marker in `artifacts`; None when it has none (or does not exist)."""
    path = artifacts / MARKER
    try:
        data = json.loads(path.read_text())
        return Marker(store=str(data["store"]), mark=str(data["mark"]))
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WrongArtifacts(
            f"{path} is not a gpujobs store marker this process can read ({type(exc).__name__}: {exc}): check "
            f"JOBS_ARTIFACTS={artifacts} and that directory's permissions; `gpujobs db adopt-artifacts --force` "
            "writes it anew"
        ) from None


def _identity(session) -> StoreIdentity:
    return session.scalars(select(StoreIdentity)).one()


def _create(artifacts: Path, marker: Marker, host: str) -> Marker:
    """Write `marker` unless the directory has one; the marker the directory then holds (another process's, where
    it wrote first)."""
    artifacts.mkdir(parents=True, exist_ok=True)
    path, content = artifacts / MARKER, _content(marker, artifacts, host)
    tmp = artifacts / f"{MARKER}.{marker.mark}.part"
    tmp.write_text(content)
    try:
        os.link(tmp, path)  # whole at once, and never over a marker written first (NFS too)
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: an exclusive create
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as out:
                out.write(content)
    finally:
        tmp.unlink(missing_ok=True)
    return read_marker(artifacts)


def _content(marker: Marker, artifacts: Path, host: str) -> str:
    about = "the gpujobs store these files belong to (core/artifacts.py): keep it with them, never edit it"
    data = {"store": marker.store, "mark": marker.mark, "path": str(artifacts), "host": host, "at": now()}
    return json.dumps({**data, "about": about}, indent=1) + "\n"


def _record(marker: Marker, artifacts: Path, host: str, *, only_if_unmarked: bool) -> StoreIdentity:
    """The store records `marker`'s mark as its directory's (only where it has none yet: the first of two
    processes wins); the store's identity as now stored."""
    stmt = update(StoreIdentity).where(StoreIdentity.id == marker.store)
    if only_if_unmarked:
        stmt = stmt.where(StoreIdentity.artifacts_mark.is_(None))
    values = {"artifacts_path": str(artifacts), "artifacts_host": host, "artifacts_adopted_at": now()}
    with session_scope() as session:
        session.execute(stmt.values(artifacts_mark=marker.mark, **values))
    with session_scope() as session:
        return _identity(session)


def _require_the_stores_files(artifacts: Path, ident: StoreIdentity, host: str) -> None:
    """A directory that lacks the newest file or adapter the store records is not the one it used: never adopt it."""
    for model, what in ((File, "stored file"), (Adapter, "adapter")):
        with session_scope() as session:
            path = session.scalar(select(model.path).order_by(model.created_at.desc(), model.id.desc()).limit(1))
        if path is not None and not (artifacts / path).exists():
            raise WrongArtifacts(
                f"JOBS_ARTIFACTS={artifacts} on host {host} is not the artifacts directory of store {ident.id} "
                f"({_database()}): it lacks {path}, the newest {what} the store records: {FIX}; {REPAIR}"
            )


def _mismatch(artifacts: Path, host: str, found: Marker | None, ident: StoreIdentity) -> str:
    if found is None:
        what = f"it has no {MARKER} marker"
    elif found.store != ident.id:
        what = f"its {MARKER} marker is another store's ({found.store})"
    else:
        what = f"its {MARKER} marker is of this store but not of the directory it adopted (a copy, or one adopted at the same moment)"
    if ident.artifacts_mark is None:
        where = (
            "the store has adopted no artifacts directory yet: give each store a directory of its own (set "
            "JOBS_ARTIFACTS to one no other store uses)"
        )
    else:
        where = (
            f"the store's artifacts directory is {ident.artifacts_path} (as adopted on host {ident.artifacts_host}): "
            f"{FIX}; {REPAIR}"
        )
    return f"JOBS_ARTIFACTS={artifacts} on host {host} is not the artifacts directory of store {ident.id} " + (
        f"({_database()}): {what}; {where}"
    )


def _database() -> str:
    return get_engine().url.render_as_string(hide_password=True)


def _host() -> str:
    return get_settings().hostname or socket.gethostname()
