"""Per-process worker runtime: identity, the resident model, the heartbeat thread, and the shard runner.

One worker process owns one GPU slice and runs one shard at a time (Celery solo pool, in the main thread).
A daemon thread beats every second: it renews the current shard's lease, notices a cancel or a lost lease
(the engine checks `should_stop()` between decode steps), refreshes the worker's registration, and runs the
reaper, which any number of workers may run at once.

The stall watchdog: progress, not liveness, renews a lease. The engines report every decode step, prefill chunk
and training step, and the runner every committed micro-batch, to `Runtime.progress` (worker/progress.py). The
heartbeat renews the lease only while the last progress is within the stall bound. Past it (`_on_stall`) the
worker writes a `stall` event on the job (what it was doing, for how long, the engine thread's stack), gives the
shard back (the attempt counts: a shard that stalls on every attempt fails after JOBS_MAX_ATTEMPTS with that
reason; a cancelled job's shard is cancelled), sends it again for another worker, records the reason on its
registration and exits with `core.exits.STALLED`: a CUDA context that hung is not trusted again. Committed rows
stay; the next claim takes only pending rows.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core import adapters, exits, leases, registry
from core.db import session_scope
from core.errors import IllegalTransition, InvalidInput, LeaseLost
from core.models import Job, Shard
from core.queue import TASK_RUN_SHARD, send, waiting_messages
from core.settings import get_settings
from core.spec import FinetuneSpec, GenerateSpec, LoadOptions
from core.store import add_event, expire_batches, maybe_finalize, now
from worker import capabilities, faults, generate, hubfetch, loader
from worker.progress import Progress, Stall

log = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
STALL_EXIT_GRACE_S = 30.0  # a stalled worker exits this long after the stall at the latest, recorded or not


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
    progress: Progress = field(default_factory=Progress)  # the engine's progress on the current shard
    _engine_thread: int | None = None  # the thread that runs shards (Celery's solo pool: the main thread)
    _reported_progress: bool = False  # the registration shows a shard's progress (cleared once it ended)
    _beat: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------------------------------

    def register(self, pid: int) -> None:
        caps = capabilities.probe()
        with session_scope() as session:
            registry.register(session, name=self.name, host=self.host, pid=pid, slice=self.slice,
                              queues=self.queues, gpus=capabilities.gpus(), capabilities=caps,
                              restarts=get_settings().worker_restarts)
        log.info("worker %s registered: slice %r, queues %s, %d CUDA device(s)", self.name, self.slice,
                 self.queues, caps["device_count"])

    def refuse(self, pid: int, exit_code: int, reason: str) -> None:
        """Register as a worker that did not start: offline, with why and its exit code (never on a queue)."""
        caps = capabilities.probe()
        with session_scope() as session:
            registry.register(session, name=self.name, host=self.host, pid=pid, slice=self.slice,
                              queues=self.queues, gpus=capabilities.gpus(), capabilities=caps)
            registry.stopped(session, self.name, exit_code=exit_code, reason=f"refused to start: {reason}")

    def start_heartbeat(self) -> None:
        self._beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._beat.start()
        threading.Thread(target=self._probe_qlora, name="qlora-probe", daemon=True).start()

    def _probe_qlora(self) -> None:
        """Merge the (slow) bitsandbytes 4-bit probe into this worker's registration once it has run."""
        try:
            result = capabilities.probe_qlora(capabilities.gpus())
            with session_scope() as session:
                registry.heartbeat(session, self.name, current_shard_id=self.current, extra={"qlora": result})
            log.info("worker %s: QLoRA probe %s", self.name, result)
        except Exception:
            log.exception("QLoRA probe of %s failed to record", self.name)

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
                self._check_current(settings, renew=time.time() - last_beat >= settings.heartbeat_seconds)
                if time.time() - last_beat >= settings.heartbeat_seconds:
                    last_beat = time.time()
                    with session_scope() as session:
                        registry.heartbeat(session, self.name, current_shard_id=self.current,
                                           extra=self._activity(settings))
                    reap()
            except Exception:  # the beat must survive database or broker outages; the lease covers the gap
                log.exception("heartbeat of %s failed; retrying", self.name)

    def _activity(self, settings) -> dict[str, Any] | None:
        """What the registration shows while the worker runs: its engine's progress (set to null once a shard
        ended), and on GPUs the memory its torch holds."""
        extra: dict[str, Any] = {}
        if self.current is not None:
            extra["progress"] = self.progress.report(settings.stall_seconds, settings.stall_phase_seconds)
        elif self._reported_progress:
            extra["progress"] = None
        self._reported_progress = self.current is not None
        if self.gpus:
            extra["gpu_memory"] = _gpu_memory()
        return extra or None

    def _check_current(self, settings, *, renew: bool) -> None:
        """Stop renewing a stalled shard's lease (and end the process), renew a progressing one, and notice a cancel
        or a lost lease."""
        shard_id, job_id = self.current, self.current_job
        if shard_id is None:
            return
        stall = self.progress.stalled(settings.stall_seconds, settings.stall_phase_seconds)
        if stall is not None:
            self._on_stall(shard_id, job_id, stall)  # never returns
        lease_seconds = settings.lease_seconds
        with session_scope() as session:
            if renew and not leases.renew(session, shard_id, self.name, lease_seconds):
                log.warning("%s lost the lease of shard %s: stopping it", job_id, shard_id)
                self.stop_current.set()
            if leases.job_stopping(session, job_id):
                self.stop_current.set()

    def _on_stall(self, shard_id: int, job_id: str, stall: Stall) -> None:
        """The engine made no progress within the bound: write a `stall` event with the engine thread's stack, give
        the shard back and send it again, record why on the registration, and end the process with
        exits.STALLED. Never returns: the engine thread is stuck (in the GPU, a collective, a lock), and nothing
        it holds is trusted again. Whatever of this cannot be written (database down, a log handler stuck with the
        engine thread), the process still exits within STALL_EXIT_GRACE_S; the lease, no longer renewed, then
        expires and any worker's reaper re-queues the shard."""
        exit_timer = threading.Timer(STALL_EXIT_GRACE_S, os._exit, [exits.STALLED])
        exit_timer.daemon = True
        exit_timer.start()
        self.stop_current.set()
        stack = thread_stack(self._engine_thread)
        reason = f"stalled: {stall.describe()}"
        log.error("%s shard %s %s on %s; engine thread stack:\n%s", job_id, shard_id, reason, self.name, stack)
        where = f"job {job_id}, shard id {shard_id}"
        try:
            idx, resend = self._give_back_stalled(shard_id, job_id, stall, stack)
            where = f"job {job_id}, shard {idx}"
            if resend:
                self._resend(shard_id, shard_queue(job_id))
        except Exception:
            log.exception("%s could not give back shard %s after the stall: its lease expires unrenewed and the "
                          "reaper re-queues it", job_id, shard_id)
        try:
            with session_scope() as session:
                registry.stopped(session, self.name, exit_code=exits.STALLED,
                                 reason=f"{reason} ({where}); exit code {exits.STALLED}")
        except Exception:
            log.exception("could not record the stall on the registration of %s", self.name)
        _flush_output()
        os._exit(exits.STALLED)

    def _give_back_stalled(self, shard_id: int, job_id: str, stall: Stall, stack: str) -> tuple[int, bool]:
        """The stall event (its own transaction, so it stays even if the lease is no longer ours), then the shard:
        back to the queue (send it again: True), failed past its attempts, or cancelled with its job. Returns the
        shard's index in its job and whether to send it again."""
        with session_scope() as session:
            shard = session.get(Shard, shard_id)
            if leases.job_stopping(session, job_id):
                outcome = "the job is stopping: the shard is cancelled"
            elif shard.attempts >= shard.max_attempts:
                outcome = "the shard fails: it used its last attempt"
            else:
                outcome = f"the shard goes back to the queue (attempt {shard.attempts} of {shard.max_attempts} used)"
            add_event(session, job_id, f"shard {shard.idx} stalled on {self.name}: {stall.describe()}, stuck in "
                      f"{stuck_at(stack)}; {outcome}; the worker exits with code {exits.STALLED} (the engine "
                      "thread's stack: gpujobs events --json)", kind="stall", level="error", shard_id=shard_id,
                      data={"worker": self.name, "doing": stall.doing, "seconds": round(stall.seconds, 3),
                            "bound_s": round(stall.bound, 3), "phase": stall.phase, "progress_count": stall.beats,
                            "median_step_s": stall.median_step_s, "attempt": shard.attempts,
                            "max_attempts": shard.max_attempts, "exit_code": exits.STALLED, "stack": stack})
        with session_scope() as session:
            shard = session.get(Shard, shard_id)
            idx = shard.idx
            if leases.job_stopping(session, job_id):
                leases.stop_cancelled(session, shard, self.name)
                return idx, False
            if shard.attempts >= shard.max_attempts:
                leases.give_up(session, shard, f"stalled on attempt {shard.attempts} of {shard.max_attempts} "
                               f"({self.name}): {stall.describe()}")
                return idx, False
            leases.hand_back(session, shard, self.name, f"stalled on {self.name}: {stall.describe()}")
        return idx, True

    # --- the shard runner --------------------------------------------------------------------------------

    def run_shard(self, shard_id: int) -> None:
        settings = get_settings()
        with session_scope() as session:
            claim = leases.claim(session, shard_id, self.name, settings.lease_seconds)
            if claim is None:
                return
            shard, job = claim.shard, claim.job
            rows = [(r.idx, r.input) for r in claim.rows]
            lines = {r.idx: r.line for r in claim.rows}
        self.progress.start("the shard was claimed")  # before `current`: the watchdog never sees an old clock
        self._engine_thread = threading.get_ident()
        self.current, self.current_job = shard.id, job.id
        self.stop_current.clear()
        log.info("%s shard %s: %d pending rows", job.id, shard.idx, len(rows))
        try:
            if job.kind == "finetune":
                self._run_finetune(shard, job, rows, lines)
            else:
                self._run(shard, job, rows)
        except (LeaseLost, IllegalTransition) as exc:  # someone else owns the shard now: leave it to them
            log.warning("%s %s", job.id, exc)
        except (InvalidInput, adapters.RegistryError) as exc:
            self._give_up(shard, str(exc))
        except Exception:
            self._failed_attempt(shard, traceback.format_exc())
        finally:
            self.current = self.current_job = None
        with session_scope() as session:
            maybe_finalize(session, job.id)
        if job.kind == "finetune":
            release_waiting(job.id)

    def _run(self, shard, job: Job, rows: list[tuple[int, dict[str, Any]]]) -> None:
        settings = get_settings()
        spec = GenerateSpec.model_validate(job.spec)
        if spec.tp_plan:  # refused at submit too; a job queued while no worker was live reaches this
            raise InvalidInput("tp_plan auto (tensor parallel under torchrun) is not supported by the workers yet: "
                               "use device_map auto to split the model over the slice")
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

        engine_info: dict[str, Any] = {}  # what ran: engine, attention, CUDA graphs, cache (worker/generate.py)
        first_result: float | None = None
        for results in generate.generate(loaded, spec, rows, batch_rows=batch_rows, should_stop=should_stop,
                                         on_event=on_event, info=engine_info, progress=self.progress):
            engine_s += time.perf_counter() - t_engine
            faults.hit("batch")
            with session_scope() as session:
                if leases.job_stopping(session, job.id):
                    break
                leases.commit_rows(session, shard, self.name, results, settings.lease_seconds)
            self.progress.beat("committed micro-batch")
            first_result = first_result or time.time()  # time to first result: first commit after the claim
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
                       "peak_memory_bytes": _peak_memory(), "worker": self.name, "started_at": started,
                       "engine": engine_info, "time_to_first_result_s":
                           round(first_result - (shard.started_at or started), 3) if first_result else None}
            leases.finish(session, shard, self.name, metrics)
        _record_engine(job.id, engine_info)

    def _run_finetune(self, shard, job: Job, rows: list[tuple[int, dict[str, Any]]], lines: dict[int, int]) -> None:
        """Train (resuming from the last complete checkpoint), register the adapter, then finish the shard.

        The resident model is dropped first: training wraps a model in place, so it is never shared with jobs.
        """
        from worker import distributed, finetune

        settings = get_settings()
        spec = FinetuneSpec.model_validate(job.spec)
        opts = LoadOptions.model_validate(spec.model_dump(include=set(LoadOptions.model_fields)))
        with self.progress.phase("downloading model"):  # Hub ids, once per host (a stalled download times out)
            opts = hubfetch.prepare(opts, job.id, worker=self.name, should_stop=self._stopping)
        self.resident = None
        _free_memory()
        workdir = adapters.workdir(job.id)
        checkpoint = finetune.latest_checkpoint(workdir / "checkpoints")
        _event(job.id, shard, f"{self.name} starts training" + (f", resuming from {checkpoint.name}" if checkpoint
                                                                 else ""))
        should_stop = lambda: self.stop_current.is_set() or self.shutting_down.is_set()  # noqa: E731

        def on_log(record: dict[str, Any]) -> None:
            _event(job.id, shard, finetune_line(record), kind="metric", data=record)
            faults.hit("train_step")

        t0 = time.perf_counter()
        # one process, or one per GPU of the slice under torchrun (worker/distributed.py); this process writes SQL
        result = distributed.finetune(opts, spec, [(lines[i], row) for i, row in rows], workdir, gpus=self.gpus,
                                      should_stop=should_stop, on_log=on_log, progress=self.progress)
        _record_load(job.id, result.metrics["load"])
        with session_scope() as session:
            if leases.job_stopping(session, job.id):
                leases.stop_cancelled(session, shard, self.name)
                return
            if result.stopped:  # shutdown or lost lease: the next worker resumes from the last checkpoint
                leases.hand_back(session, shard, self.name, "worker stopping: training handed back at step "
                                 f"{result.metrics['steps']}", count_attempt=False)
        if result.stopped:
            self._resend(shard.id, job.queue)
            return
        folder = adapters.adapter_dir(job.id)
        with self.progress.phase("publishing and verifying the adapter"):
            _publish(result.adapter_dir, folder)
            faults.hit("adapter_saved", path=folder / adapters.WEIGHTS)
            try:
                finetune.verify_adapter(opts, folder, gpus=self.gpus)
            except Exception as exc:  # noqa: BLE001  any failure to load or generate is the registry's refusal
                raise adapters.RegistryError(f"registry error: the adapter saved at {folder} does not load onto "
                                             f"{spec.model} and generate ({type(exc).__name__}: {exc})") from exc
        wall = time.perf_counter() - t0
        metrics = {**{k: v for k, v in result.metrics.items() if k != "load"}, "wall_seconds": round(wall, 3),
                   "gpu_seconds": round(wall * max(self.gpus, 0), 3), "worker": self.name,
                   "resumed_from_step": result.resumed_from}
        with session_scope() as session:
            leases.commit_rows(session, shard, self.name, [leases.RowResult(idx=i) for i, _ in rows],
                               settings.lease_seconds)
            registered = session.get(Job, job.id)
            adapters.register(session, registered, folder, lora_config=result.lora_config,
                              load_options=result.metrics["load"], metrics=metrics)
            registered.metrics = {**(registered.metrics or {}), "training": metrics}
            leases.finish(session, shard, self.name, metrics)

    def model_for(self, spec: GenerateSpec, job_id: str) -> loader.Loaded:
        """The resident model if the load options match, else load (and free the previous one first)."""
        opts = LoadOptions.model_validate(spec.model_dump(include=set(LoadOptions.model_fields)))
        with self.progress.phase("downloading model"):  # Hub ids, once per host (a stalled download times out)
            opts = hubfetch.prepare(opts, job_id, worker=self.name, should_stop=self._stopping)
        key = opts.load_key()
        if self.resident and self.resident[0] == key:
            return self.resident[1]
        self.resident = None
        _free_memory()
        t0 = time.perf_counter()
        with self.progress.phase("loading model"):
            loaded = loader.load(opts, gpus=self.gpus)
        loaded.resolved["load_seconds"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        prepared = generate.prepare_engine(loaded, spec, self.progress)  # load time, not a job's: cache,
        # compiled layers, CUDA graphs
        if prepared:
            loaded.resolved["prepared"] = {**prepared, "seconds": round(time.perf_counter() - t0, 3)}
        with session_scope() as session:
            add_event(session, job_id, f"{self.name} loaded {opts.model} in {loaded.resolved['load_seconds']} s",
                      data=loaded.resolved)
        self.resident = (key, loaded)
        return loaded

    def _stopping(self) -> bool:
        return self.stop_current.is_set() or self.shutting_down.is_set()

    def _failed_attempt(self, shard, error: str) -> None:
        log.error("%s shard %s failed on %s:\n%s", shard.job_id, shard.idx, self.name, error)
        last_line = error.strip().splitlines()[-1]
        with session_scope() as session:
            shard = session.get(Shard, shard.id)
            add_event(session, shard.job_id, f"shard {shard.idx} failed on {self.name} (attempt {shard.attempts} of "
                      f"{shard.max_attempts}): {last_line}", level="error", data={"traceback": error},
                      shard_id=shard.id)
            try:
                if shard.attempts >= shard.max_attempts:
                    leases.give_up(session, shard, f"failed {shard.attempts} times; last error: {last_line}")
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


def finetune_line(record: dict[str, Any]) -> str:
    """One readable line per training log: `step 12/60 epoch 2.00 loss 0.4123 lr 1.0e-02 …`."""
    parts = [f"step {record['step']}/{record['max_steps']}", f"epoch {record['epoch']:.2f}"]
    for key, fmt in (("loss", "loss {:.4f}"), ("eval_loss", "eval_loss {:.4f}"), ("learning_rate", "lr {:.1e}"),
                     ("grad_norm", "grad_norm {:.3f}"), ("tokens_per_s", "{:.0f} tok/s"),
                     ("gpu_peak_memory_bytes", "peak {:.0f} MiB")):
        if record.get(key) is not None:
            value = record[key] / 2**20 if key == "gpu_peak_memory_bytes" else record[key]
            parts.append(fmt.format(value))
    return " ".join(parts)


def _event(job_id: str, shard, message: str, **kwargs: Any) -> None:
    with session_scope() as session:
        add_event(session, job_id, message, shard_id=shard.id, **kwargs)


def _publish(src, dest) -> None:
    """Move the saved adapter to its registry folder: copy beside it, then rename, so a reader never sees half."""
    import shutil

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


def release_waiting(finetune_id: str | None = None) -> None:
    """Shard (or fail) generation jobs that waited for a fine-tune that has now ended, and send their shards."""
    with session_scope() as session:
        to_send = adapters.release_waiting(session, finetune_id)
    for shard_ids, queue in to_send:
        for shard_id in shard_ids:
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
        for job_id in expire_batches(session, settings.batch_window_seconds):
            log.info("%s reaper: OpenAI batch past its completion window: cancelled as expired", job_id)
    release_waiting()  # chained jobs whose fine-tune ended while no worker was there to release them


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


def _record_engine(job_id: str, engine_info: dict[str, Any]) -> None:
    """The job's load options also say which engine ran, as the first finished shard saw it (each shard's
    metrics keep their own)."""
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job.load_options is not None and "engine" not in job.load_options:
            job.load_options = {**job.load_options, "engine": engine_info}


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


def _gpu_memory() -> list[dict[str, int]]:
    """What this process's torch holds on each of its GPUs (GET /metrics); never initialises CUDA itself."""
    import torch

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return []
    return [{"index": i, "allocated_bytes": int(torch.cuda.memory_allocated(i)),
             "reserved_bytes": int(torch.cuda.memory_reserved(i))} for i in range(torch.cuda.device_count())]


def _free_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def thread_stack(ident: int | None) -> str:
    """The current stack of thread `ident` (the engine thread, read from the heartbeat thread), innermost last."""
    frame = sys._current_frames().get(ident) if ident is not None else None
    if frame is None:
        return "(the engine thread is gone)\n"
    return "".join(traceback.format_stack(frame))


def stuck_at(stack: str) -> str:
    """Where the engine thread is, in one line: its innermost frame, and the innermost in this project's code when
    that is another (`threading.py:359 in wait, from worker/faults.py:71 in _hang`)."""
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith('File "')]
    if not frames:
        return "an unknown place"
    described = [_frame_text(f) for f in frames]
    ours = [d for f, d in zip(frames, described) if f'"{ROOT}/' in f and "-packages/" not in f]
    innermost = described[-1]
    return innermost if not ours or ours[-1] == innermost else f"{innermost}, from {ours[-1]}"


def _frame_text(line: str) -> str:
    """`File "/x/worker/faults.py", line 71, in _hang` -> `worker/faults.py:71 in _hang`."""
    try:
        path, rest = line.removeprefix('File "').split('", line ', 1)
        number, func = rest.split(", in ", 1)
    except ValueError:
        return line
    path = path.removeprefix(f"{ROOT}/") if path.startswith(f"{ROOT}/") else Path(path).name
    return f"{path}:{number} in {func}"


def _flush_output() -> None:
    """Flush the log handlers and std streams before os._exit (which skips every cleanup)."""
    for handler in logging.getLogger().handlers:
        try:
            handler.flush()
        except Exception:  # noqa: BLE001  a handler that cannot flush now: exit anyway
            pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
