"""A Redis that refuses this worker's credentials ends it at once with exits.BROKER_REFUSED (77), never retried.

Celery retries every failed connection to its broker, and kombu counts redis-py's AuthenticationError among the
connection errors: a worker given a wrong password in JOBS_REDIS_URL retried it JOBS_BROKER_RETRIES times (about
45 minutes) while its SQL heartbeat showed it online in `gpujobs workers`. A refused password does not heal by
waiting, and a restart with the same environment is refused the same way, so:

- at start-up, before its heavy imports and before it registers, the worker connects to its broker once
  (`refusal`); refused credentials end it with 77 and one ERROR line naming the URL (password masked) and the fix,
  and its registration is offline with that reason (worker/main.py's `refuse`); it is never online;
- later (the password changed on the server, then a reconnect), Celery's consumer connects through
  `stop_on_refused_credentials`: the first refused attempt ends the worker with 77 and the same line.

Anything else that fails a connection (Redis down or restarting, a host unreachable, a timeout) is left to Celery's
retries, as before: only an answer from Redis that refuses the credentials is final.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError

from core import exits
from core.queue import masked

log = logging.getLogger(__name__)
# what Redis answers to refused credentials, for an error that reached us without redis-py's class (kombu re-raises
# connection errors as its own OperationalError, keeping the cause: `refused` follows the chain first)
REFUSALS = ("WRONGPASS", "NOAUTH", "invalid username-password pair", "Authentication required")


def refused(exc: BaseException | None) -> bool:
    """Whether `exc`, or an error it was raised from, is Redis refusing the credentials we gave."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, AuthenticationError | AuthenticationWrongNumberOfArgsError):
            return True
        if any(marker in str(exc) for marker in REFUSALS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def message(url: str, exc: BaseException) -> str:
    """One line: which broker refused (`url`, its password masked), what it said and what to do."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return (
        f"Redis at {masked(url)} refused this worker's credentials ({said}): set the password Redis requires in "
        "JOBS_REDIS_URL (redis://:PASSWORD@HOST:PORT/DB, unix://:PASSWORD@/PATH.sock?db=DB for a unix socket, or "
        "redis://USER:PASSWORD@... for an ACL user), then start "
        f"the worker again; not retried (exit {exits.BROKER_REFUSED})"
    )


def refusal(app) -> str | None:
    """Connect to the Celery app's broker once: the message when Redis refused our credentials; None when it took
    them, or when the connection failed otherwise (Celery's consumer retries that)."""
    conn = app.connection_for_read()
    try:
        conn.ensure_connection(max_retries=0)
    except Exception as exc:  # noqa: BLE001  kombu raises many types for one cause; only a refusal is ours
        return message(app.conf.broker_url, exc) if refused(exc) else None
    finally:
        conn.release()
    return None


def stop_on_refused_credentials(on_refused: Callable[[str], None]) -> None:
    """Make Celery's consumer end the worker with exits.BROKER_REFUSED at the first connection attempt Redis refuses
    for its credentials, instead of retrying it; `on_refused(message)` is called first (the registration's reason).

    Celery's `Consumer.ensure_connected` retries through `conn.ensure_connection(errback, max_retries, ...)`, and
    its errback only logs; ours runs before it and raises WorkerShutdown(77), which Celery's WorkController turns
    into a stop with that exit status (worker/main.py reads it back). With JOBS_BROKER_RETRIES=0 kombu raises at
    once, without the errback: the same check runs on what it raised.
    """
    from celery.exceptions import WorkerShutdown
    from celery.worker.consumer.consumer import Consumer

    ensure_connected = getattr(Consumer.ensure_connected, "retries_refusals", Consumer.ensure_connected)

    def stop_if_refused(consumer, exc: BaseException) -> None:
        if refused(exc):
            text = message(consumer.app.conf.broker_url, exc)
            log.error("%s", text)
            on_refused(text)
            raise WorkerShutdown(exits.BROKER_REFUSED) from exc

    def ensure_connected_unless_refused(self, conn):
        retry = conn.ensure_connection

        def ensure_connection(errback=None, *args, **kwargs):
            def on_error(exc, interval):
                stop_if_refused(self, exc)
                if errback:
                    errback(exc, interval)

            return retry(on_error, *args, **kwargs)

        conn.ensure_connection = ensure_connection  # this connection only
        try:
            return ensure_connected(self, conn)
        except Exception as exc:
            stop_if_refused(self, exc)
            raise

    ensure_connected_unless_refused.retries_refusals = ensure_connected
    Consumer.ensure_connected = ensure_connected_unless_refused
