"""The soak run (ops/gpu/soak.py) on CPU: its --smoke mode end to end (tiny models, the same steps and checks as on
the H200), the worker's stack dump on SIGUSR2 that a stuck step relies on, and the soak's G1/G2 rows being those of
ops/bench/gen.py."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import ROOT, wait_for

STEPS = [
    "setup",
    "engines",
    "g2_first",
    "g2_second",
    "g1",
    "shared_prefix",
    "mixed",
    "cancel_retry",
    "oom",
    "finetune_chain",
    "adapter",
]


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_worker_writes_every_thread_stack_on_sigusr2_and_keeps_running(jobs_env, spawn_worker):
    """`kill -USR2` on a worker puts the stack of each of its threads (the heartbeat among them) in its log; the
    worker stays registered and alive."""
    worker = spawn_worker()
    # registered before its heartbeat thread starts: signal once Celery says it is ready, when both run
    wait_for(lambda: " ready." in worker.log.read_text(errors="replace"), 90, "the worker ready", procs=[worker])
    os.kill(worker.pid, signal.SIGUSR2)
    wait_for(
        lambda: "_heartbeat_loop" in worker.log.read_text(errors="replace"),
        60,
        "a stack dump in the log",
        procs=[worker],
    )
    text = worker.log.read_text(errors="replace")
    assert "Current thread" in text or "Thread 0x" in text
    from tests.conftest import registered

    assert worker.alive() and registered(jobs_env.database_url, worker.pid)


def test_soak_rows_are_the_rows_of_gen_py(tiny_model):
    """The soak draws G1/G2 rows as ops/bench/gen.py does (same one-token words, same seed): same prompts, same
    max_new_tokens, and each prompt's token count is its word count."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    soak = _module("soak_under_test", "ops/gpu/soak.py")
    gen = _module("gen_under_test", "ops/bench/gen.py")
    tok = AutoTokenizer.from_pretrained(tiny_model)
    words = soak.one_token_words(tiny_model)
    assert words == gen.harness.one_token_words(tok)
    for name, rows in (("g2", soak.Rows(32, (4, 40), (2, 24))), ("g1", soak.Rows(24, (16, 16), (16, 16)))):
        ours = soak.synthetic(words, rows)
        assert [(p, o) for p, _, o in ours] == gen.workload(name, tok, smoke=True)
    fast = Tokenizer.from_file(str(tiny_model / "tokenizer.json"))
    assert all(len(fast.encode(p).ids) == n for p, n, _ in ours)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_smoke_passes_every_step(tmp_path, tiny_model, base_model):
    """`ops/gpu/soak.py --smoke` runs every step of the GPU soak through a real stack on CPU and passes: each job in
    its expected state, every row once, greedy outputs equal across engines (and the fast engine's memorized answers
    with fp8 and int8 KV caches), the injected OOM split, no restart."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny-qa").symlink_to(tiny_model)  # built as the soak builds them: only the random tiny one is built
    (models / "tiny-base").symlink_to(base_model)
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "OUT"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "ops" / "gpu" / "soak.py"),
            "--smoke",
            "--work",
            str(tmp_path),
            "--out",
            str(out),
            "--budget-s",
            "800",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=880,
    )
    report = json.loads(out.read_text())["soak"]
    failed = {
        s["name"]: s.get("error") or [k for k, c in s["checks"].items() if not c["ok"]]
        for s in report["steps"]
        if not s.get("passed")
    }
    assert proc.returncode == 0 and report["passed"], f"{failed}\n{proc.stdout[-4000:]}"
    assert [s["name"] for s in report["steps"]] == STEPS
    assert all(s["restarts"] == 0 and s["checks"] for s in report["steps"])
    engines = next(s for s in report["steps"] if s["name"] == "engines")
    assert engines["checks"]["fast_fp8_memorized_answers"]["ok"]  # the fast engine with quantized KV caches
    assert engines["checks"]["fast_int8_memorized_answers"]["ok"]
    oom = next(s for s in report["steps"] if s["name"] == "oom")
    assert oom["checks"]["out_of_memory_split"]["events"]
    tune = next(s for s in report["steps"] if s["name"] == "finetune_chain")
    assert tune["checks"]["every_step_logged_once_in_order"]["count"] == 60  # examples/finetune.yaml's max_steps
