"""Load at CI size, through the real stack (uvicorn, Redis, SQLite, CPU worker processes, the tiny model): 200
concurrent submissions and a 20,000-row job, each row written exactly once, status calls answering within a bound.

Speeds are printed and written to JSON, never asserted; the one timing asserted is the status-call bound
(STATUS_P99_S). `ops/bench/load.py` runs the same functions at full size (1,000 submissions, 200,000 rows).
"""

from __future__ import annotations

import json

import pytest

from ops.bench.load import (
    audit,
    big_report,
    burst,
    burst_report,
    cpu_delta,
    cpu_seconds,
    job_spec,
    memory,
    polling,
    submit_big,
    table,
    wait_terminal,
    warm_up,
    write_rows,
)
from tests.conftest import registered, wait_for

pytestmark = pytest.mark.slow

# GET /jobs/{id} while 200 submissions arrive over 64 connections and the worker drains them, on 2 cores shared with
# three other test suites (load average 3-8): p99 0.05-0.66 s, slowest call 1.56 s, over ten runs. Two seconds is
# 3x the worst p99 seen, and below the submissions' own p99 (3-4 s): a status read that queued behind
# submissions (for a thread of the API's pool or a database connection) would fail it.
STATUS_P99_S = 2.0
# Workers get one intra-op thread: with torch's default (one per core) a worker competing with the API on 2 cores
# spends 5x the CPU on the tiny model (ops/bench/README.md, "Load").
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def report_out(tmp_path, capsys, name: str, report: dict) -> None:
    out = tmp_path / f"{name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    with capsys.disabled():
        print(f"\n{table(report)}\nwrote {out}")


def test_200_concurrent_submissions_each_row_once_and_status_answers_fast(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model, capsys
):
    """200 jobs of 1-2 rows (max_new_tokens 1) submitted at once over 64 HTTP connections, one CPU worker: every
    POST /jobs answers 201, every job succeeds and is finalized once, every row is executed exactly once, and
    GET /jobs/{id}, called in a loop meanwhile, answers 200 with p99 under STATUS_P99_S."""
    url, token, api = api_server
    worker = spawn_worker([], **ONE_THREAD)
    alive = lambda: next((f"process {p.pid}" for p in (api, worker) if not p.alive()), None)  # noqa: E731
    spec = job_spec(tiny_model)
    warm = warm_up(url, token, spec, tmp_path, jobs_env.database_url, workers=1, alive=alive)
    cpu = {"api": cpu_seconds(api.pid), "worker": cpu_seconds(worker.pid)}
    data = tmp_path / "burst"
    data.mkdir()
    with polling(url, token, pause=0.02) as poller:
        b = burst(url, token, spec, data, jobs=200, connections=64, poller=poller)
        wait_terminal(jobs_env.database_url, b.job_ids, 150, alive=alive)
    a = audit(jobs_env.database_url, b.job_ids)
    report = {"warm_up_s": warm, "burst": burst_report(b, a, poller)}
    report["burst"]["cpu_s"] = cpu_delta(cpu, {"api": cpu_seconds(api.pid), "worker": cpu_seconds(worker.pid)})
    report["memory"] = {"api": memory(api.pid), "worker": memory(worker.pid)}
    report_out(tmp_path, capsys, "load-burst", report)

    assert b.codes == {"201": 200}, b.failures
    assert a["job_states"] == {"succeeded": 200}
    assert a["jobs_finalized_once"] == 200
    assert a["rows"] == a["rows_expected"] == a["rows_succeeded"] == b.rows
    assert a["executions_min"] == a["executions_max"] == 1, "a row was executed twice, or never"
    assert set(poller.codes) == {200}, (poller.codes, poller.errors[:5])
    status = report["burst"]["status_s"]
    assert status["n"] >= 100, status
    assert status["p99"] < STATUS_P99_S, f"GET /jobs/{{id}} p99 {status['p99']} s under load: bound {STATUS_P99_S} s"


def test_20000_row_job_on_two_cpu_workers_writes_every_row_once(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model, capsys
):
    """One job of 20,000 rows (max_new_tokens 1, shards of 2,000 rows, micro-batches of 256) uploaded and
    submitted over HTTP, run by two CPU workers: every row succeeds with exactly one execution and the job is
    finalized once. Rows per second are reported, not asserted."""
    url, token, api = api_server
    workers = [spawn_worker([], wait=False, **ONE_THREAD) for _ in range(2)]
    for w in workers:
        wait_for(lambda w=w: registered(jobs_env.database_url, w.pid), 90, "worker registration", procs=[w])
    procs = [api, *workers]
    alive = lambda: next((f"process {p.pid}" for p in procs if not p.alive()), None)  # noqa: E731
    warm = warm_up(url, token, job_spec(tiny_model), tmp_path, jobs_env.database_url, workers=2, alive=alive)
    spec = job_spec(tiny_model, shard_rows=2000, batch_rows=256)
    data = write_rows(tmp_path / "big.jsonl", 20_000)
    cpu = {name: cpu_seconds(p.pid) for name, p in zip(("api", "worker0", "worker1"), procs)}
    with polling(url, token, pause=0.5) as poller:
        big = submit_big(url, token, spec, data, 20_000)
        poller.add(big.job_id)
        wait_terminal(jobs_env.database_url, [big.job_id], 150, alive=alive)
    a = audit(jobs_env.database_url, [big.job_id])
    report = {"warm_up_s": warm, "big": big_report(big, a, poller, spec, workers=2)}
    report["big"]["cpu_s"] = cpu_delta(
        cpu, {name: cpu_seconds(p.pid) for name, p in zip(("api", "worker0", "worker1"), procs)}
    )
    report["memory"] = {name: memory(p.pid) for name, p in zip(("api", "worker0", "worker1"), procs)}
    report_out(tmp_path, capsys, "load-big", report)

    assert a["job_states"] == {"succeeded": 1} and a["jobs_finalized_once"] == 1
    assert a["rows"] == a["rows_succeeded"] == a["rows_succeeded_by_jobs"] == 20_000
    assert a["executions_min"] == a["executions_max"] == 1, "a row was executed twice, or never"
    assert set(poller.codes) == {200}, (poller.codes, poller.errors[:5])
