"""Models by Hub id, on disk: the cache, its locks and our markers, verification against each blob's hash, a
snapshot found again without the Hub (`from_cache`), what a cache holds (`scan`, `record`) and removing from it
(`remove`). No torch, no network: core/hub_download.py fetches into it.

The cache is Hugging Face's own layout, so a cache filled by `hf download` / `snapshot_download` is used as it is,
and `hf cache scan` / `hf cache delete` see what we fetched:

    <cache>/models--org--name/blobs/<etag>                 a file's bytes, named by their hash: the sha256 of an LFS
                                                            file, the git blob id (sha1) of any other
    <cache>/models--org--name/snapshots/<commit>/<file>    a relative symlink to its blob
    <cache>/models--org--name/refs/<branch or tag>         the commit it named when last resolved
    <cache>/.locks/models--org--name/<etag>.lock           huggingface_hub's lock of one blob (we take the same one)
    <cache>/.locks/models--org--name/gpujobs-<commit>.lock ours: one process per host fetches a snapshot at a time
    <cache>/models--org--name/.gpujobs/<commit>.json       ours: the files a load reads, verified (size, mtime)

Decision (docs/design.md "Models by Hub id"):

- Nothing half-written is ever loaded: a snapshot is used only once every file a load needs is there and its content
  matches its hash; the marker records what was verified, and a file whose size or mtime changed since is hashed
  again (a corrupt or truncated one is fetched again, or refused offline).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from core.errors import FetchInterrupted, InvalidInput
from core.hub import (
    COMMIT,
    INDEX,
    REF,
    Fetched,
    Listener,
    RepoFile,
    Snapshot,
    describe,
    host,
    kind_of,
    repo_dir,
    select,
    small_json,
)
from core.settings import get_settings

log = logging.getLogger(__name__)

CHUNK = 1 << 20


# --- locks ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def file_lock(path: Path, should_stop: Callable[[], bool], on_busy: Callable[[], None] | None = None) -> Iterator[None]:
    """An exclusive file lock (flock: released by the kernel if the holder dies), waited for while checking
    `should_stop`."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path))
    told = False
    while True:
        try:
            lock.acquire(timeout=0.5)
            break
        except Timeout:
            if should_stop():
                raise FetchInterrupted(f"stopped while waiting for {path.name}") from None
            if on_busy and not told:
                on_busy()
                told = True
    try:
        yield
    finally:
        lock.release()


def snapshot_lock(snap: Snapshot, listener: Listener, should_stop: Callable[[], bool]):
    root = repo_dir(snap.repo)
    return file_lock(
        root.parent / ".locks" / root.name / f"gpujobs-{snap.commit}.lock",
        should_stop,
        on_busy=lambda: listener.waiting(snap),
    )


# --- the cache: links, refs, markers, verification --------------------------------------------------------------


def content_ok(path: Path, etag: str) -> bool:
    """Does the file's content match its etag: sha256 for 64 hex digits, the git blob id (sha1 of `blob <size>\\0`
    and the bytes) for 40. Another form (a mirror's own etag) cannot be checked and passes."""
    if len(etag) == 64:
        digest = hashlib.sha256()
    elif len(etag) == 40:
        digest = hashlib.sha1(usedforsecurity=False)
        digest.update(f"blob {path.stat().st_size}\0".encode())
    else:
        return True
    with open(path, "rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest() == etag


def vouched_files(repo: str, commit: str) -> set[str]:
    """Files of the marker whose blob has not changed since it was verified (no need to hash them again)."""
    data, root = marker(repo, commit), repo_dir(repo)
    found = set()
    for name, entry in (data or {}).get("files", {}).items():
        try:
            st = (root / "blobs" / str(entry.get("etag"))).stat()
        except OSError:
            continue
        if st.st_size == entry.get("size") and st.st_mtime_ns == entry.get("mtime_ns"):
            found.add(name)
    return found


def drop_if_corrupt(root: Path, f: RepoFile) -> None:
    blob = root / "blobs" / f.etag
    if not blob.is_file():
        return
    if (f.size is None or blob.stat().st_size == f.size) and content_ok(blob, f.etag):
        return
    log.warning("%s: %s in the cache does not match its hash %s: fetching it again", root.name, f.name, f.etag)
    blob.unlink(missing_ok=True)


def link_blob(root: Path, commit: str, f: RepoFile) -> None:
    """snapshots/<commit>/<file> -> ../../blobs/<etag>, replaced atomically if it points elsewhere."""
    pointer = root / "snapshots" / commit / f.name
    target = os.path.relpath(root / "blobs" / f.etag, pointer.parent)
    if pointer.is_symlink() and os.readlink(pointer) == target:
        return
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{uuid.uuid4().hex[:8]}.tmp")
    os.symlink(target, tmp)
    os.replace(tmp, pointer)


def write_ref(repo: str, revision: str, commit: str) -> None:
    """refs/<revision> = commit, where a branch or tag was resolved elsewhere (the API) to a snapshot fetched here."""
    root = repo_dir(repo)
    if (root / "snapshots" / commit).is_dir():
        set_ref(root, revision, commit)


def set_ref(root: Path, revision: str, commit: str) -> None:
    if COMMIT.match(revision) or revision == commit or not REF.match(revision):
        return
    ref = root / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if ref.is_file() and ref.read_text().strip() == commit:
        return
    _atomic_write(ref, commit)


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _marker_path(root: Path, commit: str) -> Path:
    return root / ".gpujobs" / f"{commit}.json"


def write_marker(root: Path, snap: Snapshot) -> None:
    files = {}
    for f in snap.files:
        st = (root / "blobs" / f.etag).stat()
        files[f.name] = {"etag": f.etag, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    _atomic_write(
        _marker_path(root, snap.commit),
        json.dumps(
            {"repo": snap.repo, "commit": snap.commit, "kind": snap.kind, "files": files, "verified_at": time.time()}
        ),
    )


def marker(repo: str, commit: str) -> dict[str, Any] | None:
    try:
        data = json.loads(_marker_path(repo_dir(repo), commit).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else None


def marker_ok(repo: str, commit: str, kind: str, files: list[RepoFile] | None = None) -> bool:
    """The marker names exactly these files (when given), and each still links to its blob with the size and mtime
    it had when verified: then nothing needs hashing."""
    data = marker(repo, commit)
    if data is None or kind not in ("auto", data.get("kind")):
        return False
    listed = data["files"]
    if files is not None and {f.name: f.etag for f in files} != {k: v.get("etag") for k, v in listed.items()}:
        return False
    root = repo_dir(repo)
    for name, entry in listed.items():
        blob = root / "blobs" / str(entry.get("etag"))
        pointer = root / "snapshots" / commit / name
        try:
            st = blob.stat()
        except OSError:
            return False
        if (
            not pointer.is_symlink()
            or os.readlink(pointer) != os.path.relpath(blob, pointer.parent)
            or st.st_size != entry.get("size")
            or st.st_mtime_ns != entry.get("mtime_ns")
        ):
            return False
    return True


def from_marker(repo: str, revision: str, commit: str, kind: str) -> Fetched:
    data = marker(repo, commit) or {"files": {}}
    kind = data.get("kind", kind)
    return Fetched(
        repo,
        revision,
        commit,
        kind,
        repo_dir(repo) / "snapshots" / commit,
        len(data["files"]),
        sum(int(v.get("size") or 0) for v in data["files"].values()),
    )


def cached_commit(repo: str, revision: str | None, cache: Path | None = None) -> str | None:
    """The commit `revision` names in a cache: itself if it is one with a snapshot, else refs/<revision>."""
    rev = revision or "main"
    root = repo_dir(repo, cache)
    if COMMIT.match(rev):
        return rev if (root / "snapshots" / rev).is_dir() else None
    try:
        commit = (root / "refs" / rev).read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.match(commit) and (root / "snapshots" / commit).is_dir() else None


def local_files(repo: str, commit: str, cache: Path | None = None) -> list[RepoFile]:
    """The files of a cached snapshot, each with the blob it links to (its etag) and that blob's size."""
    snapshot = repo_dir(repo, cache) / "snapshots" / commit
    found = []
    for pointer in sorted(snapshot.iterdir()) if snapshot.is_dir() else []:
        if pointer.name.startswith(".") or not pointer.is_file():
            continue
        etag = Path(os.readlink(pointer)).name if pointer.is_symlink() else ""
        found.append(RepoFile(pointer.name, pointer.stat().st_size, etag))
    return found


def from_cache(repo: str, revision: str | None, *, kind: str = "model", why: str) -> Fetched:
    """The snapshot from this host's cache alone (offline, or the Hub unreachable): its files are selected as for a
    download and each is verified against its blob's name; refused, saying `why` there is no other way, when it is
    not there or not whole."""
    rev = revision or "main"
    where = f"in the Hugging Face cache of host {host()} ({get_settings().hub_cache})"
    commit = cached_commit(repo, rev)
    if commit is None:
        raise InvalidInput(f"{describe(repo, rev)} is not {where}, and {why}")
    if marker_ok(repo, commit, kind):
        return from_marker(repo, rev, commit, kind)
    snapshot = repo_dir(repo) / "snapshots" / commit
    kind = kind_of(local_files(repo, commit), kind)
    try:
        chosen = select(
            local_files(repo, commit),
            kind=kind,
            repo=repo,
            revision=rev,
            read_index=lambda f: small_json(snapshot / f.name, what=f"{INDEX} of {describe(repo, rev)}"),
        )
    except InvalidInput as exc:
        raise InvalidInput(f"{describe(repo, rev)} is not complete {where} ({exc}), and {why}") from None
    bad = [f.name for f in chosen if not f.etag or not content_ok(snapshot / f.name, f.etag)]
    if bad:
        raise InvalidInput(
            f"{', '.join(bad)} of {describe(repo, rev)} {where} is corrupted (its content does not "
            f"match its hash), and {why}"
        )
    snap = Snapshot(repo, commit, rev, kind, chosen)
    write_marker(repo_dir(repo), snap)
    return Fetched(repo, rev, commit, kind, snapshot, len(chosen), snap.bytes)


# --- what a cache holds, and removing from it -----------------------------------------------------------------


def scan(cache: Path | None = None) -> list[dict[str, Any]]:
    """Every snapshot in a cache: repo, commit, the refs naming it, files, bytes on disk, and its state: `ready`
    (every file a load reads is there: verified by us, or whole-looking from another tool) or `partial`."""
    cache = cache or get_settings().hub_cache
    found = []
    for root in sorted(cache.glob("models--*")) if cache.is_dir() else []:
        repo = root.name[len("models--") :].replace("--", "/")
        refs = _refs(root)
        for snapshot in sorted((root / "snapshots").iterdir()) if (root / "snapshots").is_dir() else []:
            if snapshot.is_dir() and COMMIT.match(snapshot.name):
                found.append(_snapshot_record(repo, root, snapshot, refs.get(snapshot.name, [])))
    return found


def record(repo: str, commit: str) -> dict[str, Any] | None:
    """scan()'s record of one snapshot of this host's cache, or None if it is not there."""
    root = repo_dir(repo)
    snapshot = root / "snapshots" / commit
    return _snapshot_record(repo, root, snapshot, _refs(root).get(commit, [])) if snapshot.is_dir() else None


def _refs(root: Path) -> dict[str, list[str]]:
    refs: dict[str, list[str]] = {}
    for ref in (root / "refs").rglob("*") if (root / "refs").is_dir() else []:
        # `.name.<hex>.tmp`: another process's ref being written (_atomic_write), or left by a crash; a ref never
        # starts with a dot (REF)
        if ref.is_file() and not ref.name.startswith("."):
            try:
                refs.setdefault(ref.read_text().strip(), []).append(ref.relative_to(root / "refs").as_posix())
            except OSError:
                continue
    return refs


def _snapshot_record(repo: str, root: Path, snapshot: Path, refs: list[str]) -> dict[str, Any]:
    files = local_files(repo, snapshot.name, root.parent)
    kind = kind_of(files)
    try:
        select(
            files,
            kind=kind,
            repo=repo,
            revision=snapshot.name,
            read_index=lambda f: small_json(snapshot / f.name, what=INDEX),
        )
        state = "ready"
    except InvalidInput:
        state = "partial"
    blobs = {(root / "blobs" / f.etag) if f.etag else snapshot / f.name for f in files}
    sizes = [b.stat() for b in blobs if b.exists()]
    return {
        "repo": repo,
        "commit": snapshot.name,
        "kind": kind,
        "refs": sorted(refs),
        "files": len(files),
        "bytes": sum(s.st_size for s in sizes),
        "state": state,
        "verified": marker(repo, snapshot.name) is not None and marker_ok(repo, snapshot.name, kind)
        if root.parent == get_settings().hub_cache
        else None,
        "modified_at": max((s.st_mtime for s in sizes), default=snapshot.stat().st_mtime),
    }


def remove(
    repo: str, commits: list[str] | None = None, *, should_stop: Callable[[], bool] = lambda: False
) -> dict[str, Any]:
    """Delete snapshots of `repo` (every one when `commits` is None) from this host's cache: their links, the refs
    naming them, our markers and every blob no remaining snapshot uses; the repo's folder once none is left. Each
    snapshot's fetch lock is held while it goes, so no fetch of it runs meanwhile."""
    root = repo_dir(repo)
    present = [p.name for p in (root / "snapshots").iterdir()] if (root / "snapshots").is_dir() else []
    targets = [c for c in present if commits is None or c in commits]
    freed = 0
    for commit in targets:
        snap = Snapshot(repo, commit, commit, "model", [])
        with snapshot_lock(snap, Listener(), should_stop):
            shutil.rmtree(root / "snapshots" / commit, ignore_errors=True)
            _marker_path(root, commit).unlink(missing_ok=True)
            for ref, named in _refs(root).items():
                if ref == commit:
                    for name in named:
                        (root / "refs" / name).unlink(missing_ok=True)
    kept = (
        {Path(os.readlink(p)).name for p in (root / "snapshots").rglob("*") if p.is_symlink()}
        if (root / "snapshots").is_dir()
        else set()
    )
    for blob in (root / "blobs").iterdir() if (root / "blobs").is_dir() else []:
        if blob.name not in kept and not blob.name.endswith(".incomplete"):
            freed += blob.stat().st_size
            blob.unlink(missing_ok=True)
    if root.is_dir() and not any((root / "snapshots").iterdir() if (root / "snapshots").is_dir() else []):
        shutil.rmtree(root, ignore_errors=True)
    return {"repo": repo, "removed": targets, "freed_bytes": freed}
