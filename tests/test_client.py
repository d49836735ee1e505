"""The Python client (`from api.client import Client`) against a live API and a real worker."""

from __future__ import annotations

import json

import pytest

from api.client import Client
from core.errors import InvalidInput, NotFound, ServiceUnavailable
from tests.conftest import qa_pairs


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_submit_wait_with_progress_results_status_and_cancel(
    tmp_path, jobs_env, api_server, spawn_worker, tiny_model, capsys
):
    """submit(input=local file) uploads it; wait() calls back on every poll and prints progress; results()
    yields the memorized answers in input order; status() and cancel() work; a cancelled job ends cancelled."""
    url, token, _ = api_server
    spawn_worker([])
    qa = qa_pairs()
    with Client(url, token) as client:
        data = write_rows(tmp_path / "qa.jsonl", [{"prompt": q, "custom_id": f"q{i}"} for i, (q, _) in enumerate(qa)])
        job = client.submit({"model": str(tiny_model), "max_new_tokens": 16}, input=data)
        seen = []
        done = client.wait(job["id"], poll=0.2, timeout=120, on_update=lambda j: seen.append(j["state"]), progress=True)
        assert done["state"] == "succeeded" and seen[-1] == "succeeded"
        assert f"{job['id']} succeeded  {len(qa)}/{len(qa)} rows" in capsys.readouterr().err
        assert [(r["custom_id"], r["output"]) for r in client.results(job["id"])] == [
            (f"q{i}", a) for i, (_, a) in enumerate(qa)
        ]
        assert list(client.results(job["id"], errors=True)) == []
        assert client.status(job["id"])["rows"] == {"total": len(qa), "succeeded": len(qa), "failed": 0, "pending": 0}

        long_rows = write_rows(tmp_path / "long.jsonl", [{"prompt": f"row {i}"} for i in range(300)])
        slow = client.submit({"model": str(tiny_model), "max_new_tokens": 64, "ignore_eos": True}, input=long_rows)
        assert client.cancel(slow["id"])["state"] in ("cancelling", "cancelled")
        ended = client.wait(slow["id"], poll=0.2, timeout=120)
        assert ended["state"] == "cancelled" and ended["rows"]["pending"] > 0
        assert [j["id"] for j in client.jobs(limit=2)] == [slow["id"], job["id"]]


def test_client_errors_say_what_was_wrong(tmp_path, jobs_env, api_server):
    """A missing local input, an unknown job and an unreachable server raise our exception types with the fix."""
    url, token, _ = api_server
    with Client(url, token) as client:
        with pytest.raises(InvalidInput, match="not a local file"):
            client.submit({"model": "m"}, input=tmp_path / "nope.jsonl")
        with pytest.raises(NotFound):
            client.status("job_000000000000")
    with pytest.raises(ServiceUnavailable, match="gpujobs up"), Client("http://127.0.0.1:9", token) as dead:
        dead.status("job_000000000000")
