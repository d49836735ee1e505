"""Stored files. Every input becomes a stored file before a job uses it, so a job never depends on a path that
may change or vanish, and a worker on any host reads it from the shared artifacts location.

Stored paths are built from our own ids (`files/<id>`), never from a user's file name: a name such as
`../../etc/passwd` is kept only as a label.
"""

from __future__ import annotations

import hashlib
import os
import unicodedata
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import event, or_, select
from sqlalchemy.orm import Session

from core.errors import Forbidden, InvalidInput, NoSuchPath, NotFound, TooLarge
from core.models import File, Job
from core.settings import get_settings
from core.states import JobState
from core.store import new_id, now

CHUNK = 1 << 20


def absolute(file: File) -> Path:
    return get_settings().artifacts / file.path


def save(
    session: Session, *, owner: str, filename: str, stream: BinaryIO, purpose: str = "input", job_id: str | None = None
) -> File:
    """Copy `stream` into the store as a new file of `owner`'s, recorded in `session`'s transaction.

    Nothing is left half-written: the copy goes to `<id>.part` and is renamed once whole; an upload over
    JOBS_MAX_UPLOAD_BYTES or any error removes the part file; and the stored copy is deleted again if the
    transaction that records it does not commit (a submit refused after its server-side input was copied in).
    """
    settings = get_settings()
    file_id = new_id("file")
    rel = Path("files") / file_id
    dest = settings.artifacts / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    label = _label(filename)
    tmp = dest.with_suffix(".part")
    try:
        digest, size = _copy(stream, tmp, label, settings.max_upload_bytes)
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _discard_unless_committed(session, dest)
    file = File(
        id=file_id,
        owner=owner,
        filename=label,
        purpose=purpose,
        path=str(rel),
        bytes=size,
        sha256=digest.hexdigest(),
        created_at=now(),
        job_id=job_id,
    )
    session.add(file)
    return file


def _copy(stream: BinaryIO, tmp: Path, label: str, limit: int):
    digest, size = hashlib.sha256(), 0
    with open(tmp, "wb") as out:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > limit:
                raise TooLarge(
                    f"{label!r} is larger than the upload limit of {limit} bytes "
                    "(JOBS_MAX_UPLOAD_BYTES): split the dataset into several jobs"
                )
            digest.update(chunk)
            out.write(chunk)
    return digest, size


def _label(filename: str) -> str:
    """The user's file name, kept only as a label: its last path component, without control characters."""
    base = os.path.basename((filename or "").replace("\\", "/"))
    base = "".join(ch for ch in base if unicodedata.category(ch)[0] != "C").strip()
    return base[:255] if base not in ("", ".", "..") else "upload"


def _discard_unless_committed(session: Session, path: Path) -> None:
    """Delete `path` when the session's current transaction ends without a commit (rollback or close)."""
    state = {"committed": False, "done": False}

    def committed(_session: Session) -> None:
        state["committed"] = True

    def ended(_session: Session, transaction) -> None:
        if transaction.parent is None and not state["done"]:
            state["done"] = True
            if not state["committed"]:
                path.unlink(missing_ok=True)

    event.listen(session, "after_commit", committed)
    event.listen(session, "after_transaction_end", ended)


def get(session: Session, file_id: str, *, owner: str | None) -> File:
    file = session.get(File, file_id)
    if file is None or (owner is not None and file.owner != owner):
        raise NotFound(f"no file {file_id!r}: upload it with the job (`gpujobs submit --input FILE`)")
    return file


def live_use(session: Session, file_id: str) -> tuple[Job, str] | None:
    """The oldest live (not ended) job that names the file, and what the file is to it: its `input` (a fine-tune's
    training data; a then_generate input is its chained job's input), its `adapter` (read by the worker when the
    job runs) or its `validation_input`. None when no live job names it, so it may be deleted."""
    live = [s.value for s in JobState if not s.terminal]
    names = or_(
        Job.input_file_id == file_id,
        Job.spec["adapter"].as_string() == file_id,
        Job.spec["validation_input"].as_string() == file_id,
    )
    stmt = select(Job).where(Job.state.in_(live), names).order_by(Job.created_at, Job.id).limit(1)
    job = session.scalar(stmt)
    if job is None:
        return None
    named = {"input": job.input_file_id, **{k: (job.spec or {}).get(k) for k in ("adapter", "validation_input")}}
    return job, next(role for role, ref in named.items() if ref == file_id)


def resolve(path: str, *, what: str) -> Path:
    """`~user` expanded and symlinks followed; an unknown user or a bad path is the caller's error, not ours."""
    try:
        return Path(path).expanduser().resolve()
    except (OSError, RuntimeError, ValueError) as exc:
        raise InvalidInput(f"{what} path {path!r} cannot be resolved ({exc}): give an absolute path") from None


def check_server_path(path: str, roots: list[Path], *, what: str) -> Path:
    """Resolve a server-side path (following symlinks) and require it under one of `roots`.

    With no roots configured, any readable path is allowed only while the API listens on loopback (the embedded
    single-user default); beyond loopback roots are required.
    """
    settings = get_settings()
    real = resolve(path, what=what)
    if roots:
        if not any(real.is_relative_to(root) for root in roots):
            names = os.pathsep.join(str(r) for r in roots)
            raise Forbidden(f"{what} path {path!r} is outside the allowed roots ({names}): move it under one of them")
    elif not settings.is_loopback:
        setting, instead = {
            "model": ("JOBS_MODEL_ROOTS", "name a Hub model id instead"),
            "dataset": ("JOBS_DATA_ROOTS", "upload the dataset instead (`gpujobs submit … --input LOCAL_FILE` does)"),
        }.get(what, ("JOBS_MODEL_ROOTS and JOBS_DATA_ROOTS", "upload it instead"))
        raise Forbidden(
            f"server-side {what} paths are disabled: the API listens beyond loopback (JOBS_API_HOST="
            f"{settings.api_host}) and {setting} is not set: the operator sets it on the API host, with the same "
            f"paths on every worker host (docs/cluster.md); or {instead}"
        )
    if not real.exists():
        looked = f"looked for {real}" + (f"; the allowed roots: {os.pathsep.join(map(str, roots))}" if roots else "")
        raise NoSuchPath(
            f"{what} path {path!r} does not exist on the API's host ({looked}): give a path that exists there, "
            "or upload the file and give its id"
        )
    return real


def import_server_file(session: Session, *, owner: str, path: str) -> File:
    real = server_dataset(path)
    with open(real, "rb") as stream:
        return save(session, owner=owner, filename=real.name, stream=stream)


def server_dataset(path: str) -> Path:
    """A server-side dataset path a job may read: under JOBS_DATA_ROOTS (see `check_server_path`), a regular file."""
    real = check_server_path(path, get_settings().data_roots, what="dataset")
    if not real.is_file():
        raise InvalidInput(f"dataset path {path!r} is not a regular file")
    return real


def source(session: Session, ref: str, *, owner: str) -> tuple[Path, str, File | None]:
    """Where a job's dataset `ref` is read from, storing nothing: the owner's stored file (its path, its name and
    the file), or an allowed server path (checked as `import_server_file` checks it, with the name it would be
    stored under, and None)."""
    if ref.startswith("file_"):
        file = get(session, ref, owner=owner)
        return absolute(file), file.filename, file
    real = server_dataset(ref)
    return real, _label(real.name), None


def stored(session: Session, ref: str, *, owner: str) -> File:
    """The stored file a job reads: the owner's file id, or a server path copied into the store in `session`'s
    transaction (deleted again if it does not commit)."""
    if ref.startswith("file_"):
        return get(session, ref, owner=owner)
    return import_server_file(session, owner=owner, path=ref)
