"""Request bodies are bounded and, past a small size, need a valid token before a byte of them is read.

FastAPI reads and parses a route's body (a multipart upload spooled to disk, a JSON body into memory) before it
resolves the route's dependencies, the bearer token among them, and an upload's size was checked only while it was
copied into the store: anyone who could reach the port could fill the API host's temporary disk or memory without a
token, and a 50 GB upload over JOBS_MAX_UPLOAD_BYTES was refused only once all of it had arrived. This middleware
answers first:

- A body whose Content-Length is over its limit is refused (413) at once: uploads (`POST /files`, `/v1/files`) may
  be JOBS_MAX_UPLOAD_BYTES plus the multipart framing, every other body `JSON_LIMIT` (a job spec, a batch, a quota:
  kilobytes; a JSON schema in a spec may be large, never 16 MiB). A body sent without a length (chunked) is
  counted as it is read, and the request answered 413 once it passes the limit.
- A body over `OPEN_LIMIT`, or of unknown length, is read only after its token passes the same check the routes
  make (`api.access.principal`): 401 or 403 otherwise. The one route that takes a body without a token (`POST
  /dashboard/session`, a sign-in code) takes a few bytes.

The routes' own checks stay as they are (a token on every request, core/files.py's size while copying): this only
answers sooner, and under /v1 in OpenAI's error shape, as the routes there answer.
"""

from __future__ import annotations

from fastapi.security import HTTPAuthorizationCredentials
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api import openai_api
from api.access import principal
from core.errors import JobsError, TooLarge
from core.settings import get_settings

UPLOADS = ("/files", "/v1/files")
MULTIPART = 1 << 20  # an upload's framing beside its file: part headers, boundaries, a `purpose` field
JSON_LIMIT = 16 << 20
OPEN_LIMIT = 64 << 10  # larger bodies need a valid token before they are read


class BodyGuard:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        upload = scope["path"] in UPLOADS
        limit = get_settings().max_upload_bytes + MULTIPART if upload else JSON_LIMIT
        length = headers.get("content-length")
        size = int(length) if length and length.isdigit() else None  # the server refused a malformed one
        if size is not None and size > limit:
            await error_response(too_large(upload, limit), scope["path"])(scope, receive, send)
            return
        if size is None or size > OPEN_LIMIT:
            try:
                await run_in_threadpool(principal, bearer(headers.get("authorization")))
            except JobsError as exc:
                await error_response(exc, scope["path"])(scope, receive, send)
                return
        await Counted(self.app, limit, upload)(scope, receive, send)


class Counted:
    """The app, fed the body while it stays within `limit`: past it the app reads the end of the body (the client
    is gone, as far as it can tell) and whatever it answers is replaced by the 413."""

    def __init__(self, app: ASGIApp, limit: int, upload: bool):
        self.app, self.limit, self.upload, self.seen, self.over, self.started = app, limit, upload, 0, False, False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            if self.over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.seen += len(message.get("body", b""))
                if self.seen > self.limit:
                    self.over = True
                    return {"type": "http.disconnect"}
            return message

        async def answer(message: Message) -> None:
            if not self.over:
                self.started = True
                await send(message)
            elif message["type"] == "http.response.start" and not self.started:
                self.started = True
                await error_response(too_large(self.upload, self.limit), scope["path"])(scope, receive, send)

        await self.app(scope, counted, answer)
        if self.over and not self.started:  # the app gave up without answering (a disconnect mid-body)
            await error_response(too_large(self.upload, self.limit), scope["path"])(scope, receive, send)


def bearer(header: str | None) -> HTTPAuthorizationCredentials | None:
    scheme, _, secret = (header or "").partition(" ")
    return (
        HTTPAuthorizationCredentials(scheme=scheme, credentials=secret.strip()) if scheme.lower() == "bearer" else None
    )


def too_large(upload: bool, limit: int) -> TooLarge:
    if upload:
        return TooLarge(
            f"the upload is larger than the upload limit of {get_settings().max_upload_bytes} bytes "
            "(JOBS_MAX_UPLOAD_BYTES): split the dataset into several jobs"
        )
    return TooLarge(f"the request body is over {limit} bytes: a job spec or request holds settings, not data")


def error_response(exc: JobsError, path: str) -> JSONResponse:
    """The answer to `exc`, here and in app.py's handler of every JobsError: our error body, or OpenAI's under /v1
    (api/openai_api.py), whose clients read only that."""
    if openai_api.serves(path):
        response = openai_api.error(exc.http_status, str(exc), param=exc.param)
    else:
        content = {"error": {"type": type(exc).__name__, "message": str(exc)}}
        response = JSONResponse(status_code=exc.http_status, content=content)
    if exc.http_status == 401:
        response.headers["WWW-Authenticate"] = "Bearer"  # RFC 9110: a 401 names the scheme that would pass
    return response
