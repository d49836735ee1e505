"""The HTTP API (FastAPI). Routes are thin: parse, call one service function, format.

Every route but `/healthz` needs `Authorization: Bearer <token>`; the job's owner comes from the token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, File, Header, Query, Request, UploadFile
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from api import service
from core import auth, files
from core.db import check_reachable, session_scope
from core.errors import Forbidden, JobsError
from core.queue import ping_redis


@dataclass(frozen=True)
class Principal:
    owner: str
    scopes: frozenset[str]

    @property
    def is_admin(self) -> bool:
        return "admin" in self.scopes

    @property
    def visible_owner(self) -> str | None:
        """The owner filter for reads and changes: None (everything) for admins."""
        return None if self.is_admin else self.owner


def principal(authorization: Annotated[str | None, Header()] = None) -> Principal:
    secret = authorization.removeprefix("Bearer ").strip() if authorization else None
    with session_scope() as session:
        token = auth.authenticate(session, secret)
        scopes = frozenset(token.scopes.split(","))
    if not scopes & {"user", "admin"}:
        raise Forbidden("this token has no user or admin scope")
    return Principal(owner=token.owner, scopes=scopes)


Caller = Annotated[Principal, Depends(principal)]

app = FastAPI(
    title="gpujobs",
    summary="Queued generation and LoRA fine-tune jobs on GPU workers",
    version="0.1.0",
)


@app.exception_handler(JobsError)
async def _jobs_error(_request: Request, exc: JobsError) -> JSONResponse:
    return JSONResponse(status_code=exc.http_status, content={"error": {"type": type(exc).__name__, "message": str(exc)}})


@app.get("/healthz", summary="Liveness: the database and Redis answer")
def healthz() -> dict[str, Any]:
    check_reachable()
    ping_redis()
    return {"ok": True}


@app.post("/files", status_code=201, summary="Upload a file (a dataset) and get its id")
def upload(caller: Caller, file: Annotated[UploadFile, File()]) -> dict[str, Any]:
    return service.store_upload(owner=caller.owner, filename=file.filename or "upload", stream=file.file)


@app.get("/files/{file_id}", summary="A stored file's metadata")
def file_info(caller: Caller, file_id: str) -> dict[str, Any]:
    with session_scope() as session:
        return service.file_view(files.get(session, file_id, owner=caller.visible_owner))


@app.post("/jobs", status_code=201, summary="Submit a job (the spec; `input` is a file id or a server path)")
async def submit(caller: Caller, spec: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    return await run_in_threadpool(service.submit, owner=caller.owner, spec_data=spec)


@app.get("/jobs", summary="List jobs, newest first")
def list_jobs(caller: Caller, state: str | None = None, limit: Annotated[int, Query(ge=1, le=1000)] = 50) -> list[dict]:
    return service.list_jobs(owner=caller.visible_owner, state=state, limit=limit)


@app.get("/jobs/{job_id}", summary="A job: state, progress, rates, metrics")
def get_job(caller: Caller, job_id: str) -> dict[str, Any]:
    return service.get(job_id, owner=caller.visible_owner)


@app.get("/jobs/{job_id}/results", summary="Finished rows as JSONL, in input order (also while the job runs)")
def results(caller: Caller, job_id: str, errors: bool = False) -> StreamingResponse:
    service.get(job_id, owner=caller.visible_owner)  # 404 before the stream starts

    def lines() -> Iterator[bytes]:
        for record in service.results(job_id, owner=caller.visible_owner, errors=errors):
            yield (json.dumps(record, ensure_ascii=False) + "\n").encode()

    return StreamingResponse(lines(), media_type="application/x-ndjson")


@app.get("/jobs/{job_id}/events", summary="A job's events after an event id")
def job_events(caller: Caller, job_id: str, after: int = 0, limit: Annotated[int, Query(ge=1, le=5000)] = 500) -> list:
    return service.events(job_id, owner=caller.visible_owner, after=after, limit=limit)


@app.post("/jobs/{job_id}/cancel", summary="Cancel a job; finished rows are kept")
def cancel(caller: Caller, job_id: str) -> dict[str, Any]:
    return service.cancel(job_id, owner=caller.visible_owner, by=caller.owner)


@app.post("/jobs/{job_id}/retry", summary="Re-open a finished job and re-run its failed rows")
def retry(caller: Caller, job_id: str, failed_only: bool = False) -> dict[str, Any]:
    return service.retry(job_id, owner=caller.visible_owner, failed_only=failed_only, by=caller.owner)


@app.get("/workers", summary="Registered workers, their slices, GPUs and heartbeats")
def workers(caller: Caller) -> list[dict[str, Any]]:
    return service.workers()
