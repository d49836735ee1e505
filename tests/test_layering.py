"""Layering: the API never imports torch or worker code, even after it handled a real submit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import ROOT

SCRIPT = textwrap.dedent("""
    import json, sys
    from fastapi.testclient import TestClient
    from api.app import app
    from core import auth
    from core.db import session_scope

    with session_scope() as session:
        token = auth.create_token(session, owner="alice", scopes=["user"])
    client = TestClient(app, headers={"Authorization": f"Bearer {token}"})
    rows = b'{"prompt": "hi"}\\n{"prompt": "ho", "guided_regex": "[0-9]+"}\\n'
    file_id = client.post("/files", files={"file": ("d.jsonl", rows)}).json()["id"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constrained = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    job = client.post("/jobs", json={"model": sys.argv[1], "input": file_id, "gpus": 0, "response_format": constrained})
    assert job.status_code == 201, job.text
    assert client.get(f"/jobs/{job.json()['id']}").status_code == 200
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "worker", "transformers", "peft"))
    print(json.dumps({"job": job.json()["id"], "heavy": heavy, "grammar_checked": "llguidance" in sys.modules}))
""")


def test_api_process_imports_no_torch_and_no_worker_code_after_a_submit(jobs_env, tiny_model):
    """A submit through the real FastAPI app (real Redis, real SQLite) leaves torch, transformers and worker/
    out of the API process's sys.modules, also where it compiled the job's and a row's constraints (llguidance)."""
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_model)],
        env=jobs_env.env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["job"].startswith("job_")
    assert report["heavy"] == [] and report["grammar_checked"]
