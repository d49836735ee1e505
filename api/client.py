"""A small typed HTTP client for the jobs API, used by the CLI and usable from scripts and notebooks:

    from api.client import Client
    c = Client()                       # JOBS_API_URL / JOBS_TOKEN, or what `gpujobs up` wrote
    job = c.submit({"model": "/models/m", "input": c.upload("data.jsonl")["id"]})
    c.wait(job["id"]); rows = list(c.results(job["id"]))
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from core import errors
from core.settings import get_settings

TERMINAL = ("succeeded", "failed", "cancelled")
LONG = httpx.Timeout(60.0, read=1800.0)  # uploads and submits of large datasets


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 60.0):
        settings = get_settings()
        self.url = (url or settings.api_url).rstrip("/")
        self.token = token or settings.token
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise errors.ServiceUnavailable(f"cannot reach the jobs API at {self.url} ({exc}): start one with "
                                            "`gpujobs up`, or set JOBS_API_URL") from exc
        if response.status_code >= 400:
            raise _error(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def upload(self, path: str | Path) -> dict[str, Any]:
        with open(path, "rb") as stream:
            return self._json("POST", "/files", files={"file": (Path(path).name, stream)}, timeout=LONG)

    def submit(self, spec: dict[str, Any]) -> dict[str, Any]:
        # a submit parses and stores every row before it answers: minutes for millions of rows
        return self._json("POST", "/jobs", json=spec, timeout=LONG)

    def job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/jobs/{job_id}")

    def jobs(self, *, state: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        params = {"limit": limit} | ({"state": state} if state else {})
        return self._json("GET", "/jobs", params=params)

    def results(self, job_id: str, *, errors: bool = False) -> Iterator[dict[str, Any]]:
        try:
            with self.http.stream("GET", f"/jobs/{job_id}/results", params={"errors": errors}) as response:
                if response.status_code >= 400:
                    response.read()
                    raise _error(response)
                for line in response.iter_lines():
                    if line:
                        yield json.loads(line)
        except httpx.TransportError as exc:
            raise errors_unreachable(self.url, exc) from exc

    def events(self, job_id: str, *, after: int = 0) -> list[dict[str, Any]]:
        return self._json("GET", f"/jobs/{job_id}/events", params={"after": after})

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/cancel")

    def retry(self, job_id: str, *, failed_only: bool = False) -> dict[str, Any]:
        return self._json("POST", f"/jobs/{job_id}/retry", params={"failed_only": failed_only})

    def workers(self) -> list[dict[str, Any]]:
        return self._json("GET", "/workers")

    def usage(self, *, owner: str | None = None, since: str | None = None) -> dict[str, Any]:
        """Per-owner sums (jobs, rows, tokens, GPU- and engine seconds); `since` is 7d, 12h… or an ISO date."""
        params = {k: v for k, v in {"owner": owner, "since": since}.items() if v is not None}
        return self._json("GET", "/usage", params=params)

    def wait(self, job_id: str, *, poll: float = 1.0, timeout: float | None = None,
             on_update: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Poll until the job ends; `on_update` sees every poll (progress bars)."""
        deadline = time.monotonic() + timeout if timeout else None
        while True:
            job = self.job(job_id)
            if on_update:
                on_update(job)
            if job["state"] in TERMINAL:
                return job
            if deadline and time.monotonic() > deadline:
                raise errors.JobsError(f"job {job_id} is still {job['state']} after {timeout} s")
            time.sleep(poll)


def errors_unreachable(url: str, exc: Exception) -> errors.ServiceUnavailable:
    return errors.ServiceUnavailable(f"cannot reach the jobs API at {url} ({exc}): start one with `gpujobs up`")


def _error(response: httpx.Response) -> errors.JobsError:
    """Rebuild our exception type from the API's error body, so the CLI maps it to the same exit code."""
    try:
        body = response.json()["error"]
        kind, message = body["type"], body["message"]
    except (ValueError, KeyError, TypeError):
        kind, message = "JobsError", f"HTTP {response.status_code}: {response.text[:500]}"
        if response.status_code == 422:
            kind = "InvalidInput"
    cls = getattr(errors, kind, errors.JobsError)
    return cls(message) if isinstance(cls, type) and issubclass(cls, errors.JobsError) else errors.JobsError(message)
