"""Engines, sessions and migrations.

SQLite runs in WAL mode with a busy timeout, so the API, several workers and the reaper can write to one file;
Postgres is the cluster store. Either way the schema comes only from `alembic upgrade head` (`upgrade()`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import ArgumentError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session, sessionmaker

from core.errors import InvalidInput, ServiceUnavailable
from core.settings import get_settings

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


_engines: dict[str, Engine] = {}


def get_engine(url: str | None = None) -> Engine:
    url = url or get_settings().database_url
    if url not in _engines:
        try:
            _engines[url] = _create_engine(url)
        except (ArgumentError, ImportError) as exc:  # `postgres://…` (no such dialect), a typo, no psycopg
            shown = url.split("://", 1)[0] + "://…@" + url.rsplit("@", 1)[-1] if "@" in url else url
            raise InvalidInput(
                f"JOBS_DATABASE_URL {shown} is not a URL SQLAlchemy can open ({exc}): give "
                "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE (pip install -e '.[postgres]') or "
                "sqlite:///PATH"
            ) from exc
    return _engines[url]


def _create_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        # One connection per thread of the API's thread pool (anyio's 40), and as many again for other threads: with
        # SQLAlchemy's default (5 + 10 overflow) a status read queued for a connection behind submissions waiting
        # for SQLite's write lock (ops/bench/README.md, "Load"). In WAL mode readers never wait for the writer; an
        # idle connection is a file handle.
        engine = create_engine(
            url, connect_args={"timeout": 30, "check_same_thread": False}, pool_size=40, max_overflow=40
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=10, connect_args=PG_CONNECT_ARGS)


# libpq: give up a connect after 10 s; notice a dead peer (host gone, network cut) after ~20 s instead of TCP's
# ~15 min (unacknowledged data: tcp_user_timeout) or 2 h (idle connection: keepalives).
PG_CONNECT_ARGS = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 20_000,
}


@cache
def _sessionmaker(url: str) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope(url: str | None = None) -> Iterator[Session]:
    """A session that commits on success and rolls back on error; database outages become ServiceUnavailable."""
    session = _sessionmaker(url or get_settings().database_url)()
    try:
        yield session
        session.commit()
    except (OperationalError, ProgrammingError) as exc:
        session.rollback()
        unmigrated = _unmigrated(exc, session)
        if unmigrated is not None:
            raise ServiceUnavailable(unmigrated) from exc
        if isinstance(exc, ProgrammingError):
            raise
        raise ServiceUnavailable(f"the database cannot be reached or is locked: {exc.orig}") from exc
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def _unmigrated(exc: OperationalError | ProgrammingError, session: Session) -> str | None:
    """The message for a store that lacks a table or column of ours (the migrations were never applied, or not the
    newest: `gpujobs db upgrade` forgotten on a new cluster or after an upgrade), else None. Without it a new
    Postgres answered with a traceback in the CLI and a 500 from the API, SQLite with 'cannot be reached'."""
    code = getattr(exc.orig, "sqlstate", None)  # psycopg: 42P01 undefined table, 42703 undefined column
    text = str(exc.orig).strip()
    if (
        code not in ("42P01", "42703")
        and not text.startswith(("no such table", "no such column"))
        and ("has no column named" not in text)
    ):
        return None
    where = session.get_bind().url.render_as_string(hide_password=True)
    return (
        f"the database {where} lacks gpujobs' tables or columns ({text.splitlines()[0]}): apply the migrations with "
        "`gpujobs db upgrade` (with the same JOBS_DATABASE_URL), then try again"
    )


def alembic_config(url: str | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", (url or get_settings().database_url).replace("%", "%%"))
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Apply the migrations: the only way a schema is created."""
    from alembic import command

    try:
        command.upgrade(alembic_config(url), revision)
    except OperationalError as exc:
        raise ServiceUnavailable(f"cannot migrate the database: {exc.orig}") from exc


def check_reachable(url: str | None = None) -> None:
    try:
        with get_engine(url).connect() as conn:
            conn.execute(text("select 1"))
    except OperationalError as exc:
        raise ServiceUnavailable(
            f"the database at {get_engine(url).url.render_as_string(hide_password=True)} cannot be reached: "
            f"{exc.orig}. Check JOBS_DATABASE_URL, or start the local stack with `gpujobs up`."
        ) from exc


def dispose() -> None:
    """Drop pooled connections (after a fork, or between tests that change the URL)."""
    for engine in _engines.values():
        engine.dispose()
    _engines.clear()
    _sessionmaker.cache_clear()
