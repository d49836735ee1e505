"""Prometheus metrics at `GET /metrics`, read from SQL and Redis at scrape time (nothing is kept in the process).

Every API process answers the same numbers, so Prometheus may scrape any of them; there is no per-process state
to lose on a restart. Read with a token of the `metrics` scope (`gpujobs tokens create --owner prometheus
--scope metrics`) or an admin token: the numbers are totals over every owner, so a `user` token may not.

Exported (names are a contract: ops/prometheus/alerts.yml and ops/grafana/gpujobs.json use them, and
tests/test_metrics.py checks that every name they use is exported):

    gpujobs_jobs{state}                                 jobs in each state (every state, 0 included)
    gpujobs_queue_depth{queue}                          messages waiting in Redis per queue (cpu, gpu1, ...)
    gpujobs_queued_shards{queue,priority,owner}         shards waiting in SQL to be claimed (core/scheduling.py);
                                                        only the combinations with some are exported
    gpujobs_running_shards{owner}                       shards running now, per owner (quotas cap these)
    gpujobs_redis_up                                    1 when Redis answered this scrape
    gpujobs_rows_processed_total{state}                 rows finished, succeeded or failed
    gpujobs_tokens_processed_total{kind}                prompt and completion tokens of finished rows
    gpujobs_rows_per_second, gpujobs_tokens_per_second  completion rate over the last minute, all jobs
    gpujobs_workers{state}                              registered workers: online, lost, offline (core/registry.py)
    gpujobs_worker_restarts_total{host,slice}           restarts of the worker of that host and slice by its
                                                        supervisor (`gpujobs up`): the newest worker's count
    gpujobs_worker_up{worker,host,slice}                1 while the worker's heartbeat is fresh
    gpujobs_worker_heartbeat_age_seconds{worker,...}    seconds since its last heartbeat
    gpujobs_gpu_memory_total_bytes{worker,gpu,name}     each GPU a worker holds, from its registration
    gpujobs_gpu_memory_allocated_bytes{worker,gpu}      what the worker's torch allocated / reserved on it,
    gpujobs_gpu_memory_reserved_bytes{worker,gpu}       from its heartbeat (`capabilities.gpu_memory`)

The row and token counters sum finished jobs' totals (written at finalize) and live jobs' rows, so a scrape costs
two grouped queries over the jobs table plus one over live jobs' rows, never a scan of every row ever run. A
`gpujobs retry` puts rows back to pending, so a counter may step down; Prometheus reads that as a counter reset.
Workers shown are those not stopped cleanly (online or lost) that beat within the last day: a worker that died
long ago stops firing the worker-lost alert after that. A worker whose supervisor saw it exit is offline (with its
exit code), not lost: its restart shows in gpujobs_worker_restarts_total instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core import auth, registry, scheduling
from core.db import session_scope
from core.errors import Forbidden
from core.models import Job, JobRow, Worker
from core.queue import waiting_messages
from core.settings import get_settings
from core.states import JobState, RowState
from core.store import now

log = logging.getLogger(__name__)
RATE_WINDOW = 60.0  # seconds behind gpujobs_rows_per_second / gpujobs_tokens_per_second
WORKER_HORIZON = 86400.0  # workers whose last heartbeat is older than this are no longer shown

router = APIRouter()
bearer = HTTPBearer(auto_error=False, description="A token with the `metrics` (or `admin`) scope.")


def metrics_reader(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    with session_scope() as session:
        token = auth.authenticate(session, credentials.credentials if credentials else None)
        owner, scopes = token.owner, set(token.scopes.split(","))
    if not scopes & {"metrics", "admin"}:
        raise Forbidden(
            "/metrics needs a token with the metrics or admin scope: create one with "
            "`gpujobs tokens create --owner prometheus --scope metrics`"
        )
    return owner


# Not in the OpenAPI schema: it is Prometheus's text format, not JSON, and tests/test_metrics.py checks its access.
@router.get("/metrics", include_in_schema=False)
def metrics(_reader: Annotated[str, Depends(metrics_reader)]) -> Response:
    registry_ = CollectorRegistry(auto_describe=False)
    registry_.register(SqlCollector())
    return Response(generate_latest(registry_), media_type=CONTENT_TYPE_LATEST)


class SqlCollector:
    """A prometheus_client collector that reads everything at scrape time."""

    def collect(self) -> Iterator[Metric]:
        with session_scope() as session:
            yield from job_metrics(session)
            yield from row_metrics(session)
            yield from worker_metrics(session)
            yield from scheduling_metrics(session)
            queues = known_queues(session)
        yield from queue_metrics(queues)


def job_metrics(session: Session) -> Iterator[Metric]:
    counts = dict(session.execute(select(Job.state, func.count()).group_by(Job.state)).all())
    jobs = GaugeMetricFamily("gpujobs_jobs", "Jobs in each state", labels=["state"])
    for state in JobState:
        jobs.add_metric([state.value], counts.get(state.value, 0))
    yield jobs


def row_metrics(session: Session) -> Iterator[Metric]:
    terminal = [s.value for s in JobState if s.terminal]
    done = session.execute(
        select(
            func.coalesce(func.sum(Job.rows_succeeded), 0),
            func.coalesce(func.sum(Job.rows_failed), 0),
            func.coalesce(func.sum(Job.prompt_tokens), 0),
            func.coalesce(func.sum(Job.completion_tokens), 0),
        ).where(Job.state.in_(terminal))
    ).one()
    rows = {RowState.succeeded.value: int(done[0]), RowState.failed.value: int(done[1])}
    tokens = {"prompt": int(done[2]), "completion": int(done[3])}
    live = select(
        JobRow.state,
        func.count(),
        func.coalesce(func.sum(JobRow.prompt_tokens), 0),
        func.coalesce(func.sum(JobRow.completion_tokens), 0),
    ).join(Job, Job.id == JobRow.job_id)
    live = live.where(Job.state.not_in(terminal), JobRow.state != RowState.pending.value).group_by(JobRow.state)
    for state, count, prompt, completion in session.execute(live).all():
        rows[state] = rows.get(state, 0) + int(count)
        tokens["prompt"] += int(prompt)
        tokens["completion"] += int(completion)
    processed = CounterMetricFamily("gpujobs_rows_processed", "Rows finished, by outcome", labels=["state"])
    for state, count in rows.items():
        processed.add_metric([state], count)
    yield processed
    counted = CounterMetricFamily("gpujobs_tokens_processed", "Tokens of finished rows", labels=["kind"])
    for kind, count in tokens.items():
        counted.add_metric([kind], count)
    yield counted
    yield from rate_metrics(session, terminal)


def rate_metrics(session: Session, terminal: list[str]) -> Iterator[Metric]:
    """Rows and completion tokens finished in the last minute, over the jobs that could have any (index on job)."""
    since = now() - RATE_WINDOW
    recent = select(Job.id).where(Job.state.not_in(terminal) | (Job.finished_at > since))
    count, tokens = session.execute(
        select(func.count(), func.coalesce(func.sum(JobRow.completion_tokens), 0)).where(
            JobRow.job_id.in_(recent), JobRow.finished_at > since, JobRow.worker.is_not(None)
        )
    ).one()
    yield GaugeMetricFamily(
        "gpujobs_rows_per_second",
        f"Rows finished per second over the last {RATE_WINDOW:.0f} s",
        value=count / RATE_WINDOW,
    )
    yield GaugeMetricFamily(
        "gpujobs_tokens_per_second",
        f"Completion tokens per second over the last {RATE_WINDOW:.0f} s",
        value=int(tokens) / RATE_WINDOW,
    )


def worker_metrics(session: Session) -> Iterator[Metric]:
    timeout, t = get_settings().worker_timeout, now()
    workers = registry.all_workers(session)
    states: dict[str, int] = {"online": 0, "lost": 0, "offline": 0}
    labels = ["worker", "host", "slice"]
    up = GaugeMetricFamily("gpujobs_worker_up", "1 while the worker's heartbeat is fresh", labels=labels)
    age = GaugeMetricFamily(
        "gpujobs_worker_heartbeat_age_seconds", "Seconds since the worker's last heartbeat", labels=labels
    )
    gpu = ["worker", "gpu"]
    total = GaugeMetricFamily(
        "gpujobs_gpu_memory_total_bytes", "Memory of each GPU a worker holds", labels=[*gpu, "name", "uuid"]
    )
    allocated = GaugeMetricFamily(
        "gpujobs_gpu_memory_allocated_bytes", "GPU memory the worker's tensors hold", labels=gpu
    )
    reserved = GaugeMetricFamily(
        "gpujobs_gpu_memory_reserved_bytes", "GPU memory the worker's allocator reserved", labels=gpu
    )
    newest: dict[tuple[str, str], Worker] = {}
    for w in workers:
        state = registry.state_of(w, t, timeout)
        fresh = state == "online"
        states[state] = states.get(state, 0) + 1
        if t - w.heartbeat_at > WORKER_HORIZON:
            continue
        if (w.host, w.slice) not in newest or newest[(w.host, w.slice)].started_at < w.started_at:
            newest[(w.host, w.slice)] = w
        if state == "offline":
            continue
        up.add_metric([w.name, w.host, w.slice], 1 if fresh else 0)
        age.add_metric([w.name, w.host, w.slice], max(0.0, t - w.heartbeat_at))
        for g in w.gpus or []:
            total.add_metric(
                [w.name, str(g.get("index")), str(g.get("name")), str(g.get("uuid"))], g.get("memory_bytes") or 0
            )
        for g in (w.capabilities or {}).get("gpu_memory", []):
            allocated.add_metric([w.name, str(g.get("index"))], g.get("allocated_bytes") or 0)
            reserved.add_metric([w.name, str(g.get("index"))], g.get("reserved_bytes") or 0)
    by_state = GaugeMetricFamily("gpujobs_workers", "Registered workers by state", labels=["state"])
    for state, count in states.items():
        by_state.add_metric([state], count)
    restarts = CounterMetricFamily(
        "gpujobs_worker_restarts",
        "Restarts of the worker of a host and slice by its supervisor",
        labels=["host", "slice"],
    )
    for (host, slice_), w in sorted(newest.items()):
        restarts.add_metric([host, slice_], w.restarts or 0)
    yield from (by_state, restarts, up, age, total, allocated, reserved)


def scheduling_metrics(session: Session) -> Iterator[Metric]:
    queued = GaugeMetricFamily(
        "gpujobs_queued_shards",
        "Shards waiting to be claimed, by queue, priority and owner",
        labels=["queue", "priority", "owner"],
    )
    for queue, priority, owner, count in scheduling.queue_depth(session):
        queued.add_metric([queue, priority, owner], count)
    running = GaugeMetricFamily("gpujobs_running_shards", "Shards running now, by owner", labels=["owner"])
    for owner, count in sorted(scheduling.running_shards(session).items()):
        running.add_metric([owner], count)
    yield from (queued, running)


def known_queues(session: Session) -> list[str]:
    """The cpu queue, every queue a recent worker consumes, and the queues of live jobs."""
    terminal = [s.value for s in JobState if s.terminal]
    names = {"cpu"}
    for queues in session.scalars(select(Worker.queues).where(Worker.heartbeat_at > now() - WORKER_HORIZON)):
        names.update(queues or [])
    names.update(session.scalars(select(Job.queue).where(Job.state.not_in(terminal)).distinct()))
    return sorted(names)


def queue_metrics(queues: list[str]) -> Iterator[Metric]:
    depth = GaugeMetricFamily("gpujobs_queue_depth", "Messages waiting in Redis per queue", labels=["queue"])
    up = 1
    try:
        for queue in queues:
            depth.add_metric([queue], waiting_messages(queue))
    except Exception as exc:  # redis raises several types for one cause; the scrape must still answer
        log.warning("metrics: Redis did not answer (%s): gpujobs_redis_up is 0", exc)
        depth, up = GaugeMetricFamily("gpujobs_queue_depth", "Messages waiting in Redis per queue", labels=["queue"]), 0
    yield depth
    yield GaugeMetricFamily("gpujobs_redis_up", "1 when Redis answered this scrape", value=up)


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples of a /metrics answer by name (tests and scripts)."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return found
