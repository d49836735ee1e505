"""Hosts as Linux network namespaces on one machine, for cross-host tests. Root and iproute2 only.

Not a conftest: tests/test_netns.py builds its fixture from these helpers.

Topology (one per test, names and subnet unique to this run):

    namespace gj<pid>n<k>hub   bridge br0 10.231.X.1/24: Redis :6379 (password), PostgreSQL :5432, the API :8765
      |-- port-a  <veth>  eth0 10.231.X.2/24   namespace gj<pid>n<k>a   (worker host "host-a")
      |-- port-b  <veth>  eth0 10.231.X.3/24   namespace gj<pid>n<k>b   (worker host "host-b")
      `-- port-root <veth> gj<pid>n<k>r 10.231.X.254/24 in the root namespace (the test process: SQL reads, the client)

Only these addresses are ever contacted. Every namespace has only the connected /24 route (no default route), so
nothing inside can reach anything else. `cut(host, how)` takes a host off the network ("cable": its link loses
carrier; "switch": its link stays up and its frames go nowhere), `restore(host, how)` brings it back.

`Cluster.close()` kills what it started (by pid: the processes of the namespaces this run created, all of them
its own children), deletes the namespaces (which deletes every veth and the bridge) and the temp directories.
It never raises, so it can run from a finalizer after any failure.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import ROOT, Proc, make_env, registered, wait_for

NET = "10.231"  # the /16 the subnets are taken from: 10.231.X.0/24, X unique per live topology
HUB_HOST = 1
ROOT_HOST = 254
REDIS_PORT, PG_PORT, API_PORT = 6379, 5432, 8765  # fixed: each hub namespace has its own ports
LOCK_FILE = "/tmp/gpujobs-netns.lock"
_counter = 0


# --- can this machine do it? ----------------------------------------------------------------------------------


def unavailable() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if not shutil.which("ip"):
        return "the `ip` command is missing (apt install iproute2)"
    if not shutil.which("runuser"):
        return "`runuser` is missing (util-linux): PostgreSQL must run as the postgres user"
    probe = f"gj{os.getpid()}probe"
    out = subprocess.run(["ip", "netns", "add", probe], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        return f"`ip netns add` failed: {out.stderr.strip()} (a container needs CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    try:
        out = subprocess.run(
            ["ip", "-n", probe, "link", "add", "br0", "type", "bridge"], check=False, capture_output=True, text=True
        )
        if out.returncode != 0:
            return f"cannot create a bridge in a namespace: {out.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def pg_bindir() -> Path | None:
    """The PostgreSQL server binaries (initdb, pg_ctl, postgres): PATH, else the newest /usr/lib/postgresql/N/bin.
    None without them or without the `postgres` user they run as."""
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return None
    found = shutil.which("initdb")
    if found and shutil.which("pg_ctl"):
        return Path(found).parent
    versions = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/initdb"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    return versions[-1].parent if versions else None


# --- ip(8) -----------------------------------------------------------------------------------------------------


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["ip", *args], check=False, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _used_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 route and address of the root namespace (the default route aside)."""
    nets = []
    for line in ip("-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("broadcast", "local", "unicast", "multicast"):
            first = line.split()[1]
        if first != "default":
            try:
                nets.append(ipaddress.ip_network(first, strict=False))
            except ValueError:
                pass
    for line in ip("-4", "-o", "addr", "show").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_interface(parts[parts.index("inet") + 1]).network)
    return nets


# --- the cluster -----------------------------------------------------------------------------------------------


@dataclass
class Cluster:
    name: str  # gj<pid>n<k>: prefix of the namespaces and of the root veth
    hosts: tuple[str, ...]
    workdir: Path  # temp dir (mode 755: PostgreSQL runs as postgres inside it)
    subnet: int = -1
    namespaces: list[str] = field(default_factory=list)
    procs: list[Proc] = field(default_factory=list)
    pg_data: Path | None = None
    pg_bin: Path | None = None
    redis_password: str = field(default_factory=lambda: secrets.token_hex(16))
    token: str | None = None
    cut_hosts: set[str] = field(default_factory=set)

    # names and addresses
    @property
    def hub(self) -> str:
        return f"{self.name}hub"

    def ns(self, host: str) -> str:
        return f"{self.name}{host}"

    @property
    def root_veth(self) -> str:
        return f"{self.name}r"

    def addr(self, host: str) -> str:
        """The address of `host` ('hub', 'root' or a worker host) on the bridge."""
        if host == "hub":
            return f"{NET}.{self.subnet}.{HUB_HOST}"
        if host == "root":
            return f"{NET}.{self.subnet}.{ROOT_HOST}"
        return f"{NET}.{self.subnet}.{2 + self.hosts.index(host)}"

    @property
    def database_url(self) -> str:
        return f"postgresql+psycopg://postgres@{self.addr('hub')}:{PG_PORT}/jobs"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@{self.addr('hub')}:{REDIS_PORT}/0"

    @property
    def api_url(self) -> str:
        return f"http://{self.addr('hub')}:{API_PORT}"

    @property
    def artifacts(self) -> Path:
        return self.workdir / "artifacts"  # one directory for every "host": the shared filesystem

    # --- network ---

    def create_network(self) -> None:
        """The namespaces, the bridge in the hub, one veth per host and one to the root namespace."""
        with open(LOCK_FILE, "a") as lock:  # two runs at once must not take the same subnet
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = self._free_subnet()
            for ns in [self.hub, *(self.ns(h) for h in self.hosts)]:
                ip("netns", "add", ns)
                self.namespaces.append(ns)
                ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            ip("-n", self.hub, "addr", "add", f"{self.addr('hub')}/24", "dev", "br0")
            ip("-n", self.hub, "link", "set", "br0", "up")
            for host in self.hosts:
                ip(
                    "-n",
                    self.hub,
                    "link",
                    "add",
                    f"port-{host}",
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    self.ns(host),
                )
                ip("-n", self.hub, "link", "set", f"port-{host}", "master", "br0", "up")
                ip("-n", self.ns(host), "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
                ip("-n", self.ns(host), "link", "set", "eth0", "up")
            ip(
                "-n",
                self.hub,
                "link",
                "add",
                "port-root",
                "type",
                "veth",
                "peer",
                "name",
                self.root_veth,
                "netns",
                str(os.getpid()),
            )
            ip("-n", self.hub, "link", "set", "port-root", "master", "br0", "up")
            ip("addr", "add", f"{self.addr('root')}/24", "dev", self.root_veth)
            ip("link", "set", self.root_veth, "up")

    def _free_subnet(self) -> int:
        used = _used_networks()
        start = os.getpid() % 250
        for i in range(250):
            x = 1 + (start + i) % 250
            net = ipaddress.ip_network(f"{NET}.{x}.0/24")
            if not any(net.overlaps(u) for u in used):
                return x
        raise RuntimeError(f"no free /24 in {NET}.0.0/16 on this machine (every one overlaps a route)")

    def cut(self, host: str, how: str = "cable") -> None:
        """Cut `host` off the network, two ways:

        - "cable": the hub side of its veth goes down, its eth0 loses carrier (a pulled cable, a dead switch port).
          The host's kernel drops what it sends at once: established TCP connections keep retrying every 0.5 s,
          new connections fail after ~3 s with "No route to host".
        - "switch": its veth is taken off the bridge; both ends stay up, frames go nowhere (a switch or router
          that stops forwarding). Nothing fails: TCP retransmits with exponential backoff and connects hang.
        """
        if how == "cable":
            ip("-n", self.hub, "link", "set", f"port-{host}", "down")
        elif how == "switch":
            ip("-n", self.hub, "link", "set", f"port-{host}", "nomaster")
        else:
            raise ValueError(f"cut how={how!r}: 'cable' or 'switch'")
        self.cut_hosts.add(host)

    def restore(self, host: str, how: str = "cable") -> None:
        if how == "cable":
            ip("-n", self.hub, "link", "set", f"port-{host}", "up")
        else:
            ip("-n", self.hub, "link", "set", f"port-{host}", "master", "br0")
        self.cut_hosts.discard(host)

    def exec_in(self, host: str, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.hub if host == "hub" else self.ns(host), *cmd]

    # --- processes ---

    def spawn(self, host: str, cmd: list[str], env: dict[str, str], log_name: str) -> Proc:
        """Start `cmd` inside `host`'s namespace (`ip netns exec` execs it: the pid is the command's own)."""
        log = self.workdir / "logs" / log_name
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                self.exec_in(host, cmd),
                env=env,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc = Proc(popen, log)
        proc.host = host  # close() kills processes of a host that is cut off at once: they could not finish
        self.procs.append(proc)
        return proc

    def env(self, home: str, **extra: str) -> dict[str, str]:
        """A process environment (tests.conftest.make_env) pointed at the hub's Redis and PostgreSQL."""
        env = make_env(self.workdir, self.database_url, self.redis_url, **extra)
        env["JOBS_HOME"] = str(self.workdir / home)
        env["JOBS_ARTIFACTS"] = str(self.artifacts)
        return env

    def start_redis(self) -> None:
        from core.embedded import find_redis_server

        workdir = self.workdir / "redis"
        workdir.mkdir()
        cmd = [
            find_redis_server(),
            "--bind",
            self.addr("hub"),
            "--port",
            str(REDIS_PORT),
            "--requirepass",
            self.redis_password,
            "--protected-mode",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(workdir),
            "--logfile",
            "",
        ]
        proc = self.spawn("hub", cmd, dict(os.environ), "redis.log")
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=1, socket_timeout=2)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except (redis.RedisError, OSError):
                return False

        wait_for(answers, 20, "redis-server in the hub namespace", procs=[proc])

    def start_postgres(self, pg_bin: Path) -> None:
        """initdb + pg_ctl as the postgres user (as .ci/run does), listening on the hub address, trust auth for
        the bridge subnet, durability off (a throwaway cluster)."""
        self.pg_bin = pg_bin
        root = self.workdir / "pg"
        root.mkdir()
        shutil.chown(root, "postgres", "postgres")
        self.pg_data = root / "data"
        self._as_postgres(
            [
                str(pg_bin / "initdb"),
                "-D",
                str(self.pg_data),
                "-U",
                "postgres",
                "--auth=trust",
                "--no-locale",
                "-E",
                "UTF8",
            ],
            root / "initdb.log",
        )
        with open(self.pg_data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {NET}.{self.subnet}.0/24 trust\n")
        options = (
            f"-p {PG_PORT} -k {root} -c listen_addresses={self.addr('hub')} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        self._as_postgres(
            self.exec_in(
                "hub",
                [
                    "runuser",
                    "-u",
                    "postgres",
                    "--",
                    str(pg_bin / "pg_ctl"),
                    "-D",
                    str(self.pg_data),
                    "-l",
                    str(root / "postgres.log"),
                    "-w",
                    "-t",
                    "60",
                    "-o",
                    options,
                    "start",
                ],
            ),
            root / "pg_ctl.log",
            runuser=False,
        )
        import psycopg

        with psycopg.connect(
            f"postgresql://postgres@{self.addr('hub')}:{PG_PORT}/postgres", autocommit=True, connect_timeout=10
        ) as conn:
            conn.execute("CREATE DATABASE jobs")

    def _as_postgres(self, cmd: list[str], log: Path, *, runuser: bool = True) -> None:
        full = ["runuser", "-u", "postgres", "--", *cmd] if runuser else cmd
        out = subprocess.run(full, check=False, cwd=self.workdir / "pg", capture_output=True, text=True)
        log.write_text(out.stdout + out.stderr)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])}… failed ({out.returncode}):\n{out.stdout}{out.stderr}")

    def spawn_worker(self, host: str, *, wait: bool = True, **extra: str) -> Proc:
        """A CPU worker on `host`, started like `jobs worker --gpus none` (core.slices.worker_env/worker_command);
        `extra`: more environment (JOBS_* overrides)."""
        from core.slices import worker_command, worker_env

        # One intra-op thread: two CPU workers on a small (often shared) machine with torch's default of one thread
        # per core oversubscribe it, and a tiny model then runs 10-40x slower (measured on 2 cores under load).
        env = worker_env(
            [],
            self.env(f"home-{host}", JOBS_HOSTNAME=f"host-{host}", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", **extra),
        )
        proc = self.spawn(host, worker_command([]), env, f"worker-{host}.log")
        if wait:
            wait_for(
                lambda: registered(self.database_url, proc.pid),
                90,
                f"the worker on host-{host} to register",
                procs=[proc],
            )
        return proc

    def consuming(self, host: str) -> bool:
        """True while a worker on `host` waits for a task (its Celery consumer is blocked in BRPOP)."""
        import redis

        client = redis.Redis.from_url(self.redis_url, socket_connect_timeout=2, socket_timeout=5)
        try:
            return any(
                c["addr"].rsplit(":", 1)[0] == self.addr(host) and c.get("cmd") == "brpop" for c in client.client_list()
            )
        finally:
            client.close()

    def start_api(self, *, model_roots: list[Path], data_roots: list[Path]) -> Proc:
        """The API server (uvicorn) in the hub, listening on the hub's address (hence roots are required)."""
        import httpx

        env = self.env(
            "home-hub",
            JOBS_API_HOST=self.addr("hub"),
            JOBS_API_PORT=str(API_PORT),
            JOBS_MODEL_ROOTS=os.pathsep.join(map(str, model_roots)),
            JOBS_DATA_ROOTS=os.pathsep.join(map(str, data_roots)),
        )
        proc = self.spawn(
            "hub",
            [
                sys.executable,
                "-m",
                "uvicorn",
                "api.app:app",
                "--host",
                self.addr("hub"),
                "--port",
                str(API_PORT),
                "--log-level",
                "warning",
            ],
            env,
            "api.log",
        )

        def healthy() -> bool:
            try:
                return httpx.get(f"{self.api_url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, "the API server in the hub namespace", procs=[proc])
        return proc

    def diagnostics(self) -> str:
        """What PostgreSQL's sessions are doing (a lock held by a cut host shows here) and the logs' tails."""
        lines = []
        try:
            import psycopg

            with psycopg.connect(
                f"postgresql://postgres@{self.addr('hub')}:{PG_PORT}/jobs", connect_timeout=5, autocommit=True
            ) as conn:
                rows = conn.execute(
                    "SELECT client_addr, state, wait_event_type, wait_event, "
                    "now() - state_change, left(query, 100) FROM pg_stat_activity "
                    "WHERE datname = 'jobs' AND pid <> pg_backend_pid()"
                ).fetchall()
            lines += ["pg_stat_activity:", *(f"  {r}" for r in rows)]
        except Exception as exc:  # noqa: BLE001 (diagnostics must never hide the real failure)
            lines.append(f"pg_stat_activity unavailable: {exc}")
        for proc in self.procs:
            lines += [f"--- {proc.log.name} (pid {proc.pid}, alive {proc.alive()}):", proc.tail(25)]
        return "\n".join(lines)

    # --- teardown ---

    def close(self, keep_logs: Path | None = None) -> None:
        """Stop everything this cluster started and remove the namespaces and files (the logs are copied to
        `keep_logs` first). Never raises."""
        for proc in reversed(self.procs):  # SIGTERM (a worker hands its shard back), SIGKILL after 10 s
            if proc.host in self.cut_hosts and proc.alive():
                _quietly(proc.popen.kill)
            _quietly(proc.stop, 10)
        if self.pg_data is not None and self.pg_bin is not None and (self.pg_data / "postmaster.pid").exists():
            _quietly(
                subprocess.run,
                [
                    "runuser",
                    "-u",
                    "postgres",
                    "--",
                    str(self.pg_bin / "pg_ctl"),
                    "-D",
                    str(self.pg_data),
                    "stop",
                    "-m",
                    "immediate",
                    "-t",
                    "20",
                ],
                check=False,
                capture_output=True,
                cwd="/",
            )
        for ns in self.namespaces:  # anything left in our own namespaces is ours (started here): kill it by pid
            out = subprocess.run(["ip", "netns", "pids", ns], check=False, capture_output=True, text=True)
            for pid in out.stdout.split():
                _quietly(os.kill, int(pid), signal.SIGKILL)
        for ns in reversed(self.namespaces):
            for _ in range(50):  # retried: the kernel may still be releasing the processes just killed
                if subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True).returncode == 0:
                    break
                time.sleep(0.1)
        if self.subnet >= 0:  # deleting the hub deleted the veth pair; this only catches a half-built network
            subprocess.run(["ip", "link", "del", self.root_veth], check=False, capture_output=True)
        if keep_logs is not None:
            for log in [*(self.workdir / "logs").glob("*.log"), *(self.workdir / "pg").glob("*.log")]:
                _quietly(shutil.copy, log, keep_logs / log.name)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _quietly(fn, *args, **kwargs) -> None:
    """Teardown goes on whatever one step raises."""
    try:
        fn(*args, **kwargs)
    except Exception:  # noqa: BLE001, S110
        pass


def new_cluster(hosts: tuple[str, ...] = ("a", "b")) -> Cluster:
    """An empty cluster with a unique name and its temp dir; call create_network() next, close() always."""
    global _counter
    _counter += 1
    workdir = Path(tempfile.mkdtemp(prefix="gpujobs-netns-"))
    os.chmod(workdir, 0o755)  # the postgres user must reach workdir/pg
    return Cluster(name=f"gj{os.getpid()}n{_counter}", hosts=hosts, workdir=workdir)
