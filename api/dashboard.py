"""The web dashboard: one static page (api/static/dashboard.html + dashboard.js, no build step) served at
`/dashboard`, and the one read it needs beyond the JSON API (`throughput`, routed in api/app.py).

The page and its script hold no data and answer without a token, like any static file; the page asks for a token
(kept in the browser's localStorage) and sends it as `Authorization: Bearer` on every API call, so a user sees
only their jobs and an admin everyone's, exactly as over the API. Views (hash routes): `#/jobs` (state, progress,
throughput, owner), `#/jobs/ID` (the job's current run, by polling: a generation job's progress, events and
throughput over time; a fine-tune's step, epoch, loss, training tok/s, ETA and a loss curve of one point per step
from its step events), `#/workers` (slices, GPUs, heartbeats).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse
from sqlalchemy import BigInteger, cast, func, select

from core.db import session_scope
from core.models import JobRow
from core.store import get_job, now

STATIC = Path(__file__).resolve().parent / "static"
MAX_BUCKETS = 120

router = APIRouter(include_in_schema=False)


@router.get("/dashboard")
def page() -> FileResponse:
    return FileResponse(STATIC / "dashboard.html", media_type="text/html", headers={"Cache-Control": "no-cache"})


@router.get("/dashboard/dashboard.js")
def script() -> FileResponse:
    return FileResponse(STATIC / "dashboard.js", media_type="text/javascript", headers={"Cache-Control": "no-cache"})


@router.get("/")
def root() -> RedirectResponse:
    return RedirectResponse("/dashboard")


def throughput(job_id: str, *, owner: str | None) -> dict[str, Any]:
    """Rows and output tokens per second over the job's current run (from its start: a retry starts a new one), in
    at most 120 equal time buckets (SQL-side)."""
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        start = job.started_at or job.created_at
        end = job.finished_at or now()
        bucket = max(1, math.ceil((end - start) / MAX_BUCKETS))
        # whole milliseconds, then integer division: the same buckets on SQLite and Postgres (whose CAST rounds)
        slot = cast((JobRow.finished_at - start) * 1000, BigInteger) // (bucket * 1000)
        stmt = (
            select(slot, func.count(), func.coalesce(func.sum(JobRow.completion_tokens), 0))
            .where(JobRow.job_id == job.id, JobRow.finished_at >= start, JobRow.worker.is_not(None))  # this run
            .group_by(slot)
            .order_by(slot)
        )
        points = [
            {
                "t": round(start + int(s) * bucket, 3),
                "rows_per_s": round(n / bucket, 3),
                "tokens_per_s": round(int(tok) / bucket, 2),
            }
            for s, n, tok in session.execute(stmt).all()
        ]
    return {"job_id": job_id, "bucket_seconds": bucket, "points": points}
