"""Fuzz the HTTP API with Schemathesis, every check, against a stack like `gpujobs up`'s: the API under uvicorn,
its own redis-server, SQLite (or the database given), no worker (jobs stay queued).

Two runs, one token each: an admin's, and a user's whose path ids and datasets are, one time in three, another
owner's objects, which must stay 404 (tests/fuzz_hooks.py holds the hooks and that check). Each run's findings
fail it: Schemathesis exits non-zero. tests/schemathesis.toml holds the settings both runs share, with why.

CI runs it from tests/test_fuzz.py (a fixed seed, a small budget). A longer run, by hand:

    .venv/bin/python -m tests.fuzz --max-time 600      # 300 s a token; prints each run's summary
    .venv/bin/python -m tests.fuzz --serve             # only the stack, to replay a finding (`st replay`, curl)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "schemathesis.toml"
ADMIN, USER, OTHER = "fuzz-admin", "fuzz-user", "fuzz-other-owner"
PROMPTS = b'{"prompt": "hello"}\n{"prompt": "world", "custom_id": "w"}\n'
TRAINING = b'{"prompt": "2+2=", "completion": "4"}\n{"prompt": "3+3=", "completion": "6"}\n'


@dataclass
class Stack:
    url: str
    tokens: dict[str, str]  # owner -> token
    objects: dict[str, dict[str, str]]  # owner -> {file, train_file, live, finished}
    model: str
    log: Path


@dataclass
class Run:
    who: str
    returncode: int
    output: str
    seconds: float

    @property
    def cases(self) -> int:
        """The number of test cases Schemathesis generated ("Test cases: N generated, …"), or -1."""
        found = re.search(r"(\d+) generated", self.output)
        return int(found[1]) if found else -1

    def summary(self) -> str:
        """The report's last part: its SUMMARY section (phases, failures, warnings, case count)."""
        return self.output[self.output.rfind("SUMMARY") - 40 :] if "SUMMARY" in self.output else self.output[-3000:]


def _seed(url: str, token: str, owner: str, model: str) -> dict[str, str]:
    """The owner's objects: a dataset, a training set, a live job (queued: no worker) and a cancelled one."""
    from core.db import session_scope
    from core.models import Adapter

    client = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
    files = {
        name: client.post("/files", files={"file": (f"{name}.jsonl", data)}).raise_for_status().json()["id"]
        for name, data in (("file", PROMPTS), ("train_file", TRAINING))
    }
    spec = {"model": model, "input": files["file"], "gpus": 0, "max_new_tokens": 4}
    live, finished = (client.post("/jobs", json=spec).raise_for_status().json()["id"] for _ in range(2))
    client.post(f"/jobs/{finished}/cancel").raise_for_status()
    with session_scope() as session:  # an adapter registered for the live job, as a fine-tune's worker would
        session.add(
            Adapter(
                id=live,
                job_id=live,
                owner=owner,
                base_model=spec["model"],
                tokenizer=spec["model"],
                path=f"adapters/{live}",
                bytes=1,
                sha256="0" * 64,
                lora_config={"r": 8},
                load_options={},
                metrics={},
                created_at=0.0,
            )
        )
    return {**files, "live": live, "finished": finished}


@contextmanager
def api_stack(workdir: Path, env: dict[str, str], model: Path) -> Iterator[Stack]:
    """The API under uvicorn on a free port over the store and Redis that `env` (and this process's environment,
    already pointed at them and migrated) names; tokens for an admin and two users, each user with objects."""
    from core import auth
    from core.db import session_scope
    from core.embedded import free_port, stop_process

    with session_scope() as session:
        tokens = {
            ADMIN: auth.create_token(session, owner=ADMIN, scopes=["admin", "user"], name="fuzz"),
            USER: auth.create_token(session, owner=USER, scopes=["user"], name="fuzz"),
            OTHER: auth.create_token(session, owner=OTHER, scopes=["user"], name="fuzz"),
        }
    port, log = free_port(), workdir / "api.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "api.app:app", "--port", str(port), "--no-access-log"],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        objects = {owner: _seed(url, tokens[owner], owner, str(model)) for owner in (USER, OTHER)}
        yield Stack(url, tokens, objects, str(model), log)
    finally:
        stop_process(proc)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def schemathesis(stack: Stack, who: str, *, seed: int, max_time: int, max_examples: int | None = None) -> Run:
    """One Schemathesis run with `who`'s token, every check; a user's run also reaches another owner's objects."""
    own = stack.objects.get(who, stack.objects[USER])
    seeds = {"own": own, "model": stack.model}
    if who != ADMIN:
        seeds |= {"foreign": stack.objects[OTHER], "foreign_owner": OTHER}
    command = [
        *(sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", f"{stack.url}/openapi.json"),
        *("--header", f"Authorization: Bearer {stack.tokens[who]}"),
        *("--checks", "all", "--seed", str(seed), "--max-time", str(max_time), "--workers", "1", "--no-color"),
        *(("--max-examples", str(max_examples)) if max_examples else ()),
    ]
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.fuzz_hooks", GPUJOBS_FUZZ=json.dumps(seeds), PYTHONPATH=str(ROOT))
    started = time.monotonic()
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=max_time + 300)
    return Run(who, done.returncode, done.stdout + done.stderr, time.monotonic() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-time", type=int, default=600, help="seconds for both runs together (default 600)")
    parser.add_argument("--seed", type=int, default=28, help="Schemathesis's seed (default 28)")
    parser.add_argument("--max-examples", type=int, help="cases per operation and phase (default: Schemathesis's)")
    parser.add_argument("--database-url", help="an empty database to use instead of a new SQLite file (Postgres)")
    parser.add_argument("--out", type=Path, help="write each run's whole report here (<token>.txt)")
    parser.add_argument(
        "--serve", action="store_true", help="only start the stack, print its URL, tokens and seeds, and wait"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `kill`, `timeout`: stop the API and Redis on the way out

    from core.db import upgrade
    from core.embedded import start_redis
    from tests.conftest import build_tiny, make_env

    with tempfile.TemporaryDirectory(prefix="gpujobs-fuzz-") as tmp:
        workdir = Path(tmp)
        redis = start_redis(workdir / "redis")
        try:
            env = make_env(workdir, args.database_url or f"sqlite:///{workdir / 'jobs.db'}", redis.url)
            os.environ.update(env)
            upgrade()
            model = workdir / "tiny"
            build_tiny(model)
            with api_stack(workdir, env, model) as stack:
                if args.serve:
                    print(
                        json.dumps(
                            {
                                "url": stack.url,
                                "tokens": stack.tokens,
                                "objects": stack.objects,
                                "model": stack.model,
                                "log": str(stack.log),
                            }
                        ),
                        flush=True,
                    )
                    while True:
                        time.sleep(3600)
                runs = [
                    schemathesis(
                        stack, who, seed=args.seed, max_time=args.max_time // 2, max_examples=args.max_examples
                    )
                    for who in (ADMIN, USER)
                ]
        finally:
            redis.stop()
    for run in runs:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{run.who}.txt").write_text(run.output)
        print(f"=== {run.who}: exit {run.returncode}, {run.cases} cases in {run.seconds:.0f} s\n{run.summary()}")
    return max(run.returncode for run in runs)


if __name__ == "__main__":
    sys.exit(main())
