"""One typed settings object, read from `JOBS_*` environment variables when first asked for.

Nothing is read at import time: tests and launchers change the environment and call `reset()`.

Embedded default (no configuration): everything lives under `JOBS_HOME` (default `~/.gpujobs`):

    jobs.db          SQLite store (WAL)
    artifacts/       uploaded files, results, adapters (JOBS_ARTIFACTS points elsewhere in a cluster)
    logs/            one log file per process started by `gpujobs up`
    run/stack.json   what `gpujobs up` started: Redis URL, API URL, pids (the supervisor's and its workers')
    token            the local admin token written by `gpujobs up` (mode 0600)
    compile-cache/   what workers compiled (torch.compile, Triton), per torch/triton/transformers/Python versions
                     (worker/compile_cache.py)

Cluster: set `JOBS_REDIS_URL`, `JOBS_DATABASE_URL`, `JOBS_API_URL`, `JOBS_ARTIFACTS` (a path every host mounts).

Models by Hub id (core/hub.py) follow the Hugging Face variables, so existing caches, `hf download` and mirrors keep
working: `HF_ENDPOINT` (the Hub or a mirror), `HF_HUB_OFFLINE` (never reach it), `HF_HUB_CACHE` / `HF_HOME` (the
cache), `HF_TOKEN` / `HF_TOKEN_PATH` (read when needed by `core.hub.token()`, never kept here: a settings object
may be printed). Ours: `JOBS_HUB_MODELS` (Hub ids allowed when JOBS_MODEL_ROOTS is set), `JOBS_HUB_MIN_FREE_BYTES`
(free space a download must leave), `JOBS_HUB_TIMEOUT` (seconds to connect or wait for a byte), `JOBS_HUB_PARALLEL_FILES` (files of one
snapshot fetched at once, 1 to 64, default 8).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from functools import cache
from pathlib import Path


def _env(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _paths(name: str) -> list[Path]:
    value = _env(name)
    return [Path(p).expanduser().resolve() for p in value.split(os.pathsep) if p] if value else []


def _broker_wait() -> float | None:
    """JOBS_BROKER_WAIT_SECONDS: unset = kombu's 1 s; else above 0 and below the broker socket's 15 s read timeout."""
    value = _env("JOBS_BROKER_WAIT_SECONDS")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < 15:
        raise ValueError(
            f"JOBS_BROKER_WAIT_SECONDS={value!r}: give seconds above 0 and below 15 (the broker socket's read timeout)"
        )
    return seconds


def _share(name: str, default: float) -> float:
    """A share above 0 and at most 1."""
    value = _env(name)
    if value is None:
        return default
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"{name}={value!r}: give a number above 0 and at most 1 (the default is {default})")
    return share


def _seconds_or_auto(name: str) -> float | None:
    """A positive number of seconds, or None for `auto` (the default)."""
    value = _env(name, "auto")
    if value.lower() == "auto":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r}: give a positive number of seconds, or auto")
    return seconds


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    redis_url: str | None
    api_url: str
    artifacts: Path
    token: str | None
    api_host: str = "127.0.0.1"
    api_port: int = 8765
    model_roots: list[Path] = field(default_factory=list)
    data_roots: list[Path] = field(default_factory=list)
    allow_remote_code: bool = False
    hostname: str | None = None
    shard_rows: int = 256
    batch_rows: int = 16
    lease_seconds: float = 20.0
    max_attempts: int = 3
    fair_share_window: float = 3600.0  # owners' GPU-seconds are counted over this many seconds (core/scheduling.py)
    yield_after: float = 120.0  # a running shard yields to work that outranks it and waited this long (0: never)
    worker_timeout: float = 30.0
    visibility_timeout: int = 12 * 3600
    broker_wait_seconds: float | None = None  # a worker's BRPOP wait in Redis; None = kombu's 1 s (core/queue.py)
    broker_retries: int = 100  # a worker's reconnects to a Redis that went away before it exits 1 (Celery's default)
    batch_window_seconds: float = 24 * 3600.0  # OpenAI batches' completion_window "24h" (shorter only in tests)
    stall_seconds: float | None = None  # None = auto: max(120 s, 50 x the median engine step) (worker/progress.py)
    stall_phase_seconds: float = 1800.0  # bound of one-off phases: loading, compiling, capturing CUDA graphs
    max_upload_bytes: int = 1 << 30
    max_rows: int = 10_000_000
    max_row_bytes: int = 1 << 20
    # supervised workers (`gpujobs up`, `gpujobs supervise`; api/supervisor.py): a slot whose worker exited
    # `restart_limit` times within `restart_window` seconds stays down; restarts wait `restart_backoff` seconds,
    # doubling up to `restart_backoff_max`
    restart_limit: int = 5
    restart_window: float = 600.0
    restart_backoff: float = 1.0
    restart_backoff_max: float = 60.0
    worker_restarts: int = 0  # set by the supervisor on the worker it restarts: shown in its registration
    stopped_workers_shown: float = 3600.0  # `gpujobs workers` lists a stopped worker this long (`--all`: always)
    hub_endpoint: str = "https://huggingface.co"
    hub_offline: bool = False
    hub_cache: Path = Path("~/.cache/huggingface/hub")  # read from HF_HUB_CACHE / HF_HOME (_hf_home)
    hub_token_path: Path = Path("~/.cache/huggingface/token")
    hub_models: list[str] = field(default_factory=list)  # fnmatch patterns of Hub ids allowed beside the model roots
    hub_min_free_bytes: int = 1 << 30
    hub_timeout: float = 10.0
    # the share of each GPU's memory a worker may hold: the model, the fast engine's KV cache and its working memory
    # (vLLM's gpu_memory_utilization); the cache gets what is left of it (worker/engines/slot_state.py `cache_budget`)
    gpu_memory_utilization: float = 0.9
    hub_parallel_files: int = 8  # files of one snapshot fetched at once (huggingface_hub's max_workers is 8 too)
    # the niceness of a CPU worker's flex_attention compile probe (a child process and the compiler it starts;
    # worker/capabilities.py): 19, the lowest priority, never competes with a job; 0 answers sooner on a host
    # whose other processes keep every core busy (where 19 gets about 1 % of a core)
    probe_nice: int = 19

    @property
    def files_dir(self) -> Path:
        return self.artifacts / "files"

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def run_dir(self) -> Path:
        return self.home / "run"

    @property
    def stack_file(self) -> Path:
        return self.run_dir / "stack.json"

    @property
    def token_file(self) -> Path:
        return self.home / "token"

    @property
    def heartbeat_seconds(self) -> float:
        return self.lease_seconds / 3

    @property
    def is_loopback(self) -> bool:
        return self.api_host in ("127.0.0.1", "localhost", "::1")


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _hf_home() -> Path:
    """HF_HOME as huggingface_hub reads it: $HF_HOME, else $XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface."""
    default = Path(_env("XDG_CACHE_HOME", "~/.cache")).expanduser() / "huggingface"
    return Path(_env("HF_HOME", str(default))).expanduser()


def _stack(home: Path) -> dict:
    try:
        return json.loads((home / "run" / "stack.json").read_text())
    except (OSError, ValueError):
        return {}


def _token(home: Path) -> str | None:
    try:
        return (home / "token").read_text().strip() or None
    except OSError:
        return None


# Numbers read from the environment: field -> variable. The default is the field's own (one place); a value that is
# not a number of the field's type is refused with the variable's name.
_NUMBERS = {
    "api_port": "JOBS_API_PORT",
    "shard_rows": "JOBS_SHARD_ROWS",
    "batch_rows": "JOBS_BATCH_ROWS",
    "lease_seconds": "JOBS_LEASE_SECONDS",
    "max_attempts": "JOBS_MAX_ATTEMPTS",
    "fair_share_window": "JOBS_FAIR_SHARE_WINDOW_SECONDS",
    "yield_after": "JOBS_YIELD_AFTER_SECONDS",
    "worker_timeout": "JOBS_WORKER_TIMEOUT",
    "visibility_timeout": "JOBS_VISIBILITY_TIMEOUT",
    "broker_retries": "JOBS_BROKER_RETRIES",
    "batch_window_seconds": "JOBS_BATCH_WINDOW_SECONDS",
    "stall_phase_seconds": "JOBS_STALL_PHASE_SECONDS",
    "max_upload_bytes": "JOBS_MAX_UPLOAD_BYTES",
    "max_rows": "JOBS_MAX_ROWS",
    "max_row_bytes": "JOBS_MAX_ROW_BYTES",
    "restart_limit": "JOBS_RESTART_LIMIT",
    "restart_window": "JOBS_RESTART_WINDOW",
    "restart_backoff": "JOBS_RESTART_BACKOFF",
    "restart_backoff_max": "JOBS_RESTART_BACKOFF_MAX",
    "worker_restarts": "JOBS_WORKER_RESTARTS",
    "stopped_workers_shown": "JOBS_STOPPED_WORKERS_SHOWN",
    "hub_min_free_bytes": "JOBS_HUB_MIN_FREE_BYTES",
    "hub_timeout": "JOBS_HUB_TIMEOUT",
    "hub_parallel_files": "JOBS_HUB_PARALLEL_FILES",
    "probe_nice": "JOBS_PROBE_NICE",
}
MAX_PARALLEL_FILES = 64


def _default(name: str):
    return next(f.default for f in fields(Settings) if f.name == name)


def _number(name: str) -> int | float:
    default = _default(name)
    value = _env(_NUMBERS[name])
    if value is None:
        return default
    try:
        return type(default)(value)
    except ValueError:
        kind = "a whole number" if isinstance(default, int) else "a number"
        raise ValueError(f"{_NUMBERS[name]}={value!r}: give {kind} (the default is {default})") from None


def api_url_for(host: str, port: int | str) -> str:
    """The URL that reaches an API listening on `host`: an IPv6 address goes in brackets (`http://[::1]:8765`);
    without them (`http://:::8765`) every CLI command failed with a traceback on the port."""
    host = host.strip("[]")
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@cache
def get_settings() -> Settings:
    home = Path(_env("JOBS_HOME", "~/.gpujobs")).expanduser().resolve()
    stack = _stack(home)
    host = _env("JOBS_API_HOST", _default("api_host"))
    numbers = {name: _number(name) for name in _NUMBERS}
    if not 1 <= numbers["hub_parallel_files"] <= MAX_PARALLEL_FILES:
        raise ValueError(
            f"JOBS_HUB_PARALLEL_FILES={numbers['hub_parallel_files']}: give a whole number from 1 to "
            f"{MAX_PARALLEL_FILES} (files of one model fetched at once; the default is {_default('hub_parallel_files')})"
        )
    if numbers["broker_retries"] < 0:
        raise ValueError(
            f"JOBS_BROKER_RETRIES={numbers['broker_retries']}: give a whole number of reconnects, 0 or more (the "
            f"default is {_default('broker_retries')})"
        )
    if not 0 <= numbers["probe_nice"] <= 19:
        raise ValueError(
            f"JOBS_PROBE_NICE={numbers['probe_nice']}: give a niceness from 0 (the worker's own priority) to 19 "
            f"(the lowest; the default)"
        )
    return Settings(
        home=home,
        database_url=_env("JOBS_DATABASE_URL", f"sqlite:///{home / 'jobs.db'}"),
        redis_url=_env("JOBS_REDIS_URL", stack.get("redis_url")),
        api_url=_env("JOBS_API_URL", stack.get("api_url", api_url_for(host, numbers["api_port"]))).rstrip("/"),
        api_host=host,
        artifacts=Path(_env("JOBS_ARTIFACTS", str(home / "artifacts"))).expanduser().resolve(),
        token=_env("JOBS_TOKEN") or _token(home),
        model_roots=_paths("JOBS_MODEL_ROOTS"),
        data_roots=_paths("JOBS_DATA_ROOTS"),
        allow_remote_code=_true(_env("JOBS_ALLOW_REMOTE_CODE")),
        hostname=_env("JOBS_HOSTNAME"),
        broker_wait_seconds=_broker_wait(),
        stall_seconds=_seconds_or_auto("JOBS_STALL_SECONDS"),
        gpu_memory_utilization=_share("JOBS_GPU_MEMORY_UTILIZATION", _default("gpu_memory_utilization")),
        hub_endpoint=_env("HF_ENDPOINT", _default("hub_endpoint")).rstrip("/"),
        hub_offline=_true(_env("HF_HUB_OFFLINE")) or _true(_env("TRANSFORMERS_OFFLINE")),
        hub_cache=Path(_env("HF_HUB_CACHE") or _env("HUGGINGFACE_HUB_CACHE") or str(_hf_home() / "hub"))
        .expanduser()
        .resolve(),
        hub_token_path=Path(_env("HF_TOKEN_PATH", str(_hf_home() / "token"))).expanduser(),
        hub_models=[p.strip() for p in (_env("JOBS_HUB_MODELS") or "").split(",") if p.strip()],
        **numbers,
    )


def reset() -> None:
    """Forget the cached settings (after the environment or the stack file changed)."""
    get_settings.cache_clear()
