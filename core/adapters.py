"""The adapter registry: LoRA adapters made by fine-tune jobs, and generation jobs that wait for one.

An adapter is registered by the worker that trained it, after it checked that the saved adapter loads onto its base
and generates; only then does the fine-tune succeed. Its id is the fine-tune job's id. Files live under the
artifacts dir: `finetune/<job>/checkpoints` while training, `adapters/<job>/` once registered (`path` is stored
relative to the artifacts dir, so hosts may mount it at different places).

Chaining: a generation job that names `adapter: <fine-tune id>` while that fine-tune is still live is stored with
its rows but left `queued`, with no shards (`check_for_generation` says when). When the fine-tune ends,
`core.jobs.release_waiting` (called by the worker that finished it, and by every reaper as a safety net) creates
its shards, or fails it with the fine-tune's outcome.

An adapter may also be a stored file (`adapter: file_…`): a zipped PEFT adapter directory, checked at submit and
extracted once per file by the worker (the section at the end of this module says how and why).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import struct
import uuid
import zipfile
from pathlib import Path, PurePosixPath
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from core import files
from core.errors import Conflict, InvalidInput, NotFound
from core.hub import HUB_ID
from core.models import Adapter, File, Job
from core.settings import get_settings
from core.states import JobState
from core.store import add_event, now

log = logging.getLogger(__name__)
WEIGHTS = "adapter_model.safetensors"


def workdir(job_id: str) -> Path:
    """Where a fine-tune's checkpoints are written (shared by every worker that may resume it)."""
    return get_settings().artifacts / "finetune" / job_id


def adapter_dir(job_id: str) -> Path:
    return get_settings().artifacts / "adapters" / job_id


def absolute(adapter: Adapter) -> Path:
    return get_settings().artifacts / adapter.path


def digest(folder: Path) -> tuple[int, str]:
    """(bytes, sha256) of the adapter's weights file."""
    data = (folder / WEIGHTS).read_bytes()
    return len(data), hashlib.sha256(data).hexdigest()


def register(
    session: Session,
    job: Job,
    folder: Path,
    *,
    lora_config: dict[str, Any],
    load_options: dict[str, Any],
    metrics: dict[str, Any],
) -> Adapter:
    """Record the adapter saved at `folder` (under the artifacts dir) for fine-tune `job`; idempotent per job."""
    size, sha = digest(folder)
    row = session.get(Adapter, job.id) or Adapter(id=job.id, job_id=job.id)
    row.owner, row.base_model, row.base_revision = job.owner, job.spec["model"], job.spec.get("revision")
    row.tokenizer, row.path = job.spec["model"], str(folder.relative_to(get_settings().artifacts))
    row.bytes, row.sha256, row.lora_config, row.load_options = size, sha, lora_config, load_options
    row.metrics, row.created_at = metrics, now()
    session.add(row)
    add_event(session, job.id, f"adapter registered: {size} bytes, sha256 {sha[:12]}…", data={"path": row.path})
    return row


def get(session: Session, adapter_id: str, *, owner: str | None) -> Adapter:
    """An adapter by id (= its fine-tune job id); another owner's answers NotFound, as if it did not exist."""
    row = session.get(Adapter, adapter_id)
    if row is None or (owner is not None and row.owner != owner):
        raise NotFound(f"no adapter {adapter_id!r}: list yours with `gpujobs adapters list`")
    return row


def list_for(session: Session, *, owner: str | None, limit: int = 100, after: str | None = None) -> list[Adapter]:
    """Newest first (ties by id, so a page ends at one place); `after`: an adapter id, those listed after it."""
    stmt = select(Adapter).order_by(Adapter.created_at.desc(), Adapter.id.desc()).limit(limit)
    if owner is not None:
        stmt = stmt.where(Adapter.owner == owner)
    if after:
        last = get(session, after, owner=owner)
        stmt = stmt.where(
            (Adapter.created_at < last.created_at) | ((Adapter.created_at == last.created_at) & (Adapter.id < last.id))
        )
    return list(session.scalars(stmt).all())


def view(row: Adapter) -> dict[str, Any]:
    return {
        "id": row.id,
        "job_id": row.job_id,
        "owner": row.owner,
        "base_model": row.base_model,
        "base_revision": row.base_revision,
        "tokenizer": row.tokenizer,
        "path": str(absolute(row)),
        "bytes": row.bytes,
        "sha256": row.sha256,
        "lora_config": row.lora_config,
        "load_options": row.load_options,
        "metrics": row.metrics,
        "created_at": row.created_at,
    }


def check_for_generation(
    session: Session,
    *,
    ref: str,
    owner: str,
    admin: bool,
    model: str,
    revision: str | None,
    notes: list[str] | None = None,
) -> bool:
    """Can a generation job of `owner` on `model` use adapter `ref`? True: yes, but its fine-tune is still running
    (the job must wait for it). Raises with what is wrong otherwise. A stored file (`file_…`) is checked by
    `check_file`, and its note appended to `notes` (for the job's events)."""
    if is_file_ref(ref):
        note = check_file(session, ref=ref, owner=owner, admin=admin, model=model)
        if notes is not None:
            notes.append(note)
        return False
    if HUB_ID.match(ref):
        return False  # a Hub LoRA repo: checked against the Hub or the workers' caches (api/service_models.py)
    if not ref.startswith("job_"):
        raise InvalidInput(
            f"adapter {ref!r}: name the fine-tune job that made it (job_…), an uploaded adapter "
            "file (file_…) or a Hub LoRA repo (org/name); list adapters with `gpujobs adapters list`"
        )
    job = session.get(Job, ref)
    if job is None or (not admin and job.owner != owner):
        raise NotFound(f"no adapter {ref!r}: list yours with `gpujobs adapters list`")
    if job.kind != "finetune":
        raise InvalidInput(f"adapter {ref!r} names a {job.kind} job, not a fine-tune")
    base, base_revision = job.spec.get("model"), job.spec.get("revision")
    if (base, base_revision) != (model, revision):
        raise InvalidInput(
            f"adapter {ref} was trained on {base!r}"
            + (f" (revision {base_revision})" if base_revision else "")
            + f", not on {model!r}: submit with --model {base}"
        )
    state = JobState(job.state)
    if not state.terminal:
        return True
    if state is not JobState.succeeded:
        raise Conflict(
            f"fine-tune {ref} is {job.state}"
            + (f" ({job.error})" if job.error else "")
            + ": it has no adapter. Retry it with `gpujobs retry`"
        )
    if session.get(Adapter, ref) is None:
        raise Conflict(f"fine-tune {ref} succeeded but registered no adapter: retry it with `gpujobs retry`")
    return False


# --- adapters from a stored file (`adapter: file_…`) ---------------------------------------------------------------
#
# A PEFT LoRA adapter directory (what `save_pretrained` writes) uploaded as one zip: its files at the zip's top level
# or under one folder. The API checks it at submit without torch (`check_archive`); the worker extracts the two files
# it loads, once per file id, to `adapters/<file id>/` (`extract_file`), so the resident-model key (the spec's
# `adapter`, a file id) and the folder name are the same immutable id. Other allowed files (a model card, tokenizer
# files that `save_pretrained` of a tokenizer adds) are ignored: the job uses its base model's tokenizer.
#
# The base model is matched by name, because a zip names its base the way its trainer saw it (a Hub id, a path on
# another host): equal strings, equal resolved paths, or equal last path components (case-insensitive:
# `Qwen/Qwen3-0.6B` matches `/models/Qwen3-0.6B`). A mismatch is refused at submit with both names; a config that
# names no base is accepted with an event saying so. The worker's PEFT load is the real check (shapes), and it fails
# the job with a clear message when the adapter does not fit.

ADAPTER_CONFIG = "adapter_config.json"
LORA_TYPES = ("LORA",)
IGNORED_FILES = frozenset(
    {
        "README.md",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
        "generation_config.json",
        ".gitattributes",
    }
)
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")  # PEFT inits that rewrite the base weights
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
MAX_ADAPTER_CONFIG_BYTES = 1 << 20
MAX_MEMBERS = 64
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit
HOW = "pack the directory that PEFT's save_pretrained wrote: `gpujobs submit generate --adapter DIR` does it"


def is_file_ref(ref: str | None) -> bool:
    return bool(ref) and ref.startswith("file_")


def get_file(session: Session, ref: str, *, owner: str | None) -> File:
    """The stored file an `adapter: file_…` names; another owner's answers NotFound, as for every file."""
    file = session.get(File, ref)
    if file is None or (owner is not None and file.owner != owner):
        raise NotFound(
            f"no file {ref!r}: upload the adapter directory with `gpujobs submit generate --adapter DIR` "
            "(or POST /files with its zip) and name the file id it gets"
        )
    return file


def check_archive(path: Path, ref: str) -> tuple[str, dict[str, Any]]:
    """Check a stored adapter zip without extracting it: returns (the folder prefix inside it, adapter_config).

    Refused, with what to do: not a zip, path traversal or links in member names, more than one folder, a file that
    is not part of an adapter, pickle weights, a missing or non-LoRA config, sizes beyond the upload limit."""
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise InvalidInput(f"adapter {ref} is not a zip archive ({exc}): {HOW}") from None
    with archive:
        members = [m for m in archive.infolist() if not m.is_dir()]
        prefix = _archive_root(archive.infolist(), ref)
        names = {m.filename[len(prefix) :]: m for m in members}
        if len(names) != len(members):
            raise InvalidInput(f"adapter {ref}: the archive holds a file name twice: {HOW}")
        _check_members(names, ref, total=sum(m.file_size for m in members))
        info = names[ADAPTER_CONFIG]
        if info.file_size > MAX_ADAPTER_CONFIG_BYTES:
            raise InvalidInput(f"adapter {ref}: {ADAPTER_CONFIG} is over {MAX_ADAPTER_CONFIG_BYTES} bytes: {HOW}")
        try:
            config = json.loads(archive.read(info))
        except (ValueError, zipfile.BadZipFile, OSError) as exc:
            raise InvalidInput(f"adapter {ref}: {ADAPTER_CONFIG} is not valid JSON ({exc}): {HOW}") from None
        if not isinstance(config, dict):
            raise InvalidInput(f"adapter {ref}: {ADAPTER_CONFIG} is not a JSON object: {HOW}")
        if str(config.get("peft_type", "")).upper() not in LORA_TYPES:
            raise InvalidInput(
                f"adapter {ref}: peft_type {config.get('peft_type')!r} is not a LoRA adapter "
                f"(peft_type {' or '.join(LORA_TYPES)}); only LoRA adapters can be loaded"
            )
        init = config.get("init_lora_weights")
        if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
            raise InvalidInput(
                f"adapter {ref}: init_lora_weights {init!r} changes the base model's weights, so the "
                "adapter does not apply to a plain base: convert it to a plain LoRA adapter first "
                "(PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...))"
            )
        _check_safetensors(archive, names[WEIGHTS], ref)
    return prefix, config


def _archive_root(infos: list, ref: str) -> str:
    """'' for files at the top level, 'dir/' for one folder holding them; traversal and links are refused."""
    folders = set()
    for info in infos:
        name = info.filename
        parts = name.rstrip("/").split("/")
        if (
            name.startswith("/")
            or "\\" in name
            or ":" in parts[0]
            or any(p in ("", ".", "..") for p in parts)
            or len(parts) > 2
        ):
            raise InvalidInput(
                f"adapter {ref}: the archive member {name!r} is not a plain file name of the "
                f"adapter directory (no '..', absolute paths or nested folders): {HOW}"
            )
        if stat.S_ISLNK(info.external_attr >> 16):
            raise InvalidInput(f"adapter {ref}: the archive member {name!r} is a symbolic link: {HOW}")
        if len(parts) == 2 or info.is_dir():
            folders.add(parts[0])
    top = sorted(i.filename for i in infos if "/" not in i.filename)
    if len(folders) > 1 or (folders and top):
        where = ", ".join(sorted(f"{f}/" for f in folders) + top[:3])
        raise InvalidInput(
            f"adapter {ref}: the archive holds more than one adapter directory ({where}); it must hold "
            f"the adapter's files at its top level or in one folder: {HOW}"
        )
    return f"{folders.pop()}/" if folders else ""


def _check_members(names: dict[str, Any], ref: str, *, total: int) -> None:
    pickled = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickled:
        raise InvalidInput(
            f"adapter {ref} holds pickle weights ({', '.join(pickled)}), which are refused: save the "
            "adapter with save_pretrained(..., safe_serialization=True) (adapter_model.safetensors)"
        )
    for required in (ADAPTER_CONFIG, WEIGHTS):
        if required not in names:
            raise InvalidInput(f"adapter {ref} has no {required}: {HOW}")
    unknown = sorted(set(names) - {ADAPTER_CONFIG, WEIGHTS} - IGNORED_FILES)
    if unknown:
        raise InvalidInput(
            f"adapter {ref} holds files that are not part of a LoRA adapter ({', '.join(unknown[:5])})"
            f": pack only {ADAPTER_CONFIG} and {WEIGHTS}, e.g. with `gpujobs submit generate --adapter "
            "DIR`"
        )
    limit = get_settings().max_upload_bytes
    if len(names) > MAX_MEMBERS or total > limit:
        raise InvalidInput(
            f"adapter {ref} unpacks to {total} bytes in {len(names)} files, over the limit of {limit} "
            f"bytes (JOBS_MAX_UPLOAD_BYTES) or {MAX_MEMBERS} files"
        )


def _check_safetensors(archive: Any, info: Any, ref: str) -> None:
    """The weights start with a safetensors header: a little-endian length, then a JSON object of tensors."""
    try:
        with archive.open(info) as stream:
            size = struct.unpack("<Q", stream.read(8))[0]
            header = json.loads(stream.read(size)) if 2 <= size <= MAX_SAFETENSORS_HEADER else None
    except (struct.error, ValueError, OSError) as exc:
        header = exc
    if not isinstance(header, dict) or not any(k != "__metadata__" for k in header):
        raise InvalidInput(
            f"adapter {ref}: {WEIGHTS} is not a safetensors file with tensors: save the adapter again "
            "with save_pretrained"
        )


def same_base(named: str, model: str) -> str | None:
    """How an adapter's `base_model_name_or_path` matches the job's model: 'name', 'path', or None (no match)."""
    if named == model:
        return "name"
    if named.startswith(("/", "~")) and Path(named).expanduser().resolve() == Path(model).expanduser().resolve():
        return "path"
    last = PurePosixPath(named.rstrip("/")).name.lower()
    return "name" if last and last == PurePosixPath(model.rstrip("/")).name.lower() else None


def check_file(session: Session, *, ref: str, owner: str, admin: bool, model: str) -> str:
    """Check an `adapter: file_…` at submit; returns a note for the job's events. Raises with what is wrong."""
    file = get_file(session, ref, owner=None if admin else owner)
    _, config = check_archive(files.absolute(file), ref)
    named = config.get("base_model_name_or_path")
    if named in (None, ""):
        return (
            f"adapter {ref} names no base model (base_model_name_or_path): not checked at submit; it must fit {model}"
        )
    if not isinstance(named, str) or same_base(named, model) is None:
        raise InvalidInput(
            f"adapter {ref} was trained on {named!r}, not on {model!r}: submit with --model set to "
            f"that base, or, if {model} is the same model under another name, set "
            f"base_model_name_or_path in {ADAPTER_CONFIG} to it and upload again"
        )
    return (
        f"adapter {ref}: LoRA r={config.get('r')} on base {named!r} (matched by {same_base(named, model)}; "
        f"{file.bytes} bytes, sha256 {file.sha256[:12]}…)"
    )


def file_dir(file_id: str) -> Path:
    return get_settings().artifacts / "adapters" / file_id


def extract_file(file: File) -> Path:
    """The extracted folder of an adapter file, made once per file id: checked again, its two adapter files written
    to a private temporary folder, then renamed into place (a reader never sees half; a racing worker's copy is
    dropped)."""
    dest = file_dir(file.id)
    if dest.is_dir():
        return dest
    source = files.absolute(file)
    prefix, _ = check_archive(source, file.id)
    tmp = dest.with_name(f".{file.id}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.mkdir(parents=True)
    try:
        with zipfile.ZipFile(source) as archive:
            for name in (ADAPTER_CONFIG, WEIGHTS):  # our names, never the archive's paths
                with archive.open(prefix + name) as src, open(tmp / name, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 20)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not dest.is_dir():
                raise
            log.info("adapter %s was extracted by another worker meanwhile", file.id)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
