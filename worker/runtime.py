"""Per-process worker runtime: identity, the resident model, the heartbeat thread, and the shard runner.

One worker process owns one GPU slice and runs one shard at a time (Celery solo pool, in the main thread).
A daemon thread beats every second: it renews the current shard's lease, notices a cancel or a lost lease
(the engine checks `should_stop()` between decode steps), refreshes the worker's registration, and runs the
reaper, which any number of workers may run at once.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from core import leases, registry
from core.db import session_scope
from core.errors import IllegalTransition, InvalidInput, LeaseLost
from core.models import Job, Shard
from core.queue import TASK_RUN_SHARD, send, waiting_messages
from core.settings import get_settings
from core.spec import GenerateSpec, LoadOptions
from core.store import add_event, maybe_finalize, now
from worker import capabilities, faults, generate, loader

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    name: str
    host: str
    slice: str
    queues: list[str]
    gpus: int
    current: int | None = None  # shard id under lease
    current_job: str | None = None
    stop_current: threading.Event = field(default_factory=threading.Event)
    shutting_down: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    resident: tuple[str, loader.Loaded] | None = None
    _beat: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------------------

    def register(self, pid: int) -> None:
        caps = capabilities.probe()
        with session_scope() as session:
            registry.register(session, name=self.name, host=self.host, pid=pid, slice=self.slice,
                              queues=self.queues, gpus=capabilities.gpus(), capabilities=caps)
        log.info("worker %s registered: slice %r, queues %s, %d CUDA device(s)", self.name, self.slice,
                 self.queues, caps["device_count"])
        if self.gpus and caps["device_count"] < self.gpus:
            log.error("worker %s was started for GPUs %s but CUDA sees %d device(s): it will refuse GPU shards",
                      self.name, self.slice, caps["device_count"])

    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._beat.start()

    def stop(self) -> None:
        self.shutting_down.set()
        self.closed.set()
        with session_scope() as session:
            registry.stopped(session, self.name)

    # --- heartbeat ---------------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        settings = get_settings()
        last_beat = 0.0
        while not self.closed.wait(1.0):
            try:
                self._check_current(settings.lease_seconds, renew=time.time() - last_beat >= settings.heartbeat_seconds)
                if time.time() - last_beat >= settings.heartbeat_seconds:
                    last_beat = time.time()
                    with session_scope() as session:
                        registry.heartbeat(session, self.name, current_shard_id=self.current)
                    reap()
            except Exception:  # the beat must survive database or broker outages; the lease covers the gap
                log.exception("heartbeat of %s failed; retrying", self.name)

    def _check_current(self, lease_seconds: float, *, renew: bool) -> None:
        shard_id, job_id = self.current, self.current_job
        if shard_id is None:
            return
        with session_scope() as session:
            if renew and not leases.renew(session, shard_id, self.name, lease_seconds):
                log.warning("%s lost the lease of shard %s: stopping it", job_id, shard_id)
                self.stop_current.set()
            if leases.job_stopping(session, job_id):
                self.stop_current.set()

    # --- the shard runner --------------------------------------------------------------------------------

    def run_shard(self, shard_id: int) -> None:
        settings = get_settings()
        with session_scope() as session:
            claim = leases.claim(session, shard_id, self.name, settings.lease_seconds)
            if claim is None:
                return
            shard, job = claim.shard, claim.job
            rows = [(r.idx, r.input) for r in claim.rows]
        self.current, self.current_job = shard.id, job.id
        self.stop_current.clear()
        log.info("%s shard %s: %d pending rows", job.id, shard.idx, len(rows))
        try:
            self._run(shard, job, rows)
        except (LeaseLost, IllegalTransition) as exc:  # someone else owns the shard now: leave it to them
            log.warning("%s %s", job.id, exc)
        except InvalidInput as exc:
            self._give_up(shard, str(exc))
        except Exception:
            self._failed_attempt(shard, traceback.format_exc())
        finally:
            self.current = self.current_job = None
        with session_scope() as session:
            maybe_finalize(session, job.id)

    def _run(self, shard, job: Job, rows: list[tuple[int, dict[str, Any]]]) -> None:
        settings = get_settings()
        spec = GenerateSpec.model_validate(job.spec)
        started, t0 = time.time(), time.perf_counter()
        loaded = self.model_for(spec, job.id)
        _record_load(job.id, loaded.resolved)
        batch_rows = spec.batch_rows or settings.batch_rows
        engine_s = 0.0
        _reset_peak_memory()
        should_stop = lambda: self.stop_current.is_set() or self.shutting_down.is_set()  # noqa: E731
        t_engine = time.perf_counter()
        def on_event(message: str) -> None:
            with session_scope() as session:
                add_event(session, job.id, f"shard {shard.idx}: {message}", level="warning", shard_id=shard.id)

        for results in generate.generate(loaded, spec, rows, batch_rows=batch_rows, should_stop=should_stop,
                                         on_event=on_event):
            engine_s += time.perf_counter() - t_engine
            faults.hit("batch")
            with session_scope() as session:
                if leases.job_stopping(session, job.id):
                    break
                leases.commit_rows(session, shard, self.name, results, settings.lease_seconds)
            t_engine = time.perf_counter()
        with session_scope() as session:
            if leases.job_stopping(session, job.id):
                leases.stop_cancelled(session, shard, self.name)
                return
            handing_back = should_stop()  # shutdown or lost lease: hand the unfinished rows back
            if handing_back:
                leases.hand_back(session, shard, self.name, "worker stopping: unfinished rows handed back",
                                 count_attempt=False)
        if handing_back:
            self._resend(shard.id, job.queue)
            return
        with session_scope() as session:
            wall = time.perf_counter() - t0
            metrics = {"wall_seconds": round(wall, 3), "engine_seconds": round(engine_s, 3),
                       "gpu_seconds": round(wall * max(self.gpus, 0), 3), "rows": len(rows),
                       "peak_memory_bytes": _peak_memory(), "worker": self.name, "started_at": started}
            leases.finish(session, shard, self.name, metrics)

    def model_for(self, spec: GenerateSpec, job_id: str) -> loader.Loaded:
        """The resident model if the load options match, else load (and free the previous one first)."""
        opts = LoadOptions.model_validate(spec.model_dump(include=set(LoadOptions.model_fields)))
        key = opts.load_key()
        if self.resident and self.resident[0] == key:
            return self.resident[1]
        self.resident = None
        _free_memory()
        t0 = time.perf_counter()
        loaded = loader.load(opts, gpus=self.gpus)
        loaded.resolved["load_seconds"] = round(time.perf_counter() - t0, 3)
        with session_scope() as session:
            add_event(session, job_id, f"{self.name} loaded {opts.model} in {loaded.resolved['load_seconds']} s",
                      data=loaded.resolved)
        self.resident = (key, loaded)
        return loaded

    def _failed_attempt(self, shard, error: str) -> None:
        log.error("%s shard %s failed on %s:\n%s", shard.job_id, shard.idx, self.name, error)
        with session_scope() as session:
            add_event(session, shard.job_id, f"shard {shard.idx} failed on {self.name}", level="error",
                      data={"traceback": error}, shard_id=shard.id)
            shard = session.get(Shard, shard.id)
            try:
                if shard.attempts >= shard.max_attempts:
                    leases.give_up(session, shard, f"failed {shard.attempts} times; last error: {error.strip().splitlines()[-1]}")
                    return
                leases.hand_back(session, shard, self.name, "engine error; retrying")
            except IllegalTransition:
                return
        self._resend(shard.id, shard_queue(shard.job_id))

    def _give_up(self, shard, reason: str) -> None:
        with session_scope() as session:
            try:
                leases.give_up(session, shard, reason)
            except IllegalTransition:
                pass

    def _resend(self, shard_id: int, queue: str) -> None:
        send(TASK_RUN_SHARD, [shard_id], queue)
        with session_scope() as session:
            leases.mark_enqueued(session, [shard_id])


def shard_queue(job_id: str) -> str:
    with session_scope() as session:
        return session.get(Job, job_id).queue


def reap() -> None:
    """Send never-sent shards, re-queue shards whose lease expired, finalize jobs whose shards all ended.

    After a Redis restart (its data, our messages included, are gone) every queued shard is sent again. Two
    reapers may both send a shard: the second message finds the shard leased or done and does nothing.
    """
    settings = get_settings()
    broker_restarted = _claim_broker_epoch()
    with session_scope() as session:
        registry.mark_lost(session, settings.worker_timeout)
        cutoff = now() if broker_restarted else now() - settings.lease_seconds
        shards = leases.queued_shards(session, older_than=cutoff, unsent_only=not broker_restarted)
        to_send = [(s.id, s.job_id) for s in shards]
        for shard in leases.expired_shards(session):
            if leases.requeue_expired(session, shard):
                to_send.append((shard.id, shard.job_id))
        # A message Redis handed to a host as it dropped off the network is gone (kombu records it as unacked only
        # once read): a shard still queued a lease after its send, while its queue is empty, is sent again.
        stale = leases.sent_long_ago(session, sent_before=now() - settings.lease_seconds)
        empty = {q for q in {q for _, q in stale} if waiting_messages(q) == 0}
        for shard, queue in stale:
            if queue in empty and leases.mark_resent(session, shard):
                to_send.append((shard.id, shard.job_id))
    for shard_id, job_id in to_send:
        log.info("%s reaper: enqueuing shard %s", job_id, shard_id)
        send(TASK_RUN_SHARD, [shard_id], shard_queue(job_id))
        with session_scope() as session:
            leases.mark_enqueued(session, [shard_id])
    with session_scope() as session:
        for job_id in leases.stuck_jobs(session):
            maybe_finalize(session, job_id)


def _claim_broker_epoch() -> bool:
    """True for the one process that first sees an empty Redis (a fresh or restarted server lost its messages).

    That process re-sends every queued shard; duplicate messages are harmless (a claim is idempotent).
    """
    import redis

    client = redis.Redis.from_url(get_settings().redis_url, socket_timeout=5)
    return bool(client.set("gpujobs:broker-epoch", str(now()), nx=True))


def _record_load(job_id: str, resolved: dict[str, Any]) -> None:
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job.load_options is None:
            job.load_options = resolved
            job.versions = capabilities.versions()


def _reset_peak_memory() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory() -> int:
    import resource

    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: peak resident set of the process


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
