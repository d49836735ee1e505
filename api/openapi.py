"""What the OpenAPI document (`/openapi.json`, `/docs`) says beyond what FastAPI derives from the routes: the error
responses, the job spec as `POST /jobs`'s body, and its examples. A client generated from the document, and the
fuzzer that checks it (tests/test_fuzz.py), see the API as it is.

- **Errors.** Every route lists the statuses it answers besides success, each with the one error body
  (`ErrorBody`): `{"error": {"type", "message"}}` (`type` names the error: NotFound, InvalidInput, …, the class in
  core/errors.py that the client rebuilds; `message` says what was wrong and what to do). A route declares its
  statuses with `responses=errors(...)`, from the one table `ERRORS` here; api/app.py turns every error (ours,
  Starlette's 400/404/405, request validation) into that body.
- **The job spec.** The body is `GenerateSpec` or `FinetuneSpec` (core/spec.py), told apart by `kind` (left out:
  generate), as the JSON Schema pydantic derives from the very models `parse_spec` validates with: one source, no
  schema kept by hand. One difference, stated in the document: over HTTP a generation spec may leave out `model`
  when its input is OpenAI batch lines that name `body.model` (api/checks.py `_model_from_input`).
- **What a schema cannot say** (whether a model directory or file exists, whether a live worker can run the job,
  rules between fields such as `validation_input` or `validation_split`) is answered by 404, 409 or 422 with a
  message; the document lists those statuses.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, Field
from pydantic.json_schema import models_json_schema

from core.spec import FinetuneSpec, GenerateSpec


class ErrorDetail(BaseModel):
    type: str = Field(
        description="what kind of error: InvalidInput, NotFound, Forbidden, Unauthorized, Conflict, Unschedulable, "
        "TooLarge, BadRequest, ServiceUnavailable, … (the class in core/errors.py)",
        examples=["NotFound"],
    )
    message: str = Field(
        description="one line: what was wrong, and what to do", examples=["job job_0123456789ab not found"]
    )


class ErrorBody(BaseModel):
    """The body of every error answer."""

    error: ErrorDetail
    detail: list[dict[str, Any]] | None = Field(
        None, description="a request that FastAPI refused while reading it (422): its list of problems, each located"
    )


# Each status a route may answer besides success, and what it means, the same on every route.
ERRORS: dict[int, str] = {
    400: "Malformed request: the body is not JSON, or not a readable multipart form",
    401: "No bearer token, or one that is unknown, revoked or expired",
    403: "The token may not do this: it lacks the user or admin scope (or the admin scope for operators' routes, "
    "the priority scope for high priority), or a path outside the server's data roots",
    404: "No such object for this token: it does not exist, or another owner's (the same answer for both)",
    409: "The object's state does not allow it (a finished job cancelled, a live job retried), or no live worker can "
    "run the job now",
    413: "The upload is larger than the server's limit (JOBS_MAX_UPLOAD_BYTES)",
    422: "Well formed, but invalid: the message names each field and what it takes (a query parameter the route "
    "does not take is refused, not ignored)",
    503: "The database or Redis does not answer: retry later",
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: the given statuses, each with its meaning and the error body."""
    return {status: {"model": ErrorBody, "description": ERRORS[status]} for status in sorted(statuses)}


# --- POST /jobs -----------------------------------------------------------------------------------------------

_refs, _defs = models_json_schema(
    [(GenerateSpec, "validation"), (FinetuneSpec, "validation")], ref_template="#/components/schemas/{model}"
)
SPEC_SCHEMAS: dict[str, Any] = _defs["$defs"]  # GenerateSpec, FinetuneSpec and the models they use
SPEC_SCHEMAS["GenerateSpec"]["required"].remove("model")
SPEC_SCHEMAS["GenerateSpec"]["properties"]["model"]["description"] += (
    "; may be left out when `input` is OpenAI batch lines that all name the same `body.model`"
)
JOB_SPEC = {
    "oneOf": [_refs[(GenerateSpec, "validation")], _refs[(FinetuneSpec, "validation")]],
    "description": "a generation spec (kind generate, or no kind) or a fine-tune spec (kind finetune)",
}

SPEC_EXAMPLES = {
    "generate": {
        "summary": "Generate: a model and a dataset of prompts",
        "value": {
            "model": "Qwen/Qwen3-0.6B",
            "input": "file_0123456789ab",
            "max_new_tokens": 128,
            "temperature": 0.7,
            "top_p": 0.9,
        },
    },
    "openai": {
        "summary": "OpenAI batch lines: the model is each line's body.model",
        "value": {"input": "file_0123456789ab", "input_format": "openai"},
    },
    "finetune": {
        "summary": "A LoRA fine-tune, then a generation with the new adapter",
        "value": {
            "kind": "finetune",
            "model": "Qwen/Qwen3-0.6B",
            "input": "file_0123456789ab",
            "max_steps": 200,
            "learning_rate": 0.0002,
            "lora_r": 16,
            "then_generate": {"input": "file_ba9876543210", "max_new_tokens": 64},
        },
    },
}

JOB_SPEC_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": JOB_SPEC, "examples": SPEC_EXAMPLES}},
    }
}
"""`POST /jobs`'s `openapi_extra`: the route reads its body itself and validates it with `parse_spec`."""


def openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document of `app`, plus the spec's schemas in `components` (cached, as FastAPI's own is)."""
    if app.openapi_schema is None:
        document = get_openapi(
            title=app.title,
            version=app.version,
            summary=app.summary,
            description=app.description,
            routes=app.routes,
        )
        document.setdefault("components", {}).setdefault("schemas", {}).update(SPEC_SCHEMAS)
        for path in document["paths"].values():
            for operation in path.values():
                for parameter in operation.get("parameters", []):
                    parameter["schema"] = _never_null(parameter["schema"])
        app.openapi_schema = document
    return app.openapi_schema


def _never_null(schema: dict[str, Any]) -> dict[str, Any]:
    """A parameter's schema without the `null` FastAPI adds for `X | None = None`: a query parameter is a string or
    left out, never null (left out, it takes its default)."""
    branches = [b for b in schema.get("anyOf", []) if b != {"type": "null"}]
    if "anyOf" not in schema or len(branches) == len(schema["anyOf"]):
        return schema
    rest = {k: v for k, v in schema.items() if k != "anyOf"}
    return {**rest, **branches[0]} if len(branches) == 1 else {**rest, "anyOf": branches}
