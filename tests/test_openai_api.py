"""The OpenAI-compatible Batch API, driven by the official `openai` client (only base_url and api_key set) against a
live API server and a real worker."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from api.client import Client
from core import auth, errors
from core.db import session_scope
from tests.conftest import qa_pairs, wait_for

MODEL = "tiny-qa"  # the tiny model's directory name under JOBS_MODEL_ROOTS (the allow-list)
SLOW = "sleep_0.4@batch"  # the worker sleeps before each micro-batch commit: long batches last, whatever the engine


@pytest.fixture
def model_roots(jobs_env, tiny_model):
    """The API allows the models under the tiny model's parent directory (set before api_server starts)."""
    jobs_env.env["JOBS_MODEL_ROOTS"] = str(tiny_model.parent)
    assert tiny_model.name == MODEL


def chat_line(custom_id: str, content, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], **body},
    }


def write_lines(path, lines) -> str:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def warm_up(url: str, token: str, tiny_model, tmp_path, worker) -> None:
    """Run a 1-row job (our API: no completion window) to the end, so that the worker has imported torch and loaded
    the model before a batch's 6 s window starts: on a loaded machine that start alone can outlast the window, and
    the batch then expires with no finished row, which is not what the tests below are about."""
    data = tmp_path / "warm.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    ours = Client(url, token)
    job = ours.submit({"model": str(tiny_model), "gpus": 0, "max_new_tokens": 1}, input=data)
    wait_for(lambda: ours.job(job["id"])["state"] == "succeeded", 120, "the warm-up job", procs=[worker])


def wait_status(client: OpenAI, batch_id: str, statuses: tuple[str, ...], timeout: float = 120):
    return wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status in statuses and b,
        timeout,
        f"batch {batch_id} to reach {statuses}",
        interval=0.5,
    )


def test_the_documented_batch_workflow_list_cancel_and_isolation(
    tmp_path, model_roots, jobs_env, api_server, spawn_worker
):
    """files.create(purpose=batch) → batches.create → retrieve until completed → files.content(output_file_id)
    gives each memorized answer under its custom_id, and the error file the bad line; list pages with has_more and
    `after`; cancel ends cancelled with finished rows kept; another user gets 404; 24h only, allow-listed models."""
    url, token, _ = api_server
    spawn_worker([], JOBS_TEST_FAULTS=SLOW)
    client = OpenAI(base_url=f"{url}/v1", api_key=token)
    qa = qa_pairs()
    lines = [chat_line(f"q{i}", q, max_tokens=16) for i, (q, _) in enumerate(qa)]
    lines.append(chat_line("bad", "x", logit_bias={"1": 2}))  # a key this server does not support: a failed row
    with open(write_lines(tmp_path / "batch.jsonl", lines), "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes > 0

    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "docs"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"run": "docs"}
    done = wait_status(client, batch.id, ("completed", "failed"))
    assert done.status == "completed" and done.completed_at and done.in_progress_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        len(qa) + 1,
        len(qa),
        1,
    )
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    answers = {o["custom_id"]: o["response"]["body"]["choices"][0]["message"]["content"] for o in output}
    assert answers == {f"q{i}": a for i, (_, a) in enumerate(qa)}
    assert all(
        o["response"]["status_code"] == 200 and o["response"]["body"]["object"] == "chat.completion" for o in output
    )
    [error] = [json.loads(line) for line in client.files.content(done.error_file_id).text.splitlines()]
    assert error["custom_id"] == "bad" and error["response"]["status_code"] == 400
    assert "logit_bias" in error["response"]["body"]["error"]["message"]
    assert client.files.retrieve(done.output_file_id).bytes == len(client.files.content(done.output_file_id).content)
    assert done.usage.output_tokens > 0

    long = [chat_line(f"r{i}", f"row {i}", max_tokens=8) for i in range(300)]
    with open(write_lines(tmp_path / "long.jsonl", long), "rb") as f:
        second = client.batches.create(
            input_file_id=client.files.create(file=f, purpose="batch").id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert client.batches.cancel(second.id).status in ("cancelling", "cancelled")
    cancelled = wait_status(client, second.id, ("cancelled",))
    assert cancelled.cancelled_at and cancelled.request_counts.completed < 300

    first_page = client.batches.list(limit=1)
    assert [b.id for b in first_page.data] == [second.id] and first_page.has_more
    assert [b.id for b in client.batches.list(limit=1)] == [second.id, batch.id]  # auto-paging follows `after`

    with session_scope() as session:
        bob = OpenAI(base_url=f"{url}/v1", api_key=auth.create_token(session, owner="bob", scopes=["user"]))
    for call in (
        lambda: bob.batches.retrieve(batch.id),
        lambda: bob.files.content(done.output_file_id),
        lambda: bob.files.retrieve(uploaded.id),
        lambda: bob.batches.cancel(second.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert bob.batches.list().data == []

    with pytest.raises(openai.BadRequestError, match="only '24h'"):
        client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="48h")
    with open(
        write_lines(tmp_path / "other.jsonl", [chat_line("a", "hi") | {"body": {"model": "gpt-4o", "messages": []}}]),
        "rb",
    ) as f:
        other = client.files.create(file=f, purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not a model directory under the model roots"):
        client.batches.create(input_file_id=other.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(uploaded.id)


def test_a_batch_nobody_reads_still_expires_by_the_workers_reaper(
    tmp_path, model_roots, jobs_env, spawn_worker, tiny_model, request
):
    """No client reads the batch after creating it: the workers' reaper cancels it once its (6 s) window has
    passed, with the window as the reason, and keeps its finished rows; /v1 then reports it `expired`."""
    jobs_env.env["JOBS_BATCH_WINDOW_SECONDS"] = "6"
    url, token, _ = request.getfixturevalue("api_server")
    # 1 s before each of 50 commits: the batch outlasts its window and a late reaper on a loaded machine; the expiry
    # ends it long before that
    worker = spawn_worker([], JOBS_TEST_FAULTS="sleep_1@batch", JOBS_BATCH_WINDOW_SECONDS="6")
    warm_up(url, token, tiny_model, tmp_path, worker)
    client = OpenAI(base_url=f"{url}/v1", api_key=token)
    lines = [chat_line(f"r{i}", f"row {i}", max_tokens=8) for i in range(800)]
    with open(write_lines(tmp_path / "long.jsonl", lines), "rb") as f:
        batch = client.batches.create(
            input_file_id=client.files.create(file=f, purpose="batch").id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    ours = Client(url, token)  # reads through our own API only: nothing here runs the /v1 expiry check
    job = wait_for(
        lambda: (j := ours.job(batch.id))["state"] == "cancelled" and j, 180, "the reaper's expiry", procs=[worker]
    )
    assert 0 < job["rows"]["succeeded"] < 800
    assert any("completion window" in e["message"] for e in ours.events(batch.id))
    assert client.batches.retrieve(batch.id).status == "expired"


def test_a_batch_past_its_completion_window_expires_and_keeps_finished_rows(
    tmp_path, model_roots, jobs_env, spawn_worker, tiny_model, request
):
    """With the window shortened to 6 s, a long batch (slowed down) read after it is `expired`, its finished rows
    are in the output file and counted in request_counts, and the job underneath is cancelled."""
    jobs_env.env["JOBS_BATCH_WINDOW_SECONDS"] = "6"
    url, token, _ = request.getfixturevalue("api_server")
    worker = spawn_worker([], JOBS_TEST_FAULTS=SLOW)
    warm_up(url, token, tiny_model, tmp_path, worker)
    client = OpenAI(base_url=f"{url}/v1", api_key=token)
    lines = [chat_line(f"r{i}", f"row {i}", max_tokens=8) for i in range(400)]  # 25 commits of 16 rows: >= 10 s
    with open(write_lines(tmp_path / "long.jsonl", lines), "rb") as f:
        batch = client.batches.create(
            input_file_id=client.files.create(file=f, purpose="batch").id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
    assert batch.expires_at - batch.created_at in (5, 6, 7)
    ours = Client(url, token)
    wait_for(lambda: ours.job(batch.id)["rows"]["succeeded"] > 0, 60, "the first finished rows")
    time.sleep(max(0.0, batch.expires_at + 1 - time.time()))
    expired = wait_status(client, batch.id, ("expired",), timeout=60)
    counts = expired.request_counts
    assert 0 < counts.completed < 400 and expired.expired_at and expired.cancelled_at is None
    output = client.files.content(expired.output_file_id).text.splitlines()
    assert len(output) == counts.completed
    assert ours.job(batch.id)["state"] == "cancelled"


def test_a_batch_past_its_completion_window_is_not_retried_one_within_it_is(tmp_path, jobs_env, tiny_model):
    """A retry of an ended batch whose window has passed is refused (409 BatchExpired, saying to create a new batch
    from its input file) and the batch stays as it was, instead of answering `running` and being cancelled again by
    the next read; a batch still within its window is retried."""
    from fastapi.testclient import TestClient

    from api import service
    from api.app import app
    from core.models import Job

    with session_scope() as session:
        headers = {"Authorization": f"Bearer {auth.create_token(session, owner='alice', scopes=['user'])}"}
    client = TestClient(app)
    lines = [chat_line(f"r{i}", f"row {i}", max_tokens=2) for i in range(3)]
    spec = {"model": str(tiny_model), "input": write_lines(tmp_path / "batch.jsonl", lines), "gpus": 0}
    old, fresh = (service.submit(owner="alice", spec_data=spec)["id"] for _ in range(2))
    for batch_id in (old, fresh):
        assert client.post(f"/jobs/{batch_id}/cancel", headers=headers).json()["state"] == "cancelled"
    with session_scope() as session:  # as if created two days ago: its 24 h window has passed
        job = session.get(Job, old)
        job.created_at -= 2 * 86400
        input_file = job.input_file_id

    refused = client.post(f"/jobs/{old}/retry", headers=headers)
    assert refused.status_code == 409 and refused.json()["error"]["type"] == "BatchExpired", refused.text
    message = refused.json()["error"]["message"]
    assert f"batch {old}'s completion window ended at " in message
    assert f"create a new batch from its input file {input_file}" in message
    assert client.get(f"/jobs/{old}", headers=headers).json()["state"] == "cancelled"
    assert client.get(f"/v1/batches/{old}", headers=headers).json()["status"] == "cancelled"
    assert client.post(f"/jobs/{fresh}/retry", headers=headers).json()["state"] == "running"
    assert client.get(f"/v1/batches/{fresh}", headers=headers).json()["status"] == "in_progress"


OPENAI_ERROR = {"message", "type", "param", "code"}  # the keys of OpenAI's error body, every one always there


def raises(call, kind: type[openai.APIStatusError], status: int) -> openai.APIStatusError:
    """The call fails with `kind` and `status`, its body in OpenAI's shape with our message; the error, to read."""
    with pytest.raises(kind) as caught:
        call()
    error = caught.value
    assert error.status_code == status and set(error.body) == OPENAI_ERROR and error.body["message"], error.body
    return error


def test_errors_under_v1_have_openai_shape_and_statuses_and_elsewhere_ours(tmp_path, jobs_env, request):
    """Under /v1 every error is OpenAI's body with OpenAI's statuses, so its client raises the matching exception:
    an invalid request (our checks, FastAPI's validation, a body that is not JSON or not sent as JSON) is a 400
    BadRequestError naming the field in `param`, no such batch or file a 404 NotFoundError, a bad key a 401 with
    code invalid_api_key, an over-size upload a 413, no such route a 404 and a wrong method a 405; outside /v1 an
    invalid query is still our 422 with our body; our Python client rebuilds our exception types from OpenAI's body."""
    jobs_env.env["JOBS_MAX_UPLOAD_BYTES"] = "1000"
    url, token, _ = request.getfixturevalue("api_server")
    client = OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0)
    with open(write_lines(tmp_path / "b.jsonl", [chat_line("a", "hi")]), "rb") as f:
        uploaded = client.files.create(file=f, purpose="batch")
    request_ = {"input_file_id": uploaded.id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}

    def create(**changes):
        return lambda: client.post("/batches", body={**request_, **changes}, cast_to=object)

    error = raises(create(endpoint="/v1/embeddings"), openai.BadRequestError, 400)
    assert (error.type, error.param, error.code) == ("invalid_request_error", "endpoint", None)
    assert (
        error.body["message"]
        == "endpoint '/v1/embeddings' is not supported: use /v1/chat/completions or /v1/completions"
    )
    assert raises(create(completion_window="48h"), openai.BadRequestError, 400).param == "completion_window"
    missing = lambda: client.post("/batches", body={"endpoint": "/v1/chat/completions"}, cast_to=object)  # noqa: E731
    error = raises(missing, openai.BadRequestError, 400)
    assert (error.type, error.param, error.code) == (
        "invalid_request_error",
        "input_file_id",
        "missing_required_parameter",
    )
    assert "input_file_id: Field required" in error.body["message"]
    assert raises(create(metadata={"run": 1}), openai.BadRequestError, 400).param == "metadata.run"
    error = raises(create(input_file_id="file_000000000000"), openai.NotFoundError, 404)
    assert (error.type, error.param) == ("invalid_request_error", "input_file_id")
    error = raises(lambda: client.batches.retrieve("job_000000000000"), openai.NotFoundError, 404)
    assert error.type == "invalid_request_error" and "job_000000000000" in error.body["message"]
    raises(lambda: client.files.retrieve("file_000000000000"), openai.NotFoundError, 404)
    assert raises(lambda: client.batches.list(limit=0), openai.BadRequestError, 400).param == "limit"
    assert raises(lambda: client.batches.list(after="job_000000000000"), openai.NotFoundError, 404).param == "after"
    error = raises(lambda: OpenAI(base_url=f"{url}/v1", api_key="nope").batches.list(), openai.AuthenticationError, 401)
    assert (error.type, error.code) == ("invalid_request_error", "invalid_api_key")
    big = lambda: client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")  # noqa: E731
    assert "JOBS_MAX_UPLOAD_BYTES" in raises(big, openai.APIStatusError, 413).body["message"]
    tune = lambda: client.files.create(file=("t.jsonl", b"{}\n"), purpose="fine-tune")  # noqa: E731
    assert raises(tune, openai.BadRequestError, 400).param == "purpose"

    headers = {"Authorization": f"Bearer {token}"}
    for method, path, kwargs, status, message in (
        (
            "POST",
            "/v1/batches",
            {"content": b"{not json", "headers": {"Content-Type": "application/json"}},
            400,
            "the body is not valid JSON",
        ),
        ("POST", "/v1/batches", {"data": request_}, 400, "the body was not read as JSON because its Content-Type is"),
        ("GET", "/v1/nowhere", {}, 404, "Not Found"),
        ("PUT", "/v1/batches", {}, 405, "Method Not Allowed"),
    ):
        answer = httpx.request(method, url + path, headers=headers | kwargs.pop("headers", {}), **kwargs)
        body = answer.json()
        assert answer.status_code == status and set(body) == {"error"} and set(body["error"]) == OPENAI_ERROR, body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"].startswith(message)
    with pytest.raises(errors.NotFound, match="no file 'file_000000000000'"):  # our client reads OpenAI's body too
        Client(url, token).delete_file("file_000000000000")
    ours = httpx.get(f"{url}/jobs", params={"limit": 0}, headers=headers)
    assert ours.status_code == 422 and set(ours.json()) == {"error", "detail"}, ours.text
    assert ours.json()["error"] == {"type": "InvalidInput", "message": ours.json()["error"]["message"]}
    ours = httpx.get(f"{url}/files/file_000000000000", headers=headers)
    assert ours.status_code == 404 and set(ours.json()["error"]) == {"type", "message"}, ours.text


def test_the_body_guard_answers_v1_in_openai_shape(jobs_env):
    """api/limits.py answers before any route: under /v1 its 413 (a Content-Length over the upload limit) and its
    401 (a body of unknown length without a valid token) have OpenAI's body, and POST /files keeps ours."""
    from fastapi.testclient import TestClient

    from api.app import app
    from core.settings import get_settings

    with session_scope() as session:
        headers = {"Authorization": f"Bearer {auth.create_token(session, owner='ann', scopes=['user'])}"}
    client = TestClient(app)
    multipart = {"Content-Type": "multipart/form-data; boundary=b"}
    over = {"Content-Length": str(get_settings().max_upload_bytes + (2 << 20))}
    for path, shape in (("/v1/files", OPENAI_ERROR), ("/files", {"type", "message"})):
        answer = client.post(path, headers={**headers, **multipart, **over}, content=b"")
        assert answer.status_code == 413 and set(answer.json()["error"]) == shape, answer.text
        answer = client.post(path, headers={"Authorization": "Bearer nope", **multipart}, content=iter([b"x" * 10]))
        assert answer.status_code == 401 and set(answer.json()["error"]) == shape, answer.text
        assert answer.headers["WWW-Authenticate"] == "Bearer"
    assert (
        client.post("/v1/files", headers=multipart, content=iter([b"x"])).json()["error"]["code"] == "invalid_api_key"
    )


def test_batch_create_names_the_field_the_shared_submit_checks_refuse(tmp_path, jobs_env):
    """The submit checks a batch shares with POST /jobs name the field at fault, so /v1 fills OpenAI's `param` in
    the batch's terms: the lines' body.model, metadata.priority (refused by the spec check and by the token's
    scope), a line's url, and when every line is refused the first line's field (body.max_tokens, custom_id); POST
    /jobs keeps its own body."""
    from fastapi.testclient import TestClient

    from api.app import app
    from core import registry

    with session_scope() as session:
        headers = {"Authorization": f"Bearer {auth.create_token(session, owner='ann', scopes=['user'])}"}
        registry.register(  # a live CPU worker, as one registers: the checks after the slice's run
            session, name="cpu", host="h", pid=1, slice="", queues=["cpu"], gpus=[], capabilities={}
        )
    model = tmp_path / "model"  # a saved model to the submit checks (no worker loads it)
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen3"}')
    (model / "model.safetensors").write_bytes(b"")
    client = TestClient(app)

    def create(lines, **request) -> dict:
        data = "".join(json.dumps(line) + "\n" for line in lines).encode()
        upload = client.post("/v1/files", headers=headers, files={"file": ("b.jsonl", data)}, data={"purpose": "batch"})
        body = {"input_file_id": upload.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        answer = client.post("/v1/batches", headers=headers, json=body | request)
        assert set(answer.json()) == {"error"} and set(answer.json()["error"]) == OPENAI_ERROR, answer.text
        return {"status": answer.status_code, **answer.json()["error"]}

    def line(custom_id: str, **body) -> dict:
        return chat_line(custom_id, "hi", **{"model": str(model), **body})

    for lines, request, status, param, message in (
        ([line("a"), line("b", model="/elsewhere")], {}, 400, "body.model", "name different models"),
        ([line("a", model="/nowhere/model")], {}, 404, "body.model", "'/nowhere/model' does not exist"),
        ([line("a")], {"metadata": {"priority": "urgent"}}, 400, "metadata.priority", "priority: Input should be"),
        ([line("a")], {"metadata": {"priority": "high"}}, 403, "metadata.priority", "priority or admin scope"),
        ([line("a"), {**line("b"), "url": "/v1/completions"}], {}, 400, "url", "line 2 has url '/v1/completions'"),
        ([line("a", max_tokens=0), line("b", max_tokens=0)], {}, 400, "body.max_tokens", "no row of the dataset can"),
        ([line("a", n=0)], {}, 400, "body.n", "line 1: invalid per-row parameter: num_return_sequences"),
        ([line("a"), line("a")], {}, 400, "custom_id", "duplicate custom_id 'a' on lines 1 and 2"),
    ):
        error = create(lines, **request)
        assert (error["status"], error["type"], error["param"]) == (status, "invalid_request_error", param), error
        assert message in error["message"], error

    spec = {"model": str(model), "input": "file_000000000000", "priority": "urgent"}
    refused = client.post("/jobs", headers=headers, json=spec)
    assert refused.status_code == 422 and set(refused.json()["error"]) == {"type", "message"}, refused.text
    assert "priority: Input should be" in refused.json()["error"]["message"]


def test_files_list_pages_filters_and_shows_only_the_callers_files(tmp_path, api_server):
    """files.list(): the caller's stored files (an uploaded batch file and one of POST /files alike, purpose
    `batch`), newest first; `limit` pages with has_more and the client's auto-paging follows `after`; order=asc;
    `purpose` filters (batch output files are not listed); another user sees only theirs and gets 404 for a cursor
    of ann's; an admin sees everyone's."""
    url, admin_token, _ = api_server
    with session_scope() as session:
        tokens = {owner: auth.create_token(session, owner=owner, scopes=["user"]) for owner in ("ann", "bob")}
    ann, bob, admin = (OpenAI(base_url=f"{url}/v1", api_key=t, max_retries=0) for t in (*tokens.values(), admin_token))
    data = b'{"prompt": "hi"}\n'
    anns = [ann.files.create(file=(f"{n}.jsonl", data), purpose="batch").id for n in ("one", "two", "three")]
    anns.append(Client(url, tokens["ann"]).upload(write_lines(tmp_path / "four.jsonl", [{"prompt": "x"}]))["id"])
    bobs = [bob.files.create(file=("bob.jsonl", data), purpose="batch").id]

    listed = ann.files.list()
    assert [f.id for f in listed.data] == anns[::-1] and not listed.has_more
    assert [(f.filename, f.purpose, f.bytes) for f in listed.data[-3:]] == [
        (f"{n}.jsonl", "batch", len(data)) for n in ("three", "two", "one")
    ]
    assert listed.data[0].purpose == "batch"  # POST /files stores it as input: OpenAI's batch
    first = ann.files.list(limit=3)
    assert [f.id for f in first.data] == anns[::-1][:3] and first.has_more
    assert [f.id for f in ann.files.list(limit=3)] == anns[::-1]  # auto-paging follows `after`
    assert [f.id for f in ann.files.list(limit=1, order="asc")] == anns
    assert [f.id for f in ann.files.list(after=anns[2], limit=1).data] == [anns[1]]
    assert [f.id for f in ann.files.list(after=anns[1], order="asc").data] == anns[2:]
    assert [f.id for f in ann.files.list(purpose="batch")] == anns[::-1]
    assert ann.files.list(purpose="batch_output").data == []
    raw = httpx.get(f"{url}/v1/files", params={"limit": 2}, headers={"Authorization": f"Bearer {tokens['ann']}"})
    assert raw.json() | {"data": None} == {
        "object": "list",
        "data": None,
        "first_id": anns[3],
        "last_id": anns[2],
        "has_more": True,
    }

    assert [f.id for f in bob.files.list()] == bobs
    assert raises(lambda: bob.files.list(after=anns[0]), openai.NotFoundError, 404).param == "after"
    assert [f.id for f in admin.files.list()] == bobs + anns[::-1]
    assert raises(lambda: ann.files.list(limit=10_001), openai.BadRequestError, 400).param == "limit"
    assert raises(lambda: ann.files.list(order="sideways"), openai.BadRequestError, 400).param == "order"
    assert ann.files.delete(anns[0]).deleted
    assert [f.id for f in ann.files.list(order="asc")] == anns[1:]
