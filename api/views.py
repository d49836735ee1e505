"""Read views behind the HTTP API and the CLI: a job (state, progress, live rates, downloads, training), lists of
jobs, events, workers, adapters and files, and usage per owner. Reads only; no torch, no worker code.

`owner=None` means an admin: every job is visible. Otherwise another owner's job or file answers 404, as if it
did not exist.
"""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from core import adapters, hub, model_cache, registry, scheduling
from core.db import session_scope
from core.errors import InvalidInput
from core.models import Job, JobEvent, JobRow, Shard
from core.settings import get_settings
from core.states import JobState, RowState
from core.store import get_job, now, progress

HUB_ID = hub.HUB_ID


# --- jobs ---------------------------------------------------------------------------------------------------


def job_view(session: Session, job: Job) -> dict[str, Any]:
    p = progress(session, job)
    view = {
        "id": job.id,
        "kind": job.kind,
        "name": job.spec.get("name"),
        "state": job.state,
        "owner": job.owner,
        "model": job.spec.get("model"),
        "queue": job.queue,
        "gpus": job.gpus,
        "priority": scheduling.name(job.priority),
        "rows": {k: p[k] for k in ("total", "succeeded", "failed", "pending")},
        "tokens": {"prompt": p["prompt_tokens"], "completion": p["completion_tokens"]},
        "created_at": job.created_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
        "metrics": _metrics(session, job),
        "load_options": job.load_options,
        "versions": job.versions,
        "error": job.error,
        "retries": job.retries,
        "run": run_of(job),  # 1, then one more per retry; metrics.runs holds the earlier runs' outcome and numbers
        "input_file_id": job.input_file_id,
        "spec": job.spec,
    }
    if not JobState(job.state).terminal:
        if job.kind != "finetune":  # a fine-tune's rate is training's (`training`), not generated tokens
            view["live"] = _live_rates(session, job, p)
        place = scheduling.place(session, job)  # while shards are queued: position and why it waits
        if place is not None:
            view["scheduling"] = place
        downloads = _downloads(session, job)
        if downloads:
            view["downloads"] = downloads
    if job.kind == "finetune":
        view["training"] = training_progress(session, job)
    return view


def _downloads(session: Session, job: Job) -> list[dict[str, Any]]:
    """Downloads of the job's Hub model (its pinned commit, once known) and adapter in progress on any host: bytes
    done and total, rate, ETA."""
    found = []
    for key, repo in (("model", job.spec.get("model")), ("adapter", job.spec.get("adapter"))):
        if not repo or not HUB_ID.match(repo):
            continue
        commit = ((job.metrics or {}).get(key) or {}).get("commit")
        found += [
            model_cache.download_view(r) for r in model_cache.downloads(session, repo, [commit] if commit else None)
        ]
    return found


def _metrics(session: Session, job: Job) -> dict[str, Any]:
    """The job's stored metrics plus time to first result: for the job, its first committed row after its start;
    per shard, each finished shard's first committed row after its claim (min / max over shards)."""
    metrics = dict(job.metrics or {})
    if job.kind == "finetune":  # no generated results: its progress is `training`
        return metrics
    if job.started_at is not None and "time_to_first_result_s" not in metrics:  # this run's first row
        first = session.scalar(
            select(func.min(JobRow.finished_at)).where(
                JobRow.job_id == job.id, JobRow.worker.is_not(None), JobRow.finished_at >= job.started_at
            )
        )
        metrics["time_to_first_result_s"] = round(first - job.started_at, 3) if first is not None else None
    this_run = [Shard.started_at >= job.started_at] if job.started_at is not None else [Shard.started_at.is_(None)]
    shard_ttfr = [
        m["time_to_first_result_s"]
        for m in session.scalars(
            select(Shard.metrics).where(Shard.job_id == job.id, Shard.metrics.is_not(None), *this_run)
        )
        if (m or {}).get("time_to_first_result_s") is not None
    ]
    if shard_ttfr:
        metrics["shard_time_to_first_result_s"] = {
            "min": min(shard_ttfr),
            "max": max(shard_ttfr),
            "shards": len(shard_ttfr),
        }
    return metrics


def _live_rates(session: Session, job: Job, p: dict[str, int]) -> dict[str, Any]:
    """Rows and tokens per second over the last minute of the current run, and an ETA from that rate. Rows an
    earlier run finished in that minute (right after a retry) are left out: the window is this run's age."""
    started = job.started_at or now()  # None until the run's first claim: nothing of it has finished yet
    since = max(now() - 60, started)
    rows, tokens = session.execute(
        select(func.count(), func.coalesce(func.sum(JobRow.completion_tokens), 0)).where(
            JobRow.job_id == job.id, JobRow.finished_at > since, JobRow.worker.is_not(None)
        )
    ).one()
    window = min(60.0, now() - started) or 1.0
    rate = rows / window if rows else 0.0
    return {
        "rows_per_s": round(rate, 3),
        "tokens_per_s": round(tokens / window, 2) if rows else 0.0,
        "eta_s": round(p["pending"] / rate, 1) if rate else None,
    }


def list_jobs(
    *, owner: str | None, state: str | None = None, limit: int = 50, after: str | None = None
) -> list[dict[str, Any]]:
    """Newest first (ties by id, so a page ends at one place); `after`: a job id, the jobs listed after it."""
    with session_scope() as session:
        stmt = select(Job).order_by(Job.created_at.desc(), Job.id.desc()).limit(limit)
        if owner is not None:
            stmt = stmt.where(Job.owner == owner)
        if state:
            stmt = stmt.where(Job.state == state)
        if after:
            last = get_job(session, after, owner=owner)
            stmt = stmt.where(
                (Job.created_at < last.created_at) | ((Job.created_at == last.created_at) & (Job.id < last.id))
            )
        return [job_view(session, job) for job in session.scalars(stmt).all()]


def get(job_id: str, *, owner: str | None) -> dict[str, Any]:
    with session_scope() as session:
        return job_view(session, get_job(session, job_id, owner=owner))


def run_of(job: Job) -> int:
    """The job's current run: 1, then one more per retry (the `run` its events are written in)."""
    return (job.retries or 0) + 1


def training_progress(session, job: Job) -> dict[str, Any] | None:
    """A fine-tune's last logged step, epoch, loss and an ETA from the recent step time, in its current run and not
    superseded by a resume (None before step 1)."""
    recent = session.scalars(
        select(JobEvent)
        .where(
            JobEvent.job_id == job.id,
            JobEvent.kind == "metric",
            JobEvent.run == run_of(job),
            JobEvent.superseded.is_(False),
        )
        .order_by(JobEvent.id.desc())
        .limit(3)
    ).all()
    if not recent:
        return None
    data: dict[str, Any] = {}
    for event in reversed(recent):  # the newest value of each key (the last log of a run holds only train_loss)
        data.update(event.data or {})
    event = recent[0]
    remaining = max((data.get("max_steps") or 0) - data.get("step", 0), 0)
    if data.get("step_seconds") and not JobState(job.state).terminal:
        data["eta_s"] = round(remaining * data["step_seconds"], 1)
    data["at"] = event.ts
    return data


def events(
    job_id: str,
    *,
    owner: str | None,
    after: int = 0,
    limit: int = 500,
    run: int | str | None = None,
    superseded: bool = False,
) -> list[dict[str, Any]]:
    """A job's events after event id `after`, oldest first: of run `run` (a number, `current`, or None: every
    run), without the step events a resumed fine-tune superseded unless `superseded`."""
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        stmt = select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after)
        if run is not None:
            stmt = stmt.where(JobEvent.run == (run_of(job) if run == "current" else int(run)))
        if not superseded:
            stmt = stmt.where(JobEvent.superseded.is_(False))
        return [
            {
                "id": e.id,
                "ts": e.ts,
                "kind": e.kind,
                "level": e.level,
                "message": e.message,
                "data": e.data,
                "shard_id": e.shard_id,
                "run": e.run,
                "superseded": e.superseded,
            }
            for e in session.scalars(stmt.order_by(JobEvent.id).limit(limit)).all()
        ]


# --- workers, adapters, files -------------------------------------------------------------------------------


def workers(*, all: bool = False) -> list[dict[str, Any]]:
    """Registered workers with one state (online, lost, offline: core/registry.py); by default without those that
    stopped over JOBS_STOPPED_WORKERS_SHOWN seconds ago or were replaced by a newer worker on their host and slice."""
    settings, t = get_settings(), now()
    with session_scope() as session:
        found = registry.all_workers(session)
        if not all:
            found = registry.shown(
                found, t, timeout=settings.worker_timeout, stopped_for=settings.stopped_workers_shown
            )
        return [
            {
                "name": w.name,
                "host": w.host,
                "pid": w.pid,
                "slice": w.slice,
                "queues": w.queues,
                "gpus": w.gpus,
                "capabilities": w.capabilities,
                "state": registry.state_of(w, t, settings.worker_timeout),
                "started_at": w.started_at,
                "heartbeat_at": w.heartbeat_at,
                "current_shard_id": w.current_shard_id,
                "restarts": w.restarts,
                "stopped_at": w.stopped_at,
                "exit_code": w.exit_code,
                "reason": w.reason,
            }
            for w in found
        ]


def list_adapters(*, owner: str | None, limit: int = 100, after: str | None = None) -> list[dict[str, Any]]:
    with session_scope() as session:
        return [adapters.view(a) for a in adapters.list_for(session, owner=owner, limit=limit, after=after)]


def get_adapter(adapter_id: str, *, owner: str | None) -> dict[str, Any]:
    with session_scope() as session:
        return adapters.view(adapters.get(session, adapter_id, owner=owner))


def file_view(f) -> dict[str, Any]:
    return {
        "id": f.id,
        "filename": f.filename,
        "bytes": f.bytes,
        "sha256": f.sha256,
        "purpose": f.purpose,
        "created_at": f.created_at,
        "owner": f.owner,
    }


# --- usage --------------------------------------------------------------------------------------------------

USAGE_FIELDS = (
    "jobs",
    "rows_succeeded",
    "rows_failed",
    "prompt_tokens",
    "completion_tokens",
    "gpu_seconds",
    "engine_seconds",
)
# `since`: a duration, an RFC 3339 date, or an RFC 3339 date-time (with its zone). These patterns are the query
# parameter's schema too (SINCE_SCHEMA): a value passes here exactly when it passes there, the calendar aside.
DURATION = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([smhdw])$")
DATE = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
DATE_TIME = re.compile(
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$"
)
UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
SINCE_SCHEMA = {
    "anyOf": [
        {"type": "string", "pattern": DURATION.pattern},
        {"type": "string", "format": "date"},
        {"type": "string", "format": "date-time"},
    ]
}


def usage(*, owner: str | None, since: str | None = None) -> dict[str, Any]:
    """What each owner used, summed in SQL over jobs created since `since` (a duration such as 7d, or an ISO date).

    Finished jobs count the totals written when they were finalized; live jobs count their rows so far and the
    metrics of their finished shards. GPU-seconds are each shard's wall time × its worker's slice size (0 on a
    CPU worker); engine seconds are the time spent inside generation. `owner=None` (admins): every owner.
    """
    start = usage_since(since)
    where = [Job.owner == owner] if owner is not None else []
    where += [Job.created_at >= start] if start is not None else []
    terminal = [s.value for s in JobState if s.terminal]
    totals: dict[str, dict[str, float]] = {owner: dict.fromkeys(USAGE_FIELDS, 0)} if owner is not None else {}
    with session_scope() as session:
        for query in _usage_queries(where, terminal):
            for record in session.execute(query).mappings():
                sums = totals.setdefault(record["owner"], dict.fromkeys(USAGE_FIELDS, 0))
                for key, value in record.items():
                    if key != "owner":
                        sums[key] += value or 0
    owners = [{"owner": name, **_rounded(sums)} for name, sums in sorted(totals.items())]
    overall = {key: sum(o[key] for o in owners) for key in USAGE_FIELDS}
    return {"since": start, "until": now(), "owners": owners, "total": _rounded(overall)}


def _usage_queries(where: list, terminal: list[str]) -> list:
    """Per-owner sums: job counts; finished jobs' totals; live jobs' rows so far; live jobs' finished shards."""

    def metric(column, name: str):
        return func.coalesce(func.sum(column[name].as_float()), 0.0)

    def counted(state: RowState):
        return func.coalesce(func.sum(case((JobRow.state == state.value, 1), else_=0)), 0)

    finished, live = Job.state.in_(terminal), Job.state.not_in(terminal)
    return [
        select(Job.owner, func.count().label("jobs")).where(*where).group_by(Job.owner),
        select(
            Job.owner,
            func.sum(Job.rows_succeeded).label("rows_succeeded"),
            func.sum(Job.rows_failed).label("rows_failed"),
            func.sum(Job.prompt_tokens).label("prompt_tokens"),
            func.sum(Job.completion_tokens).label("completion_tokens"),
            metric(Job.metrics, "gpu_seconds").label("gpu_seconds"),
            metric(Job.metrics, "engine_seconds").label("engine_seconds"),
        )
        .where(*where, finished)
        .group_by(Job.owner),
        select(
            Job.owner,
            counted(RowState.succeeded).label("rows_succeeded"),
            counted(RowState.failed).label("rows_failed"),
            func.coalesce(func.sum(JobRow.prompt_tokens), 0).label("prompt_tokens"),
            func.coalesce(func.sum(JobRow.completion_tokens), 0).label("completion_tokens"),
        )
        .join(JobRow, JobRow.job_id == Job.id)
        .where(*where, live)
        .group_by(Job.owner),
        select(
            Job.owner,
            metric(Shard.metrics, "gpu_seconds").label("gpu_seconds"),
            metric(Shard.metrics, "engine_seconds").label("engine_seconds"),
        )
        .join(Shard, Shard.job_id == Job.id)
        .where(*where, live)
        .group_by(Job.owner),
    ]


def _rounded(sums: dict[str, float]) -> dict[str, Any]:
    return {k: round(float(v), 3) if k.endswith("_seconds") else int(v) for k, v in sums.items()}


def usage_since(value: str | None) -> float | None:
    """`7d`, `12h`, `30m`, `90s`, `2w` before now, or an RFC 3339 date (UTC) or date-time → Unix seconds."""
    if value is None:
        return None
    if match := DURATION.match(value):
        return max(0.0, now() - float(match[1]) * UNIT_SECONDS[match[2]])
    refused = InvalidInput(
        f"since {value!r}: give a duration such as 7d, 12h, 30m or 2w, or an ISO date or time "
        "such as 2026-01-31 or 2026-01-31T12:00:00Z"
    )
    if not (DATE.match(value) or DATE_TIME.match(value)):
        raise refused
    if value.startswith("0000"):
        return 0.0  # year 0 is a valid RFC 3339 year but not Python's: before every job anyway
    text = value
    if DATE_TIME.match(value):  # Python wants an upper-case T, and no leap second (:60 counts as :59)
        text = value[:10] + "T" + value[11:17] + value[17:19].replace("60", "59") + value[19:]
    try:
        moment = datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text)
    except ValueError:
        raise refused from None  # not a day of the calendar (2026-02-30)
    return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp()
