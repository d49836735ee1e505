"""Access control: tokens stored as SHA-256 only, owner isolation on EVERY route of the OpenAPI schema, scopes.

The route tests do not list routes by hand: they walk `app.openapi()["paths"]`, fill path parameters with user A's
ids by name, build a minimal valid request for each operation, and probe it without a token, with user B's token,
with a metrics-only token and with an admin token. A route added later without protection fails them; a route
they cannot build a request for fails them too, with what to add here.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select, text

from api.app import Caller, app
from core import auth
from core.db import session_scope
from core.models import Adapter, Job, JobEvent, JobRow, Token
from core.settings import get_settings
from tests.conftest import ROOT

METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")  # an OpenAPI path item's operations
# the only operations that answer without a token (the dashboard's session takes a one-time code instead)
PUBLIC = {("GET", "/healthz"), ("POST", "/dashboard/session")}
# operations that show no owner's data (shared by everyone, or a code for the caller's own token)
GLOBAL = {("GET", "/workers"), ("GET", "/models"), ("POST", "/dashboard/codes")}
ADMIN_ONLY = {
    ("POST", "/models/pull"),
    ("POST", "/models/remove"),
    ("GET", "/quotas"),
    ("PUT", "/quotas"),
}  # operators' routes: a user gets 403
# A job reads only its submitter's files: an admin submitting over another owner's file id gets 404 like anyone.
ADMIN_REFUSED = {
    ("POST", "/jobs"): 404,
    # no live worker in this world: the request has no host to go to (409: the cluster's state, not the request)
    ("POST", "/models/pull"): 409,
    ("POST", "/models/remove"): 409,
}
MISSING = {"job_id": "job_000000000000", "file_id": "file_000000000000"}  # ids that exist for nobody
ALICE, BOB, ROOT_ADMIN = "alice", "bob", "root"
SECRETS = ("alice-secret-prompt-7f3a", "alice-secret-extra-55d0", "alice-secret-output-91c2", "alice-secret.jsonl")


class Unexercisable(AssertionError):
    """The test cannot build a request for a route: it must be taught, never skip the route."""


@dataclass
class World:
    """Users A (alice) and B (bob) with jobs and files, an admin, and tokens of every kind."""

    client: TestClient
    model: str
    tokens: dict[str, str]
    a_jobs: list[str]  # a live job (shards queued, no worker) and a cancelled one, each with a finished row
    a_file: str
    b_job: str
    b_file: str

    def headers(self, who: str | None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[who]}"} if who else {}

    def call(self, who: str | None, method: str, url: str, **kwargs: Any):
        return self.client.request(method, url, headers=self.headers(who), **kwargs)

    @property
    def a_markers(self) -> tuple[str, ...]:
        """Strings that only A's data holds: seeing one in B's answer is a leak."""
        return (*self.a_jobs, self.a_file, *SECRETS, f'"{ALICE}"', f"by {ALICE}")

    @property
    def b_markers(self) -> tuple[str, ...]:
        return (self.b_job, self.b_file, f'"{BOB}"')


def rows_file(*rows: Any) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


def submit(world: World, who: str, file_id: str) -> dict[str, Any]:
    response = world.call(
        who, "POST", "/jobs", json={"model": world.model, "input": file_id, "gpus": 0, "max_new_tokens": 4}
    )
    assert response.status_code == 201, response.text
    return response.json()


def upload(world: World, who: str, name: str, data: bytes) -> str:
    response = world.call(who, "POST", "/files", files={"file": (name, data)})
    assert response.status_code == 201, response.text
    return response.json()["id"]


@pytest.fixture
def world(jobs_env, tiny_model) -> World:
    with session_scope() as session:
        tokens = {
            ALICE: auth.create_token(session, owner=ALICE, scopes=["user"]),
            BOB: auth.create_token(session, owner=BOB, scopes=["user"]),
            ROOT_ADMIN: auth.create_token(session, owner=ROOT_ADMIN, scopes=["admin"]),
            "metrics": auth.create_token(session, owner="prometheus", scopes=["metrics"]),
        }
    w = World(TestClient(app), str(tiny_model), tokens, [], "", "", "")
    w.a_file = upload(
        w,
        ALICE,
        SECRETS[3],
        rows_file({"prompt": SECRETS[0], "note": SECRETS[1]}, {"prompt": "second"}, "{broken " + SECRETS[0]),
    )
    w.a_jobs = [submit(w, ALICE, w.a_file)["id"] for _ in range(2)]
    cancelled = w.call(ALICE, "POST", f"/jobs/{w.a_jobs[1]}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled", cancelled.text
    with session_scope() as session:  # one finished row per job, as a worker would have written it
        for job_id in w.a_jobs:
            row = session.get(JobRow, (job_id, 0))
            row.state, row.output, row.finish_reason, row.completion_tokens = "succeeded", SECRETS[2], "stop", 3
            # an adapter registered for the job, as a fine-tune's worker would have (its id is the job's id)
            session.add(
                Adapter(
                    id=job_id,
                    job_id=job_id,
                    owner=ALICE,
                    base_model=w.model,
                    tokenizer=w.model,
                    path=f"adapters/{job_id}",
                    bytes=1,
                    sha256="0" * 64,
                    lora_config={"r": 8},
                    load_options={},
                    metrics={"note": SECRETS[1]},
                    created_at=0.0,
                )
            )
    w.b_file = upload(w, BOB, "bob.jsonl", rows_file({"prompt": "bob's own prompt"}))
    w.b_job = submit(w, BOB, w.b_file)["id"]
    with session_scope() as session:
        session.add(
            Adapter(
                id=w.b_job,
                job_id=w.b_job,
                owner=BOB,
                base_model=w.model,
                tokenizer=w.model,
                path=f"adapters/{w.b_job}",
                bytes=1,
                sha256="0" * 64,
                lora_config={"r": 8},
                load_options={},
                metrics={},
                created_at=0.0,
            )
        )
    return w


# --- building a request for any operation of the schema --------------------------------------------------------


def operations(application: FastAPI = app) -> list[tuple[str, str, dict[str, Any]]]:
    paths = application.openapi()["paths"]
    return [(m.upper(), path, op) for path, item in paths.items() for m, op in item.items() if m in METHODS]


def bodies(world: World, ids: dict[str, str]) -> dict[tuple[str, str], tuple[dict[str, Any], set[str]]]:
    """A minimal valid body for each operation that takes one, and which of `ids` it uses. A new route with a
    body must be added here."""
    return {
        ("POST", "/files"): ({"files": {"file": ("probe.jsonl", rows_file({"prompt": "probe"}))}}, set()),
        ("POST", "/jobs"): (
            {"json": {"model": world.model, "input": ids["file_id"], "gpus": 0, "max_new_tokens": 4}},
            {"file_id"},
        ),
        ("POST", "/models/pull"): ({"json": {"repo": "acme/probe", "workers": "all"}}, set()),
        ("POST", "/models/remove"): ({"json": {"repo": "acme/probe", "workers": "all"}}, set()),
        ("PUT", "/quotas"): ({"json": {"owner": "probe-owner", "max_running_shards": 4}}, set()),
    }


@dataclass
class Request:
    method: str
    url: str
    kwargs: dict[str, Any]
    ids: dict[str, str]  # the ids it was built from
    used: set[str]  # the names of the ids it carries (in its path or body)

    def send(self, world: World, who: str | None):
        return world.call(who, self.method, self.url, **self.kwargs)


def build(world: World, method: str, path: str, op: dict[str, Any], ids: dict[str, str]) -> Request:
    """A minimal valid request for the operation, carrying `ids`. Raises Unexercisable saying what to add."""
    url, used, params = path, set(), {}
    for param in op.get("parameters", []):
        name, where = param["name"], param["in"]
        if where == "path":
            if name not in ids:
                raise Unexercisable(
                    f"{method} {path}: path parameter {name!r} is not one this test can fill with "
                    f"user A's ids ({', '.join(ids)}): teach tests/test_access.py about it"
                )
            url, used = url.replace("{" + name + "}", ids[name]), used | {name}
        elif where == "query" and name in ids:  # an id in the query string (`?job_id=`) is probed like one in the path
            params[name], used = ids[name], used | {name}
        elif param.get("required"):
            raise Unexercisable(
                f"{method} {path}: required {where} parameter {name!r}: add a value for it in tests/test_access.py"
            )
    kwargs: dict[str, Any] = {"params": params}
    if "requestBody" in op:
        if (method, path) not in bodies(world, ids):
            raise Unexercisable(
                f"{method} {path} takes a body: add a minimal valid one to bodies() in tests/test_access.py"
            )
        body, carried = bodies(world, ids)[(method, path)]
        kwargs, used = {**kwargs, **body}, used | carried
    return Request(method, url, kwargs, ids, used)


def a_ids(world: World) -> dict[str, str]:
    return {"job_id": world.a_jobs[0], "file_id": world.a_file}


def requests_for(world: World, method: str, path: str, op: dict[str, Any]) -> list[Request]:
    """The operation's request on A's ids: one per job of A's for a job route (a live one and a finished one)."""
    first = build(world, method, path, op, a_ids(world))
    if "job_id" not in first.used:
        return [first]
    return [build(world, method, path, op, {**a_ids(world), "job_id": job_id}) for job_id in world.a_jobs]


# --- the probes: each returns the problems it found -------------------------------------------------------------


def protected(application: FastAPI) -> list[tuple[str, str, dict[str, Any]]]:
    return [(m, p, op) for m, p, op in operations(application) if (m, p) not in PUBLIC]


def serving(world: World, application: FastAPI) -> World:
    return world if application is app else replace(world, client=TestClient(application))


def probe_without_token(world: World, application: FastAPI = app) -> list[str]:
    """Every operation but the public ones declares bearer security and answers 401 with a message, without a
    token, with an unknown token, and with another auth scheme."""
    world = serving(world, application)
    problems = []
    for method, path, op in protected(application):
        if not op.get("security"):
            problems.append(f"{method} {path}: the OpenAPI schema declares no security (take `Caller`)")
        request = build(world, method, path, op, a_ids(world))
        for headers in ({}, {"Authorization": "Bearer jt_not-a-token"}, {"Authorization": "Basic YWxpY2U6eA=="}):
            response = world.client.request(method, request.url, headers=headers, **request.kwargs)
            if response.status_code != 401:
                problems.append(
                    f"{method} {path} with {headers or 'no token'}: {response.status_code} {response.text[:200]}"
                )
            elif "token" not in response.json()["error"]["message"]:
                problems.append(f"{method} {path}: 401 without saying what is wrong with the token")
    return problems


def probe_other_user(world: World, application: FastAPI = app) -> list[str]:
    """User B: A's jobs and files answer 404 exactly like ids that do not exist (no existence oracle, none of A's
    data); operations that carry none of A's ids answer with B's own items only."""
    world = serving(world, application)
    problems = []
    for method, path, op in protected(application):
        for request in requests_for(world, method, path, op):
            response = request.send(world, BOB)
            echoed = {request.ids[name] for name in request.used}  # a 404 may name the id that was asked for
            leaked = [m for m in world.a_markers if m in response.text and m not in echoed]
            if leaked:
                problems.append(f"{method} {request.url} as B shows A's data {leaked}: {response.text[:300]}")
            if request.used:
                twin = build(world, method, path, op, MISSING).send(world, BOB)
                expected = response.text
                for name in request.used:
                    expected = expected.replace(request.ids[name], MISSING[name])
                if response.status_code != 404 or (twin.status_code, twin.text) != (404, expected):
                    problems.append(
                        f"{method} {request.url} as B: {response.status_code} {response.text[:200]} "
                        f"(for ids that do not exist: {twin.status_code} {twin.text[:200]})"
                    )
            elif (method, path) in ADMIN_ONLY:
                if response.status_code != 403 or "only an admin token" not in response.text:
                    problems.append(f"{method} {path} as B (a user): {response.status_code} {response.text[:200]}")
            elif not response.is_success:
                problems.append(f"{method} {path} as B: {response.status_code} {response.text[:200]}")
            else:
                problems += _only_own(world, method, path, response)
    return problems


def _only_own(world: World, method: str, path: str, response) -> list[str]:
    """A route without ids shows B's own items only (or no owner's items at all, for the shared routes in GLOBAL)."""
    owners = _owners(response.json())
    if owners - {BOB}:
        return [f"{method} {path} as B lists items of {sorted(owners - {BOB})}"]
    if (method, path) in GLOBAL:
        return [f"{method} {path} is listed as GLOBAL but shows owners {sorted(owners)}"] if owners else []
    if not any(m in response.text for m in world.b_markers):
        return [
            f"{method} {path} as B shows none of B's own items: if it shows no owner's data at all, add it to "
            f"GLOBAL in tests/test_access.py ({response.text[:200]})"
        ]
    return []


def _owners(data: Any) -> set[str]:
    if isinstance(data, dict):
        found = {data["owner"]} if isinstance(data.get("owner"), str) else set()
        return found.union(*(_owners(v) for v in data.values()))
    if isinstance(data, list):
        return set().union(*(_owners(v) for v in data))
    return set()


def probe_admin(world: World, application: FastAPI = app) -> list[str]:
    """An admin's same requests succeed and show A's data: reads on each of A's jobs, changes on one whose state
    allows them (cancel the live job, retry the cancelled one)."""
    world = serving(world, application)
    problems = []
    for method, path, op in protected(application):
        answers = [(r.url, r.send(world, ROOT_ADMIN)) for r in requests_for(world, method, path, op)]
        expected = ADMIN_REFUSED.get((method, path))
        if expected:
            problems += [
                f"{method} {url} as admin: {r.status_code}, expected {expected}"
                for url, r in answers
                if r.status_code != expected
            ]
            continue
        ok = [r for _, r in answers if r.is_success]
        if not ok or (method == "GET" and len(ok) < len(answers)):
            problems += [
                f"{method} {url} as admin: {r.status_code} {r.text[:200]}" for url, r in answers if not r.is_success
            ]
            continue
        shows_a = any(m in r.text for r in ok for m in world.a_markers)
        reads_owned = method == "GET" and (method, path) not in GLOBAL
        if (reads_owned or "{" in path) and not shows_a:
            problems.append(f"{method} {path} as admin succeeded but shows none of A's data: {ok[0].text[:200]}")
    return problems


def probe_metrics_token(world: World, application: FastAPI = app) -> list[str]:
    """A metrics-only token may not submit, read or change jobs and files: 403 with a message on every route."""
    world = serving(world, application)
    problems = []
    for method, path, op in protected(application):
        response = build(world, method, path, op, a_ids(world)).send(world, "metrics")
        if response.status_code != 403 or "user or admin scope" not in response.text:
            problems.append(f"{method} {path} with a metrics token: {response.status_code} {response.text[:200]}")
    return problems


def snapshot(job_ids: list[str]) -> list[tuple]:
    with session_scope() as session:
        jobs = session.scalars(select(Job).where(Job.id.in_(job_ids)).order_by(Job.id)).all()
        events = session.scalar(select(func.count()).select_from(JobEvent).where(JobEvent.job_id.in_(job_ids)))
        return [(j.id, j.state, j.retries, j.rows_total) for j in jobs] + [("events", events)]


# --- the tests ----------------------------------------------------------------------------------------------


def test_every_route_but_healthz_answers_401_without_a_valid_token(world):
    """No token, an unknown token, or a non-Bearer scheme: 401 with a message on every route of the schema."""
    assert operations(), "the OpenAPI schema lists no routes"
    assert probe_without_token(world) == []
    assert world.client.get("/healthz").status_code == 200


def test_user_b_gets_404_for_every_route_on_user_a_jobs_and_files_and_lists_only_own(world):
    """With B's token, every operation that takes one of A's ids answers 404 exactly like a missing id (no
    existence oracle, none of A's data), A's jobs are left unchanged, and the list routes show only B's items."""
    before = snapshot(world.a_jobs)
    assert probe_other_user(world) == []
    assert snapshot(world.a_jobs) == before
    listed = world.call(BOB, "GET", "/jobs").json()
    assert [j["id"] for j in listed] == [world.b_job]


def test_an_admin_sees_and_changes_every_owners_jobs_and_files(world):
    """The same requests with an admin token succeed on A's jobs and files and show A's data."""
    assert probe_admin(world) == []
    listed = {j["id"] for j in world.call(ROOT_ADMIN, "GET", "/jobs").json()}
    assert listed >= {*world.a_jobs, world.b_job}
    assert world.call(ROOT_ADMIN, "GET", f"/files/{world.a_file}").json()["owner"] == ALICE


def test_a_metrics_only_token_cannot_submit_or_read_jobs(world):
    """A token with only the metrics scope gets 403 saying it needs the user or admin scope, on every route."""
    assert probe_metrics_token(world) == []


def test_a_route_added_later_without_protection_fails_these_probes(world):
    """The probes are not tied to today's routes: a new route that skips `Caller`, one that checks the token but
    forgets the owner filter (here with the id in its query string), and one they cannot build a request for are
    each reported."""
    leaky = FastAPI()
    leaky.router.routes.extend(app.router.routes)
    leaky.exception_handlers.update(app.exception_handlers)

    @leaky.get("/jobs/{job_id}/peek")
    def peek(job_id: str) -> dict[str, Any]:  # no token needed at all
        with session_scope() as session:
            job = session.get(Job, job_id)
            return {"owner": job.owner if job else None, "id": job_id}

    @leaky.get("/export")
    def export(caller: Caller, job_id: str) -> dict[str, Any]:  # a token, but any owner's job
        with session_scope() as session:
            job = session.get(Job, job_id)
            return {"owner": job.owner if job else None, "name": job_id}

    @leaky.get("/jobs/{job_id}/adapters/{adapter_id}")
    def adapter(caller: Caller, job_id: str, adapter_id: str) -> dict[str, Any]:
        return {}

    with pytest.raises(Unexercisable, match="adapter_id"):
        probe_without_token(world, leaky)
    leaky.router.routes.pop()
    leaky.openapi_schema = None
    assert [p for p in probe_without_token(world, leaky) if "/export" in p] == []
    assert any("/peek" in p for p in probe_without_token(world, leaky))
    assert {path for path in ("/peek", "/export") if any(path in p for p in probe_other_user(world, leaky))} == {
        "/peek",
        "/export",
    }
    assert any("/peek" in p for p in probe_metrics_token(world, leaky))


def test_tokens_are_stored_as_sha256_only_and_a_revoked_token_gets_401(jobs_env):
    """`gpujobs tokens create` prints a secret that appears nowhere in the tokens table (only its SHA-256 does),
    `tokens list` never shows it (a header row, then a row per token; `--json` no header), and after `tokens revoke`
    the token gets 401 with a message saying so."""

    def gpujobs(*args: str) -> str:
        result = subprocess.run(
            [sys.executable, "-m", "api", *args], env=jobs_env.env, cwd=ROOT, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert gpujobs("tokens", "list") == ""  # none yet: stderr says so, no header alone
    secret = gpujobs("tokens", "create", "--owner", "carol", "--scope", "user", "--name", "laptop").strip()
    assert secret.startswith("jt_") and len(secret) > 40
    with session_scope() as session:
        stored = [dict(r) for r in session.execute(text("SELECT * FROM tokens")).mappings()]
    assert len(stored) == 1 and stored[0]["sha256"] == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in json.dumps(stored, default=str) and secret not in gpujobs("tokens", "list", "--json")
    database = Path(get_settings().database_url.removeprefix("sqlite:///"))
    for path in database.parent.glob(database.name + "*"):  # the database, its WAL and shared memory files
        assert secret.encode() not in path.read_bytes()

    client = TestClient(app, headers={"Authorization": f"Bearer {secret}"})
    assert client.get("/jobs").status_code == 200
    token_id = json.loads(gpujobs("tokens", "list", "--json"))[0]["id"]
    assert gpujobs("tokens", "list").splitlines()[1].split()[:4] == [token_id, "carol", "user", "active"]
    gpujobs("tokens", "revoke", token_id)
    refused = client.get("/jobs")
    assert refused.status_code == 401
    assert "revoked" in refused.json()["error"]["message"]
    assert json.loads(gpujobs("tokens", "list", "--json")) == [  # no header: JSON as before
        {"id": token_id, "owner": "carol", "scopes": "user", "name": "laptop", "revoked": True}
    ]
    header, row = gpujobs("tokens", "list").splitlines()
    assert header.split() == ["token", "owner", "scopes", "state", "name"]
    assert row.split() == [token_id, "carol", "user", "revoked", "laptop"] and row.index("revoked") == header.index(
        "state"
    )


def test_token_owner_and_scopes_are_checked_when_created(jobs_env):
    """An empty or spaced owner and an unknown scope are refused with their reason; nothing is stored."""
    from core.errors import InvalidInput

    with session_scope() as session:
        for owner, scopes, reason in [
            ("", ["user"], "owner"),
            ("a b", ["user"], "owner"),
            ("ok", ["root"], "unknown scope"),
            ("ok", [], "unknown scope"),
        ]:
            with pytest.raises(InvalidInput, match=reason):
                auth.create_token(session, owner=owner, scopes=scopes)
        assert session.scalar(select(func.count()).select_from(Token)) == 0


def test_a_user_cannot_import_another_owners_stored_file_by_server_path(world, tmp_path):
    """A user's server-side `input` path is refused (403) unless JOBS_DATA_ROOTS is set, and never reaches into
    the store (where A's files, the database and the local admin token live); an admin may still use one."""
    stored = get_settings().artifacts / "files" / world.a_file
    assert stored.is_file()
    own = tmp_path / "mine.jsonl"
    own.write_bytes(rows_file({"prompt": "bob's server file"}))
    for path in (str(stored), str(own)):
        refused = world.call(BOB, "POST", "/jobs", json={"model": world.model, "input": path, "gpus": 0})
        assert refused.status_code == 403, refused.text
        assert "JOBS_DATA_ROOTS" in refused.json()["error"]["message"]
    admin = world.call(ROOT_ADMIN, "POST", "/jobs", json={"model": world.model, "input": str(own), "gpus": 0})
    assert admin.status_code == 201, admin.text


def test_with_data_roots_a_user_still_cannot_read_the_store_by_path(world, tmp_path, monkeypatch):
    """With JOBS_DATA_ROOTS covering the store, a user's path into it is still refused; one outside it works."""
    monkeypatch.setenv("JOBS_DATA_ROOTS", str(tmp_path))
    get_settings.cache_clear()
    stored = get_settings().artifacts / "files" / world.a_file
    refused = world.call(BOB, "POST", "/jobs", json={"model": world.model, "input": str(stored), "gpus": 0})
    assert refused.status_code == 403 and "inside the jobs store" in refused.text, refused.text
    own = tmp_path / "data" / "mine.jsonl"
    own.parent.mkdir()
    own.write_bytes(rows_file({"prompt": "bob's server file"}))
    accepted = world.call(BOB, "POST", "/jobs", json={"model": world.model, "input": str(own), "gpus": 0})
    assert accepted.status_code == 201 and accepted.json()["owner"] == BOB, accepted.text
    for odd in ("~no-such-user-x/d.jsonl", "a\x00b", 42, ["a"], ""):  # refused with a message, never a 500
        response = world.call(BOB, "POST", "/jobs", json={"model": world.model, "input": odd, "gpus": 0})
        assert 400 <= response.status_code < 500, (odd, response.text)


def test_beyond_loopback_without_roots_a_server_path_is_refused_with_the_setting_to_set(world, tmp_path, monkeypatch):
    """An API listening beyond loopback (JOBS_API_HOST=0.0.0.0) with no roots refuses server-side model and dataset
    paths; the refusal names the setting the operator must set for each and what a user can do meanwhile (it said
    only that 'no roots are set')."""
    monkeypatch.setenv("JOBS_API_HOST", "0.0.0.0")
    get_settings.cache_clear()
    data = tmp_path / "mine.jsonl"
    data.write_bytes(rows_file({"prompt": "a server-side dataset"}))
    spec = {"model": world.model, "input": str(data), "gpus": 0}
    model = world.call(ROOT_ADMIN, "POST", "/jobs", json=spec)
    assert model.status_code == 403, model.text
    message = model.json()["error"]["message"]
    assert "JOBS_MODEL_ROOTS is not set" in message and "JOBS_API_HOST=0.0.0.0" in message, message
    assert "docs/cluster.md" in message and "Hub model id" in message, message

    monkeypatch.setenv("JOBS_MODEL_ROOTS", str(Path(world.model).parent))
    get_settings.cache_clear()
    dataset = world.call(ROOT_ADMIN, "POST", "/jobs", json=spec)
    assert dataset.status_code == 403, dataset.text
    message = dataset.json()["error"]["message"]
    assert "JOBS_DATA_ROOTS is not set" in message and "upload the dataset" in message, message
