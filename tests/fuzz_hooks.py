"""Schemathesis hooks for fuzzing the API (tests/fuzz.py loads them with SCHEMATHESIS_HOOKS=tests.fuzz_hooks).

The stack holds objects of two owners: the caller's own, and (for a user token) another owner's. $GPUJOBS_FUZZ
names them (JSON: `own` and `foreign`, each {"file", "train_file", "live", "finished"}, and `model`, a real model
directory). Generated ids almost never exist, so two cases in three are pointed at real ones instead:

- a path's `job_id` / `file_id` becomes one of the caller's own objects or, for a user, another owner's;
- a positive `POST /jobs` body names the real model and a real dataset (the caller's, or another owner's), so
  submits get past "no such file" into the checks behind it.

Only components generated as valid are changed (a negative one stays as generated, or Schemathesis would see an
invalid request "accepted"). The check `another_owners_objects_stay_hidden` fails a request that reaches another
owner's object: on its path anything but 404 (or the 422 of a request refused before any lookup), in a body any
success; and any answer that names the other owner.
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis
from hypothesis import strategies as st
from schemathesis.core.parameters import ParameterLocation

SEEDS: dict[str, Any] = json.loads(os.environ.get("GPUJOBS_FUZZ") or "{}")
OWN: dict[str, str] = SEEDS.get("own", {})
FOREIGN: dict[str, str] = SEEDS.get("foreign", {})
FOREIGN_OWNER: str | None = SEEDS.get("foreign_owner")
CHOICES = ["generated", "own", "foreign"] if FOREIGN else ["generated", "own", "own"]


def _positive(case, location: ParameterLocation) -> bool:
    meta = case.meta
    return meta is None or not meta.is_negative_at(location)


def _point(case, whose: str, job: str):
    """The case with its ids (path) and datasets (POST /jobs body) replaced by `whose` objects (`job`: the live
    job or the finished one)."""
    if whose == "generated" or not SEEDS or (case.meta and case.meta.phase.name != "fuzzing"):
        return case  # the other phases' cases are scenarios of their own (links, coverage, examples)
    objects = OWN if whose == "own" else FOREIGN
    if case.path_parameters and _positive(case, ParameterLocation.PATH):
        real = {"job_id": objects[job], "file_id": objects["file"]}
        case.path_parameters = {k: real.get(k, v) for k, v in case.path_parameters.items()}
    if (
        case.method == "POST"
        and case.path == "/jobs"
        and isinstance(case.body, dict)
        and _positive(case, ParameterLocation.BODY)
    ):
        body = dict(case.body, model=SEEDS["model"])
        finetune = body.get("kind") == "finetune"
        body["input"] = objects["train_file" if finetune else "file"]
        if body.get("validation_input") is not None:
            body["validation_input"] = objects["train_file"]
        if isinstance(body.get("then_generate"), dict):
            body["then_generate"] = dict(body["then_generate"], input=objects["file"])
        case.body = body
    return case


@schemathesis.hook
def flatmap_case(context, case):
    return st.tuples(st.sampled_from(CHOICES), st.sampled_from(["live", "finished"])).map(
        lambda choice: _point(case, *choice)
    )


def _names_foreign_object(case) -> tuple[bool, bool]:
    """Whether the request names one of another owner's objects: on its path, in its body."""
    foreign = set(FOREIGN.values())
    named = lambda value: isinstance(value, str) and value in foreign  # noqa: E731  (a negative case sends lists too)
    on_path = any(named(v) for v in (case.path_parameters or {}).values())
    in_body = isinstance(case.body, dict) and any(
        named(case.body.get(k)) for k in ("input", "validation_input", "adapter")
    )
    return on_path, in_body


@schemathesis.check
def another_owners_objects_stay_hidden(ctx, response, case) -> bool | None:
    if not FOREIGN:
        return None
    on_path, in_body = _names_foreign_object(case)
    if on_path and response.status_code not in (404, 422):
        raise AssertionError(
            f"{case.method} {case.formatted_path} names another owner's object and got {response.status_code}, not 404"
        )
    if in_body and response.status_code < 300:
        raise AssertionError(f"{case.method} {case.path} used another owner's dataset: {response.status_code}")
    if FOREIGN_OWNER and FOREIGN_OWNER.encode() in response.content:  # bytes: a Parquet answer is not text
        raise AssertionError(f"{case.method} {case.formatted_path}: the answer names another owner")
    return None
