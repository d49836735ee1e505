"""Models by Hub id, fetched: `ensure` makes a snapshot present and verified in this host's cache, from the Hub
(`plan` resolves the revision and picks the files with core/hub.py's `select`) or, offline or with the Hub
unreachable, from the cache alone (core/hub_cache.py). `submit_files` fetches the API's few small files. No torch.

Decisions (docs/design.md "Models by Hub id"):

- Resumable downloads are ours, over HTTP with huggingface_hub's endpoints (`/api/models/{repo}/revision/{rev}`,
  `/{repo}/resolve/{commit}/{file}`): huggingface_hub 2.x writes each download to a process-unique temporary file
  that it deletes when the download fails, so a job's retry would start again from byte 0. We write
  `blobs/<etag>.incomplete` under huggingface_hub's own per-blob lock file, ask for the rest with a Range request,
  and rename it into place only once its hash matches the blob's name.
- The files of one snapshot are fetched JOBS_HUB_PARALLEL_FILES at a time (default 8, as huggingface_hub's
  snapshot_download), largest first, each resumable on its own; the first file that fails fails the snapshot with
  its own error, the others stop at their next chunk and keep their parts. Measured against `hf_hub_download` on one
  large file in ops/bench/hub_download.py (ops/bench/README.md).
- Xet-backed repos (checked against huggingface_hub 2.4 and hf-xet 1.8, pinned in constraints.txt): the file list
  still gives each file's sha256 (its LFS oid) and size, and `/resolve/` still redirects to the bytes over plain
  HTTP (the Hub's LFS bridge for Xet storage), so they are fetched and checked like any LFS file. hf_xet, even
  installed, is never called here: we read no `X-Xet-Hash` header, so we get none of its chunk deduplication or its
  parallel reconstruction of one file (`hf_hub_download` uses it when the header is there). A cache filled by
  `hf download` with hf_xet is used as it is: its blobs carry the same names, some as symlinks into
  huggingface_hub's shared blob store, which every check here follows. Not tested against the real Hub (no network
  here): whether the bridge honours Range; a 200 to a Range request restarts the part from byte 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any
from urllib.parse import quote

from core.errors import ChecksumMismatch, FetchInterrupted, HubUnreachable, InvalidInput
from core.hub import (
    ADAPTER_CONFIG,
    COMMIT,
    INDEX,
    MAX_SMALL_FILE,
    RETRIES,
    SUBMIT_FILES,
    Fetched,
    Listener,
    RepoFile,
    Snapshot,
    describe,
    endpoint,
    host,
    http_client,
    human_bytes,
    kind_of,
    listing,
    refusal,
    repo_dir,
    select,
    short,
    small_json,
    unreachable,
)
from core.hub_cache import (
    content_ok,
    drop_if_corrupt,
    file_lock,
    from_cache,
    from_marker,
    link_blob,
    marker_ok,
    set_ref,
    snapshot_lock,
    vouched_files,
    write_marker,
)
from core.settings import get_settings

log = logging.getLogger(__name__)


# --- which files of which commit: resolved on the Hub ---------------------------------------------------------


def plan(repo: str, revision: str | None, *, kind: str = "model", client=None, retries: int = RETRIES) -> Snapshot:
    """The snapshot a load of `repo` at `revision` reads, resolved on the Hub (the index, if any, is fetched)."""
    commit, files, gated = listing(repo, revision, retries=retries)
    rev = revision or "main"

    def read_index(f: RepoFile) -> Any:
        path = _fetch_file(Snapshot(repo, commit, rev, kind, [f]), f, client=client)
        return small_json(path, what=f"{INDEX} of {describe(repo, rev)}")

    kind = kind_of(files, kind)
    return Snapshot(
        repo, commit, rev, kind, select(files, kind=kind, repo=repo, revision=rev, read_index=read_index), gated=gated
    )


# --- fetching -----------------------------------------------------------------------------------------------


def ensure(
    repo: str,
    revision: str | None,
    *,
    kind: str = "model",
    listener: Listener | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> Fetched:
    """The snapshot of `repo` at `revision` in this host's cache, fetched if needed, verified.

    A commit whose marker still matches needs no request at all. Offline (HF_HUB_OFFLINE) only the cache is used.
    When the Hub cannot be reached, a complete cached snapshot of the revision is used, with a note saying so."""
    listener = listener or Listener()
    rev = revision or "main"
    if COMMIT.match(rev) and marker_ok(repo, rev, kind):
        return from_marker(repo, rev, rev, kind)
    settings = get_settings()
    if settings.hub_offline:
        return from_cache(
            repo,
            rev,
            kind=kind,
            why=f"this host is offline (HF_HUB_OFFLINE=1): pull it on a host "
            f"with network access into this cache ({settings.hub_cache}), e.g. `gpujobs models pull "
            f"{repo}`, or unset HF_HUB_OFFLINE",
        )
    try:
        snap = plan(repo, rev, kind=kind)
    except HubUnreachable as exc:
        try:
            fetched = from_cache(repo, rev, kind=kind, why=str(exc))
        except InvalidInput:
            raise exc from None
        fetched.notes.append(
            f"the Hub cannot be reached ({exc}); using the cached {describe(repo, rev)} = commit {fetched.commit}"
        )
        return fetched
    return fetch(snap, listener=listener, should_stop=should_stop)


def fetch(
    snap: Snapshot,
    *,
    listener: Listener | None = None,
    should_stop: Callable[[], bool] | None = None,
    complete: bool = True,
) -> Fetched:
    """Make every file of `snap` present and verified in this host's cache, one process per host at a time.

    `complete` (a whole load's files) writes the marker; the API fetches a few small files with complete=False."""
    listener, stop = listener or Listener(), should_stop or (lambda: False)
    root = repo_dir(snap.repo)
    # a few small files (the API's submit checks) need only the blob locks: never wait behind a worker's download
    with snapshot_lock(snap, listener, stop) if complete else contextlib.nullcontext():
        if complete and marker_ok(snap.repo, snap.commit, snap.kind, snap.files):
            set_ref(root, snap.revision, snap.commit)
            return from_marker(snap.repo, snap.revision, snap.commit, snap.kind)
        vouched = vouched_files(snap.repo, snap.commit)
        for f in snap.files:  # what is there must be whole and right; a bad blob goes, and is fetched below
            if f.name not in vouched:
                drop_if_corrupt(root, f)
        missing = [f for f in snap.files if not (root / "blobs" / f.etag).is_file()]
        t0, downloaded = time.monotonic(), 0
        if missing:
            downloaded = _download_all(snap, missing, listener, stop)
        for f in snap.files:
            link_blob(root, snap.commit, f)
        set_ref(root, snap.revision, snap.commit)
        if complete:
            write_marker(root, snap)
        seconds = time.monotonic() - t0
        if missing:
            listener.finished(snap, downloaded=downloaded, seconds=seconds)
    return Fetched(
        snap.repo,
        snap.revision,
        snap.commit,
        snap.kind,
        root / "snapshots" / snap.commit,
        len(snap.files),
        snap.bytes,
        downloaded,
        round(seconds, 3),
    )


def _download_all(snap: Snapshot, missing: list[RepoFile], listener: Listener, stop: Callable[[], bool]) -> int:
    """Fetch the `missing` files, up to JOBS_HUB_PARALLEL_FILES at once (the largest first, so the last to finish
    are small), through one HTTP client. The first file that fails fails the snapshot with its own error (which
    names the file); the others stop at their next chunk, keeping their parts for the next fetch, and files not
    started yet are not started."""
    root = repo_dir(snap.repo)
    total = sum(f.size or 0 for f in missing)
    parts = {f.etag: _part_size(root, f) for f in missing}
    _check_disk(snap, total - sum(parts.values()))
    counting = threading.Lock()
    done = [sum(parts.values())]
    listener.started(snap, files=len(missing), total=total, done=done[0])
    failed = threading.Event()  # a file failed (or a stop was seen): the others stop at their next chunk
    errors: list[BaseException] = []  # the first is the snapshot's error; the siblings' stops come after it

    def on_bytes(n: int) -> None:
        with counting:  # several threads add up; the listener sees each total once, in order
            done[0] += n
            listener.progress(done[0], total)

    def fetch_one(f: RepoFile) -> None:
        if failed.is_set():
            return  # not started once another file failed
        try:
            _fetch_file(snap, f, client=client, on_bytes=on_bytes, should_stop=lambda: failed.is_set() or stop())
        except BaseException as exc:  # noqa: BLE001  raised below, in the caller's thread
            with counting:
                errors.append(exc)
                failed.set()

    order = sorted(missing, key=lambda f: f.size or 0, reverse=True)
    width = min(get_settings().hub_parallel_files, len(order))
    with http_client(connections=width) as client, ThreadPoolExecutor(width, thread_name_prefix="hub-fetch") as pool:
        try:
            wait([pool.submit(fetch_one, f) for f in order])
        except BaseException:  # interrupted while waiting (Ctrl-C in `gpujobs models pull`): stop the downloads
            failed.set()
            raise
    if errors:
        raise errors[0]
    return total - sum(parts.values())


def _fetch_file(
    snap: Snapshot,
    f: RepoFile,
    *,
    client=None,
    on_bytes: Callable[[int], None] = lambda n: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> Path:
    """One blob, downloaded (resumed from its .incomplete part) and verified under huggingface_hub's blob lock."""
    root = repo_dir(snap.repo)
    blob = root / "blobs" / f.etag
    with contextlib.ExitStack() as stack:
        stack.enter_context(file_lock(root.parent / ".locks" / root.name / f"{f.etag}.lock", should_stop))
        if blob.is_file() and content_ok(blob, f.etag):
            return blob
        client = client or stack.enter_context(http_client())
        blob.parent.mkdir(parents=True, exist_ok=True)
        part = blob.with_name(blob.name + ".incomplete")
        url = (
            f"{get_settings().hub_endpoint}/{snap.repo}/resolve/{quote(snap.commit, safe='')}/{quote(f.name, safe='/')}"
        )
        for attempt in (1, 2):  # a file whose bytes do not match its hash is fetched again once
            _stream(client, url, part, f, snap, on_bytes, should_stop)
            if content_ok(part, f.etag):
                os.replace(part, blob)
                return blob
            part.unlink(missing_ok=True)
            log.warning(
                "%s: %s of %s@%s did not match its hash: %s",
                snap.repo,
                f.name,
                snap.repo,
                short(snap.commit),
                "fetching it again" if attempt == 1 else "giving up",
            )
        raise ChecksumMismatch(
            f"{f.name} of {snap.repo}@{snap.commit} from {endpoint()} does not match its hash "
            f"{f.etag} twice in a row: the endpoint (HF_ENDPOINT) serves corrupted bytes"
        )
    raise AssertionError("unreachable")


def _stream(
    client,
    url: str,
    part: Path,
    f: RepoFile,
    snap: Snapshot,
    on_bytes: Callable[[int], None],
    should_stop: Callable[[], bool],
) -> None:
    """Append the rest of `f` to `part` (a Range request from its size), retrying transport errors, each time from
    where the bytes stopped."""
    import httpx

    failures = 0
    while True:
        offset = part.stat().st_size if part.exists() else 0
        if f.size is not None and offset > f.size:
            part.unlink()
            offset = 0
        if f.size is not None and offset == f.size:
            return
        received = 0
        try:
            with client.stream("GET", url, headers={"range": f"bytes={offset}-"} if offset else {}) as response:
                if response.status_code >= 500:
                    raise httpx.RemoteProtocolError(f"the server answered {response.status_code}")
                if response.status_code >= 400:
                    response.read()
                    raise refusal(response.status_code, response.headers, snap.repo, snap.commit, f.name)
                resumed = offset and response.status_code == 206
                with open(part, "ab" if resumed else "wb") as out:
                    if offset and not resumed:
                        on_bytes(-offset)  # the server ignored the Range: those bytes come again
                    for chunk in response.iter_bytes():  # as the bytes arrive: progress and resume see them
                        if should_stop():
                            raise FetchInterrupted(
                                f"fetch of {snap.repo} stopped (the job was cancelled or the "
                                "worker is stopping); the part already downloaded is kept for the "
                                "next attempt"
                            )
                        out.write(chunk)
                        received += len(chunk)
                        on_bytes(len(chunk))
            if f.size is None or part.stat().st_size == f.size:
                return
            raise httpx.RemoteProtocolError(f"the body ended after {part.stat().st_size} of {f.size} bytes")
        except httpx.TransportError as exc:
            if should_stop():
                raise FetchInterrupted(
                    f"fetch of {snap.repo} stopped (the job was cancelled or the worker is stopping)"
                ) from None
            failures = 0 if received else failures + 1  # bytes flowed: the endpoint is there, keep going
            if failures > RETRIES:
                raise unreachable(exc, f"{f.name} of {describe(snap.repo, snap.commit)}") from None
            log.warning(
                "%s: %s interrupted after %d bytes (%s): resuming",
                snap.repo,
                f.name,
                part.stat().st_size if part.exists() else 0,
                exc,
            )
            time.sleep(min(2 ** max(failures - 1, 0), 8))


def _part_size(root: Path, f: RepoFile) -> int:
    part = root / "blobs" / f"{f.etag}.incomplete"
    size = part.stat().st_size if part.exists() else 0
    return size if f.size is None or size <= f.size else 0


def _check_disk(snap: Snapshot, needed: int) -> None:
    settings = get_settings()
    settings.hub_cache.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(settings.hub_cache).free
    if free - needed < settings.hub_min_free_bytes:
        raise InvalidInput(
            f"not enough disk space for {snap.repo}@{short(snap.commit)} on host {host()}: {human_bytes(needed)} to "
            f"download into {settings.hub_cache}, {human_bytes(free)} free, and "
            f"{human_bytes(settings.hub_min_free_bytes)} must stay free (JOBS_HUB_MIN_FREE_BYTES): remove models no "
            "job needs (`gpujobs models list`, `gpujobs models rm`), or point HF_HUB_CACHE at a larger disk"
        )


# --- the API's submit checks: a few small files, read without torch ---------------------------------------------


def submit_files(snap: Snapshot) -> Path:
    """Config, tokenizer and chat template of `snap` in this host's cache (fetched if missing), for the submit
    checks; the weights are left to the workers."""
    small = [f for f in snap.files if f.name in SUBMIT_FILES or f.name == ADAPTER_CONFIG]
    too_big = [f.name for f in small if (f.size or 0) > MAX_SMALL_FILE]
    if too_big:
        raise InvalidInput(
            f"{', '.join(too_big)} of {snap.repo} is over {human_bytes(MAX_SMALL_FILE)}: not a config "
            "or tokenizer file this server reads"
        )
    return fetch(Snapshot(snap.repo, snap.commit, snap.revision, snap.kind, small), complete=False).path
