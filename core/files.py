"""Stored files. Every input becomes a stored file before a job uses it, so a job never depends on a path that
may change or vanish, and a worker on any host reads it from the shared artifacts location.

Stored paths are built from our own ids (`files/<id>`), never from a user's file name: a name such as
`../../etc/passwd` is kept only as a label.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import BinaryIO

from sqlalchemy.orm import Session

from core.errors import Forbidden, InvalidInput, NotFound
from core.models import File
from core.settings import get_settings
from core.store import new_id, now

CHUNK = 1 << 20


def absolute(file: File) -> Path:
    return get_settings().artifacts / file.path


def save(session: Session, *, owner: str, filename: str, stream: BinaryIO, purpose: str = "input",
         job_id: str | None = None) -> File:
    settings = get_settings()
    file_id = new_id("file")
    rel = Path("files") / file_id
    dest = settings.artifacts / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest, size = hashlib.sha256(), 0
    tmp = dest.with_suffix(".part")
    with open(tmp, "wb") as out:
        while chunk := stream.read(CHUNK):
            size += len(chunk)
            if size > settings.max_upload_bytes:
                out.close()
                tmp.unlink()
                raise InvalidInput(
                    f"{filename!r} is larger than the upload limit of {settings.max_upload_bytes} bytes "
                    "(JOBS_MAX_UPLOAD_BYTES): split the dataset into several jobs"
                )
            digest.update(chunk)
            out.write(chunk)
    os.replace(tmp, dest)
    label = os.path.basename(filename.replace("\\", "/")) or "upload"
    file = File(id=file_id, owner=owner, filename=label[:255], purpose=purpose, path=str(rel), bytes=size,
                sha256=digest.hexdigest(), created_at=now(), job_id=job_id)
    session.add(file)
    return file


def get(session: Session, file_id: str, *, owner: str | None) -> File:
    file = session.get(File, file_id)
    if file is None or (owner is not None and file.owner != owner):
        raise NotFound(f"no file {file_id!r}: upload it with the job (`gpujobs submit --input FILE`)")
    return file


def check_server_path(path: str, roots: list[Path], *, what: str) -> Path:
    """Resolve a server-side path (following symlinks) and require it under one of `roots`.

    With no roots configured, any readable path is allowed only while the API listens on loopback (the embedded
    single-user default); beyond loopback roots are required.
    """
    settings = get_settings()
    real = Path(path).expanduser().resolve()
    if roots:
        if not any(real.is_relative_to(root) for root in roots):
            names = os.pathsep.join(str(r) for r in roots)
            raise Forbidden(f"{what} path {path!r} is outside the allowed roots ({names}): move it under one of them")
    elif not settings.is_loopback:
        raise Forbidden(f"server-side {what} paths are disabled: the API listens beyond loopback and no roots are set")
    if not real.exists():
        raise InvalidInput(f"{what} path {path!r} does not exist on the server")
    return real


def import_server_file(session: Session, *, owner: str, path: str) -> File:
    real = check_server_path(path, get_settings().data_roots, what="dataset")
    if not real.is_file():
        raise InvalidInput(f"dataset path {path!r} is not a regular file")
    with open(real, "rb") as stream:
        return save(session, owner=owner, filename=real.name, stream=stream)


def copy_to(file: File, dest: Path) -> None:
    shutil.copyfile(absolute(file), dest)
