"""Load benchmark: many concurrent submissions and one large job through the real stack.

    python ops/bench/load.py                       # full size: 1,000 submissions, a 200,000-row job
    python ops/bench/load.py --submissions 200 --rows 20000 --out /tmp/load.json
    JOBS_BENCH_DATABASE_URL=postgresql+psycopg://... python ops/bench/load.py   # Postgres instead of SQLite

It starts its own stack in a temp dir, the same pieces the tests use: a private redis-server
(`core.embedded.start_redis`), SQLite (WAL) migrated by Alembic (or the Postgres URL given), the API under uvicorn
and CPU worker processes (`python -m worker.main --slice ''`), with a tiny random Qwen3 model built on the spot.

Three phases on the stack, each checked for "nothing lost, nothing run twice" in SQL (every row has one result and
`executions == 1`, every job is finalized exactly once), and one on the store alone:

1. burst: N jobs of 1-2 rows (max_new_tokens 1) submitted at once over C concurrent HTTP connections (upload +
   POST /jobs each), while another thread calls GET /jobs/{id} in a loop and records its latency.
2. big: one job of R rows (max_new_tokens 1), uploaded and submitted over HTTP, run by the workers; status polled.
3. mixed (`--mixed M`): owners sharing the workers (core/scheduling.py): `big` submits one job of many shards, then
   M small jobs of `ann`, `bob`, `cat` (normal), `vip` (high) and `batch` (low) are submitted at once; waiting time
   (a job's first shard started − submitted) and turnaround percentiles per owner and priority.
4. claims (`--claims`, after the stack stopped, on its store): the claim's cost in ms (core/leases.claim, the
   scheduling rule's queries included) with 100 queued jobs of one shard, and with 100 jobs of 100 shards (10,000
   queued shards), 8 owners, 3 priorities and 2,000 shards run within the fair-share window; and the cost of a
   worker's heartbeat question "should my shard yield?" (core/scheduling.yield_reason) with the claimed shards running.

It prints a table and writes JSON (commit, machine, settings, numbers) to ops/bench/results/load-<date>.json.
`tests/test_load.py` runs the same functions at CI size (200 submissions, 20,000 rows).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ops.bench import harness  # after the repository root is on sys.path

TERMINAL = ("succeeded", "failed", "cancelled")


# --- measurements -------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), nearest rank; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary(values: list[float]) -> dict[str, float | int | None]:
    """Count, p50, p99 and max of latencies (seconds), rounded to the millisecond's tenth."""
    r = lambda v: None if v is None else round(v, 4)  # noqa: E731
    return {
        "n": len(values),
        "p50": r(percentile(values, 50)),
        "p99": r(percentile(values, 99)),
        "max": r(max(values) if values else None),
    }


def memory(pid: int) -> dict[str, int]:
    """Peak (VmHWM) and current (VmRSS) resident memory of a process, in bytes, from /proc/PID/status."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (its own threads, not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class StatusPoller(threading.Thread):
    """Calls GET /jobs/{id} in a loop over the ids it is given, recording each call's latency and status code."""

    def __init__(self, url: str, token: str, *, pause: float = 0.0):
        super().__init__(name="status-poller", daemon=True)
        self.url, self.token, self.pause = url, token, pause
        self.ids: list[str] = []
        self.latencies: list[float] = []
        self.times: list[float] = []  # Unix time each call started
        self.codes: dict[int, int] = {}
        self.errors: list[str] = []
        self._halt = threading.Event()

    def add(self, job_id: str) -> None:
        self.ids.append(job_id)  # list.append is atomic under the GIL

    def run(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"}
        with httpx.Client(base_url=self.url, headers=headers, timeout=60) as client:
            i = 0
            while not self._halt.is_set():
                if not self.ids:
                    time.sleep(0.01)
                    continue
                job_id = self.ids[i % len(self.ids)]
                i += 1
                self.times.append(time.time())
                t0 = time.perf_counter()
                try:
                    code = client.get(f"/jobs/{job_id}").status_code
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    code = 0
                self.latencies.append(time.perf_counter() - t0)
                self.codes[code] = self.codes.get(code, 0) + 1
                if self.pause:
                    self._halt.wait(self.pause)

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


@contextmanager
def polling(url: str, token: str, ids: list[str] = (), pause: float = 0.0) -> Iterator[StatusPoller]:
    poller = StatusPoller(url, token, pause=pause)
    for job_id in ids:
        poller.add(job_id)
    poller.start()
    try:
        yield poller
    finally:
        poller.stop()


def write_rows(path: Path, n: int, *, prefix: str = "r") -> Path:
    """A JSONL dataset of n short prompts with unique custom_ids."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"prompt": f"Row {i}: what is the capital of France?", "custom_id": f"{prefix}{i}"}))
            f.write("\n")
    return path


@dataclass
class Burst:
    """What a burst of concurrent submissions measured."""

    jobs: int
    connections: int
    upload_s: list[float] = field(default_factory=list)
    submit_s: list[float] = field(default_factory=list)
    codes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    job_ids: list[str] = field(default_factory=list)
    rows: int = 0
    started: float = 0.0  # Unix time of the first request
    submitted: float = 0.0  # Unix time the last submission answered


def burst(
    url: str,
    token: str,
    spec: dict,
    data_dir: Path,
    *,
    jobs: int,
    connections: int,
    poller: StatusPoller | None = None,
    rows_per_job: tuple[int, int] = (1, 2),
    seed: int = 0,
) -> Burst:
    """Submit `jobs` jobs of 1-2 rows at once over `connections` HTTP connections (one thread and one keep-alive
    connection each): upload the dataset (POST /files), then POST /jobs with `spec` + the file id."""
    connections = min(connections, jobs)  # every connection's thread waits at the gate for the others
    rng = random.Random(seed)
    sizes = [rng.randint(*rows_per_job) for _ in range(jobs)]
    datasets = [write_rows(data_dir / f"burst-{i}.jsonl", n, prefix=f"b{i}-") for i, n in enumerate(sizes)]
    result = Burst(jobs=jobs, connections=connections, rows=sum(sizes))
    local = threading.local()
    lock = threading.Lock()
    gate = threading.Barrier(connections)
    headers = {"Authorization": f"Bearer {token}"}

    def client() -> httpx.Client:
        if not hasattr(local, "client"):
            local.client = httpx.Client(
                base_url=url, headers=headers, timeout=120, limits=httpx.Limits(max_connections=1)
            )
            local.client.get("/healthz")  # open the connection before the clock starts
            gate.wait(60)  # every connection is open before the first submission
        return local.client

    def one(i: int) -> None:
        c = client()
        t0 = time.perf_counter()
        with open(datasets[i], "rb") as f:
            up = c.post("/files", files={"file": (datasets[i].name, f, "application/x-ndjson")})
        t1 = time.perf_counter()
        sub = c.post("/jobs", json={**spec, "input": up.json()["id"]}) if up.status_code == 201 else up
        t2 = time.perf_counter()
        with lock:
            result.started = result.started or time.time() - (t2 - t0)
            result.upload_s.append(t1 - t0)
            result.submit_s.append(t2 - t1)
            result.codes[str(sub.status_code)] = result.codes.get(str(sub.status_code), 0) + 1
            if sub.status_code == 201:
                result.job_ids.append(sub.json()["id"])
                if poller is not None:
                    poller.add(sub.json()["id"])
            else:
                result.failures.append(f"job {i}: HTTP {sub.status_code}: {sub.text[:300]}")

    with ThreadPoolExecutor(connections, thread_name_prefix="submit") as pool:
        list(pool.map(one, range(jobs)))
        # the pool's threads hold the clients; close them from the threads that own them
        list(pool.map(lambda _: getattr(local, "client", None) and local.client.close(), range(connections)))
    result.submitted = time.time()
    return result


def wait_terminal(
    database_url: str,
    job_ids: list[str],
    timeout: float,
    alive: Callable[[], str | None] = lambda: None,
    interval: float = 0.5,
) -> dict[str, int]:
    """Wait until every job is terminal; returns {state: count}. `alive` names a dead process, if any."""
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import Job

    deadline = time.monotonic() + timeout
    while True:
        with session_scope(database_url) as session:
            states = dict(
                session.execute(select(Job.state, func.count()).where(Job.id.in_(job_ids)).group_by(Job.state)).all()
            )
        if sum(states.get(s, 0) for s in TERMINAL) == len(job_ids):
            return states
        dead = alive()
        if dead:
            raise RuntimeError(f"{dead} died while {states} of {len(job_ids)} jobs were not finished")
        if time.monotonic() > deadline:
            raise TimeoutError(f"after {timeout} s the {len(job_ids)} jobs are {states}")
        time.sleep(interval)


def audit(database_url: str, job_ids: list[str]) -> dict:
    """Nothing lost, nothing twice, from SQL: row states and `executions`, finalizations per job, rows/s."""
    from sqlalchemy import case, func, select

    from core.db import session_scope
    from core.models import Job, JobEvent, JobRow

    with session_scope(database_url) as session:
        rows = select(JobRow).where(JobRow.job_id.in_(job_ids)).subquery()
        one = lambda cond: func.sum(case((cond, 1), else_=0))  # noqa: E731
        total, succeeded, ex_min, ex_max, ex_not_one, first_start, last_finish = session.execute(
            select(
                func.count(),
                one(rows.c.state == "succeeded"),
                func.min(rows.c.executions),
                func.max(rows.c.executions),
                one(rows.c.executions != 1),
                func.min(rows.c.started_at),
                func.max(rows.c.finished_at),
            )
        ).one()
        jobs = session.execute(
            select(
                Job.id, Job.state, Job.rows_total, Job.rows_succeeded, Job.created_at, Job.started_at, Job.finished_at
            ).where(Job.id.in_(job_ids))
        ).all()
        finals = dict(
            session.execute(
                select(JobEvent.job_id, func.count())
                .where(
                    JobEvent.job_id.in_(job_ids), JobEvent.kind == "state", JobEvent.message.like("job → finalizing%")
                )
                .group_by(JobEvent.job_id)
            ).all()
        )
        ends = dict(
            session.execute(
                select(JobEvent.job_id, func.count())
                .where(
                    JobEvent.job_id.in_(job_ids), JobEvent.kind == "state", JobEvent.message.like("job → succeeded%")
                )
                .group_by(JobEvent.job_id)
            ).all()
        )
    states: dict[str, int] = {}
    for j in jobs:
        states[j.state] = states.get(j.state, 0) + 1
    return {
        "jobs": len(jobs),
        "job_states": states,
        "rows": int(total or 0),
        "rows_expected": sum(j.rows_total for j in jobs),
        "rows_succeeded": int(succeeded or 0),
        "rows_succeeded_by_jobs": sum(j.rows_succeeded for j in jobs),
        "executions_min": ex_min,
        "executions_max": ex_max,
        "rows_not_executed_once": int(ex_not_one or 0),
        "jobs_finalized_once": sum(1 for j in jobs if finals.get(j.id) == 1 and ends.get(j.id) == 1),
        "first_row_started_at": first_start,
        "last_row_finished_at": last_finish,
        "first_job_created_at": min((j.created_at for j in jobs), default=None),
        "first_job_started_at": min((j.started_at for j in jobs if j.started_at), default=None),
        "last_job_finished_at": max((j.finished_at for j in jobs if j.finished_at), default=None),
    }


def burst_report(b: Burst, a: dict, poller: StatusPoller) -> dict:
    """The burst's numbers: latencies, rows/s written (first request → last row written), jobs/s."""
    span = (a["last_row_finished_at"] or b.started) - b.started
    done = (a["last_job_finished_at"] or b.started) - b.started
    return {
        "jobs": b.jobs,
        "connections": b.connections,
        "rows": b.rows,
        "codes": b.codes,
        "failures": b.failures[:20],
        "upload_s": summary(b.upload_s),
        "submit_s": summary(b.submit_s),
        "submit_phase_s": round(b.submitted - b.started, 3),
        "status_s": summary(poller.latencies),
        "status_while_submitting_s": summary(
            [lat for t, lat in zip(poller.times, poller.latencies) if t < b.submitted]
        ),
        "status_codes": {str(k): v for k, v in poller.codes.items()},
        "status_errors": poller.errors[:20],
        "rows_written_span_s": round(span, 3),
        "rows_per_s": round(a["rows"] / span, 1) if span > 0 else None,
        "all_jobs_finished_s": round(done, 3),
        "jobs_per_s": round(b.jobs / done, 2) if done > 0 else None,
        "audit": a,
    }


@dataclass
class BigJob:
    job_id: str
    rows: int
    upload_s: float
    submit_s: float
    started: float  # Unix time of the upload's start
    submitted: float  # Unix time POST /jobs answered


def warm_up(
    url: str,
    token: str,
    spec: dict,
    data_dir: Path,
    database_url: str,
    *,
    workers: int,
    timeout: float = 300,
    alive: Callable[[], str | None] = lambda: None,
) -> list[float]:
    """Run 1-row jobs, `workers` at a time, until every worker has loaded the model (its "loaded" event), so the
    measurements that follow see warm workers. Returns the seconds each round took (the first includes the load)."""
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import JobEvent

    rounds: list[float] = []
    job_ids: list[str] = []
    loaded: set[str] = set()
    while len(loaded) < workers and len(rounds) < 10:
        t0 = time.perf_counter()
        data = [write_rows(data_dir / f"warm-up-{len(rounds)}-{i}.jsonl", 1) for i in range(workers)]
        with ThreadPoolExecutor(workers) as pool:
            job_ids += [b.job_id for b in pool.map(lambda d: submit_big(url, token, spec, d, 1), data)]
        wait_terminal(database_url, job_ids, timeout, alive=alive, interval=0.1)
        rounds.append(round(time.perf_counter() - t0, 3))
        with session_scope(database_url) as session:
            messages = session.scalars(
                select(JobEvent.message).where(JobEvent.job_id.in_(job_ids), JobEvent.message.like("% loaded %"))
            ).all()
        loaded = {m.split(" loaded ", 1)[0] for m in messages}
    return rounds


def submit_big(url: str, token: str, spec: dict, data: Path, rows: int) -> BigJob:
    """Upload a large dataset and submit it as one job; returns when POST /jobs has answered."""
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=url, headers=headers, timeout=600) as c:
        started = time.time()
        t0 = time.perf_counter()
        with open(data, "rb") as f:
            up = c.post("/files", files={"file": (data.name, f, "application/x-ndjson")})
        up.raise_for_status()
        t1 = time.perf_counter()
        sub = c.post("/jobs", json={**spec, "input": up.json()["id"]})
        t2 = time.perf_counter()
    if sub.status_code != 201:
        raise RuntimeError(f"the big job was refused: HTTP {sub.status_code}: {sub.text[:500]}")
    return BigJob(sub.json()["id"], rows, round(t1 - t0, 3), round(t2 - t1, 3), started, time.time())


def big_report(big: BigJob, a: dict, poller: StatusPoller, spec: dict, workers: int) -> dict:
    run = (a["last_row_finished_at"] or 0) - (a["first_job_started_at"] or 0)
    end_to_end = (a["last_job_finished_at"] or big.started) - big.started
    return {
        "rows": big.rows,
        "workers": workers,
        "shard_rows": spec.get("shard_rows"),
        "batch_rows": spec.get("batch_rows"),
        "upload_s": big.upload_s,
        "submit_s": big.submit_s,
        "run_s": round(run, 3),
        "rows_per_s": round(a["rows"] / run, 1) if run > 0 else None,
        "end_to_end_s": round(end_to_end, 3),
        "end_to_end_rows_per_s": round(a["rows"] / end_to_end, 1) if end_to_end > 0 else None,
        "status_s": summary(poller.latencies),
        "status_codes": {str(k): v for k, v in poller.codes.items()},
        "audit": a,
    }


def cpu_delta(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float | None]:
    """CPU seconds each process used between two readings."""
    return {k: None if before.get(k) is None or after.get(k) is None else round(after[k] - before[k], 2) for k in after}


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f} MiB"


def ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms"


def cpu_text(cpu: dict[str, float | None]) -> str:
    workers = [v for k, v in cpu.items() if k.startswith("worker") and v is not None]
    return f"{cpu.get('api')} / {round(sum(workers), 2)}"


def table(report: dict) -> str:
    """A plain-text table of a report made by `run()` or tests/test_load.py."""
    lines = [f"{'measure':<44} value"]
    add = lambda k, v: lines.append(f"{k:<44} {v}")  # noqa: E731
    if b := report.get("burst"):
        add("burst: jobs / rows / connections", f"{b['jobs']} / {b['rows']} / {b['connections']}")
        add("burst: HTTP codes of POST /jobs", b["codes"])
        add("burst: upload latency p50 / p99", f"{ms(b['upload_s']['p50'])} / {ms(b['upload_s']['p99'])}")
        add(
            "burst: submit latency p50 / p99 / max",
            f"{ms(b['submit_s']['p50'])} / {ms(b['submit_s']['p99'])} / {ms(b['submit_s']['max'])}",
        )
        add("burst: all submitted in", f"{b['submit_phase_s']:.1f} s")
        add(
            f"burst: status latency p50 / p99 / max (n={b['status_s']['n']})",
            f"{ms(b['status_s']['p50'])} / {ms(b['status_s']['p99'])} / {ms(b['status_s']['max'])}",
        )
        w = b["status_while_submitting_s"]
        add(f"  of which while submitting (n={w['n']})", f"{ms(w['p50'])} / {ms(w['p99'])} / {ms(w['max'])}")
        add(
            "burst: rows written per s",
            f"{b['rows_per_s']} ({b['audit']['rows']} rows in {b['rows_written_span_s']} s)",
        )
        add("burst: jobs finished per s", f"{b['jobs_per_s']} (all in {b['all_jobs_finished_s']} s)")
        if b.get("cpu_s"):
            add("burst: CPU seconds (api / workers)", cpu_text(b["cpu_s"]))
        add("burst: rows with executions != 1", b["audit"]["rows_not_executed_once"])
        add("burst: jobs finalized exactly once", f"{b['audit']['jobs_finalized_once']} of {b['jobs']}")
    if m := report.get("mixed"):
        add("mixed: small jobs / big job's shards", f"{m['jobs']} / {m['big_shards']}")
        for cls, e in m["by_owner_priority"].items():
            w, r = e["wait_s"], e["turnaround_s"]
            add(
                f"mixed: {cls} wait p50 / p99 (n={w['n']})",
                f"{ms(w['p50'])} / {ms(w['p99'])}; turnaround p50 {ms(r['p50'])}",
            )
        add("mixed: rows with executions != 1", m["audit"]["rows_not_executed_once"])
    for c in report.get("claims", []):
        add(
            f"claim: ms at {c['queued_jobs']} jobs / {c['queued_shards']} shards",
            f"mean {c['claim_ms']['mean']}, p50 {c['claim_ms']['p50']}, p99 {c['claim_ms']['p99']} "
            f"(n={c['claim_ms']['n']})",
        )
        y = c["yield_check_ms"]
        add(
            f"yield check: ms at {c['queued_shards']} queued / {c['running_shards']} running shards",
            f"mean {y['mean']}, p50 {y['p50']}, p99 {y['p99']} (n={y['n']})",
        )
    if g := report.get("big"):
        add(
            "big: rows / workers / shard / batch",
            f"{g['rows']} / {g['workers']} / {g['shard_rows']} / {g['batch_rows']}",
        )
        add("big: upload / POST /jobs", f"{g['upload_s']:.2f} s / {g['submit_s']:.2f} s")
        add("big: rows written per s (first claim → last row)", f"{g['rows_per_s']} ({g['run_s']} s)")
        add("big: end to end (upload → finalized)", f"{g['end_to_end_s']} s ({g['end_to_end_rows_per_s']} rows/s)")
        add(
            f"big: status latency p50 / p99 / max (n={g['status_s']['n']})",
            f"{ms(g['status_s']['p50'])} / {ms(g['status_s']['p99'])} / {ms(g['status_s']['max'])}",
        )
        if g.get("cpu_s"):
            add("big: CPU seconds (api / workers)", cpu_text(g["cpu_s"]))
        add("big: rows with executions != 1", g["audit"]["rows_not_executed_once"])
        add("big: job states / finalized once", f"{g['audit']['job_states']} / {g['audit']['jobs_finalized_once']}")
    for name, mem in report.get("memory", {}).items():
        add(f"{name}: peak RSS (VmHWM) / RSS now", f"{mib(mem.get('VmHWM'))} / {mib(mem.get('VmRSS'))}")
    return "\n".join(lines)


# --- the stack (the bench's own; the tests use their fixtures) ------------------------------------------------


class Stack:
    """Redis, a migrated store, the API and N CPU workers, all in `tmp`; stopped on exit."""

    def __init__(
        self, tmp: Path, *, database_url: str | None = None, workers: int = 1, torch_threads: int = 0, log=print
    ):
        self.tmp, self.n_workers, self.torch_threads, self.log = tmp, workers, torch_threads, log
        self.database_url = database_url or f"sqlite:///{tmp / 'jobs.db'}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis = None

    def __enter__(self) -> Stack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from api.stack import worker_command, worker_env
        from core import auth, db, queue, settings
        from core.embedded import free_port, start_redis

        self.redis = start_redis(self.tmp / "redis")
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
        env.update(
            JOBS_HOME=str(self.tmp / "home"),
            JOBS_DATABASE_URL=self.database_url,
            JOBS_REDIS_URL=self.redis.url,
            JOBS_ARTIFACTS=str(self.tmp / "artifacts"),
            HF_HUB_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=str(ROOT),
        )
        self.env = env
        os.environ.update(env)
        for key in [k for k in os.environ if k.startswith("JOBS_") and k not in env]:
            del os.environ[key]
        settings.reset()
        db.dispose()
        queue.reset()
        db.upgrade()
        with db.session_scope() as session:
            self.token = auth.create_token(session, owner="bench", scopes=["admin", "user"], name="load bench")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._spawn(
            "api", [sys.executable, "-m", "uvicorn", "api.app:app", "--port", str(port), "--log-level", "warning"], env
        )
        threads = {"OMP_NUM_THREADS": str(self.torch_threads)} if self.torch_threads else {}
        for i in range(self.n_workers):
            self._spawn(f"worker{i}", worker_command([]), worker_env([], {**env, **threads}))
        self._wait(self._healthy, 60, "the API server")
        self._wait(self._registered, 120, f"{self.n_workers} worker(s) to register")
        pids = ", ".join(f"{name} {p.pid}" for name, p in self.procs.items())
        where = self.database_url.split("@")[-1]
        self.log(f"stack up: API {self.url}, {self.n_workers} worker(s), {where}; pids: {pids}", flush=True)

    def _spawn(self, name: str, cmd: list[str], env: dict) -> None:
        with open(self.tmp / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def dead(self) -> str | None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                return f"{name} (pid {p.pid}, exit {p.returncode}; log {self.tmp / (name + '.log')})"
        return None

    def _wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.dead():
                raise RuntimeError(f"{self.dead()} died while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _registered(self) -> bool:
        from sqlalchemy import func, select

        from core.db import session_scope
        from core.models import Worker

        pids = [p.pid for n, p in self.procs.items() if n.startswith("worker")]
        with session_scope(self.database_url) as session:
            online = session.scalar(select(func.count()).where(Worker.pid.in_(pids), Worker.state == "online"))
        return online == len(pids)

    def memory(self) -> dict[str, dict[str, int]]:
        return {name: memory(p.pid) for name, p in self.procs.items()}

    def cpu(self) -> dict[str, float | None]:
        return {name: cpu_seconds(p.pid) for name, p in self.procs.items()}

    def stop(self) -> None:
        from core.embedded import stop_process

        for p in self.procs.values():
            stop_process(p, timeout=20)
        if self.redis is not None:
            self.redis.stop()


# --- mixed owners and priorities (core/scheduling.py) -----------------------------------------------------------

MIXED_OWNERS = (("ann", "normal"), ("bob", "normal"), ("cat", "normal"), ("vip", "high"), ("batch", "low"))


def mixed(stack: Stack, model: Path, data_dir: Path, *, jobs: int, big_shards: int, timeout: float) -> dict:
    """`big` submits one job of `big_shards` 2-row shards; then `jobs` 1-2-row jobs of the owners in MIXED_OWNERS
    are submitted at once (8 connections). Waiting and turnaround percentiles per owner and priority, from SQL."""
    from sqlalchemy import func, select

    from api.client import Client
    from core import auth
    from core.db import session_scope
    from core.models import Job, Shard
    from core.scheduling import name

    with session_scope(stack.database_url) as session:
        tokens = {
            o: auth.create_token(session, owner=o, scopes=["user", "priority"])
            for o in ("big", *[o for o, _ in MIXED_OWNERS])
        }
    spec = job_spec(model, shard_rows=2, batch_rows=2)
    with Client(stack.url, tokens["big"]) as c:
        ids = [c.submit(spec, input=write_rows(data_dir / "mixed-big.jsonl", 2 * big_shards))["id"]]
    rng = random.Random(0)
    plan = [(MIXED_OWNERS[i % len(MIXED_OWNERS)], rng.randint(1, 2)) for i in range(jobs)]

    def submit_one(i: int) -> str:
        (owner, priority), rows = plan[i]
        with Client(stack.url, tokens[owner]) as c:
            return c.submit(spec, input=write_rows(data_dir / f"mixed-{i}.jsonl", rows), priority=priority)["id"]

    with ThreadPoolExecutor(8) as pool:
        ids += list(pool.map(submit_one, range(jobs)))
    wait_terminal(stack.database_url, ids, timeout, alive=stack.dead)
    with session_scope(stack.database_url) as session:
        rows = session.execute(
            select(Job.owner, Job.priority, Job.created_at, Job.finished_at, func.min(Shard.started_at))
            .join(Shard, Shard.job_id == Job.id)
            .where(Job.id.in_(ids))
            .group_by(Job.id)
        ).all()
    by_class: dict[str, dict[str, list[float]]] = {}
    for owner, priority, created, finished, started in rows:
        entry = by_class.setdefault(f"{owner}/{name(priority)}", {"wait_s": [], "turnaround_s": []})
        if started is not None:
            entry["wait_s"].append(started - created)
        if finished is not None:
            entry["turnaround_s"].append(finished - created)
    return {
        "jobs": jobs,
        "big_shards": big_shards,
        "audit": audit(stack.database_url, ids),
        "by_owner_priority": {k: {m: summary(v) for m, v in e.items()} for k, e in sorted(by_class.items())},
    }


# --- the claim's cost --------------------------------------------------------------------------------------------

CLAIM_QUEUE = "bench-claims"  # no worker consumes it


def claim_cost(
    database_url: str, *, jobs: int, shards_per_job: int, claims: int = 200, owners: int = 8, history: int = 2000
) -> dict:
    """ms per `core.leases.claim` on a queue holding `jobs` x `shards_per_job` queued shards of `owners` owners
    and three priorities, after `history` shards ran within the fair-share window. Its rows are deleted after."""
    from sqlalchemy import delete, insert, select

    from core import leases, scheduling
    from core.db import session_scope
    from core.models import Job, Shard, ShardRun
    from core.store import now

    t, rng = now(), random.Random(1)
    job_rows = [
        {
            "id": f"job_claims{i:06d}",
            "kind": "generate",
            "state": "running",
            "owner": f"owner{i % owners}",
            "spec": {},
            "queue": CLAIM_QUEUE,
            "gpus": 1,
            "rows_total": shards_per_job,
            "rows_succeeded": 0,
            "rows_failed": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "created_at": t - 3600 + i,
            "retries": 0,
            "priority": rng.choice((0, 1, 1, 2)),
        }
        for i in range(jobs)
    ]
    shard_rows = [
        {
            "job_id": j["id"],
            "idx": k,
            "row_start": k,
            "row_end": k + 1,
            "state": "queued",
            "attempts": 0,
            "max_attempts": 3,
            "rows_done": 0,
            "rows_failed": 0,
            "completion_tokens": 0,
            "enqueued_at": t,
            "queued_at": j["created_at"],
        }
        for j in job_rows
        for k in range(shards_per_job)
    ]
    ran = [
        {
            "job_id": job_rows[i % jobs]["id"],
            "idx": shards_per_job + i,
            "row_start": 0,
            "row_end": 1,
            "state": "succeeded",
            "attempts": 1,
            "max_attempts": 3,
            "rows_done": 1,
            "rows_failed": 0,
            "completion_tokens": 0,
            "started_at": t - rng.uniform(60, 3000),
            "finished_at": t - rng.uniform(0, 50),
        }
        for i in range(history)
    ]
    with session_scope(database_url) as session:
        session.execute(insert(Job), job_rows)
        for chunk in range(0, len(shard_rows) + len(ran), 5000):
            session.execute(insert(Shard), (shard_rows + ran)[chunk : chunk + 5000])
        runs = session.execute(  # each shard that ran is one ended attempt (what owners' GPU-seconds sum)
            select(Shard.id, Job.owner, Shard.started_at, Shard.finished_at)
            .join(Job, Job.id == Shard.job_id)
            .where(Job.queue == CLAIM_QUEUE, Shard.state == "succeeded")
        ).all()
        run_rows = [
            {"shard_id": i, "owner": o, "weight": 1.0, "started_at": s, "ended_at": e, "ended_as": "succeeded"}
            for i, o, s, e in runs
        ]
        session.execute(insert(ShardRun), run_rows)
        hint = session.scalar(select_first_shard(CLAIM_QUEUE))
    if database_url.startswith("postgresql"):  # fresh planner statistics, as autovacuum keeps them on a live store:
        from sqlalchemy import text  # without, a plan made for 100 shards scans 10,000 (80 ms a claim instead of 9)

        from core.db import get_engine

        with get_engine(database_url).connect() as conn:
            for table in ("jobs", "shards", "shard_runs"):
                conn.execute(text(f"ANALYZE {table}"))
            conn.commit()
    times, claimed, checks = [], [], []
    try:
        for i in range(min(claims, len(shard_rows))):
            t0 = time.perf_counter()
            with session_scope(database_url) as session:
                got = leases.claim(session, hint, f"bench{i}", 60.0)
            times.append(time.perf_counter() - t0)
            assert got is not None, "a claim found nothing on a queue with queued shards"
            claimed.append(got.shard.id)
        for shard_id in claimed[:100]:  # a worker's heartbeat question: yield to waiting work? (as after 1 s)
            t0 = time.perf_counter()
            with session_scope(database_url) as session:
                scheduling.yield_reason(session, shard_id, 1.0)
            checks.append(time.perf_counter() - t0)
    finally:
        with session_scope(database_url) as session:
            bench_shards = select(Shard.id).join(Job, Job.id == Shard.job_id).where(Job.queue == CLAIM_QUEUE)
            session.execute(delete(ShardRun).where(ShardRun.shard_id.in_(bench_shards)))
            session.execute(delete(Job).where(Job.queue == CLAIM_QUEUE))
    return {
        "queued_jobs": jobs,
        "queued_shards": len(shard_rows),
        "owners": owners,
        "history_shards": history,
        "claim_ms": milliseconds(times),
        "running_shards": len(claimed),
        "yield_check_ms": milliseconds(checks),
    }


def milliseconds(times: list[float]) -> dict:
    return {k: (None if v is None else round(v * 1000, 2)) for k, v in summary(times).items() if k != "n"} | {
        "n": len(times),
        "mean": round(1000 * sum(times) / len(times), 2),
    }


def select_first_shard(queue: str):
    from sqlalchemy import select

    from core.models import Job, Shard

    return select(Shard.id).join(Job, Job.id == Shard.job_id).where(Job.queue == queue).order_by(Shard.id).limit(1)


def build_model(out: Path) -> Path:
    """The tests' tiny Qwen3 architecture with random weights (nothing memorized: answers do not matter here)."""
    subprocess.run(
        [sys.executable, "-m", "worker.tinymodel", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    return out


def job_spec(model: Path, **extra) -> dict:
    return {"model": str(model), "gpus": 0, "max_new_tokens": 1, **extra}


def run(args: argparse.Namespace) -> dict:
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    report: dict = {
        "bench": "load",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **harness.commit_info(),
        "machine": harness.machine(),
        "versions": harness.versions(),
        "settings": settings,
    }
    database_url = args.database_url or os.environ.get("JOBS_BENCH_DATABASE_URL") or None
    with tempfile.TemporaryDirectory(prefix="gpujobs-load-") as tmp_name:
        tmp = Path(tmp_name)
        model = Path(args.model) if args.model else build_model(tmp / "model")
        with Stack(tmp, database_url=database_url, workers=args.workers, torch_threads=args.torch_threads) as stack:
            report["settings"]["database"] = stack.database_url.split("://")[0]
            report["warm_up_s"] = warm_up(
                stack.url, stack.token, job_spec(model), tmp, stack.database_url, workers=args.workers, alive=stack.dead
            )
            if args.submissions:
                print(f"burst: {args.submissions} submissions over {args.connections} connections ...", flush=True)
                data = tmp / "burst"
                data.mkdir()
                cpu = stack.cpu()
                with polling(stack.url, stack.token, pause=0.02) as poller:
                    b = burst(
                        stack.url,
                        stack.token,
                        job_spec(model),
                        data,
                        jobs=args.submissions,
                        connections=args.connections,
                        poller=poller,
                    )
                    if b.job_ids:
                        wait_terminal(stack.database_url, b.job_ids, args.timeout, alive=stack.dead)
                report["burst"] = burst_report(b, audit(stack.database_url, b.job_ids), poller)
                report["burst"]["cpu_s"] = cpu_delta(cpu, stack.cpu())
                report["memory_after_burst"] = stack.memory()
            if args.rows:
                print(f"big: one job of {args.rows} rows ...", flush=True)
                data = write_rows(tmp / "big.jsonl", args.rows)
                spec = job_spec(model, shard_rows=args.shard_rows, batch_rows=args.batch_rows)
                cpu = stack.cpu()
                with polling(stack.url, stack.token, pause=0.5) as poller:
                    big = submit_big(stack.url, stack.token, spec, data, args.rows)
                    poller.add(big.job_id)
                    wait_terminal(stack.database_url, [big.job_id], args.timeout, alive=stack.dead, interval=1)
                report["big"] = big_report(big, audit(stack.database_url, [big.job_id]), poller, spec, args.workers)
                report["big"]["cpu_s"] = cpu_delta(cpu, stack.cpu())
            if args.mixed:
                print(
                    f"mixed: one job of {args.mixed_big_shards} shards, then {args.mixed} small jobs of 5 owners ...",
                    flush=True,
                )
                data = tmp / "mixed"
                data.mkdir()
                report["mixed"] = mixed(
                    stack, model, data, jobs=args.mixed, big_shards=args.mixed_big_shards, timeout=args.timeout
                )
            report["memory"] = stack.memory()
            database_url = stack.database_url
        if args.claims:
            print("claims: the claim's cost at 100 queued jobs and at 10,000 queued shards ...", flush=True)
            report["claims"] = [claim_cost(database_url, jobs=100, shards_per_job=n) for n in (1, 100)]
    report["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = harness.parser(__doc__, out=None, out_help="JSON output (default ops/bench/results/load-<date>.json)")
    parser.prog = "python ops/bench/load.py"
    parser.add_argument("--submissions", type=int, default=1000, help="jobs of 1-2 rows submitted at once (0: skip)")
    parser.add_argument("--connections", type=int, default=64, help="concurrent HTTP connections for the burst")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the big job (0: skip)")
    parser.add_argument("--shard-rows", type=int, default=2000, help="rows per shard of the big job")
    parser.add_argument("--batch-rows", type=int, default=256, help="rows per committed micro-batch of the big job")
    parser.add_argument("--workers", type=int, default=2, help="CPU worker processes")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS of each worker (0: torch's default, one thread per core)",
    )
    parser.add_argument("--model", help="model directory (default: a tiny random Qwen3 built on the spot)")
    parser.add_argument("--database-url", help="a Postgres URL (also JOBS_BENCH_DATABASE_URL); default SQLite")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for each phase's jobs")
    parser.add_argument(
        "--mixed",
        type=int,
        default=0,
        help="small jobs of 5 owners and 3 priorities submitted behind one big job (0: skip)",
    )
    parser.add_argument("--mixed-big-shards", type=int, default=100, help="2-row shards of the mixed phase's big job")
    parser.add_argument(
        "--claims",
        action="store_true",
        help="measure the claim's cost (ms per claim at 100 queued jobs and at 10,000 queued shards)",
    )
    args = parser.parse_args(argv)
    report = run(args)
    out = args.out or harness.RESULTS / f"load-{dt.date.today().isoformat()}.json"
    harness.write_json(out, report)
    print(table(report))
    print(f"wrote {out}")
    ok = all(
        report.get(k, {}).get("audit", {}).get("rows_not_executed_once", 0) == 0 for k in ("burst", "big", "mixed")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
