"""The service fixtures themselves work: Redis restarts on the same port, empty; Postgres gives a throwaway database."""

from __future__ import annotations

import os

import pytest

from tests.services import postgres_url, redis_server  # noqa: F401


def test_redis_answers_and_restarts_on_same_port_without_data(redis_server):  # noqa: F811
    client = redis_server.client(socket_timeout=5)
    assert client.ping()
    client.set("gpujobs:smoke", "1")
    port, pid = redis_server.port, redis_server.proc.pid
    assert redis_server.url == f"redis://127.0.0.1:{port}/0" == redis_server.broker_url

    redis_server.restart()

    assert redis_server.port == port
    assert redis_server.proc.pid != pid
    assert redis_server.url == f"redis://127.0.0.1:{port}/0"
    client = redis_server.client(socket_timeout=5)
    assert client.ping()
    assert client.get("gpujobs:smoke") is None  # no persistence: a restart loses everything
    assert not any(p.suffix in (".rdb", ".aof") for p in redis_server.workdir.iterdir())


@pytest.fixture(scope="module")
def created_databases():
    """Names the postgres test saw; checked after every function fixture (postgres_url too) is torn down."""
    names: list[str] = []
    yield names
    if names:
        sqlalchemy = pytest.importorskip("sqlalchemy")
        admin = sqlalchemy.create_engine(os.environ["JOBS_TEST_POSTGRES_URL"])
        try:
            with admin.connect() as conn:
                left = (
                    conn.execute(
                        sqlalchemy.text("select datname from pg_database where datname = any(:names)"), {"names": names}
                    )
                    .scalars()
                    .all()
                )
        finally:
            admin.dispose()
        assert left == [], f"postgres_url did not drop {left}"


def test_postgres_gives_a_fresh_database_dropped_afterwards(postgres_url, created_databases):  # noqa: F811
    sqlalchemy = pytest.importorskip("sqlalchemy")
    name = sqlalchemy.engine.make_url(postgres_url).database
    assert name.startswith("jobs_test_")
    created_databases.append(name)

    engine = sqlalchemy.create_engine(postgres_url)
    with engine.connect() as conn:
        assert conn.execute(sqlalchemy.text("select 1")).scalar() == 1
        assert conn.execute(sqlalchemy.text("select current_database()")).scalar() == name
    # Deliberately not disposed: the pool keeps a session open, which the fixture must end to drop the database.
