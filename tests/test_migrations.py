"""The schema comes only from the Alembic migrations: complete, without drift from the models, reversible, on SQLite and
Postgres; SQLite engines run in WAL mode with a busy timeout; `jobs db upgrade` works from the command line.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from core import db
from core.models import Base

ROOT = Path(__file__).resolve().parent.parent
TABLES = set(Base.metadata.tables)


@pytest.fixture
def blank_url(database_url) -> str:
    """A blank database (a new SQLite file or a new Postgres database); pooled connections dropped afterwards."""
    db.dispose()
    yield database_url
    db.dispose()


def _tables(url: str) -> set[str]:
    return set(inspect(db.get_engine(url)).get_table_names())


def _drift(url: str) -> list:
    with db.get_engine(url).connect() as conn:
        context = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        return compare_metadata(context, Base.metadata)


def test_models_define_the_expected_tables():
    """The metadata the migrations must build is the whole store (guards against an empty comparison)."""
    assert TABLES == {
        "jobs",
        "shards",
        "job_rows",
        "job_events",
        "workers",
        "files",
        "tokens",
        "adapters",
        "cached_models",
        "quotas",
        "shard_runs",
        "store_identity",
    }


def test_upgrade_creates_every_table_of_the_models(blank_url):
    """On a blank database upgrade() creates every table of Base.metadata (plus alembic_version), nothing else."""
    assert _tables(blank_url) == set()
    db.upgrade(blank_url)
    assert _tables(blank_url) == TABLES | {"alembic_version"}
    db.upgrade(blank_url)  # a second upgrade is a no-op
    assert _tables(blank_url) == TABLES | {"alembic_version"}


def test_migrated_schema_has_no_drift_from_the_models(blank_url):
    """alembic's compare_metadata between the migrated database and the models is empty (types, indexes, keys)."""
    db.upgrade(blank_url)
    assert _drift(blank_url) == []


def test_migrated_indexes_and_constraints_match_the_models(blank_url):
    """Every index, primary key and foreign key of the models exists in the migrated database."""
    db.upgrade(blank_url)
    inspector = inspect(db.get_engine(blank_url))
    for name, table in Base.metadata.tables.items():
        indexes = {(i["name"], tuple(i["column_names"])) for i in inspector.get_indexes(name)}
        assert {(i.name, tuple(c.name for c in i.columns)) for i in table.indexes} <= indexes, name
        assert inspector.get_pk_constraint(name)["constrained_columns"] == [c.name for c in table.primary_key], name
        fks = {(tuple(f["constrained_columns"]), f["referred_table"]) for f in inspector.get_foreign_keys(name)}
        assert {
            (tuple(fk.parent.name for fk in c.elements), c.referred_table.name) for c in table.foreign_key_constraints
        } == fks, name


def test_each_store_gets_its_own_random_id_once_also_when_upgraded_from_0010(blank_url, tmp_path):
    """0011 gives a store one `store_identity` row with a random id and no artifacts directory adopted yet (the first
    process that checks one adopts it: core/artifacts.py); a later upgrade keeps it; another store (here one
    upgraded from 0010 with a job in it) gets another id."""
    from sqlalchemy import select, text

    from core.db import session_scope
    from core.models import StoreIdentity

    def identities(url: str) -> list[tuple]:
        with session_scope(url) as session:
            return session.execute(select(StoreIdentity.id, StoreIdentity.artifacts_mark)).all()

    db.upgrade(blank_url)
    [(first, mark)] = identities(blank_url)
    assert first.startswith("store_") and len(first) == len("store_") + 16 and mark is None
    db.upgrade(blank_url)
    assert identities(blank_url) == [(first, None)]

    older = f"sqlite:///{tmp_path / 'older.db'}"
    try:
        db.upgrade(older, "0010")
        with db.get_engine(older).begin() as conn:
            conn.execute(
                text(
                    "INSERT INTO jobs (id, kind, state, owner, spec, queue, gpus, rows_total, rows_succeeded, "
                    "rows_failed, prompt_tokens, completion_tokens, created_at, retries) VALUES ('job_1', "
                    "'generate', 'succeeded', 'o', '{}', 'cpu', 0, 0, 0, 0, 0, 0, 0, 0)"
                )
            )
        db.upgrade(older)
        [(second, mark)] = identities(older)
        assert second.startswith("store_") and second != first and mark is None
    finally:
        db.dispose()


def test_downgrade_to_base_and_upgrade_again(blank_url):
    """downgrade to base removes every table; upgrade head afterwards rebuilds them with no drift."""
    db.upgrade(blank_url)
    command.downgrade(db.alembic_config(blank_url), "base")
    assert _tables(blank_url) <= {"alembic_version"}
    db.upgrade(blank_url)
    assert _tables(blank_url) == TABLES | {"alembic_version"}
    assert _drift(blank_url) == []


def test_sqlite_engine_runs_in_wal_mode_with_a_busy_timeout(tmp_path):
    """Every SQLite connection uses WAL, a 30 s busy timeout and enforced foreign keys."""
    db.dispose()
    url = f"sqlite:///{tmp_path / 'nested' / 'jobs.db'}"  # a missing parent directory is created
    try:
        db.upgrade(url)
        with db.get_engine(url).connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 30000
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert (tmp_path / "nested" / "jobs.db-wal").exists()
    finally:
        db.dispose()


def test_jobs_db_upgrade_command_migrates_a_fresh_sqlite_file(tmp_path):
    """`python -m api db upgrade` with JOBS_DATABASE_URL set exits 0 and creates every table."""
    db.dispose()
    path = tmp_path / "cli.db"
    url = f"sqlite:///{path}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_")}
    env.update(JOBS_DATABASE_URL=url, JOBS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "api", "db", "upgrade"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "database at head" in result.stderr
    try:
        assert _tables(url) == TABLES | {"alembic_version"}
        assert _drift(url) == []
    finally:
        db.dispose()


@pytest.mark.parametrize(
    "url, why",
    [
        ("postgres://jobs:s3cret@127.0.0.1:5432/jobs", "sqlalchemy.dialects:postgres"),  # Heroku's and libpq's scheme
        ("postgresq+psycopg://jobs:s3cret@127.0.0.1:5432/jobs", "sqlalchemy.dialects:postgresq.psycopg"),
        ("127.0.0.1:5432/jobs", "Could not parse"),
    ],
)
def test_jobs_db_upgrade_with_a_url_sqlalchemy_cannot_open_says_which_form_to_give(tmp_path, url, why):
    """A JOBS_DATABASE_URL that names no dialect SQLAlchemy has (`postgres://`, a typo) or is no URL at all was a
    traceback ending in NoSuchModuleError; it is one line, exit 2, that shows the URL without its password and the
    forms to give."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_")}
    env.update(JOBS_DATABASE_URL=url, JOBS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "api", "db", "upgrade"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "s3cret" not in result.stderr, result.stderr
    assert result.stderr.startswith("Error: JOBS_DATABASE_URL ") and why in result.stderr, result.stderr
    assert "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE" in result.stderr, result.stderr


def test_a_store_without_the_migrations_says_to_run_db_upgrade_and_tokens_create_prints_no_token(tmp_path, blank_url):
    """A store whose migrations were never applied (a new cluster database, `gpujobs db upgrade` forgotten) or not
    the newest: every use says to run `gpujobs db upgrade` (a ServiceUnavailable: CLI exit 3, API 503) instead of a
    traceback (Postgres) or 'cannot be reached' (SQLite); `tokens create` prints no token it could not store."""
    from core import auth
    from core.db import session_scope
    from core.errors import ServiceUnavailable
    from core.models import JobRow

    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_")}
    env.update(JOBS_DATABASE_URL=blank_url, JOBS_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT))
    created = subprocess.run(
        [sys.executable, "-m", "api", "tokens", "create", "--owner", "dave"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (created.returncode, created.stdout) == (3, ""), created.stdout + created.stderr
    assert "Traceback" not in created.stderr and "`gpujobs db upgrade`" in created.stderr, created.stderr
    assert "lacks gpujobs' tables or columns" in created.stderr and "tokens" in created.stderr, created.stderr
    with pytest.raises(ServiceUnavailable, match="gpujobs db upgrade"):
        with session_scope(blank_url) as session:
            auth.list_tokens(session)

    db.upgrade(blank_url, "0009")  # one migration behind: job_rows has no logprobs column yet
    with pytest.raises(ServiceUnavailable, match="lacks gpujobs' tables or columns .*gpujobs db upgrade"):
        with session_scope(blank_url) as session:
            session.get(JobRow, ("job_1", 0))


def test_0002_keeps_outputs_and_stores_nul_characters(blank_url):
    """Upgrading from 0001 turns stored output text into JSON strings unchanged, and afterwards an output with a
    NUL character (which a Postgres text column refuses) round-trips exactly."""
    from sqlalchemy import text

    from core.db import session_scope
    from core.models import JobRow

    db.upgrade(blank_url, "0001")
    with db.get_engine(blank_url).begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, kind, state, owner, spec, queue, gpus, rows_total, rows_succeeded, "
                "rows_failed, prompt_tokens, completion_tokens, created_at, retries) VALUES ('job_1', "
                "'generate', 'running', 'o', '{}', 'cpu', 0, 2, 0, 0, 0, 0, 0, 0)"
            )
        )
        conn.execute(
            text(
                "INSERT INTO job_rows (job_id, idx, custom_id, line, state, output, executions) VALUES "
                "('job_1', 0, 'a', 1, 'succeeded', 'Paris. \"quoted\"', 1), "
                "('job_1', 1, 'b', 2, 'pending', NULL, 0)"
            )
        )
    db.upgrade(blank_url)
    with session_scope(blank_url) as session:
        assert session.get(JobRow, ("job_1", 0)).output == 'Paris. "quoted"'
        session.get(JobRow, ("job_1", 1)).output = "nul\x00inside"
    with session_scope(blank_url) as session:
        assert session.get(JobRow, ("job_1", 1)).output == "nul\x00inside"
    assert _drift(blank_url) == []
