"""OpenAI-compatible Batch API: `/v1/files` and `/v1/batches`, mapped onto our generation jobs.

A script written for the OpenAI Batch API runs unchanged with `OpenAI(base_url="http://HOST:8765/v1",
api_key=<a gpujobs token>)`: `files.create(purpose="batch")`, `batches.create(...)`, `batches.retrieve` until
`completed`, `files.content(output_file_id)`, `batches.list` and `files.list` (cursor pagination),
`batches.cancel`, `files.delete`.

How it maps (choices that clients see, hence written down here):

- A batch **is** a generation job: its id is the job id (`job_…`), so `gpujobs status/results/events` work on it,
  and any job whose input is OpenAI batch lines shows as a batch. `batches.create` submits
  `{"input": file, "input_format": "openai"}` with no model: the lines' `body.model` names it, checked against
  the model allow-list (`JOBS_MODEL_ROOTS`, see api/checks.py `_model_from_input`). Every line's `url` must be
  the batch's `endpoint`. Parsing the lines and writing the output and error files are `core.openai_batch`'s
  (`openai_request`, `openai_output_record`, `openai_error_record`), through `results.export(fmt="openai")`.
- States map one to one: queued/validating → `validating`, running → `in_progress`, finalizing → `finalizing`,
  succeeded → `completed`, failed → `failed`, cancelling → `cancelling`, cancelled → `cancelled`, and a batch
  cancelled by its completion window → `expired` (`finalizing` while that cancel is under way).
- `completion_window` is `24h` only (JOBS_BATCH_WINDOW_SECONDS shortens it in tests). The window is enforced when
  a batch is read (retrieve, list) and by every worker's reaper (`core.jobs.expire_batches`): a live batch past
  `expires_at` is cancelled, its finished rows kept. `expires_at` is `created_at` + the window for every run: a
  retry (`gpujobs retry`, POST /jobs/{id}/retry) of a batch past it is refused (409; why: docs/design.md).
- The output and error files are not copies: `<batch id>-output` / `<batch id>-errors` are built from the job's
  rows when read, so they exist as soon as rows do (OpenAI names them once the batch ends; so do we) and cannot be
  deleted on their own; a job that is no batch (a fine-tune above all) has none (404). Uploaded files are ordinary
  stored files (`file_…`), usable by `gpujobs submit` too, and a file uploaded with POST /files shows here too, as
  purpose `batch`.
- `files.list` lists the stored files the caller may read (an admin: everyone's), newest first (`order=asc` for
  oldest first), `limit` 1 to 10,000 (default 10,000), `after` a file id, `purpose` a filter. It does not list the
  output and error files: they are a batch's rows, named by its `output_file_id` / `error_file_id`, not stored
  files, so `purpose=batch_output` lists none.
- Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}`, on every path under /v1 (routed or
  not, and the size and token checks of api/limits.py made before routing), so that OpenAI's clients raise their
  matching exception (`openai.BadRequestError`, `NotFoundError`, …). An invalid request (a field missing or
  invalid, a bad query parameter, a body that is not JSON or not sent as JSON, a request our checks refuse) is a
  400 `invalid_request_error` whose `param` names the field where one is known (code `missing_required_parameter`
  for a missing one). The submit checks a batch shares with POST /jobs name the spec's field, which
  `create_batch` turns into the request's (`BATCH_PARAMS`: `input_file_id`, `metadata.priority`, `body.model`) or
  leaves as the lines' (`custom_id`, `body.max_tokens`: a batch whose every line is refused). The other statuses
  are ours (401 with code `invalid_api_key`, 403, 404, 405, 409, 413), each an `invalid_request_error`, and a 5xx a
  `server_error`. The message is our own, saying what to do. Elsewhere the API keeps its own body (api/app.py).
- `metadata.priority` (`low`, `normal`, `high`) is the job's priority (core/scheduling.py); `high` needs a token
  with the priority or admin scope, like any submit. It stays in the batch's metadata too.
- `request_counts` are the job's rows: total, succeeded (`completed`), failed; `usage` its tokens.
- The endpoints check tokens like the rest of the API (scope user or admin; a user sees only their own). They are
  not in our OpenAPI schema: OpenAI's specification describes them, and tests/test_openai_api.py checks their
  access (a user gets 404 for another owner's batch and file).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, TypeVar

from fastapi import APIRouter, File, Form, Query, UploadFile
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy import and_, case, or_, select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api import access, results, service, views
from core import files
from core.db import session_scope
from core.errors import Conflict, IllegalTransition, InvalidInput, JobsError, NotFound
from core.jobs import BATCH_EXPIRED_BY, batch_deadline
from core.models import File as StoredFile
from core.models import Job, JobEvent
from core.settings import get_settings
from core.states import JobState
from core.store import get_job, now

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
META = "openai_batch."  # spec.metadata keys of ours, hidden from the batch's metadata
STATUS = {
    "queued": "validating",
    "validating": "validating",
    "running": "in_progress",
    "finalizing": "finalizing",
    "succeeded": "completed",
    "failed": "failed",
    "cancelling": "cancelling",
    "cancelled": "cancelled",
}
OUTPUT, ERRORS = "-output", "-errors"
BATCH_PURPOSES = ("batch", "input")  # stored purposes shown as OpenAI's "batch" (POST /files stores "input")
PREFIX = "/v1"
# the batch request's field that stands for a spec field a submit check names (api/checks.py): a batch's input is
# its input_file_id, its priority its metadata.priority, its model the lines' body.model; the lines' own fields
# (custom_id, body.max_tokens) and metadata keep their names
BATCH_PARAMS = {"input": "input_file_id", "priority": "metadata.priority", "model": "body.model"}
# OpenAI's error type by status where it is neither invalid_request_error (4xx) nor server_error (5xx); no error of
# ours answers 429 today, one that comes will read as OpenAI's
ERROR_TYPES = {429: "rate_limit_error"}

router = APIRouter(prefix=PREFIX, include_in_schema=False)
Who = access.Caller
T = TypeVar("T")


# --- errors --------------------------------------------------------------------------------------------------


def serves(path: str) -> bool:
    """Whether a request's path is this API's, routed or not: its errors take OpenAI's shape."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error as OpenAI's API answers it, for api/app.py's handlers and api/limits.py: a request we call invalid
    (our 422) is OpenAI's 400, so that its clients raise BadRequestError; the other statuses stay."""
    status = 400 if status == 422 else status
    kind = "server_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error")
    if status == 401:
        code = code or "invalid_api_key"
    content = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(status_code=status, content=content)


# --- files ---------------------------------------------------------------------------------------------------


@router.post("/files")
def create_file(
    who: Who, _one: access.OneFile, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> dict[str, Any]:
    if purpose != "batch":
        raise InvalidInput(
            f"purpose {purpose!r} is not supported here: upload batch input files with purpose='batch'", param="purpose"
        )
    with session_scope() as session:
        stored = files.save(
            session, owner=who.owner, filename=file.filename or "batch.jsonl", stream=file.file, purpose="batch"
        )
        return file_object(stored)


@router.get("/files")
def list_files(
    who: Who,
    purpose: Annotated[str | None, Query(description="only files of this purpose")] = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Annotated[Literal["asc", "desc"], Query(description="by created_at")] = "desc",
    after: Annotated[str | None, Query(description="the last file id of the previous page")] = None,
) -> dict[str, Any]:
    """The stored files the caller may read (an admin: everyone's), newest first by default. A batch's output and
    error files are not listed: they are views of its rows, not stored files (its output_file_id and error_file_id
    name them), so `purpose=batch_output` lists none."""
    shown = case((StoredFile.purpose.in_(BATCH_PURPOSES), "batch"), else_=StoredFile.purpose)  # file_object's
    with session_scope() as session:
        stmt = select(StoredFile)
        if who.visible_owner is not None:
            stmt = stmt.where(StoredFile.owner == who.visible_owner)
        if purpose is not None:
            stmt = stmt.where(shown == purpose)
        if after:
            cursor = _named(lambda: files.get(session, after, owner=who.visible_owner), "after")
            at, key = StoredFile.created_at, StoredFile.id
            stmt = stmt.where(
                or_(at < cursor.created_at, and_(at == cursor.created_at, key < cursor.id))
                if order == "desc"
                else or_(at > cursor.created_at, and_(at == cursor.created_at, key > cursor.id))
            )
        keys = (StoredFile.created_at, StoredFile.id)
        stmt = stmt.order_by(*(k.desc() if order == "desc" else k.asc() for k in keys)).limit(limit + 1)
        found = list(session.scalars(stmt))
        return page([file_object(f) for f in found[:limit]], has_more=len(found) > limit)


@router.get("/files/{file_id}")
def retrieve_file(who: Who, file_id: str) -> dict[str, Any]:
    if job_id := _virtual(file_id):
        size = sum(len(chunk) for chunk in _virtual_content(who, file_id, job_id))
        with session_scope() as session:
            job = _batch_of_file(session, who, file_id, job_id)
            return {
                "id": file_id,
                "object": "file",
                "bytes": size,
                "created_at": int(job.finished_at or now()),
                "filename": f"{file_id}.jsonl",
                "purpose": "batch_output",
                "status": "processed",
                "expires_at": None,
                "status_details": None,
            }
    with session_scope() as session:
        return file_object(files.get(session, file_id, owner=who.visible_owner))


@router.get("/files/{file_id}/content")
def file_content(who: Who, file_id: str):
    if job_id := _virtual(file_id):
        chunks = _virtual_content(who, file_id, job_id)
        first = next(chunks, b"")  # a 404 is raised here, before the response starts
        return StreamingResponse(_chain(first, chunks), media_type="application/jsonl")
    with session_scope() as session:
        stored = files.get(session, file_id, owner=who.visible_owner)
        path, name = files.absolute(stored), stored.filename
    if not path.is_file():  # removed from the artifacts store behind the database's back
        raise NotFound(f"file {file_id}'s stored copy is gone from the server's artifacts store: upload it again")
    return FileResponse(path, media_type="application/octet-stream", filename=name)


@router.delete("/files/{file_id}")
def delete_file(who: Who, file_id: str) -> dict[str, Any]:
    if job_id := _virtual(file_id):
        with session_scope() as session:
            _batch_of_file(session, who, file_id, job_id)
        raise Conflict(f"{file_id} is built from batch {job_id}'s rows: it cannot be deleted on its own")
    with session_scope() as session:
        stored = files.get(session, file_id, owner=who.visible_owner)
        if used := files.live_use(session, file_id):
            job, role = used
            what, state = ("batch", STATUS[job.state]) if is_batch(job) else ("job", job.state)
            raise Conflict(
                f"file {file_id} is the {role} of {what} {job.id}, which is still {state}: delete it once the "
                f"{what} has ended (or cancel the {what})"
            )
        path = files.absolute(stored)
        session.delete(stored)
    path.unlink(missing_ok=True)
    return {"id": file_id, "object": "file", "deleted": True}


def file_object(f: StoredFile) -> dict[str, Any]:
    return {
        "id": f.id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": int(f.created_at),
        "filename": f.filename,
        "purpose": "batch" if f.purpose in BATCH_PURPOSES else f.purpose,
        "status": "processed",
        "expires_at": None,
        "status_details": None,
    }


def page(data: list[dict[str, Any]], *, has_more: bool) -> dict[str, Any]:
    """A list as OpenAI's cursor pages read it: the client asks again with `after` = the last id while has_more."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _named(find: Callable[[], T], param: str) -> T:
    """`find()`, whose NotFound names the request field that named what is missing (OpenAI's `param`)."""
    try:
        return find()
    except NotFound as exc:
        exc.param = param
        raise


def _virtual(file_id: str) -> str | None:
    """The job id of a batch's output or error file id, else None."""
    for suffix in (OUTPUT, ERRORS):
        if file_id.startswith("job_") and file_id.endswith(suffix):
            return file_id.removesuffix(suffix)
    return None


def _virtual_content(who: access.Principal, file_id: str, job_id: str) -> Iterator[bytes]:
    """The output or error file's bytes; 404 (raised here, before any byte) for a job that is not a batch."""
    with session_scope() as session:
        _batch_of_file(session, who, file_id, job_id)
    return results.export(job_id, owner=who.visible_owner, fmt="openai", errors=file_id.endswith(ERRORS))


def _batch_of_file(session: Session, who: access.Principal, file_id: str, job_id: str) -> Job:
    """The batch behind an output or error file id: only an OpenAI batch has them (another job, a fine-tune
    above all, answers 404, as /v1/batches/{id} does)."""
    job = get_job(session, job_id, owner=who.visible_owner)
    if not is_batch(job):
        raise NotFound(
            f"no file {file_id!r}: job {job_id} is not an OpenAI batch, and only a batch has output and error "
            f"files; read the job with GET /jobs/{job_id}"
        )
    return job


def is_batch(job: Job) -> bool:
    """A generation job whose input is OpenAI batch lines (however it was submitted)."""
    return job.kind == "generate" and job.spec.get("input_format") == "openai"


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest


# --- batches -------------------------------------------------------------------------------------------------


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # newer client fields (output_expires_after…) change nothing here

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None


@router.post("/batches")
async def create_batch(who: Who, request: BatchRequest) -> dict[str, Any]:
    spec = await run_in_threadpool(batch_spec, who, request)
    try:
        job = await run_in_threadpool(
            service.submit, owner=who.owner, spec_data=spec, admin=who.is_admin, may_prioritize=who.may_prioritize
        )
    except JobsError as exc:  # the submit checks name the spec's field: `param` names the request's
        exc.param = BATCH_PARAMS.get(exc.param, exc.param)
        raise
    return await run_in_threadpool(_view, who, job["id"])


def batch_spec(who: access.Principal, request: BatchRequest) -> dict[str, Any]:
    """The job spec of a batch request, after the checks OpenAI makes when a batch is created."""
    if request.endpoint not in ENDPOINTS:
        raise InvalidInput(
            f"endpoint {request.endpoint!r} is not supported: use {' or '.join(ENDPOINTS)}", param="endpoint"
        )
    if request.completion_window != "24h":
        raise InvalidInput(
            f"completion_window {request.completion_window!r}: only '24h' is supported", param="completion_window"
        )
    metadata = request.metadata or {}
    if len(metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in metadata.items()):
        raise InvalidInput(
            "metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512", param="metadata"
        )
    if any(k.startswith(META) for k in metadata):
        raise InvalidInput(
            f"metadata keys starting with {META!r} are reserved by this server: rename them", param="metadata"
        )
    with session_scope() as session:
        stored = _named(lambda: files.get(session, request.input_file_id, owner=who.owner), "input_file_id")
        path = files.absolute(stored)
    check_urls(path, request.endpoint)
    spec = {
        "kind": "generate",
        "input": request.input_file_id,
        "input_format": "openai",
        "metadata": {**metadata, META + "endpoint": request.endpoint, META + "completion_window": "24h"},
    }
    if "priority" in metadata:  # metadata {"priority": "low" | "normal" | "high"}: the job's priority
        spec["priority"] = metadata["priority"]
    return spec


def check_urls(path, endpoint: str) -> None:
    """Every line must be a request to the batch's endpoint (lines that are not JSON are left to the row checks)."""
    with open(path, "rb") as stream:
        for line_no, raw in enumerate(stream, start=1):
            try:
                url = json.loads(raw).get("url") if raw.strip() else None
            except (ValueError, AttributeError):
                continue
            if url is not None and url != endpoint:
                raise InvalidInput(
                    f"line {line_no} has url {url!r} but the batch's endpoint is {endpoint!r}: every "
                    "line of a batch must use the batch's endpoint",
                    param="url",
                )


@router.get("/batches/{batch_id}")
def retrieve_batch(who: Who, batch_id: str) -> dict[str, Any]:
    return _view(who, batch_id)


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(who: Who, batch_id: str) -> dict[str, Any]:
    _view(who, batch_id)  # 404 for a job that is not a batch; expires it first if its window has passed
    try:
        service.cancel(batch_id, owner=who.visible_owner, by=who.owner)
    except IllegalTransition as exc:
        raise Conflict(f"batch {batch_id} cannot be cancelled: {exc}") from None
    return _view(who, batch_id)


@router.get("/batches")
def list_batches(
    who: Who,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: Annotated[str | None, Query(description="the last batch id of the previous page")] = None,
) -> dict[str, Any]:
    with session_scope() as session:
        stmt = select(Job.id).where(Job.kind == "generate", Job.spec["input_format"].as_string() == "openai")
        if who.visible_owner is not None:
            stmt = stmt.where(Job.owner == who.visible_owner)
        if after:
            cursor = _named(lambda: get_job(session, after, owner=who.visible_owner), "after")
            stmt = stmt.where(
                or_(Job.created_at < cursor.created_at, and_(Job.created_at == cursor.created_at, Job.id < cursor.id))
            )
        ids = list(session.scalars(stmt.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)))
    return page([_view(who, job_id) for job_id in ids[:limit]], has_more=len(ids) > limit)


def _view(who: access.Principal, batch_id: str) -> dict[str, Any]:
    expire_if_due(who, batch_id)
    with session_scope() as session:
        job = get_job(session, batch_id, owner=who.visible_owner)
        if not is_batch(job):
            raise NotFound(
                f"no batch {batch_id!r}: job {batch_id} is not an OpenAI batch (its input is not batch "
                "lines); read it with `gpujobs status`"
            )
        return batch_object(session, job)


def expire_if_due(who: access.Principal, batch_id: str) -> None:
    with session_scope() as session:
        job = session.get(Job, batch_id)
        due = (
            job is not None
            and (who.visible_owner in (None, job.owner))
            and not JobState(job.state).terminal
            and (deadline := batch_deadline(job)) is not None
            and now() > deadline
        )
    if due:
        try:
            service.cancel(batch_id, owner=None, by=BATCH_EXPIRED_BY)
        except IllegalTransition:
            pass  # it ended meanwhile


def batch_object(session: Session, job: Job) -> dict[str, Any]:
    view = views.job_view(session, job)
    times = state_times(session, job.id)
    expired = BATCH_EXPIRED_BY in times.get("cancelling_reason", "")
    status = STATUS[job.state]
    if expired:
        status = "expired" if job.state == "cancelled" else "finalizing"
    ended = JobState(job.state).terminal
    rows, tokens = view["rows"], view["tokens"]
    meta = job.spec.get("metadata") or {}
    errors = None
    if job.state == "failed" and job.error:
        errors = {"object": "list", "data": [{"code": "failed", "message": job.error, "param": None, "line": None}]}
    return {
        "id": job.id,
        "object": "batch",
        "endpoint": meta.get(META + "endpoint", ENDPOINTS[0]),
        "errors": errors,
        "input_file_id": job.input_file_id,
        "completion_window": "24h",
        "status": status,
        "output_file_id": job.id + OUTPUT if ended and rows["succeeded"] else None,
        "error_file_id": job.id + ERRORS if ended and rows["failed"] else None,
        "created_at": int(job.created_at),
        "in_progress_at": _ts(times.get("running")),
        "expires_at": int(job.created_at + get_settings().batch_window_seconds),
        "finalizing_at": _ts(times.get("finalizing")),
        "completed_at": _ts(times.get("succeeded")),
        "failed_at": _ts(times.get("failed")),
        "expired_at": _ts(times.get("cancelled")) if expired else None,
        "cancelling_at": None if expired else _ts(times.get("cancelling")),
        "cancelled_at": None if expired else _ts(times.get("cancelled")),
        "request_counts": {"total": rows["total"], "completed": rows["succeeded"], "failed": rows["failed"]},
        "metadata": {k: v for k, v in meta.items() if not k.startswith(META)} or None,
        "model": job.spec.get("model"),
        "usage": {
            "input_tokens": tokens["prompt"],
            "output_tokens": tokens["completion"],
            "total_tokens": tokens["prompt"] + tokens["completion"],
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }


def state_times(session: Session, job_id: str) -> dict[str, Any]:
    """When the job last entered each state (from its state events), and the reason of its last cancel."""
    stmt = (
        select(JobEvent.ts, JobEvent.data)
        .where(JobEvent.job_id == job_id, JobEvent.kind == "state", JobEvent.shard_id.is_(None))
        .order_by(JobEvent.id)
    )
    times: dict[str, Any] = {}
    for ts, data in session.execute(stmt).all():
        state = (data or {}).get("state")
        if state:
            times[state] = ts
            if state == "cancelling":
                times["cancelling_reason"] = (data or {}).get("reason") or ""
    return times


def _ts(value: float | None) -> int | None:
    return int(value) if value is not None else None
