"""Worker process entry point: `python -m worker.main --slice 2,0`.

Started by `gpujobs worker` / `gpujobs up` / ops launchers with CUDA_DEVICE_ORDER and CUDA_VISIBLE_DEVICES already set
on this process's own environment; this module checks they agree with `--slice` and never changes them. CUDA is
initialised here, in a process that never forks (Celery's solo pool).

`kill -USR2 <pid>` writes the stack of every thread of a worker to its stderr (its log under `gpujobs up`) and
lets it run on: what a stuck or slow worker is doing, even inside a C call (ops/gpu/soak.py sends it when a step
passes its time limit). SIGUSR2, because Celery takes SIGUSR1 for a Python-level dump that waits for the main
thread to come back to Python.

The worker refuses to start, with a message on stderr, its reason and exit code in its registration (state
offline: it never serves a queue) and the exit code of core/exits.py, when the environment contradicts the slice
(exits.ENV_MISMATCH, 5), the slice's GPUs are not visible (exits.SLICE_MISSING, 6), Redis refuses the credentials
of JOBS_REDIS_URL (exits.BROKER_REFUSED, 77: checked with one connection; worker/broker.py), its JOBS_ARTIFACTS is
not the store's artifacts directory (exits.WRONG_ARTIFACTS, 78; core/artifacts.py, which also adopts the directory
of a store that has none yet), or its engine or training code does not import (exits.BROKEN, 72: restartable, a
fresh process may import it whole). A stalled engine ends the process with exits.STALLED (70; worker/runtime.py); a
worker of a local stack that was stopped leaves with exits.STACK_GONE (69; worker/stackwatch.py); a reconnect that
Redis refuses for its credentials ends it with 77, not retried. Celery's worker may end itself with 1 (a Redis that
stayed away past JOBS_BROKER_RETRIES reconnects): the registration then keeps the code and Celery's reason. Each
exit ends with one log line: `worker NAME exits with code N (why)`.

The start-up order, each step before the next: the cheap checks in the main thread (environment, slice, then the
broker's credentials, then the artifacts directory: the broker's check only reads, the artifacts check may adopt a
directory, so a worker Redis refuses never adopts one), then every heavy import in the main thread
(worker/preload.py has the order and why), then the other threads (models, heartbeat, flex_attention probe, stack
watch) with the QLoRA probe and the registration, then Celery's solo pool in the main thread.

Tests only: JOBS_TEST_MISSING_GPUS_OK=1 starts a worker whose slice's GPUs are missing anyway (it registers its
queue and fails GPU jobs at load), so CI on a CPU host can run the launchers' GPU-slice workers (tests/test_deploy.py).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass

from celery import signals

from core import artifacts, exits
from core.errors import WrongArtifacts
from core.logs import setup_logging
from core.queue import queue_for

log = logging.getLogger("worker")
MISSING_GPUS_OK = "JOBS_TEST_MISSING_GPUS_OK"  # tests only: see the module docstring


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m worker.main")
    parser.add_argument("--slice", required=True, help="CUDA_VISIBLE_DEVICES of this worker ('' for CPU)")
    parser.add_argument("--name", help="worker name (default: w<pid>-<slice>@<host>)")
    parser.add_argument("--loglevel", default="INFO")
    return parser.parse_args(argv)


def survive_broker_loss_with_unacked_messages() -> None:
    """Keep the worker alive when Redis dies while it holds an unacknowledged message.

    Celery 5.7 handles a lost broker connection by `collect()`ing it (which detaches its transport) and then
    closing it; closing the default channel tries to restore the unacked message through the detached transport,
    raises AttributeError, and Celery ends the worker as an "unrecoverable error". Kombu already ignores
    AttributeError when it closes the connection itself; we ignore it when it closes the channel too. Nothing is
    lost by that: the message could not be put back into a dead Redis anyway, and the shard's SQL lease and the
    reaper re-queue it (tests/test_faults.py kills Redis for 2 s and 10 s mid-job).
    """
    from kombu.connection import Connection

    def maybe_close_channel(self, channel):
        try:
            channel.close()
        except self.connection_errors + self.channel_errors + (AttributeError,):
            pass

    Connection.maybe_close_channel = maybe_close_channel


def event_heartbeats_never_block() -> None:
    """Send Celery's event heartbeats (`worker-online`, `worker-heartbeat`: what Flower shows) once, never retrying.

    Celery's `Heart` sends one every 2 s from the consumer's event loop, in the main thread, with `retry=True` and no
    retry policy, and kombu's `Connection.ensure` then reconnects for ever without looking at Celery's shutdown
    flags. When that timer fires after Redis died but before the event loop has read the dead socket (a worker that
    was not scheduled at that moment: a busy machine), the main thread never comes back: neither the stack watch's
    shutdown (exit 69) nor SIGTERM is seen (issue 22: a hand-started worker outlived `gpujobs down`). Sent without
    retry, an event that finds no broker is buffered by the dispatcher (sent once it reconnects) and the loop goes
    on to notice the lost connection. This worker's liveness is its SQL heartbeat (worker/runtime.py), not these
    events (tests/test_supervisor.py shows the send returning on a dead Redis).
    """
    from celery.worker import heartbeat

    if getattr(heartbeat.Heart._send, "never_blocks", False):
        return
    send = heartbeat.Heart._send

    def send_once(self, event, retry=True):
        return send(self, event, retry=False)

    send_once.never_blocks = True
    heartbeat.Heart._send = send_once


def start_models(name: str, closed) -> None:
    """Record what this host's Hugging Face cache holds (before the worker counts as live, so a submit sees it),
    then serve `gpujobs models pull/rm --workers` requests in a thread (worker/hubfetch.py)."""
    import threading

    from worker import hubfetch

    try:
        hubfetch.inventory(name)
    except Exception:  # an unreadable cache must not keep the worker from serving local models
        log.exception("could not scan the Hugging Face cache")
    threading.Thread(target=hubfetch.serve, args=(name, closed), name="models", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.loglevel)
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    from core.settings import get_settings

    # A session of this worker left inside a transaction (its host cut off between UPDATE and COMMIT) is ended by
    # the server within one lease, so its row locks never outlive the lease; and no statement waits on a lock long.
    lease_ms = int(get_settings().lease_seconds * 1000)
    os.environ.setdefault("PGOPTIONS", f"-c idle_in_transaction_session_timeout={lease_ms} -c lock_timeout=5000")

    from worker import compile_cache

    compile_cache.use(get_settings().home)  # before torch compiles anything: compiled code kept under JOBS_HOME

    devices = [d for d in args.slice.split(",") if d]
    host = get_settings().hostname or socket.gethostname()
    name = args.name or f"w{os.getpid()}-{'gpu' + '-'.join(devices) if devices else 'cpu'}@{host}"
    queue = queue_for(len(devices))

    from worker import capabilities, faults, preload, stackwatch  # light: the standard library and core

    where = Where(name=name, host=host, slice=args.slice, queues=[queue])
    if os.environ.get("CUDA_VISIBLE_DEVICES") != args.slice or os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        return refuse(
            where,
            exits.ENV_MISMATCH,
            (
                f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r} / CUDA_DEVICE_ORDER="
                f"{os.environ.get('CUDA_DEVICE_ORDER')!r} do not match --slice {args.slice!r}: start workers with "
                "`gpujobs worker --gpus ...`"
            ),
        )
    problem = capabilities.slice_problem(devices)
    if problem and os.environ.get(MISSING_GPUS_OK) == "1":
        log.error("%s=1 (tests only): starting although %s", MISSING_GPUS_OK, problem)
    elif problem:
        return refuse(where, exits.SLICE_MISSING, problem)
    from core.queue import get_app
    from worker import broker

    refusal = broker.refusal(get_app())  # one connection, before torch's imports: a wrong password ends it here
    if refusal:
        return refuse(where, exits.BROKER_REFUSED, refusal)
    try:  # after the broker (which changes nothing), before any work: another directory would keep outputs to itself
        artifacts.verify(get_settings().artifacts, host=host)
    except WrongArtifacts as exc:
        return refuse(where, exits.WRONG_ARTIFACTS, str(exc))
    try:  # every heavy import, in this thread, before any other thread starts (worker/preload.py: the order, why)
        preload.preload()
    except preload.Broken as exc:
        return refuse(where, exits.BROKEN, str(exc))

    from worker import runtime as rt

    runtime = rt.Runtime(name=name, host=host, slice=args.slice, queues=[queue], gpus=len(devices))
    from worker import tasks

    tasks.use(runtime)
    start_models(name, runtime.closed)
    runtime.register(os.getpid())
    faults.hit("start")  # test-only (worker/faults.py)
    runtime.start_heartbeat()
    stackwatch.watch(name, runtime.hand_back_now)  # a worker of the local stack leaves (69) when it is stopped
    signals.worker_shutting_down.connect(lambda **_: runtime.shutting_down.set(), weak=False)
    survive_broker_loss_with_unacked_messages()
    event_heartbeats_never_block()
    refused: list[str] = []  # why Redis refused this worker's credentials at a reconnect (77), if it did
    broker.stop_on_refused_credentials(refused.append)
    controllers = []  # Celery's WorkController: worker_main() drops its exit status (stackwatch's 69), we keep it
    signals.worker_init.connect(lambda sender, **_: controllers.append(sender), weak=False)
    gave_up = GaveUp()
    logging.getLogger("celery").addHandler(gave_up)
    code = None
    try:
        tasks.app.worker_main(
            [
                "worker",
                "--pool=solo",
                f"--queues={queue}",
                f"--hostname={name}",
                f"--loglevel={args.loglevel}",
                "--without-gossip",
                "--without-mingle",
                "--task-events",
            ]
        )
        code = (controllers[0].exitcode if controllers else None) or 0
    finally:
        runtime.stop(exit_code=code or None, reason=refused[-1] if refused else exit_reason(code, gave_up.message))
    log.info("worker %s exits with code %d (%s)", name, code, exits.describe(code))
    return code


class GaveUp(logging.Handler):
    """The last critical record of Celery's loggers: why its worker gave up (`Unrecoverable error: ...`, e.g. a
    Redis that stayed away past JOBS_BROKER_RETRIES reconnects)."""

    def __init__(self):
        super().__init__(logging.CRITICAL)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def exit_reason(code: int | None, message: str | None) -> str | None:
    """What the registration says of an exit Celery's worker ended with: nothing for a clean stop, or where the
    reason is already written (stackwatch's 69)."""
    if not code or code == exits.STACK_GONE:
        return None
    return f"exit code {code}: {message}" if message else f"exit code {code} ({exits.describe(code)})"


@dataclass(frozen=True)
class Where:
    """Who a worker is: what its registration is keyed and listed by."""

    name: str
    host: str
    slice: str
    queues: list[str]


def refuse(where: Where, code: int, reason: str) -> int:
    """Do not start: say why on stderr and in the registration (offline, with the reason and exit code, so
    `gpujobs workers` shows it), and return the exit code."""
    log.error("refusing to start (exit %d): %s", code, reason)
    try:
        register_refusal(where, os.getpid(), code, reason)
    except Exception:  # noqa: BLE001  no database: the message and the exit code still say it
        log.exception("could not record the refusal of %s in the database", where.name)
    return code


def register_refusal(where: Where, pid: int, code: int, reason: str) -> None:
    """Register as a worker that did not start: offline, with why and its exit code (never on a queue). What it can
    run is left out when the process cannot tell (its imports are broken: exits.BROKEN)."""
    from core import registry
    from core.db import session_scope
    from core.settings import get_settings
    from worker import capabilities

    try:
        caps, gpus = capabilities.probe(), capabilities.gpus()
    except Exception as exc:  # noqa: BLE001  the reason says why; the row is written all the same
        caps, gpus = {"probe_error": f"{type(exc).__name__}: {exc}"}, []
    with session_scope() as session:
        registry.register(
            session,
            name=where.name,
            host=where.host,
            pid=pid,
            slice=where.slice,
            queues=where.queues,
            gpus=gpus,
            capabilities=caps,
            restarts=get_settings().worker_restarts,
        )
        registry.stopped(session, where.name, exit_code=code, reason=f"refused to start: {reason}")


if __name__ == "__main__":
    sys.exit(main())
