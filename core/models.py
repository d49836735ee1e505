"""SQLAlchemy 2 models: the whole store. Schemas are built only by the Alembic migrations in `migrations/`.

Times are Unix seconds (float, UTC) written by the process that makes the change. Leases compare the
reaper's clock with the holder's: hosts of one cluster must keep their clocks in sync (NTP), and the
lease length (20 s by default) is far above usual skew. Floats keep lease arithmetic and metrics trivial and
behave the same on SQLite and Postgres.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from core.states import JobState, RowState, ShardState


class Base(DeclarativeBase):
    type_annotation_map = {dict[str, Any]: JSON, list[Any]: JSON}


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16))
    state: Mapped[str] = mapped_column(String(16), default=JobState.queued.value)
    owner: Mapped[str] = mapped_column(String(128))
    spec: Mapped[dict[str, Any]]
    input_file_id: Mapped[str | None] = mapped_column(String(40))
    queue: Mapped[str] = mapped_column(String(32))
    gpus: Mapped[int] = mapped_column(Integer)
    rows_total: Mapped[int] = mapped_column(Integer, default=0)
    rows_succeeded: Mapped[int] = mapped_column(Integer, default=0)
    rows_failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    load_options: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    versions: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)
    retries: Mapped[int] = mapped_column(Integer, default=0)
    # 0 low, 1 normal, 2 high (0008; core/scheduling.py): an integer so that the claim orders by it
    priority: Mapped[int] = mapped_column(Integer, default=1, server_default="1")

    __table_args__ = (
        Index("ix_jobs_owner_created", "owner", "created_at"),
        Index("ix_jobs_state", "state"),
        Index("ix_jobs_queue_priority", "queue", "priority", "owner", "created_at"),
    )


class Shard(Base):
    __tablename__ = "shards"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)
    row_start: Mapped[int] = mapped_column(Integer)
    row_end: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=ShardState.queued.value)
    lease_owner: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[float | None] = mapped_column(Float)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer)
    enqueued_at: Mapped[float | None] = mapped_column(Float)
    queued_at: Mapped[float | None] = mapped_column(Float)  # when it last became queued (0009): how long it waits
    yielded_at: Mapped[float | None] = mapped_column(Float)  # when it last yielded to waiting work (0009)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    rows_done: Mapped[int] = mapped_column(Integer, default=0)
    rows_failed: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    error: Mapped[str | None] = mapped_column(Text)

    __table_args__ = (
        Index("ix_shards_job_state", "job_id", "state"),
        Index("ix_shards_state_lease", "state", "lease_expires_at"),
        Index("ix_shards_finished_at", "finished_at"),  # owners' recent GPU-seconds (core/scheduling.py)
    )


class JobRow(Base):
    """One input row and, once run, its result. Written idempotently on (job_id, idx)."""

    __tablename__ = "job_rows"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    idx: Mapped[int] = mapped_column(Integer, primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(255))
    line: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16), default=RowState.pending.value)
    input: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # JSON, not text: generated text may hold NUL characters, which Postgres text columns refuse
    output: Mapped[str | None] = mapped_column(JSON)
    finish_reason: Mapped[str | list[str] | None] = mapped_column(JSON)  # a list with num_return_sequences > 1
    # per output: its tokens' logprobs, compact (core/logprob_store.py; rows before it: OpenAI's chat shape); null
    # unless asked (0010)
    logprobs: Mapped[list[Any] | None] = mapped_column(JSON)
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    error: Mapped[str | None] = mapped_column(Text)
    executions: Mapped[int] = mapped_column(Integer, default=0)
    worker: Mapped[str | None] = mapped_column(String(255))
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (Index("ix_job_rows_job_state", "job_id", "state"),)


class JobEvent(Base):
    """A state change, a log line or a metric of a job, in order of `id`.

    `run` (0007) is the job's run it was written in (`jobs.retries + 1`: 1, then one more per retry); `superseded`
    marks a fine-tune's step events that a resume from an earlier checkpoint ran again (the current view hides them).
    """

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    shard_id: Mapped[int | None] = mapped_column(Integer)
    ts: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(16))
    level: Mapped[str] = mapped_column(String(8), default="info")
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    run: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    superseded: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

    __table_args__ = (Index("ix_job_events_job_id", "job_id", "id"),)


class Worker(Base):
    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    slice: Mapped[str] = mapped_column(String(255))
    queues: Mapped[list[Any]]
    gpus: Mapped[list[Any]]
    capabilities: Mapped[dict[str, Any]]
    state: Mapped[str] = mapped_column(String(16))
    started_at: Mapped[float] = mapped_column(Float)
    heartbeat_at: Mapped[float] = mapped_column(Float)
    current_shard_id: Mapped[int | None] = mapped_column(Integer)
    # why a worker stopped or was stopped (0005): written by the worker on its way out (a stall, a slice it cannot
    # see) and by the supervisor that saw it exit (`gpujobs up`); `restarts` counts the supervisor's restarts of
    # this worker's slot before this process
    stopped_at: Mapped[float | None] = mapped_column(Float)
    exit_code: Mapped[int | None] = mapped_column(Integer)
    reason: Mapped[str | None] = mapped_column(Text)
    restarts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class ShardRun(Base):
    """One ended attempt of a shard (0009): who ran it, on how many GPUs (`weight`: a CPU shard counts 1), from when
    to when, and how it ended (the shard's next state: succeeded, failed, cancelled, or queued when it was handed
    back, yielded or its lease expired). Owners' GPU-seconds are summed from these and the shards running now."""

    __tablename__ = "shard_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    shard_id: Mapped[int] = mapped_column(ForeignKey("shards.id", ondelete="CASCADE"))
    owner: Mapped[str] = mapped_column(String(128))
    weight: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float] = mapped_column(Float)
    ended_as: Mapped[str] = mapped_column(String(16))

    __table_args__ = (
        Index("ix_shard_runs_owner_ended", "owner", "ended_at"),
        Index("ix_shard_runs_shard", "shard_id"),
    )


class Quota(Base):
    """An owner's limits (0008, 0009; core/scheduling.py): at most `max_running_shards` of its shards run at once,
    and at most `max_gpu_seconds_per_day` GPU-seconds over the last 24 hours (None: no cap). Set by an admin
    (`gpujobs quota set`); an owner without a row has no limits."""

    __tablename__ = "quotas"

    owner: Mapped[str] = mapped_column(String(128), primary_key=True)
    max_running_shards: Mapped[int | None] = mapped_column(Integer)
    max_gpu_seconds_per_day: Mapped[float | None] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    updated_by: Mapped[str | None] = mapped_column(String(128))


class File(Base):
    """A stored file: an uploaded input, a result export or an artifact such as an adapter."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    owner: Mapped[str] = mapped_column(String(128))
    filename: Mapped[str] = mapped_column(String(255))
    purpose: Mapped[str] = mapped_column(String(32))
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    job_id: Mapped[str | None] = mapped_column(String(40))

    __table_args__ = (Index("ix_files_owner", "owner"),)


class Token(Base):
    """An API token, stored as its SHA-256 only. Scopes: `user`, `admin`, `metrics` (comma separated)."""

    __tablename__ = "tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    sha256: Mapped[str] = mapped_column(String(64), unique=True)
    owner: Mapped[str] = mapped_column(String(128))
    scopes: Mapped[str] = mapped_column(String(128))
    name: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[float] = mapped_column(Float)
    revoked_at: Mapped[float | None] = mapped_column(Float)


class Adapter(Base):
    """A LoRA adapter made by a fine-tune job: stored under the artifacts dir and checked to load onto its base.

    Its id is the fine-tune job's id (one adapter per job), so `adapter: <job id>` in a generation spec names it.
    """

    __tablename__ = "adapters"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    owner: Mapped[str] = mapped_column(String(128))
    base_model: Mapped[str] = mapped_column(Text)
    base_revision: Mapped[str | None] = mapped_column(String(255))
    tokenizer: Mapped[str] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    lora_config: Mapped[dict[str, Any]]
    load_options: Mapped[dict[str, Any]]
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (Index("ix_adapters_owner", "owner"),)


class CachedModel(Base):
    """A snapshot of a Hub repo in one host's Hugging Face cache (0006): what `gpujobs models list` shows, the
    progress of a download that `gpujobs status` shows, and the requests `models pull/rm --workers` leave for the
    workers of a host (`state` pull_requested / remove_requested; one of them claims each).

    Written by the workers (core/model_cache.py); a host is the worker's host name (JOBS_HOSTNAME) and its cache
    directory (HF_HUB_CACHE), so two caches on one host are two places. `commit` is '' only for a pull request whose
    revision the API could not resolve (the worker resolves it).
    """

    __tablename__ = "cached_models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(String(255))
    cache_dir: Mapped[str] = mapped_column(String(1024))
    repo: Mapped[str] = mapped_column(String(255))
    commit: Mapped[str] = mapped_column(String(64))
    kind: Mapped[str] = mapped_column(String(16), default="model")
    revision: Mapped[str | None] = mapped_column(String(255))
    refs: Mapped[list[Any] | None] = mapped_column(JSON)
    state: Mapped[str] = mapped_column(String(24))
    files: Mapped[int] = mapped_column(Integer, default=0)
    bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_total: Mapped[int] = mapped_column(BigInteger, default=0)
    rate: Mapped[float | None] = mapped_column(Float)
    worker: Mapped[str | None] = mapped_column(String(255))
    requested_by: Mapped[str | None] = mapped_column(String(128))
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float)
    finished_at: Mapped[float | None] = mapped_column(Float)
    last_used_at: Mapped[float | None] = mapped_column(Float)

    __table_args__ = (
        UniqueConstraint("host", "cache_dir", "repo", "commit", name="uq_cached_models_place"),
        Index("ix_cached_models_repo", "repo"),
    )


class StoreIdentity(Base):
    """The store's one row (0011; core/artifacts.py): its random id, made by the migration, and the artifacts
    directory it adopted: the `mark` that directory's marker file holds, and where and when it was adopted (for the
    message that names it to a process whose JOBS_ARTIFACTS is another directory). No mark: none adopted yet."""

    __tablename__ = "store_identity"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    created_at: Mapped[float] = mapped_column(Float)
    artifacts_mark: Mapped[str | None] = mapped_column(String(40))
    artifacts_path: Mapped[str | None] = mapped_column(Text)
    artifacts_host: Mapped[str | None] = mapped_column(String(255))
    artifacts_adopted_at: Mapped[float | None] = mapped_column(Float)
