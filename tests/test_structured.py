"""Structured outputs and logprobs at the edges (core/structured.py, core/openai_batch.py, api/results.py): a constraint
the grammar engine cannot compile is refused at submit with llguidance's reason and nothing is written (a row's fails
that row, with its line); OpenAI batch lines' response_format, logprobs and top_logprobs become the row's parameters;
the CLI's --json-schema, --choice, --regex and --logprobs; and, past a real worker, results carry the
log-probabilities in OpenAI's shapes and as a JSONL key and a Parquet column.
"""

from __future__ import annotations

import base64
import json
from array import array
from types import SimpleNamespace

import jsonschema_rs
import pyarrow.parquet as pq
import pytest

from core import logprob_store, openai_batch
from tests.conftest import qa_pairs
from tests.test_bad_input import api, lines, model, refused, row_errors, rows_of  # noqa: F401
from tests.test_e2e import jobs, write_rows

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
NOT_KEYWORD = {"type": "json_schema", "json_schema": {"name": "a", "schema": {"not": {"type": "string"}}}}
INVALID = "invalid generate spec: "

SUBMIT_CASES = [
    (
        "unimplemented keyword",
        {"response_format": NOT_KEYWORD},
        INVALID + "response_format json_schema cannot be compiled by the grammar engine (llguidance): Unimplemented "
        'keys: ["not"]',
    ),
    (
        "look-around regex",
        {"guided_regex": "(?<=a)b"},
        INVALID
        + 'guided_regex cannot be compiled by the grammar engine (llguidance): invalid regex "(?<=a)b": look-around, '
        "including look-ahead and look-behind, is not supported",
    ),
    (
        "an unclosed class",
        {"guided_regex": "([a-z"},
        INVALID + 'guided_regex cannot be compiled by the grammar engine (llguidance): invalid regex "([a-z": unclosed '
        "character class",
    ),
    (
        "two constraints",
        {"guided_regex": "a+", "guided_choice": ["a"]},
        INVALID + "give one constraint, not guided_choice and guided_regex",
    ),
    (
        "stop with a constraint",
        {"guided_choice": ["a", "b"], "stop": ["x"]},
        INVALID + "stop strings cut a constrained output where its grammar does not end: leave stop out with "
        "guided_choice",
    ),
    (
        "ignore_eos with a constraint",
        {"response_format": JSON_SCHEMA, "ignore_eos": True},
        INVALID
        + "ignore_eos cannot be combined with response_format json_schema: the grammar ends the output with EOS",
    ),
    ("top_logprobs alone", {"top_logprobs": 3}, INVALID + "top_logprobs needs logprobs true"),
    (
        "too many top_logprobs",
        {"logprobs": True, "top_logprobs": 21},
        INVALID + "top_logprobs: Input should be less than or equal to 20",
    ),
    (
        "a response_format written as its type alone",
        {"response_format": "json_object"},
        INVALID + "response_format: 'json_object' is not an object: use "
        '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, {"type": "json_object"} or '
        '{"type": "text"}',
    ),
    (
        "guided_choice written as one string",
        {"guided_choice": "yes"},
        INVALID + "guided_choice: guided_choice must be a non-empty list of non-empty strings",
    ),
    (
        "a response_format of another shape",
        {"response_format": {"type": "json_schema", "schema": SCHEMA}},
        INVALID + "response_format: unknown key(s) 'schema' for type json_schema",
    ),
    (
        "continuous engine",
        {"engine": "continuous", "guided_choice": ["a", "b"]},
        INVALID + "a constrained output (response_format, guided_choice, guided_regex) is not supported by the "
        "continuous engine (transformers' continuous batching takes no logits processor of ours): use engine auto, "
        "fast, padded or static",
    ),
]


@pytest.mark.parametrize(("fields", "message"), [c[1:] for c in SUBMIT_CASES], ids=[c[0] for c in SUBMIT_CASES])
def test_a_constraint_that_cannot_run_is_refused_at_submit(api, model, fields, message):  # noqa: F811
    """The grammar engine's own reason (checked in the API, without torch), or the conflict; nothing written."""
    spec = {"model": str(model), "input": api.upload(lines({"prompt": "hi"})), "gpus": 0, **fields}
    refused(api, spec, 422, message)


def test_a_rows_constraint_that_cannot_run_fails_that_row(api, model):  # noqa: F811
    """Per-row constraints are checked like the job's: a bad one fails its row with its line; a row's constraint
    replaces the job's (a row's guided_choice beside the job's response_format is not two constraints); the
    other rows wait for a worker."""
    data = lines(
        {"prompt": "a", "guided_choice": ["yes", "no"]},
        {"prompt": "b", "response_format": NOT_KEYWORD},
        {"prompt": "c", "guided_regex": "[0-9]+", "stop": ["x"]},
        {"prompt": "d", "response_format": {"type": "text"}, "logprobs": True, "top_logprobs": 2},
        {"prompt": "e"},
    )
    spec = {"model": str(model), "input": api.upload(data), "gpus": 0, "response_format": JSON_SCHEMA}
    response = api.submit(spec)
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    assert row_errors(api, job_id) == [
        (
            2,
            "line-2",
            "line 2: response_format json_schema cannot be compiled by the grammar engine (llguidance): "
            'Unimplemented keys: ["not"]',
        ),
        (
            3,
            "line-3",
            "line 3: stop strings cut a constrained output where its grammar does not end: leave stop out with "
            "guided_regex",
        ),
    ]
    stored = {r.idx: r.input["params"] for r in rows_of(job_id) if r.error is None}
    assert stored == {
        0: {"guided_choice": ["yes", "no"]},
        3: {"response_format": {"type": "text"}, "logprobs": True, "top_logprobs": 2},
        4: {},
    }


def openai_line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def test_openai_lines_carry_response_format_and_logprobs(api, model):  # noqa: F811
    """Chat lines: response_format, logprobs and top_logprobs; completions lines: logprobs N (their top-N); vLLM's
    guided_choice, guided_regex and guided_json; a chat line's logprobs that is not a boolean fails its line."""
    chat, completions = "/v1/chat/completions", "/v1/completions"
    messages = [{"role": "user", "content": "hi"}]
    data = lines(
        openai_line("a", chat, messages=messages, response_format=JSON_SCHEMA, logprobs=True, top_logprobs=2),
        openai_line("b", completions, prompt="hi", logprobs=3),
        openai_line("c", chat, messages=messages, response_format={"type": "json_object"}),
        openai_line("d", chat, messages=messages, guided_choice=["x", "y"], logprobs=False),
        openai_line("e", completions, prompt="hi", guided_json=SCHEMA),
        openai_line("f", chat, messages=messages, logprobs=2),
    )
    response = api.submit({"model": str(model), "input": api.upload(data, "batch.jsonl"), "gpus": 0})
    assert response.status_code == 201, response.text
    job_id = response.json()["id"]
    stored = {r.custom_id: r.input["params"] for r in rows_of(job_id) if r.error is None}
    assert stored == {
        "a": {"response_format": JSON_SCHEMA, "logprobs": True, "top_logprobs": 2},
        "b": {"logprobs": True, "top_logprobs": 3},
        "c": {"response_format": {"type": "json_object"}},
        "d": {"guided_choice": ["x", "y"], "logprobs": False},
        "e": {"response_format": {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": SCHEMA}}},
    }
    assert row_errors(api, job_id) == [
        (6, "f", "line 6: body.logprobs on /v1/chat/completions is true or false (top_logprobs says how many)")
    ]


ENTRY = {
    "token": "Par",
    "logprob": -0.5,
    "bytes": [80, 97, 114],
    "top_logprobs": [{"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114]}],
}


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_openai_output_lines_carry_logprobs_in_openais_shapes(chat):
    """chat: choices[].logprobs = {content: [...], refusal: null}; completions: tokens, token_logprobs,
    top_logprobs ({token: logprob} per step), text_offset; a row without logprobs has null."""
    second = {**ENTRY, "token": "is", "bytes": [105, 115], "logprob": -1.0, "top_logprobs": []}
    row = SimpleNamespace(
        input={"messages" if chat else "prompt": "q"},
        output="Paris",
        finish_reason="stop",
        logprobs=[ENTRY, second],
        prompt_tokens=3,
        completion_tokens=2,
        finished_at=1.0,
        idx=0,
        custom_id="a",
    )
    choice = openai_batch.openai_output_record(row, job_id="job_x", model="m")["response"]["body"]["choices"][0]
    if chat:
        assert choice["logprobs"] == {"content": [ENTRY, second], "refusal": None}
    else:
        assert choice["logprobs"] == {
            "tokens": ["Par", "is"],
            "token_logprobs": [-0.5, -1.0],
            "top_logprobs": [{"Par": -0.5}, {}],
            "text_offset": [0, 3],
        }
    row.logprobs = None
    assert (
        openai_batch.openai_output_record(row, job_id="job_x", model="m")["response"]["body"]["choices"][0]["logprobs"]
        is None
    )


def _compact(entries: list[dict], k: int) -> dict:
    """What a worker stores for `entries` (core/logprob_store.py's format 1), written here from its docstring."""

    def b64(code: str, values: list) -> str:
        return base64.b64encode(array(code, values).tobytes()).decode()

    names = {}
    for e in entries:
        for t in [e, *e["top_logprobs"]]:
            names[t["id"]] = (t["token"], bytes(t["bytes"]).hex())
    vocab = sorted(names)
    return {
        "format": 1,
        "n": len(entries),
        "k": k,
        "ids": b64("i", [e["id"] for e in entries]),
        "logprob": b64("f", [e["logprob"] for e in entries]),
        "top_ids": b64("i", [t["id"] for e in entries for t in e["top_logprobs"]]),
        "top_logprob": b64("f", [t["logprob"] for e in entries for t in e["top_logprobs"]]),
        "vocab": b64("i", vocab),
        "text": [names[t][0] for t in vocab],
        "bytes": [names[t][1] for t in vocab],
    }


def test_stored_compact_logprobs_are_read_in_openais_shape():
    """A row stores each output's logprobs compact (arrays, each token's text once) and every reader gets OpenAI's
    entries: -inf (a token the model gave no probability) reads -9999.0, a piece of a character keeps its exact
    bytes; several outputs are a list of them; rows stored in OpenAI's shape (before the compact format) read as
    they are; an unknown format is an error, not a silent guess."""
    par = {"id": 7, "token": "Par", "logprob": -0.5, "bytes": [80, 97, 114]}
    half = {"id": 300, "token": "\ufffd", "logprob": float("-inf"), "bytes": [0xE4]}
    entries = [
        {**par, "top_logprobs": [par, {**half, "logprob": -2.0}]},
        {**half, "top_logprobs": [par, half]},
    ]
    want = [
        {"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114], "top_logprobs": [
            {"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114]},
            {"token": "\ufffd", "logprob": -2.0, "bytes": [0xE4]},
        ]},
        {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xE4], "top_logprobs": [
            {"token": "Par", "logprob": -0.5, "bytes": [80, 97, 114]},
            {"token": "\ufffd", "logprob": -9999.0, "bytes": [0xE4]},
        ]},
    ]  # fmt: skip
    stored = _compact(entries, k=2)
    assert logprob_store.render(stored) == logprob_store.render_row(stored) == want
    assert logprob_store.render_row([stored, _compact(entries[:1], k=2)]) == [want, want[:1]]
    assert logprob_store.render_row(want) == want and logprob_store.render_row([want, want]) == [want, want]
    assert logprob_store.render_row(None) is None and logprob_store.render(_compact([], k=0)) == []
    with pytest.raises(ValueError, match="unknown format 2"):
        logprob_store.render({**stored, "format": 2})
    row = SimpleNamespace(
        input={"messages": "q"}, output="Par", finish_reason="stop", logprobs=stored, prompt_tokens=3,
        completion_tokens=2, finished_at=1.0, idx=0, custom_id="a",
    )  # fmt: skip
    choice = openai_batch.openai_output_record(row, job_id="job_x", model="m")["response"]["body"]["choices"][0]
    assert choice["logprobs"] == {"content": want, "refusal": None}


def test_the_cli_takes_a_schema_file_choices_a_regex_and_logprobs(tmp_path, jobs_env, api_server, tiny_model):
    """--json-schema FILE becomes response_format json_schema (named after the file, strict); --choice repeats;
    --regex; --logprobs --top-logprobs. A schema the engine cannot compile exits 2 with its reason and creates no
    job; a file that is not JSON too."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    data = write_rows(tmp_path / "rows.jsonl", [{"prompt": "hi"}])
    base = ["submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", "--json"]
    schema = tmp_path / "person.schema.json"
    schema.write_text(json.dumps(SCHEMA))
    spec = json.loads(jobs(env, *base, "--json-schema", str(schema), "--logprobs", check=True).stdout)["spec"]
    assert spec["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
    }
    assert spec["logprobs"] is True
    spec = json.loads(
        jobs(env, *base, "--choice", "yes", "--choice", "no", "--logprobs", "--top-logprobs", "2", check=True).stdout
    )["spec"]
    assert (spec["guided_choice"], spec["logprobs"], spec["top_logprobs"]) == (["yes", "no"], True, 2)
    assert json.loads(jobs(env, *base, "--regex", "[0-9]+", check=True).stdout)["spec"]["guided_regex"] == "[0-9]+"
    listed = jobs(env, "list", "--json", check=True).stdout
    schema.write_text(json.dumps({"not": {"type": "string"}}))
    bad = jobs(env, *base, "--json-schema", str(schema))
    assert bad.returncode == 2
    assert (
        'response_format json_schema cannot be compiled by the grammar engine (llguidance): Unimplemented keys: ["not"]'
        in bad.stderr
    )
    schema.write_text("{not json")
    bad = jobs(env, *base, "--json-schema", str(schema))
    assert bad.returncode == 2 and f"--json-schema {schema}: not a readable JSON file" in bad.stderr
    assert jobs(env, "list", "--json", check=True).stdout == listed  # no job created by the refusals


def test_results_carry_logprobs_in_every_format(tmp_path, jobs_env, api_server, spawn_worker, tiny_model):
    """Past a real worker: an OpenAI batch whose chat lines ask for a JSON schema and logprobs, and a completions
    line for logprobs 2. The outputs validate; `results --format openai` has OpenAI's logprob shapes, JSONL a
    `logprobs` key (one entry per completion token), Parquet a `logprobs` column."""
    url, token, _ = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    spawn_worker([])
    question = qa_pairs()[0][0]
    chat = [
        openai_line(
            f"c{i}",
            "/v1/chat/completions",
            messages=[{"role": "user", "content": question}],
            response_format=JSON_SCHEMA,
            logprobs=True,
            top_logprobs=2,
            max_tokens=40,
            **({"temperature": 1.2, "seed": i} if i else {}),
        )
        for i in range(3)
    ]
    completion = openai_line("p", "/v1/completions", prompt=question, logprobs=2, max_tokens=6)
    data = write_rows(tmp_path / "batch.jsonl", [*chat, completion])
    job_id = jobs(env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True)
    job = json.loads(jobs(env, "wait", job_id.stdout.strip(), "--json", check=True).stdout)
    assert job["rows"]["succeeded"] == 4, job
    out = {
        r["custom_id"]: r["response"]["body"]
        for r in map(json.loads, jobs(env, "results", job["id"], "--format", "openai", check=True).stdout.splitlines())
    }
    for i in range(3):
        choice = out[f"c{i}"]["choices"][0]
        if choice["finish_reason"] == "stop":
            assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(choice["message"]["content"]))
        content = choice["logprobs"]["content"]
        assert len(content) == out[f"c{i}"]["usage"]["completion_tokens"]
        assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in content)
    completions = out["p"]["choices"][0]["logprobs"]
    assert len(completions["tokens"]) == len(completions["token_logprobs"]) == out["p"]["usage"]["completion_tokens"]
    assert all(len(top) == 2 for top in completions["top_logprobs"])
    records = [json.loads(x) for x in jobs(env, "results", job["id"], check=True).stdout.splitlines()]
    assert [len(r["logprobs"]) for r in records] == [r["completion_tokens"] for r in records]
    parquet = tmp_path / "r.parquet"
    jobs(env, "results", job["id"], "--format", "parquet", "-o", str(parquet), check=True)
    table = pq.read_table(parquet).to_pylist()
    assert [json.loads(r["logprobs"]) for r in table] == [r["logprobs"] for r in records]
