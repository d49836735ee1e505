"""The small exception tree. Edges translate these: the CLI to exit codes, the API to HTTP statuses.

Every message says what was wrong and what to do about it.
"""

from __future__ import annotations


class JobsError(Exception):
    """Base of every error we raise on purpose."""

    http_status = 500


class InvalidInput(JobsError):
    """A spec, a dataset or a request that cannot be accepted as it is."""

    http_status = 422


class NotFound(JobsError):
    http_status = 404


class Forbidden(JobsError):
    http_status = 403


class Unauthorized(JobsError):
    http_status = 401


class Conflict(JobsError):
    """The thing exists but is in a state that does not allow the operation."""

    http_status = 409


class Unschedulable(JobsError):
    """No live worker can run this job (missing GPUs, backends or packages)."""

    http_status = 422


class ServiceUnavailable(JobsError):
    """Redis or the database cannot be reached."""

    http_status = 503


class NoAccess(InvalidInput):
    """The Hub refused a repo to a process without a token (gated, private, or missing: it does not say which)."""


class HubUnreachable(ServiceUnavailable):
    """The Hugging Face Hub (or the mirror HF_ENDPOINT names) cannot be reached, or answered with a server error."""


class ChecksumMismatch(JobsError):
    """A downloaded file's content does not match the hash the Hub lists for it (fetched again once, then this)."""


class IllegalTransition(Conflict):
    """A state change that the state machine does not allow, or that lost a race."""


class LeaseLost(JobsError):
    """This worker no longer holds the shard's lease: someone else owns the work now."""
