"""Cluster settings: workers on two "hosts" (own JOBS_HOME and host name) share one Redis, one Postgres and
one JOBS_ARTIFACTS location, and drain one job together."""

from __future__ import annotations

import json

from sqlalchemy import select

from api import service, views
from core.db import session_scope
from core.models import JobRow, Worker
from tests.conftest import wait_for


def test_two_hosts_drain_one_job_on_postgres(tmp_path, pg_jobs_env, spawn_worker, tiny_model):
    """Each of two workers with different JOBS_HOME and JOBS_HOSTNAME commits some shards of one job; every
    row is done once; the job is finalized once."""
    hosts = []
    for name in ("host-a", "host-b"):
        home = tmp_path / name
        hosts.append(spawn_worker([], JOBS_HOME=str(home), JOBS_HOSTNAME=name))
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Row {i}"}) + "\n" for i in range(64)))
    job = service.submit(
        owner="t",
        spec_data={
            "model": str(tiny_model),
            "input": str(data),
            "gpus": 0,
            "max_new_tokens": 32,
            "ignore_eos": True,
            "shard_rows": 4,
            "batch_rows": 2,
        },
    )
    wait_for(lambda: views.get(job["id"], owner=None)["state"] == "succeeded", 180, "the job", procs=hosts)
    with session_scope() as session:
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"])).all()
        names = {w.name: w.host for w in session.scalars(select(Worker)).all()}
    assert {r.executions for r in rows} == {1} and len(rows) == 64
    assert {names[r.worker] for r in rows} == {"host-a", "host-b"}
    events = views.events(job["id"], owner=None)
    assert sum(1 for e in events if e["message"].startswith("job → succeeded")) == 1
