"""Models by Hub id: names, the Hub's file list of a commit, and which of its files a load reads. No torch: the API
(submit checks), the CLI (`gpujobs models pull` on this host) and the workers all use it.

Three modules, one concern each (docs/design.md "Models by Hub id"):

- here: Hub ids and the names of the cache's folders, the token, talking to the Hub (`listing`: a revision resolved
  to its commit and that commit's files, with refusals that say what to do), and `select`: the files a load reads;
- core/hub_download.py: `ensure` (the snapshot in this host's cache, fetched if needed), `plan` (a revision's
  snapshot resolved on the Hub), the resumable, parallel download of its files, and the API's few small files;
- core/hub_cache.py: the cache on disk (Hugging Face's own layout, its locks, our markers), verification against
  each blob's hash, a snapshot found again offline, and what a cache holds (`scan`) and removing from it.

Decisions:

- Only what a load reads is fetched: config, generation config, tokenizer files, chat template and the safetensors
  weights (the shards the index names, never a second copy such as consolidated.safetensors); an adapter repo's
  adapter_config.json and adapter_model.safetensors. A repo whose weights are only pickled is refused.
- The token (HF_TOKEN, or the token file) is read when a request is made and sent only to the endpoint (httpx
  drops it on a redirect to another host); it is never logged, stored or put in a message.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from core.errors import HubUnreachable, InvalidInput, NoAccess
from core.settings import get_settings

log = logging.getLogger(__name__)

# org/name; `./x` and `../x` are paths, not Hub ids. ASCII, as the Hub's ids are (Python's \w is Unicode): the API's
# schema uses the same pattern (api/app.py, ModelRequest.repo).
HUB_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*/[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
PLAIN_FILE = re.compile(r"^(?!\.)[\w.-]+$")  # a file name at a repo's top level, never `..` or a path
REF = re.compile(r"^(?!\.)[\w.-]+(/(?!\.)[\w.-]+)*$")  # a branch or tag name safe as a path under refs/
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


def http_client(connections: int = 1):
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


def unreachable(exc: Exception, what: str) -> HubUnreachable:
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
                raise unreachable(exc, what) from None
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
    with http_client() as client:
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


def small_json(path: Path, *, what: str) -> Any:
    try:
        if path.stat().st_size > MAX_SMALL_FILE:
            raise ValueError(f"over {MAX_SMALL_FILE} bytes")
        return json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"{what} is not readable JSON ({exc})") from None


def read_json(path: Path, name: str) -> dict[str, Any] | None:
    try:
        data = small_json(path / name, what=name)
    except InvalidInput:
        return None
    return data if isinstance(data, dict) else None


def human_bytes(n: float) -> str:
    """`1536` -> `1.5 KiB` (what the CLI and messages show)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
