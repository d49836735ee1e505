"""The deployment files follow the code: compose.yaml is valid Compose and every command it names runs here
(migrations, the API, the workers, Redis), pinned as the file says; the bare-host launcher and the systemd units
start real, pinned workers.

The tests read compose.yaml itself (pyyaml, anchors merged, ${VAR} interpolated), so they follow the file.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import yaml

from api.stack import alive, detect_gpus
from core.embedded import find_redis_server, free_port
from tests.conftest import ROOT, Proc, registered, wait_for
from tests.services import require_service

COMPOSE = ROOT / "compose.yaml"
LAUNCHER = ROOT / "ops" / "launch-workers.sh"
SYSTEMD = ROOT / "ops" / "systemd"
# The variables compose.yaml requires (${VAR:?}); everything else keeps its default.
COMPOSE_ENV = {"REDIS_PASSWORD": "redis-test-secret", "POSTGRES_PASSWORD": "pg-test-secret"}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# --- reading compose.yaml as Compose does ---------------------------------------------------------------------

_VARIABLE = re.compile(r"\$(?:(\$)|\{(\w+)(?:(:?[-?])([^}]*))?\}|(\w+))")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's interpolation: $$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}, ${VAR?error}."""

    def value(m: re.Match) -> str:
        if m.group(1):
            return "$"
        name, op, arg = m.group(2) or m.group(5), m.group(3), m.group(4)
        current = env.get(name)
        missing = not current if op and op.startswith(":") else current is None
        if op and op.endswith("-"):
            return arg if missing else current
        if op and op.endswith("?") and missing:
            raise KeyError(f"compose.yaml needs {name}: {arg}")
        return current or ""

    return _VARIABLE.sub(value, text)


def resolved(node, env: dict[str, str]):
    if isinstance(node, str):
        return interpolate(node, env)
    if isinstance(node, dict):
        return {k: resolved(v, env) for k, v in node.items()}
    if isinstance(node, list):
        return [resolved(v, env) for v in node]
    return node


@cache
def compose() -> dict:
    return resolved(yaml.safe_load(COMPOSE.read_text()), COMPOSE_ENV)


def service(name: str) -> dict:
    return compose()["services"][name]


def command(name: str) -> list[str]:
    cmd = service(name)["command"]
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def environment(name: str) -> dict[str, str]:
    env = service(name).get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def worker_services() -> list[str]:
    return [name for name in yaml.safe_load(COMPOSE.read_text())["services"] if name.startswith("worker")]


def local_argv(argv: list[str]) -> list[str]:
    """The container's program, from this checkout: `jobs` is `python -m api`, `python` is this interpreter."""
    program, *rest = argv
    if program == "jobs":
        return [sys.executable, "-m", "api", *rest]
    if program == "python":
        return [sys.executable, *rest]
    return argv


def local_env(base: dict[str, str], name: str, tmp_path: Path, **overrides: str) -> dict[str, str]:
    """The service's environment from compose.yaml, with its URLs and paths pointed at this machine."""
    env = {**base, **environment(name)}
    env.update(
        JOBS_HOME=str(tmp_path / "home"),
        JOBS_ARTIFACTS=str(tmp_path / "artifacts"),
        JOBS_MODEL_ROOTS=str(tmp_path / "models"),
        JOBS_DATA_ROOTS=str(tmp_path / "data"),
    )
    env.update(overrides)
    return env


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1", **extra)
    return env


def celery_ready(log: Path) -> bool:
    """The worker consumes (Celery's signal handlers are in place: SIGTERM is a clean stop from now on)."""
    return " ready." in log.read_text(errors="replace")


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# A worker whose slice's GPUs are missing refuses to start (exit 6, tests/test_watchdog.py); where they are missing
# (a CPU host) these tests start the launchers' GPU-slice workers anyway, to check their pinning, start and stop.
MISSING_GPUS_OK = {"JOBS_TEST_MISSING_GPUS_OK": "1"}


def worker_row(database_url: str, pid: int):
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import Worker

    with session_scope(database_url) as session:
        return session.scalars(select(Worker).where(Worker.pid == pid)).one()


# --- the image: what `pip install .` puts in it ------------------------------------------------------------------


def test_the_installed_distribution_holds_every_package_of_ours():
    """The image installs the project with `pip install .` (not editable), which copies only the packages that
    pyproject.toml names: every folder of ours with an `__init__.py` (worker/engines/, worker/training/ …) is named
    there, or the image would start workers without their engines or training code."""
    import tomllib

    named = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    ours = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("core", "api", "worker", "migrations")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert ours <= named, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(ours - named)}"


# --- compose.yaml: valid, and wired as the design says ----------------------------------------------------------


def test_compose_file_validates_with_docker_compose():
    """`docker-compose config` (Compose's own schema, interpolation and references) accepts compose.yaml, and
    refuses it when REDIS_PASSWORD is not set."""
    if not shutil.which("docker-compose"):
        require_service("docker-compose", "apt-get install --no-install-recommends docker-compose")
    base = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/root")}
    ok = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"],
        env={**base, **COMPOSE_ENV},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    missing = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), "config", "-q"],
        env={**base, "POSTGRES_PASSWORD": "x"},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode != 0 and "REDIS_PASSWORD" in missing.stderr


def test_compose_starts_services_in_order_with_shared_artifacts_and_models():
    """migrate waits for a healthy Postgres; the API and every worker wait for migrate to finish and for a
    healthy Redis; the API and every worker mount the same artifacts and models volumes at JOBS_ARTIFACTS and
    JOBS_MODEL_ROOTS."""
    assert service("migrate")["depends_on"] == {"postgres": {"condition": "service_healthy"}}
    assert worker_services(), "compose.yaml has no worker service"
    for name in ["api", *worker_services()]:
        assert service(name)["depends_on"] == {
            "migrate": {"condition": "service_completed_successfully"},
            "redis": {"condition": "service_healthy"},
        }, name
        env = environment(name)
        mounts = {v.split(":")[1]: v.split(":")[0] for v in service(name)["volumes"]}
        assert mounts[env["JOBS_ARTIFACTS"]] == "artifacts", name
        assert mounts[env["JOBS_MODEL_ROOTS"]] == "models", name
        assert env["JOBS_DATABASE_URL"].startswith("postgresql+psycopg://jobs:pg-test-secret@postgres:5432/")
        assert env["JOBS_REDIS_URL"] == "redis://:redis-test-secret@redis:6379/0"
    for name in ("redis", "postgres", "api"):
        assert service(name)["healthcheck"]["test"], name


def test_each_worker_service_reserves_its_own_gpus_and_names_them_as_the_container_sees_them():
    """Each worker reserves host GPUs by device_ids and runs `jobs worker --gpus` with the container's own
    indices (0..n-1: the reserved GPUs, renumbered), CUDA_VISIBLE_DEVICES the same and PCI bus order; no two
    workers reserve the same host GPU."""
    reserved: dict[str, str] = {}
    for name in worker_services():
        devices = service(name)["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        host_ids = [str(d) for d in devices[0]["device_ids"]]
        for gpu in host_ids:
            assert gpu not in reserved, f"host GPU {gpu} is reserved by {reserved.get(gpu)} and {name}"
            reserved[gpu] = name
        inside = ",".join(str(i) for i in range(len(host_ids)))
        cmd = command(name)
        assert cmd[:2] == ["jobs", "worker"] and cmd[cmd.index("--gpus") + 1] == inside, (name, cmd)
        env = environment(name)
        assert env["CUDA_VISIBLE_DEVICES"] == inside and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", name
        assert {k: env[k] for k in MULTICAST_OFF} == MULTICAST_OFF, name


def test_compose_restarts_workers_and_every_long_running_service():
    """Every worker service, the API, Redis and Postgres restart when they exit (unless stopped on purpose); the
    one-shot migration does not."""
    for name in [*worker_services(), "api", "redis", "postgres"]:
        assert service(name)["restart"] == "unless-stopped", name
    assert service("migrate")["restart"] == "no"


# --- every command of compose.yaml runs here ----------------------------------------------------------------


def test_migrate_command_brings_a_blank_database_to_head(tmp_path, database_url):
    """The migrate service's command (`jobs db upgrade`), run here against a blank SQLite file and a blank
    Postgres database, exits 0 and leaves the schema at the migrations' head."""
    from alembic.script import ScriptDirectory
    from sqlalchemy import create_engine, inspect, text

    from core.db import alembic_config

    env = local_env(clean_env(), "migrate", tmp_path, JOBS_DATABASE_URL=database_url)
    result = subprocess.run(
        local_argv(command("migrate")), env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            version = conn.execute(text("select version_num from alembic_version")).scalar_one()
            assert "workers" in inspect(conn).get_table_names()
    finally:
        engine.dispose()
    assert version == ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()


def test_api_command_serves_healthz_and_its_healthcheck_passes(tmp_path, jobs_env):
    """The api service's command (host and port put on this machine) serves /healthz with the database and
    Redis up; the service's healthcheck command passes against it, and fails once the server is gone."""
    import httpx

    port = free_port()
    argv = local_argv(command("api"))
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    env = local_env(
        jobs_env.env, "api", tmp_path, JOBS_DATABASE_URL=jobs_env.database_url, JOBS_REDIS_URL=jobs_env.redis_url
    )
    log = tmp_path / "api.log"
    with open(log, "wb") as out:
        proc = Proc(subprocess.Popen(argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT), log)

    def healthy() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    test = service("api")["healthcheck"]["test"]
    assert test[0] == "CMD"
    check = [arg.replace("8765", str(port)) for arg in local_argv(test[1:])]
    try:
        wait_for(healthy, 60, "the API's /healthz", procs=[proc])
        assert subprocess.run(check, env=env, capture_output=True, timeout=30).returncode == 0
    finally:
        proc.stop()
    assert subprocess.run(check, env=env, capture_output=True, timeout=30).returncode != 0


@pytest.mark.parametrize("name", worker_services())
def test_worker_command_runs_a_worker_pinned_as_compose_says(tmp_path, jobs_env, name):
    """A worker service's command, run here with that service's environment, becomes a registered worker whose
    real environment (/proc/PID/environ) has CUDA_DEVICE_ORDER=PCI_BUS_ID, the file's CUDA_VISIBLE_DEVICES and
    NVLink multicast off; its registration records what CUDA gave it (no device on a CPU machine)."""
    wanted = environment(name)["CUDA_VISIBLE_DEVICES"]
    env = local_env(
        jobs_env.env,
        name,
        tmp_path,
        JOBS_DATABASE_URL=jobs_env.database_url,
        JOBS_REDIS_URL=jobs_env.redis_url,
        **MISSING_GPUS_OK,
    )
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            local_argv(command(name)), env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    proc = Proc(popen, log)
    try:
        wait_for(lambda: registered(jobs_env.database_url, proc.pid), 90, f"{name} registration", procs=[proc])
        real = environ_of(proc.pid)  # the same pid: `jobs worker` execs the worker in place
        assert real["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert real["CUDA_VISIBLE_DEVICES"] == wanted
        assert {k: real[k] for k in MULTICAST_OFF} == MULTICAST_OFF
        row = worker_row(jobs_env.database_url, proc.pid)
        assert row.slice == wanted and row.capabilities["cuda_visible_devices"] == wanted
        assert row.capabilities["cuda_available"] is bool(detect_gpus())
        wait_for(lambda: celery_ready(log), 60, f"{name} consuming", procs=[proc])
    finally:
        proc.stop()
    assert worker_row(jobs_env.database_url, proc.pid).state == "offline"  # SIGTERM is a clean stop


def test_redis_command_requires_the_password_the_urls_carry(tmp_path):
    """The redis service's command, run here on a free port, refuses clients without the password and
    answers the JOBS_REDIS_URL that compose.yaml gives the other services."""
    import redis

    from core.embedded import stop_process

    argv = command("redis")
    assert argv[0] == "redis-server"
    port = free_port()
    argv = [
        find_redis_server(),
        *argv[1:],
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--dir",
        str(tmp_path),
        "--save",
        "",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = environment("api")["JOBS_REDIS_URL"].replace("@redis:6379", f"@127.0.0.1:{port}")
        client = redis.Redis.from_url(url, socket_connect_timeout=2)
        wait_for(lambda: _pings(client), 20, "redis-server")
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_connect_timeout=2).ping()
        if shutil.which("redis-cli"):  # the healthcheck, as the container runs it (REDISCLI_AUTH from the file)
            test = service("redis")["healthcheck"]["test"]
            assert test[0] == "CMD-SHELL"
            shell = test[1].replace("redis-cli", f"redis-cli -p {port}")
            env = {"PATH": os.environ["PATH"], **environment("redis")}
            assert subprocess.run(["sh", "-c", shell], env=env, timeout=20).returncode == 0
            assert subprocess.run(["sh", "-c", shell], env={**env, "REDISCLI_AUTH": "wrong"}, timeout=20).returncode
    finally:
        stop_process(proc)


def _pings(client) -> bool:
    import redis

    try:
        return client.ping()
    except redis.ConnectionError:
        return False


# --- the bare-host launcher -----------------------------------------------------------------------------------


def launcher(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(LAUNCHER), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_launcher_script_is_clean_bash():
    """ops/launch-workers.sh parses (bash -n) and, where shellcheck is installed, passes it."""
    assert subprocess.run(["bash", "-n", str(LAUNCHER)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        result = subprocess.run(["shellcheck", str(LAUNCHER)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["0,1", "1"], "two workers never share a GPU"),
        (["2", "2"], "given twice"),
        (["0,0"], "names GPU 0 twice"),
        (["cuda:0"], "bad GPU"),
    ],
)
def test_launcher_refuses_bad_or_overlapping_slices_before_starting_anything(tmp_path, args, message):
    """Overlapping, repeated or malformed slices are refused with exit 5 (GPU conflict) or 2 (usage), and no
    worker is started."""
    env = clean_env(JOBS_HOME=str(tmp_path / "home"))
    result = launcher(env, *args)
    assert result.returncode in (2, 5) and message in result.stderr, result.stderr
    assert not list((tmp_path / "home" / "run").glob("worker-*.pid"))


def test_launcher_refuses_slices_outside_an_inherited_cuda_visible_devices(tmp_path):
    """With CUDA_VISIBLE_DEVICES=0,1 inherited (a scheduler's allocation), a slice using GPU 2 is refused
    (exit 5)."""
    env = clean_env(JOBS_HOME=str(tmp_path / "home"), CUDA_VISIBLE_DEVICES="0,1")
    result = launcher(env, "0", "2")
    assert result.returncode == 5 and "CUDA_VISIBLE_DEVICES='0,1'" in result.stderr, result.stderr


@pytest.mark.slow
def test_launcher_starts_one_pinned_worker_per_slice_restarts_a_killed_one_and_stops_them(tmp_path, jobs_env):
    """`launch-workers.sh 0,1 2` starts two supervised workers, each with its pid file (the supervisor's), log and
    own CUDA_VISIBLE_DEVICES; a worker killed with SIGKILL is started again by its supervisor (registered with
    restarts=1); a slice overlapping a running worker is refused; `stop` ends supervisors and workers (they
    register offline) and removes the pid files."""
    home = tmp_path / "home"
    bin_dir = str(Path(sys.executable).parent)  # this environment's `jobs`
    env = dict(jobs_env.env, JOBS_HOME=str(home), PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **MISSING_GPUS_OK)
    run_dir = home / "run"
    try:
        result = launcher(env, "0,1", "2")
        assert result.returncode == 0, result.stdout + result.stderr
        supervisors, pids = {}, {}
        for slice_, tag in (("0,1", "0-1"), ("2", "2")):
            pid_text, recorded = (run_dir / f"worker-{tag}.pid").read_text().split()
            assert recorded == slice_ and (home / "logs" / f"worker-{tag}.log").exists()
            supervisors[slice_] = int(pid_text)
            [pids[slice_]] = wait_for(lambda s=int(pid_text): children(s), 30, f"the worker of slice {slice_}")
        for slice_, pid in pids.items():
            wait_for(lambda pid=pid: registered(jobs_env.database_url, pid), 90, f"worker {slice_} registration")
            real = environ_of(pid)
            assert real["CUDA_VISIBLE_DEVICES"] == slice_ and real["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
            assert worker_row(jobs_env.database_url, pid).slice == slice_
            log = home / "logs" / f"worker-{slice_.replace(',', '-')}.log"
            wait_for(lambda log=log: celery_ready(log), 60, f"worker {slice_} consuming")

        os.kill(pids["2"], signal.SIGKILL)
        [again] = wait_for(lambda: [c for c in children(supervisors["2"]) if c != pids["2"]], 60, "the restart")
        wait_for(lambda: registered(jobs_env.database_url, again), 90, "the restarted worker's registration")
        assert worker_row(jobs_env.database_url, again).restarts == 1
        assert worker_row(jobs_env.database_url, pids["2"]).exit_code == -9
        pids["2 (restarted)"] = again

        overlap = launcher(env, "1,3")
        assert overlap.returncode == 5 and "two workers never share a GPU" in overlap.stderr
        assert sorted(p.name for p in run_dir.glob("worker-*.pid")) == ["worker-0-1.pid", "worker-2.pid"]

        status = launcher(env, "status")
        assert status.returncode == 0 and status.stdout.count("running") == 2, status.stdout

        stopped = launcher(env, "stop", timeout=180)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr
        assert not list(run_dir.glob("worker-*.pid"))
        assert not [p for p in supervisors.values() if alive(p)]
        for pid in pids.values():
            assert not alive(pid)
            assert worker_row(jobs_env.database_url, pid).state == "offline"
    finally:
        for pid_file in run_dir.glob("worker-*.pid"):  # a failed assertion above must not leave workers behind
            pid = int(pid_file.read_text().split()[0])
            if alive(pid) and "supervise" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                for child in children(pid):
                    os.kill(child, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)


# --- systemd units --------------------------------------------------------------------------------------------


def unit_lines(name: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in (SYSTEMD / name).read_text().splitlines() if line.startswith(f"{key}=")]


def test_worker_unit_takes_its_slice_from_the_instance_name():
    """gpujobs-worker@.service runs `jobs worker --gpus %I` (the unescaped instance name), so
    gpujobs-worker@2\\x2c3.service (systemd-escape's spelling of 2,3) runs the slice 2,3; both units read
    /etc/gpujobs/env."""
    assert unit_lines("gpujobs-worker@.service", "ExecStart")[0].endswith(" worker --gpus %I")
    for unit in ("gpujobs-worker@.service", "gpujobs-api.service"):
        assert unit_lines(unit, "EnvironmentFile") == ["/etc/gpujobs/env"], unit
    if not shutil.which("systemd-escape"):
        pytest.skip("systemd-escape is not installed")
    escaped = subprocess.run(["systemd-escape", "2,3"], capture_output=True, text=True, check=True).stdout.strip()
    assert escaped == "2\\x2c3"
    assert (
        subprocess.run(["systemd-escape", "-u", escaped], capture_output=True, text=True, check=True).stdout.strip()
        == "2,3"
    )


def test_worker_unit_restarts_a_failed_worker_except_configuration_errors_within_a_cap():
    """The worker unit restarts a worker that failed (a crash, a kill, a stall), never one that exited with a
    configuration error (2, 5, 6, 77, 78: core/exits.py's CONFIGURATION), and gives up after 5 starts in 10 minutes."""
    from core.exits import CONFIGURATION

    unit = "gpujobs-worker@.service"
    assert unit_lines(unit, "Restart") == ["on-failure"]
    assert {int(c) for c in unit_lines(unit, "RestartPreventExitStatus")[0].split()} == set(CONFIGURATION)
    assert (unit_lines(unit, "StartLimitIntervalSec"), unit_lines(unit, "StartLimitBurst")) == (["600"], ["5"])


def test_the_readme_lists_every_worker_exit_code_and_whether_it_is_restarted():
    """README's "Worker exit codes" table has a row for each code of core/exits.py, and says "yes" to a restart
    exactly where core.exits.restartable does (0: no, a clean stop)."""
    from core import exits

    text = (ROOT / "README.md").read_text().split("### Worker exit codes", 1)[1].split("\n#", 1)[0]
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    table = {int(code): restart.strip() for code, _, restart in rows}
    assert set(table) == set(exits.MEANINGS)
    assert {c for c, r in table.items() if r.startswith("yes")} == {c for c in table if exits.restartable(c)}


def test_systemd_units_verify(tmp_path):
    """systemd-analyze verify accepts both units (a slice instance and the API), with their programs pointed at
    this environment."""
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed")
    prefix = str(Path(sys.executable).parent.parent)
    names = {"gpujobs-api.service": "gpujobs-api.service", "gpujobs-worker@.service": "gpujobs-worker@2\\x2c3.service"}
    for source, target in names.items():
        text = (SYSTEMD / source).read_text().replace("/opt/gpujobs/venv", prefix)
        (tmp_path / target).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / t) for t in names.values()]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    ours = [line for line in result.stderr.splitlines() if "gpujobs" in line]
    assert result.returncode == 0 and not ours, result.stderr
