"""End to end through the CLI: a real API server, real Redis, a real worker process, the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT, qa_pairs


def jobs(env: dict[str, str], *args: str, check: bool = False) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "api", *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=420
    )
    if check and result.returncode != 0:
        raise AssertionError(f"jobs {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
    return result


def write_rows(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_submit_wait_results_through_the_cli(tmp_path, jobs_env, api_server, spawn_worker, tiny_model):
    """submit → Redis → a pinned worker → SQL → results: memorized answers come back in input order with
    pass-through keys; a malformed line becomes a failed row and the job exits 4."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    spawn_worker([])
    qa = qa_pairs()
    rows = [{"prompt": q, "custom_id": f"q{i}", "source": "test"} for i, (q, _) in enumerate(qa)]
    rows.insert(2, "{not json")
    rows.append({"messages": [{"role": "user", "content": qa[0][0]}], "max_new_tokens": 2})
    data = write_rows(tmp_path / "rows.jsonl", rows)
    sub = jobs(
        env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--max-new-tokens", "16", "--wait"
    )
    assert sub.returncode == 4, sub.stderr
    job_id = sub.stdout.strip()
    assert job_id.startswith("job_")

    out = jobs(env, "results", job_id, check=True)
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["custom_id"] for r in results] == [f"q{i}" for i in range(len(qa))] + ["line-8"]
    assert [r["output"] for r in results[:-1]] == [a for _, a in qa]
    assert all(r["source"] == "test" and r["finish_reason"] == "stop" for r in results[:-1])
    assert results[-1]["completion_tokens"] == 2 and results[-1]["finish_reason"] == "length"

    errors = [json.loads(line) for line in jobs(env, "results", job_id, "--errors", check=True).stdout.splitlines()]
    assert len(errors) == 1 and errors[0]["line"] == 3 and "invalid JSON" in errors[0]["error"]

    status = json.loads(jobs(env, "status", job_id, "--json", check=True).stdout)
    assert status["state"] == "succeeded"
    assert status["rows"] == {"total": 8, "succeeded": 7, "failed": 1, "pending": 0}
    assert status["metrics"]["output_tok_s"] > 0 and status["load_options"]["dtype"] == "float32"
    assert status["versions"]["transformers"]


def test_unreachable_server_exits_3(tmp_path, jobs_env):
    """With no API listening, every command (also `results`, which streams) names the URL, says how to start one
    or point elsewhere, and exits 3."""
    env = dict(jobs_env.env, JOBS_API_URL="http://127.0.0.1:9", JOBS_TOKEN="x")
    for args in (["list"], ["results", "job_0123456789ab"]):
        result = jobs(env, *args)
        assert result.returncode == 3, (args, result.stderr)
        assert result.stderr.startswith("Error: cannot reach the jobs API at http://127.0.0.1:9 ("), result.stderr
        assert result.stderr.endswith(": start one with `gpujobs up`, or set JOBS_API_URL\n"), result.stderr


def test_a_malformed_api_url_exits_2_in_one_line(jobs_env):
    """An API URL that is no http(s) URL is the caller's mistake: one line naming it and where to fix it, exit 2.
    `http://[::1` gave httpx's traceback (exit 1), and `127.0.0.1:8765` (no scheme) "cannot reach" (exit 3)."""
    for url in ("http://[::1", "127.0.0.1:8765", "localhost:8765", "ftp://example.com"):
        result = jobs(dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN="x"), "list")
        assert result.returncode == 2, (url, result.stderr)
        assert result.stderr.startswith(f"Error: {url!r} is not a URL of the jobs API (") and result.stderr.endswith(
            "give http://HOST:PORT, e.g. http://127.0.0.1:8765, in --api-url or JOBS_API_URL\n"
        ), result.stderr


def test_an_answer_that_is_not_the_jobs_apis_exits_3_naming_the_url(jobs_env):
    """Another server at the URL (an HTML 404, a single-page app's 200) or a proxy in front of an API that is down
    (an HTML 502): one line naming the request and what to check, exit 3. The page itself was printed (exit 1), or
    for a 200 page, json's traceback, or `results` wrote the page as the results."""
    import http.server
    import threading

    class Pages(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # the path's first part is the status to answer: /404/jobs/… answers 404
            body = b"<html><body><h1>Bad Gateway</h1></body></html>"
            self.send_response(int(self.path.split("/")[1]))
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Pages)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for status, args in (
            (404, ["list"]),
            (502, ["status", "job_0123456789ab"]),
            (200, ["list"]),
            (200, ["results", "job_0123456789ab"]),
        ):
            url = f"http://127.0.0.1:{server.server_address[1]}/{status}"
            result = jobs(dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN="x"), *args)
            assert (result.returncode, result.stdout) == (3, ""), (status, args, result.stdout, result.stderr)
            [line] = result.stderr.splitlines()
            assert line.startswith(f"Error: GET {url}/") and f"answered HTTP {status} (text/html)" in line, line
            assert "check that --api-url / JOBS_API_URL is the jobs API's address" in line, line
    finally:
        server.shutdown()


def test_wrong_token_exits_2(jobs_env, api_server):
    """A wrong token is refused with a message naming JOBS_TOKEN."""
    url, _, _ = api_server
    result = jobs(dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN="jt_wrong"), "list")
    assert result.returncode == 2
    assert "JOBS_TOKEN" in result.stderr
