"""The HTTP API (FastAPI). Routes are thin: parse, call one service function, format.

Every route but `/healthz` needs `Authorization: Bearer <token>` with the `user` or `admin` scope; the job's owner
comes from the token. A user sees and changes only their own jobs and files (another owner's answer 404, exactly
as if they did not exist); an admin sees every owner's. `tests/test_access.py` checks this on every route of the
OpenAPI schema, so a new route must take `Caller` (or be added to its public list on purpose). The routers
mounted below stay out of the schema and check access themselves, each with its own tests: `/metrics` (Prometheus
text, metrics or admin scope: tests/test_metrics.py), `/dashboard` (a static page; its data comes from the routes
here), `/v1/files` and `/v1/batches` (OpenAI's specification describes them: tests/test_openai_api.py).

Every route declares the errors it answers (`responses=errors(...)`, api/openapi.py), and every error, ours or
Starlette's, has the one body `{"error": {"type", "message"}}`, and a query parameter a route does not declare is one
of those errors (`KnownQueryRoute`), not ignored. tests/test_fuzz.py checks the document against the answers with
Schemathesis. Under /v1 every error has OpenAI's body and statuses instead (`openai_api.error`:
`{"error": {"message", "type", "param", "code"}}`, an invalid request a 400), as OpenAI's clients read them.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from http import HTTPStatus
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, File, Query, Request, Response, UploadFile
from fastapi.dependencies.models import Dependant
from fastapi.dependencies.utils import get_parameterless_sub_dependant
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, field_validator
from sqlalchemy.exc import DataError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match

from api import checks, dashboard, metrics, openai_api, openapi, service, service_models, views
from api.access import Caller, Credentials, OneFile
from api.limits import BodyGuard, error_response
from api.openapi import errors
from api.results import export, readable
from core import artifacts, auth, files, formats, scheduling
from core.db import check_reachable, session_scope
from core.errors import Forbidden, InvalidInput, JobsError, ServiceUnavailable, WrongArtifacts
from core.hub import HUB_ID
from core.queue import ping_redis
from core.spec import whole_number
from core.states import JobState

log = logging.getLogger(__name__)
# job_events.id is an Integer: 32 bits on Postgres (the fuzzer found a 35-bit `after` refused there with a 422)
MAX_EVENT_ID = 2**31 - 1


class KnownQueryRoute(APIRoute):
    """A route of ours (each `@app.get` etc. below): a query parameter it does not declare is refused with a 422
    naming it and those the route takes, where FastAPI would ignore it (`GET /jobs?stat=failed`, a typo of `state`,
    listed every job). The routers included below keep FastAPI's own route class: /v1's OpenAI clients may send
    parameters of their own, and /metrics and /dashboard take none that matter."""

    def __init__(self, path: str, endpoint: Any, **kwargs: Any) -> None:
        responses = kwargs.get("responses") or {}
        kwargs["responses"] = responses if 422 in responses else {**responses, **errors(422)}
        super().__init__(path, endpoint, **kwargs)
        self.query_names = tuple(dict.fromkeys(_query_names(self.dependant)))
        # last, after the route's own dependencies (`dependencies=` would put it first): a request without a token
        # still gets its 401 first, and the route acts only once the check has passed
        check = get_parameterless_sub_dependant(depends=Depends(_refuse_unknown_query), path=self.path_format)
        self.dependant.dependencies.append(check)


def _query_names(dependant: Dependant) -> list[str]:
    """The query parameters a route reads: its own and those of its dependencies, as sent (aliases)."""
    return [field.alias for field in dependant.query_params] + [
        name for sub in dependant.dependencies for name in _query_names(sub)
    ]


def _refuse_unknown_query(request: Request) -> None:
    route = request.scope["route"]
    unknown = [name for name in dict.fromkeys(request.query_params) if name not in route.query_names]
    if not unknown:
        return
    named = ", ".join(repr(name) for name in unknown)
    takes = f"it takes {', '.join(route.query_names)}" if route.query_names else "it takes none"
    plural = "s" if len(unknown) > 1 else ""
    raise InvalidInput(f"unknown query parameter{plural} {named} for {request.method} {route.path}: {takes}")


@asynccontextmanager
async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
    """Serve only from the store's artifacts directory (core/artifacts.py; a fresh store adopts this one): an API
    on another would keep uploads where no worker reads them. A store that cannot be reached yet is no reason to
    refuse: /healthz and every request say so, and the workers check their own directory when they start."""
    try:
        await run_in_threadpool(artifacts.verify)
    except WrongArtifacts as exc:
        log.error("refusing to start: %s", exc)
        raise
    except ServiceUnavailable as exc:
        log.warning("could not check the artifacts directory against the store: %s", exc)
    yield


app = FastAPI(
    title="gpujobs",
    summary="Queued generation and LoRA fine-tune jobs on GPU workers",
    version="0.1.0",
    lifespan=lifespan,
)
app.router.route_class = KnownQueryRoute  # before the routes below are declared
app.add_middleware(BodyGuard)  # a body's size, and past a few KiB its token, checked before it is read (api/limits.py)
app.include_router(metrics.router)  # GET /metrics (Prometheus; the metrics or admin scope)
app.include_router(dashboard.router)  # the web dashboard's static page at /dashboard (its data: the routes below)
app.include_router(openai_api.router)  # /v1/files and /v1/batches: the OpenAI Batch API over our jobs
app.openapi = partial(openapi.openapi, app)  # FastAPI's document plus the job spec's schemas (api/openapi.py)


@app.exception_handler(JobsError)
async def _jobs_error(request: Request, exc: JobsError) -> JSONResponse:
    return error_response(exc, request.scope["path"])


@app.exception_handler(HTTPException)
async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own answers (a body it cannot parse: 400; no such route: 404; a method the path lacks: 405) in
    our error body. A 405's Allow lists the methods of every route of the path (Starlette's names only the first
    route's, e.g. POST for /jobs, which GET serves too; RFC 9110 wants them all)."""
    try:
        kind = "".join(word.capitalize() for word in HTTPStatus(exc.status_code).name.split("_"))
    except ValueError:
        kind = "HTTPError"
    response = _error(request, exc.status_code, kind, f"{exc.detail}")
    response.headers.update(exc.headers or {})
    if exc.status_code == 405:
        response.headers["Allow"] = ", ".join(_allowed(request.scope))
    return response


HTTP_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE")  # those a route may declare


def _allowed(scope: dict[str, Any]) -> list[str]:
    """The methods some route serves at the request's path, each found by matching the path with that method: the
    routers included above (/v1, /metrics, /dashboard) sit behind FastAPI's wrapper, which has no `methods` to
    read, but matches like any route."""
    routes = app.router.routes
    return [m for m in HTTP_METHODS if any(r.matches({**scope, "method": m})[0] == Match.FULL for r in routes)]


@app.exception_handler(DataError)
async def _data_error(request: Request, exc: DataError) -> JSONResponse:
    """A value the database refuses (a NUL character in a string, a number out of range): the request's fault."""
    log.warning("%s %r: the database refused a value: %s", request.method, request.url.path, exc.orig)
    return _error(
        request,
        422,
        "InvalidInput",
        f"the request holds a value the database cannot store ({exc.orig}): "
        "remove NUL characters and keep numbers within 64 bits",
    )


@app.exception_handler(RequestValidationError)
async def _invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's own 422 (`detail`, kept for its clients), plus our `error` with one readable line for the CLI. A
    body that is not JSON at all is a 400: malformed, rather than invalid. A JSON route reads its body as JSON only
    under a JSON Content-Type (FastAPI's strict content type; POST /jobs reads its own): otherwise the body reaches
    validation as bytes, and the 422 says which header to send (`curl -d` sends a form's). Under /v1 each is
    OpenAI's 400 (api/openai_api.py), naming the first field at fault as its `param`."""
    malformed = [e for e in exc.errors() if e.get("type") == "json_invalid"]
    if malformed:
        return _error(request, 400, "BadRequest", f"the body is not valid JSON: {malformed[0]['ctx']['error']}")
    if any(tuple(e["loc"]) == ("body",) and isinstance(e.get("input"), bytes) for e in exc.errors()):
        sent = request.headers.get("content-type")
        return _error(
            request,
            422,
            "InvalidInput",
            f"the body was not read as JSON because its Content-Type is {repr(sent) if sent else 'missing'}: send "
            "the body as JSON with Content-Type: application/json",
            detail=jsonable_encoder(exc.errors()),
        )
    problems = "; ".join(
        f"{' '.join(map(str, e['loc']))}: {e['msg']}"
        + (f" ({e['ctx']['error']})" if "error" in (e.get("ctx") or {}) else "")
        for e in exc.errors()
    )
    first = exc.errors()[0]
    return _error(
        request,
        422,
        "InvalidInput",
        f"invalid request: {problems}",
        param=".".join(map(str, first["loc"][1:])) or None,  # ("body", "metadata", "k"): metadata.k
        code="missing_required_parameter" if first["type"] == "missing" else None,
        detail=_finite(jsonable_encoder(exc.errors())),
    )


def _finite(value: Any) -> Any:
    """`value` with NaN and ±Infinity as text: Python's JSON reader takes them from a body, and an error that echoes
    one back could not be written as JSON (it was a 500 from the error handler itself)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _not_json(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON number: give a finite number, or leave the field out")


def _error(
    request: Request,
    status: int,
    kind: str,
    message: str,
    *,
    param: str | None = None,
    code: str | None = None,
    **extra: Any,
) -> JSONResponse:
    """Our error body (with `extra`, FastAPI's `detail` for one), or under /v1 OpenAI's, which names the field at
    fault (`param`) and may carry one of OpenAI's codes."""
    if openai_api.serves(request.scope["path"]):
        return openai_api.error(status, message, param=param, code=code)
    return JSONResponse(status_code=status, content={"error": {"type": kind, "message": message}, **extra})


@app.get("/healthz", summary="Liveness: the database and Redis answer", responses=errors(503))
def healthz() -> dict[str, Any]:
    check_reachable()
    ping_redis()
    return {"ok": True}


@app.post(
    "/files",
    status_code=201,
    summary="Upload a file (a dataset) and get its id",
    responses=errors(400, 401, 403, 413, 422, 503),
)
def upload(
    caller: Caller,
    _one: OneFile,
    file: Annotated[
        UploadFile,
        File(
            description="the file, as the one multipart part named `file` (several are refused): a dataset "
            "(JSONL, OpenAI batch lines, CSV, Parquet) or a packed saved dataset; its format is detected when a job "
            "reads it",
            json_schema_extra={"format": "binary"},  # any bytes (OpenAPI 3.0's spelling, which clients know)
        ),
    ],
) -> dict[str, Any]:
    return service.store_upload(owner=caller.owner, filename=file.filename or "upload", stream=file.file)


@app.get("/files/{file_id}", summary="A stored file's metadata", responses=errors(401, 403, 404, 422, 503))
def file_info(caller: Caller, file_id: str) -> dict[str, Any]:
    with session_scope() as session:
        return views.file_view(files.get(session, file_id, owner=caller.visible_owner))


@app.post(
    "/jobs",
    status_code=201,
    summary="Submit a job (the spec; `input` is a file id or a server path)",
    responses=errors(400, 401, 403, 404, 409, 422, 503),
    openapi_extra=openapi.JOB_SPEC_BODY,
)
async def submit(caller: Caller, request: Request) -> dict[str, Any]:
    # The body is read here, not by FastAPI: `parse_spec` validates it (api/openapi.py documents it from the same
    # models), and its messages name each bad field.
    try:
        spec = json.loads(await request.body(), parse_constant=_not_json)
    except ValueError as exc:
        return _error(request, 400, "BadRequest", f"the body is not valid JSON: {exc}")
    except RecursionError:
        return _error(request, 400, "BadRequest", "the body is nested too deeply to be a job spec")
    if not isinstance(spec, dict):
        raise InvalidInput(f"a job spec must be a JSON object, not {type(spec).__name__}")
    checks.request(spec, admin=caller.is_admin)
    return await run_in_threadpool(
        service.submit, owner=caller.owner, spec_data=spec, admin=caller.is_admin, may_prioritize=caller.may_prioritize
    )


HAS_MORE = "X-Has-More"  # a list route's header: "true" when its `limit` cut the list (ask for the next page)
HAS_MORE_HEADER = {
    "description": "true when `limit` cut the list",
    "schema": {"type": "string", "enum": ["true", "false"]},
}


def _page(response: Response, found: list, limit: int) -> list:
    """The first `limit` of `limit + 1` found, with X-Has-More saying whether there were more: a list never stops
    without saying so."""
    response.headers[HAS_MORE] = "true" if len(found) > limit else "false"
    return found[:limit]


@app.get(
    "/jobs",
    summary="List jobs, newest first (header X-Has-More: true when `limit` cut the list: ask again with `after` the "
    "last id listed)",
    responses={200: {"headers": {HAS_MORE: HAS_MORE_HEADER}}, **errors(401, 403, 404, 422, 503)},
)
def list_jobs(
    caller: Caller,
    response: Response,
    state: JobState | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
    after: Annotated[str | None, Query(description="a job id: the jobs listed after it (the next page)")] = None,
) -> list[dict]:
    state_value = state.value if state else None
    found = views.list_jobs(owner=caller.visible_owner, state=state_value, limit=limit + 1, after=after)
    return _page(response, found, limit)


@app.get("/jobs/{job_id}", summary="A job: state, progress, rates, metrics", responses=errors(401, 403, 404, 422, 503))
def get_job(caller: Caller, job_id: str) -> dict[str, Any]:
    return views.get(job_id, owner=caller.visible_owner)


@app.get(
    "/jobs/{job_id}/results",
    summary="Finished rows as JSONL, OpenAI batch output, CSV or Parquet (also while the job runs); a fine-tune "
    "generates no rows (409: its adapter is GET /adapters/{job_id})",
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "the rows, in the format asked (a file download)",
            "content": {media: {"schema": {"type": "string"}} for media in sorted(set(formats.MEDIA_TYPES.values()))},
        },
        **errors(401, 403, 404, 409, 422, 503),
    },
)
def results(
    caller: Caller,
    job_id: str,
    errors: bool = False,
    format: Annotated[
        Literal["jsonl", "openai", "csv", "parquet"],
        Query(description="jsonl (ours), openai (Batch output file; with errors, its error file), csv or parquet"),
    ] = "jsonl",
    order: Annotated[
        Literal["input", "finished"], Query(description="input order, or the order rows finished")
    ] = "input",
    with_input: Annotated[
        bool,
        Query(
            description="put each row's prompt (or chat messages) beside its output, in every format (off by "
            "default: prompts are often far longer than outputs)"
        ),
    ] = False,
) -> StreamingResponse:
    readable(job_id, owner=caller.visible_owner)  # 404 (or 409 for a fine-tune) before the stream starts
    kind = ("-errors" if errors else "") + ("-with-input" if with_input else "")
    name = f"{job_id}{kind}.{'jsonl' if format == 'openai' else format}"
    return StreamingResponse(
        export(job_id, owner=caller.visible_owner, fmt=format, errors=errors, order=order, with_input=with_input),
        media_type=formats.MEDIA_TYPES[format],
        headers={"Content-Disposition": f'attachment; filename="{name}"'},
    )


@app.get(
    "/jobs/{job_id}/throughput",
    summary="Rows and output tokens per second over a job's run: every interval from its start to its end (or "
    "now), with the run's averages",
    responses=errors(401, 403, 404, 422, 503),
)
def throughput(caller: Caller, job_id: str) -> dict[str, Any]:
    return dashboard.throughput(job_id, owner=caller.visible_owner)


# --- the dashboard's sign-in by a one-time code (`gpujobs dashboard`; why this shape: api/dashboard.py) ----------


@app.post(
    "/dashboard/codes",
    status_code=201,
    summary="A one-time code that signs the dashboard in with this token: open /dashboard#code=CODE within 60 s",
    responses=errors(401, 403, 503),
)
def dashboard_code(caller: Caller, credentials: Credentials) -> dict[str, Any]:
    assert credentials is not None  # `Caller` refused a request without one
    return dashboard.signin_code(credentials.credentials)


class SigninRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    code: str = Field(min_length=1, max_length=200, description="the code from POST /dashboard/codes")


@app.post(
    "/dashboard/session",
    summary="Trade a one-time dashboard code for its token (no bearer token: the code is the credential; it works "
    "once)",
    responses=errors(400, 401, 422, 503),
)
def dashboard_session(body: SigninRequest) -> dict[str, Any]:
    return dashboard.redeem(body.code)


@app.get(
    "/jobs/{job_id}/events",
    summary="A job's events after an event id, oldest first, `limit` at a time: ask "
    "again with `after` = the last id while X-Has-More is true",
    responses=errors(401, 403, 404, 422, 503),
)
def job_events(
    caller: Caller,
    response: Response,
    job_id: str,
    after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID)] = 0,
    limit: Annotated[int, Query(ge=1, le=5000)] = 500,
    run: Annotated[
        str | None,
        Query(
            pattern=r"^([1-9][0-9]{0,8}|current)$",
            description="a run's events only: its number (1, then one more per retry) or `current`; default: every run",
        ),
    ] = None,
    superseded: Annotated[bool, Query(description="also the step events a resumed fine-tune ran again")] = False,
) -> list:
    found = views.events(
        job_id, owner=caller.visible_owner, after=after, limit=limit + 1, run=run, superseded=superseded
    )
    return _page(response, found, limit)


@app.post(
    "/jobs/{job_id}/cancel",
    summary="Cancel a job; finished rows are kept",
    responses=errors(401, 403, 404, 409, 422, 503),
)
def cancel(caller: Caller, job_id: str) -> dict[str, Any]:
    return service.cancel(job_id, owner=caller.visible_owner, by=caller.owner)


@app.post(
    "/jobs/{job_id}/retry",
    summary="Re-open a finished job and re-run its failed rows",
    responses=errors(401, 403, 404, 409, 422, 503),
)
def retry(caller: Caller, job_id: str, failed_only: bool = False) -> dict[str, Any]:
    return service.retry(job_id, owner=caller.visible_owner, failed_only=failed_only, by=caller.owner)


@app.get(
    "/usage",
    summary="Usage per owner: jobs, rows, tokens, GPU-seconds and engine seconds",
    responses=errors(401, 403, 422, 503),
)
def usage(
    caller: Caller,
    owner: Annotated[str | None, Query(description="one owner (admins); a user sees only their own")] = None,
    since: Annotated[
        str | None,
        Query(
            description="jobs created since: a duration (7d, 12h, 30m, 90s, 2w) or an RFC 3339 date (UTC) or "
            "date-time (2026-01-31, 2026-01-31T12:00:00Z)",
            json_schema_extra=views.SINCE_SCHEMA,
        ),
    ] = None,
) -> dict[str, Any]:
    owner = owner or None
    if not caller.is_admin and owner not in (None, caller.owner):
        raise Forbidden(f"only an admin can read the usage of {owner!r}: leave out --owner to see your own")
    return views.usage(owner=caller.visible_owner or owner, since=since)


@app.get(
    "/adapters",
    summary="Registered LoRA adapters (id = the fine-tune job that made it), newest first "
    "(header X-Has-More: true when `limit` cut the list: ask again with `after` the last id listed)",
    responses={200: {"headers": {HAS_MORE: HAS_MORE_HEADER}}, **errors(401, 403, 404, 422, 503)},
)
def list_adapters(
    caller: Caller,
    response: Response,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    after: Annotated[
        str | None, Query(description="an adapter id: the adapters listed after it (the next page)")
    ] = None,
) -> list[dict[str, Any]]:
    return _page(response, views.list_adapters(owner=caller.visible_owner, limit=limit + 1, after=after), limit)


@app.get(
    "/adapters/{job_id}",
    summary="An adapter (its id is the fine-tune job's): base model, tokenizer, LoRA config, metrics",
    responses=errors(401, 403, 404, 422, 503),
)
def get_adapter(caller: Caller, job_id: str) -> dict[str, Any]:
    return views.get_adapter(job_id, owner=caller.visible_owner)


@app.get(
    "/workers",
    summary="Registered workers, their slices, GPUs, heartbeats, restarts and why they stopped",
    responses=errors(401, 403, 422, 503),
)
def workers(
    caller: Caller,
    all: Annotated[
        bool, Query(description="also workers that stopped long ago or were replaced on their host and slice")
    ] = False,
) -> list[dict[str, Any]]:
    return views.workers(all=all)


class ModelRequest(BaseModel):
    """`gpujobs models pull/rm --workers`: which repo, which revision, whose caches."""

    model_config = ConfigDict(extra="forbid")
    repo: str = Field(description="a Hub id, org/name", json_schema_extra={"pattern": HUB_ID.pattern})
    revision: str | None = Field(
        None, description="branch, tag or commit (pull: default main; rm: default every snapshot of the repo)"
    )
    workers: str = Field(
        "all", min_length=1, description="`all`, or worker names separated by commas: their hosts' caches act"
    )


@app.get(
    "/models",
    summary="Hub models in each host's Hugging Face cache: commits, sizes, last use, downloads",
    responses=errors(401, 403, 422, 503),
)
def list_models(
    caller: Caller,
    repo: Annotated[str | None, Query(description="only this Hub id")] = None,
) -> list[dict[str, Any]]:
    return service_models.list_models(repo=repo)


@app.post(
    "/models/pull",
    summary="Ask the hosts of live workers to fetch a Hub model into their cache (admins)",
    responses=errors(400, 401, 403, 409, 422, 503),
)
def pull_models(caller: Caller, body: ModelRequest) -> list[dict[str, Any]]:
    _admin_only(caller, "pull models onto the workers' hosts")
    return service_models.request("pull", repo=body.repo, revision=body.revision, workers=body.workers, by=caller.owner)


@app.post(
    "/models/remove",
    summary="Ask the hosts of live workers to delete a Hub model from their cache (admins)",
    responses=errors(400, 401, 403, 409, 422, 503),
)
def remove_models(caller: Caller, body: ModelRequest) -> list[dict[str, Any]]:
    _admin_only(caller, "remove models from the workers' hosts")
    return service_models.request(
        "remove", repo=body.repo, revision=body.revision, workers=body.workers, by=caller.owner
    )


class QuotaRequest(BaseModel):
    """`gpujobs quota set`: at least one cap; a cap left out stays as it is."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"anyOf": [{"required": [cap]} for cap in scheduling.LIMITS]},
    )

    owner: str = Field(  # the pattern is documented, and checked by scheduling.set_quota, whose error says it
        min_length=1,
        max_length=128,
        json_schema_extra={"pattern": auth.OWNER_PATTERN},
        description="the owner the quota holds for: a name without spaces or control characters, as tokens have",
    )
    max_running_shards: int | None = Field(
        None,
        description="shards of the owner that run at once at most (0 holds new work); null: no cap",
        ge=0,
        le=1_000_000,
    )
    max_gpu_seconds_per_day: float | None = Field(
        None,
        description="GPU-seconds the owner's shards use over the last 24 hours at most (a CPU shard counts 1 a "
        "second); past it new shards wait, running ones finish; null: no cap",
        ge=0,
    )

    @field_validator("max_running_shards", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        return whole_number(value)


@app.get(
    "/quotas",
    summary="Owners' quotas (caps on their running shards and on their GPU-seconds per day), their running and "
    "queued shards and GPU-seconds: every owner with a quota or with work queued or running (admins)",
    responses=errors(401, 403, 503),
)
def list_quotas(caller: Caller) -> list[dict[str, Any]]:
    _admin_only(caller, "read owners' quotas")
    with session_scope() as session:
        return scheduling.quotas(session)


@app.put(
    "/quotas",
    summary="Set an owner's quota (admins): the caps given change (null removes one), the others stay; a quota left "
    "with no cap is removed",
    responses=errors(400, 401, 403, 422, 503),
)
def set_quota(caller: Caller, body: QuotaRequest) -> dict[str, Any]:
    _admin_only(caller, "set quotas")
    limits = body.model_dump(include=body.model_fields_set & set(scheduling.LIMITS))
    with session_scope() as session:
        scheduling.set_quota(session, body.owner, by=caller.owner, **limits)
    with session_scope() as session:
        return scheduling.quota_view(session, body.owner)


def _admin_only(caller, what: str) -> None:
    if not caller.is_admin:
        raise Forbidden(f"only an admin token may {what}: ask an operator, or use a token with the admin scope")
