"""The local stack behind `gpujobs up` / `gpujobs down` / `gpujobs worker`: Redis, the API server and pinned workers.

GPU pinning follows the NVIDIA guide: every worker gets `CUDA_DEVICE_ORDER=PCI_BUS_ID` and its own
`CUDA_VISIBLE_DEVICES` set explicitly on its own environment (empty for a CPU worker), so indices match
`nvidia-smi` and order is respected (`2,0` makes GPU 2 `cuda:0`). An inherited CUDA_VISIBLE_DEVICES that
contradicts the requested slice is refused (exit code 5), never silently obeyed or overridden. Every worker also gets
NVLink multicast off (core/slices.py); the worker passes the same variables on to every child it launches.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import getpass
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from api.supervisor import StopSignals, Supervisor
from core import artifacts, auth
from core.db import session_scope, upgrade
from core.embedded import start_redis
from core.errors import GpuConflict, InvalidInput, JobsError, StartInterrupted
from core.logs import setup_logging
from core.settings import api_url_for, get_settings, reset
from core.slices import parse_slice, parse_slices, worker_command, worker_env  # noqa: F401  (ops/bench/load.py imports them from here)


def check_inherited(devices: list[str]) -> None:
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and parse_slice(inherited) != devices:
        raise GpuConflict(
            f"CUDA_VISIBLE_DEVICES={inherited!r} is set in this shell but --gpus asks for "
            f"{','.join(devices) or 'none'}: unset it (`unset CUDA_VISIBLE_DEVICES`) or pass the same devices"
        )


def detect_gpus() -> list[str]:
    """GPU indices in PCI order from nvidia-smi (no CUDA in this process); [] when there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True, check=False
    )
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()] if out.returncode == 0 else []


# --- up / down ----------------------------------------------------------------------------------------------
#
# stack.json (run/stack.json, written under run/stack.lock) lists what `up` started: redis, redis_url, api,
# api_url, supervisor (the pid that supervises the workers: the foreground `up` itself, or the detached
# supervisor process), workers (the live workers' pids) and slots (each slice's worker: pid, restarts, state
# running | restarting | down, reason). The supervisor keeps workers and slots current as it restarts workers.

STACK_HINT = "restart the stack (`gpujobs down`, then `gpujobs up`)"
NAMES = {"supervisor": "supervisor", "api": "API", "redis": "Redis"}


def read_stack() -> dict:
    try:
        return json.loads(get_settings().stack_file.read_text())
    except (OSError, ValueError):
        return {}


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie (exited, not yet reaped) is not alive
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def stack_pids(stack: dict) -> list[int]:
    """The pids stack.json lists; none when it was written before this machine last booted (its pids are others')."""
    if stack.get("boot_id") not in (None, boot_id()):
        return []
    return [p for p in [stack.get("supervisor"), *stack.get("workers", []), stack.get("api"), stack.get("redis")] if p]


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def ensure_token(owner: str | None = None) -> str:
    """The local admin token in $JOBS_HOME/token (mode 0600), created on first use."""
    settings = get_settings()
    if settings.token_file.exists():
        return settings.token_file.read_text().strip()
    with session_scope() as session:
        secret = auth.create_token(
            session, owner=owner or getpass.getuser(), scopes=["admin", "user", "metrics"], name="local admin (jobs up)"
        )
    fd = os.open(settings.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def prepare(slices: list[list[str]] | None) -> list[list[str]]:
    """Refuse to start a second stack or contradict CUDA_VISIBLE_DEVICES; the slices to run (default: one worker per
    GPU that nvidia-smi lists, else one CPU worker). Nothing is started yet."""
    settings = get_settings()
    stack = read_stack()
    if stack and any(alive(p) for p in stack_pids(stack)):
        raise JobsError(
            f"a stack is already running from {settings.home} (API {stack.get('api_url')}): "
            "use it, or stop it with `gpujobs down`"
        )
    if slices is None:
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        found = parse_slice(inherited) if inherited is not None else detect_gpus()
        slices = [[d] for d in found] or [[]]
    for s in slices:
        check_inherited_for_up(s)
    return slices


def check_port(host: str, port: int) -> None:
    """Refuse an API port that another program listens on, before anything starts: uvicorn would otherwise exit after
    Redis and the workers had started, with the cause only in api.log. Binds as uvicorn does (SO_REUSEADDR, so a
    socket left in TIME_WAIT by a stack just stopped does not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InvalidInput(
                    f"port {port} on {host} is in use (by another program): pick another with --port"
                ) from None
            raise InvalidInput(
                f"cannot listen on {host} port {port} ({exc.strerror or exc}): pick another --host or --port"
            ) from None


def up(*, host: str, port: int, log=print, interrupted=lambda: False) -> dict:
    """Start Redis (unless JOBS_REDIS_URL is set), migrate, check the artifacts directory (core/artifacts.py), start
    the API; write stack.json step by step (a failure half-way leaves stack.json listing what `down` must stop).
    Workers: `start_workers`."""
    settings = get_settings()
    for d in (settings.home, settings.run_dir, settings.logs_dir, settings.artifacts):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.home, 0o700)
    stack = {"home": str(settings.home), "started_at": time.time(), "boot_id": boot_id(), "workers": [], "slots": []}
    if os.environ.get("JOBS_REDIS_URL"):
        stack["redis_url"] = os.environ["JOBS_REDIS_URL"]
    else:
        redis = start_redis(settings.run_dir / "redis")
        stack.update(redis=redis.proc.pid, redis_url=redis.url)
        log(f"redis    {redis.url} (pid {redis.proc.pid})")
    stack["api_url"] = api_url_for(host, port)
    write_stack(stack)
    _check(interrupted)
    reset()
    upgrade()
    artifacts.verify(settings.artifacts)  # adopted by a fresh store; another store's, or not the store's: refused
    ensure_token()
    _check(interrupted)
    api_cmd = [
        sys.executable,
        "-m",
        "uvicorn",
        "api.app:app",
        "--host",
        host,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    stack["api"] = _spawn(api_cmd, stack_env(stack), settings.logs_dir / "api.log")
    update_stack(api=stack["api"])
    log(f"api      {stack['api_url']} (pid {stack['api']}, log {settings.logs_dir / 'api.log'})")
    return stack


def stack_env(stack: dict) -> dict[str, str]:
    """The environment of the stack's processes: this one's, pointed at the stack's home, Redis and API."""
    host, port = stack["api_url"].removeprefix("http://").rsplit(":", 1)
    return dict(
        os.environ,
        JOBS_HOME=stack["home"],
        JOBS_REDIS_URL=stack["redis_url"],
        JOBS_API_HOST=host.strip("[]"),
        JOBS_API_PORT=port,
    )


def start_workers(stack: dict, slices: list[list[str]], *, detach: bool, log=print):
    """One supervised worker per slice. Foreground: a Supervisor in this process (returned; the caller steps it).
    Detached: a supervisor process of its own (`python -m api.stack`, `main` below) that outlives `up`."""
    settings = get_settings()
    if detach:
        cmd = [sys.executable, "-m", "api.stack", "--gpus", format_slices(slices)]
        pid = _spawn(cmd, stack_env(stack), settings.logs_dir / "supervisor.log")
        update_stack(supervisor=pid)
        log(f"workers  {len(slices)} supervised by pid {pid} (log {settings.logs_dir / 'supervisor.log'})")
        return None
    update_stack(supervisor=os.getpid())
    sup = Supervisor(slices, env=stack_env(stack), logs_dir=settings.logs_dir, hint=STACK_HINT, on_change=record_slots)
    sup.start()
    return sup


def run_detached(slices: list[list[str]], *, stop_timeout: float) -> int:
    """The detached supervisor process of `up --detach`: start the workers, supervise them until asked to stop (or
    until Redis or the API exits), then stop the whole stack."""
    log = logging.getLogger("supervisor")  # the supervisor's own log lines, as in a foreground `up`
    signals = StopSignals().install()
    stack = read_stack()
    if not stack:
        log.error("no stack.json in %s: start the stack with `gpujobs up`", get_settings().run_dir)
        return 1
    update_stack(supervisor=os.getpid())
    sup = Supervisor(
        slices, env=dict(os.environ), logs_dir=get_settings().logs_dir, hint=STACK_HINT, on_change=record_slots
    )
    sup.start()
    why = supervise_stack(sup, stack, signals.requested)
    log.info("%s: stopping the stack", why if not signals.requested() else signals.received)
    shutdown(sup, timeout=stop_timeout, log=log.info)
    return 0


def supervise_stack(sup, stack: dict, interrupted) -> str | None:
    """Step the supervisor until a stop is asked (returns None) or Redis or the API exits (returns which)."""
    while not interrupted():
        for key in ("redis", "api"):
            if stack.get(key) and not alive(stack[key]):
                return f"{NAMES[key]} (pid {stack[key]}) exited"
        sup.step()
        time.sleep(0.5)
    return None


def record_slots(sup) -> None:
    update_stack(workers=sup.pids(), slots=sup.view())


def format_slices(slices: list[list[str]]) -> str:
    return ";".join(",".join(s) or "none" for s in slices)


def check_inherited_for_up(devices: list[str]) -> None:
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and not set(devices) <= set(parse_slice(inherited)):
        raise GpuConflict(
            f"CUDA_VISIBLE_DEVICES={inherited!r} is set in this shell but a slice asks for "
            f"{','.join(devices)}: unset it or pass slices within it"
        )


def _check(interrupted) -> None:
    if interrupted():
        raise StartInterrupted("interrupted while starting: stopped what was started")


def _spawn(cmd: list[str], env: dict[str, str], logfile: Path) -> int:
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    return proc.pid


@contextmanager
def _stack_lock():
    """One writer of stack.json at a time (`up`, the supervisor and `down` may all write it)."""
    run_dir = get_settings().run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "stack.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _write(stack: dict) -> None:
    path = get_settings().stack_file
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stack, indent=2))
    os.replace(tmp, path)


def write_stack(stack: dict) -> None:
    with _stack_lock():
        _write(stack)


def update_stack(**changes) -> None:
    """Change fields of stack.json; nothing when it is gone (the stack was stopped)."""
    with _stack_lock():
        stack = read_stack()
        if stack:
            _write({**stack, **changes})


def wait_healthy(stack: dict, *, sup=None, interrupted=lambda: False, timeout: float = 180.0) -> dict:
    """Until the API answers and every slot's worker has registered (workers import torch: this takes seconds).
    Steps `sup` (a foreground supervisor) meanwhile. Returns stack.json as it is then."""
    from api.client import Client

    reset()
    client = Client(url=stack["api_url"])
    logs = get_settings().logs_dir
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check(interrupted)
        if sup is not None:
            sup.step()
        current = read_stack() or stack
        dead = [f"{NAMES[k]} (pid {current[k]})" for k in NAMES if current.get(k) and not alive(current[k])]
        if dead:
            raise JobsError(f"{', '.join(dead)} exited during start: see the logs in {logs}")
        down = [s for s in current.get("slots", []) if s["state"] == "down"]
        if down:
            raise JobsError(
                "; ".join(f"the worker of slice {s['slice'] or 'none (CPU)'} stays down: {s['reason']}" for s in down)
                + f" (see the logs in {logs})"
            )
        slots = current.get("slots", [])
        try:
            client.health()
            online = {w["pid"] for w in client.workers() if w["state"] == "online"}
            if slots and all(s["state"] == "running" and s["pid"] in online for s in slots):
                return current
        except JobsError:
            pass
        time.sleep(0.5)
    raise JobsError(f"the stack did not become healthy in {timeout:.0f} s: see the logs in {logs}")


def shutdown(sup, *, timeout: float = 30.0, log=print) -> None:
    """Stop a stack whose supervisor is this process: its workers first, then what stack.json lists."""
    if sup is not None:
        for slot, pid, code in sup.stop(timeout):
            log(f"stopped worker {slot.label} (pid {pid}, exit {code})")
    down(timeout=timeout, log=log)


def down(*, timeout: float = 30.0, log=print) -> bool:
    """Stop what stack.json lists: the supervisor first (it stops its workers, which hand back their shards, and
    never restarts one meanwhile; a detached one then stops the API and Redis too), then whatever still runs:
    workers, the API, Redis. Says what it stopped. False when no stack.json exists."""
    stack = read_stack()
    if not stack:
        return False
    me = os.getpid()
    running = [p for p in stack_pids(stack) if alive(p) and p != me]  # [] for a stack.json from before a reboot
    if not running:
        _remove_stack()
        if stack.get("supervisor") != me:
            log(
                f"the stack in {stack.get('home')} was not running (its processes had exited, or the machine "
                "restarted since): removed its stack.json"
            )
        return True
    labels = _labels(stack)
    supervisor = stack.get("supervisor")
    if supervisor in running:
        log(f"stopping the supervisor (pid {supervisor}): its workers hand their shards back first")
        _stop([supervisor], 3 * timeout + 15, log)
    latest = read_stack()
    labels.update(_labels(latest))
    workers = sorted(set(stack.get("workers", [])) | set(latest.get("workers", [])))
    for group in (workers, [stack.get("api")], [stack.get("redis")]):
        _stop([p for p in group if p and p != me and alive(p)], timeout, log)
    _remove_stack()
    for pid in running:
        log(f"stopped {labels.get(pid, 'process')} (pid {pid})")
    return True


def _remove_stack() -> None:
    with _stack_lock():
        get_settings().stack_file.unlink(missing_ok=True)
    reset()


def _labels(stack: dict) -> dict[int, str]:
    labels = {stack[k]: f"{NAMES[k]}" + (f" {stack['api_url']}" if k == "api" else "") for k in NAMES if stack.get(k)}
    for s in stack.get("slots", []):
        if s.get("pid"):
            labels[s["pid"]] = f"worker of slice {s['slice'] or 'none (CPU)'}"
    for pid in stack.get("workers", []):
        labels.setdefault(pid, "worker")
    return labels


def _stop(pids: list[int], timeout: float, log) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if alive(pid):
            log(f"pid {pid} did not stop in {timeout:.0f} s: killing it")
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def main(argv: list[str] | None = None) -> int:
    """`python -m api.stack --gpus SLICES`: the detached supervisor process of `gpujobs up --detach`
    (`run_detached`)."""
    parser = argparse.ArgumentParser(
        prog="python -m api.stack",
        description="the supervisor of a detached stack "
        "(started by `gpujobs up --detach`; it owns $JOBS_HOME/run/stack.json)",
    )
    parser.add_argument("--gpus", required=True, help="slices, ';' between workers ('0,1;2'; 'none' = a CPU worker)")
    parser.add_argument("--stop-timeout", type=float, default=30.0, help="seconds a worker gets to stop")
    args = parser.parse_args(argv)
    setup_logging("INFO")
    return run_detached(parse_slices(args.gpus), stop_timeout=args.stop_timeout)


if __name__ == "__main__":
    sys.exit(main())
