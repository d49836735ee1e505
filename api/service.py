"""The service behind the HTTP API and the CLI: what changes jobs and files. Thin: checks (api/checks.py), then
one call into core's lifecycle (core/jobs.py), then a view (api/views.py). Reads are in api/views.py and
api/results.py. No torch, no worker code.

`owner=None` means an admin: every job is visible. Otherwise another owner's job or file answers 404, as if it
did not exist.
"""

from __future__ import annotations

from typing import Any

from api import checks, views
from core import files, jobs
from core.db import session_scope


def submit(
    *, owner: str, spec_data: dict[str, Any], admin: bool = False, may_prioritize: bool = False
) -> dict[str, Any]:
    """Check, store the job and its rows, then enqueue its shards. Nothing is written if a check fails.

    A generation job whose `adapter` names a fine-tune still running waits, queued without shards, for its
    adapter (`core.adapters`). A fine-tune's `then_generate` is submitted like any spec, naming the fine-tune as
    its adapter. `admin` lets an admin's job use another owner's adapter; `may_prioritize` lets it be `high`
    (api/checks.py)."""
    return views.get(_submit(owner, spec_data, admin, may_prioritize), owner=None)


def _submit(owner: str, spec_data: Any, admin: bool, may_prioritize: bool) -> str:
    new = checks.submission(owner, spec_data, admin=admin, may_prioritize=may_prioritize)
    return jobs.submit(new, chain=lambda chained: _submit(owner, chained, admin, may_prioritize))


def cancel(job_id: str, *, owner: str | None, by: str) -> dict[str, Any]:
    jobs.cancel(job_id, owner=owner, by=by)
    return views.get(job_id, owner=owner)


def retry(job_id: str, *, owner: str | None, failed_only: bool, by: str) -> dict[str, Any]:
    """Re-open a finished job under the same id and re-run its failed (and, unless failed_only, unfinished) rows
    (`core.jobs.retry`)."""
    jobs.retry(job_id, owner=owner, failed_only=failed_only, by=by)
    return views.get(job_id, owner=owner)


def store_upload(*, owner: str, filename: str, stream) -> dict[str, Any]:
    with session_scope() as session:
        return views.file_view(files.save(session, owner=owner, filename=filename, stream=stream))
