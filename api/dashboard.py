"""The web dashboard: one static page (api/static/dashboard.html + dashboard.js, no build step) served at
`/dashboard`, the one read it needs beyond the JSON API (`throughput`), and its sign-in by a one-time code
(`signin_code`, `redeem`); their routes are in api/app.py.

The page and its script hold no data and answer without a token, like any static file; the page asks for a token
(kept in the browser's localStorage) and sends it as `Authorization: Bearer` on every API call, so a user sees
only their jobs and an admin everyone's, exactly as over the API. Views (hash routes): `#/jobs` (state, progress,
throughput, owner), `#/jobs/ID` (the job's current run, by polling: a generation job's progress, events and
throughput over time, and downloads of its results; a fine-tune's step, epoch, loss, training tok/s, ETA and a
loss curve of one point per step from its step events), `#/workers` (slices, GPUs, heartbeats).

Signing in without pasting the token (`gpujobs dashboard`): the CLI asks `POST /dashboard/codes` with its token
for a one-time code and prints `<api>/dashboard#code=<code>`. The page reads the code from the URL's fragment,
replaces the URL at once (`history.replaceState`), and trades the code for the token with `POST
/dashboard/session` (the code in the body), keeping the token in localStorage as a pasted one. Why this shape:

- The token never appears in a URL: not in the server's access log (a fragment is never sent to the server; the
  code travels in a POST body), not in the browser's history, not in the terminal's scrollback or in the process
  list of a browser the CLI starts. Only the code does, and it is dead within a minute.
- Chromium's history database keeps the URL a page was opened with even after `replaceState` rewrites it (seen in
  tests/test_dashboard.py), so a fragment holding the token itself would stay there for good; what stays there
  is a code that worked once and expired after SIGNIN_SECONDS.
- The code is kept in Redis, which every API process of a cluster shares, with a time to live; a GET and DEL in
  one transaction makes it single-use even under two concurrent redemptions. Redis holds the token sealed with the
  code (XOR with a SHAKE-256 stream of it) under the code's SHA-256, so what Redis holds opens nothing without
  the code. Not a cookie: every API route already takes the bearer token, and a cookie would bring CSRF to the
  routes that change jobs.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import FileResponse, RedirectResponse
from sqlalchemy import BigInteger, cast, func, select

from core import auth
from core.db import session_scope
from core.errors import ServiceUnavailable, Unauthorized
from core.models import JobRow
from core.queue import redis_client
from core.store import get_job, now

STATIC = Path(__file__).resolve().parent / "static"
MAX_BUCKETS = 120
SIGNIN_SECONDS = 60  # how long a sign-in code works (once)
SIGNIN_KEY = "gpujobs:signin:"  # + the code's SHA-256: the sealed token, until redeemed or expired

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
    """Rows and output tokens per second over the job's current run (from its start: a retry starts a new one) in
    at most 120 intervals of whole milliseconds (SQL-side), every interval from the start listed, empty ones as 0.
    A finished run's span is its `metrics.duration_s`, its last interval only as long as the run went on, so the
    averages here are the very figures of its `output_tok_s` and `rows_per_s` and the intervals' time-weighted mean
    is that average; a run shorter than a second is one interval. A live run ends at its last whole interval: the
    one under way would read as a drop to 0 until its rows come in."""
    with session_scope() as session:
        job = get_job(session, job_id, owner=owner)
        start = job.started_at or job.created_at
        duration = (job.metrics or {}).get("duration_s") if job.finished_at is not None else None
        span_ms = max(1, round(duration * 1000 if duration else (max(job.finished_at or now(), start) - start) * 1000))
        bucket_ms = max(1000, math.ceil(span_ms / MAX_BUCKETS))
        if job.finished_at is None and span_ms >= bucket_ms:
            span_ms -= span_ms % bucket_ms
        count = math.ceil(span_ms / bucket_ms)
        # whole milliseconds, then integer division: the same buckets on SQLite and Postgres (whose CAST rounds)
        slot = cast((JobRow.finished_at - start) * 1000, BigInteger) // bucket_ms
        stmt = (
            select(slot, func.count(), func.coalesce(func.sum(JobRow.completion_tokens), 0))
            .where(JobRow.job_id == job.id, JobRow.finished_at >= start, JobRow.worker.is_not(None))  # this run
            .group_by(slot)
        )
        sums = [[0, 0] for _ in range(count)]
        for s, n, tok in session.execute(stmt).all():
            if int(s) >= count and job.finished_at is None:
                continue  # the interval under way
            bucket = sums[min(max(int(s), 0), count - 1)]  # a row committed as the run ended counts in the last
            bucket[0], bucket[1] = bucket[0] + n, bucket[1] + int(tok)
    end = start + span_ms / 1000
    points = []
    for i, (n, tok) in enumerate(sums):
        seconds = (min(bucket_ms, span_ms - i * bucket_ms)) / 1000
        points.append(
            {
                "t": round(start + i * bucket_ms / 1000, 3),
                "seconds": seconds,
                "rows_per_s": round(n / seconds, 3),
                "tokens_per_s": round(tok / seconds, 2),
            }
        )
    rows, tokens = sum(n for n, _ in sums), sum(t for _, t in sums)
    return {
        "job_id": job_id,
        "bucket_seconds": bucket_ms / 1000,
        "start": start,
        "end": end,
        "rows": rows,
        "tokens": tokens,
        "rows_per_s": round(rows / (span_ms / 1000), 3),
        "tokens_per_s": round(tokens / (span_ms / 1000), 2),
        "points": points,
    }


# --- sign-in by a one-time code -------------------------------------------------------------------------------


def signin_code(secret: str) -> dict[str, Any]:
    """A one-time code that signs the dashboard in with the token `secret` (the caller's own), for SIGNIN_SECONDS."""
    code = secrets.token_urlsafe(32)
    with _redis() as client:
        client.set(_key(code), _seal(secret.encode(), code), ex=SIGNIN_SECONDS)
    return {"code": code, "expires_in_s": SIGNIN_SECONDS}


def redeem(code: str) -> dict[str, Any]:
    """The token a code was made for, once: the code is deleted as it is read. A used, expired or unknown code,
    or a token revoked since, is refused."""
    with _redis() as client:
        sealed, _ = client.pipeline(transaction=True).get(_key(code)).delete(_key(code)).execute()
    if sealed is None:
        raise Unauthorized(
            f"this sign-in link was used already or has expired (a link works once, within {SIGNIN_SECONDS} s): "
            "run `gpujobs dashboard` again, or paste a token"
        )
    secret = _seal(sealed, code).decode()
    with session_scope() as session:
        owner = auth.authenticate(session, secret).owner
    return {"token": secret, "owner": owner}


def _key(code: str) -> str:
    return SIGNIN_KEY + hashlib.sha256(code.encode()).hexdigest()


def _seal(data: bytes, code: str) -> bytes:
    """`data` XOR a key stream derived from the code: sealing and opening are the same operation."""
    stream = hashlib.shake_256(b"gpujobs dashboard sign-in\x00" + code.encode()).digest(len(data))
    return bytes(a ^ b for a, b in zip(data, stream))


@contextlib.contextmanager
def _redis() -> Iterator[Any]:
    """A Redis client for one step; an outage is ServiceUnavailable (503), with where to look."""
    import redis

    client = redis_client(socket_connect_timeout=3, socket_timeout=3)
    try:
        yield client
    except (redis.RedisError, OSError) as exc:
        raise ServiceUnavailable(
            f"Redis cannot be reached ({exc}): start the stack (`gpujobs up`) or check JOBS_REDIS_URL"
        ) from exc
    finally:
        client.close()
