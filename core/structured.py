"""Structured outputs and log-probabilities: what a row asks for, checked in the API without torch.

A row's output can be constrained (one constraint per row; a row's own replaces the job's, `sampling_of`):

    response_format  {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}  (OpenAI's form)
                     {"type": "json_object"}   any JSON object
                     {"type": "text"}          no constraint (clears the job's for a row)
    guided_choice    ["yes", "no", …]          exactly one of these strings (vLLM's name)
    guided_regex     "\\d{3}-\\d{4}"           a match of this regular expression (vLLM's name; Rust regex syntax,
                                               no look-around)

Each becomes a grammar of llguidance (guidance-ai/llguidance, pinned in constraints.txt; docs/design.md "Structured
outputs" says why it and not xgrammar): its Rust core compiles and checks a grammar with no torch and no
tokenizer, so a schema the engine cannot compile (an unknown `format`, an unimplemented keyword such as `not`, a
regex with look-around) is refused at submit with llguidance's own reason. The worker compiles the same grammar
against the model's tokenizer (worker/engines/grammar.py) and masks the logits with it at every step.

JSON may hold at most one space between its tokens (`whitespace_pattern` " ?"): no newline, no indentation, so a
model cannot spend its tokens on layout, but one that writes `{"a": 1, "b": 2}` (as most chat models do) keeps its
own form instead of being forced off it; a schema may say otherwise in its `x-guidance` object (llguidance's
options; `{"whitespace_flexible": false}`: compact only).

A constrained row cannot also ask for `stop` strings (a stop string cuts the output where the grammar did not end
it) nor `ignore_eos` (the grammar ends the output with EOS): both are refused with the reason.

`logprobs` (true/false) and `top_logprobs` (0-20) ask for each generated token's log-probability and the
`top_logprobs` most likely alternatives (worker/engines/logprobs.py says which distribution).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

CONSTRAINT_KEYS = ("response_format", "guided_choice", "guided_regex")
RESPONSE_TYPES = ("text", "json_object", "json_schema")
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": " ?"}  # docstring above; docs/design.md
TOP_LOGPROBS_MAX = 20
MAX_CHOICES = 1000
MAX_GRAMMAR_CHARS = 100_000  # a schema or regex as JSON text


def check_response_format(value: Any) -> dict[str, Any] | None:
    """The shape of a `response_format` (OpenAI's three forms); raises ValueError saying what is wrong."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_TYPES:
        raise ValueError(
            (f"{value!r} is not an object: " if not isinstance(value, dict) else "")
            + 'use {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, {"type": "json_object"} '
            'or {"type": "text"}'
        )
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    if stray := sorted(set(value) - allowed):
        raise ValueError(f"unknown key(s) {', '.join(map(repr, stray))} for type {kind}")
    if kind != "json_schema":
        return value
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
        raise ValueError('type json_schema needs "json_schema": {"name": ..., "schema": {a JSON Schema object}}')
    if stray := sorted(set(inner) - {"name", "schema", "strict", "description"}):
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, stray))} in json_schema: it has name, schema, strict, description"
        )
    if inner.get("name") is not None and not isinstance(inner["name"], str):
        raise ValueError("json_schema.name must be a string")
    if inner.get("strict") is not None and not isinstance(inner["strict"], bool):
        raise ValueError("json_schema.strict must be true or false")
    if len(json.dumps(inner["schema"])) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"the schema is longer than {MAX_GRAMMAR_CHARS} characters as JSON")
    return value


def check_choice(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError("guided_choice must be a non-empty list of non-empty strings")
    if len(value) > MAX_CHOICES:
        raise ValueError(f"guided_choice holds more than {MAX_CHOICES} strings")
    return value


def check_regex(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError("guided_regex must be a non-empty string")
    if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"guided_regex is longer than {MAX_GRAMMAR_CHARS} characters")
    return value


def constraint(params: dict[str, Any]) -> tuple[str, Any] | None:
    """The constraint of effective parameters: ("json_schema", schema), ("json_object", None), ("choice", list),
    ("regex", str), or None."""
    fmt = params.get("response_format")
    if fmt and fmt.get("type") == "json_schema":
        return "json_schema", fmt["json_schema"]["schema"]
    if fmt and fmt.get("type") == "json_object":
        return "json_object", None
    if params.get("guided_choice"):
        return "choice", params["guided_choice"]
    if params.get("guided_regex"):
        return "regex", params["guided_regex"]
    return None


def schema_of(params: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema an output must satisfy (json_object: any object), or None (tests and benchmarks check
    outputs against it)."""
    found = constraint(params)
    if found is None or found[0] not in ("json_schema", "json_object"):
        return None
    return found[1] if found[0] == "json_schema" else {"type": "object"}


def grammar(params: dict[str, Any]) -> str | None:
    """The llguidance grammar (its JSON text) of the row's constraint, or None."""
    found = constraint(params)
    return None if found is None else _grammar(found[0], json.dumps(found[1]))  # key order kept: properties in order


@functools.lru_cache(maxsize=512)
def _grammar(kind: str, key: str) -> str:
    from llguidance import LLMatcher, grammar_from

    value = json.loads(key)
    if kind == "json_schema":
        # a schema whose x-guidance says anything about whitespace decides it alone (llguidance's whitespace_pattern,
        # ours by default, would otherwise outrank its `whitespace_flexible: false`)
        own = value.get("x-guidance") if isinstance(value.get("x-guidance"), dict) else {}
        ours = {} if {"whitespace_flexible", "whitespace_pattern"} & set(own) else JSON_OPTIONS
        return LLMatcher.grammar_from_json_schema(value, defaults=ours)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "choice":
        return grammar_from("choice", key)
    return LLMatcher.grammar_from_regex(value)


@functools.lru_cache(maxsize=512)
def compile_error(text: str) -> str:
    """llguidance's reason a grammar does not compile ('' when it does), without a tokenizer: torch-free."""
    from llguidance import LLMatcher

    try:
        return LLMatcher.validate_grammar(text)
    except Exception as exc:  # a malformed grammar text raises instead of answering
        return str(exc)


def problem(params: dict[str, Any]) -> str | None:
    """Why effective parameters (`sampling_of`) cannot run together, or None: several constraints, a constraint with
    stop strings or ignore_eos, top_logprobs without logprobs, or a constraint the grammar engine cannot compile."""
    given = [k for k in CONSTRAINT_KEYS if params.get(k) and params[k] != {"type": "text"}]
    if len(given) > 1:
        return f"give one constraint, not {' and '.join(given)}"
    if params.get("top_logprobs") and not params.get("logprobs"):
        return "top_logprobs needs logprobs true"
    found = constraint(params)
    if found is None:
        return None
    name = f"response_format {found[0]}" if found[0].startswith("json") else f"guided_{found[0]}"
    if params.get("stop"):
        return f"stop strings cut a constrained output where its grammar does not end: leave stop out with {name}"
    if params.get("ignore_eos"):
        return f"ignore_eos cannot be combined with {name}: the grammar ends the output with EOS"
    try:
        text = grammar(params)
    except Exception as exc:  # whatever a fuzzed schema makes the converter raise (ValueError, RecursionError …)
        return f"{name} cannot be compiled: {exc}"
    error = compile_error(text)
    if error and not error.startswith("WARNING"):
        return f"{name} cannot be compiled by the grammar engine (llguidance): {_first_lines(error)}"
    return None


def _first_lines(text: str, limit: int = 400) -> str:
    """llguidance's message, on one line. A regex error draws a caret under the pattern over several lines and
    adds the grammar's own lines: it is given as the pattern and the error's line alone (`invalid regex "([a-z":
    unclosed character class`)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    pattern = re.search(r'invalid regex "(.*)" \(in regex\)', lines[0]) if lines else None
    reason = next((line.removeprefix("error:").strip() for line in lines if line.startswith("error:")), None)
    flat = f'invalid regex "{pattern[1]}": {reason}' if pattern and reason else " ".join(lines)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def override(job: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The job's parameters with a row's overrides: a row naming any constraint replaces the job's constraint
    (a row's guided_choice is not combined with the job's response_format)."""
    out = dict(job)
    if any(row.get(k) is not None for k in CONSTRAINT_KEYS):
        out.update(dict.fromkeys(CONSTRAINT_KEYS))
    out.update({k: v for k, v in row.items() if v is not None})
    return out
