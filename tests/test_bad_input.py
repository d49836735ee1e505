"""Bad input: every refusal says exactly what was wrong and what to do, with its HTTP status or CLI exit code,
and nothing is left half-written.

A refused submit leaves no job, row, shard or file behind (the database and the artifacts folder are compared
before and after). A row-level problem becomes a failed row naming its line while the other rows stay intact.
Most cases go through the FastAPI app in-process (`TestClient`, real Redis and SQLite, per-case settings); the
CLI cases go through a real API server; one case runs bad rows past a real worker, which survives them.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import func, select

from core import settings as core_settings
from core.dataset import parse_jsonl
from core.db import session_scope
from core.models import File, Job, JobRow, Shard
from tests.conftest import ROOT, registered, wait_for
from tests.test_e2e import jobs, write_rows

DROP = object()  # a spec value that removes the field
EMPTY = "the dataset is empty: expected one JSON object per line with 'prompt' or 'messages'"
ONE_OF = "a row needs exactly one of 'prompt' (a string) or 'messages' (a list of messages)"
SAMPLE_AT_ZERO = (
    "do_sample is true but temperature is 0 (the row's or the job's): sampling needs a temperature "
    "above 0; set one, or set do_sample false for greedy decoding"
)
GREEDY_N2 = (
    "num_return_sequences 2 needs sampling (greedy decoding returns the same text each time): set "
    "temperature > 0 or do_sample true for this row"
)
ATTN = (
    "unknown attention backend 'bogus': use one of sdpa, sdpa_gqa, eager, flex_attention, flash_attention_2, "
    "flash_attention_3, flash_attention_4, 'paged|<backend>', or a Hub kernel repo id such as "
    "'kernels-community/flash-attn'"
)


# --- the harness ----------------------------------------------------------------------------------------------


@dataclass
class Api:
    """The FastAPI app in-process on the test's own store, with an admin token (alice) and a user token (bob)."""

    client: Any
    admin: dict[str, str]
    bob: dict[str, str]
    artifacts: Path
    monkeypatch: Any

    def upload(self, data: bytes, name: str = "data.jsonl", headers: dict[str, str] | None = None) -> str:
        response = self.client.post("/files", files={"file": (name, data)}, headers=headers or self.admin)
        assert response.status_code == 201, response.text
        return response.json()["id"]

    def submit(self, spec: Any, headers: dict[str, str] | None = None):
        return self.client.post("/jobs", json=spec, headers=headers or self.admin)

    def setenv(self, **values: str) -> None:
        """Change JOBS_* settings for this test (the app reads them lazily)."""
        for key, value in values.items():
            self.monkeypatch.setenv(key, value)
        core_settings.reset()

    def stored(self) -> dict[str, Any]:
        """Everything a submit could write: table counts and the files under the artifacts folder."""
        with session_scope() as session:
            counts = {
                m.__tablename__: session.scalar(select(func.count()).select_from(m)) for m in (Job, JobRow, Shard, File)
            }
        counts["redis keys"] = redis.Redis.from_url(core_settings.get_settings().redis_url).dbsize()
        folder = self.artifacts / "files"
        counts["on disk"] = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        return counts


@pytest.fixture
def api(jobs_env, monkeypatch) -> Iterator[Api]:
    from fastapi.testclient import TestClient

    from api.app import app
    from core import auth

    with session_scope() as session:
        admin = auth.create_token(session, owner="alice", scopes=["admin", "user"], name="tests")
        bob = auth.create_token(session, owner="bob", scopes=["user"], name="tests")
    yield Api(
        TestClient(app),
        {"Authorization": f"Bearer {admin}"},
        {"Authorization": f"Bearer {bob}"},
        Path(jobs_env.env["JOBS_ARTIFACTS"]),
        monkeypatch,
    )
    core_settings.reset()


def fake_model(
    path: Path, *, config: str | None = '{"model_type": "qwen3"}', weights: str = "model.safetensors"
) -> Path:
    """A directory that looks like a saved model to the submit checks (no worker ever loads it)."""
    path.mkdir(parents=True)
    if config is not None:
        (path / "config.json").write_text(config)
    (path / weights).write_bytes(b"")
    return path


@pytest.fixture
def model(tmp_path) -> Path:
    return fake_model(tmp_path / "models" / "tiny")


def lines(*rows: Any) -> bytes:
    """JSONL bytes: dicts are dumped, bytes and str are taken as the line itself."""

    def line(row: Any) -> bytes:
        return row if isinstance(row, bytes) else (row if isinstance(row, str) else json.dumps(row)).encode()

    return b"".join(line(row) + b"\n" for row in rows)


def error_of(response) -> tuple[int, str]:
    body = response.json()
    return response.status_code, body["error"]["message"] if "error" in body else body


def refused(api: Api, spec: Any, status: int, message: str, headers: dict[str, str] | None = None) -> None:
    """The submit is refused with exactly `status` and `message`, and nothing at all was written."""
    before = api.stored()
    assert error_of(api.submit(spec, headers)) == (status, message)
    assert api.stored() == before


def row_errors(api: Api, job_id: str) -> list[tuple[int, str, str]]:
    response = api.client.get(f"/jobs/{job_id}/results", params={"errors": True}, headers=api.admin)
    return [(r["line"], r["custom_id"], r["error"]) for r in map(json.loads, response.text.splitlines())]


def rows_of(job_id: str) -> list[JobRow]:
    with session_scope() as session:
        return list(session.scalars(select(JobRow).where(JobRow.job_id == job_id).order_by(JobRow.idx)))


# --- the spec -------------------------------------------------------------------------------------------------

SPEC_CASES = [
    # (case, spec fields over a valid spec, HTTP status, exact message)
    ("unknown field", {"bogus": 1}, 422, "invalid generate spec: unknown field 'bogus'"),
    (
        "a misspelt field",
        {"max_tokens": 5},
        422,
        "invalid generate spec: unknown field 'max_tokens' (did you mean 'max_new_tokens'?)",
    ),
    (
        "no model",
        {"model": DROP},
        422,
        "model is missing: name one (--model, or `model:` in the spec); only OpenAI "
        "batch lines may name it instead, in body.model",
    ),
    ("no input", {"input": DROP}, 422, "invalid generate spec: input: Field required"),
    (
        "model as a number",
        {"model": 5},
        422,
        "invalid generate spec: model: give a string, not the number 5 (YAML and --set read unquoted digits, and "
        "digits with one e, as a number: quote it)",
    ),
    (
        "a commit id YAML reads as a number",
        {"revision": 1234567},  # `revision: 1234567` unquoted in a spec file or --set
        422,
        "invalid generate spec: revision: give a string, not the number 1234567 (YAML and --set read unquoted "
        "digits, and digits with one e, as a number: quote it)",
    ),
    (
        "max_new_tokens 0",
        {"max_new_tokens": 0},
        422,
        "invalid generate spec: max_new_tokens: Input should be greater than or equal to 1",
    ),
    (
        "max_new_tokens 10**9",
        {"max_new_tokens": 10**9},
        422,
        "invalid generate spec: max_new_tokens: Input should be less than or equal to 131072",
    ),
    (
        "max_new_tokens not a number",
        {"max_new_tokens": "many"},
        422,
        "invalid generate spec: max_new_tokens: Input should be a valid integer, not 'many'",
    ),
    (  # strict, as the schema: a number in a string is not a number (the fuzzer found "5" accepted)
        "max_new_tokens a numeric string",
        {"max_new_tokens": "5"},
        422,
        "invalid generate spec: max_new_tokens: Input should be a valid integer, not '5'",
    ),
    (
        "ignore_eos 1",
        {"ignore_eos": 1},
        422,
        "invalid generate spec: ignore_eos: Input should be a valid boolean, not 1",
    ),
    (
        "temperature -1",
        {"temperature": -1},
        422,
        "invalid generate spec: temperature: Input should be greater than or equal to 0",
    ),
    ("top_p 0", {"top_p": 0}, 422, "invalid generate spec: top_p: Input should be greater than 0"),
    ("top_p 1.5", {"top_p": 1.5}, 422, "invalid generate spec: top_p: Input should be less than or equal to 1"),
    ("top_k -1", {"top_k": -1}, 422, "invalid generate spec: top_k: Input should be greater than or equal to 0"),
    (
        "repetition_penalty 0",
        {"repetition_penalty": 0},
        422,
        "invalid generate spec: repetition_penalty: Input should be greater than 0",
    ),
    (
        "an empty stop string",
        {"stop": ["\n", ""]},
        422,
        "invalid generate spec: stop: an empty stop string would end every row before its first token: remove it",
    ),
    (
        "17 stop strings",
        {"stop": [f"s{i}" for i in range(17)]},
        422,
        "invalid generate spec: stop: at most 16 items, not 17",
    ),
    (
        "sampling at temperature 0",
        {"do_sample": True, "temperature": 0},
        422,
        f"invalid generate spec: {SAMPLE_AT_ZERO}",
    ),
    (
        "repetition_penalty on the continuous engine",
        {"engine": "continuous", "repetition_penalty": 1.2},
        422,
        "invalid generate spec: repetition_penalty is not supported by the continuous engine (transformers drops it): "
        "use engine padded or auto",
    ),
    (
        "top_p on the fast engine",
        {"engine": "fast", "temperature": 0.7, "top_p": 0.9},
        422,
        "invalid generate spec: top_p is not supported by the fast engine: use engine auto (which runs such rows "
        "padded) or padded",
    ),
    ("unknown kind", {"kind": "train"}, 422, "unknown job kind 'train': use 'generate' or 'finetune'"),
    ("kind not a string", {"kind": 3}, 422, "unknown job kind 3: use 'generate' or 'finetune'"),
    (
        "a fine-tune with an unknown scheduler",
        {"kind": "finetune", "lr_scheduler": "cosinus"},
        422,
        "invalid finetune spec: lr_scheduler: unknown lr_scheduler 'cosinus': use one of linear, cosine, "
        "cosine_with_restarts, polynomial, constant, constant_with_warmup, inverse_sqrt, cosine_with_min_lr, "
        "warmup_stable_decay",
    ),
    ("gpus -1", {"gpus": -1}, 422, "invalid generate spec: gpus: Input should be greater than or equal to 0"),
    ("gpus 65", {"gpus": 65}, 422, "invalid generate spec: gpus: Input should be less than or equal to 64"),
    (
        "unknown attention backend",
        {"attn_implementation": "bogus"},
        422,
        f"invalid generate spec: attn_implementation: {ATTN}",
    ),
    (
        "unknown quantization",
        {"quantization": "int3"},
        422,
        "invalid generate spec: quantization.method: Input should be 'bnb-4bit', 'bnb-8bit', 'torchao-int8', "
        "'torchao-int4', 'torchao-float8' or 'fp8', not 'int3'",
    ),
    (
        "unknown dtype",
        {"dtype": "int8"},
        422,
        "invalid generate spec: dtype: Input should be 'auto', 'bfloat16', 'float16' or 'float32', not 'int8'",
    ),
    (
        "trust_remote_code forbidden",
        {"trust_remote_code": True},
        403,
        "trust_remote_code is disabled on this server (JOBS_ALLOW_REMOTE_CODE): use a model that transformers "
        "supports natively",
    ),
    (
        "model path missing",
        {"model": "{tmp}/nope"},
        404,
        "model '{tmp}/nope' does not exist: give a local model directory or a Hub id (org/name)",
    ),
    (
        "a relative path that is not a Hub id",
        {"model": "../nope"},
        422,
        "model '../nope' is a relative path (the API server would read it from its own working directory): give an "
        "absolute path on the server, or a Hub id (org/name)",
    ),
    ("model path empty", {"model": " "}, 422, "model is empty: give a local model directory or a Hub id (org/name)"),
    (
        "model path is a file",
        {"model": "{model}/config.json"},
        422,
        "model path '{model}/config.json' is not a directory: point at a directory saved with save_pretrained "
        "(config.json and *.safetensors)",
    ),
    (
        "input file id unknown",
        {"input": "file_000000000000"},
        404,
        "no file 'file_000000000000': upload it with the job (`gpujobs submit --input FILE`)",
    ),
    (
        "input empty",
        {"input": ""},
        422,
        "input is empty: give a file id (file_…) from POST /files, or a server path under JOBS_DATA_ROOTS",
    ),
    (
        "dataset server path missing",
        {"input": "{tmp}/nope.jsonl"},
        404,
        "dataset path '{tmp}/nope.jsonl' does not exist on the API's host (looked for {tmp}/nope.jsonl): give a "
        "path that exists there, or upload the file and give its id",
    ),
    ("dataset server path a directory", {"input": "{tmp}"}, 422, "dataset path '{tmp}' is not a regular file"),
]


def fill(value: Any, **names: str) -> Any:
    """Put the test's paths into a case's strings ({tmp}, {model})."""
    if isinstance(value, str):
        return value.format(**names)
    if isinstance(value, dict):
        return {k: fill(v, **names) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, **names) for v in value]
    return value


@pytest.mark.parametrize(("fields", "status", "message"), [c[1:] for c in SPEC_CASES], ids=[c[0] for c in SPEC_CASES])
def test_a_bad_spec_is_refused_with_its_message_and_writes_nothing(api, model, tmp_path, fields, status, message):
    """Each bad spec gets its exact status and message; no job, row, shard or file is written."""
    spec = {"model": str(model), "input": api.upload(lines({"prompt": "hi"})), "gpus": 0}
    names = {"tmp": str(tmp_path), "model": str(model)}
    for key, value in fill(fields, **names).items():
        spec.pop(key) if value is DROP else spec.__setitem__(key, value)
    refused(api, spec, status, fill(message, **names))


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (dict(config=None), "model directory '{m}' has no config.json: point at a saved transformers model"),
        (
            dict(weights="pytorch_model.bin"),
            "model directory '{m}' has no .safetensors weights (pickle .bin "
            "checkpoints are refused): convert it with save_pretrained(..., safe_serialization=True)",
        ),
        (
            dict(config="{not json"),
            "model directory '{m}' has a config.json that is not a JSON object (of at most "
            "10485760 bytes): save the model again with save_pretrained",
        ),
        (
            dict(config="[1, 2]"),
            "model directory '{m}' has a config.json that is not a JSON object (of at most "
            "10485760 bytes): save the model again with save_pretrained",
        ),
    ],
    ids=["no config.json", "pickle weights only", "config.json not JSON", "config.json not an object"],
)
def test_a_model_directory_that_is_not_a_saved_model_is_refused(api, tmp_path, layout, message):
    """A model directory without config.json, with only pickle weights, or with a config.json that is not a
    JSON object is refused before anything is stored."""
    m = fake_model(tmp_path / "m", **layout)
    refused(api, {"model": str(m), "input": api.upload(lines({"prompt": "hi"})), "gpus": 0}, 422, message.format(m=m))


def test_a_relative_model_path_is_refused_over_http_and_an_org_name_not_there_stays_a_hub_id(api, tmp_path):
    """Over HTTP a model path relative to the API server's working directory (one present there, Hub-id shaped or
    not) or with ./, ../ or ~ in front is refused naming what to give, nothing written; an org/name that is not
    there passes this check (a Hub id)."""
    from api import checks

    fake_model(tmp_path / "home" / "models" / "tiny")
    api.monkeypatch.chdir(tmp_path)
    data = api.upload(lines({"prompt": "hi"}))
    cwd, home = "its own working directory", "its user's home"
    for model, where in [
        ("home/models/tiny", cwd),
        ("home/models", cwd),  # org/name shaped, but present in the working directory
        ("./home/models/tiny", cwd),
        ("../x/y", cwd),
        (".", cwd),
        ("~/models/tiny", home),
    ]:
        refused(
            api,
            {"model": model, "input": data, "gpus": 0},
            422,
            f"model {model!r} is a relative path (the API server would read it from {where}): give an absolute path "
            "on the server, or a Hub id (org/name)",
        )
    assert checks.request({"model": "models/tiny", "input": data}, admin=True) is None


def test_remote_code_passes_that_check_when_the_server_allows_it(api, model):
    """With JOBS_ALLOW_REMOTE_CODE=1 a trust_remote_code spec passes the check and the job is queued."""
    api.setenv(JOBS_ALLOW_REMOTE_CODE="1")
    response = api.submit(
        {"model": str(model), "input": api.upload(lines({"prompt": "hi"})), "gpus": 0, "trust_remote_code": True}
    )
    assert response.status_code == 201, response.text
    assert response.json()["state"] == "running" and response.json()["spec"]["trust_remote_code"] is True


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"[1, 2]", 422, "a job spec must be a JSON object, not list"),
        (b'"a spec"', 422, "a job spec must be a JSON object, not str"),
        (b"{not json", 400, "the body is not valid JSON: Expecting property name enclosed in double quotes: line 1"),
        (  # Python's reader takes NaN and Infinity; JSON has neither
            b'{"model": "m", "input": "file_000000000000", "temperature": NaN}',
            400,
            "the body is not valid JSON: NaN is not a JSON number: give a finite number, or leave the field out",
        ),
        (b"[" * 5000 + b"]" * 5000, 400, "the body is nested too deeply to be a job spec"),  # a RecursionError: 500
    ],
    ids=["a JSON list", "a JSON string", "not JSON", "NaN", "nested too deeply"],
)
def test_a_body_that_is_not_a_json_object_is_refused(api, body, status, message):
    """POST /jobs with a JSON array or a string is a 422 naming the problem, broken JSON a 400 (malformed, not
    invalid); nothing is written."""
    before = api.stored()
    response = api.client.post("/jobs", content=body, headers={**api.admin, "Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert response.json()["error"]["message"].startswith(message)
    assert api.stored() == before


def test_nan_in_a_body_that_fails_validation_is_a_422_not_a_500(api):
    """A body with NaN or Infinity where pydantic validates it: the 422 echoes the value as text (the error handler
    itself failed to write it as JSON, a 500), also on the one route that needs no token."""
    for method, path, body, headers in (
        ("PUT", "/quotas", b'{"owner": "bob", "max_gpu_seconds_per_day": NaN}', api.admin),
        ("POST", "/dashboard/session", b'{"code": Infinity}', {}),
    ):
        response = api.client.request(
            method, path, content=body, headers={**headers, "Content-Type": "application/json"}
        )
        assert response.status_code == 422, response.text
        assert response.json()["error"]["type"] == "InvalidInput"
        assert response.json()["detail"][0]["input"] in ("nan", "inf"), response.text


def test_a_file_whose_stored_copy_is_gone_is_a_404(api):
    """GET /v1/files/{id}/content of a file removed from the artifacts store behind the database's back: a 404 that
    says so (a 500 from FileResponse before)."""
    from core import files
    from core.db import session_scope

    file_id = api.upload(lines({"prompt": "hi"}))
    with session_scope() as session:
        files.absolute(files.get(session, file_id, owner=None)).unlink()
    response = api.client.get(f"/v1/files/{file_id}/content", headers=api.admin)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["message"] == (
        f"file {file_id}'s stored copy is gone from the server's artifacts store: upload it again"
    )


JSON_ROUTES = [
    ("PUT", "/quotas", {"owner": "ann", "max_running_shards": 1}),
    (
        "POST",
        "/v1/batches",
        {"input_file_id": "file_x", "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ),
    ("POST", "/models/pull", {"repo": "org/name"}),
    ("POST", "/models/remove", {"repo": "org/name"}),
    ("POST", "/dashboard/session", {"code": "x"}),
]


@pytest.mark.parametrize(("method", "path", "body"), JSON_ROUTES, ids=[f"{m} {p}" for m, p, _ in JSON_ROUTES])
def test_a_json_route_given_a_body_without_a_json_content_type_says_which_header_to_send(api, method, path, body):
    """A JSON body sent as a form (`curl -d`), as text/plain or with no Content-Type is a 422 (OpenAI's 400 under
    /v1) that says to send Content-Type: application/json, nothing written; the same body as application/json passes
    that point, and a JSON array as application/json keeps the validation message."""
    invalid = 400 if path.startswith("/v1/") else 422
    before = api.stored()
    for sent in ("application/x-www-form-urlencoded", "text/plain", None):
        headers = {**api.admin, **({"Content-Type": sent} if sent else {})}
        response = api.client.request(method, path, content=json.dumps(body).encode(), headers=headers)
        assert error_of(response) == (
            invalid,
            f"the body was not read as JSON because its Content-Type is {repr(sent) if sent else 'missing'}: send "
            "the body as JSON with Content-Type: application/json",
        )
    assert api.stored() == before
    listed = api.client.request(method, path, content=b"[1]", headers={**api.admin, "Content-Type": "application/json"})
    assert error_of(listed)[0] == invalid and "Content-Type" not in error_of(listed)[1], listed.text
    sent_as_json = api.client.request(method, path, json=body, headers=api.admin)
    assert "Content-Type" not in sent_as_json.text, sent_as_json.text


def test_a_query_parameter_a_route_does_not_take_is_refused_naming_those_it_takes(api, model):
    """FastAPI ignores a query parameter a route does not declare: `GET /jobs?stat=failed` (a typo of `state`) or
    `?owner=alice` listed every job. Our routes refuse one (422 InvalidInput) naming it and those the route takes,
    before they act (a submit with one writes nothing), after the token is checked (401 first); the declared ones
    still work. /v1 (OpenAI clients send their own), /metrics, /dashboard and the document are left as they were."""
    job = api.submit({"model": str(model), "input": api.upload(lines({"prompt": "hi"})), "gpus": 0}).json()
    cases = {
        "/jobs?stat=failed": "unknown query parameter 'stat' for GET /jobs: it takes state, limit, after",
        "/jobs?owner=alice&limit=5&Limit=1&owner=bob": (
            "unknown query parameters 'owner', 'Limit' for GET /jobs: it takes state, limit, after"
        ),
        "/jobs/job_000000000000/results?fmt=csv": (
            "unknown query parameter 'fmt' for GET /jobs/{job_id}/results: it takes errors, format, order, with_input"
        ),
        "/quotas?owner=ann": "unknown query parameter 'owner' for GET /quotas: it takes none",
        "/healthz?verbose": "unknown query parameter 'verbose' for GET /healthz: it takes none",
    }
    for url, message in cases.items():
        response = api.client.get(url, headers=api.admin)
        assert error_of(response) == (422, message), url
        assert response.json()["error"]["type"] == "InvalidInput"
    assert api.client.get("/jobs?stat=failed", headers={"Authorization": "Bearer nope"}).status_code == 401
    for state, ids in ((job["state"], [job["id"]]), ("failed", [])):
        listed = api.client.get(f"/jobs?state={state}&limit=5", headers=api.admin)
        assert listed.status_code == 200 and [j["id"] for j in listed.json()] == ids, listed.text
    spec = {"model": str(model), "input": api.upload(lines({"prompt": "hi"})), "gpus": 0}
    before = api.stored()
    submitted = api.client.post("/jobs?priority=high", json=spec, headers=api.admin)
    assert error_of(submitted) == (422, "unknown query parameter 'priority' for POST /jobs: it takes none")
    assert api.stored() == before
    for url in ("/v1/batches?foo=1", "/metrics?foo=1", "/dashboard?foo=1", "/openapi.json?foo=1", "/docs?foo=1"):
        assert api.client.get(url, headers=api.admin).status_code == 200, url


def test_another_owners_file_is_not_found(api, model):
    """bob cannot submit on alice's file: it answers 404 as if it did not exist, and nothing is written."""
    alices = api.upload(lines({"prompt": "hi"}))
    refused(
        api,
        {"model": str(model), "input": alices, "gpus": 0},
        404,
        f"no file {alices!r}: upload it with the job (`gpujobs submit --input FILE`)",
        headers=api.bob,
    )


# --- server-side paths and roots ------------------------------------------------------------------------------


@pytest.fixture
def roots(api, tmp_path, model) -> dict[str, Path]:
    """JOBS_MODEL_ROOTS and JOBS_DATA_ROOTS set to folders of the test's own."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ok.jsonl").write_bytes(lines({"prompt": "hi"}))
    api.setenv(JOBS_MODEL_ROOTS=str(model.parent), JOBS_DATA_ROOTS=str(data))
    return {"models": model.parent, "data": data}


def test_a_model_outside_the_model_roots_is_refused(api, roots, tmp_path):
    """A model directory outside JOBS_MODEL_ROOTS is refused with 403 naming the roots; a Hub id is refused
    too (models come only from the roots and JOBS_HUB_MODELS); the model inside the roots is accepted."""
    outside = fake_model(tmp_path / "elsewhere")
    data = str(roots["data"] / "ok.jsonl")
    refused(
        api,
        {"model": str(outside), "input": data, "gpus": 0},
        403,
        f"model path '{outside}' is outside the allowed roots ({roots['models']}): move it under one of them",
    )
    refused(
        api,
        {"model": "Qwen/Qwen3-0.6B", "input": data, "gpus": 0},
        422,
        f"model 'Qwen/Qwen3-0.6B' is not a directory under the model roots ({roots['models']}): this server "
        "loads models only from JOBS_MODEL_ROOTS and the Hub ids JOBS_HUB_MODELS lists",
    )
    refused(
        api,
        {"model": f"{roots['models']}/../elsewhere", "input": data, "gpus": 0},
        403,
        f"model path '{roots['models']}/../elsewhere' is outside the allowed roots ({roots['models']}): move it "
        "under one of them",
    )
    accepted = api.submit({"model": str(roots["models"] / "tiny"), "input": data, "gpus": 0})
    assert accepted.status_code == 201, accepted.text


@pytest.mark.parametrize(
    "path",
    ["{tmp}/other.jsonl", "{data}/../../../../etc/passwd", "/etc/passwd", "{data}/link-to-passwd"],
    ids=["outside the roots", "traversal out of the root", "a system file", "a symlink in the root to /etc/passwd"],
)
def test_a_dataset_path_outside_the_data_roots_is_refused(api, roots, tmp_path, model, path):
    """A server-side dataset outside JOBS_DATA_ROOTS, reached by `..` or by a symlink inside the root, is
    refused with 403 (the path is resolved first); nothing is copied into the store."""
    (tmp_path / "other.jsonl").write_bytes(lines({"prompt": "hi"}))
    (roots["data"] / "link-to-passwd").symlink_to("/etc/passwd")
    path = path.format(tmp=tmp_path, data=roots["data"])
    refused(
        api,
        {"model": str(model), "input": path, "gpus": 0},
        403,
        f"dataset path {path!r} is outside the allowed roots ({roots['data']}): move it under one of them",
    )


def test_a_server_path_refused_after_it_was_copied_in_leaves_no_copy(api, roots, model):
    """A dataset inside the roots that is refused as a whole (duplicate custom_ids) is copied into the store
    first: the copy is removed when the submit's transaction rolls back."""
    dup = lines({"prompt": "a", "custom_id": "x"}, {"prompt": "b", "custom_id": "x"})
    (roots["data"] / "dup.jsonl").write_bytes(dup)
    refused(
        api,
        {"model": str(model), "input": str(roots["data"] / "dup.jsonl"), "gpus": 0},
        422,
        "duplicate custom_id 'x' on lines 1 and 2: custom_ids must be unique within a dataset",
    )
    ok = api.submit({"model": str(model), "input": str(roots["data"] / "ok.jsonl"), "gpus": 0})
    assert ok.status_code == 201, ok.text
    assert len(api.stored()["on disk"]) == 1


# --- uploads --------------------------------------------------------------------------------------------------


def test_an_upload_named_with_a_path_is_stored_under_our_own_id(api):
    """An upload named ../../etc/passwd is stored as files/<its id>; the name is kept only as the label
    'passwd'; nothing is written outside the store."""

    def written() -> set[Path]:
        return {p for p in api.artifacts.parent.parent.rglob("*") if p.is_file() and "jobs.db" not in p.name}

    before = written()
    response = api.client.post("/files", files={"file": ("../../etc/passwd", b'{"prompt": "hi"}\n')}, headers=api.admin)
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["filename"] == "passwd" and body["id"].startswith("file_")
    assert written() - before == {api.artifacts / "files" / body["id"]}


def test_an_oversized_upload_is_refused_and_leaves_nothing(api):
    """An upload over JOBS_MAX_UPLOAD_BYTES is a 413 with the limit and the setting; no file row, no stored
    file and no .part file are left."""
    api.setenv(JOBS_MAX_UPLOAD_BYTES="1000")
    before = api.stored()
    response = api.client.post("/files", files={"file": ("big.jsonl", b"x" * 5000)}, headers=api.admin)
    assert error_of(response) == (
        413,
        "'big.jsonl' is larger than the upload limit of 1000 bytes "
        "(JOBS_MAX_UPLOAD_BYTES): split the dataset into several jobs",
    )
    assert api.stored() == before
    assert not list(api.artifacts.rglob("*.part"))


def test_a_large_body_is_refused_before_it_is_read(api):
    """api/limits.py: a body over its limit is a 413 from its Content-Length alone, and one of unknown length once
    it passes the limit; a body over a few KiB without a valid token is a 401 before any of it is read (FastAPI
    read and spooled a whole upload before the route's token check)."""
    api.setenv(JOBS_MAX_UPLOAD_BYTES="1000")
    sent = []

    def body(chunks: int, size: int = 1 << 20):
        for _ in range(chunks):
            sent.append(size)
            yield b"x" * size

    before = api.stored()
    multipart = {"Content-Type": "multipart/form-data; boundary=b"}
    for headers in ({}, {"Authorization": "Bearer nope"}):  # no token, a wrong one: nothing read
        response = api.client.post("/files", content=body(3), headers={**headers, **multipart})
        assert response.status_code == 401 and response.json()["error"]["type"] == "Unauthorized", response.text
        assert sent == [] and response.headers["WWW-Authenticate"] == "Bearer"
    over = (5 << 20) + 1
    response = api.client.post(
        "/v1/files", headers={**api.admin, **multipart, "Content-Length": str(over)}, content=b""
    )
    assert error_of(response) == (
        413,
        "the upload is larger than the upload limit of 1000 bytes (JOBS_MAX_UPLOAD_BYTES): split the dataset into "
        "several jobs",
    )
    response = api.client.post("/files", content=body(3), headers={**api.admin, **multipart})  # chunked: counted
    assert response.status_code == 413 and response.json()["error"]["type"] == "TooLarge", response.text
    response = api.client.post(
        "/jobs", headers={**api.admin, "Content-Type": "application/json", "Content-Length": str(17 << 20)}, content=b""
    )
    assert error_of(response) == (
        413,
        f"the request body is over {16 << 20} bytes: a job spec or request holds settings, not data",
    )
    assert api.stored() == before


@pytest.mark.parametrize("path", ["/files", "/v1/files"])
def test_an_upload_with_two_file_parts_is_refused_and_stores_neither(api, path):
    """Two multipart parts named file (POST /files and the OpenAI route alike) are a 422 (OpenAI's 400, naming the
    field `file`) that says to send one, and neither is stored (FastAPI would have kept the last and dropped the
    first without a word); one part still uploads."""
    parts = [("file", ("one.jsonl", b'{"prompt": "hi"}\n')), ("file", ("empty.jsonl", b""))]
    before = api.stored()
    response = api.client.post(path, files=parts, data={"purpose": "batch"}, headers=api.admin)
    assert path == "/files" or response.json()["error"]["param"] == "file", response.text
    assert error_of(response) == (
        400 if path.startswith("/v1/") else 422,
        "the upload holds 2 parts named file: send exactly one part named file (one upload per file)",
    )
    assert api.stored() == before
    one = api.client.post(path, files=parts[:1], data={"purpose": "batch"}, headers=api.admin)
    assert one.status_code in (200, 201) and one.json()["filename"] == "one.jsonl", one.text


# --- datasets refused as a whole ------------------------------------------------------------------------------

DATASET_CASES = [
    ("empty file", b"", EMPTY),
    ("blank lines only", b"\n   \n\r\n\t\n", EMPTY),
    (
        "duplicate custom_ids",
        lines({"prompt": "a", "custom_id": "q"}, "", {"prompt": "b"}, {"prompt": "c", "custom_id": "q"}),
        "duplicate custom_id 'q' on lines 1 and 4: custom_ids must be unique within a dataset",
    ),
    (
        "a custom_id equal to a generated one",
        lines({"prompt": "a", "custom_id": "line-2"}, {"prompt": "b"}),
        "duplicate custom_id 'line-2' on lines 1 and 2: custom_ids must be unique within a dataset",
    ),
    (
        "UTF-16",
        '{"prompt": "hi"}\n'.encode("utf-16"),
        "the dataset is UTF-16 encoded (it starts with a UTF-16 byte-order mark): save it as UTF-8, one JSON object "
        "per line",
    ),
]


@pytest.mark.parametrize(("data", "message"), [c[1:] for c in DATASET_CASES], ids=[c[0] for c in DATASET_CASES])
def test_a_dataset_refused_as_a_whole_creates_no_job(api, model, data, message):
    """An empty dataset, one of blank lines, duplicate custom_ids or a UTF-16 file: 422 with the message, and
    no job, row or shard (the uploaded file stays the user's)."""
    refused(api, {"model": str(model), "input": api.upload(data), "gpus": 0}, 422, message)


def test_more_rows_than_jobs_max_rows_is_refused_before_any_insert(api, model):
    """With JOBS_MAX_ROWS=1000, 1001 rows are refused naming the limit and the setting, and nothing is
    written; 1000 rows (and blank lines) are accepted."""
    api.setenv(JOBS_MAX_ROWS="1000")
    refused(
        api,
        {"model": str(model), "input": api.upload(lines(*[{"prompt": "p"}] * 1001)), "gpus": 0},
        422,
        "the dataset has more than 1000 rows, the limit of this server (JOBS_MAX_ROWS): split it into several jobs",
    )
    ok = api.submit({"model": str(model), "input": api.upload(lines(*[{"prompt": "p"}] * 1000, "", "")), "gpus": 0})
    assert ok.status_code == 201, ok.text
    assert ok.json()["rows"]["total"] == 1000


def test_the_row_limit_also_holds_while_parsing():
    """parse_jsonl refuses row max_rows + 1 itself (the submit's pre-count is only the cheap first check)."""
    rows = parse_jsonl(io.BytesIO(lines(*[{"prompt": "p"}] * 4)), max_rows=3)
    with pytest.raises(Exception, match=r"more than 3 rows, the limit of this server \(JOBS_MAX_ROWS\)"):
        list(rows)


# --- rows that fail alone -------------------------------------------------------------------------------------

ROW_CASES = [
    # (case, the bad line, the exact error of that row)
    ("malformed JSON", b'{"prompt": "x"', "invalid JSON: Expecting ',' delimiter (column 15)"),
    ("not an object", b'["prompt", "x"]', "expected a JSON object, got list"),
    ("prompt as a number", {"prompt": 42}, "'prompt' must be a non-empty string, not a number"),
    ("prompt empty", {"prompt": ""}, "'prompt' must be a non-empty string"),
    (
        "messages not a list",
        {"messages": "hello"},
        "'messages' must be a non-empty list of {role, content} objects, not a string",
    ),
    (
        "a message without content",
        {"messages": [{"role": "user"}]},
        "messages[0] must be an object with 'role' (one of system, user, assistant, tool, developer) and 'content'",
    ),
    ("neither prompt nor messages", {"text": "hi"}, ONE_OF),
    (
        "max_new_tokens as a string",
        {"prompt": "x", "max_new_tokens": "12"},
        "invalid per-row parameter: max_new_tokens: Input should be a valid integer, not '12'",
    ),
    (
        "do_sample as a number",
        {"prompt": "x", "do_sample": 1},
        "invalid per-row parameter: do_sample: Input should be a valid boolean, not 1",
    ),
    (
        "an empty stop string in a row",
        {"prompt": "x", "stop": ""},
        "invalid per-row parameter: stop: an empty stop string would end every row before its first token: remove it",
    ),
    (
        "temperature -1 in a row",
        {"prompt": "x", "temperature": -1},
        "invalid per-row parameter: temperature: Input should be greater than or equal to 0",
    ),
    (
        "top_p 1.5 in a row",
        {"prompt": "x", "top_p": 1.5},
        "invalid per-row parameter: top_p: Input should be less than or equal to 1",
    ),
    ("sampling at temperature 0 in a row", {"prompt": "x", "do_sample": True, "temperature": 0}, SAMPLE_AT_ZERO),
    ("two outputs under greedy decoding in a row", {"prompt": "x", "num_return_sequences": 2}, GREEDY_N2),
    (
        "17 stop strings in a row",
        {"prompt": "x", "stop": ["s"] * 17},
        "invalid per-row parameter: stop: at most 16 items, not 17",
    ),
    ("non-UTF-8 bytes", b'{"prompt": "caf\xe9"}', "not valid UTF-8 at byte 15: save the file as UTF-8"),
    (
        "a NUL in the custom_id",
        {"prompt": "x", "custom_id": "a\u0000b"},
        "custom_id must be a non-empty string of at most 255 printable characters",
    ),
    (
        "NaN as a value",
        b'{"prompt": "x", "score": NaN}',
        "invalid JSON: NaN is not a JSON value: write null or a number",
    ),
    (
        "a lone surrogate escape",
        b'{"prompt": "a\\ud800b"}',
        "the row holds a lone UTF-16 surrogate escape (\\ud800 to \\udfff), which is not text: fix or remove the escape",
    ),
    (
        "JSON nested too deeply",
        b'{"prompt": "x", "deep": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        "invalid JSON: nested too deeply",
    ),
]


@pytest.mark.parametrize(("bad", "error"), [c[1:] for c in ROW_CASES], ids=[c[0] for c in ROW_CASES])
def test_a_bad_row_fails_alone_and_the_other_rows_are_kept(api, model, bad, error):
    """The bad row (line 3, after a blank line) is a failed row 'line 3: …'; the rows around it are pending
    and the job runs."""
    data = lines({"prompt": "first", "custom_id": "a"}, "", bad, {"prompt": "last", "custom_id": "b"})
    response = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0})
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["state"] == "running" and job["rows"] == {"total": 3, "succeeded": 0, "failed": 1, "pending": 2}
    [(line, custom_id, message)] = row_errors(api, job["id"])
    assert (line, message) == (3, f"line 3: {error}")
    assert [(r.custom_id, r.state, (r.input or {}).get("prompt")) for r in rows_of(job["id"])] == [
        ("a", "pending", "first"),
        (custom_id, "failed", None),
        ("b", "pending", "last"),
    ]


def test_a_row_with_the_jobs_temperature_0_and_its_own_do_sample_fails(api, model):
    """A row's do_sample is checked together with the job's temperature 0 (the engine would fail the shard)."""
    data = lines(
        {"prompt": "x", "do_sample": True}, {"prompt": "y"}, {"prompt": "z", "do_sample": True, "temperature": 0.7}
    )
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0, "temperature": 0}).json()
    assert [(line, error) for line, _, error in row_errors(api, job["id"])] == [(1, f"line 1: {SAMPLE_AT_ZERO}")]
    assert job["rows"]["pending"] == 2


def test_a_rows_parameter_the_jobs_engine_refuses_fails_that_row_at_submit(api, model):
    """Per-row checks of the engine the job asked for run at submit (the worker would refuse them one by one):
    a row's repetition_penalty under engine continuous, a row's top_p under engine fast, n > 1 where the job is
    greedy; the other rows stay pending."""
    cases = [
        (
            "continuous",
            {"repetition_penalty": 1.3},
            "repetition_penalty is not supported by the continuous "
            "engine (transformers drops it): use engine padded or auto",
        ),
        (
            "fast",
            {"do_sample": True, "temperature": 0.5, "top_p": 0.5},
            "top_p is not supported by the fast engine: use engine auto (which runs such rows padded) or padded",
        ),
        ("padded", {"num_return_sequences": 3, "temperature": 0}, GREEDY_N2.replace("sequences 2", "sequences 3")),
    ]
    for engine, params, error in cases:
        data = lines({"prompt": "ok"}, {"prompt": "x", **params})
        response = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0, "engine": engine})
        assert response.status_code == 201, response.text
        assert [(line, e) for line, _, e in row_errors(api, response.json()["id"])] == [(2, f"line 2: {error}")]
        assert response.json()["rows"]["pending"] == 1


def test_a_refused_csv_row_keeps_its_pass_through_columns_in_its_error_record(api, model):
    """A CSV row refused at submit (a bad parameter cell) comes back with `--errors` with its own pass-through
    columns (`tag`), like a row that ran; the CSV error export has the column too."""
    data = b"prompt,tag,max_new_tokens\nfine,keep-1,\nbad,keep-2,many\n"
    job = api.submit({"model": str(model), "input": api.upload(data, "d.csv"), "gpus": 0}).json()
    response = api.client.get(f"/jobs/{job['id']}/results", params={"errors": True}, headers=api.admin)
    [record] = map(json.loads, response.text.splitlines())
    assert record["tag"] == "keep-2" and record["line"] == 3 and record["error"].startswith("line 3: invalid per-row")
    exported = api.client.get(
        f"/jobs/{job['id']}/results", params={"errors": True, "format": "csv"}, headers=api.admin
    ).text
    assert exported.splitlines()[0].split(",")[-1] == "tag" and exported.splitlines()[1].endswith(",keep-2")


def test_a_10_mb_prompt_is_a_failed_row_that_is_not_stored_in_full(api, model):
    """A 10 MB row over JOBS_MAX_ROW_BYTES (1 MiB) fails with its size and the limit; only its first 2000 bytes
    are kept, and the rows after it are read normally."""
    huge = json.dumps({"prompt": "x" * 10_000_000}).encode()
    data = lines({"prompt": "before"}, huge, {"prompt": "after"})
    job = api.submit({"model": str(model), "input": api.upload(data), "gpus": 0}).json()
    assert row_errors(api, job["id"]) == [
        (
            2,
            "line-2",
            f"line 2: row of {len(huge)} bytes exceeds the limit of "
            "1048576 bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it",
        )
    ]
    bad = rows_of(job["id"])[1]
    assert bad.input == {"raw": huge[:2000].decode()}
    assert job["rows"] == {"total": 3, "succeeded": 0, "failed": 1, "pending": 2}


@pytest.mark.parametrize("ending", [b"\n", b"\r\n", b""])
def test_a_row_at_the_size_limit_is_kept_and_one_byte_more_is_not(ending):
    """The limit counts the row without its line ending, whatever the line ending (also at the end of file)."""
    row = b'{"prompt": "' + b"x" * 88 + b'"}'  # 102 bytes
    assert len(row) == 102
    parsed = list(parse_jsonl(io.BytesIO(row + (ending or b"\n") + row + b"x" + ending), max_row_bytes=102))
    assert parsed[0].error is None
    assert parsed[1].error == (
        "line 2: row of 103 bytes exceeds the limit of 102 bytes (JOBS_MAX_ROW_BYTES): shorten the row or split it"
    )


def test_a_byte_order_mark_at_the_start_is_not_part_of_the_first_row(api, model):
    """A UTF-8 file saved with a BOM (Windows editors) parses; the first row is not failed for it, nor is the first
    row of a second such file joined to it (`cat a.jsonl b.jsonl`)."""
    bom = b"\xef\xbb\xbf"
    job = api.submit({"model": str(model), "input": api.upload(bom + lines({"prompt": "hi"})), "gpus": 0})
    assert job.json()["rows"] == {"total": 1, "succeeded": 0, "failed": 0, "pending": 1}
    joined = bom + lines({"prompt": "hi"}) + bom + lines({"prompt": "ho"})
    job = api.submit({"model": str(model), "input": api.upload(joined), "gpus": 0})
    assert job.json()["rows"] == {"total": 2, "succeeded": 0, "failed": 0, "pending": 2}


def test_a_dataset_of_only_bad_rows_is_refused_and_stores_nothing(api, model):
    """Every row bad: the submit is refused (422) with the first reason, and no job, row or shard is stored (the
    upload stays the user's, to submit again with a fix); rows without a prompt name the keys the rows have and
    the option that maps one."""
    data = lines("{broken", {"prompt": 7}, b"\xff\xfe")
    refused(
        api,
        {"model": str(model), "input": api.upload(data), "gpus": 0},
        422,
        "no row of the dataset can run (3 rows, every one invalid); the first: line 1: invalid JSON: Expecting "
        "property name enclosed in double quotes (column 2): fix the dataset and submit it again",
    )
    refused(
        api,
        {
            "model": str(model),
            "input": api.upload(lines({"question": "q1", "tag": "a"}, {"question": "q2"})),
            "gpus": 0,
        },
        422,
        f"no row of the dataset can run (2 rows, every one invalid); the first: line 1: {ONE_OF}; the rows' keys "
        "are 'question', 'tag': map the column that holds the prompt with --column prompt=question (spec: "
        '"input_columns": {"prompt": "question"}), or messages=COLUMN for chat messages',
    )


def test_200000_tiny_rows_are_accepted(api, model):
    """A dataset of 200,000 tiny rows is accepted, inserted and sharded (submit time is printed)."""
    data = b'{"prompt": "p"}\n' * 200_000
    file_id = api.upload(data)
    t0 = time.perf_counter()
    response = api.submit({"model": str(model), "input": file_id, "gpus": 0})
    elapsed = time.perf_counter() - t0
    print(f"\nsubmit of 200,000 rows took {elapsed:.2f} s")
    assert response.status_code == 201, response.text
    assert response.json()["rows"]["total"] == 200_000
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(JobRow)) == 200_000
        assert session.scalar(select(func.count()).select_from(Shard)) == 200_000 // 256 + 1


# --- the CLI --------------------------------------------------------------------------------------------------


def test_the_cli_refuses_bad_input_with_its_exit_code_and_writes_nothing(tmp_path, jobs_env, api_server, model):
    """Through `gpujobs submit` against a real server: a missing --model, an empty dataset, a missing server path
    and a dataset whose rows all fail (with --wait too) exit 2 with their message and create no job and leave no
    upload; a job with one good row is accepted."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    empty = write_rows(tmp_path / "empty.jsonl", [])
    bad = write_rows(tmp_path / "bad.jsonl", ["{oops", {"prompt": ""}])
    missing = tmp_path / "missing.jsonl"
    all_bad = (
        "Error: no row of the dataset can run (2 rows, every one invalid); the first: line 1: invalid JSON: "
        "Expecting property name enclosed in double quotes (column 2): fix the dataset and submit it again"
    )
    cases = [
        (
            ["--input", bad],
            2,
            "Error: missing --model (or `model:` in the spec file); only OpenAI batch lines may "
            "name the model instead, in body.model",
        ),
        (["--model", str(model), "--input", empty, "--gpus", "0"], 2, f"Error: {EMPTY}"),
        (
            ["--model", str(model), "--input", str(missing), "--gpus", "0"],
            2,
            f"Error: --input {missing}: no such file or directory on this machine, so it was sent as a path on the "
            f"API's host; there: dataset path '{missing}' does not exist on the API's host (looked for {missing}): "
            "give a path that exists there, or upload the file and give its id",
        ),
        (["--model", str(model), "--input", bad, "--gpus", "0"], 2, all_bad),
        (["--model", str(model), "--input", bad, "--gpus", "0", "--wait"], 2, all_bad),
    ]
    for args, code, message in cases:
        result = jobs(env, "submit", "generate", *args)
        assert (result.returncode, result.stderr.strip(), result.stdout) == (code, message, ""), args
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(Job)) == 0
        assert session.scalar(select(func.count()).select_from(File)) == 0
    ok = jobs(
        env,
        "submit",
        "generate",
        "--model",
        str(model),
        "--input",
        write_rows(tmp_path / "ok.jsonl", [{"prompt": "hi"}]),
        "--gpus",
        "0",
    )
    assert ok.returncode == 0 and ok.stdout.startswith("job_"), ok.stderr
    with session_scope() as session:
        job = session.scalars(select(Job)).one()
    for args, message in (
        (["--run", "2"], f"Error: job {job.id} has only run 1 (each retry starts the next)"),
        (["--run", "1", "--all-runs"], "Error: give --run N or --all-runs, not both"),
    ):
        refused = jobs(env, "events", job.id, *args)
        assert (refused.returncode, refused.stderr.strip(), refused.stdout) == (2, message, ""), args


def test_gpus_contradicting_cuda_visible_devices_exits_5(jobs_env):
    """`gpujobs worker --gpus 0` under an inherited CUDA_VISIBLE_DEVICES=1 exits 5 (covered in depth in
    test_worker_env)."""
    result = jobs(dict(jobs_env.env, CUDA_VISIBLE_DEVICES="1"), "worker", "--gpus", "0")
    assert result.returncode == 5 and "CUDA_VISIBLE_DEVICES='1'" in result.stderr


# --- a real worker --------------------------------------------------------------------------------------------


def build_untrained_model(out: Path) -> Path:
    """A tiny random Qwen3 model with its tokenizer (no training: the answers do not matter here)."""
    subprocess.run(
        [sys.executable, "-m", "worker.tinymodel", str(out)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    return out


def test_a_worker_survives_bad_rows_and_takes_the_next_job(api, jobs_env, spawn_worker, tmp_path):
    """Bad rows (structural, and one over the model's context) fail with their line; the good rows succeed on a
    real worker, which stays alive and runs the next job."""
    worker = spawn_worker([], wait=False)
    model = build_untrained_model(tmp_path / "untrained")  # while the worker starts
    wait_for(lambda: registered(jobs_env.database_url, worker.pid), 90, "worker registration", procs=[worker])
    rows = [
        {"prompt": "hello", "custom_id": "good-1"},
        "{oops",
        {"prompt": "x", "max_new_tokens": "5"},
        {"prompt": "too long", "max_new_tokens": 131072, "custom_id": "long"},
        {"prompt": "x", "do_sample": True, "temperature": 0},
        {"messages": [{"role": "user", "content": "hi"}], "custom_id": "good-2"},
    ]
    spec = {"model": str(model), "max_new_tokens": 4, "batch_rows": 8}
    first = api.submit({**spec, "input": api.upload(lines(*rows))}).json()
    done = wait_for(
        lambda: (
            (j := api.client.get(f"/jobs/{first['id']}", headers=api.admin).json())["state"] in ("succeeded", "failed")
            and j
        ),
        90,
        "the first job",
        procs=[worker],
    )
    assert done["state"] == "succeeded" and done["rows"]["succeeded"] == 2 and done["rows"]["failed"] == 4
    errors = {custom_id: error for _, custom_id, error in row_errors(api, first["id"])}
    assert sorted(errors) == ["line-2", "line-3", "line-5", "long"]
    # caught before any GPU time by the API's token check (the validating step), so it names its line
    assert re.fullmatch(
        r"line 4: prompt of \d+ tokens \+ max_new_tokens 131072 exceeds the model's context of 512 tokens: "
        r"shorten the prompt or lower max_new_tokens",
        errors["long"],
    ), errors["long"]
    assert worker.alive()
    second = api.submit({**spec, "input": api.upload(lines({"prompt": "again"}))}).json()
    wait_for(
        lambda: api.client.get(f"/jobs/{second['id']}", headers=api.admin).json()["state"] == "succeeded",
        60,
        "the next job",
        procs=[worker],
    )
    assert worker.alive()
