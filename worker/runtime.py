"""Per-process worker runtime: identity, the resident model, the heartbeat thread, and the shard runner.

One worker process owns one GPU slice and runs one shard at a time (Celery solo pool, in the main thread).
A daemon thread beats every second: it renews the current shard's lease, notices a cancel or a lost lease
(the engine checks `should_stop()` between decode steps), refreshes the worker's registration, and runs the
reaper, which any number of workers may run at once. Every third of a lease it also asks whether the shard should
yield to waiting work that outranks it (core/scheduling.py `yield_reason`): a generation shard then stops after
the micro-batch it is in, a fine-tune after saving a checkpoint at its step's end, and the shard goes back to the
queue (`leases.yield_shard`) to go on later from there.

The stall watchdog: progress, not liveness, renews a lease. The engines report every decode step, prefill chunk
and training step, and the runner every micro-batch it hands over to be committed, to `Runtime.progress`
(worker/progress.py). The heartbeat renews the lease only while the last progress is within the stall bound. Past
it (`_on_stall`) the worker writes a `stall` event on the job (what it was doing, for how long, the engine
thread's stack, and the committer's when the engine waits on it), gives the shard back (the attempt counts: a
shard that stalls on every attempt fails after JOBS_MAX_ATTEMPTS with that reason; a cancelled job's shard is
cancelled), sends it again for another worker, records the reason on its registration and exits with
`core.exits.STALLED`: a CUDA context that hung is not trusted again. Committed rows stay; the next claim takes
only pending rows.

Threads and imports: the process imports its heavy modules once, in the main thread, before `start_heartbeat` starts
the heartbeat and the flex_attention probe's thread (worker/preload.py has the whole start-up order and why: two
threads' imports of torch raced and broke the process, issue 27). While a generation shard runs, a third thread
commits its micro-batches (worker/committer.py: the engine goes on decoding meanwhile). None of them imports
anything heavy; the QLoRA probe runs in the main thread at registration. A shard that fails while the process's
engine or training code no longer imports (`preload.check`) is the worker's fault (`_on_broken`): the shard goes
back without counting the attempt (core/leases.py `give_back_broken`), the registration says why, and the process
exits with `core.exits.BROKEN`.

The heartbeat (with its watchdog) and the shard runner stay one class: both read and set one shard's state (the
shard under lease, its stop and yield flags, the engine's progress) under one lock, `_switch`. What they call lives
apart: the engines (worker/generate.py, worker/engines/) and training (worker/training/), the engine thread's stack
for a stall report (worker/tracebacks.py), and memory figures (worker/gpu_memory.py).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from core import adapters, dispatch, exits, formats, jobs, leases, registry
from core.db import session_scope
from core.errors import IllegalTransition, InvalidInput, LeaseLost, RegistryError
from core.models import Job
from core.settings import get_settings
from core.spec import FinetuneSpec, GenerateSpec, LoadOptions
from worker import capabilities, failures, faults, generate, gpu_memory, hubfetch, loader, preload, tracebacks, training
from worker.committer import Committer
from worker.progress import Progress, Stall

log = logging.getLogger(__name__)
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
    yielding: threading.Event = field(default_factory=threading.Event)  # the scheduler asked the shard to yield
    yield_why: tuple[str, float] | None = None  # (why, when asked) of that request
    # held while the runner switches shards and while the heartbeat flags one: a flag meant for a shard that ended
    # meanwhile (its renew was slow) must not stop the next one
    _switch: threading.Lock = field(default_factory=threading.Lock)
    shutting_down: threading.Event = field(default_factory=threading.Event)
    closed: threading.Event = field(default_factory=threading.Event)
    resident: tuple[str, loader.Loaded] | None = None
    progress: Progress = field(default_factory=Progress)  # the engine's progress on the current shard
    _engine_thread: int | None = None  # the thread that runs shards (Celery's solo pool: the main thread)
    _reported_progress: bool = False  # the registration shows a shard's progress (cleared once it ended)
    _beat: threading.Thread | None = None
    _probes: list[subprocess.Popen] = field(default_factory=list)  # probe child processes (flex_attention)

    # --- lifecycle ---------------------------------------------------------------------------------------

    def register(self, pid: int) -> None:
        """Register online with what this worker can run, the QLoRA probe's answer included (after
        preload.preload(): bitsandbytes is imported, the probe is one small 4-bit matmul)."""
        caps = capabilities.probe()
        caps["qlora"] = capabilities.probe_qlora(capabilities.gpus())
        with session_scope() as session:
            registry.register(
                session,
                name=self.name,
                host=self.host,
                pid=pid,
                slice=self.slice,
                queues=self.queues,
                gpus=capabilities.gpus(),
                capabilities=caps,
                restarts=get_settings().worker_restarts,
            )
        log.info(
            "worker %s registered: slice %r, queues %s, %d CUDA device(s); QLoRA %s",
            self.name,
            self.slice,
            self.queues,
            caps["device_count"],
            caps["qlora"],
        )

    def start_heartbeat(self) -> None:
        """Start the heartbeat and the flex_attention probe's thread: after preload.preload(), never before."""
        self._beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._beat.start()
        threading.Thread(target=self._probe_flex, name="flex-probe", daemon=True).start()

    def _probe_flex(self) -> None:
        """Merge the flex_attention compile probe into this worker's registration (and drop flex_attention from
        its attention backends when it does not compile here)."""
        try:
            devices = capabilities.gpus()
            result = capabilities.probe_flex_isolated(
                devices, nice=get_settings().probe_nice, started=self._probes.append
            )
            if self.shutting_down.is_set():
                return  # the probe was ended with the worker: no answer
            backends = [b for b in capabilities.attention_backends(devices) if result["ok"] or b != "flex_attention"]
            with session_scope() as session:
                registry.heartbeat(
                    session,
                    self.name,
                    current_shard_id=self.current,
                    extra={"flex_attention": result, "attention": backends},
                )
            log.info("worker %s: flex_attention probe %s", self.name, result)
        except Exception:
            log.exception("flex_attention probe of %s failed to record", self.name)

    def stop(self, exit_code: int | None = None, reason: str | None = None) -> None:
        """The process is ending: stop the threads and probes, and mark the registration offline (with the exit
        code and why, where the process was not asked to stop)."""
        self.shutting_down.set()
        self.closed.set()
        for proc in self._probes:  # a probe still compiling ends with the worker
            if proc.poll() is None:
                proc.kill()
        with session_scope() as session:
            registry.stopped(session, self.name, exit_code=exit_code, reason=reason)

    def hand_back_now(self, reason: str) -> None:
        """Give back the shard this worker holds, from another thread, when the process is about to end without
        its engine (worker/stackwatch.py's last resort): the engine's later commits find the lease gone."""
        job_id = self.current_job
        if job_id is not None:
            leases.hand_over(job_id, self.name, reason)

    # --- heartbeat ---------------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Beat every second until the worker closes. A beat that fails (the store or Redis unreachable) is retried
        at the next one; the first failure is logged with its traceback, the next ones in one line each, and the
        first beat that works again says so (the lease covers a gap shorter than itself)."""
        settings = get_settings()
        last_beat = 0.0
        failing_since: float | None = None
        while not self.closed.wait(1.0):
            try:
                due = time.time() - last_beat >= settings.heartbeat_seconds
                self._check_current(settings, renew=due)
                if due:
                    last_beat = time.time()
                    with session_scope() as session:
                        registry.heartbeat(
                            session, self.name, current_shard_id=self.current, extra=self._activity(settings)
                        )
                    jobs.reap()
                    if failing_since is not None:
                        log.warning("heartbeat of %s works again after %.0f s", self.name, time.time() - failing_since)
                        failing_since = None
            except Exception as exc:  # the beat must survive database or broker outages; the lease covers the gap
                if failing_since is None:
                    failing_since = time.time()
                    log.exception("heartbeat of %s failed; retrying at its next beat", self.name)
                else:
                    log.warning(
                        "heartbeat of %s still failing after %.0f s: %s: %s",
                        self.name,
                        time.time() - failing_since,
                        type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "",
                    )

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
            extra["gpu_memory"] = gpu_memory.per_gpu()
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
        why = leases.watch(shard_id, job_id, self.name, renew_for=settings.lease_seconds if renew else None)
        reason = None
        if why is None and renew and not self.yielding.is_set():
            reason = leases.yield_reason(shard_id, settings.yield_after)
        with self._switch:
            if self.current != shard_id:
                return  # that shard ended while we looked: what we saw is not about the one running now
            if why is not None:
                if why == leases.LEASE_LOST:
                    log.warning("%s lost the lease of shard %s: stopping it", job_id, shard_id)
                self.stop_current.set()
            elif reason:
                log.info("%s shard %s yields at its next boundary: %s", job_id, shard_id, reason)
                self.yield_why = (reason, time.time())
                self.yielding.set()

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
        stack = tracebacks.thread_stack(self._engine_thread)
        stuck_in = tracebacks.stuck_at(stack)
        if "worker/committer.py" in stuck_in:  # the engine waits on a commit: where that is stuck says why
            committer = tracebacks.thread_stack(tracebacks.thread_named("committer-"))
            stack += f"\ncommitter thread stack:\n{committer}"
            stuck_in += f"; waiting on the committer, at {tracebacks.stuck_at(committer)}"
        reason = f"stalled: {stall.describe()}"
        log.error("%s shard %s %s on %s; engine thread stack:\n%s", job_id, shard_id, reason, self.name, stack)
        where = f"job {job_id}, shard id {shard_id}"
        try:
            idx = leases.give_back_stalled(
                shard_id,
                self.name,
                stall=stall.describe(),
                stuck_in=stuck_in,
                exit_code=exits.STALLED,
                data={
                    "doing": stall.doing,
                    "seconds": round(stall.seconds, 3),
                    "bound_s": round(stall.bound, 3),
                    "phase": stall.phase,
                    "progress_count": stall.beats,
                    "median_step_s": stall.median_step_s,
                    "stack": stack,
                },
            )
            where = f"job {job_id}, shard {idx}"
        except Exception:
            log.exception(
                "%s could not give back shard %s after the stall: its lease expires unrenewed and the "
                "reaper re-queues it",
                job_id,
                shard_id,
            )
        try:
            with session_scope() as session:
                registry.stopped(
                    session, self.name, exit_code=exits.STALLED, reason=f"{reason} ({where}); exit code {exits.STALLED}"
                )
        except Exception:
            log.exception("could not record the stall on the registration of %s", self.name)
        _flush_output()
        os._exit(exits.STALLED)

    def _on_broken(self, shard_id: int, job_id: str, cause: str, error: str) -> None:
        """A shard failed and this process can no longer import its engine or training code (worker/preload.py):
        give the shard back without counting the attempt (core/leases.py `give_back_broken`), record why on the
        registration and end the process with exits.BROKEN; its supervisor starts a fresh one, which imports them
        whole. Never returns: nothing this process would run next imports either. As for a stall, the process
        exits within STALL_EXIT_GRACE_S whatever cannot be written; the lease then expires and a reaper re-queues
        the shard (that attempt counts)."""
        exit_timer = threading.Timer(STALL_EXIT_GRACE_S, os._exit, [exits.BROKEN])
        exit_timer.daemon = True
        exit_timer.start()
        log.error(
            "%s shard id %s: %s is broken (%s): it hands the shard back and exits", job_id, shard_id, self.name, cause
        )
        where = f"job {job_id}, shard id {shard_id}"
        try:
            idx = leases.give_back_broken(shard_id, self.name, cause=cause, error=error, exit_code=exits.BROKEN)
            where = f"job {job_id}, shard {idx}"
        except Exception:
            log.exception(
                "%s could not give back shard %s: its lease expires and the reaper re-queues it", job_id, shard_id
            )
        try:
            with session_scope() as session:
                registry.stopped(
                    session,
                    self.name,
                    exit_code=exits.BROKEN,
                    reason=f"broken: {cause} ({where}); exit code {exits.BROKEN}",
                )
        except Exception:
            log.exception("could not record on the registration of %s why it exits", self.name)
        for proc in self._probes:  # os._exit ends no child
            if proc.poll() is None:
                proc.kill()
        _flush_output()
        os._exit(exits.BROKEN)

    # --- the shard runner --------------------------------------------------------------------------------

    def run_shard(self, shard_id: int) -> None:
        claim = leases.take(shard_id, self.name, get_settings().lease_seconds)
        if claim is None:
            return
        shard, job = claim.shard, claim.job
        rows = [(r.idx, r.input) for r in claim.rows]
        lines = {r.idx: r.line for r in claim.rows}
        self.progress.start("the shard was claimed")  # before `current`: the watchdog never sees an old clock
        self._engine_thread = threading.get_ident()
        with self._switch:
            self.current, self.current_job = shard.id, job.id
            self.stop_current.clear()
            self.yielding.clear()
        log.info("%s shard %s: %d pending rows", job.id, shard.idx, len(rows))
        try:
            if job.kind == "finetune":
                self._run_finetune(shard, job, rows, lines)
            else:
                self._run(shard, job, rows, lines)
        except (LeaseLost, IllegalTransition) as exc:  # someone else owns the shard now: leave it to them
            log.warning("%s %s", job.id, exc)
        except (InvalidInput, RegistryError) as exc:
            leases.fail(shard.id, str(exc))
        except Exception as exc:
            error = traceback.format_exc()
            log.error("%s shard %s failed on %s:\n%s", shard.job_id, shard.idx, self.name, error)
            broken = preload.check()  # the process's own code no longer imports: the worker's fault, not the job's
            if broken is not None:
                self._on_broken(shard.id, job.id, broken, error)  # never returns
            cause = failures.final_cause(exc)  # an error that fails the same way on every attempt, or None
            if cause is not None:
                leases.fail_final(shard.id, self.name, cause, error)
            else:
                leases.fail_attempt(shard.id, self.name, error)
        finally:
            with self._switch:
                self.current = self.current_job = None
        jobs.finalize(job.id)
        dispatch.wake(job.owner)  # a capped owner's next shard, whose message found her at her cap
        if job.kind == "finetune":
            jobs.release_waiting(job.id)

    def _run(self, shard, job: Job, rows: list[tuple[int, dict[str, Any]]], lines: dict[int, int]) -> None:
        settings = get_settings()
        spec = GenerateSpec.model_validate(job.spec)
        if spec.tp_plan:  # refused at submit too; a job queued while no worker was live reaches this
            raise InvalidInput(
                "tp_plan auto (tensor parallel under torchrun) is not supported by the workers yet: "
                "use device_map auto to split the model over the slice"
            )
        started, t0 = time.time(), time.perf_counter()
        loaded = self.model_for(spec, job.id)
        jobs.record_load(job.id, loaded.resolved, capabilities.versions)
        batch_rows = spec.batch_rows or settings.batch_rows
        engine_s = 0.0
        gpu_memory.reset_peak_memory()
        boundary = threading.Event()  # a yield was asked and a micro-batch is committed: the engine stops here
        should_stop = lambda: self.stop_current.is_set() or self.shutting_down.is_set()  # noqa: E731
        t_engine = time.perf_counter()

        def on_event(message: str) -> None:
            jobs.event(job.id, f"shard {shard.idx}: {message}", level="warning", shard_id=shard.id)

        where = formats.location(spec.input_format)
        engine_info: dict[str, Any] = {}  # what ran: engine, attention, CUDA graphs, cache (worker/generate.py)
        done = {"rows": 0, "first_result": None}  # committed rows, time of the first commit

        def commit(results: list) -> bool:  # on the committer's thread (worker/committer.py)
            faults.hit("commit")
            if not leases.record(shard, self.name, results, settings.lease_seconds):
                return False  # the job is stopping
            done["rows"] += len(results)
            done["first_result"] = done["first_result"] or time.time()  # time to first result: first commit
            if self.yielding.is_set():
                boundary.set()  # rows the engine still returns are committed too; it starts no other
            return True

        committer = Committer(commit, name=f"committer-{shard.id}")
        try:
            for results in generate.generate(
                loaded,
                spec,
                rows,
                batch_rows=batch_rows,
                should_stop=lambda: should_stop() or boundary.is_set() or committer.halted,
                on_event=on_event,
                info=engine_info,
                progress=self.progress,
            ):
                engine_s += time.perf_counter() - t_engine
                faults.hit("batch")
                failures.name_rows(results, lines, where)  # every row error names its line (or row)
                committer.put(results)
                self.progress.beat("micro-batch handed over")  # the engine's progress (a commit is the committer's)
                if committer.stopped:
                    break  # the job is stopping
                t_engine = time.perf_counter()
        finally:
            committer.close()  # every micro-batch handed over is committed before the shard's end is decided
        committed, first_result = done["rows"], done["first_result"]
        if boundary.is_set() and committed < len(rows) and not should_stop():
            self._yield(shard, f"after {committed} of the shard's {len(rows)} pending rows")
            return
        # a cancelled job's shard is cancelled; on shutdown or a lost lease the unfinished rows are handed back
        if leases.end_early(
            shard.id, self.name, hand_back="worker stopping: unfinished rows handed back" if should_stop() else None
        ):
            return
        wall = time.perf_counter() - t0
        metrics = {
            "wall_seconds": round(wall, 3),
            "engine_seconds": round(engine_s, 3),
            "gpu_seconds": round(wall * max(self.gpus, 0), 3),
            "rows": len(rows),
            "peak_memory_bytes": gpu_memory.peak_memory(),
            "worker": self.name,
            "started_at": started,
            "engine": engine_info,
            "time_to_first_result_s": round(first_result - (shard.started_at or started), 3) if first_result else None,
        }
        leases.complete(shard.id, self.name, metrics)
        jobs.record_engine(job.id, engine_info)

    def _run_finetune(self, shard, job: Job, rows: list[tuple[int, dict[str, Any]]], lines: dict[int, int]) -> None:
        """Train (resuming from the last complete checkpoint), register the adapter, then finish the shard.

        The resident model is dropped first: training wraps a model in place, so it is never shared with jobs.
        """
        with self.progress.phase("importing the training code"):  # peft, the trainer: seconds, more on a busy host
            training.import_code()

        settings = get_settings()
        spec = FinetuneSpec.model_validate(job.spec)
        opts = LoadOptions.model_validate(spec.model_dump(include=set(LoadOptions.model_fields)))
        with self.progress.phase("downloading model"):  # Hub ids, once per host (a stalled download times out)
            opts = hubfetch.prepare(opts, job.id, worker=self.name, should_stop=self._stopping)
        self.resident = None
        gpu_memory.free_memory()
        workdir = adapters.workdir(job.id)
        checkpoint, step = training.resume_point(workdir / "checkpoints")
        # steps an interrupted attempt logged after this checkpoint run again: their events leave the current view
        jobs.supersede_steps(job.id, after_step=step)
        jobs.event(
            job.id,
            f"{self.name} starts training" + (f", resuming from {checkpoint.name}" if checkpoint else ""),
            shard_id=shard.id,
        )
        should_stop = lambda: self.stop_current.is_set() or self.shutting_down.is_set()  # noqa: E731

        def on_log(record: dict[str, Any]) -> None:
            jobs.event(job.id, finetune_line(record), kind="metric", data=record, shard_id=shard.id)
            faults.hit("train_step")

        t0 = time.perf_counter()
        # one process, or one per GPU of the slice under torchrun (worker/training/); this process writes SQL
        result = training.train(
            opts,
            spec,
            [(lines[i], row) for i, row in rows],
            workdir,
            gpus=self.gpus,
            should_stop=should_stop,
            should_yield=self.yielding.is_set,
            on_log=on_log,
            progress=self.progress,
        )
        jobs.record_load(job.id, result.metrics["load"], capabilities.versions)
        if result.stopped and self.yielding.is_set() and not should_stop():
            step = result.metrics["steps"]
            self._yield(shard, f"at step {step}, its checkpoint saved (checkpoint-{step})")
            return
        # a cancelled job's shard is cancelled; on shutdown or a lost lease the next worker resumes from the last
        # checkpoint
        if leases.end_early(
            shard.id,
            self.name,
            hand_back=f"worker stopping: training handed back at step {result.metrics['steps']}"
            if result.stopped
            else None,
        ):
            return
        folder = adapters.adapter_dir(job.id)
        with self.progress.phase("publishing and verifying the adapter"):
            _publish(result.adapter_dir, folder)
            faults.hit("adapter_saved", path=folder / adapters.WEIGHTS)
            try:
                training.verify_adapter(opts, folder, gpus=self.gpus)
            except Exception as exc:  # noqa: BLE001  any failure to load or generate is the registry's refusal
                raise RegistryError(
                    f"registry error: the adapter saved at {folder} does not load onto "
                    f"{spec.model} and generate ({type(exc).__name__}: {exc})"
                ) from exc
        wall = time.perf_counter() - t0
        metrics = {
            **{k: v for k, v in result.metrics.items() if k != "load"},
            "wall_seconds": round(wall, 3),
            "gpu_seconds": round(wall * max(self.gpus, 0), 3),
            "worker": self.name,
            "resumed_from_step": result.resumed_from,
        }
        leases.complete_training(
            shard.id,
            self.name,
            rows=[i for i, _ in rows],
            folder=folder,
            lora_config=result.lora_config,
            load_options=result.metrics["load"],
            metrics=metrics,
            lease_seconds=settings.lease_seconds,
        )

    def _yield(self, shard, at: str) -> None:
        reason, requested_at = self.yield_why
        log.info("%s shard %s yields %s: %s", shard.job_id, shard.idx, at, reason)
        leases.yield_shard(shard.id, self.name, reason=reason, requested_at=requested_at, at=at)

    def model_for(self, spec: GenerateSpec, job_id: str) -> loader.Loaded:
        """The resident model if the load options match, else load (and free the previous one first)."""
        opts = LoadOptions.model_validate(spec.model_dump(include=set(LoadOptions.model_fields)))
        with self.progress.phase("downloading model"):  # Hub ids, once per host (a stalled download times out)
            opts = hubfetch.prepare(opts, job_id, worker=self.name, should_stop=self._stopping)
        key = opts.load_key()
        if self.resident and self.resident[0] == key:
            return self.resident[1]
        self.resident = None
        gpu_memory.free_memory()
        t0 = time.perf_counter()
        with self.progress.phase("loading model"):
            loaded = loader.load(opts, gpus=self.gpus)
        loaded.resolved["load_seconds"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        prepared = generate.prepare_engine(loaded, spec, self.progress)  # load time, not a job's: cache,
        # compiled layers, CUDA graphs
        if prepared:
            loaded.resolved["prepared"] = {**prepared, "seconds": round(time.perf_counter() - t0, 3)}
        jobs.event(
            job_id, f"{self.name} loaded {opts.model} in {loaded.resolved['load_seconds']} s", data=loaded.resolved
        )
        self.resident = (key, loaded)
        return loaded

    def _stopping(self) -> bool:
        return self.stop_current.is_set() or self.shutting_down.is_set()


def finetune_line(record: dict[str, Any]) -> str:
    """One readable line per training log: `step 12/60 epoch 2.00 loss 0.4123 lr 1.0e-02 …`."""
    parts = [f"step {record['step']}/{record['max_steps']}", f"epoch {record['epoch']:.2f}"]
    for key, fmt in (
        ("loss", "loss {:.4f}"),
        ("eval_loss", "eval_loss {:.4f}"),
        ("learning_rate", "lr {:.1e}"),
        ("grad_norm", "grad_norm {:.3f}"),
        ("tokens_per_s", "{:.0f} tok/s"),
        ("gpu_peak_memory_bytes", "peak {:.0f} MiB"),
    ):
        if record.get(key) is not None:
            value = record[key] / 2**20 if key == "gpu_peak_memory_bytes" else record[key]
            parts.append(fmt.format(value))
        elif key in record.get("non_finite", {}):
            parts.append(f"{key} {record['non_finite'][key]}")
    return " ".join(parts)


def _publish(src, dest) -> None:
    """Move the saved adapter to its registry folder: copy beside it, then rename, so a reader never sees half."""
    import shutil

    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)


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
