"""Soak run (issue 12): the whole service, one pinned worker, a realistic sequence of jobs, every step checked and
time-boxed. Prints a table last; writes JSON (`soak.passed`, and per step: job ids, state, seconds, rows, restarts).

    bash ops/gpu/soak.sh                       # the device call: one H200, at most 9 minutes (.whl carried)
    bash ops/gpu/soak.sh --quick               # at most 4 minutes: what to run after every engine change
    python ops/gpu/soak.py --smoke             # this CPU: the tiny model for every step, small sizes, same code

The stack is started as a user starts it (`python -m api up --detach --gpus 0`: embedded Redis, SQLite, the API
under uvicorn, ONE worker pinned to GPU 0; `--gpus none` for --smoke) in a fresh JOBS_HOME, and driven over HTTP
with `api.client.Client`; rows and the worker registry are then read from its SQLite. Steps, in this order:

1. engines         the tiny model that memorized examples/qa.jsonl (plain prompts and chat messages), greedy, once
                   per engine (padded, fast, static, continuous): every engine's outputs equal the padded engine's
                   (plain `model.generate`) on every row, and the answers are the memorized ones.
2. g2_first        G2 (ops/bench/gen.py: Qwen3-0.6B architecture, random bf16 weights, EOS off; 2,048 rows, inputs
3. g2_second       32-1,024, outputs 16-512, the same rows as gen.py), twice in a row: cold, then on the warm engine.
4. g1              G1: 1,024 rows × 256 in + 256 out.
   shared_prefix   G3's shape, smaller: rows of one 1,024-word instruction and 64 words of their own (EOS off),
                   with the prefix cache off, then on: the same outputs; the second job reused the instruction and
                   took cascade decode steps (worker/engines/decode_attention.py; --smoke's rows are too few for
                   them: none), the first neither.
5. mixed           2,048 rows: half greedy (the fast engine), the rest with top_p, top_k or repetition_penalty (which
                   `auto` runs on the padded engine), over 4 shards.
6. cancel_retry    a long job cancelled once rows are committed (cancelled within a few seconds, the rows done
                   kept), then `retry`: the rest run and the job succeeds.
7. oom             a forced CUDA out-of-memory on the padded engine (sizes below), which must split its batch, say
                   so in the job's events, and finish every row.
8. finetune_chain  a LoRA fine-tune of a tiny base that knows no answer (examples/finetune.yaml, packed, 2 blocks
                   x 2 a step) chained to a generation job with the new adapter: the memorized answers come out; on
                   one GPU the step's blocks ran as one micro-batch (the path F1 takes); every step's loss, gradient
                   norm and time were logged once, in order (the lean trainer reads them one step late).
9. adapter         a generation job naming that adapter (plain prompts and chat messages): the same answers.

Every job: the expected end state within the step's bound; every row exactly once (`job_rows.executions` = 1, state
succeeded); where EOS is off, each row's completion tokens equal its max_new_tokens and its prompt tokens its
prompt's words. Across the run: one worker, never restarted (workers.restarts, exit_code and reason, migration
0005), the same process at the end, and no stall: no job event and no worker reason mentions "stall" (the stall
watchdog being written next to this records an error event on a stall; matching on the word is provisional).

The forced OOM: 2,048 rows of 768 one-token words, max_new_tokens 4, EOS off, `engine: padded`, `batch_rows` 2,048,
one shard. The first `model.generate` call asks for a KV cache of 2,048 × 768 tokens × 112 KiB = 168 GiB at prefill,
more than an H200 holds (~140 GiB), so it should fail within a few seconds, part way through the 28 layers; each
half needs 84 GiB of cache plus, by estimate, 20-25 GiB of activations, and should fit (if not, it splits again).
Seconds of GPU work in all (estimated: not yet run on the H200), and building the input is one string join: the old
check (2,048 × 4,000 tokens) spent minutes building and uploading 8M tokens and splitting three or four times, with
every failed attempt's prefill paid again. The prompts are short in bytes
(~6 per token), so the API's token check (against a context of 40,960) does not tokenize them either. --smoke has
no CUDA: its worker raises the out-of-memory with the test fault `oom_over_64@generate` (worker/faults.py), on the
same engine path; every other --smoke job keeps its padded calls at 64 rows or fewer.

A step that passes its bound is recorded failed with "slow or stuck" evidence: the stack of every thread of the
worker (`kill -USR2`, faulthandler, worker/main.py) copied from its log into the step's record and stacks.txt; its
live jobs are cancelled; a worker that does not stop them within 30 s is killed with SIGABRT (PYTHONFAULTHANDLER=1
dumps its stacks as it dies) and, unless a supervisor brings one back within 15 s, started again as `up` starts it,
so the next step can run (such a restart fails the soak). The whole run stays within --budget-s: a step that cannot
get 20 s is skipped, which fails the soak too.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

QA = [json.loads(line) for line in (ROOT / "examples" / "qa.jsonl").read_text().splitlines() if line.strip()]
TERMINAL = ("succeeded", "failed", "cancelled")
ENGINES = ("padded", "fast", "static", "continuous")  # padded first: plain model.generate is the reference
SEED = 0  # the G1/G2 rows of ops/bench/gen.py
STUCK_GRACE_S = 30  # a stuck step's jobs get this long to stop after their cancel before the worker is killed
YIELD_AFTER_S = "3"  # the stack's JOBS_YIELD_AFTER_SECONDS: the yield step's high job waits this long


@dataclass(frozen=True)
class Rows:
    """A synthetic workload: `n` rows, prompt words and max_new_tokens uniform in the given ranges."""

    n: int
    words: tuple[int, int]
    new: tuple[int, int]


@dataclass(frozen=True)
class Mode:
    name: str
    budget_s: float
    big_arch: str  # the G1/G2 model: qwen3-0.6b, or tiny for --smoke
    up_gpus: str  # `gpujobs up --gpus`
    gpus: int  # the spec's slice size
    batch_rows: int
    qa_copies: int  # the engines step: 6 questions × 2 forms × this many copies
    g2: Rows
    g1: Rows
    mixed: Rows
    cancel: Rows
    cancel_batch_rows: int
    cancel_s: float  # a cancel must end the job within this
    oom: Rows
    prefix: Rows  # shared_prefix: rows, (words of the shared instruction, words of each row's own part), new tokens
    bounds: dict[str, float]
    worker_env: dict[str, str] = field(default_factory=dict)
    poll_s: float = 0.25
    # the yield step's low job (None: no yield step, as in --smoke): more rows than the fast engine's slots and
    # outputs of many lengths, so rows finish, and are committed, all along (uniform lengths commit only at the end)
    yield_low: Rows | None = None
    # shared_prefix's rows × shared pages reach fastgen.CASCADE_MIN_READS (4,096): the cached job takes cascade steps
    # (quick: 256 rows × at least 16 pages, the 1,024-word instruction; smoke's 24 rows of a 300-word one stay far
    # below it)
    cascade: bool = True


G2 = Rows(2048, (32, 1024), (16, 512))
G1 = Rows(1024, (256, 256), (256, 256))
OOM = Rows(2048, (768, 768), (4, 4))
MODES = {
    "full": Mode(
        "full",
        570,
        "qwen3-0.6b",
        "0",
        1,
        256,
        8,
        G2,
        G1,
        Rows(2048, (16, 128), (8, 64)),
        Rows(1024, (32, 256), (64, 1024)),
        16,
        15,
        OOM,
        Rows(1024, (1024, 64), (64, 64)),
        dict(
            setup=150,
            engines=180,
            g2_first=150,
            g2_second=90,
            g1=90,
            shared_prefix=90,
            mixed=120,
            cancel_retry=120,
            oom=60,
            finetune_chain=150,
            adapter=60,
            **{"yield": 120},
        ),
        yield_low=Rows(4096, (32, 256), (16, 512)),
    ),
    "quick": Mode(
        "quick",
        360,
        "qwen3-0.6b",
        "0",
        1,
        256,
        4,
        Rows(512, G2.words, G2.new),
        Rows(256, (256, 256), (256, 256)),
        Rows(512, (16, 128), (8, 64)),
        Rows(512, (32, 256), (64, 512)),
        16,
        15,
        OOM,
        Rows(256, (1024, 64), (32, 32)),
        dict(
            setup=120,
            engines=150,
            g2_first=120,
            g2_second=60,
            g1=60,
            shared_prefix=60,
            mixed=60,
            cancel_retry=60,
            oom=60,
            finetune_chain=120,
            adapter=45,
            **{"yield": 120},
        ),
        yield_low=Rows(4096, (32, 256), (16, 512)),
    ),
    # CPU: every model tiny, every padded call at most 64 rows except the OOM step's, whose fault fires above 64
    "smoke": Mode(
        "smoke",
        1500,
        "tiny",
        "none",
        0,
        32,
        2,
        Rows(64, (4, 40), (2, 24)),
        Rows(32, (16, 16), (16, 16)),
        Rows(96, (4, 24), (4, 12)),
        Rows(128, (4, 24), (24, 24)),
        8,
        60,
        Rows(256, (8, 8), (4, 4)),
        Rows(24, (300, 8), (8, 8)),
        dict(
            setup=400,
            engines=300,
            g2_first=180,
            g2_second=180,
            g1=180,
            shared_prefix=240,
            mixed=240,
            cancel_retry=300,
            oom=240,
            finetune_chain=400,
            adapter=180,
        ),
        worker_env={"JOBS_TEST_FAULTS": "oom_over_64@generate", "OMP_NUM_THREADS": "1"},
        poll_s=0.2,
        cascade=False,
    ),
}


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


class Stuck(Exception):
    """A step's job (or process) did not end within the step's bound."""

    def __init__(self, what: str, state: str, bound: float):
        super().__init__(f"slow or stuck: {what} still {state} at the step's bound of {bound:.0f} s")


# --- the stack -------------------------------------------------------------------------------------------------


class Stack:
    """The stack `gpujobs up` started in `home`: its worker's pid, log and registry, and the means to dump, kill
    and restart that worker."""

    def __init__(self, home: Path, mode: Mode, env: dict[str, str]):
        self.home, self.mode, self.env = home, mode, env
        self.worker_log = home / "logs" / "worker-0.log"
        self.stacks_file = home / "stacks.txt"
        self.started_pid: int | None = None
        self.deliberate_restarts = 0

    def up(self, port: int, output: Path) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "api", "up", "--detach", "--gpus", self.mode.up_gpus, "--port", str(port)]
        out = open(output, "wb")  # noqa: SIM115  the child writes it
        return subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def read(self) -> dict:
        try:
            return json.loads((self.home / "run" / "stack.json").read_text())
        except (OSError, ValueError):
            return {}

    def worker_pid(self) -> int | None:
        """The live worker's pid as it registered itself (with a supervisor, stack.json may list another process):
        the newest registered process still alive, whatever its heartbeat says (a busy worker's may lag)."""
        alive = [w for w in registry() if _alive(w["pid"])]
        if alive:
            return max(alive, key=lambda w: w["started_at"])["pid"]
        workers = [p for p in self.read().get("workers") or [] if isinstance(p, int) and _alive(p)]
        return workers[0] if workers else None

    def down(self) -> None:
        subprocess.run([sys.executable, "-m", "api", "down"], env=self.env, cwd=ROOT, capture_output=True, timeout=120)

    def dump_stacks(self, label: str) -> str:
        """Every thread's stack of the worker (SIGUSR2 → faulthandler → its log), appended to stacks.txt."""
        pid = self.worker_pid()
        if not pid or not _alive(pid):
            return f"no live worker to dump (pid {pid})"
        start = self.worker_log.stat().st_size if self.worker_log.exists() else 0
        os.kill(pid, signal.SIGUSR2)
        time.sleep(2.0)
        with open(self.worker_log, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
        with open(self.stacks_file, "a") as f:
            f.write(f"===== {label}: worker {pid} at {time.strftime('%H:%M:%S')}\n{text}\n")
        return text[-12000:]

    def restart_worker(self, reason: str) -> int:
        """Kill the worker with SIGABRT (PYTHONFAULTHANDLER=1: it dumps its stacks as it dies) and start one again,
        as `gpujobs up` does (same command, pinned environment, same log), recording it in stack.json."""
        from core.slices import parse_slice, worker_command, worker_env

        pid = self.worker_pid()
        log(f"killing worker {pid} with SIGABRT: {reason}")
        if pid and _alive(pid):
            os.kill(pid, signal.SIGABRT)
            _wait_until(lambda: not _alive(pid), 30)
        self.deliberate_restarts += 1

        def another() -> int | None:
            return next(
                (w["pid"] for w in registry() if w["state"] == "online" and w["pid"] != pid and _alive(w["pid"])), None
            )

        if _wait_until(lambda: another() is not None, 15):  # a supervisor started one
            return another()
        devices = parse_slice(self.mode.up_gpus)
        stack = self.read()
        env = dict(self.env, JOBS_REDIS_URL=stack.get("redis_url", ""))
        with open(self.worker_log, "ab") as out:
            proc = subprocess.Popen(
                worker_command(devices),
                env=worker_env(devices, env),
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        stack["workers"] = [p for p in stack.get("workers", []) if p != pid] + [proc.pid]
        (self.home / "run" / "stack.json").write_text(json.dumps(stack, indent=2))
        _wait_until(lambda: any(w["pid"] == proc.pid and w["state"] == "online" for w in registry()), 180)
        return proc.pid


def _alive(pid: int) -> bool:
    from api.stack import alive

    return alive(pid)


def _wait_until(condition: Callable[[], bool], timeout: float, poll: float = 0.5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(poll)
    return condition()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- SQL reads ---------------------------------------------------------------------------------------------------


def registry() -> list[dict[str, Any]]:
    """Every worker row (migration 0005 fields included); none before `up` has migrated the store."""
    from core.db import session_scope
    from core.errors import JobsError
    from core.registry import all_workers

    try:
        with session_scope() as s:
            return [
                {
                    "name": w.name,
                    "pid": w.pid,
                    "state": w.state,
                    "restarts": w.restarts,
                    "exit_code": w.exit_code,
                    "reason": w.reason,
                    "started_at": w.started_at,
                    "stopped_at": w.stopped_at,
                    "heartbeat_at": w.heartbeat_at,
                    "slice": w.slice,
                }
                for w in all_workers(s)
            ]
    except JobsError as exc:  # no database yet, or no tables
        log(f"worker registry not readable: {exc}")
        return []


def restart_count(workers: list[dict[str, Any]]) -> int:
    """Restarts the registry shows: a supervisor's count on the newest row, or one row per process started."""
    return max([len(workers) - 1] + [w["restarts"] or 0 for w in workers]) if workers else 0


def stall_evidence() -> list[str]:
    """Job events and worker reasons that mention a stall (the stall watchdog's error events): the word, not
    "install"."""
    import re

    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import JobEvent, Worker

    with session_scope() as s:
        events = s.execute(
            select(JobEvent.job_id, JobEvent.message).where(func.lower(JobEvent.message).like("%stall%"))
        ).all()
        reasons = s.execute(select(Worker.name, Worker.reason).where(func.lower(Worker.reason).like("%stall%"))).all()
    found = [f"{job}: {msg}" for job, msg in events] + [f"worker {name}: {reason}" for name, reason in reasons]
    return [line for line in found if re.search(r"\bstall", line, re.IGNORECASE)]


def rows_report(job_id: str, expected: dict[int, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Each row once: counts by state, executions, and rows whose token counts differ from `expected`
    ({idx: (prompt tokens, completion tokens)}, for EOS-off rows)."""
    from sqlalchemy import select

    from core.db import session_scope
    from core.models import JobRow

    with session_scope() as s:
        rows = s.execute(
            select(
                JobRow.idx,
                JobRow.state,
                JobRow.executions,
                JobRow.prompt_tokens,
                JobRow.completion_tokens,
                JobRow.error,
            ).where(JobRow.job_id == job_id)
        ).all()
    states: dict[str, int] = {}
    for r in rows:
        states[r.state] = states.get(r.state, 0) + 1
    done = [r for r in rows if r.state == "succeeded"]
    wrong = [r.idx for r in done if expected and (r.prompt_tokens, r.completion_tokens) != expected.get(r.idx)]
    report = {
        "total": len(rows),
        "succeeded": states.get("succeeded", 0),
        "failed": states.get("failed", 0),
        "other": {k: v for k, v in states.items() if k not in ("succeeded", "failed")},
        "executions_min": min((r.executions for r in rows), default=None),
        "executions_max": max((r.executions for r in rows), default=None),
        "completion_tokens": sum(r.completion_tokens or 0 for r in done),
    }
    if expected is not None:
        report["wrong_token_counts"] = len(wrong)
        report["wrong_token_examples"] = [
            (
                i,
                *next((r.prompt_tokens, r.completion_tokens) for r in done if r.idx == i),
                *expected.get(i, (None, None)),
            )
            for i in wrong[:5]
        ]
    errors = [r.error for r in rows if r.error]
    if errors:
        report["first_error"] = errors[0][-500:]
    return report


def once_ok(report: dict[str, Any], total: int) -> bool:
    """Every one of `total` rows succeeded, and was written exactly once."""
    return (
        report["total"] == total
        and report["succeeded"] == total
        and report["executions_min"] == 1
        and report["executions_max"] == 1
        and not report.get("wrong_token_counts")
    )


def throughput(job_id: str) -> dict[str, Any]:
    """Output tokens ÷ (last row committed − first shard started), from SQL (as ops/bench/gen.py measures)."""
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import JobRow, Shard

    with session_scope() as s:
        tokens, last = s.execute(
            select(func.sum(JobRow.completion_tokens), func.max(JobRow.finished_at)).where(
                JobRow.job_id == job_id, JobRow.state == "succeeded"
            )
        ).one()
        first = s.execute(select(func.min(Shard.started_at)).where(Shard.job_id == job_id)).scalar()
    window = (last - first) if (last and first) else None
    return {
        "output_tokens": tokens,
        "window_s": window and round(window, 3),
        "output_tok_s": round(tokens / window, 1) if (tokens and window) else None,
    }


# --- inputs ------------------------------------------------------------------------------------------------------


def one_token_words(model: Path) -> list[str]:
    """' word' strings the model's tokenizer makes exactly one token of (N of them joined are N tokens); the same
    list, in the same order, as ops/bench/harness.py's, so the same seed gives gen.py's G1/G2 rows."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = []
    for tid in range(tok.get_vocab_size()):
        piece = tok.id_to_token(tid)
        if piece and piece.startswith("Ġ") and piece[1:].isalpha():
            text = tok.decode([tid], skip_special_tokens=False)
            if tok.encode(text, add_special_tokens=False).ids == [tid]:
                words.append(text)
    if len(words) < 20:
        raise RuntimeError(f"only {len(words)} one-token words in {model}'s tokenizer: cannot build prompts")
    return words


def synthetic(words: list[str], rows: Rows, seed: int = SEED) -> list[tuple[str, int, int]]:
    """(prompt, prompt tokens, max_new_tokens) per row, drawn as ops/bench/gen.py's `workload()` draws them."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows.n):  # a fixed size draws no number (gen.py's G1 draws none)
        n = rows.words[0] if rows.words[0] == rows.words[1] else rng.randint(*rows.words)
        prompt = "".join(rng.choice(words) for _ in range(n))
        out.append((prompt, n, rows.new[0] if rows.new[0] == rows.new[1] else rng.randint(*rows.new)))
    return out


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def qa_records(copies: int) -> list[dict[str, Any]]:
    """The memorized questions as plain prompts (p…) and as chat messages (c…), `copies` times each."""
    out = []
    for k in range(copies):
        for i, qa in enumerate(QA):
            out.append({"prompt": qa["question"], "custom_id": f"p{i}-{k}"})
            out.append({"messages": [{"role": "user", "content": qa["question"]}], "custom_id": f"c{i}-{k}"})
    return out


def memorized(outputs: dict[str, str]) -> int:
    """Rows whose output is the memorized answer of their question (custom ids p<i>-<k> / c<i>-<k>)."""
    return sum(out == QA[int(cid[1:].split("-")[0])]["answer"] for cid, out in outputs.items())


# --- steps -------------------------------------------------------------------------------------------------------


class Step:
    """One step's record and clock: jobs it submitted, checks, rows, seconds; `wait` stops at the step's bound."""

    def __init__(self, soak: Soak, name: str, bound: float):
        self.soak, self.name, self.bound = soak, name, bound
        self.t0 = time.monotonic()
        self.deadline = self.t0 + bound
        self.record: dict[str, Any] = {
            "name": name,
            "bound_s": round(bound, 1),
            "job_ids": [],
            "state": None,
            "checks": {},
            "rows": None,
            "restarts": 0,
        }

    def check(self, name: str, ok: bool, **detail: Any) -> bool:
        self.record["checks"][name] = {"ok": bool(ok), **detail}
        if not ok:
            log(f"{self.name}: check {name} FAILED {detail}")
        return bool(ok)

    def submit(self, spec: dict[str, Any]) -> str:
        job = self.soak.client.submit({"gpus": self.soak.mode.gpus, **spec})
        self.record["job_ids"].append(job["id"])
        return job["id"]

    def wait(self, job_id: str, until: Callable[[dict], bool] | None = None) -> dict:
        """Poll until the job is terminal (or `until(job)`), or raise Stuck at the step's bound."""
        until = until or (lambda job: job["state"] in TERMINAL)
        while True:
            job = self.soak.client.job(job_id)
            if until(job) or job["state"] in TERMINAL:
                return job
            if time.monotonic() > self.deadline:
                raise Stuck(f"job {job_id}", job["state"], self.bound)
            time.sleep(self.soak.mode.poll_s)

    def finish(self, job: dict, expected_state: str = "succeeded") -> bool:
        self.record["state"] = job["state"]
        return self.check(
            "state",
            job["state"] == expected_state,
            want=expected_state,
            got=job["state"],
            error=(job.get("error") or "")[-500:] or None,
        )

    def rows(self, job_id: str, total: int, expected: dict[int, tuple[int, int]] | None = None) -> dict:
        report = rows_report(job_id, expected)
        self.record["rows"] = report
        self.check("every_row_once", once_ok(report, total), total=total)
        return report

    @property
    def passed(self) -> bool:
        checks = self.record["checks"].values()
        return bool(checks) and all(c["ok"] for c in checks) and not self.record.get("error")


class Soak:
    def __init__(self, mode: Mode, work: Path, models: Path):
        self.mode, self.work, self.models = mode, work, models
        self.client = None
        self.stack: Stack | None = None
        self.deadline = time.monotonic() + mode.budget_s
        self.steps: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}  # what later steps need from earlier ones (file ids, the adapter)
        self.words: list[str] = []  # one-token words of the G1/G2 model's tokenizer
        self.paths = {
            "tiny_qa": models / "tiny-qa",
            "tiny_base": models / "tiny-base",
            "big": models / ("tiny-random" if mode.big_arch == "tiny" else "qwen3-0.6b"),
        }

    # --- running steps ---

    def run(self, name: str, fn: Callable[[Step], None], *, worker: bool = True) -> dict[str, Any]:
        left = self.deadline - time.monotonic() - 20  # 20 s kept for the final checks and `down`
        bound = min(self.mode.bounds[name], left)
        if left < 20:
            record = {"name": name, "skipped": f"{left:.0f} s of the budget left", "checks": {}, "job_ids": []}
            log(f"{name}: skipped, {left:.0f} s of the budget left")
            self.steps.append(record)
            return record
        before = restart_count(registry()) if worker else 0
        if worker:
            self.ensure_worker(name)
        step = Step(self, name, bound)
        cut = f", cut from its {self.mode.bounds[name]:.0f} s by the budget" if bound < self.mode.bounds[name] else ""
        log(f"{name}: start (bound {bound:.0f} s{cut})")
        if cut:  # past it the step fails as slow or stuck: the record says the budget, not the step, set the bound
            step.record["bound_cut_by_budget"] = True
        try:
            fn(step)
        except Stuck as exc:
            step.record["error"] = str(exc)
            try:
                step.record["evidence"] = self.stuck(step, exc)
            except Exception:  # noqa: BLE001  the evidence is best effort; the run goes on
                step.record["evidence"] = {"error": traceback.format_exc()[-3000:]}
        except Exception as exc:  # a failed step is recorded; the next one still runs
            step.record["error"] = f"{type(exc).__name__}: {exc}"
            step.record["traceback"] = traceback.format_exc()[-4000:]
            log(f"{name}: error {traceback.format_exc()}")
        step.record["seconds"] = round(time.monotonic() - step.t0, 2)
        step.record["restarts"] = restart_count(registry()) - before if worker else 0
        step.record["passed"] = step.passed and step.record["restarts"] == 0
        self.steps.append(step.record)
        log(f"{name}: {'passed' if step.record['passed'] else 'FAILED'} in {step.record['seconds']} s")
        return step.record

    def ensure_worker(self, before_step: str) -> None:
        pid = self.stack.worker_pid()
        if not (pid and _alive(pid)):  # a supervisor's restart is waited for there, and counted by the registry
            self.stack.restart_worker(f"no live worker before step {before_step}")

    def stuck(self, step: Step, exc: Stuck) -> dict[str, Any]:
        """Evidence for a step past its bound: the worker's stacks, then its live jobs cancelled; a worker that
        does not stop them is killed (stacks again) and started anew so the next step can run."""
        log(f"{step.name}: {exc}: dumping the worker's stacks")
        evidence: dict[str, Any] = {"stacks": self.stack.dump_stacks(f"{step.name} past its bound")}
        live = []
        for job_id in step.record["job_ids"]:
            try:
                if self.client.job(job_id)["state"] not in TERMINAL:
                    self.client.cancel(job_id)
                    live.append(job_id)
            except Exception as err:  # noqa: BLE001  evidence gathering must not end the run
                evidence.setdefault("cancel_errors", []).append(f"{job_id}: {err}")
        stopped = _wait_until(lambda: all(self.client.job(j)["state"] in TERMINAL for j in live), STUCK_GRACE_S)
        evidence["cancelled"] = live
        evidence["stopped_after_cancel"] = stopped
        if not stopped:
            evidence["worker_killed"] = True
            evidence["new_worker_pid"] = self.stack.restart_worker(
                f"step {step.name}: jobs {live} did not stop within {STUCK_GRACE_S} s of their cancel"
            )
        return evidence

    # --- the steps ---

    def engines(self, step: Step) -> None:
        records = qa_records(self.mode.qa_copies)
        file_id = self.client.upload(write_jsonl(self.work / "qa.jsonl", records))["id"]
        jobs = {
            e: step.submit(
                {
                    "model": str(self.paths["tiny_qa"]),
                    "input": file_id,
                    "max_new_tokens": 16,
                    "engine": e,
                    "batch_rows": len(records),
                    "name": f"soak engines: {e}",
                }
            )
            for e in ENGINES
        }
        for kind in ("fp8", "int8"):  # the fast engine with a quantized KV cache (kv_cache_dtype)
            jobs[f"fast_{kind}"] = step.submit(
                {
                    "model": str(self.paths["tiny_qa"]),
                    "input": file_id,
                    "max_new_tokens": 16,
                    "engine": "fast",
                    "kv_cache_dtype": kind,
                    "batch_rows": len(records),
                    "name": f"soak engines: fast, kv_cache_dtype {kind}",
                }
            )
        outputs: dict[str, dict[str, str]] = {}
        states = {}
        for engine, job_id in jobs.items():
            job = step.wait(job_id)
            states[engine] = job["state"]
            report = rows_report(job_id)
            step.check(
                f"{engine}_succeeded_once",
                job["state"] == "succeeded" and once_ok(report, len(records)),
                state=job["state"],
                rows=report,
                error=(job.get("error") or "")[-300:] or None,
            )
            if job["state"] == "succeeded":
                outputs[engine] = {r["custom_id"]: r["output"] for r in self.client.results(job_id)}
        step.record["state"] = "succeeded" if set(states.values()) == {"succeeded"} else json.dumps(states)
        reference = outputs.get("padded", {})
        for engine in ENGINES[1:]:
            got = outputs.get(engine, {})
            differ = sorted(cid for cid in reference if got.get(cid) != reference[cid])
            step.check(
                f"{engine}_equals_padded",
                bool(reference) and bool(got) and not differ,
                differ=len(differ),
                examples={c: [reference[c], got.get(c)] for c in differ[:3]},
            )
        right = memorized(reference)
        step.check("memorized_answers", right >= 0.95 * len(records), right=right, of=len(records))
        for kind in ("fp8", "int8"):  # the rounding may move a greedy pick: the answers, not equality
            got = outputs.get(f"fast_{kind}", {})
            step.check(
                f"fast_{kind}_memorized_answers",
                memorized(got) >= 0.95 * len(records),
                right=memorized(got),
                of=len(records),
                differ_from_padded=sum(got.get(cid) != out for cid, out in reference.items()),
            )
        step.record["rows"] = {"total": len(records) * len(jobs), "per_engine": len(records)}

    def g2(self, step: Step, second: bool) -> None:
        data = self.state.get("g2")
        if data is None:
            data = synthetic(self.words, self.mode.g2)
            path = write_jsonl(
                self.work / "g2.jsonl",
                [{"prompt": p, "max_new_tokens": o, "custom_id": f"r{i}"} for i, (p, _, o) in enumerate(data)],
            )
            self.state["g2"] = data
            self.state["g2_file"] = self.client.upload(path)["id"]
        job_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.state["g2_file"],
                "ignore_eos": True,
                "batch_rows": self.mode.batch_rows,
                "shard_rows": len(data),
                "name": f"soak g2 ({'second' if second else 'first'})",
            }
        )
        step.finish(step.wait(job_id))
        step.rows(job_id, len(data), {i: (n, o) for i, (_, n, o) in enumerate(data)})
        step.record["throughput"] = throughput(job_id)
        outputs = {r["custom_id"]: r["output"] for r in self.client.results(job_id)}
        if second and self.state.get("g2_outputs"):  # informational: greedy rows of two runs on one engine
            first = self.state["g2_outputs"]
            step.record["equal_to_first_run"] = sum(outputs.get(k) == v for k, v in first.items())
        self.state["g2_outputs"] = outputs

    def g1(self, step: Step) -> None:
        data = synthetic(self.words, self.mode.g1)
        path = write_jsonl(
            self.work / "g1.jsonl", [{"prompt": p, "custom_id": f"r{i}"} for i, (p, _, _) in enumerate(data)]
        )
        new = self.mode.g1.new[0]
        job_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.client.upload(path)["id"],
                "max_new_tokens": new,
                "ignore_eos": True,
                "batch_rows": self.mode.batch_rows,
                "shard_rows": len(data),
                "name": "soak g1",
            }
        )
        step.finish(step.wait(job_id))
        step.rows(job_id, len(data), {i: (n, new) for i, (_, n, _) in enumerate(data)})
        step.record["throughput"] = throughput(job_id)

    def shared_prefix(self, step: Step) -> None:
        """G3's shape, smaller: rows of one long shared instruction and a part of their own, EOS off, run with the
        prefix cache off, then on (the shared pages prefilled once, and read once a decode step for every row by the
        cascade): the same outputs; the second job reused the instruction and took cascade steps."""
        shared, own = self.mode.prefix.words
        rng = random.Random(SEED + 5)
        instruction = "".join(rng.choice(self.words) for _ in range(shared))
        data = synthetic(self.words, Rows(self.mode.prefix.n, (own, own), self.mode.prefix.new), seed=SEED + 5)
        path = write_jsonl(
            self.work / "prefix.jsonl",
            [{"prompt": instruction + p, "custom_id": f"s{i}"} for i, (p, _, _) in enumerate(data)],
        )
        file_id = self.client.upload(path)["id"]
        new = self.mode.prefix.new[0]
        outputs, fast = {}, {}
        for mode in ("off", "auto"):
            job_id = step.submit(
                {
                    "model": str(self.paths["big"]),
                    "input": file_id,
                    "engine": "fast",
                    "prefix_cache": mode,
                    "max_new_tokens": new,
                    "ignore_eos": True,
                    "batch_rows": self.mode.batch_rows,
                    "shard_rows": len(data),
                    "name": f"soak shared prefix, prefix_cache {mode}",
                }
            )
            job = step.wait(job_id)
            step.check(f"state_{mode}", job["state"] == "succeeded", got=job["state"], error=job.get("error"))
            step.rows(job_id, len(data), {i: (shared + n, new) for i, (_, n, _) in enumerate(data)})
            step.record["checks"][f"every_row_once_{mode}"] = step.record["checks"].pop("every_row_once")
            outputs[mode] = {r["custom_id"]: r["output"] for r in self.client.results(job_id)}
            fast[mode] = ((job.get("load_options") or {}).get("engine") or {}).get("fast") or {}
        step.record["state"] = job["state"]
        step.record["fast"] = {
            m: {k: f.get(k) for k in ("prefix_tokens_reused", "cascade_steps", "steps")} for m, f in fast.items()
        }
        same = sum(outputs["auto"].get(k) == v for k, v in outputs["off"].items())
        step.check("outputs_equal", same == len(data), equal=same, rows=len(data))
        for key, expected in (("prefix_tokens_reused", True), ("cascade_steps", self.mode.cascade)):
            on, off = fast["auto"].get(key) or 0, fast["off"].get(key) or 0
            step.check(key, (on > 0) == expected and off == 0, on=on, off=off)

    def mixed(self, step: Step) -> None:
        """Half greedy rows (fast engine on CUDA), a sixth each with top_p, top_k, repetition_penalty (padded)."""
        data = synthetic(self.words, self.mode.mixed, seed=SEED + 1)
        kinds = [
            {},
            {},
            {},
            {"temperature": 0.8, "top_p": 0.9, "max_new_tokens": 32},
            {"temperature": 0.8, "top_k": 40, "max_new_tokens": 32},
            {"repetition_penalty": 1.3, "max_new_tokens": 32},
        ]
        records, expected = [], {}
        for i, (prompt, n, new) in enumerate(data):
            params = {"max_new_tokens": new, **kinds[i % len(kinds)]}
            records.append({"prompt": prompt, "custom_id": f"m{i}", **params})
            expected[i] = (n, params["max_new_tokens"])
        path = write_jsonl(self.work / "mixed.jsonl", records)
        job_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.client.upload(path)["id"],
                "ignore_eos": True,
                "batch_rows": self.mode.batch_rows,
                "shard_rows": max(1, len(data) // 4),
                "name": "soak mixed sampling",
            }
        )
        job = step.wait(job_id)
        step.finish(job)
        step.rows(job_id, len(data), expected)
        step.record["engine"] = (job.get("load_options") or {}).get("engine")

    def cancel_retry(self, step: Step) -> None:
        data = synthetic(self.words, self.mode.cancel, seed=SEED + 2)
        path = write_jsonl(
            self.work / "cancel.jsonl",
            [{"prompt": p, "max_new_tokens": o, "custom_id": f"k{i}"} for i, (p, _, o) in enumerate(data)],
        )
        job_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.client.upload(path)["id"],
                "ignore_eos": True,
                "batch_rows": self.mode.cancel_batch_rows,
                "shard_rows": len(data),
                "name": "soak cancel then retry",
            }
        )
        job = step.wait(job_id, until=lambda j: j["state"] == "running" and j["rows"]["succeeded"] > 0)
        if not step.check(
            "running_with_rows_committed",
            job["state"] == "running",
            state=job["state"],
            note="the job must still run once rows are committed: make it longer if it ended",
        ):
            return
        t = time.monotonic()
        self.client.cancel(job_id)
        job = step.wait(job_id)
        cancel_s = time.monotonic() - t
        kept = job["rows"]["succeeded"]
        step.check(
            "cancelled_promptly",
            job["state"] == "cancelled" and cancel_s <= self.mode.cancel_s,
            state=job["state"],
            seconds=round(cancel_s, 2),
            bound_s=self.mode.cancel_s,
        )
        step.check("rows_kept", 0 < kept < len(data), kept=kept, of=len(data))
        self.client.retry(job_id)
        step.finish(step.wait(job_id))
        step.rows(job_id, len(data), {i: (n, o) for i, (_, n, o) in enumerate(data)})
        step.record["cancel"] = {"seconds": round(cancel_s, 2), "rows_kept": kept}

    def oom(self, step: Step) -> None:
        data = synthetic(self.words, self.mode.oom, seed=SEED + 3)
        path = write_jsonl(
            self.work / "oom.jsonl", [{"prompt": p, "custom_id": f"o{i}"} for i, (p, _, _) in enumerate(data)]
        )
        new = self.mode.oom.new[0]
        job_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.client.upload(path)["id"],
                "max_new_tokens": new,
                "ignore_eos": True,
                "engine": "padded",
                "batch_rows": len(data),
                "shard_rows": len(data),
                "name": "soak forced OOM",
            }
        )
        step.finish(step.wait(job_id))
        step.rows(job_id, len(data), {i: (n, new) for i, (_, n, _) in enumerate(data)})
        splits = [e["message"] for e in self.client.events(job_id) if "out of memory" in e["message"]]
        step.check(
            "out_of_memory_split", bool(splits), events=splits[:8], injected="JOBS_TEST_FAULTS" in self.mode.worker_env
        )

    def finetune_chain(self, step: Step) -> None:
        import yaml

        spec = yaml.safe_load((ROOT / "examples" / "finetune.yaml").read_text())
        qa_file = self.client.upload(
            write_jsonl(self.work / "qa-plain.jsonl", [r for r in qa_records(1) if "prompt" in r])
        )["id"]
        spec.update(
            model=str(self.paths["tiny_base"]),
            name="soak fine-tune",
            # packed, 2 blocks x 2 a step: on a GPU the worker runs them as one micro-batch of 4 (the default for
            # packed rows on one GPU, setup.MERGE_MICRO_BATCHES), the path F1 takes; the CPU runs 2 x 2
            packing=True,
            max_seq_length=48,
            batch_size=2,
            gradient_accumulation=2,
            input=self.client.upload(ROOT / "examples" / "finetune_qa.jsonl")["id"],
            then_generate={"input": qa_file, "max_new_tokens": 16, "name": "soak chained generation"},
        )
        tune_id = step.submit(spec)
        tune = step.wait(tune_id)
        training = (tune.get("metrics") or {}).get("training") or {}
        step.check(
            "finetune_succeeded",
            tune["state"] == "succeeded",
            state=tune["state"],
            error=(tune.get("error") or "")[-500:] or None,
            final_loss=training.get("final_loss"),
        )
        micro = (training.get("speed") or {}).get("micro_batches")
        step.check("micro_batches_merged_on_a_gpu", bool(micro and micro["merged"]) == (self.mode.gpus == 1), got=micro)
        # each step's loss and gradient norm are read back one step late (setup.lean_trainer): on a GPU through a
        # CUDA event, which the CPU tests fake; every step must still come once, in order, with its own time
        logged = [e["data"] for e in self.client.all_events(tune_id) if e["kind"] == "metric" and "loss" in e["data"]]
        step.check(
            "every_step_logged_once_in_order",
            [r["step"] for r in logged] == list(range(1, spec["max_steps"] + 1))
            and all(r["loss"] is not None and r.get("grad_norm") is not None for r in logged)
            and all((r.get("step_seconds") or 0) > 0 for r in logged),
            steps=[r["step"] for r in logged][-5:],
            count=len(logged),
            unlogged_or_untimed=[r["step"] for r in logged if not (r.get("step_seconds") or 0) > 0][:5],
        )
        gen_id = (tune.get("metrics") or {}).get("then_generate_job")
        if not step.check("chained_job_created", bool(gen_id)):
            step.record["state"] = tune["state"]
            return
        step.record["job_ids"].append(gen_id)
        step.finish(step.wait(gen_id))
        step.rows(gen_id, len(QA))
        outputs = {r["custom_id"]: r["output"] for r in self.client.results(gen_id)}
        step.check(
            "memorized_after_finetune",
            memorized(outputs) >= len(QA) - 1,
            right=memorized(outputs),
            of=len(QA),
            outputs=outputs,
        )
        if tune["state"] == "succeeded":
            self.state["adapter"], self.state["chained_outputs"] = tune_id, outputs

    def yield_(self, step: Step) -> None:
        """A low-priority job of one long shard runs on the fast engine; a high-priority job submitted then waits
        JOBS_YIELD_AFTER_SECONDS (YIELD_AFTER_S here), the low shard yields after its micro-batch, the high job runs,
        then the low one goes on and finishes: one yield event, every row of both exactly once with its tokens."""
        data = synthetic(self.words, self.mode.yield_low, seed=SEED + 4)
        low_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.client.upload(
                    write_jsonl(
                        self.work / "yield-low.jsonl",
                        [{"prompt": p, "max_new_tokens": o, "custom_id": f"y{i}"} for i, (p, _, o) in enumerate(data)],
                    )
                )["id"],
                "ignore_eos": True,
                "batch_rows": self.mode.batch_rows,
                "shard_rows": len(data),
                "priority": "low",
                "name": "soak yield: the low job",
            }
        )
        step.wait(low_id, until=lambda j: j["state"] == "running" and j["rows"]["succeeded"] > 0)
        urgent = synthetic(self.words, Rows(64, (16, 64), (32, 32)), seed=SEED + 5)
        high_id = step.submit(
            {
                "model": str(self.paths["big"]),
                "input": self.client.upload(
                    write_jsonl(
                        self.work / "yield-high.jsonl",
                        [
                            {"prompt": p, "max_new_tokens": o, "custom_id": f"h{i}"}
                            for i, (p, _, o) in enumerate(urgent)
                        ],
                    )
                )["id"],
                "ignore_eos": True,
                "priority": "high",
                "name": "soak yield: the high job",
            }
        )
        high = step.wait(high_id)
        step.finish(high)
        step.rows(high_id, len(urgent), {i: (n, o) for i, (_, n, o) in enumerate(urgent)})
        low = step.wait(low_id)
        step.check("low_succeeded", low["state"] == "succeeded", state=low["state"], error=low.get("error"))
        low_rows = rows_report(low_id, {i: (n, o) for i, (_, n, o) in enumerate(data)})
        step.check("low_rows_once", once_ok(low_rows, len(data)), **low_rows)
        yields = [e for e in self.client.events(low_id) if e["kind"] == "yield"]
        step.check("low_yielded_once", len(yields) == 1, events=[e["message"] for e in yields])
        step.check("high_finished_first", (high["finished_at"] or 0) < (low["finished_at"] or 0))
        if yields:
            asked = yields[0]["data"]["requested_at"]
            step.record["yield"] = {
                "asked_after_high_submit_s": round(asked - high["created_at"], 2),
                "high_start_after_ask_s": round(high["started_at"] - asked, 2),
                "at": yields[0]["data"]["at"],
                "low_rows": len(data),
            }

    def adapter(self, step: Step) -> None:
        adapter = self.state.get("adapter")
        if not step.check("adapter_available", bool(adapter), note="from the finetune_chain step"):
            return
        records = qa_records(2)
        job_id = step.submit(
            {
                "model": str(self.paths["tiny_base"]),
                "adapter": adapter,
                "max_new_tokens": 16,
                "input": self.client.upload(write_jsonl(self.work / "qa-adapter.jsonl", records))["id"],
                "batch_rows": len(records),
                "name": "soak generation with the adapter",
            }
        )
        job = step.wait(job_id)
        step.finish(job)
        step.rows(job_id, len(records))
        outputs = {r["custom_id"]: r["output"] for r in self.client.results(job_id)}
        step.check(
            "memorized_with_adapter", memorized(outputs) >= len(records) - 2, right=memorized(outputs), of=len(records)
        )
        chained = self.state.get("chained_outputs", {})
        differ = [cid for cid, out in chained.items() if outputs.get(cid) != out]
        step.check("equals_chained_job", not differ, differ=differ)
        step.record["adapter"] = ((job.get("load_options") or {}).get("adapter") or {}).get("id")


# --- setup, final checks, report ---------------------------------------------------------------------------------


def build_models(soak: Soak) -> dict[str, subprocess.Popen]:
    """Start building what is missing, each in its own process (the 0.6B shape on the GPU takes ~25 s)."""
    qa = str(ROOT / "examples" / "qa.jsonl")
    wanted = {
        "tiny_qa": ["--qa", qa],
        "tiny_base": ["--base", "--qa", qa],
        "big": ["--arch", "tiny", "--steps", "1"] if soak.mode.big_arch == "tiny" else ["--arch", "qwen3-0.6b"],
    }
    procs = {}
    soak.models.mkdir(parents=True, exist_ok=True)
    for key, extra in wanted.items():
        path = soak.paths[key]
        if not (path / "model.safetensors").exists():
            out = open(soak.work / f"build-{key}.log", "wb")
            procs[f"build_{key}"] = subprocess.Popen(
                [sys.executable, "-m", "worker.tinymodel", str(path), *extra],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    return procs


def setup(soak: Soak, step: Step) -> None:
    """Models built (in parallel with the stack's start), a fresh stack up, the client and the word list ready."""
    builds = build_models(soak)
    stack = soak.stack
    stack.down()  # a stack left by an earlier run from this home
    shutil.rmtree(stack.home, ignore_errors=True)
    stack.home.mkdir(parents=True)
    up = stack.up(free_port(), soak.work / "up.log")
    for name, proc in {"up": up, **builds}.items():
        try:
            proc.wait(timeout=max(1.0, step.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            raise Stuck(f"{name} (pid {proc.pid})", "running", step.bound) from None
        output = soak.work / ("up.log" if name == "up" else f"{name.replace('build_', 'build-')}.log")
        step.check(
            f"{name}_exit_0",
            proc.returncode == 0,
            command=" ".join(map(str, proc.args[1:])),
            returncode=proc.returncode,
            output=None if proc.returncode == 0 else output.read_text(errors="replace")[-3000:],
        )
    if up.returncode != 0:
        raise RuntimeError(f"gpujobs up failed: {(soak.work / 'up.log').read_text(errors='replace')[-3000:]}")
    from api.client import Client
    from core.settings import reset

    reset()
    soak.client = Client()
    stack.started_pid = stack.worker_pid()
    soak.words = one_token_words(soak.paths["big"])
    workers = registry()
    step.check("one_worker_online", len(workers) == 1 and workers[0]["state"] == "online", workers=workers)
    step.record["state"] = "up"


def final_checks(soak: Soak) -> dict[str, Any]:
    workers = registry()
    pid = soak.stack.worker_pid()
    stalls = stall_evidence()
    checks = {
        "one_worker_registered": {"ok": len(workers) == 1, "workers": len(workers)},
        "no_restart": {
            "ok": restart_count(workers) == 0 and soak.stack.deliberate_restarts == 0,
            "registry_restarts": restart_count(workers),
            "restarts_by_soak": soak.stack.deliberate_restarts,
        },
        "same_worker_process": {
            "ok": pid == soak.stack.started_pid and bool(pid) and _alive(pid),
            "started": soak.stack.started_pid,
            "now": pid,
        },
        "worker_online_no_exit": {
            "ok": all(
                w["state"] == "online"
                and time.time() - w["heartbeat_at"] < 30
                and w["exit_code"] is None
                and not w["reason"]
                for w in workers
            ),
            "workers": workers,
        },
        "no_stall": {
            "ok": not stalls,
            "evidence": stalls[:20],
            "note": "matches 'stall' in job events and worker reasons (the stall watchdog's error events)",
        },
    }
    return checks


def log_errors(path: Path, keep: int = 10) -> dict[str, Any]:
    """ERROR lines and tracebacks of a log (evidence, not a check: an expected out-of-memory is logged too)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    errors = [ln for ln in lines if " ERROR " in ln or ln.startswith(("Traceback", "Fatal Python"))]
    return {"count": len(errors), "first": [ln[:300] for ln in errors[:keep]]}


def worker_info() -> dict[str, Any]:
    """What the worker registered: its GPUs (name, UUID, memory) and library versions."""
    from core.db import session_scope
    from core.registry import all_workers

    with session_scope() as s:
        w = next(iter(all_workers(s)), None)
        if w is None:
            return {}
        return {
            "name": w.name,
            "gpus": w.gpus,
            "versions": (w.capabilities or {}).get("versions"),
            "torch_cuda": (w.capabilities or {}).get("torch_cuda"),
        }


def commit_info() -> dict[str, Any]:
    """The commit the soak ran: SOAK_COMMIT when the caller names it (a device call's copy of .git can be older than
    the working tree it carries: git then names that older commit and lists the changed files as modified)."""
    if os.environ.get("SOAK_COMMIT"):
        return {"commit": os.environ["SOAK_COMMIT"]}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
        ).stdout
        return {"commit": head.stdout.strip(), "modified": [ln[3:] for ln in dirty.splitlines()]}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": os.environ.get("SOAK_COMMIT")}


def nvidia_smi() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    return subprocess.run(
        [smi, "--query-gpu=index,name,uuid,memory.total,memory.used", "--format=csv"], capture_output=True, text=True
    ).stdout.strip()


def print_table(report: dict[str, Any]) -> None:
    print()
    print(
        f"SOAK {report['mode']}: {'PASSED' if report['passed'] else 'FAILED'} in {report['total_s']} s "
        f"(budget {report['budget_s']} s); commit {report.get('commit')}"
    )
    print(
        f"{'step':<16}{'result':<8}{'state':<12}{'seconds':>9}{'bound':>7}{'rows ok/total':>15}{'exec':>6}"
        f"{'restarts':>10}  notes"
    )
    for s in report["steps"]:
        rows = s.get("rows") or {}
        ok_rows = (
            f"{rows.get('succeeded', '-')}/{rows.get('total', '-')}"
            if "succeeded" in rows
            else str(rows.get("total", "-"))
        )
        execs = f"{rows.get('executions_max', '-')}" if rows else "-"
        failed = [k for k, c in s.get("checks", {}).items() if not c["ok"]]
        notes = s.get("skipped") or s.get("error") or (("failed: " + ", ".join(failed)) if failed else "")
        if not notes and s.get("throughput", {}).get("output_tok_s"):
            notes = f"{s['throughput']['output_tok_s']:,.0f} output tok/s"
        result = "skip" if s.get("skipped") else ("pass" if s.get("passed") else "FAIL")
        print(
            f"{s['name']:<16}{result:<8}{str(s.get('state') or '-'):<12.12}{s.get('seconds', 0):>9.1f}"
            f"{s.get('bound_s', 0):>7.0f}{ok_rows:>15}{execs:>6}{s.get('restarts', 0):>10}  {notes[:90]}"
        )
    for name, c in report["final_checks"].items():
        print(f"{'final':<16}{'pass' if c['ok'] else 'FAIL':<8}{name}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--quick", action="store_true", help="smaller G1/G2/mixed/cancel jobs: at most 6 minutes")
    kind.add_argument("--smoke", action="store_true", help="CPU: the tiny model for every step, small sizes")
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/gpujobs-soak"),
        help="models (kept between runs), inputs, and the stack's JOBS_HOME (<work>/home, made afresh)",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="the JSON (default: ops/gpu/results/soak-<mode>.json; --smoke: in --work);"
        " a copy, with the logs, also goes to $OUT when it is set",
    )
    p.add_argument("--budget-s", type=float, help="the whole run's time (default: full 570, quick 360, smoke 1500)")
    p.add_argument(
        "--only",
        metavar="STEP[,STEP]",
        help="run only these steps after setup (e.g. --only yield: one check on a scarce GPU), in the usual order",
    )
    p.add_argument(
        "--bound",
        action="append",
        default=[],
        metavar="STEP=SECONDS",
        help="another bound for one step (repeatable); e.g. to see a stuck step's evidence",
    )
    p.add_argument("--faults", help="more JOBS_TEST_FAULTS for the worker (worker/faults.py), e.g. sleep_60@train_step")
    args = p.parse_args(argv)
    mode = MODES["quick" if args.quick else "smoke" if args.smoke else "full"]
    mode = replace(mode, budget_s=args.budget_s or mode.budget_s, bounds={**mode.bounds, **parse_bounds(args.bound)})
    if args.faults:
        faults = ",".join(f for f in (mode.worker_env.get("JOBS_TEST_FAULTS"), args.faults) if f)
        mode = replace(mode, worker_env={**mode.worker_env, "JOBS_TEST_FAULTS": faults})
    out = args.out or (
        args.work / "soak-smoke.json" if args.smoke else ROOT / "ops" / "gpu" / "results" / f"soak-{mode.name}.json"
    )
    args.work.mkdir(parents=True, exist_ok=True)
    home = args.work / "home"
    for key in [k for k in os.environ if k.startswith("JOBS_")]:  # this run owns its stack
        del os.environ[key]
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ.update(JOBS_HOME=str(home), HF_HUB_OFFLINE="1")
    env = dict(
        os.environ,
        PYTHONFAULTHANDLER="1",
        PYTHONUNBUFFERED="1",
        JOBS_YIELD_AFTER_SECONDS=YIELD_AFTER_S,
        **mode.worker_env,
    )
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]  # env.sh's: /tmp/site, then the repo
    env["PYTHONPATH"] = os.pathsep.join(paths if str(ROOT) in paths else [*paths, str(ROOT)])

    def stop(signum, _frame):  # `timeout` sends SIGTERM: write what we have and stop the stack
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    t0 = time.monotonic()
    soak = Soak(mode, args.work, args.work / "models")
    soak.stack = Stack(home, mode, env)
    report: dict[str, Any] = {
        "mode": mode.name,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **commit_info(),
        "budget_s": mode.budget_s,
        "only": args.only,  # a partial run: only these steps after setup
        "passed": False,
        "steps": soak.steps,
        "final_checks": {},
        "nvidia_smi": nvidia_smi(),
    }

    def save() -> None:
        report["total_s"] = round(time.monotonic() - t0, 1)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"soak": report}, indent=2, default=str))

    plan: list[tuple[str, Callable[[Step], None]]] = [
        ("engines", soak.engines),
        ("g2_first", lambda s: soak.g2(s, False)),
        ("g2_second", lambda s: soak.g2(s, True)),
        ("g1", soak.g1),
        ("shared_prefix", soak.shared_prefix),
        ("mixed", soak.mixed),
        ("cancel_retry", soak.cancel_retry),
        ("oom", soak.oom),
        ("finetune_chain", soak.finetune_chain),
        ("adapter", soak.adapter),
        *([("yield", soak.yield_)] if mode.yield_low else []),
    ]
    if args.only:
        wanted = set(args.only.split(","))
        if unknown := wanted - {name for name, _ in plan}:
            raise SystemExit(f"--only {args.only}: no step {', '.join(sorted(unknown))} in {mode.name} mode")
        plan = [(name, fn) for name, fn in plan if name in wanted]
    try:
        record = soak.run("setup", lambda step: setup(soak, step), worker=False)
        save()
        if record.get("passed"):
            for name, fn in plan:
                soak.run(name, fn)
                save()
            report["final_checks"] = final_checks(soak)
            report["worker"] = worker_info()
            report["worker_log_errors"] = log_errors(soak.stack.worker_log)
    except KeyboardInterrupt as exc:
        report["interrupted"] = str(exc)
        log(f"interrupted: {exc}")
    finally:
        report["passed"] = (
            all(s.get("passed") for s in soak.steps)
            and len(soak.steps) == len(plan) + 1
            and bool(report["final_checks"])
            and all(c["ok"] for c in report["final_checks"].values())
        )
        try:
            soak.stack.down()
            report["worker_after_down"] = registry()
        except Exception as exc:  # noqa: BLE001  the report is written whatever happened
            report["down_error"] = repr(exc)
        save()
        copy_out(out, home)
    print_table(report)
    log(f"wrote {out}")
    return 0 if report["passed"] else 1


def parse_bounds(items: list[str]) -> dict[str, float]:
    bounds = {}
    for item in items:
        name, _, seconds = item.partition("=")
        if name not in MODES["full"].bounds or not seconds.replace(".", "", 1).isdigit():
            raise SystemExit(f"--bound {item!r}: give STEP=SECONDS with STEP one of {', '.join(MODES['full'].bounds)}")
        bounds[name] = float(seconds)
    return bounds


def copy_out(out: Path, home: Path) -> None:
    """The JSON, the worker's, API's and `up`'s logs and any stack dumps into $OUT (the device tool brings it
    back: at most 8 files)."""
    target = os.environ.get("OUT")
    if not target:
        return
    Path(target).mkdir(parents=True, exist_ok=True)
    for src, name in (
        (out, out.name),
        (home / "logs" / "worker-0.log", "worker-0.log"),
        (home / "logs" / "api.log", "api.log"),
        (home / "stacks.txt", "stacks.txt"),
        (home.parent / "up.log", "up.log"),
    ):
        if src.exists() and src.resolve() != (Path(target) / name).resolve():
            shutil.copyfile(src, Path(target) / name)


if __name__ == "__main__":
    sys.exit(main())
