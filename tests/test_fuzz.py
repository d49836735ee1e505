"""The API's contract, machine-checked: Schemathesis fuzzes the HTTP API from its own OpenAPI document with every
check (tests/fuzz.py), and the document says what the API does (api/openapi.py).

`test_schemathesis_finds_nothing` is CI's fuzzing: a stack like `gpujobs up`'s (uvicorn, its own Redis, no
worker), an admin's run on SQLite and a user's run (whose requests reach another owner's objects one time in three:
they must stay 404) on Postgres where one is configured (CI: Postgres found what SQLite did not), a fixed seed,
FUZZ_SECONDS each. Any finding fails it, with Schemathesis's report. What it once found is pinned below as plain
cases, on SQLite and on Postgres. A longer run, by hand: `python -m tests.fuzz`.
"""

from __future__ import annotations

import io
import json
import os
from typing import Any

import jsonschema_rs
import pytest
from fastapi.testclient import TestClient

from api import service, views
from api.app import app
from api.openapi import SPEC_EXAMPLES
from core import auth
from core.db import session_scope
from core.errors import InvalidInput
from core.spec import FinetuneSpec, GenerateSpec, parse_spec
from tests import fuzz, fuzz_hooks
from tests.services import POSTGRES_ENV, in_ci

# Each token's run; with its start-up and the phase under way when time is up, ~45 s on a loaded machine: 90 s for both
FUZZ_SECONDS = 35
SEED = 28


@pytest.mark.parametrize("who", [fuzz.ADMIN, fuzz.USER])
def test_schemathesis_finds_nothing(request, who, tiny_model, tmp_path):
    """Every check of Schemathesis, with an admin token (on SQLite) or a user token (on Postgres where configured),
    finds nothing: no server error, no undocumented status, content type or header, no answer off its schema, no
    schema-valid request refused (a job spec aside: tests/schemathesis.toml says why), no invalid one accepted, no
    route that ignores a missing token, and no other owner's object reached."""
    postgres = who == fuzz.USER and (in_ci() or os.environ.get(POSTGRES_ENV))
    env = request.getfixturevalue("pg_jobs_env" if postgres else "jobs_env")
    with fuzz.api_stack(tmp_path, env.env, tiny_model) as stack:
        run = fuzz.schemathesis(stack, who, seed=SEED, max_time=FUZZ_SECONDS)
    print(
        f"{run.who} on {env.database_url.split(':')[0]}: exit {run.returncode}, {run.cases} cases in {run.seconds:.0f} s"
    )
    assert run.returncode == 0 and run.cases > 0, run.output[-20000:]


def test_a_user_reaching_another_owners_object_is_a_finding(monkeypatch):
    """The hooks' own check fails a request that reached another owner's object (a 200, a 403 or a 409 on its path;
    a success with its dataset; an answer naming the other owner), and passes the 404."""
    foreign = {"file": "file_f", "train_file": "file_t", "live": "job_l", "finished": "job_f"}
    monkeypatch.setattr(fuzz_hooks, "FOREIGN", foreign)
    monkeypatch.setattr(fuzz_hooks, "FOREIGN_OWNER", "other")

    class Case:
        method, path, formatted_path = "GET", "/jobs/{job_id}", "/jobs/job_l"
        path_parameters: dict[str, Any] = {"job_id": "job_l"}
        body: Any = None

    class Response:
        def __init__(self, status: int, content: bytes = b"{}"):
            self.status_code, self.content = status, content

    check = fuzz_hooks.another_owners_objects_stay_hidden
    assert check(None, Response(404), Case()) is None
    for status in (200, 403, 409):
        with pytest.raises(AssertionError, match="another owner's object"):
            check(None, Response(status), Case())
    body_case = type("BodyCase", (Case,), {"method": "POST", "path": "/jobs", "path_parameters": {}})
    body_case.body = {"input": "file_f"}
    with pytest.raises(AssertionError, match="another owner's dataset"):
        check(None, Response(201), body_case())
    body_case.body = {"input": ["file_f"], "adapter": {"a": 1}}  # a negative case's values need not be strings
    assert check(None, Response(422), body_case()) is None
    with pytest.raises(AssertionError, match="names another owner"):
        check(None, Response(404, b'{"owner": "other"}'), Case())


# --- the document ------------------------------------------------------------------------------------------------


def test_the_job_spec_in_the_document_is_the_models_schema():
    """POST /jobs's body is GenerateSpec or FinetuneSpec, exactly as pydantic derives them from core/spec.py (one
    source): only `model` may be left out over HTTP (OpenAI batch lines name it), as the document says."""
    document = app.openapi()
    body = document["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["oneOf"] == [
        {"$ref": "#/components/schemas/GenerateSpec"},
        {"$ref": "#/components/schemas/FinetuneSpec"},
    ]
    components = document["components"]["schemas"]
    for model in (GenerateSpec, FinetuneSpec):
        derived = model.model_json_schema(ref_template="#/components/schemas/{model}")
        documented = json.loads(json.dumps(components[model.__name__]))
        if model is GenerateSpec:
            assert (
                "model" not in documented["required"]
                and "OpenAI batch lines" in documented["properties"]["model"]["description"]
            )
            documented["required"].insert(derived["required"].index("model"), "model")
            documented["properties"]["model"] = derived["properties"]["model"]
        derived.pop("$defs", None)
        assert documented == derived, model.__name__
    for name, schema in {
        **components["GenerateSpec"]["properties"],
        **components["FinetuneSpec"]["properties"],
    }.items():
        assert schema.get("description"), f"spec field {name} has no description in the document"


def test_the_documented_examples_are_valid_specs():
    """/docs shows a generation, OpenAI batch lines and a fine-tune: each is valid against the document, and the
    generation and the fine-tune parse as specs (the OpenAI lines' model comes from the file)."""
    document = app.openapi()
    content = document["paths"]["/jobs"]["post"]["requestBody"]["content"]["application/json"]
    validator = jsonschema_rs.validator_for({**content["schema"], "components": document["components"]})
    shown = content["examples"]
    assert set(shown) == {"generate", "openai", "finetune"} and shown == SPEC_EXAMPLES
    for name, example in shown.items():
        assert validator.is_valid(example["value"]), (name, list(validator.iter_errors(example["value"])))
    assert parse_spec(shown["generate"]["value"]).kind == "generate"
    assert parse_spec(shown["finetune"]["value"]).kind == "finetune"
    assert not validator.is_valid({}) and not validator.is_valid({"kind": "finetune", "input": "file_x"})


def test_every_route_documents_its_errors_with_the_error_body():
    """Each operation lists 401 and 403 (a token is needed) or, for /healthz, only 503 and 422; 404 where its path
    names an object; 422 everywhere (a query parameter the route does not take is refused); 400 where it takes a
    body; each with the error body."""
    for path, item in app.openapi()["paths"].items():
        for method, operation in item.items():
            responses = operation["responses"]
            errors = {int(s) for s in responses if int(s) >= 400}
            needed = {422, 503} | ({401, 403} if operation.get("security") else set())
            needed |= {404} if "{" in path else set()
            needed |= {400} if operation.get("requestBody") else set()
            assert needed <= errors, f"{method.upper()} {path} does not document {sorted(needed - errors)}"
            for status in errors:
                schema = responses[str(status)]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, status)


@pytest.mark.parametrize(
    ("request_", "status", "kind"),
    [
        (("POST", "/jobs", {"content": b"{not json"}), 400, "BadRequest"),
        (
            (
                "POST",
                "/files",
                {"content": b"--x\r\n-38--x--\r\n", "headers": {"Content-Type": "multipart/form-data; boundary=x"}},
            ),
            400,
            "BadRequest",
        ),
        (("GET", "/jobs", {"headers": {"Authorization": ""}}), 401, "Unauthorized"),
        (("GET", "/jobs/job_000000000000", {}), 404, "NotFound"),
        (("DELETE", "/jobs", {}), 405, "MethodNotAllowed"),
        (("GET", "/jobs", {"params": {"limit": 0}}), 422, "InvalidInput"),
        (("GET", "/usage", {"params": {"since": "last week"}}), 422, "InvalidInput"),
    ],
    ids=[
        "malformed JSON",
        "malformed multipart",
        "no token",
        "no such job",
        "no such method",
        "a bad query",
        "a bad since",
    ],
)
def test_every_error_answer_has_the_error_body(jobs_env, request_, status, kind):
    """Ours and Starlette's errors alike: {"error": {"type", "message"}}; a 401 names its scheme, a 405 lists every
    method of the path (GET and POST for /jobs)."""
    with session_scope() as session:
        token = auth.create_token(session, owner="fuzz", scopes=["user"])
    method, url, kwargs = request_
    headers = {"Authorization": f"Bearer {token}", **kwargs.pop("headers", {})}
    response = TestClient(app).request(method, url, headers=headers, **kwargs)
    assert response.status_code == status, response.text
    assert set(response.json()) <= {"error", "detail"} and set(response.json()["error"]) == {"type", "message"}
    assert response.json()["error"]["type"] == kind and response.json()["error"]["message"]
    if status == 401:
        assert response.headers["WWW-Authenticate"] == "Bearer"
    if status == 405:
        assert response.headers["Allow"] == "GET, POST"


@pytest.mark.parametrize(
    ("method", "url", "allow"),
    [
        ("DELETE", "/jobs", "GET, POST"),
        ("PUT", "/v1/batches", "GET, POST"),
        ("DELETE", "/v1/files", "GET, POST"),
        ("PUT", "/v1/files/file_000000000000", "DELETE, GET"),
        ("POST", "/metrics", "GET"),
        ("POST", "/dashboard", "GET"),
    ],
)
def test_a_405_allows_the_methods_the_path_has_also_under_included_routers(jobs_env, method, url, allow):
    """RFC 9110: a 405's Allow lists the path's methods, also for the routes of the included routers (/v1,
    /metrics, /dashboard), whose Allow was empty; under /v1 the body is OpenAI's (api/openai_api.py)."""
    with session_scope() as session:
        token = auth.create_token(session, owner="fuzz", scopes=["user"])
    response = TestClient(app).request(method, url, headers={"Authorization": f"Bearer {token}"})
    kind = "invalid_request_error" if url.startswith("/v1/") else "MethodNotAllowed"
    assert response.status_code == 405 and response.json()["error"]["type"] == kind, response.text
    assert response.headers["Allow"] == allow


# --- what the fuzzing found, pinned as plain cases ---------------------------------------------------------------


@pytest.fixture
def seeded(any_jobs_env, tiny_model) -> dict[str, Any]:
    """An admin token, a stored file, a live job (queued for a CPU worker that never comes) and a cancelled one."""
    with session_scope() as session:
        token = auth.create_token(session, owner="fuzz", scopes=["admin", "user"])
    data = b'{"prompt": "hello"}\n{"prompt": "world", "custom_id": "w"}\n'
    file_id = service.store_upload(owner="fuzz", filename="d.jsonl", stream=io.BytesIO(data))["id"]
    spec = {"model": str(tiny_model), "input": file_id, "gpus": 0, "max_new_tokens": 4}
    live, finished = (service.submit(owner="fuzz", spec_data=spec)["id"] for _ in range(2))
    service.cancel(finished, owner=None, by="fuzz")
    return {
        "token": token,
        "file_id": file_id,
        "spec": spec,
        "job_ids": {"live": live, "finished": finished},
        "postgres": any_jobs_env.database_url.startswith("postgresql"),
    }


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        ({}, 201, None),
        ({"batch_rows": 8.0}, 201, None),  # an integer to JSON Schema: once refused by the strict check
        ({"batch_rows": "8"}, 422, "batch_rows: Input should be a valid integer"),  # once accepted: not in the schema
        ({"ignore_eos": 0}, 422, "ignore_eos: Input should be a valid boolean"),
        ({"name": "a\x00b"}, 422, "spec.name holds a NUL character: remove it"),  # NUL is not generated: pinned
        ({"kind": "finetune", "max_new_tokens": None, "adapter": ""}, 422, "continuing an adapter is not supported"),
    ],
)
def test_a_spec_is_refused_exactly_when_the_document_refuses_it(seeded, change, status, message):
    """What the fuzzer found at the edges of the spec's schema: a whole float is an integer, a numeric string or a
    0 for false is not; NUL and a fine-tune's empty adapter are refused as the document says."""
    client = TestClient(app, headers={"Authorization": f"Bearer {seeded['token']}"})
    spec = {k: v for k, v in {**seeded["spec"], **change}.items() if v is not None}  # None: left out
    response = client.post("/jobs", json=spec)
    assert response.status_code == status, response.text
    if message:
        assert message in response.json()["error"]["message"]


def test_since_is_what_the_document_says():
    """GET /usage's `since`: the document's pattern and formats and the parser accept the same values (the fuzzer
    found `__main__` valid in the document and refused)."""
    schema = app.openapi()["paths"]["/usage"]["get"]["parameters"][1]["schema"]
    validator = jsonschema_rs.validator_for(schema, validate_formats=True)
    accepted = ["7d", "1.5h", "90s", "2w", "2026-01-31", "2026-01-31T12:00:00Z", "2026-01-31t12:00:00.5+02:00"]
    refused = ["__main__", "", " 7d", "7", "-7d", "7y", "2026-02-30", "2026-01-31T12:00", "2026-01-31 12:00:00Z"]
    for value in accepted:
        assert validator.is_valid(value) and views.usage_since(value) is not None, value
    for value in refused:
        assert not validator.is_valid(value), value
        with pytest.raises(InvalidInput):
            views.usage_since(value)


@pytest.mark.parametrize(
    ("url", "params", "message"),
    [
        # an event id beyond 64 bits overflowed SQLite's integer binding: 500
        ("/jobs/{job_id}/events", {"after": 2**64}, "query after: Input should be less than or equal to"),
        # an event id beyond 32 bits: valid in the document, out of range for Postgres's job_events.id: 422 there
        ("/jobs/{job_id}/events", {"after": 2**31}, "query after: Input should be less than or equal to 2147483647"),
        # a NUL character in an id or a query value: Postgres refuses it in a text column: 500 (SQLite: not found)
        ("/jobs/job_%00", {}, "NUL"),
        ("/files/file_%00", {}, "NUL"),
        ("/usage", {"owner": "a\x00"}, "NUL"),
        # an unknown state listed nothing at all instead of saying which states exist
        ("/jobs", {"state": "bogus"}, "query state: Input should be 'queued'"),
    ],
)
def test_inputs_that_made_the_api_answer_500_are_a_422_with_a_message(seeded, url, params, message):
    """Each once made the API answer 500 (on SQLite or Postgres); now each is a 422 whose message says why."""
    from fastapi.testclient import TestClient

    client = TestClient(app, headers={"Authorization": f"Bearer {seeded['token']}"})
    response = client.get(url.format(job_id=seeded["job_ids"]["live"]), params=params)
    if message == "NUL" and not seeded["postgres"]:
        assert response.status_code in (200, 404), response.text  # SQLite stores NUL: nothing to refuse
        return
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == "InvalidInput"
    assert message in response.json()["error"]["message"]


@pytest.mark.parametrize("field", ["model", "input"])
def test_a_home_directory_of_an_unknown_user_is_a_422(seeded, field):
    """`~no-such-user/…` as the model or the dataset path is refused with a message, not a server error."""
    from fastapi.testclient import TestClient

    client = TestClient(app, headers={"Authorization": f"Bearer {seeded['token']}"}, raise_server_exceptions=False)
    response = client.post("/jobs", json={**seeded["spec"], field: "~no-such-user-x/data"})
    assert response.status_code == 422, response.text
