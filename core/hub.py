"""Models by Hub id: resolve a revision to a commit, pick the files a load needs, fetch them once per host into the
standard Hugging Face cache, verify them, and find them again offline. No torch: the API (submit checks), the CLI
(`gpujobs models pull` on this host) and the workers all use it.

The cache is Hugging Face's own layout, so a cache filled by `hf download` / `snapshot_download` is used as it is,
and `hf cache scan` / `hf cache delete` see what we fetched:

    <cache>/models--org--name/blobs/<etag>                 a file's bytes, named by their hash: the sha256 of an LFS
                                                            file, the git blob id (sha1) of any other
    <cache>/models--org--name/snapshots/<commit>/<file>    a relative symlink to its blob
    <cache>/models--org--name/refs/<branch or tag>         the commit it named when last resolved
    <cache>/.locks/models--org--name/<etag>.lock           huggingface_hub's lock of one blob (we take the same one)
    <cache>/.locks/models--org--name/gpujobs-<commit>.lock ours: one process per host fetches a snapshot at a time
    <cache>/models--org--name/.gpujobs/<commit>.json       ours: the files a load reads, verified (size, mtime)

Decisions (docs/design.md "Models by Hub id"):

- Only what a load reads is fetched: config, generation config, tokenizer files, chat template and the safetensors
  weights (the shards the index names, never a second copy such as consolidated.safetensors); an adapter repo's
  adapter_config.json and adapter_model.safetensors. A repo whose weights are only pickled is refused.
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
- Nothing half-written is ever loaded: a snapshot is used only once every file a load needs is there and its content
  matches its hash; the marker records what was verified, and a file whose size or mtime changed since is hashed
  again (a corrupt or truncated one is fetched again, or refused offline).
- The token (HF_TOKEN, or the token file) is read when a request is made and sent only to the endpoint (httpx
  drops it on a redirect to another host); it is never logged, stored or put in a message.
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from core.errors import ChecksumMismatch, FetchInterrupted, HubUnreachable, InvalidInput, NoAccess
from core.settings import get_settings

log = logging.getLogger(__name__)

# org/name; `./x` and `../x` are paths, not Hub ids. ASCII, as the Hub's ids are (Python's \w is Unicode): the API's
# schema uses the same pattern (api/app.py, ModelRequest.repo).
HUB_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*/[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
PLAIN_FILE = re.compile(r"^(?!\.)[\w.-]+$")  # a file name at a repo's top level, never `..` or a path
REF = re.compile(r"^(?!\.)[\w.-]+(/(?!\.)[\w.-]+)*$")  # a branch or tag name safe as a path under refs/
CHUNK = 1 << 20
RETRIES = 3  # transport errors within one fetch, each resuming where the last stopped (1, 2, 4 s apart)
CONFIG, INDEX, WEIGHTS = "config.json", "model.safetensors.index.json", "model.safetensors"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_EXTRAS = ("generation_config.json", *TOKENIZER_FILES)
SUBMIT_FILES = (CONFIG, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # what the API reads
NOT_SAFETENSORS = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".h5", ".msgpack")
MAX_SMALL_FILE = 64 << 20  # a config, tokenizer or index read by the API: anything bigger is not one


@dataclass(frozen=True)
class RepoFile:
    name: str
    size: int | None
    etag: str  # the blob's name: sha256 (LFS files) or the git blob id (others)


@dataclass
class Snapshot:
    """The files of one commit of a repo that a load reads."""

    repo: str
    commit: str
    revision: str  # as asked: a branch, a tag or the commit
    kind: str  # model | adapter
    files: list[RepoFile]
    gated: bool = False

    @property
    def bytes(self) -> int:
        return sum(f.size or 0 for f in self.files)


@dataclass
class Fetched:
    """A snapshot ready in this host's cache: where, which commit, and what this call had to download."""

    repo: str
    revision: str
    commit: str
    kind: str
    path: Path
    files: int
    bytes: int
    downloaded: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


class Listener:
    """What a fetch tells its caller (a worker turns these into job events and a progress row); no-ops here."""

    def waiting(self, snap: Snapshot) -> None:
        """Another process of this host holds the snapshot's lock (it is downloading it)."""

    def started(self, snap: Snapshot, *, files: int, total: int, done: int) -> None:
        """`files` files of `total` bytes are missing; `done` of those bytes are already there (a resumed part)."""

    def progress(self, done: int, total: int) -> None:
        """Called for every chunk written."""

    def finished(self, snap: Snapshot, *, downloaded: int, seconds: float) -> None:
        """Every file is there and verified."""


# --- names, settings, token ---------------------------------------------------------------------------------


def is_hub_id(name: str | None) -> bool:
    return bool(name) and HUB_ID.match(name) is not None and not Path(name).exists()


def allowed(repo: str) -> bool:
    """With JOBS_MODEL_ROOTS set, Hub ids are allowed only where JOBS_HUB_MODELS lists them (fnmatch patterns)."""
    patterns = get_settings().hub_models
    return any(fnmatch.fnmatchcase(repo, p) for p in patterns)


def folder(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def repo_dir(repo: str, cache: Path | None = None) -> Path:
    return (cache or get_settings().hub_cache) / folder(repo)


def host() -> str:
    return get_settings().hostname or socket.gethostname()


def endpoint() -> str:
    """The Hub endpoint (HF_ENDPOINT), without any user:password it may hold, for messages and registrations."""
    return re.sub(r"//[^/@]*@", "//", get_settings().hub_endpoint)


def token() -> tuple[str | None, str]:
    """(the Hugging Face token or None, where it comes from / where to put one): HF_TOKEN, then the token file that
    `hf auth login` writes (HF_TOKEN_PATH, default $HF_HOME/token). The value goes into request headers only."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        value = os.environ.get(name, "").strip()
        if value:
            return value, name
    path = get_settings().hub_token_path
    try:
        value = path.read_text().strip()
    except OSError:
        value = ""
    return (value, f"the token file {path}") if value else (None, f"HF_TOKEN or the token file {path}")


def describe(repo: str, revision: str | None) -> str:
    return f"{repo}@{revision}" if revision else repo


def short(commit: str | None) -> str:
    return commit[:12] if commit else "?"


# --- talking to the Hub -------------------------------------------------------------------------------------


def _client(connections: int = 1):
    import httpx

    settings = get_settings()
    headers = {"user-agent": "gpujobs (huggingface_hub-compatible)"}
    value, _ = token()
    if value:
        headers["authorization"] = f"Bearer {value}"  # httpx drops it on a redirect to another host (a CDN)
    # connect, and wait for the next byte: a stalled download is retried from where it stopped (a Range request), and
    # a cancel or shutdown is seen at least this often
    return httpx.Client(
        follow_redirects=True,
        timeout=settings.hub_timeout,
        headers=headers,
        verify=_ssl_context(),
        # one connection per file fetched at once, to the endpoint and to the CDN it redirects to
        limits=httpx.Limits(max_connections=2 * connections + 2, max_keepalive_connections=2 * connections + 2),
    )


@functools.cache
def _ssl_context():
    """httpx's default context (certifi, or SSL_CERT_FILE / SSL_CERT_DIR as this process started), made once: making
    it reads the CA bundle (0.1 s), and each fetch makes a client or two."""
    import httpx

    return httpx.create_ssl_context()


def _online() -> None:
    if get_settings().hub_offline:  # a guard: callers check offline mode first and use the cache
        raise InvalidInput("this process is offline (HF_HUB_OFFLINE=1): it never reaches the Hub")


def _unreachable(exc: Exception, what: str) -> HubUnreachable:
    detail = re.sub(r"//[^/@\s]*@", "//", str(exc))  # a URL in the error never shows a password of HF_ENDPOINT
    return HubUnreachable(
        f"cannot reach the Hub at {endpoint()} for {what} ({type(exc).__name__}: {detail}): check "
        "this host's network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 and pull the model on a host "
        "with network access (`gpujobs models pull`)"
    )


def refusal(status: int, headers: Any, repo: str, revision: str | None, what: str) -> Exception:
    """The error for a refused Hub request, from its status and the Hub's X-Error-Code / X-Error-Message headers."""
    code, message = headers.get("x-error-code") or "", headers.get("x-error-message") or ""
    value, source = token()
    page = f"{endpoint()}/{repo}"
    if code == "RevisionNotFound":
        return InvalidInput(
            f"revision {revision!r} of {repo} does not exist on {endpoint()}: give a branch, a tag or "
            "a commit of the repo (e.g. main)"
        )
    if code == "GatedRepo":
        if not value:
            return NoAccess(
                f"{repo} is a gated repo and no Hugging Face token is set here: accept its terms at "
                f"{page} with your account, then set HF_TOKEN (or run `hf auth login`, which writes "
                f"{get_settings().hub_token_path}) on the API host and on every worker host"
            )
        return InvalidInput(
            f"the Hugging Face token from {source} has no access to the gated repo {repo} "
            f"({status}): request access at {page} with the token's account, or use another token"
        )
    if status == 401 and "Invalid credentials" in message:
        return InvalidInput(
            f"the Hugging Face token from {source} is not valid ({status} from {endpoint()}): "
            "create a new one and set it (HF_TOKEN or `hf auth login`)"
        )
    if code == "EntryNotFound":
        return InvalidInput(f"{what} does not exist in {describe(repo, revision)} on {endpoint()}")
    if code == "RepoNotFound" or status in (401, 404):
        if value:
            return InvalidInput(
                f"model repo {repo!r} was not found on {endpoint()} (HF_ENDPOINT), or the token from "
                f"{source} has no access to it"
            )
        return NoAccess(
            f"model repo {repo!r} was not found on {endpoint()} (HF_ENDPOINT), or it is private and no "
            "Hugging Face token is set here: set a token with access (HF_TOKEN, or `hf auth login`) on "
            "the API host and on every worker host"
        )
    if status == 403:
        return InvalidInput(f"{endpoint()} refused {what} (403{': ' + message if message else ''})")
    return HubUnreachable(
        f"the Hub at {endpoint()} answered {status} for {what}{': ' + message if message else ''}: try again later"
    )


def _get(
    client, url: str, *, repo: str, revision: str | None, what: str, params: dict | None = None, retries: int = RETRIES
):
    """One GET, retried on transport errors and server errors (a blip must not fail a job's attempt; the API asks
    with retries=0 so that a submit never waits on an unreachable Hub)."""
    import httpx

    for attempt in range(retries + 1):
        try:
            response = client.get(url, params=params)
        except httpx.TransportError as exc:
            if attempt == retries:
                raise _unreachable(exc, what) from None
            time.sleep(2**attempt)
            continue
        if response.status_code >= 500 and attempt < retries:
            time.sleep(2**attempt)
            continue
        if response.status_code >= 400:
            raise refusal(response.status_code, response.headers, repo, revision, what)
        return response
    raise AssertionError("unreachable")


def listing(repo: str, revision: str | None, *, retries: int = RETRIES) -> tuple[str, list[RepoFile], bool]:
    """(commit, every file of that commit with its size and etag, gated) from `/api/models/{repo}/revision/{rev}`."""
    _online()
    rev = revision or "main"
    url = f"{get_settings().hub_endpoint}/api/models/{repo}/revision/{quote(rev, safe='')}"
    with _client() as client:
        response = _get(
            client,
            url,
            repo=repo,
            revision=rev,
            what=f"the file list of {describe(repo, rev)}",
            params={"blobs": "true"},
            retries=retries,
        )
    try:
        data = response.json()
        commit = data["sha"]
        files = [_repo_file(s) for s in data.get("siblings") or []]
    except (ValueError, KeyError, TypeError) as exc:
        raise HubUnreachable(
            f"{endpoint()} answered the file list of {describe(repo, rev)} with something that is "
            f"not the Hub's model info ({type(exc).__name__}: {exc}): check HF_ENDPOINT"
        ) from None
    if not isinstance(commit, str) or not COMMIT.match(commit):
        raise HubUnreachable(f"{endpoint()} named no commit for {describe(repo, rev)}: check HF_ENDPOINT")
    return commit, files, bool(data.get("gated"))


def _repo_file(sibling: dict[str, Any]) -> RepoFile:
    lfs = sibling.get("lfs") or {}
    etag = lfs.get("sha256") or sibling.get("blobId")
    if not isinstance(etag, str) or not re.fullmatch(r"[0-9a-f]{40}|[0-9a-f]{64}", etag):
        raise KeyError(f"no sha256 or blob id for {sibling.get('rfilename')}")
    return RepoFile(name=sibling["rfilename"], size=lfs.get("size", sibling.get("size")), etag=etag)


# --- which files a load reads -------------------------------------------------------------------------------


def select(
    files: list[RepoFile], *, kind: str, repo: str, revision: str | None, read_index: Callable[[RepoFile], Any]
) -> list[RepoFile]:
    """The files a load of `kind` reads, from a commit's files (top level only). Refused, with what to do: no
    config, no safetensors weights (pickled ones are never loaded), an index naming a shard that is not there."""
    names = {f.name: f for f in files if PLAIN_FILE.match(f.name)}
    where = describe(repo, revision)
    if kind_of(files, kind) == "adapter":
        if ADAPTER_WEIGHTS not in names:
            pickled = "adapter_model.bin" in names
            raise InvalidInput(
                f"{where} has no {ADAPTER_WEIGHTS}"
                + (
                    " (only adapter_model.bin, a pickled checkpoint, which is refused: loading one can run code)"
                    if pickled
                    else ""
                )
                + ": name a PEFT LoRA adapter saved with save_pretrained(safe_serialization=True)"
            )
        if ADAPTER_CONFIG not in names:
            raise InvalidInput(f"{where} has no {ADAPTER_CONFIG}: it is not a PEFT adapter repo")
        return [names[ADAPTER_CONFIG], names[ADAPTER_WEIGHTS]]
    if CONFIG not in names:
        raise InvalidInput(
            f"{where} has no {CONFIG}: it is not a transformers model repo (an adapter repo is named "
            "with --adapter, on its base model)"
        )
    if INDEX in names:
        weights = [names[INDEX], *_shards(read_index(names[INDEX]), names, where)]
    elif WEIGHTS in names:
        weights = [names[WEIGHTS]]
    else:
        other = sorted(n for n in names if n.endswith(NOT_SAFETENSORS))
        raise InvalidInput(
            f"{where} has no safetensors weights ({WEIGHTS} or {INDEX})"
            + (
                f"; it holds only {', '.join(other[:3])}: pickled (or non-PyTorch) checkpoints are refused, since "
                "loading a pickle can run code. Use a revision that has safetensors weights (the Hub's conversion "
                "bot often opened one as refs/pr/N: --revision refs/pr/N), or convert the weights with "
                "save_pretrained(..., safe_serialization=True) and load that directory"
                if other
                else ": it holds no weights transformers can load"
            )
        )
    return [names[CONFIG], *(names[n] for n in MODEL_EXTRAS if n in names), *weights]


def kind_of(files: list[RepoFile], kind: str = "auto") -> str:
    """`model` or `adapter`; `auto`: an adapter repo has adapter_config.json and no config.json."""
    if kind != "auto":
        return kind
    names = {f.name for f in files}
    return "adapter" if ADAPTER_CONFIG in names and CONFIG not in names else "model"


def _shards(index: Any, names: dict[str, RepoFile], where: str) -> list[RepoFile]:
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise InvalidInput(f"{where}: {INDEX} has no weight_map: the repo's weights are incomplete")
    shards = sorted({str(v) for v in weight_map.values()})
    odd = [s for s in shards if not PLAIN_FILE.match(s) or not s.endswith(".safetensors")]
    if odd:
        raise InvalidInput(
            f"{where}: {INDEX} names weights that are not safetensors files of the repo's top level "
            f"({', '.join(odd[:3])})"
        )
    missing = [s for s in shards if s not in names]
    if missing:
        raise InvalidInput(f"{where}: {INDEX} names shards that are not in the repo ({', '.join(missing[:3])})")
    return [names[s] for s in shards]


def plan(repo: str, revision: str | None, *, kind: str = "model", client=None, retries: int = RETRIES) -> Snapshot:
    """The snapshot a load of `repo` at `revision` reads, resolved on the Hub (the index, if any, is fetched)."""
    commit, files, gated = listing(repo, revision, retries=retries)
    rev = revision or "main"

    def read_index(f: RepoFile) -> Any:
        path = _fetch_file(Snapshot(repo, commit, rev, kind, [f]), f, client=client)
        return _json(path, what=f"{INDEX} of {describe(repo, rev)}")

    kind = kind_of(files, kind)
    return Snapshot(
        repo, commit, rev, kind, select(files, kind=kind, repo=repo, revision=rev, read_index=read_index), gated=gated
    )


def _json(path: Path, *, what: str) -> Any:
    try:
        if path.stat().st_size > MAX_SMALL_FILE:
            raise ValueError(f"over {MAX_SMALL_FILE} bytes")
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{what} is not readable JSON ({exc})") from None


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
    if COMMIT.match(rev) and _marker_ok(repo, rev, kind):
        return _fetched(repo, rev, rev, kind)
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
    with _snapshot_lock(snap, listener, stop) if complete else contextlib.nullcontext():
        if complete and _marker_ok(snap.repo, snap.commit, snap.kind, snap.files):
            _write_ref(root, snap.revision, snap.commit)
            return _fetched(snap.repo, snap.revision, snap.commit, snap.kind)
        vouched = _vouched(snap.repo, snap.commit)
        for f in snap.files:  # what is there must be whole and right; a bad blob goes, and is fetched below
            if f.name not in vouched:
                _drop_if_corrupt(root, f)
        missing = [f for f in snap.files if not (root / "blobs" / f.etag).is_file()]
        t0, downloaded = time.monotonic(), 0
        if missing:
            downloaded = _download_all(snap, missing, listener, stop)
        for f in snap.files:
            _link(root, snap.commit, f)
        _write_ref(root, snap.revision, snap.commit)
        if complete:
            _write_marker(root, snap)
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
    with _client(connections=width) as client, ThreadPoolExecutor(width, thread_name_prefix="hub-fetch") as pool:
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
        stack.enter_context(_lock(root.parent / ".locks" / root.name / f"{f.etag}.lock", should_stop))
        if blob.is_file() and content_ok(blob, f.etag):
            return blob
        client = client or stack.enter_context(_client())
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
                raise _unreachable(exc, f"{f.name} of {describe(snap.repo, snap.commit)}") from None
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


def human_bytes(n: float) -> str:
    """`1536` -> `1.5 KiB` (what the CLI and messages show)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --- locks ----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _lock(path: Path, should_stop: Callable[[], bool], on_busy: Callable[[], None] | None = None) -> Iterator[None]:
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


def _snapshot_lock(snap: Snapshot, listener: Listener, should_stop: Callable[[], bool]):
    root = repo_dir(snap.repo)
    return _lock(
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


def _vouched(repo: str, commit: str) -> set[str]:
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


def _drop_if_corrupt(root: Path, f: RepoFile) -> None:
    blob = root / "blobs" / f.etag
    if not blob.is_file():
        return
    if (f.size is None or blob.stat().st_size == f.size) and content_ok(blob, f.etag):
        return
    log.warning("%s: %s in the cache does not match its hash %s: fetching it again", root.name, f.name, f.etag)
    blob.unlink(missing_ok=True)


def _link(root: Path, commit: str, f: RepoFile) -> None:
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
        _write_ref(root, revision, commit)


def _write_ref(root: Path, revision: str, commit: str) -> None:
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


def _write_marker(root: Path, snap: Snapshot) -> None:
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


def _marker_ok(repo: str, commit: str, kind: str, files: list[RepoFile] | None = None) -> bool:
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


def _fetched(repo: str, revision: str, commit: str, kind: str) -> Fetched:
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
    if _marker_ok(repo, commit, kind):
        return _fetched(repo, rev, commit, kind)
    snapshot = repo_dir(repo) / "snapshots" / commit
    kind = kind_of(local_files(repo, commit), kind)
    try:
        chosen = select(
            local_files(repo, commit),
            kind=kind,
            repo=repo,
            revision=rev,
            read_index=lambda f: _json(snapshot / f.name, what=f"{INDEX} of {describe(repo, rev)}"),
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
    _write_marker(repo_dir(repo), snap)
    return Fetched(repo, rev, commit, kind, snapshot, len(chosen), snap.bytes)


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


def read_json(path: Path, name: str) -> dict[str, Any] | None:
    try:
        data = _json(path / name, what=name)
    except InvalidInput:
        return None
    return data if isinstance(data, dict) else None


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
            read_index=lambda f: _json(snapshot / f.name, what=INDEX),
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
        "verified": marker(repo, snapshot.name) is not None and _marker_ok(repo, snapshot.name, kind)
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
        with _snapshot_lock(snap, Listener(), should_stop):
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
