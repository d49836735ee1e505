"""The worker's side of models by Hub id (core/hub_download.py and core/hub_cache.py do the files,
core/model_cache.py the record):

- `prepare(opts, job_id, …)`: before a job loads, its Hub model (and Hub adapter) is fetched into this host's cache
  once (other workers of the host wait on the snapshot's lock and load the same files), with job events when a
  download starts, ends or waits, and a progress row (`gpujobs status`: bytes, rate, ETA). The options come back
  pinned to the commits that were loaded, and the job's metrics record the commit the first shard resolved.
- `serve(…)`: the models thread: carries out `gpujobs models pull/rm --workers` requests for this worker's place
  (host, cache directory) and rescans the cache now and then, so `gpujobs models list` stays true.
- `inventory(…)`: the scan itself (at start, and after each pull or removal).

No torch here: the loader reads the fetched snapshot from its folder (`model_path`, `adapter_path`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from core import hub, hub_cache, hub_download, leases, model_cache
from core.db import session_scope
from core.errors import FetchInterrupted, InvalidInput, JobsError
from core.models import Job
from core.settings import get_settings
from core.spec import LoadOptions
from core.store import add_event, now

log = logging.getLogger(__name__)
PROGRESS_SECONDS = 1.0  # how often a download's row is updated
RATE_WINDOW_SECONDS = 10.0  # the rate (and so the ETA) is measured over this much recent time
POLL_SECONDS = 2.0  # how often the models thread looks for requests
RESCAN_SECONDS = 600.0


def place() -> tuple[str, str]:
    return hub.host(), str(get_settings().hub_cache)


class Progress(hub.Listener):
    """Turns a fetch's news into the place's `cached_models` row and, for a job, its events.

    While a download runs, a thread writes its bytes and rate to the row every second, also when no byte arrives
    (a stalled download shows its rate falling and stays fresh, so nobody takes it for a dead one)."""

    def __init__(self, *, worker: str, job_id: str | None = None):
        self.worker, self.job_id = worker, job_id
        self.host, self.cache = place()
        self.samples: deque[tuple[float, int]] = deque()
        self.row_id: int | None = None
        self.done = self.total = 0
        self.stopped = threading.Event()

    def _event(self, message: str, **kwargs: Any) -> None:
        if self.job_id:
            with session_scope() as session:
                add_event(session, self.job_id, message, **kwargs)

    def waiting(self, snap: hub.Snapshot) -> None:
        self._event(
            f"{self.worker} waits for {snap.repo}@{hub.short(snap.commit)}: another process on host "
            f"{self.host} is downloading it into {self.cache}"
        )

    def started(self, snap: hub.Snapshot, *, files: int, total: int, done: int) -> None:
        resumed = f", resuming after {hub.human_bytes(done)} already there" if done else ""
        self._event(
            f"download of {snap.repo}@{hub.short(snap.commit)} started on host {self.host} by {self.worker}: "
            f"{files} files, {hub.human_bytes(total)}{resumed}",
            data={
                "download": {
                    "repo": snap.repo,
                    "commit": snap.commit,
                    "host": self.host,
                    "files": files,
                    "bytes_total": total,
                    "bytes_done": done,
                }
            },
        )
        self.done, self.total = done, total
        self.samples.append((time.monotonic(), done))
        with session_scope() as session:
            row = model_cache.upsert(
                session,
                host=self.host,
                cache_dir=self.cache,
                repo=snap.repo,
                commit=snap.commit,
                kind=snap.kind,
                state="downloading",
                worker=self.worker,
                bytes_total=total,
                bytes_done=done,
                rate=None,
                started_at=now(),
                error=None,
                finished_at=None,
            )
            self.row_id = row.id
        threading.Thread(target=self._flush_loop, name="download-progress", daemon=True).start()

    def progress(self, done: int, total: int) -> None:
        self.done, self.total = done, total

    def _flush_loop(self) -> None:
        while not self.stopped.wait(PROGRESS_SECONDS):
            try:
                self._flush()
            except Exception:  # a missed progress write is not worth a failed download
                log.warning("%s: could not record download progress", self.worker, exc_info=True)

    def _flush(self) -> None:
        t, done = time.monotonic(), self.done
        self.samples.append((t, done))
        while len(self.samples) > 2 and t - self.samples[0][0] > RATE_WINDOW_SECONDS:
            self.samples.popleft()
        t0, done0 = self.samples[0]
        rate = max(done - done0, 0) / (t - t0) if t > t0 else None
        with session_scope() as session:
            model_cache.update_row(session, self.row_id, bytes_done=done, bytes_total=self.total, rate=rate)

    def finished(self, snap: hub.Snapshot, *, downloaded: int, seconds: float) -> None:
        self.stopped.set()
        rate = downloaded / seconds if seconds > 0 else 0.0
        self._event(
            f"download of {snap.repo}@{hub.short(snap.commit)} finished on host {self.host}: "
            f"{hub.human_bytes(downloaded)} in {seconds:.1f} s ({hub.human_bytes(int(rate))}/s), every file "
            "verified",
            data={
                "download": {
                    "repo": snap.repo,
                    "commit": snap.commit,
                    "host": self.host,
                    "bytes": downloaded,
                    "seconds": round(seconds, 3),
                }
            },
        )

    def failed(self, error: str) -> None:
        self.stopped.set()
        if self.row_id is None:
            return
        with session_scope() as session:
            model_cache.update_row(session, self.row_id, state="failed", error=error, finished_at=now())


# --- before a job loads ---------------------------------------------------------------------------------------


def prepare(opts: LoadOptions, job_id: str, *, worker: str, should_stop: Callable[[], bool]) -> LoadOptions:
    """The job's Hub model and Hub adapter fetched into this host's cache; the options pinned to their commits.

    A fetch stopped by a cancel or a shutdown ends the shard as the engine's stop does (`_hand_over`)."""
    try:
        return _prepare(opts, job_id, worker=worker, should_stop=should_stop)
    except FetchInterrupted:
        _hand_over(job_id, worker)
        raise


def _prepare(opts: LoadOptions, job_id: str, *, worker: str, should_stop: Callable[[], bool]) -> LoadOptions:
    updates: dict[str, Any] = {}
    pinned = _job_pins(job_id)
    if hub.is_hub_id(opts.model):
        asked = pinned.get("model") or {}
        fetched = ensure(
            opts.model,
            asked.get("commit") or opts.revision,
            kind="model",
            worker=worker,
            job_id=job_id,
            should_stop=should_stop,
            ref=asked.get("revision"),
        )
        updates["revision"] = fetched.commit
        _pin(job_id, opts, fetched)
    if opts.adapter and hub.is_hub_id(opts.adapter):
        asked = pinned.get("adapter") or {}
        fetched = ensure(
            opts.adapter,
            asked.get("commit") or opts.adapter_revision,
            kind="adapter",
            worker=worker,
            job_id=job_id,
            should_stop=should_stop,
            ref=asked.get("revision"),
        )
        updates["adapter_revision"] = fetched.commit
    return opts.model_copy(update=updates) if updates else opts


def _hand_over(job_id: str, worker: str) -> None:
    """The shard this worker holds for `job_id`: cancelled if the job is stopping, else (a shutdown) handed back
    without counting an attempt and sent again; the part downloaded so far stays for whoever takes it."""
    leases.hand_over(job_id, worker, "worker stopping: the model's download is handed back")


def ensure(
    repo: str,
    revision: str | None,
    *,
    kind: str,
    worker: str,
    job_id: str | None = None,
    should_stop: Callable[[], bool] = lambda: False,
    ref: str | None = None,
) -> hub.Fetched:
    """core.hub_download.ensure with this worker's progress row and job events; the row records a failure too. `ref`: the
    branch or tag the API resolved `revision` from, written to the cache's refs (an offline submit matches it)."""
    progress = Progress(worker=worker, job_id=job_id)
    try:
        fetched = hub_download.ensure(repo, revision, kind=kind, listener=progress, should_stop=should_stop)
    except FetchInterrupted:
        progress.failed("interrupted: the job was cancelled or the worker stopped; the next fetch resumes")
        raise
    except (JobsError, OSError) as exc:
        progress.failed(str(exc))
        raise
    finally:
        progress.stopped.set()
    if ref:
        hub_cache.write_ref(repo, ref, fetched.commit)
    host, cache = place()
    with session_scope() as session:
        snapshot = hub_cache.record(repo, fetched.commit)
        if snapshot is not None:
            model_cache.record(
                session,
                host=host,
                cache_dir=cache,
                snapshot=snapshot,
                last_used_at=now(),
                worker=worker,
                error=None,
                **({"finished_at": now()} if progress.row_id is not None else {}),
            )
        for note in fetched.notes:
            if job_id:
                add_event(session, job_id, note, level="warning")
    return fetched


def _job_pins(job_id: str) -> dict[str, Any]:
    """What the job's metrics say of its Hub model and adapter: the revision asked and the commit it was pinned to,
    by the API at submit (then the spec holds the commit too) or by the first worker that resolved it."""
    with session_scope() as session:
        job = session.get(Job, job_id)
        return {k: v for k, v in (job.metrics or {}).items() if k in ("model", "adapter")} if job is not None else {}


def _pin(job_id: str, opts: LoadOptions, fetched: hub.Fetched) -> None:
    with session_scope() as session:
        job = session.get(Job, job_id)
        if job is None:
            return
        model = (job.metrics or {}).get("model") or {}
        if model.get("commit"):
            return
        job.metrics = {
            **(job.metrics or {}),
            "model": {
                **model,
                "repo": opts.model,
                "revision": opts.revision or "main",
                "commit": fetched.commit,
                "files": fetched.files,
                "bytes": fetched.bytes,
                "resolved_by": "worker",
            },
        }
        add_event(
            session,
            job_id,
            f"{opts.model}@{opts.revision or 'main'} resolved to commit {fetched.commit}: "
            "every shard of this job loads that commit",
        )


# --- what the loader reads --------------------------------------------------------------------------------------


def model_path(opts: LoadOptions) -> str:
    """The folder a load reads: the model's own for a local path, the verified snapshot for a Hub id (prepared
    already, so this normally needs no request; a process that was not prepared, e.g. a torchrun rank, fetches)."""
    if not hub.is_hub_id(opts.model):
        return opts.model
    return str(hub_download.ensure(opts.model, opts.revision, kind="model").path)


def hub_record(opts: LoadOptions) -> dict[str, Any] | None:
    if not hub.is_hub_id(opts.model):
        return None
    return {
        "repo": opts.model,
        "commit": opts.revision,
        "endpoint": hub.endpoint(),
        "host": hub.host(),
        "cache": str(get_settings().hub_cache),
    }


# --- the models thread --------------------------------------------------------------------------------------------


def inventory(worker: str) -> None:
    """Record what this place's cache holds (a scan: no hashing, no network)."""
    host, cache = place()
    records = hub_cache.scan()
    with session_scope() as session:
        model_cache.sync(session, host=host, cache_dir=cache, records=records)
    log.info("%s: the Hugging Face cache %s holds %d snapshot(s)", worker, cache, len(records))


def serve(worker: str, closed: threading.Event) -> None:
    """Carry out pull/remove requests for this worker's place until `closed` is set; rescan every 10 minutes.
    A poll that fails (the store unreachable) is retried at the next one; as the heartbeat does, the first failure
    is logged with its traceback, the next ones in one line each, and the first poll that works again says so (a
    traceback every POLL_SECONDS filled a worker's log with thousands of lines per minute of a store outage)."""
    last_scan = time.monotonic()
    failing_since: float | None = None
    while not closed.wait(POLL_SECONDS):
        try:
            if time.monotonic() - last_scan > RESCAN_SECONDS:
                inventory(worker)
                last_scan = time.monotonic()
            host, cache = place()
            with session_scope() as session:
                model_cache.reclaim_stale(session)
                row = model_cache.claim(session, host=host, cache_dir=cache, worker=worker)
                claimed = (row.id, row.repo, row.commit, row.revision, row.state) if row else None
            if claimed:
                carry_out(worker, *claimed, should_stop=closed.is_set)
            if failing_since is not None:
                log.warning("%s: the models thread works again after %.0f s", worker, time.time() - failing_since)
                failing_since = None
        except Exception as exc:  # the thread must outlive a database outage; the request stays claimed and goes stale
            if failing_since is None:
                failing_since = time.time()
                log.exception("%s: the models thread failed; retrying", worker)
            else:
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                log.warning(
                    "%s: the models thread still failing after %.0f s: %s: %s",
                    worker,
                    time.time() - failing_since,
                    type(exc).__name__,
                    first_line,
                )


def carry_out(
    worker: str,
    row_id: int,
    repo: str,
    commit: str,
    revision: str | None,
    state: str,
    *,
    should_stop: Callable[[], bool],
) -> None:
    """One claimed request: a pull (fetch into this cache) or a removal (delete from it)."""
    host, cache = place()
    try:
        if state == "removing":
            result = hub_cache.remove(repo, [commit] if commit else None, should_stop=should_stop)
            with session_scope() as session:
                model_cache.drop(session, row_id)
            log.info("%s: removed %s from %s: %s", worker, repo, cache, result)
        else:
            target = commit or revision
            if not commit:  # the API could not resolve it: the row becomes the commit's row
                target = _adopt(row_id, repo, revision, host=host, cache=cache)
            ensure(repo, target, kind="auto", worker=worker, should_stop=should_stop)
            log.info("%s: pulled %s@%s into %s", worker, repo, target, cache)
    except Exception as exc:  # noqa: BLE001  a failed request records why; the thread goes on
        with session_scope() as session:
            model_cache.update_row(session, row_id, state="failed", error=str(exc), finished_at=now())
        if not isinstance(exc, (JobsError, OSError)):
            raise  # serve() logs it with its traceback
        action = "remove" if state == "removing" else "pull"
        log.warning("%s: could not %s %s@%s in %s: %s", worker, action, repo, commit or revision, cache, exc)
    inventory(worker)


def _adopt(row_id: int, repo: str, revision: str | None, *, host: str, cache: str) -> str:
    """Resolve a pull request's revision to a commit; its row becomes (or joins) that commit's row."""
    if get_settings().hub_offline:
        commit = hub_cache.cached_commit(repo, revision)
        if commit is None:
            raise InvalidInput(
                f"{hub.describe(repo, revision)} is not in this host's cache ({cache}) and this host is "
                "offline (HF_HUB_OFFLINE=1): pull it on a host with network access"
            )
    else:
        commit, _, _ = hub.listing(repo, revision)
    with session_scope() as session:
        existing = model_cache.find(session, host=host, cache_dir=cache, repo=repo, commit=commit)
        if existing is None:
            model_cache.update_row(session, row_id, commit=commit)
        else:
            model_cache.drop(session, row_id)
    return commit
