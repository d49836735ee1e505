"""A small typed HTTP client for the jobs API, used by the CLI and usable from scripts and notebooks:

    from api.client import Client
    with Client() as c:                                # JOBS_API_URL / JOBS_TOKEN, or what `gpujobs up` wrote
        job = c.submit({"model": "/models/m", "max_new_tokens": 64}, input="data.jsonl")   # uploads the file
        c.wait(job["id"], progress=True)               # a progress line on stderr; or on_update=callback
        for row in c.results(job["id"]):               # finished rows in input order (also while it runs)
            print(row["custom_id"], row["output"])

Every method returns the API's JSON (typed below as TypedDicts: `Job`, `Result`) and raises the exception types of
`core.errors` (`InvalidInput`, `NotFound`, `ServiceUnavailable`, …) with the server's message.
"""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypedDict

import httpx

from api.packing import pack_saved_dataset, spooled
from core import errors
from core.settings import get_settings

TERMINAL = ("succeeded", "failed", "cancelled")
LONG = httpx.Timeout(60.0, read=1800.0)  # uploads and submits of large datasets
JOB_ID = re.compile(r"job_[0-9a-f]{12}")  # core.store.new_id's; an adapter's id is its fine-tune's job id


class Rows(TypedDict):
    total: int
    succeeded: int
    failed: int
    pending: int


class Job(TypedDict, total=False):
    """GET /jobs/{id}: the fields scripts use most (the API sends more: metrics, load_options, versions…)."""

    id: str
    kind: str
    state: str  # queued, validating, running, finalizing, succeeded, failed, cancelling, cancelled
    owner: str
    model: str
    rows: Rows
    tokens: dict[str, int]  # prompt, completion
    live: dict[str, Any]  # while it runs: rows_per_s, tokens_per_s, eta_s
    metrics: dict[str, Any]
    error: str | None
    priority: str  # low, normal, high
    scheduling: dict[str, Any]  # while shards are queued: position, shards_ahead, shards_queued, waiting (a reason)
    created_at: float
    started_at: float | None
    finished_at: float | None


class Result(TypedDict, total=False):
    """One line of GET /jobs/{id}/results (plus the row's own pass-through keys)."""

    custom_id: str
    line: int
    prompt: str  # with with_input=True (or messages: a list)
    output: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str  # with errors=True


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 60.0):
        settings = get_settings()
        self.url = checked_url((url or settings.api_url).rstrip("/"))
        self.token = token or settings.token
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)
        self._fresh: list[str] | None = None  # inside `removed_if_refused`: the file ids uploaded there

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise errors_unreachable(self.url, exc) from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return _body(self._request(method, path, **kwargs))

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def upload(self, path: str | Path) -> dict[str, Any]:
        """Store a local file (or a `save_to_disk` directory, packed into one zip; or what a pipe such as /dev/stdin
        holds) on the server; its `id` names it in a spec."""
        path = Path(path)
        if path.is_dir():
            with pack_saved_dataset(path) as packed:
                return self.upload(packed)
        if path.exists() and not path.is_file():  # a pipe: /dev/stdin, `<(…)`
            with spooled(path) as copy:
                return self.upload(copy)
        with open(path, "rb") as stream:
            file = self._json("POST", "/files", files={"file": (path.name, stream)}, timeout=LONG)
        if self._fresh is not None:
            self._fresh.append(file["id"])
        return file

    def delete_file(self, file_id: str) -> dict[str, Any]:
        """Delete a stored file of yours that no live job reads (the OpenAI-compatible `DELETE /v1/files/{id}`)."""
        return self._json("DELETE", f"/v1/files/{file_id}")

    @contextlib.contextmanager
    def removed_if_refused(self) -> Iterator[None]:
        """Files uploaded inside the block are deleted again when the block raises a refusal (a 4xx: bad input,
        no worker can run it, no access), so a refused submit leaves no upload behind. Other errors keep them:
        after a lost connection or a server error the job may exist and read them."""
        self._fresh = fresh = []
        try:
            yield
        except errors.JobsError as exc:
            if 400 <= exc.http_status < 500:
                for file_id in fresh:
                    # the refusal is what the caller must see; an upload that could not be removed is only clutter
                    with contextlib.suppress(errors.JobsError):
                        self.delete_file(file_id)
            raise
        finally:
            self._fresh = None

    def submit(self, spec: dict[str, Any], *, input: str | Path | None = None, priority: str | None = None) -> Job:
        """Submit a job. `input` (optional) is a local dataset (JSONL, OpenAI batch lines, CSV, Parquet, or a
        `save_to_disk` directory), uploaded first and deleted again if the submit is refused; otherwise
        `spec["input"]` names a file id or a server path. `priority` (low, normal, high; or `spec["priority"]`)
        orders queued work; high needs a token with the priority or admin scope. A dataset in which no row can run
        is refused (InvalidInput), like any bad spec: no job is made."""
        if priority is not None:
            spec = {**spec, "priority": priority}
        with self.removed_if_refused():
            if input is not None:
                if not Path(input).exists():
                    raise errors.InvalidInput(
                        f"input {str(input)!r} is not a local file or directory: give the path of a dataset "
                        "(JSONL, CSV, Parquet or a save_to_disk directory), or put a file id / server path in "
                        "spec['input']"
                    )
                spec = {**spec, "input": self.upload(input)["id"]}
            # a submit parses and stores every row before it answers: minutes for millions of rows
            return self._json("POST", "/jobs", json=spec, timeout=LONG)

    def job(self, job_id: str) -> Job:
        return self._json("GET", f"/jobs/{job_path(job_id)}")

    status = job  # `gpujobs status`

    def jobs(self, *, state: str | None = None, limit: int = 50) -> list[Job]:
        """The newest `limit` jobs (`jobs_page` also says whether more exist)."""
        return self.jobs_page(state=state, limit=limit)[0]

    def jobs_page(
        self, *, state: str | None = None, limit: int = 50, after: str | None = None
    ) -> tuple[list[Job], bool]:
        """The newest `limit` jobs (after the job `after`: the next page), and whether older ones exist beyond."""
        params = {"limit": limit} | ({"state": state} if state else {}) | ({"after": job_path(after)} if after else {})
        return self._page("/jobs", params)

    def _page(self, path: str, params: dict[str, Any]) -> tuple[list[Any], bool]:
        response = self._request("GET", path, params=params)
        return _body(response), response.headers.get("X-Has-More") == "true"

    def results(self, job_id: str, *, errors: bool = False, with_input: bool = False) -> Iterator[Result]:
        """Finished rows (failed rows with `errors`) in input order, also while the job runs; `with_input` puts
        each row's `prompt` (or `messages`) beside its output."""
        params = {"errors": errors} | ({"with_input": True} if with_input else {})
        try:
            with self.http.stream("GET", f"/jobs/{job_path(job_id)}/results", params=params) as response:
                if response.status_code >= 400 or _media_type(response) == "text/html":
                    response.read()
                    raise _error(response)
                for line in response.iter_lines():
                    if line:
                        yield json.loads(line)
        except httpx.TransportError as exc:
            raise errors_unreachable(self.url, exc) from exc

    def download(
        self,
        job_id: str,
        *,
        format: str = "jsonl",
        errors: bool = False,
        order: str = "input",
        with_input: bool = False,
    ) -> Iterator[bytes]:
        """The results file as bytes, chunk by chunk: `format` jsonl, openai (the OpenAI Batch output file, or
        its error file with `errors`), csv or parquet; `order` input or finished; `with_input` puts each row's
        prompt (or messages) beside its output."""
        params = {"errors": errors, "format": format, "order": order} | ({"with_input": True} if with_input else {})
        try:
            with self.http.stream("GET", f"/jobs/{job_path(job_id)}/results", params=params, timeout=LONG) as response:
                if response.status_code >= 400 or _media_type(response) == "text/html":  # a page: not our results
                    response.read()
                    raise _error(response)
                yield from response.iter_bytes()
        except httpx.TransportError as exc:
            raise errors_unreachable(self.url, exc) from exc

    def events(
        self, job_id: str, *, after: int = 0, limit: int = 500, run: int | str | None = None, superseded: bool = False
    ) -> list[dict[str, Any]]:
        """One page of a job's events after event id `after`, oldest first (`all_events` reads every page): of
        one run (its number, or "current"; None: every run), with `superseded` also the step events a resumed
        fine-tune ran again."""
        return self.events_page(job_id, after=after, limit=limit, run=run, superseded=superseded)[0]

    def events_page(
        self, job_id: str, *, after: int = 0, limit: int = 500, run: int | str | None = None, superseded: bool = False
    ) -> tuple[list[dict[str, Any]], bool]:
        """One page of events after `after`, and whether more exist after it (ask again from its last id)."""
        params = {"after": after, "limit": limit, "superseded": superseded} | ({"run": run} if run else {})
        return self._page(f"/jobs/{job_path(job_id)}/events", params)

    def all_events(
        self, job_id: str, *, after: int = 0, run: int | str | None = None, superseded: bool = False
    ) -> Iterator[dict[str, Any]]:
        """Every event after `after` that exists now, page by page."""
        while True:
            page, more = self.events_page(job_id, after=after, run=run, superseded=superseded)
            yield from page
            if not more or not page:
                return
            after = page[-1]["id"]

    def cancel(self, job_id: str) -> Job:
        return self._json("POST", f"/jobs/{job_path(job_id)}/cancel")

    def retry(self, job_id: str, *, failed_only: bool = False) -> Job:
        return self._json("POST", f"/jobs/{job_path(job_id)}/retry", params={"failed_only": failed_only})

    def dashboard_url(self) -> str:
        """A URL that opens the dashboard signed in with this client's token, once, within a minute: it carries a
        one-time code in its fragment, never the token (api/dashboard.py says why)."""
        code = self._json("POST", "/dashboard/codes")["code"]
        return f"{self.url}/dashboard#code={code}"

    def quotas(self) -> list[dict[str, Any]]:
        """Owners' quotas, running and queued shards and recent GPU-seconds (admins)."""
        return self._json("GET", "/quotas")

    def set_quota(self, owner: str, **limits: int | float | None) -> dict[str, Any]:
        """Set `owner`'s caps (admins only): `max_running_shards` (shards run at once) and/or
        `max_gpu_seconds_per_day`; None removes a cap, a cap not given stays as it is."""
        return self._json("PUT", "/quotas", json={"owner": owner, **limits})

    def workers(self, *, all: bool = False) -> list[dict[str, Any]]:
        """Registered workers; `all`: also those stopped long ago or replaced on their host and slice."""
        return self._json("GET", "/workers", params={"all": all} if all else None)

    def adapters(self, *, limit: int = 100) -> list[dict[str, Any]]:
        """Registered LoRA adapters (id = the fine-tune job that made it), newest first."""
        return self.adapters_page(limit=limit)[0]

    def adapters_page(self, *, limit: int = 100, after: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        """The newest `limit` adapters (after the adapter `after`: the next page), and whether older ones exist."""
        return self._page("/adapters", {"limit": limit} | ({"after": job_path(after, "adapter")} if after else {}))

    def adapter(self, adapter_id: str) -> dict[str, Any]:
        return self._json("GET", f"/adapters/{job_path(adapter_id, 'adapter')}")

    def models(self, *, repo: str | None = None) -> list[dict[str, Any]]:
        """Hub models in each host's cache (and downloads or requests in flight)."""
        return self._json("GET", "/models", params={"repo": repo} if repo else {})

    def pull_models(self, repo: str, *, revision: str | None = None, workers: str = "all") -> list[dict[str, Any]]:
        """Ask the hosts of live workers to fetch `repo` (admins); returns one request row per host cache."""
        return self._json("POST", "/models/pull", json={"repo": repo, "revision": revision, "workers": workers})

    def remove_models(self, repo: str, *, revision: str | None = None, workers: str = "all") -> list[dict[str, Any]]:
        """Ask the hosts of live workers to delete `repo` (one revision, or all) from their cache (admins)."""
        return self._json("POST", "/models/remove", json={"repo": repo, "revision": revision, "workers": workers})

    def usage(self, *, owner: str | None = None, since: str | None = None) -> dict[str, Any]:
        """Per-owner sums (jobs, rows, tokens, GPU- and engine seconds); `since` is 7d, 12h… or an ISO date."""
        params = {k: v for k, v in {"owner": owner, "since": since}.items() if v is not None}
        return self._json("GET", "/usage", params=params)

    def wait(
        self,
        job_id: str,
        *,
        poll: float = 1.0,
        timeout: float | None = None,
        on_update: Callable[[Job], None] | None = None,
        progress: bool = False,
    ) -> Job:
        """Poll until the job ends and return it; `on_update` sees every poll (progress bars), `progress=True`
        prints one updating line on stderr. Raises WaitTimeout after `timeout` seconds (the job keeps running)."""
        deadline = None if timeout is None else time.monotonic() + timeout  # 0: one look
        while True:
            job = self.job(job_id)
            if on_update:
                on_update(job)
            if progress:
                print_progress(job)
            if job["state"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise errors.WaitTimeout(
                    f"job {job_id} is still {job['state']} after {timeout} s: wait again, or `gpujobs cancel {job_id}`"
                )
            time.sleep(poll)


def job_path(job_id: str, what: str = "job") -> str:
    """`job_id` as it goes into a URL, once it is a job id: an empty $ID (a submit that failed) or a path such as
    `../workers` would otherwise reach another route, whose answer a script would take for the job's."""
    if not isinstance(job_id, str) or not JOB_ID.fullmatch(job_id):
        hint = ": the variable that should hold it is empty" if job_id == "" else ""
        raise errors.InvalidInput(
            f"{job_id!r} is not {'an adapter' if what == 'adapter' else 'a job'} id (job_ and 12 hex digits, as "
            f"`gpujobs submit` prints){hint}"
        )
    return job_id


def checked_url(url: str) -> str:
    """The API's URL once it is an http(s) URL with a host: a mistyped one (`127.0.0.1:8765`, `http://[::1`) is
    the caller's mistake (InvalidInput), said once, rather than httpx's traceback or a "cannot reach" that sends
    them to start a server."""
    try:
        parsed = httpx.URL(url)
        problem = (
            None if parsed.scheme in ("http", "https") and parsed.host else "it needs http:// or https:// and a host"
        )
    except httpx.InvalidURL as exc:
        problem = str(exc)
    if problem:
        raise errors.InvalidInput(
            f"{url!r} is not a URL of the jobs API ({problem}): give http://HOST:PORT, e.g. http://127.0.0.1:8765, "
            "in --api-url or JOBS_API_URL"
        )
    return url


def print_progress(job: Job) -> None:
    rows = job["rows"]
    done = rows["succeeded"] + rows["failed"]
    rate = (job.get("live") or {}).get("tokens_per_s")
    line = f"\r{job['id']} {job['state']:<10} {done}/{rows['total']} rows" + (f", {rate} tok/s" if rate else "")
    end = "\n" if job["state"] in TERMINAL else ""
    print(line, end=end, file=sys.stderr, flush=True)


def errors_unreachable(url: str, exc: Exception) -> errors.ServiceUnavailable:
    """One message for every request, streamed or not: where the API should be, and both ways to put it there."""
    return errors.ServiceUnavailable(
        f"cannot reach the jobs API at {url} ({exc}): start one with `gpujobs up`, or set JOBS_API_URL"
    )


# Our exception type by status, for an error in OpenAI's shape (under /v1: api/openai_api.py), whose type is OpenAI's
BY_STATUS = {
    400: "InvalidInput",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    413: "TooLarge",
    503: "ServiceUnavailable",
}


def _body(response: httpx.Response) -> Any:
    """A success's JSON body; a body that is no JSON comes from another server than the jobs API."""
    try:
        return response.json()
    except ValueError:
        raise _not_the_api(response) from None


def _media_type(response: httpx.Response) -> str:
    return response.headers.get("content-type", "").split(";")[0].strip().lower()


def _not_the_api(response: httpx.Response) -> errors.ServiceUnavailable:
    """An answer that is not the jobs API's (every error of the API has a JSON body with `error`): a proxy in front of
    an API that is down (502, 503, 504), or another server at the URL (an HTML page, a 404 of its own). The jobs API
    was not reached there (exit 3); the URL and what to check are said, not the page, which a terminal cannot show."""
    request = response.request
    return errors.ServiceUnavailable(
        f"{request.method} {request.url} answered HTTP {response.status_code} "
        f"({_media_type(response) or 'no content type'}), which is not the jobs API's answer: check that "
        "--api-url / JOBS_API_URL is the jobs API's address and that the API runs there (`gpujobs up` starts one)"
    )


def _error(response: httpx.Response) -> errors.JobsError:
    """Rebuild our exception type from the API's error body, so the CLI maps it to the same exit code."""
    try:
        body = response.json()["error"]
        kind, message = body["type"], body["message"]
        if "code" in body:  # OpenAI's body: its type says little, its status what ours would have said
            kind = BY_STATUS.get(response.status_code, "JobsError")
    except (ValueError, KeyError, TypeError):
        if response.status_code == 422:  # a request refused as FastAPI refuses one: ours, from an older API
            return errors.InvalidInput(f"HTTP 422: {response.text[:500]}")
        return _not_the_api(response)
    cls = getattr(errors, kind, errors.JobsError)
    return cls(message) if isinstance(cls, type) and issubclass(cls, errors.JobsError) else errors.JobsError(message)
