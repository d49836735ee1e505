"""The Celery app (configuration only: no task code here) and the helpers that enqueue by task *name*.

Why these settings (see docs/design.md for the long version):

- JSON only: ids go through the broker, never objects, and a pickle payload is refused by every worker.
- acks_late + reject_on_worker_lost + prefetch 1: a task is acknowledged only after it ran, and a worker holds
  at most one message it has not started.
- The Redis visibility timeout is far above the longest task (12 h). It only guards against double delivery;
  recovery of a dead worker's shard is the reaper's job (SQL leases, seconds), never Redis's.
- Queues by slice size: `cpu`, `gpu1`, `gpu2`, ... A worker consumes the queue of its own slice size.

JOBS_REDIS_URL is read by two libraries that spell a Redis on a unix socket differently: redis-py
`unix://[:PASSWORD@]/PATH.sock?db=DB`, Celery/kombu `redis+socket://[:PASSWORD@]/PATH.sock?virtual_host=DB` (kombu
reads no `db=` there: it uses database 0), and each refuses the other's. Either spelling is accepted: `broker_url()`
gives Celery its own, `redis_client()` (through `client_url()`) gives redis-py its own. Before, a worker given
`redis+socket://` failed every heartbeat in redis-py ("Redis URL must specify one of ..."), and Celery refused
`unix://` ("No such transport").
"""

from __future__ import annotations

from functools import cache
from urllib.parse import parse_qsl, quote, urlencode, urlsplit

from celery import Celery

from core.errors import ServiceUnavailable
from core.settings import get_settings

TASK_RUN_SHARD = "gpujobs.run_shard"


def queue_for(gpus: int) -> str:
    return "cpu" if gpus == 0 else f"gpu{gpus}"


REDIS_URL_FORMS = (
    "redis://[:PASSWORD@]HOST:PORT/DB, rediss://[:PASSWORD@]HOST:PORT/DB (TLS), or for a unix socket "
    "unix://[:PASSWORD@]/ABS/PATH.sock?db=DB or redis+socket://[:PASSWORD@]/ABS/PATH.sock?virtual_host=DB"
)


def redis_url() -> str:
    """JOBS_REDIS_URL as given, checked to be one of REDIS_URL_FORMS (`broker_url`/`client_url` convert it)."""
    url = get_settings().redis_url
    if not url:
        raise ServiceUnavailable(
            "no Redis is configured: start the local stack with `gpujobs up`, or set JOBS_REDIS_URL"
        )
    unix_socket(url)
    return url


def unix_socket(url: str) -> tuple[str, str, str, dict[str, str]] | None:
    """(credentials, path, db, other query parameters) of a unix socket URL in either spelling; None for a TCP one.
    Anything else raises ServiceUnavailable naming the accepted forms."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss"):
        return None
    if scheme not in ("unix", "redis+socket"):
        raise ServiceUnavailable(f"JOBS_REDIS_URL={masked(url)!r} is not a Redis URL: give {REDIS_URL_FORMS}")
    parts = urlsplit(url)
    credentials, _, host = parts.netloc.rpartition("@")
    if host or not parts.path.startswith("/"):
        raise ServiceUnavailable(
            f"JOBS_REDIS_URL={masked(url)!r}: a unix socket URL names no host, only the socket's absolute path "
            f"(three slashes: {scheme}:///run/redis.sock); give {REDIS_URL_FORMS}"
        )
    query = dict(parse_qsl(parts.query))
    if not credentials and ("password" in query or "username" in query):  # redis-py also reads them from the query
        user, password = query.pop("username", ""), query.pop("password", "")
        credentials = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    dbs = {query.pop(key) for key in ("db", "virtual_host") if key in query} or {"0"}
    if len(dbs) > 1 or not next(iter(dbs)).isdigit():
        raise ServiceUnavailable(
            f"JOBS_REDIS_URL={masked(url)!r}: give the database once, as a whole number (?db=DB or ?virtual_host=DB)"
        )
    return (credentials + "@" if credentials else ""), parts.path, dbs.pop(), query


def broker_url(url: str | None = None) -> str:
    """`url` (default JOBS_REDIS_URL) as Celery/kombu read it: a unix socket as redis+socket://...?virtual_host=DB."""
    return _spelled(url, "redis+socket", "virtual_host")


def client_url(url: str | None = None) -> str:
    """`url` (default JOBS_REDIS_URL) as redis-py reads it: a unix socket as unix://...?db=DB."""
    return _spelled(url, "unix", "db")


def _spelled(url: str | None, scheme: str, db_key: str) -> str:
    """`url` (default JOBS_REDIS_URL) with a unix socket spelled `scheme://…?db_key=DB`; a TCP URL as it is."""
    url = url or redis_url()
    socket = unix_socket(url)
    if socket is None:
        return url
    credentials, path, db, query = socket
    return f"{scheme}://{credentials}{path}?{urlencode({db_key: db, **query})}"


def redis_client(**kwargs):
    """A redis-py client of JOBS_REDIS_URL (whichever spelling it has); `kwargs` go to `Redis.from_url`."""
    import redis

    return redis.Redis.from_url(client_url(), **kwargs)


def masked(url: str) -> str:
    """`url` as a log may show it: each password replaced by `**`, the query (which may hold one) left out."""
    from kombu.utils.url import maybe_sanitize_url

    def one(part: str) -> str:
        return maybe_sanitize_url(part) if "://" in part else part.rpartition("@")[2]  # no scheme: no credentials

    return ";".join(one(part) for part in url.split(";"))  # kombu's failover list: one URL each


@cache
def get_app() -> Celery:
    settings = get_settings()
    app = Celery("gpujobs", broker=broker_url(), set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue="cpu",
        broker_transport_options=transport_options(settings.visibility_timeout, settings.broker_wait_seconds),
        broker_connection_retry_on_startup=True,
        broker_connection_timeout=5,
        broker_connection_max_retries=settings.broker_retries,  # then the worker exits 1 (worker/main.py says why)
        task_publish_retry_policy={"max_retries": 3, "interval_start": 0.2, "interval_step": 0.5},
        worker_hijack_root_logger=False,
        worker_send_task_events=True,
        task_send_sent_event=True,
    )
    return app


def transport_options(visibility_timeout: int, broker_wait: float | None = None) -> dict:
    """Kombu scans for unacknowledged messages past their visibility timeout about every 100 s; a short
    timeout (tests, tuning) only means something with a scan every second.

    Socket timeouts and keepalives: without them a worker whose host is cut off from Redis can wait on a dead
    socket until the kernel gives up on it (the TCP retransmission timeout) before it reconnects; with them a read
    fails after 15 s. The BRPOP the consumer blocks in lasts 1 s (kombu's default), well under that read timeout;
    JOBS_BROKER_WAIT_SECONDS (`broker_wait`) changes it through kombu's `polling_interval`, which also sets the
    sleep between empty polls of consumers that run without an event loop.
    """
    options: dict = {
        "visibility_timeout": visibility_timeout,
        "socket_timeout": 15,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        "health_check_interval": 10,
    }
    if broker_wait is not None:
        options["polling_interval"] = broker_wait
    if visibility_timeout < 600:
        options.update(unacked_restore_interval=1, unacked_restore_throttle=1)
    return options


def ping_redis() -> None:
    """Fail fast, with the fix in the message, when Redis is down (before anything is written)."""
    import redis

    url = redis_url()
    try:
        redis_client(socket_connect_timeout=3, socket_timeout=3).ping()
    except (redis.RedisError, OSError) as exc:
        safe = masked(url)
        raise ServiceUnavailable(
            f"Redis at {safe} cannot be reached ({exc}): start the local stack with `gpujobs up`, or check JOBS_REDIS_URL"
        ) from exc


KOMBU_PRIORITY_KEYS = ("", "\x06\x163", "\x06\x166", "\x06\x169")  # kombu's Redis lists of one queue


def waiting_messages(queue: str) -> int:
    """Messages waiting in Redis for `queue` (kombu keeps one list per priority step)."""
    client = redis_client(socket_connect_timeout=5, socket_timeout=5)
    return sum(client.llen(queue + suffix) for suffix in KOMBU_PRIORITY_KEYS)


def send(task: str, args: list, queue: str) -> None:
    try:
        get_app().send_task(task, args=args, queue=queue)
    except Exception as exc:  # kombu raises many types for one cause: the broker is gone
        raise ServiceUnavailable(f"could not enqueue {task} on {queue}: {exc}") from exc


def reset() -> None:
    get_app.cache_clear()
