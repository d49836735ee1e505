"""The local stack behind `gpujobs up` / `gpujobs down` / `gpujobs worker`: Redis, the API server and pinned workers.

GPU pinning follows the NVIDIA guide: every worker gets `CUDA_DEVICE_ORDER=PCI_BUS_ID` and its own
`CUDA_VISIBLE_DEVICES` set explicitly on its own environment (empty for a CPU worker), so indices match
`nvidia-smi` and order is respected (`2,0` makes GPU 2 `cuda:0`). An inherited CUDA_VISIBLE_DEVICES that
contradicts the requested slice is refused (exit code 5), never silently obeyed or overridden. Every worker also gets
NVLink multicast off (core/slices.py); the worker passes the same variables on to every child it launches.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from core import auth
from core.db import session_scope, upgrade
from core.embedded import start_redis
from core.errors import InvalidInput, JobsError
from core.settings import get_settings, reset
from core.slices import pinned_env


class GpuConflict(JobsError):
    """The inherited CUDA_VISIBLE_DEVICES contradicts the requested slice."""


def parse_slice(text: str) -> list[str]:
    """'2,0' -> ['2', '0']; 'none' or '' -> [] (CPU). Indices or GPU-/MIG- UUIDs, no duplicates."""
    text = text.strip()
    if text.lower() in ("", "none", "cpu"):
        return []
    devices = [d.strip() for d in text.split(",")]
    for d in devices:
        if not (d.isdigit() or d.startswith(("GPU-", "MIG-"))):
            raise InvalidInput(f"bad GPU {d!r} in {text!r}: use indices as nvidia-smi shows them (e.g. 0,1), "
                               "GPU UUIDs, or 'none' for a CPU worker")
    if len(set(devices)) != len(devices):
        raise InvalidInput(f"GPU slice {text!r} names a device twice")
    return devices


def parse_slices(text: str) -> list[list[str]]:
    """'0,1;2;3' -> [['0','1'], ['2'], ['3']]; two slices may not share a GPU."""
    slices = [parse_slice(part) for part in text.split(";")]
    seen: set[str] = set()
    for s in slices:
        if seen & set(s):
            raise InvalidInput(f"slices {text!r} share GPU(s) {sorted(seen & set(s))}: two workers never share a GPU")
        seen |= set(s)
    return slices


def check_inherited(devices: list[str]) -> None:
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and parse_slice(inherited) != devices:
        raise GpuConflict(
            f"CUDA_VISIBLE_DEVICES={inherited!r} is set in this shell but --gpus asks for "
            f"{','.join(devices) or 'none'}: unset it (`unset CUDA_VISIBLE_DEVICES`) or pass the same devices"
        )


def worker_env(devices: list[str], base: dict[str, str] | None = None) -> dict[str, str]:
    env = pinned_env(devices, os.environ if base is None else base)  # HF_HUB_OFFLINE only if the operator set it
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return env


def worker_command(devices: list[str]) -> list[str]:
    return [sys.executable, "-m", "worker.main", "--slice", ",".join(devices)]


def detect_gpus() -> list[str]:
    """GPU indices in PCI order from nvidia-smi (no CUDA in this process); [] when there is none."""
    if not shutil.which("nvidia-smi"):
        return []
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False)
    return [line.strip() for line in out.stdout.splitlines() if line.strip().isdigit()] if out.returncode == 0 else []


# --- up / down ----------------------------------------------------------------------------------------------


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
    return [p for p in [*stack.get("workers", []), stack.get("api"), stack.get("redis")] if p]


def ensure_token(owner: str | None = None) -> str:
    """The local admin token in $JOBS_HOME/token (mode 0600), created on first use."""
    settings = get_settings()
    if settings.token_file.exists():
        return settings.token_file.read_text().strip()
    with session_scope() as session:
        secret = auth.create_token(session, owner=owner or getpass.getuser(), scopes=["admin", "user", "metrics"],
                                   name="local admin (jobs up)")
    fd = os.open(settings.token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    return secret


def up(slices: list[list[str]] | None, *, host: str, port: int, log=print) -> dict:
    """Start Redis (unless JOBS_REDIS_URL is set), migrate, start the API and the workers; write stack.json."""
    settings = get_settings()
    stack = read_stack()
    if stack and any(alive(p) for p in stack_pids(stack)):
        raise JobsError(f"a stack is already running from {settings.home} (API {stack.get('api_url')}): "
                        "use it, or stop it with `gpujobs down`")
    for d in (settings.home, settings.run_dir, settings.logs_dir, settings.artifacts):
        d.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.home, 0o700)
    if slices is None:
        inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
        found = parse_slice(inherited) if inherited is not None else detect_gpus()
        slices = [[d] for d in found] or [[]]
    for s in slices:
        check_inherited_for_up(s)
    stack = {"home": str(settings.home), "started_at": time.time(), "workers": []}
    if os.environ.get("JOBS_REDIS_URL"):
        stack["redis_url"] = os.environ["JOBS_REDIS_URL"]
    else:
        redis = start_redis(settings.run_dir / "redis")
        stack.update(redis=redis.proc.pid, redis_url=redis.url)
        log(f"redis    {redis.url} (pid {redis.proc.pid})")
    stack["api_url"] = f"http://{host}:{port}"
    _write_stack(stack)
    reset()
    upgrade()
    ensure_token()
    env = dict(os.environ, JOBS_HOME=str(settings.home), JOBS_REDIS_URL=stack["redis_url"],
               JOBS_API_HOST=host, JOBS_API_PORT=str(port))
    api_cmd = [sys.executable, "-m", "uvicorn", "api.app:app", "--host", host, "--port", str(port), "--log-level",
               "warning"]
    stack["api"] = _spawn(api_cmd, env, settings.logs_dir / "api.log")
    log(f"api      {stack['api_url']} (pid {stack['api']}, log {settings.logs_dir / 'api.log'})")
    for i, devices in enumerate(slices):
        logfile = settings.logs_dir / f"worker-{i}.log"
        pid = _spawn(worker_command(devices), worker_env(devices, env), logfile)
        stack["workers"].append(pid)
        log(f"worker   slice {','.join(devices) or 'none (CPU)'} (pid {pid}, log {logfile})")
    _write_stack(stack)
    return stack


def check_inherited_for_up(devices: list[str]) -> None:
    inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
    if inherited is not None and not set(devices) <= set(parse_slice(inherited)):
        raise GpuConflict(f"CUDA_VISIBLE_DEVICES={inherited!r} is set in this shell but a slice asks for "
                          f"{','.join(devices)}: unset it or pass slices within it")


def _spawn(cmd: list[str], env: dict[str, str], logfile: Path) -> int:
    with open(logfile, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return proc.pid


def _write_stack(stack: dict) -> None:
    path = get_settings().stack_file
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(stack, indent=2))
    os.replace(tmp, path)


def wait_healthy(stack: dict, *, timeout: float = 180.0) -> None:
    """Until the API answers and every worker has registered (workers import torch: this takes seconds)."""
    from api.client import Client

    reset()
    client = Client(url=stack["api_url"])
    deadline = time.monotonic() + timeout
    expected = set(stack["workers"])
    while time.monotonic() < deadline:
        dead = [p for p in stack_pids(stack) if not alive(p)]
        if dead:
            raise JobsError(f"process(es) {dead} exited during start: see the logs in {get_settings().logs_dir}")
        try:
            client.health()
            online = {w["pid"] for w in client.workers() if w["state"] == "online"}
            if expected <= online:
                return
        except JobsError:
            pass
        time.sleep(0.5)
    raise JobsError(f"the stack did not become healthy in {timeout:.0f} s: see the logs in {get_settings().logs_dir}")


def down(*, timeout: float = 30.0, log=print) -> bool:
    """Stop what stack.json lists: workers first (they hand back their shards), then the API, then Redis."""
    settings = get_settings()
    stack = read_stack()
    if not stack:
        return False
    for group in (stack.get("workers", []), [stack.get("api")], [stack.get("redis")]):
        pids = [p for p in group if alive(p)]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if alive(pid):
                log(f"pid {pid} did not stop in {timeout:.0f} s: killing it")
                os.kill(pid, signal.SIGKILL)
    settings.stack_file.unlink(missing_ok=True)
    reset()
    return True
