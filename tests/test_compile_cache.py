"""Compiled code kept under JOBS_HOME (worker/compile_cache.py): a fresh process compiles nothing it compiled before
with the same versions, and a corrupt cache is compiled again, never trusted. Inductor compiles for the CPU here
(its C++ backend); on a GPU the same caches hold its Triton kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT
from worker import compile_cache

# a fresh worker process: the cache set up as worker/main.py does, then one compiled function
COMPILE = """
import json, sys
from pathlib import Path
from worker import compile_cache
where = compile_cache.use(Path(sys.argv[1]))
import torch
@torch.compile
def f(x):
    return torch.nn.functional.silu(x) * x.cos() + 1
x = torch.linspace(-3, 3, 4096).reshape(64, 64)
ok = torch.allclose(f(x), torch.nn.functional.silu(x) * x.cos() + 1, atol=1e-5)
print(json.dumps({"where": str(where), "ok": ok, **compile_cache.stats()}))
"""


def compile_once(home) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = str(ROOT)
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, str(home)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_fresh_process_reads_what_an_earlier_one_compiled_and_a_corrupt_cache_is_compiled_again(tmp_path):
    """First process: a miss, compiled and written under JOBS_HOME/compile-cache/<versions>/. Second: a hit, the
    same result. Then every cached file is cut in half: the next process compiles again (a miss) and is right."""
    home = tmp_path / "home"
    first = compile_once(home)
    assert first["ok"] and first["misses"] >= 1 and first["hits"] == 0
    assert first["where"] == str(compile_cache.folder(home)) and first["dir"].startswith(first["where"])
    second = compile_once(home)
    assert second["ok"] and second["hits"] >= 1 and second["misses"] == 0
    for path in (home / "compile-cache").rglob("*"):
        if path.is_file():
            os.truncate(path, path.stat().st_size // 2)
    third = compile_once(home)
    assert third["ok"] and third["misses"] >= 1


def test_the_cache_folder_is_keyed_by_versions_and_an_operators_own_folder_wins(tmp_path, monkeypatch):
    """The folder names torch, triton, transformers and Python; TORCHINDUCTOR_CACHE_DIR set by the operator is
    kept."""
    import platform

    import torch

    name = compile_cache.folder(tmp_path).name
    assert f"torch-{torch.__version__}" in name and f"py-{platform.python_version()}" in name
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    compile_cache.use(tmp_path / "home")
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_DIR"].startswith(str(tmp_path / "home" / "compile-cache"))


def test_torchs_own_default_inherited_from_the_starting_process_is_not_taken_for_an_operators(tmp_path):
    """A process that imports torch._dynamo (transformers does when it builds a model) has torch's default folder
    written into its environment, and a worker it starts inherits it: the worker still keeps its compiled code under
    JOBS_HOME (a benchmark that built its model, then started the stack, gave its workers /tmp)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    env["PYTHONPATH"] = str(ROOT)

    def run(code: str, **extra) -> str:
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env={**env, **extra}, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    inherited = run("import os, torch._dynamo; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    assert inherited == compile_cache.torch_default()
    home = tmp_path / "home"
    worker = f"import os, pathlib; from worker import compile_cache; compile_cache.use(pathlib.Path({str(home)!r}))"
    got = run(worker + "; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])", TORCHINDUCTOR_CACHE_DIR=inherited)
    assert got == str(compile_cache.folder(home) / "inductor")
