"""Shared fixtures: real Redis, real SQLite/Postgres (schema from migrations only), real worker processes,
a tiny Qwen3 model that has memorized six answers.

`jobs_env` points every JOBS_* setting of this test process at fresh state; `spawn_worker` and `api_server`
start real processes with the same environment.

The suite runs in PROCESSES pytest-xdist processes (`pytest_cmdline_main` below); `-n 0` or `-p no:xdist` runs it in
one process, for a debugger or a clean traceback. Every fixture is safe in parallel: each test has its own tmp_path
(JOBS_HOME, SQLite, artifacts), Redis and the API listen on free ports, each Postgres test gets a database named
by a fresh uuid, and the tiny models are built once per run and shared by all processes (`shared_build`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# One torch thread per process: this test process, its workers and every child it starts (they inherit the
# environment; set before anything here imports torch). The suite runs many torch processes at once on few cores,
# and torch's OpenMP threads, two or more per process, then wait on each other. One engine test on CI's 2-core
# machine (test_engine_fast.py's consecutive runs) beside one spin loop: 51 s of CPU and 47 s of wall time with
# torch's default threads, 14 s and 12 s with one; beside two spin loops, 29 s and 34 s against 15 s and 19 s.
# Set OMP_NUM_THREADS yourself to choose another number.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # a pytest plugin imported it first: its thread count is already fixed
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from tests.services import locked_redis, postgres_url, private_postgres, redis_server  # noqa: E402, F401

ROOT = Path(__file__).resolve().parent.parent

# pytest-xdist processes for a plain `python -m pytest` (the README's and CI's command). One test at a time keeps
# about one of CI's 2 cores busy on average: most tests wait on real processes (a worker importing torch, a job
# draining, a lease expiring). The whole suite needs about 1,600 CPU-seconds; 4 processes keep both cores busy
# (more would only slow each test down) and, with their workers, peaked at 3.8 GiB (PSS) together.
PROCESSES = 4


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """Run in PROCESSES processes unless -n was given (-n 0 or -p no:xdist: this process only), or --pdb asked for
    one process, or this is an xdist process itself (its numprocesses is None too)."""
    if (
        config.pluginmanager.hasplugin("xdist")
        and config.option.numprocesses is None
        and not hasattr(config, "workerinput")
        and not config.option.usepdb
    ):
        config.option.numprocesses = PROCESSES
        if config.option.dist == "no":
            config.option.dist = "worksteal"  # tests last 0.01-120 s: an idle process takes queued tests from another


def reset_caches() -> None:
    from core import db, queue, settings

    settings.reset()
    db.dispose()
    queue.reset()


@dataclass
class JobsEnv:
    home: Path
    database_url: str
    redis_url: str
    env: dict[str, str]


def make_env(tmp: Path, database_url: str, redis_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(
        JOBS_HOME=str(tmp / "home"),
        JOBS_DATABASE_URL=database_url,
        JOBS_REDIS_URL=redis_url,
        JOBS_ARTIFACTS=str(tmp / "artifacts"),
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        OMP_NUM_THREADS="1",  # CPU workers share 2 cores with the API and the test: one torch thread each
        # CI's disk can have under the 1 GiB a download must leave free; the tests of that floor set their own.
        JOBS_HUB_MIN_FREE_BYTES="0",
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request, tmp_path) -> str:
    """Each test using this runs on SQLite and on Postgres."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'jobs.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'jobs.db'}"


@pytest.fixture
def jobs_env(tmp_path, redis_server, sqlite_url, monkeypatch) -> Iterator[JobsEnv]:  # noqa: F811
    """Fresh settings for this process: a migrated SQLite store (override with `jobs_env_for`), a clean Redis."""
    yield from _jobs_env(tmp_path, redis_server, sqlite_url, monkeypatch)


def _jobs_env(tmp_path, redis_server, database_url, monkeypatch) -> Iterator[JobsEnv]:  # noqa: F811
    env = make_env(tmp_path, database_url, redis_server.url)
    for key in [k for k in os.environ if k.startswith("JOBS_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    redis_server.client().flushall()
    reset_caches()
    from core.db import upgrade

    upgrade()
    yield JobsEnv(Path(env["JOBS_HOME"]), database_url, redis_server.url, env)
    reset_caches()


@pytest.fixture
def pg_jobs_env(tmp_path, redis_server, postgres_url, monkeypatch) -> Iterator[JobsEnv]:  # noqa: F811
    yield from _jobs_env(tmp_path, redis_server, postgres_url, monkeypatch)


@pytest.fixture
def private_pg_jobs_env(tmp_path, redis_server, private_postgres, monkeypatch) -> Iterator[JobsEnv]:  # noqa: F811
    """jobs_env on a PostgreSQL server of the test's own, which the test may stop and start."""
    yield from _jobs_env(tmp_path, redis_server, private_postgres.url, monkeypatch)


@pytest.fixture
def any_jobs_env(tmp_path, redis_server, database_url, monkeypatch) -> Iterator[JobsEnv]:  # noqa: F811
    """jobs_env on SQLite and on Postgres."""
    yield from _jobs_env(tmp_path, redis_server, database_url, monkeypatch)


def run_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of this test run that every xdist process of the run shares (pytest's base temp of the run; under
    xdist each process has its own below it). Gone with the run's temp dir, like tmp_path: nothing outlives a run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def shared_build(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Path:
    """`build(out)` once per test run, whichever xdist process asks first; the others wait on a file lock and reuse
    its result (read-only by convention, as a session fixture's). Each build gets a directory of its own,
    `<run>/built-<name>/<name>`, so a model's parent directory holds that model only (tests use it as a model root).
    A build that fails leaves no marker: the next process to ask builds again, and fails alike."""
    from filelock import FileLock

    root = run_tmp(tmp_path_factory)
    folder, done = root / f"built-{name}", root / f"built-{name}.done"
    with FileLock(str(root / f"built-{name}.lock")):
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed half way
            build(folder / name)
            done.touch()
    return folder / name


@pytest.fixture(scope="session", autouse=True)
def run_inductor_cache(tmp_path_factory) -> Iterator[Path]:
    """One Inductor cache folder for every process this run starts (TORCHINDUCTOR_CACHE_DIR, unless already set;
    a worker then keeps it instead of JOBS_HOME/compile-cache, as it keeps an operator's own).

    A CPU worker's flex_attention probe compiles flex_attention in a child process (about 13-20 s of CPU at niceness
    19) unless a success is remembered in Inductor's cache folder (worker/capabilities.py). With a folder per
    JOBS_HOME, every worker of every test probed again; measured alone on a quiet 2-core box, the probes were half
    the CPU of test_recovery's SIGKILL test (47 CPU-seconds, 22 with a success remembered) and a third of
    test_cli's demo (37, 24). With one folder per run, the first probe that finishes is remembered by every worker
    started after it. tests/test_compile_cache.py removes the variable (it tests the
    JOBS_HOME folder); tests/test_failures.py sets a folder of its own (its compiler is broken on purpose)."""
    mp = pytest.MonkeyPatch()
    mp.setenv(
        "TORCHINDUCTOR_CACHE_DIR",
        os.environ.get("TORCHINDUCTOR_CACHE_DIR") or str(run_tmp(tmp_path_factory) / "inductor"),
    )
    yield Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    mp.undo()


def build_tiny(out: Path, *args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "worker.tinymodel", str(out), "--qa", str(ROOT / "examples" / "qa.jsonl"), *args],
        check=True,
        cwd=ROOT,
        capture_output=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 model + tokenizer that has memorized examples/qa.jsonl (answers are asserted exactly)."""
    return shared_build(tmp_path_factory, "tiny-qa", build_tiny)


@pytest.fixture(scope="session")
def base_model(tmp_path_factory) -> Path:
    """A tiny Qwen3 *base* model: its tokenizer knows examples/qa.jsonl's words, its weights know no answer (a LoRA
    fine-tune teaches them)."""
    return shared_build(tmp_path_factory, "tiny-base", lambda out: build_tiny(out, "--base"))


def qa_pairs() -> list[tuple[str, str]]:
    import json

    lines = (ROOT / "examples" / "qa.jsonl").read_text().splitlines()
    return [(d["question"], d["answer"]) for d in map(json.loads, lines) if d]


# --- processes ------------------------------------------------------------------------------------------------


class Proc:
    def __init__(self, popen: subprocess.Popen, log: Path):
        self.popen, self.log = popen, log

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()

    def tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2, procs: list[Proc] = ()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if not p.alive():
                raise AssertionError(f"process {p.pid} died while waiting for {what}:\n{p.tail()}")
        time.sleep(interval)
    logs = "\n".join(p.tail() for p in procs)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n{logs}")


@pytest.fixture
def spawn_worker(tmp_path) -> Iterator:
    """Start real worker processes (`python -m worker.main`) pinned like `jobs worker` does; wait until registered
    and started (`started`), so that a test's own waits time its job, not the worker importing torch.

    Workers inherit this process's environment as set by `jobs_env` / `pg_jobs_env` (request one of them first),
    plus any JOBS_* overrides given as keywords."""
    from core.slices import worker_command, worker_env

    procs: list[Proc] = []

    def spawn(devices: list[str] | None = None, *, wait: bool = True, **extra: str) -> Proc:
        devices = devices or []
        env = worker_env(devices, {**os.environ, **extra})
        log = tmp_path / f"worker-{len(procs)}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                worker_command(devices),
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        proc = Proc(popen, log)
        procs.append(proc)
        if wait:
            url = env["JOBS_DATABASE_URL"]
            wait_for(lambda: registered(url, proc.pid), 90, "worker registration", procs=[proc])
            # a worker may die by design once registered (a test fault on its first job): the test sees that itself
            wait_for(lambda: started(url, proc.pid) or not proc.alive(), 180, "worker start-up (its QLoRA probe)")
        return proc

    yield spawn
    stop_all(procs)


def stop_all(procs: list[Proc], timeout: float = 20) -> None:
    """Proc.stop for several at once: SIGTERM to all, then wait for each (a worker's warm shutdown takes seconds;
    one after another, a test's teardown waited for the sum)."""
    for p in procs:
        if p.alive():
            p.popen.terminate()
    for p in procs:
        p.stop(timeout)


def started(database_url: str, pid: int) -> bool:
    """Registered online and done with its start-up: its registration has the QLoRA probe's answer (it runs before
    the worker registers, after its heavy imports: worker/preload.py; a worker of an older layout recorded it
    later, from a thread)."""
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import Worker

    with session_scope(database_url) as session:
        caps = session.scalar(select(Worker.capabilities).where(Worker.pid == pid, Worker.state == "online"))
        return caps is not None and "qlora" in caps


def registered(database_url: str, pid: int) -> bool:
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import Worker

    with session_scope(database_url) as session:
        return session.scalar(select(Worker.name).where(Worker.pid == pid, Worker.state == "online")) is not None


@pytest.fixture
def api_server(tmp_path, jobs_env) -> Iterator[tuple[str, str, Proc]]:
    """A real API server (uvicorn) on a free port; yields (url, admin token, process)."""
    import httpx

    from core import auth
    from core.db import session_scope
    from core.embedded import free_port

    with session_scope() as session:
        token = auth.create_token(session, owner="alice", scopes=["admin", "user"], name="tests")
    port = free_port()
    log = tmp_path / "api.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "api.app:app", "--port", str(port)],
            env=jobs_env.env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    proc = Proc(popen, log)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 60, "the API server", procs=[proc])
    yield url, token, proc
    proc.stop()
