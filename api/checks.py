"""Submit-time checks: a spec against the server's rules, the live workers' capabilities, its inputs and its owner.

`submission(owner, spec_data)` runs every check of a submit and returns a `core.jobs.NewJob` (the spec resolved:
a model's real directory or pinned commit, the input's format detected) for `core.jobs.submit`, which stores it.
Nothing is written to the store here, so a refused submit leaves nothing behind. `request(spec, admin=...)` holds the checks
only an HTTP request needs (who may name server paths). No torch, no worker code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from api import service_models
from core import adapters, capability, files, formats, hub, registry, structured
from core.dataset import (
    PARAMS,
    SAMPLE_AT_ZERO,
    check_prompt_columns,
    count_rows,
    engine_problem,
    openai_models,
    too_many_rows,
)
from core.db import session_scope
from core.errors import Forbidden, InvalidInput, JobsError, NoSuchPath, Unschedulable, naming
from core.jobs import NewJob
from core.queue import ping_redis, queue_for
from core.settings import get_settings
from core.spec import GENERATE_COLUMNS, FinetuneSpec, GenerateSpec, Spec, parse_spec, sampling_of
from core.training_data import file_format

HUB_ID = hub.HUB_ID  # org/name; `./x` and `../x` are paths, not Hub ids
MAX_CONFIG_BYTES = 10 << 20  # a model's config.json, read as JSON at submit
INHERITED = (
    "revision",
    "dtype",
    "attn_implementation",
    "use_kernels",
    "kernel_config",
    "device_map",
    "trust_remote_code",
    "gpus",
    "priority",
)  # what a fine-tune's chained generation job takes from it


def submission(owner: str, spec_data: Any, *, admin: bool = False, may_prioritize: bool = False) -> NewJob:
    """Every check of a submit, in order; the checked job for `core.jobs.submit`. `admin` lets an admin's job use
    another owner's adapter; `may_prioritize` (a token with the priority or admin scope) lets it be `high`."""
    spec = parse_spec(_model_from_input(owner, spec_data))
    priority(spec, may_prioritize=may_prioritize)
    if spec.kind == "finetune":
        return finetune(owner, spec)
    return generation(owner, spec, admin=admin)


def generation(owner: str, spec: GenerateSpec, *, admin: bool = False) -> NewJob:
    """A generation job: its sampling, model (a Hub model resolved and read), the slice that runs it, its adapter
    (a fine-tune still running makes it wait), and its input (the owner's, within the row limit, format detected,
    and for a table a column that gives rows their prompt: `core.dataset.check_prompt_columns`)."""
    _check_sampling(spec)
    with naming("model"):
        spec = model(spec)
    hub_check = service_models.check(spec)  # a Hub model or adapter: resolved to a commit, config and tokenizer read
    spec = hub_check.spec
    ping_redis()
    with session_scope() as session:
        gpus = slice_size(session, spec)
        notes: list[str] = []  # an adapter file's check, for the job's events
        with naming("adapter"):
            waits = bool(spec.adapter) and adapters.check_for_generation(
                session,
                ref=spec.adapter,
                owner=owner,
                admin=admin,
                model=spec.model,
                revision=spec.revision,
                notes=notes,
            )
        with naming("input"):
            fmt = dataset(session, owner, spec.input, fmt=spec.input_format)
        spec = _with_input_format(spec, fmt)
        check_prompt_columns(files.source(session, spec.input, owner=owner)[0], fmt, spec.input_columns)
    return NewJob(
        owner=owner,
        spec=spec,
        gpus=gpus,
        inputs=[(spec.input, fmt)],
        metrics=hub_check.metrics,
        notes=hub_check.notes + notes,
        model_dir=hub_check.local_dir,
        waits=waits,
    )


def finetune(owner: str, spec: FinetuneSpec) -> NewJob:
    """A fine-tune: its base model, its chained generation spec (parsed now; submitted once the fine-tune is
    stored), the slice that runs it, and its training and validation files (the owner's, within the row limit,
    each file's format detected on its own). Their rows are checked as they are stored (`core.jobs`)."""
    with naming("model"):
        spec = model(spec)
    hub_check = service_models.check(spec)  # a Hub base: resolved to a commit, its config read
    spec = hub_check.spec
    then = _then_generate_spec(spec)
    ping_redis()
    with session_scope() as session:
        gpus = slice_size(session, spec)
        inputs = []
        for field in ("input", "validation_input"):
            if ref := getattr(spec, field):
                with naming(field):
                    inputs.append((ref, file_format(dataset(session, owner, ref, fmt=spec.file_format))))
    return NewJob(
        owner=owner,
        spec=spec,
        gpus=gpus,
        inputs=inputs,
        metrics=hub_check.metrics,
        notes=hub_check.notes,
        then_generate=then,
    )


def priority(spec: Spec, *, may_prioritize: bool) -> None:
    """`high` is for tokens with the priority (or admin) scope: any owner may lower their own work to `low`."""
    if spec.priority == "high" and not may_prioritize:
        raise Forbidden(
            "priority high needs a token with the priority or admin scope (`gpujobs tokens create "
            "--owner NAME --scope user --scope priority`): submit with priority normal or low",
            param="priority",
        )


def _then_generate_spec(spec: FinetuneSpec) -> dict[str, Any] | None:
    """The chained generation spec, checked as a generation job's is (its fields, then its sampling) before anything
    is stored: a chained spec refused after the fine-tune was stored would leave that fine-tune failed. Its adapter
    id is filled in later; the model, the adapter and the kind are the chain's, never the user's."""
    if spec.then_generate is None:
        return None
    given = spec.then_generate
    if taken := [k for k in ("model", "adapter", "adapter_revision") if k in given] + (
        ["kind"] if given.get("kind", "generate") != "generate" else []
    ):
        raise InvalidInput(
            f"invalid finetune spec: then_generate: {', '.join(taken)}: the chained job is a generation job on the "
            "fine-tune's base model with the adapter it trains: leave them out",
            param=f"then_generate.{taken[0]}",
        )
    data = {k: getattr(spec, k) for k in INHERITED if getattr(spec, k) is not None}
    data.update(given, kind="generate", model=spec.model, adapter="job_pending")
    data.setdefault("name", f"{spec.name or 'fine-tune'}: generate")
    try:
        parsed = parse_spec(data)
        assert isinstance(parsed, GenerateSpec)
        _check_sampling(parsed)
    except InvalidInput as exc:
        raise InvalidInput(
            f"invalid finetune spec: then_generate: {str(exc).removeprefix('invalid generate spec: ')}",
            param=f"then_generate.{exc.param}" if exc.param else "then_generate",
        ) from None
    return data


def _check_sampling(spec: Spec) -> None:
    """Parameters that are each valid but cannot run together (the engine would fail every row)."""
    if getattr(spec, "do_sample", None) and spec.temperature == 0:
        raise InvalidInput(f"invalid {spec.kind} spec: {SAMPLE_AT_ZERO}")
    if not isinstance(spec, GenerateSpec):
        return
    params = sampling_of(spec, None)
    if problem := structured.problem(params) or engine_problem(spec.engine, params):
        raise InvalidInput(f"invalid {spec.kind} spec: {problem}")


# --- the model ------------------------------------------------------------------------------------------------


def model(spec: Spec) -> Spec:
    """Check the model a spec names before anything is stored; a local path becomes its resolved directory.

    With JOBS_MODEL_ROOTS set, a path is checked against the roots before it is looked at, so a refusal never
    tells whether a path outside them exists, and Hub ids are refused unless JOBS_HUB_MODELS allows them (models come
    only from the roots and that list). A Hub id is checked further by `service_models.check`.
    """
    settings = get_settings()
    if spec.trust_remote_code and not settings.allow_remote_code:
        raise Forbidden(
            "trust_remote_code is disabled on this server (JOBS_ALLOW_REMOTE_CODE): use a model that "
            "transformers supports natively",
            param="trust_remote_code",
        )
    if not spec.model.strip():
        raise InvalidInput("model is empty: give a local model directory or a Hub id (org/name)")
    path = files.resolve(spec.model, what="model") if spec.model.startswith("~") else Path(spec.model)
    roots = settings.model_roots
    adapter = getattr(spec, "adapter", None)
    if adapter and hub.is_hub_id(adapter) and roots and not hub.allowed(adapter):
        raise InvalidInput(
            f"adapter {adapter!r}: this server takes Hub repos only where JOBS_HUB_MODELS lists them "
            "(its models come from JOBS_MODEL_ROOTS): upload the adapter instead (--adapter DIR)",
            param="adapter",
        )
    if not path.is_absolute() and HUB_ID.match(spec.model) and not path.exists():
        if not roots or hub.allowed(spec.model):
            return spec  # a Hub id: fetched once per host by the workers (service_models.check reads it first)
        raise InvalidInput(
            f"model {spec.model!r} is not a directory under the model roots "
            f"({os.pathsep.join(map(str, roots))}): this server loads models only from "
            "JOBS_MODEL_ROOTS and the Hub ids JOBS_HUB_MODELS lists"
        )
    if not roots and not path.exists():
        raise NoSuchPath(f"model {spec.model!r} does not exist: give a local model directory or a Hub id (org/name)")
    real = files.check_server_path(str(path), roots, what="model")
    _check_model_dir(real, spec.model)
    return spec.model_copy(update={"model": str(real)})


def _check_model_dir(real: Path, name: str) -> None:
    """A saved transformers model: a directory with a config.json object and safetensors weights."""
    if not real.is_dir():
        raise InvalidInput(
            f"model path {name!r} is not a directory: point at a directory saved with "
            "save_pretrained (config.json and *.safetensors)"
        )
    config = real / "config.json"
    if not config.is_file():
        raise InvalidInput(f"model directory {name!r} has no config.json: point at a saved transformers model")
    try:
        with open(config, "rb") as stream:
            data = json.loads(stream.read(MAX_CONFIG_BYTES + 1)) if config.stat().st_size <= MAX_CONFIG_BYTES else 0
    except (OSError, ValueError):
        data = None
    if not isinstance(data, dict):
        raise InvalidInput(
            f"model directory {name!r} has a config.json that is not a JSON object (of at most "
            f"{MAX_CONFIG_BYTES} bytes): save the model again with save_pretrained"
        )
    if not any(real.glob("*.safetensors")):
        raise InvalidInput(
            f"model directory {name!r} has no .safetensors weights (pickle .bin checkpoints are "
            "refused): convert it with save_pretrained(..., safe_serialization=True)"
        )


def _model_from_input(owner: str, spec_data: Any) -> Any:
    """A generation job that names no model takes it from its OpenAI batch lines' `body.model`: every line must
    name the same one, and it must be allowed. With JOBS_MODEL_ROOTS set, a name is a directory under one of the
    roots (`qwen3-0.6b` → `/models/qwen3-0.6b`); without roots (the single-user local default) it is whatever
    `model` may be in a spec (a local directory, or a Hub id cached on the workers)."""
    if not isinstance(spec_data, dict) or spec_data.get("model") or spec_data.get("kind", "generate") != "generate":
        return spec_data
    ref, fmt = spec_data.get("input"), spec_data.get("input_format", "auto")
    missing = InvalidInput(
        "model is missing: name one (--model, or `model:` in the spec); only OpenAI batch lines "
        "may name it instead, in body.model",
        param="model",
    )
    if not isinstance(ref, str) or not ref.strip():
        return spec_data  # the spec check says what is missing
    if fmt not in ("auto", "openai"):
        raise missing
    with session_scope() as session, naming("input"):
        if ref.startswith("file_"):
            file = files.get(session, ref, owner=owner)
            path, name = files.absolute(file), file.filename
        else:
            path = files.check_server_path(ref, get_settings().data_roots, what="dataset")
            name = path.name
    if not path.is_file() or (fmt == "auto" and formats.detect(path, name) != "openai"):
        raise missing
    models, unnamed = openai_models(path)
    if not models and unnamed is None:  # empty, CSV, plain prompts, not UTF-8: no line to take a model from
        raise InvalidInput(
            f"{name!r} holds no OpenAI batch line: each line must be a JSON object with custom_id, method, url and "
            "body, the model in body.model",
            param="input",
        )
    if not models:
        raise InvalidInput(
            "model is missing: the job names none and no OpenAI batch line names one in body.model: "
            "name one (--model, or `model:` in the spec)",
            param="body.model",
        )
    (first, first_line), *others = models.items()
    if others:
        second, second_line = others[0]
        raise InvalidInput(
            f"lines {first_line} and {second_line} name different models ({first!r} and {second!r}) "
            "in body.model: when the job names no model every line must name the same one; or name "
            "the model in the job (--model)",
            param="body.model",
        )
    if unnamed is not None:
        raise InvalidInput(
            f"line {unnamed} names no body.model while line {first_line} names {first!r}: when the job "
            "names no model every line must name the same one; or name the model in the job (--model)",
            param="body.model",
        )
    return {**spec_data, "model": _allowed_model(first)}


def _allowed_model(name: str) -> str:
    roots = get_settings().model_roots
    if not roots or (HUB_ID.match(name) and hub.allowed(name)):
        return name  # checked like any spec's model by `model` (a Hub id by service_models.check too)
    if not Path(name).is_absolute() and ".." not in Path(name).parts:
        for root in roots:
            if (root / name).is_dir():
                return str(root / name)
    raise InvalidInput(
        f"body.model {name!r} is not a model directory under the model roots "
        f"({os.pathsep.join(map(str, roots))}): name one of those directories, or name the model in "
        "the job (--model)",
        param="body.model",
    )


# --- where it runs ----------------------------------------------------------------------------------------------


def slice_size(session: Session, spec: Spec) -> int:
    """The slice size the job runs on: the spec's, or the smallest that a live worker able to run it offers.

    Refused when live workers exist but none can run the job; the message names each candidate and what it
    lacks. With no live worker at all, a job that names `gpus` is queued until one starts.
    """
    workers = registry.live(session, get_settings().worker_timeout)
    if not workers:
        if spec.gpus is None:
            raise Unschedulable(
                "no live worker: start the local stack with `gpujobs up`, or pass --gpus N to queue "
                "the job until a worker of that slice size starts"
            )
        return spec.gpus
    sizes = [spec.gpus] if spec.gpus is not None else sorted({registry.slice_size(w) for w in workers})
    gaps = []
    for size in sizes:
        for worker in (w for w in workers if registry.can_serve(w, size)):
            lacking = capability.missing(spec, worker.capabilities, size)
            if not lacking:
                return size
            gaps.append(f"{worker.name} ({queue_for(size)}): {'; '.join(lacking)}")
    if not gaps:
        raise Unschedulable(
            f"no live worker serves jobs of {spec.gpus} GPU(s) (queue {queue_for(spec.gpus)}); "
            f"live workers: {_describe(workers)}. Start one with `gpujobs worker --gpus ...`"
        )
    raise Unschedulable("no live worker can run this job: " + " | ".join(gaps))


def _describe(workers: list) -> str:
    return ", ".join(f"{w.name} ({'+'.join(w.queues)})" for w in workers)


# --- the input --------------------------------------------------------------------------------------------------


def dataset(session: Session, owner: str, ref: str, *, fmt: str = "auto") -> str:
    """Check a dataset the job reads, storing nothing yet: the owner's file id, or a server path a job may read
    (copied into the store with the job, `core.files.stored`). Returns its format (`fmt`, or detected for `auto`).

    A dataset of more rows than JOBS_MAX_ROWS is refused here, before a single row is inserted (JSONL and CSV
    by their lines, Parquet by its footer; a saved dataset while it is parsed).
    """
    if not ref.strip():
        raise InvalidInput(
            "input is empty: give a file id (file_…) from POST /files, or a server path under JOBS_DATA_ROOTS"
        )
    path, name, file = files.source(session, ref, owner=owner)
    max_rows = get_settings().max_rows
    try:
        fmt = formats.detect(path, name) if fmt == "auto" else fmt
        if fmt in ("parquet", "hf"):
            rows = formats.parquet_rows(path) if fmt == "parquet" else 0
        else:
            with open(path, "rb") as stream:
                rows = count_rows(stream, limit=max_rows + (fmt == "csv"))  # a CSV header is not a row
                rows -= fmt == "csv"
    except OSError as exc:
        if file is None:
            raise  # a server path that cannot be read: as when it is copied into the store
        raise JobsError(
            f"stored file {file.id} cannot be read from the artifacts store ({exc.strerror}): check "
            "JOBS_ARTIFACTS on the API host, or upload the dataset again"
        ) from None
    if rows > max_rows:
        raise too_many_rows(max_rows)
    return fmt


def _with_input_format(spec: GenerateSpec, fmt: str) -> GenerateSpec:
    """The spec with `input_format` resolved (auto → what the input is) and its column mapping checked."""
    columns = spec.input_columns or {}
    ours = set(GENERATE_COLUMNS)
    unknown = sorted(set(columns) - ours)
    if unknown:
        raise InvalidInput(
            f"input_columns {', '.join(map(repr, unknown))}: map one of prompt, messages, custom_id "
            f"or a sampling parameter ({', '.join(sorted(PARAMS))}) to a column of the file",
            param="input_columns",
        )
    if columns and fmt == "openai":
        raise InvalidInput(
            "input_columns does not apply to OpenAI batch lines (their keys are fixed): leave it out",
            param="input_columns",
        )
    if "prompt" in columns and "messages" in columns:
        raise InvalidInput(
            "input_columns maps both prompt and messages: a row is one or the other", param="input_columns"
        )
    return spec.model_copy(update={"input_format": fmt})


# --- an HTTP request --------------------------------------------------------------------------------------------


def request(spec: Any, *, admin: bool) -> None:
    """What a submit over HTTP must pass before the spec is read: no NUL character anywhere, a model that is no
    relative path, and a user (not an admin) names server paths only under JOBS_DATA_ROOTS, never inside the store
    (for `input`, a fine-tune's `validation_input` and its `then_generate` input alike)."""
    _refuse_nul(spec, "spec")
    _refuse_relative_model(spec.get("model"))
    if not admin:
        _check_user_server_path(spec.get("input"))
        _check_user_server_path(spec.get("validation_input"))  # a fine-tune's other datasets, checked the same way
        then = spec.get("then_generate")
        _check_user_server_path(then.get("input") if isinstance(then, dict) else then)


def _refuse_relative_model(model: Any) -> None:
    """A relative model path means the API server's working directory (or its user's home, for `~`), which an HTTP
    client neither knows nor chose; and one that is not there was taken as a Hub id. Refused when it reads as a
    path: `./`, `../` or `~` in front, or (without JOBS_MODEL_ROOTS, whose checks confine paths and must not tell
    what lies outside them) present in that directory. Any other `org/name` stays a Hub id. The CLI sends local
    paths absolute (api/cli_submit.py `resolve_local_paths`)."""
    if not isinstance(model, str) or not model.strip() or Path(model).is_absolute():
        return  # an empty model: `model` says what to give
    if (
        model.startswith(("./", "../", "~"))
        or model in (".", "..")
        or (not get_settings().model_roots and _exists(model))
    ):
        where = "its user's home" if model.startswith("~") else "its own working directory"
        raise InvalidInput(
            f"model {model!r} is a relative path (the API server would read it from {where}): give an absolute "
            "path on the server, or a Hub id (org/name)"
        )


def _exists(path: str) -> bool:
    try:
        return Path(path).exists()
    except (OSError, ValueError):
        return False


def _refuse_nul(spec: Any, where: str) -> None:
    """No spec field may hold a NUL character: paths cannot, and Postgres text columns refuse them."""
    stack = [(where, spec)]
    while stack:  # iterative: a body nested a thousand levels deep is no reason for a RecursionError
        where, value = stack.pop()
        if isinstance(value, str) and "\x00" in value:
            raise InvalidInput(f"{where} holds a NUL character: remove it")
        if isinstance(value, dict):
            stack += [(f"a key of {where}", k) for k in value] + [(f"{where}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _check_user_server_path(source: Any) -> None:
    """A user reads server files only under JOBS_DATA_ROOTS, and never the store itself (other owners' files,
    the database, the local admin token): without this a user could import another owner's stored file by path."""
    if not isinstance(source, str) or source.startswith("file_"):
        return  # a file id (checked against the owner) or not a path at all (the spec check says what is wrong)
    settings = get_settings()
    if not settings.data_roots:
        raise Forbidden(
            "server-side dataset paths are for admins unless the server sets JOBS_DATA_ROOTS: upload "
            "the file instead (`gpujobs submit --input FILE` uploads a local file)"
        )
    try:
        real = Path(source).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise InvalidInput(
            f"dataset path {source!r} cannot be resolved ({exc}): give an absolute path under "
            "JOBS_DATA_ROOTS, or a file id"
        ) from None
    if any(real.is_relative_to(p) for p in (settings.home, settings.artifacts)):
        raise Forbidden(f"dataset path {source!r} is inside the jobs store: refer to a stored file by its id")
