"""Usage accounting: per-owner sums in SQL (jobs, rows, tokens, GPU-seconds, engine seconds), who may see what,
`GET /usage` and `gpujobs usage`, and a real job's usage after a worker ran it."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api import service, views
from api.app import app
from core import auth
from core.db import session_scope
from core.errors import InvalidInput
from core.models import Job, JobRow, Shard
from tests.conftest import wait_for
from tests.test_e2e import jobs

DAY = 86400.0


def add_job(
    session,
    job_id: str,
    owner: str,
    state: str,
    *,
    age: float = 0.0,
    metrics: dict | None = None,
    rows: tuple[int, int] = (0, 0),
    tokens: tuple[int, int] = (0, 0),
) -> None:
    """A job as the store holds it; finished jobs carry the totals and metrics that finalize wrote."""
    session.add(
        Job(
            id=job_id,
            kind="generate",
            state=state,
            owner=owner,
            spec={"model": "m"},
            queue="gpu1",
            gpus=1,
            created_at=time.time() - age,
            rows_total=sum(rows),
            rows_succeeded=rows[0],
            rows_failed=rows[1],
            prompt_tokens=tokens[0],
            completion_tokens=tokens[1],
            metrics=metrics,
            retries=0,
        )
    )
    session.flush()


def add_row(session, job_id: str, idx: int, state: str, prompt: int | None = None, completion: int | None = None):
    session.add(
        JobRow(
            job_id=job_id,
            idx=idx,
            custom_id=f"r{idx}",
            line=idx + 1,
            state=state,
            input={"prompt": "p"},
            prompt_tokens=prompt,
            completion_tokens=completion,
            executions=int(state != "pending"),
        )
    )


def add_shard(session, job_id: str, idx: int, state: str, metrics: dict | None) -> None:
    session.add(
        Shard(
            job_id=job_id,
            idx=idx,
            row_start=idx,
            row_end=idx + 1,
            state=state,
            attempts=1,
            max_attempts=3,
            rows_done=0,
            rows_failed=0,
            completion_tokens=0,
            metrics=metrics,
        )
    )


@pytest.fixture
def ledger(any_jobs_env) -> None:
    """Finished and live jobs of three owners, one of them older than a week."""
    with session_scope() as session:
        # alice: a finished job (its totals were written at finalize; its shards' metrics are already in them)
        add_job(
            session,
            "job_a_done",
            "alice",
            "succeeded",
            rows=(3, 1),
            tokens=(30, 12),
            metrics={"gpu_seconds": 8.5, "engine_seconds": 2.25, "duration_s": 5.0},
        )
        add_shard(session, "job_a_done", 0, "succeeded", {"gpu_seconds": 8.5, "engine_seconds": 2.25})
        # alice: a running job: rows so far, and the metrics of its finished shard only
        add_job(session, "job_a_live", "alice", "running")
        add_row(session, "job_a_live", 0, "succeeded", 5, 7)
        add_row(session, "job_a_live", 1, "succeeded", 6, 8)
        add_row(session, "job_a_live", 2, "failed")
        add_row(session, "job_a_live", 3, "pending")
        add_shard(session, "job_a_live", 0, "succeeded", {"gpu_seconds": 4.0, "engine_seconds": 1.5})
        add_shard(session, "job_a_live", 1, "running", None)
        # alice: ten days old, finished
        add_job(
            session,
            "job_a_old",
            "alice",
            "succeeded",
            age=10 * DAY,
            rows=(100, 0),
            tokens=(1000, 500),
            metrics={"gpu_seconds": 60.0, "engine_seconds": 40.0},
        )
        # bob: every row failed before any ran (no metrics at all); carol: cancelled with what ran before the cancel
        add_job(session, "job_b_bad", "bob", "failed", rows=(0, 2))
        add_job(
            session,
            "job_c_cancel",
            "carol",
            "cancelled",
            rows=(1, 0),
            tokens=(4, 2),
            metrics={"gpu_seconds": 0.75, "engine_seconds": 0.5},
        )


ALICE_WEEK = {
    "owner": "alice",
    "jobs": 2,
    "rows_succeeded": 5,
    "rows_failed": 2,
    "prompt_tokens": 41,
    "completion_tokens": 27,
    "gpu_seconds": 12.5,
    "engine_seconds": 3.75,
}
BOB = {
    "owner": "bob",
    "jobs": 1,
    "rows_succeeded": 0,
    "rows_failed": 2,
    "prompt_tokens": 0,
    "completion_tokens": 0,
    "gpu_seconds": 0.0,
    "engine_seconds": 0.0,
}
CAROL = {
    "owner": "carol",
    "jobs": 1,
    "rows_succeeded": 1,
    "rows_failed": 0,
    "prompt_tokens": 4,
    "completion_tokens": 2,
    "gpu_seconds": 0.75,
    "engine_seconds": 0.5,
}


def test_usage_sums_finished_totals_and_live_rows_and_shards_per_owner(ledger):
    """Finished jobs count their finalized totals, a running job its rows so far and its finished shards'
    GPU- and engine seconds; `since` drops older jobs; the total adds the owners up (SQLite and Postgres)."""
    week = views.usage(owner=None, since="7d")
    assert week["owners"] == [ALICE_WEEK, BOB, CAROL]
    assert week["total"] == {
        "jobs": 4,
        "rows_succeeded": 6,
        "rows_failed": 4,
        "prompt_tokens": 45,
        "completion_tokens": 29,
        "gpu_seconds": 13.25,
        "engine_seconds": 4.25,
    }
    assert week["since"] == pytest.approx(time.time() - 7 * DAY, abs=60)

    alice = views.usage(owner="alice")["owners"]
    assert alice == [
        {
            **ALICE_WEEK,
            "jobs": 3,
            "rows_succeeded": 105,
            "prompt_tokens": 1041,
            "completion_tokens": 527,
            "gpu_seconds": 72.5,
            "engine_seconds": 43.75,
        }
    ]
    assert views.usage(owner="nobody")["owners"] == [{**BOB, "owner": "nobody", "jobs": 0, "rows_failed": 0}]


@pytest.mark.parametrize("since, days_ago", [("7d", 7), ("36h", 1.5), ("2w", 14), ("90m", 90 / 1440), ("1.5d", 1.5)])
def test_since_takes_durations(since, days_ago):
    """`--since 7d` (s, m, h, d, w) means that long before now."""
    assert views.usage_since(since) == pytest.approx(time.time() - days_ago * DAY, abs=5)


def test_since_takes_iso_dates_in_utc_unless_zoned():
    """An RFC 3339 date (UTC) or date-time (with its zone), the query parameter's formats; anything else, blank
    included, is refused with the accepted forms."""
    assert views.usage_since("2026-01-31") == 1769817600.0
    assert views.usage_since("2026-01-31T12:00:00Z") == 1769817600.0 + 12 * 3600
    assert views.usage_since("2026-01-31T12:00:00+02:00") == 1769817600.0 + 10 * 3600
    assert views.usage_since(None) is None
    for bad in ("yesterday", "7", "-7d", "7y", "2026-13-01", "2026-02-30", " ", " 7d", "2026-01-31T12:00"):
        with pytest.raises(InvalidInput, match="7d.*ISO date"):
            views.usage_since(bad)


def test_a_user_sees_only_their_own_usage_and_an_admin_sees_every_owner(ledger):
    """GET /usage: a user gets their own row (403 naming the owner when asking for another's); an admin gets every
    owner, or the one asked for; a bad `since` is a 422 with the accepted forms."""
    with session_scope() as session:
        bob = auth.create_token(session, owner="bob", scopes=["user"])
        admin = auth.create_token(session, owner="root", scopes=["admin"])
    as_bob = TestClient(app, headers={"Authorization": f"Bearer {bob}"})
    as_admin = TestClient(app, headers={"Authorization": f"Bearer {admin}"})

    assert as_bob.get("/usage").json()["owners"] == [BOB]
    assert as_bob.get("/usage", params={"owner": "bob", "since": "7d"}).json()["owners"] == [BOB]
    refused = as_bob.get("/usage", params={"owner": "alice"})
    assert refused.status_code == 403 and "'alice'" in refused.json()["error"]["message"]

    assert [o["owner"] for o in as_admin.get("/usage").json()["owners"]] == ["alice", "bob", "carol"]
    assert as_admin.get("/usage", params={"owner": "alice", "since": "7d"}).json()["owners"] == [ALICE_WEEK]
    bad = as_admin.get("/usage", params={"since": "last tuesday"})
    assert bad.status_code == 422 and "7d" in bad.json()["error"]["message"]


def test_a_real_job_run_by_a_worker_shows_tokens_and_engine_seconds_in_gpujobs_usage(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model
):
    """A job run by a real CPU worker: `gpujobs usage --json` shows its rows, prompt and completion tokens and
    engine seconds. GPU-seconds are wall time × slice size, so 0 on a CPU worker (slice size 0)."""
    url, token, _ = api_server  # an admin token of "alice"
    spawn_worker([])
    data = "".join(json.dumps({"prompt": q}) + "\n" for q in ("What is the capital of France?", "2+2?")).encode()
    file_id = service.store_upload(owner="dana", filename="d.jsonl", stream=io.BytesIO(data))["id"]
    job = service.submit(
        owner="dana", spec_data={"model": str(tiny_model), "input": file_id, "gpus": 0, "max_new_tokens": 6}
    )

    def finished() -> dict[str, Any] | None:
        view = views.get(job["id"], owner=None)
        return view if view["state"] in ("succeeded", "failed", "cancelled") else None

    done = wait_for(finished, 120, "the job to finish")
    assert done["state"] == "succeeded", done

    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    result = jobs(env, "usage", "--owner", "dana", "--since", "1h", "--json")
    assert result.returncode == 0, result.stderr
    (dana,) = json.loads(result.stdout)["owners"]
    assert dana["owner"] == "dana" and dana["jobs"] == 1
    assert (dana["rows_succeeded"], dana["rows_failed"]) == (2, 0)
    assert dana["prompt_tokens"] == done["tokens"]["prompt"] > 0
    assert dana["completion_tokens"] == done["tokens"]["completion"] > 0
    assert dana["engine_seconds"] > 0 and dana["engine_seconds"] == done["metrics"]["engine_seconds"]
    assert dana["gpu_seconds"] == 0.0 == done["metrics"]["gpu_seconds"]

    table = jobs(env, "usage")
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split()[:3] == ["owner", "jobs", "rows"]
    assert any(line.split()[:3] == ["dana", "1", "2"] for line in table.stdout.splitlines())
