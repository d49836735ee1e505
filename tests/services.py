"""Pytest helpers for tests that need a real Redis or PostgreSQL.

Not a conftest: import the fixtures where they are wanted, e.g. in tests/conftest.py

    from tests.services import postgres_url, redis_server  # noqa: F401

A missing service skips the test on a laptop but fails it under CI (`CI=true`): CI must never
go green by skipping.

- `redis_server` (module scope): a private redis-server from core.embedded on a free TCP port,
  no persistence. `.url` (redis-py), `.broker_url` (Celery/kombu), `.port`, `.proc`,
  `.kill()`, `.start()`, `.restart()` (SIGKILL, then a fresh empty server on the SAME port),
  `.client()` (a redis.Redis).
- `locked_redis` (function scope): a private redis-server that requires a password (`requirepass`, as
  compose.yaml's Redis does); `.url(password)` is its URL with that password (None: with none).
- `socket_redis` (function scope): a private redis-server on a unix socket only (no TCP), requiring a password;
  `.path` is its socket, `.password` its password.
- `postgres_url` (function scope): a fresh database on the server named by
  `JOBS_TEST_POSTGRES_URL` (e.g. `postgresql+psycopg://postgres@127.0.0.1:55432/postgres`),
  dropped afterwards; yields its SQLAlchemy URL string.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from core import embedded
from core.errors import PortInUse

POSTGRES_ENV = "JOBS_TEST_POSTGRES_URL"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_service(name: str, why: str) -> None:
    """Skip the current test because `name` is missing; under CI=true fail it instead."""
    message = f"{name} is not available: {why}"
    if in_ci():
        pytest.fail(f"{message} (CI=true: a missing service fails the run instead of skipping)", pytrace=False)
    pytest.skip(message)


class RedisHandle:
    """A redis-server owned by a fixture, that fault tests may kill and bring back on the same port."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.server = embedded.start_redis(workdir)
        self.port: int = self.server.port  # fixed for the handle's life: restart() reuses it

    @property
    def proc(self):
        return self.server.proc

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def broker_url(self) -> str:
        return self.server.broker_url

    @property
    def alive(self) -> bool:
        return self.server.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing saved, clients see dropped connections)."""
        if self.alive:
            self.server.proc.kill()
        self.server.proc.wait()

    def start(self) -> None:
        """Start a fresh, empty server on the same port (after kill())."""
        if self.alive:
            raise RuntimeError(f"redis-server pid {self.proc.pid} is still running on port {self.port}")
        for attempt in range(20):  # the old socket may linger an instant after SIGKILL
            try:
                self.server = embedded.start_redis(self.workdir, port=self.port)
                return
            except PortInUse:
                if attempt == 19:
                    raise
                time.sleep(0.1)

    def restart(self) -> None:
        """SIGKILL, then start again on the same port. The data is gone (no persistence)."""
        self.kill()
        self.start()

    def stop(self) -> None:
        embedded.stop_process(self.server.proc)

    def client(self, **kwargs):
        import redis

        return redis.Redis.from_url(self.url, **kwargs)

    def __repr__(self) -> str:
        return f"RedisHandle({self.url}, pid={self.proc.pid}, alive={self.alive})"


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisHandle]:
    try:
        embedded.find_redis_server()
    except RuntimeError as exc:
        require_service("redis-server", str(exc))
    handle = RedisHandle(tmp_path_factory.mktemp("redis"))
    try:
        yield handle
    finally:
        handle.stop()


class LockedRedis:
    """A redis-server of a test's own that requires `password`."""

    def __init__(self, workdir: Path, password: str):
        import redis

        self.server = embedded.start_redis(workdir)  # it pings the new server without a password: set one after
        self.password = password
        redis.Redis.from_url(self.server.url).config_set("requirepass", password)

    def url(self, password: str | None) -> str:
        credentials = "" if password is None else f":{password}@"
        return f"redis://{credentials}127.0.0.1:{self.server.port}/0"

    def client(self, password: str | None = None):
        import redis

        return redis.Redis.from_url(self.url(self.password if password is None else password))

    def stop(self) -> None:
        embedded.stop_process(self.server.proc)


@pytest.fixture
def locked_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LockedRedis]:
    try:
        embedded.find_redis_server()
    except RuntimeError as exc:
        require_service("redis-server", str(exc))
    server = LockedRedis(tmp_path_factory.mktemp("locked-redis"), password="right-password")
    try:
        yield server
    finally:
        server.stop()


class SocketRedis:
    """A redis-server of a test's own on a unix socket (in a short directory: a socket path has at most 107 bytes)."""

    def __init__(self, password: str):
        import redis

        self.workdir = Path(tempfile.mkdtemp(prefix="gpujobs-redis-"))
        self.path = self.workdir / "redis.sock"
        self.server = embedded.start_redis(self.workdir, unix_socket=self.path)
        self.password = password
        redis.Redis.from_url(self.server.url).config_set("requirepass", password)

    def client(self, db: int = 0):
        import redis

        return redis.Redis(unix_socket_path=str(self.path), password=self.password, db=db)

    def stop(self) -> None:
        embedded.stop_process(self.server.proc)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def socket_redis() -> Iterator[SocketRedis]:
    try:
        embedded.find_redis_server()
    except RuntimeError as exc:
        require_service("redis-server", str(exc))
    server = SocketRedis(password="socket-password")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    server_url = os.environ.get(POSTGRES_ENV, "").strip()
    if not server_url:
        require_service(
            "PostgreSQL",
            f"set {POSTGRES_ENV} to a server URL such as "
            "postgresql+psycopg://postgres@127.0.0.1:55432/postgres (.ci/run shows how to start one)",
        )
    try:
        import psycopg
        from psycopg import sql
        from sqlalchemy.engine import make_url
    except ImportError as exc:
        missing = str(exc)
    else:
        missing = None
    if missing:
        require_service("psycopg/SQLAlchemy", f"{missing} (pip install -e '.[postgres]')")

    server = make_url(server_url)
    # psycopg takes a libpq URI: the same URL without SQLAlchemy's "+driver".
    admin_conninfo = server.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"jobs_test_{uuid.uuid4().hex[:12]}"
    error = None
    try:
        with psycopg.connect(admin_conninfo, autocommit=True, connect_timeout=10) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    except psycopg.Error as exc:
        error = exc
    if error is not None:
        # The variable was set on purpose: an unreachable server is an error, never a skip.
        pytest.fail(
            f"{POSTGRES_ENV}={server.render_as_string(hide_password=True)} is set but CREATE DATABASE failed: {error}",
            pytrace=False,
        )

    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        _drop_database(psycopg, sql, admin_conninfo, name)


def _drop_database(psycopg, sql, admin_conninfo: str, name: str) -> None:
    """Drop `name`, first ending the sessions a test left open (pools not disposed, leaked connections)."""
    with psycopg.connect(admin_conninfo, autocommit=True, connect_timeout=10) as conn:
        for attempt in range(10):
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            )
            try:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
                return
            except psycopg.errors.ObjectInUse:  # a pool reconnected in between: terminate again
                if attempt == 9:
                    raise
                time.sleep(0.2)


PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivatePostgres:
    """A PostgreSQL server of the test's own (initdb in a temp dir, run as the postgres user), which a fault test
    may stop in immediate mode and start again on the same port."""

    def __init__(self, root: Path):
        import shutil
        import subprocess

        self.root, self.port = root, embedded.free_port()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"
        root.mkdir(parents=True, exist_ok=True)
        shutil.chown(root, "postgres")
        self._run = lambda *args: subprocess.run(
            ["runuser", "-u", "postgres", "--", *args], cwd=root, check=True, capture_output=True, text=True
        )
        self._run(str(PG_BIN / "initdb"), "-D", str(root / "data"), "--auth=trust", "--no-locale", "-E", "UTF8")
        self.start()

    def start(self) -> None:
        self._run(
            str(PG_BIN / "pg_ctl"),
            "-D",
            str(self.root / "data"),
            "-l",
            str(self.root / "log"),
            "-w",
            "-o",
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        self._run(str(PG_BIN / "pg_ctl"), "-D", str(self.root / "data"), "-m", mode, "-w", "stop")


@pytest.fixture
def private_postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivatePostgres]:
    if os.geteuid() != 0 or not (PG_BIN / "initdb").exists():
        require_service("a private PostgreSQL", f"needs root and {PG_BIN}/initdb (apt install postgresql)")
    import tempfile

    server = PrivatePostgres(Path(tempfile.mkdtemp(prefix="gpujobs-pg-")))
    try:
        yield server
    finally:
        try:
            server.stop("immediate")
        except Exception:  # already stopped by the test
            pass
        import shutil

        shutil.rmtree(server.root, ignore_errors=True)
