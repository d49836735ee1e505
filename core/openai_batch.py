"""OpenAI Batch lines, both ways: an input line as our row (`openai_request`), and a row as a line of the output
file (`openai_output_record`) or of the error file (`openai_error_record`).

`max_tokens`/`max_completion_tokens` become `max_new_tokens`, `n` becomes `num_return_sequences`; OpenAI's
`response_format` and `logprobs`/`top_logprobs` and vLLM's `guided_*` keys map onto our row's parameters. A row's
stored log-probabilities (in OpenAI's chat shape once read: core/logprob_store.py) become a chat choice's
`logprobs.content` or a completion choice's `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`
(`completion_logprobs`).

core/dataset.py reads an `openai` input through `openai_request`; api/results.py writes the output and error files
with the records here; the OpenAI Batch routes are api/openai_api.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from core import logprob_store
from core.errors import FieldError

OPENAI_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}

# body keys we map onto our sampling parameters
_OPENAI_PARAMS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "seed": "seed",
    "stop": "stop",
    # extensions that vLLM and TGI accept in the body as well
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
    "ignore_eos": "ignore_eos",
    "do_sample": "do_sample",
    # structured outputs (core/structured.py): OpenAI's response_format, vLLM's guided_choice and guided_regex
    "response_format": "response_format",
    "guided_choice": "guided_choice",
    "guided_regex": "guided_regex",
    "top_logprobs": "top_logprobs",
}
# body keys that change nothing here when they hold these values
_OPENAI_NEUTRAL = {
    "stream": (False, None),
    "frequency_penalty": (0, None),
    "presence_penalty": (0, None),
    "parallel_tool_calls": (True, False, None),
}
_OPENAI_IGNORED = (
    "model",
    "user",
    "metadata",
    "store",
    "service_tier",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "messages",
    "prompt",
    "logprobs",  # read by _openai_logprobs
    "guided_json",  # vLLM's name for a JSON schema: read by _openai_params
)


@dataclass
class OpenAIRequest:
    custom_id: str
    kind: str  # "messages" or "prompt"
    content: Any  # the messages list or the prompt string
    params: dict[str, Any]  # in our names, not validated yet
    url: str
    model: str | None


def openai_request(obj: dict[str, Any], *, n_param: str | None = "num_return_sequences") -> OpenAIRequest:
    """One OpenAI Batch input line as our row; raises a FieldError saying what is wrong and naming the line's
    field at fault (`body.n`, `custom_id`).

    `max_tokens`/`max_completion_tokens` become `max_new_tokens`; `temperature`, `top_p`, `stop`, `seed` keep their
    names; `n` becomes `n_param` (None: only n = 1 is accepted). A parameter the body leaves out takes the
    job's value (not OpenAI's default temperature of 1). `body.model` is returned for the response to echo.
    """
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise FieldError("an OpenAI batch line needs a 'custom_id' (a non-empty string)", param="custom_id")
    if obj.get("method", "POST") != "POST":
        raise FieldError(f"method {obj.get('method')!r}: OpenAI batch lines use POST", param="method")
    unknown = sorted(set(obj) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise FieldError(
            f"unknown key(s) {', '.join(map(repr, unknown))}: an OpenAI batch line has custom_id, method, url and body",
            param=unknown[0],
        )
    url, body = obj.get("url"), obj.get("body")
    if url not in OPENAI_URLS:
        raise FieldError(f"url {url!r} is not supported: use /v1/chat/completions or /v1/completions", param="url")
    if not isinstance(body, dict):
        raise FieldError("'body' must be an object with the request (messages or prompt, max_tokens, …)", param="body")
    kind = OPENAI_URLS[url]
    other = "prompt" if kind == "messages" else "messages"
    if other in body:
        raise FieldError(f"body.{other} does not belong to {url}: use body.{kind}", param=f"body.{other}")
    content = body.get(kind)
    if kind == "messages":
        content = _openai_messages(content)
    elif isinstance(content, list) and len(content) == 1 and isinstance(content[0], str):
        content = content[0]
    params = _openai_params(body, n_param)
    params.update(_openai_logprobs(body, kind))
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):
        raise FieldError("body.model must be a non-empty string", param="body.model")
    return OpenAIRequest(custom_id, kind, content, params, url, model)


def _openai_messages(messages: Any) -> Any:
    """Text content parts are joined into one string; other parts (images, audio) are refused."""
    if not isinstance(messages, list):
        return messages  # the row check says what is wrong
    out = []
    for i, msg in enumerate(messages):
        if isinstance(msg, dict) and isinstance(msg.get("content"), list):
            parts = msg["content"]
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts
            ):
                where = f"body.messages[{i}].content"
                raise FieldError(f"{where}: only text parts are supported here", param=where)
            msg = {**msg, "content": "".join(p["text"] for p in parts)}
        if isinstance(msg, dict):
            msg = {k: v for k, v in msg.items() if k != "name"}
        out.append(msg)
    return out


def _openai_logprobs(body: dict[str, Any], kind: str) -> dict[str, Any]:
    """`logprobs`: chat's is true/false (with `top_logprobs` beside it); completions' is the number of most likely
    tokens to return at each step (0-20), which is our logprobs true + top_logprobs."""
    value = body.get("logprobs")
    if value is None:
        return {}
    if kind == "messages":
        if not isinstance(value, bool):
            raise FieldError(
                "body.logprobs on /v1/chat/completions is true or false (top_logprobs says how many)",
                param="body.logprobs",
            )
        return {"logprobs": value}
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(
            "body.logprobs on /v1/completions is the number of most likely tokens to return (0-20)",
            param="body.logprobs",
        )
    return {"logprobs": True, "top_logprobs": value}


def _openai_params(body: dict[str, Any], n_param: str | None) -> dict[str, Any]:
    params = {ours: body[theirs] for theirs, ours in _OPENAI_PARAMS.items() if theirs in body}
    if body.get("guided_json") is not None:
        if "response_format" in body:
            raise FieldError("give body.response_format or body.guided_json, not both", param="body.guided_json")
        schema = body["guided_json"]
        schema = json.loads(schema) if isinstance(schema, str) else schema
        params["response_format"] = {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}
    limits = {k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None}
    if len(set(map(json.dumps, limits.values()))) > 1:
        raise FieldError(
            "body.max_tokens and body.max_completion_tokens differ: give one of them",
            param="body.max_completion_tokens",
        )
    if limits:
        params["max_new_tokens"] = next(iter(limits.values()))
    n = body.get("n")
    if n is not None and n != 1:
        if n_param is None:
            raise FieldError(f"body.n = {n!r}: this server returns one choice per request; send n = 1", param="body.n")
        params[n_param] = n
    for key, allowed in _OPENAI_NEUTRAL.items():
        if key in body and body[key] not in allowed:
            raise FieldError(
                f"body.{key} = {json.dumps(body[key])} is not supported by this server: leave it out",
                param=f"body.{key}",
            )
    unknown = sorted(set(body) - set(_OPENAI_PARAMS) - set(_OPENAI_NEUTRAL) - set(_OPENAI_IGNORED))
    if unknown:
        raise FieldError(
            f"body key(s) {', '.join(map(repr, unknown))} are not supported by this server: leave them out",
            param=f"body.{unknown[0]}",
        )
    return params


# our row fields that a line's body gives under other names (the first name the body holds, else the first)
_BODY_NAMES = {
    "max_new_tokens": ("max_completion_tokens", "max_tokens"),
    "num_return_sequences": ("n",),
    "top_logprobs": ("top_logprobs", "logprobs"),  # /v1/completions' logprobs is the number of top tokens
    "response_format": ("response_format", "guided_json"),
}


def body_param(ours: str | None, body: Any) -> str | None:
    """The line's body field behind a field of our row (`max_new_tokens` → `body.max_tokens`), for the `param` of a
    row refused by our row checks (core/dataset.py); None for None (a rule over several fields)."""
    if not ours:
        return None
    head, dot, rest = ours.partition(".")
    names = _BODY_NAMES.get(head, (head,))
    body = body if isinstance(body, dict) else {}
    theirs = next((name for name in names if body.get(name) is not None), names[0])
    return f"body.{theirs}{dot}{rest}"


def outputs_of(value: Any) -> list[str]:
    """The generated texts of a row: one, or several (num_return_sequences > 1 stores a list)."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, list) else [value]


def openai_output_record(row: Any, *, job_id: str, model: str) -> dict[str, Any]:
    """A line of the OpenAI Batch output file for a succeeded row (`row` is a `core.models.JobRow`).

    The body is a `chat.completion` for a messages row (and /v1/chat/completions lines) or a `text_completion`
    for a prompt row; each output is one choice. `model` is echoed from the line's body.model when it had one.
    """
    meta = (row.input or {}).get("openai") or {}
    chat = "messages" in (row.input or {})
    texts = outputs_of(row.output)
    reasons = row.finish_reason
    reasons = reasons if isinstance(reasons, list) else [reasons] * len(texts)
    logprobs = logprobs_of(row.logprobs, len(texts))
    choices = [
        (
            {
                "index": i,
                "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": None if content is None else {"content": content, "refusal": None},
                "finish_reason": reason,
            }
            if chat
            else {"index": i, "text": text, "logprobs": completion_logprobs(content), "finish_reason": reason}
        )
        for i, (text, reason, content) in enumerate(zip(texts, reasons, logprobs))
    ]
    prompt, completion = row.prompt_tokens or 0, row.completion_tokens or 0
    body = {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{job_id}-{row.idx}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(row.finished_at or 0),
        "model": meta.get("model") or model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion},
    }
    return {
        "id": _request_id(job_id, row.idx, "batch_req"),
        "custom_id": row.custom_id,
        "response": {"status_code": 200, "request_id": _request_id(job_id, row.idx, "req"), "body": body},
        "error": None,
    }


def logprobs_of(value: Any, outputs: int) -> list[list[dict[str, Any]] | None]:
    """A row's stored log-probabilities per output: one content list per output (the stored value is the list
    itself for one output, a list of them for several), or None for each where the row asked for none."""
    if value is None:
        return [None] * outputs
    value = logprob_store.render_row(value)
    return value if outputs > 1 else [value]


def completion_logprobs(content: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """/v1/completions' shape of one output's log-probabilities (from the chat shape we store): tokens,
    token_logprobs, top_logprobs (one {token: logprob} per step, or None when none were asked), text_offset."""
    if content is None:
        return None
    offsets, at = [], 0
    for entry in content:
        offsets.append(at)
        at += len(entry["token"])
    asked = any(entry.get("top_logprobs") for entry in content)
    return {
        "tokens": [entry["token"] for entry in content],
        "token_logprobs": [entry["logprob"] for entry in content],
        "top_logprobs": [{t["token"]: t["logprob"] for t in entry["top_logprobs"]} for entry in content]
        if asked
        else None,
        "text_offset": offsets,
    }


def openai_error_record(row: Any, *, job_id: str) -> dict[str, Any]:
    """A line of the OpenAI Batch error file for a failed row (`row` is a `core.models.JobRow`).

    A row refused by the checks before any GPU time (it never reached a worker, and its error names its place)
    answers 400 `invalid_request_error`; a row that failed in the engine, or with its shard (a worker lost on every
    attempt: it never reached a worker either), answers 500 `server_error`."""
    error_text = row.error or ""
    invalid = (
        row.worker is None and not row.executions and error_text.startswith((f"line {row.line}: ", f"row {row.line}: "))
    )
    status = 400 if invalid else 500
    error = {
        "message": row.error or "failed",
        "type": "invalid_request_error" if invalid else "server_error",
        "param": None,
        "code": None,
    }
    return {
        "id": _request_id(job_id, row.idx, "batch_req"),
        "custom_id": row.custom_id,
        "response": {
            "status_code": status,
            "request_id": _request_id(job_id, row.idx, "req"),
            "body": {"error": error},
        },
        "error": None,
    }


def _request_id(job_id: str, idx: int, prefix: str) -> str:
    return f"{prefix}_{job_id.removeprefix('job_')}_{idx}"
