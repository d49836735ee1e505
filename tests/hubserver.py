"""A small Hugging Face Hub for the tests, on loopback: the endpoints huggingface_hub and core/hub.py call, serving
repos built in the test, with commit hashes, ETags, LFS redirects to a "CDN" on another port, Range requests, gated
and private repos, and the faults a test asks for (hold a download half-way, die half-way, send bad bytes).

    hub = HubServer().start()                      # hub.url: point HF_ENDPOINT at it
    a = hub.add("acme/tiny", {"config.json": b"{}", "model.safetensors": b"..."})
    b = hub.add("acme/tiny", {...}, tags=["v2"])     # a new commit on main
    hub.gets("acme/tiny", "model.safetensors")      # how many GETs of that file's bytes were served
    hub.add_sharded("acme/big", shards=6, size=n)   # config, index and 6 weight shards of n random bytes
    hub.in_flight, hub.max_in_flight                # files' bytes being sent now, and the most at once

Endpoints (as huggingface.co answers them):

    GET  /api/models/{repo}[/revision/{rev}][?blobs=true]   model info: sha, siblings (size, blobId, lfs.sha256)
    GET  /api/models/{repo}/tree/{rev}[?recursive=true]      the file list (huggingface_hub's snapshot_download)
    HEAD|GET /{repo}/resolve/{rev}/{file}                    X-Repo-Commit, ETag; an LFS file answers 302 to the
                                                             CDN port with X-Linked-Etag (sha256) / X-Linked-Size
    HEAD|GET /cdn/{sha256}                                   the bytes, with Range (206 / 416)

Errors carry X-Error-Code (RepoNotFound, RevisionNotFound, EntryNotFound, GatedRepo) like the Hub's.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".onnx", ".pt", ".gguf")


_DIGESTS: dict[int, tuple[bytes, str, str]] = {}  # id(data) -> (data, git blob id, sha256): each file hashed once


def _digests(data: bytes) -> tuple[str, str]:
    """(git blob id, sha256) of a file's bytes, computed once per bytes object (the benchmark serves gigabytes)."""
    known = _DIGESTS.get(id(data))
    if known is None or known[0] is not data:
        blob = hashlib.sha1(b"blob %d\0" % len(data))
        blob.update(data)
        known = _DIGESTS[id(data)] = (data, blob.hexdigest(), hashlib.sha256(data).hexdigest())
    return known[1], known[2]


def git_blob_id(data: bytes) -> str:
    return _digests(data)[0]


def sha256(data: bytes) -> str:
    return _digests(data)[1]


def is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]


@dataclass
class Repo:
    id: str
    commits: list[Commit] = field(default_factory=list)
    refs: dict[str, str] = field(default_factory=dict)
    gated: bool = False
    private: bool = False
    token: str | None = None  # the token that may read a gated or private repo

    def commit(self, rev: str) -> Commit | None:
        sha = self.refs.get(rev, rev)
        return next((c for c in self.commits if c.sha == sha), None)


class HubServer:
    def __init__(self, port: int = 0, cdn_port: int = 0):
        self.repos: dict[str, Repo] = {}
        self.blobs: dict[str, bytes] = {}  # sha256 -> bytes (the CDN's content; the URL names repo and file)
        self.get_counts: Counter = Counter()  # (repo, file) -> GETs of its bytes
        self.served: Counter = Counter()  # (repo, file) -> bytes sent
        self.ranges: defaultdict[tuple[str, str], list[int]] = defaultdict(list)  # range starts asked for
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path?query, authorization header)
        self.hold: dict[tuple[str, str], tuple[int, threading.Event]] = {}  # bytes past N wait for the event
        self.die_after: dict[tuple[str, str], int] = {}  # send N bytes, then the whole server goes away (once)
        self.corrupt: Counter = Counter()  # (repo, file) -> how many more times to send flipped bytes
        self.in_flight = 0  # GETs of files' bytes being answered now
        self.max_in_flight = 0  # the most at once since start (a client's parallel downloads)
        self.lock = threading.Lock()
        self.died = threading.Event()
        self._ports = (port, cdn_port)
        self._servers: list[ThreadingHTTPServer] = []

    # --- content ----------------------------------------------------------------------------------------------

    def add(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        tags: tuple[str, ...] = (),
        branch: str = "main",
        gated: bool = False,
        private: bool = False,
        token: str | None = None,
    ) -> str:
        """A new commit of `repo_id` holding exactly `files`, on `branch` (and `tags`); returns its sha."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        repo.gated, repo.private, repo.token = repo.gated or gated, repo.private or private, token or repo.token
        listing = "".join(f"{n}:{git_blob_id(d)};" for n, d in sorted(files.items()))
        sha = hashlib.sha1(f"{repo_id}:{len(repo.commits)}:{listing}".encode()).hexdigest()
        repo.commits.append(Commit(sha, dict(files)))
        repo.refs[branch] = sha
        for tag in tags:
            repo.refs[tag] = sha
        for name, data in files.items():
            if is_lfs(name):
                self.blobs[sha256(data)] = data
        return sha

    def gets(self, repo: str, name: str) -> int:
        return self.get_counts[(repo, name)]

    def add_sharded(self, repo_id: str, shards: int, size: int) -> dict[str, bytes]:
        """A model repo of config.json, an index and `shards` safetensors shards of `size` random bytes each (the
        last one a byte longer, so that it sorts first by size): its files, as added."""
        names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
        files = {name: os.urandom(size + (i == shards - 1)) for i, name in enumerate(names)}
        files["config.json"] = json.dumps({"model_type": "qwen3"}).encode()
        files["model.safetensors.index.json"] = json.dumps(
            {"weight_map": {f"w{i}": n for i, n in enumerate(names)}}
        ).encode()
        self.add(repo_id, files)
        return files

    # --- serving ------------------------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._ports[0]}"

    @property
    def cdn_url(self) -> str:
        return f"http://127.0.0.1:{self._ports[1]}"

    def start(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        self._servers = []
        ports = []
        for port in self._ports:
            server = _Server(("127.0.0.1", port), handler)
            threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
            self._servers.append(server)
            ports.append(server.server_address[1])
        self._ports = tuple(ports)
        self.died.clear()
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers = []

    def die(self) -> None:
        """Go away as a crashed server does: stop listening (connections are refused until start())."""
        self.stop()
        self.died.set()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up (a cancel, a timeout, the server dying) is no error worth a traceback."""
        import sys

        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.0"  # one request per connection: a server that dies leaves no pooled connection

    def log_message(self, format, *args) -> None:  # noqa: A002  quiet
        pass

    def do_HEAD(self) -> None:  # noqa: N802
        self._route(head=True)

    def do_GET(self) -> None:  # noqa: N802
        self._route(head=False)

    # --- routing ------------------------------------------------------------------------------------------------

    def _route(self, *, head: bool) -> None:
        url = urlparse(self.path)
        path = unquote(url.path)
        with self.hub.lock:
            self.hub.requests.append((self.command, unquote(self.path), self.headers.get("authorization")))
        if path.startswith("/api/models/"):
            return self._api(url, head)
        if path.startswith("/cdn/"):
            return self._cdn(path[len("/cdn/") :], parse_qs(url.query), head)
        parts = url.path.lstrip("/").split("/", 4)  # org, name, "resolve", rev, file (still quoted)
        if len(parts) == 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", unquote(parts[3]), unquote(parts[4]), head)
        self._error(404, "EntryNotFound", "not found")

    def _api(self, url, head: bool) -> None:
        rest = url.path[len("/api/models/") :].split("/")
        repo_id, tail = "/".join(rest[:2]), rest[2:]
        repo = self._repo(repo_id, api=True)
        if repo is None:
            return
        if not tail:
            tail = ["revision", "main"]
        if len(tail) >= 2 and tail[0] in ("revision", "tree"):
            commit = self._commit(repo, unquote(tail[1]))
            if commit is None:
                return
            if tail[0] == "tree":
                return self._json(200, [self._entry(n, d) for n, d in sorted(commit.files.items())])
            blobs = "blobs" in parse_qs(url.query)
            return self._json(200, self._info(repo, commit, blobs))
        self._error(404, "EntryNotFound", "unknown API path")

    def _info(self, repo: Repo, commit: Commit, blobs: bool) -> dict:
        siblings = []
        for name, data in sorted(commit.files.items()):
            sibling = {"rfilename": name}
            if blobs:
                sibling.update(size=len(data), blobId=git_blob_id(data))
                if is_lfs(name):
                    sibling["lfs"] = {"sha256": sha256(data), "size": len(data), "pointerSize": 134}
            siblings.append(sibling)
        return {
            "_id": repo.id,
            "id": repo.id,
            "modelId": repo.id,
            "sha": commit.sha,
            "private": repo.private,
            "gated": "manual" if repo.gated else False,
            "disabled": False,
            "downloads": 0,
            "likes": 0,
            "tags": ["transformers"],
            "library_name": "transformers",
            "siblings": siblings,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "createdAt": "2026-01-01T00:00:00.000Z",
        }

    def _entry(self, name: str, data: bytes) -> dict:
        entry = {"type": "file", "oid": git_blob_id(data), "size": len(data), "path": name}
        if is_lfs(name):
            entry["lfs"] = {"oid": sha256(data), "size": len(data), "pointerSize": 134}
        return entry

    def _resolve(self, repo_id: str, rev: str, name: str, head: bool) -> None:
        repo = self._repo(repo_id, api=False)
        if repo is None or not self._may_read(repo):
            return
        commit = self._commit(repo, rev)
        if commit is None:
            return
        if name not in commit.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist", commit=commit.sha)
        data = commit.files[name]
        blob_id = git_blob_id(data)
        if is_lfs(name):
            sha = sha256(data)
            self.send_response(302)
            self.send_header("Location", f"{self.hub.cdn_url}/cdn/{sha}?repo={quote(repo.id)}&file={quote(name)}")
            self.send_header("X-Repo-Commit", commit.sha)
            self.send_header("ETag", f'"{blob_id}"')
            self.send_header("X-Linked-Etag", f'"{sha}"')
            self.send_header("X-Linked-Size", str(len(data)))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self._bytes(repo.id, name, data, etag=blob_id, commit=commit.sha, head=head)

    def _cdn(self, sha: str, query: dict, head: bool) -> None:
        if sha not in self.hub.blobs:
            return self._error(404, "EntryNotFound", "no such blob")
        data = self.hub.blobs[sha]
        repo_id, name = query.get("repo", ["?"])[0], query.get("file", ["?"])[0]
        self._bytes(repo_id, name, data, etag=sha, commit=None, head=head)

    # --- access -------------------------------------------------------------------------------------------------

    def _token_ok(self, repo: Repo) -> bool:
        return repo.token is not None and self.headers.get("authorization") == f"Bearer {repo.token}"

    def _repo(self, repo_id: str, *, api: bool) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and not self._token_ok(repo)):
            status = 401 if not self.headers.get("authorization") else 404
            self._error(status, "RepoNotFound", "Repository not found")
            return None
        return repo

    def _may_read(self, repo: Repo) -> bool:
        if not repo.gated or self._token_ok(repo):
            return True
        if self.headers.get("authorization"):
            self._error(
                403, "GatedRepo", f"Access to model {repo.id} is restricted and you are not in the authorized list."
            )
        else:
            self._error(
                401,
                "GatedRepo",
                f"Access to model {repo.id} is restricted. You must have access to it "
                "and be authenticated to access it. Please log in.",
            )
        return False

    def _commit(self, repo: Repo, rev: str) -> Commit | None:
        commit = repo.commit(rev)
        if commit is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
        return commit

    # --- answers ------------------------------------------------------------------------------------------------

    def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, status: int, data) -> None:
        body = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _bytes(self, repo_id: str, name: str, data: bytes, *, etag: str, commit: str | None, head: bool) -> None:
        start = 0
        asked = self.headers.get("range")
        if asked and asked.startswith("bytes=") and asked.endswith("-"):
            start = int(asked[len("bytes=") : -1])
        if start >= len(data) and asked:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        key = (repo_id, name)
        self.send_response(206 if start else 200)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{etag}"')
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if head:
            return
        with self.hub.lock:
            self.hub.in_flight += 1
            self.hub.max_in_flight = max(self.hub.max_in_flight, self.hub.in_flight)
        try:
            last = self._answer(key, data, start)
        finally:  # before the last byte goes out: the client cannot have read it and asked for another file yet
            with self.hub.lock:
                self.hub.in_flight -= 1
        self._send(key, last)

    def _answer(self, key: tuple[str, str], data: bytes, start: int) -> bytes:
        """Send the body but its last byte, and return that byte (nothing when the server died half-way)."""
        with self.hub.lock:
            self.hub.get_counts[key] += 1
            self.hub.ranges[key].append(start)
            body = memoryview(data)[start:]  # no copy: the benchmark serves files of gigabytes
            if self.hub.corrupt[key] > 0:
                self.hub.corrupt[key] -= 1
                body = bytes([body[0] ^ 0xFF]) + body[1:]
            die_at = self.hub.die_after.pop(key, None)
            hold = self.hub.hold.get(key)
        if die_at is not None:
            self._send_then_die(key, body[: max(die_at - start, 0)])
            return b""
        if hold is not None and not hold[1].is_set():  # the bytes up to the hold point, then wait for the event
            cut = max(hold[0] - start, 0)
            self._send(key, body[:cut])
            hold[1].wait()
            body = body[cut:]
        self._send(key, body[:-1])
        return body[-1:]

    def _send(self, key: tuple[str, str], chunk: bytes) -> None:
        for i in range(0, len(chunk), 1 << 16):
            piece = chunk[i : i + (1 << 16)]
            self.wfile.write(piece)
            self.wfile.flush()
            with self.hub.lock:
                self.hub.served[key] += len(piece)

    def _send_then_die(self, key: tuple[str, str], chunk: bytes) -> None:
        self._send(key, chunk)
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_RDWR)
        threading.Thread(target=self.hub.die, daemon=True).start()
