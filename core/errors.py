"""The small exception tree. Edges translate these: the CLI to exit codes, the API to HTTP statuses.

Every message says what was wrong and what to do about it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class JobsError(Exception):
    """Base of every error we raise on purpose. `param`: the request field at fault, where one is (OpenAI's error
    body names it: api/openai_api.py)."""

    http_status = 500

    def __init__(self, *args: object, param: str | None = None):
        super().__init__(*args)
        self.param = param


class InvalidInput(JobsError):
    """A spec, a dataset or a request that cannot be accepted as it is."""

    http_status = 422


class FieldError(ValueError):
    """A ValueError that names the field at fault (`param`, as a JobsError's), for the checks that report through
    ValueError: an OpenAI batch line's (core/openai_batch.py) and a row's (core/dataset.py), whose failed row keeps
    it (`ParsedRow.param`)."""

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class NotFound(JobsError):
    http_status = 404


class Forbidden(JobsError):
    http_status = 403


class Unauthorized(JobsError):
    http_status = 401


class Conflict(JobsError):
    """The thing exists but is in a state that does not allow the operation."""

    http_status = 409


CANNOT_TRAIN = "cannot train as submitted"


class CannotTrain(InvalidInput):
    """The worker refuses a fine-tune for its spec and input alone, before any step (target modules the model
    lacks, rows longer than max_seq_length, no token to learn, ...): the same spec on the same rows is refused the
    same way on every run, so `retry` refuses it (`core.dataset.retry_can_change`) and says to submit a new job.

    The mark is the message's stable prefix, CANNOT_TRAIN, not the class: a retry sees only the error stored with
    the job's rows, and the prefix also survives a distributed rank's error file (worker/training/distributed.py).
    Failures that may pass (out of memory, a lost worker, the Hub, a package or GPU this worker lacks) are never
    this: they stay retryable."""

    def __init__(self, reason: str):
        super().__init__(reason if reason.startswith(CANNOT_TRAIN) else f"{CANNOT_TRAIN}: {reason}")


class NoSuchPath(InvalidInput):
    """A path the request names (a model directory, a dataset on the server) does not exist: 404, as for an id
    that names nothing; still the caller's mistake, so the CLI exits 2 (usage)."""

    http_status = 404


class TooLarge(InvalidInput):
    """An upload over the server's size limit (JOBS_MAX_UPLOAD_BYTES)."""

    http_status = 413


class Unschedulable(JobsError):
    """No live worker can run this job (missing GPUs, backends or packages). A 409: the request is valid, the
    cluster's current state cannot serve it (the same spec passes once such a worker runs)."""

    http_status = 409


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


class NothingToRetry(IllegalTransition):
    """A retry of a finished job that has no row a retry could change (none failed, or each failed for its input):
    the job's state, not the request, is in the way (409); the CLI exits 2, as for a usage error."""


class BatchExpired(NothingToRetry):
    """A retry of an OpenAI batch whose completion window has passed: a batch never runs past its `expires_at`
    (OpenAI's `expired` is final), so nothing in it can run again (409; the CLI exits 2, as for NothingToRetry)."""


class NotFinished(IllegalTransition):
    """An operation that needs a finished job (retry) asked of a live one: the caller's mistake, so the CLI exits 2
    (usage) rather than 1, which scripts read as "the job failed"."""


class WrongKind(Conflict):
    """An operation of one kind of job asked of another (the generated rows of a fine-tune): the job, not the
    request's form, is in the way (409, as for a job in the wrong state); the CLI exits 2, as for a usage error."""


class WaitTimeout(JobsError):
    """A wait gave up after its timeout; the job goes on. The CLI exits 124 (as `timeout(1)` does)."""

    http_status = 504


class WaitInterrupted(JobsError):
    """Ctrl-C (SIGINT) stopped a wait or a follow; the job goes on. The CLI exits 130 (128 + SIGINT, as a shell
    reports a command that SIGINT ended), not 1, which scripts read as "the job failed"."""


class LeaseLost(JobsError):
    """This worker no longer holds the shard's lease: someone else owns the work now."""


class FetchInterrupted(LeaseLost):
    """A Hub fetch was stopped: the job was cancelled, or the worker is shutting down (core/hub_download.py)."""


class RegistryError(JobsError):
    """A trained adapter failed the registry's check (it does not load onto its base, or cannot generate)."""


class GpuConflict(JobsError):
    """The inherited CUDA_VISIBLE_DEVICES contradicts the requested slice (api/stack.py)."""


class WrongArtifacts(JobsError):
    """This process's JOBS_ARTIFACTS is not the store's artifacts directory (core/artifacts.py): a worker refuses to
    start (exit 78, core/exits.py), `gpujobs up` and the API too (the CLI exits 2, a setting to fix)."""


class StartInterrupted(JobsError):
    """SIGINT, SIGTERM or SIGHUP arrived while the stack was starting (what was started is stopped)."""


@contextmanager
def naming(param: str) -> Iterator[None]:
    """A request's fault raised inside (invalid, not found, forbidden) names the field `param` unless it names one
    already: the submit checks of a spec field (api/checks.py), which /v1 answers with OpenAI's `param`."""
    try:
        yield
    except (InvalidInput, NotFound, Forbidden) as exc:
        exc.param = exc.param or param
        raise


class PortInUse(RuntimeError):
    """redis-server could not bind its TCP port: another process listens there (core/embedded.py tries another).
    Not a JobsError: it never reaches a user."""


class ChildFailed(RuntimeError):
    """A process of a distributed fine-tune failed; the message carries its error text
    (worker/training/distributed.py). Not a JobsError: it fails the attempt like any engine error."""
