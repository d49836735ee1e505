"""Models by Hub id over real HTTP: a Hub-compatible server on loopback (tests/hubserver.py) serves tiny models built
here, the API and real workers point at it through HF_ENDPOINT (nothing here reaches huggingface.co), and each
host's Hugging Face cache is a folder of the test's own.

The repos: acme/tiny-qa has two commits, v1 (the tiny *base* model: it knows no answer) and main (the tiny model
that memorized examples/qa.jsonl), each with files a load never reads (README.md, pytorch_model.bin,
onnx/model.onnx); acme/pickled has pickled weights only; acme/gated needs a token.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from sqlalchemy import func, select

from api import results, service, service_models, views
from core import hub, hub_cache, hub_download, settings
from core.db import session_scope
from core.errors import ChecksumMismatch, HubUnreachable, InvalidInput, NoAccess, Unschedulable
from core.models import Base, Job, JobEvent, Shard
from tests.conftest import ROOT, qa_pairs, wait_for
from tests.hubserver import HubServer

REPO, PICKLED, GATED = "acme/tiny-qa", "acme/pickled", "acme/gated"
SECRET = "hf_test_secret_5b1f0c9e"
NEVER_READ = ("README.md", "pytorch_model.bin", "onnx/model.onnx")
LOADED = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
)
TERMINAL = ("succeeded", "failed", "cancelled")


def model_files(folder: Path) -> dict[str, bytes]:
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != "gpujobs_tiny.json"}
    return {
        **files,
        "README.md": b"# a tiny model\n",
        "pytorch_model.bin": b"\x80\x04pickled" * 64,
        "onnx/model.onnx": b"onnx" * 256,
    }


class Hub:
    """The fake Hub and the commits of its repos."""

    def __init__(self, server: HubServer, base_model: Path, tiny_model: Path):
        self.server = server
        self.base, self.tiny = model_files(base_model), model_files(tiny_model)
        self.v1 = server.add(REPO, self.base, tags=("v1",))
        self.main = server.add(REPO, self.tiny)
        server.add(PICKLED, {k: v for k, v in self.tiny.items() if k != "model.safetensors"})
        self.gated = server.add(GATED, self.tiny, gated=True, token=SECRET)

    @property
    def weights(self) -> int:
        return len(self.tiny["model.safetensors"])


@pytest.fixture
def fake_hub(base_model, tiny_model):
    server = HubServer().start()
    yield Hub(server, base_model, tiny_model)
    server.stop()


@pytest.fixture
def hub_env(jobs_env, fake_hub, tmp_path, monkeypatch) -> Hub:
    """This process (the API, in-process) reaches the fake Hub, with its own cache and no token."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home-api"))  # no token file either
    monkeypatch.setenv("JOBS_HUB_MIN_FREE_BYTES", "0")
    monkeypatch.setenv("JOBS_HUB_TIMEOUT", "5")
    settings.reset()
    return fake_hub


def worker_env(tmp_path: Path, host: str, **extra: str) -> dict[str, str]:
    return {
        "JOBS_HOSTNAME": host,
        "HF_HUB_CACHE": str(tmp_path / f"cache-{host}"),
        "HF_HOME": str(tmp_path / f"hf-home-{host}"),
        **extra,
    }


def qa_input(tmp_path: Path) -> str:
    path = tmp_path / "qa.jsonl"
    path.write_text(
        "".join(json.dumps({"custom_id": f"q{i}", "prompt": q}) + "\n" for i, (q, _) in enumerate(qa_pairs()))
    )
    return str(path)


def spec(tmp_path: Path, **extra) -> dict:
    return {"model": REPO, "input": qa_input(tmp_path), "gpus": 0, "max_new_tokens": 16, **extra}


def finished(job_id: str, timeout: float, procs) -> dict:
    return wait_for(
        lambda: (j := views.get(job_id, owner=None))["state"] in TERMINAL and j,
        timeout,
        f"job {job_id} to finish",
        procs=procs,
    )


def right_answers(job_id: str) -> int:
    outputs = [r["output"] for r in results.results(job_id, owner=None)]
    return sum(o == a for o, (_, a) in zip(outputs, qa_pairs()))


def messages(job_id: str) -> list[str]:
    return [e["message"] for e in views.events(job_id, owner=None)]


def job_count() -> int:
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(Job))


# --- core/hub.py against the fake Hub (no worker) -------------------------------------------------------------


def test_a_fetch_reads_only_what_a_load_needs_verifies_it_and_needs_no_request_once_cached(hub_env, tmp_path):
    """Only config, generation config, tokenizer, chat template and safetensors weights are fetched (never the
    README, the pickle or a sub-folder), once; a second fetch of the commit sends no request at all; a revision
    (tag) resolves to its commit and a ref is written; a blob corrupted on disk is found and fetched again."""
    fetched = hub_download.ensure(REPO, None)
    assert fetched.commit == hub_env.main and fetched.downloaded > 0
    assert sorted(p.name for p in fetched.path.iterdir()) == sorted(LOADED)
    assert {name: hub_env.server.gets(REPO, name) for name in LOADED + NEVER_READ} == {
        **dict.fromkeys(LOADED, 1),
        **dict.fromkeys(NEVER_READ, 0),
    }
    cache = settings.get_settings().hub_cache
    assert (cache / hub.folder(REPO) / "refs" / "main").read_text() == hub_env.main

    before = len(hub_env.server.requests)
    again = hub_download.ensure(REPO, hub_env.main)
    assert again.downloaded == 0 and len(hub_env.server.requests) == before  # the marker vouches: no request

    tagged = hub_download.ensure(REPO, "v1")
    assert tagged.commit == hub_env.v1 and (tagged.path / "config.json").is_file()

    blob = (fetched.path / "model.safetensors").resolve()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes: only the hash can tell
    blob.write_bytes(bytes(data))
    gets = hub_env.server.gets(REPO, "model.safetensors")
    repaired = hub_download.ensure(REPO, hub_env.main)
    assert repaired.downloaded == hub_env.weights and hub_env.server.gets(REPO, "model.safetensors") == gets + 1
    assert hub_cache.content_ok(blob, blob.name)


def test_bad_bytes_from_the_server_are_fetched_again_and_twice_bad_leaves_nothing_loadable(hub_env):
    """A download whose bytes do not match the sha256 the Hub lists is fetched again; bad twice, it fails with a
    clear error and leaves no blob, no part, no snapshot link and no marker behind (nothing half-written is
    loadable). Files fetched beside it stop at their next chunk and keep their parts (core/hub_download.py): how far
    they got depends on the machine's speed, and the next fetch finishes them and leaves no part."""
    hub_env.server.corrupt[(REPO, "model.safetensors")] = 1
    fetched = hub_download.ensure(REPO, None)
    assert hub_env.server.gets(REPO, "model.safetensors") == 2 and hub_cache.content_ok(
        (fetched.path / "model.safetensors").resolve(),
        hub_cache.marker(REPO, fetched.commit)["files"]["model.safetensors"]["etag"],
    )

    hub_env.server.corrupt[(REPO, "model.safetensors")] = 2
    with pytest.raises(ChecksumMismatch, match="does not match its hash"):
        hub_download.ensure(REPO, "v1")
    root = settings.get_settings().hub_cache / hub.folder(REPO)
    assert not (root / "snapshots" / hub_env.v1 / "model.safetensors").exists()
    assert hub_cache.marker(REPO, hub_env.v1) is None
    bad = next(f for f in hub_download.plan(REPO, "v1").files if f.name == "model.safetensors")
    assert not (root / "blobs" / bad.etag).exists() and not (root / "blobs" / f"{bad.etag}.incomplete").exists()

    assert hub_download.ensure(REPO, "v1").commit == hub_env.v1  # the server serves good bytes again
    assert not list((root / "blobs").glob("*.incomplete"))


def test_bad_input_is_one_clear_error_each(hub_env, monkeypatch):
    """Unknown repo, unknown revision, a repo with pickled weights only, a gated repo without a token (naming the
    token that is missing), no disk space, no network: one clear error each, and no cache entry for any."""
    with pytest.raises(NoAccess, match=f"'acme/nope' was not found on {hub_env.server.url}"):
        hub_download.ensure("acme/nope", None)
    with pytest.raises(InvalidInput, match="revision 'no-such-branch' of acme/tiny-qa does not exist"):
        hub_download.ensure(REPO, "no-such-branch")
    with pytest.raises(InvalidInput, match="has no safetensors weights.*pytorch_model.bin: pickled"):
        hub_download.ensure(PICKLED, None)
    with pytest.raises(NoAccess, match="gated repo and no Hugging Face token is set here.*set HF_TOKEN.*hf auth login"):
        hub_download.ensure(GATED, None)
    monkeypatch.setenv("HF_TOKEN", "hf_someone_else")
    with pytest.raises(InvalidInput, match="token from HF_TOKEN has no access to the gated repo acme/gated"):
        hub_download.ensure(GATED, None)
    monkeypatch.setenv("JOBS_HUB_MIN_FREE_BYTES", str(1 << 60))
    settings.reset()
    with pytest.raises(InvalidInput, match="not enough disk space for acme/tiny-qa.*JOBS_HUB_MIN_FREE_BYTES"):
        hub_download.ensure(REPO, None)
    monkeypatch.setenv("JOBS_HUB_MIN_FREE_BYTES", "0")
    hub_env.server.stop()
    settings.reset()
    with pytest.raises(HubUnreachable, match=f"cannot reach the Hub at {hub_env.server.url}"):
        hub_download.ensure(REPO, None)
    cache = settings.get_settings().hub_cache
    assert not list(cache.glob("models--*/snapshots/*/model.safetensors"))


# --- submit checks (the API, in this process) -----------------------------------------------------------------


def test_submit_pins_the_commit_reads_config_and_tokenizer_and_refuses_what_it_can_know(hub_env, tmp_path, monkeypatch):
    """A Hub id is resolved at submit: the spec's revision becomes the commit (the words asked stay in metrics),
    config.json and tokenizer.json are read here (token checks run before any GPU time: a row too long for the
    context fails during validating); unknown repos and revisions, pickled weights and a gated repo without a token
    are refused with nothing stored; JOBS_MODEL_ROOTS keeps Hub ids out unless JOBS_HUB_MODELS lists them."""
    long_row = tmp_path / "long.jsonl"
    long_row.write_text(json.dumps({"prompt": "why " * 5000}) + "\n" + json.dumps({"prompt": "hello"}) + "\n")
    job = service.submit(owner="alice", spec_data=spec(tmp_path, input=str(long_row)))
    assert job["spec"]["revision"] == hub_env.main
    assert job["metrics"]["model"] == {
        "repo": REPO,
        "revision": "main",
        "commit": hub_env.main,
        "files": 6,
        "bytes": sum(len(hub_env.tiny[n]) for n in LOADED),
        "resolved_by": "api",
    }
    assert job["metrics"]["input"]["token_check"] is True and job["rows"]["failed"] == 1
    assert hub_env.server.gets(REPO, "model.safetensors") == 0  # the API never fetches weights
    tagged = service.submit(owner="alice", spec_data=spec(tmp_path, revision="v1"))
    assert tagged["spec"]["revision"] == hub_env.v1 and tagged["metrics"]["model"]["revision"] == "v1"

    count = job_count()
    for bad, match in (
        (spec(tmp_path, model="acme/nope"), "'acme/nope' was not found"),
        (spec(tmp_path, revision="nope"), "revision 'nope' of acme/tiny-qa does not exist"),
        (spec(tmp_path, model=PICKLED), "no safetensors weights.*pickled"),
        (spec(tmp_path, model=GATED), "gated repo and no Hugging Face token is set here"),
    ):
        with pytest.raises(InvalidInput, match=match):
            service.submit(owner="alice", spec_data=bad)
    assert job_count() == count

    monkeypatch.setenv("HF_TOKEN", SECRET)
    settings.reset()
    gated = service.submit(owner="alice", spec_data=spec(tmp_path, model=GATED))
    assert gated["spec"]["revision"] == hub_env.gated
    assert not secret_in_database()

    monkeypatch.setenv("JOBS_MODEL_ROOTS", str(tmp_path))
    settings.reset()
    with pytest.raises(InvalidInput, match="JOBS_MODEL_ROOTS and the Hub ids JOBS_HUB_MODELS lists"):
        service.submit(owner="alice", spec_data=spec(tmp_path))
    monkeypatch.setenv("JOBS_HUB_MODELS", "acme/*")
    settings.reset()
    assert service.submit(owner="alice", spec_data=spec(tmp_path))["spec"]["revision"] == hub_env.main


def secret_in_database() -> list[str]:
    """Every text of every table, searched for the token."""
    found = []
    with session_scope() as session:
        for table in Base.metadata.sorted_tables:
            for row in session.execute(select(table)).all():
                if SECRET in json.dumps([str(v) for v in row]):
                    found.append(table.name)
    return found


# --- real workers ------------------------------------------------------------------------------------------------


def leased_by(job_id: str) -> set[str]:
    with session_scope() as session:
        return set(
            session.scalars(
                select(Shard.lease_owner).where(Shard.job_id == job_id, Shard.lease_owner.is_not(None))
            ).all()
        )


def test_two_workers_of_a_host_download_once_and_both_load_another_host_downloads_again(
    hub_env, tmp_path, spawn_worker
):
    """Two workers on host A take the two shards of a job: one downloads (the other waits on the snapshot's lock,
    and says so), `status` shows the download's bytes, rate and ETA while it runs, each file is fetched once and
    both workers load it; the job records the commit. Host B (another cache) downloads again for the next job;
    `models list` shows both hosts."""
    release = threading.Event()
    hub_env.server.hold[(REPO, "model.safetensors")] = (hub_env.weights // 2, release)
    host_a = worker_env(tmp_path, "host-a", JOBS_HUB_TIMEOUT="300")  # no reconnect while the test holds the bytes
    workers = [spawn_worker([], **host_a) for _ in range(2)]
    job_id = service.submit(owner="alice", spec_data=spec(tmp_path, shard_rows=3))["id"]
    by_api = {name: hub_env.server.gets(REPO, name) for name in LOADED}  # the API read config and tokenizer

    def downloading():
        view = views.get(job_id, owner=None)
        moving = [d for d in view.get("downloads", []) if d["bytes_done"] >= hub_env.weights // 2]
        return moving and len(leased_by(job_id)) == 2 and moving[0]

    download = wait_for(downloading, 120, "both shards claimed while the weights download", procs=workers)
    assert download["host"] == "host-a" and download["commit"] == hub_env.main
    assert download["bytes_total"] >= hub_env.weights and download["rate_bytes_per_s"] is not None
    wait_for(
        lambda: any(" waits for acme/tiny-qa@" in m for m in messages(job_id)),
        60,
        "the second worker to say it waits",
        procs=workers,
    )
    release.set()
    job = finished(job_id, 180, workers)
    assert job["state"] == "succeeded", job["error"]
    assert right_answers(job_id) >= 5
    assert by_api["model.safetensors"] == 0 and by_api["config.json"] == 1
    assert {name: hub_env.server.gets(REPO, name) - by_api.get(name, 0) for name in LOADED + NEVER_READ} == {
        **dict.fromkeys(LOADED, 1),
        **dict.fromkeys(NEVER_READ, 0),
    }  # once for the two workers of host A
    loads = [e for e in views.events(job_id, owner=None) if " loaded acme/tiny-qa " in e["message"]]
    assert len({e["message"].split()[0] for e in loads}) == 2  # both workers loaded it
    assert job["load_options"]["revision"] == hub_env.main and job["load_options"]["hub"]["host"] == "host-a"
    events = messages(job_id)
    assert sum("download of acme/tiny-qa@" in m and "started on host host-a" in m for m in events) == 1
    assert sum("finished on host host-a" in m and "every file verified" in m for m in events) == 1

    for w in workers:
        w.stop()
    host_b = spawn_worker([], **worker_env(tmp_path, "host-b"))
    again = finished(service.submit(owner="alice", spec_data=spec(tmp_path))["id"], 180, [host_b])
    assert again["state"] == "succeeded", again["error"]
    assert hub_env.server.gets(REPO, "model.safetensors") == 2
    listed = {(m["host"], m["commit"]): m for m in service_models.list_models(repo=REPO)}
    for host in ("host-a", "host-b"):
        row = listed[(host, hub_env.main)]
        assert row["state"] == "ready" and row["bytes"] > hub_env.weights and row["last_used_at"]
        assert row["refs"] == ["main"] and row["cache_dir"] == str(tmp_path / f"cache-{host}")


def failed_attempts(job_id: str) -> list[dict]:
    with session_scope() as session:
        rows = session.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.level == "error")).all()
        return [{"message": e.message, "traceback": (e.data or {}).get("traceback", "")} for e in rows]


def test_revisions_pin_commits_a_corrupt_cache_is_fetched_again_and_a_dead_server_download_resumes(
    hub_env, tmp_path, spawn_worker, monkeypatch
):
    """A tag loads its commit (the base model: it knows no answer), main loads the memorized model; a cached blob
    changed on disk (same size) and one truncated are found at the next job and fetched again; the server dying
    half-way through the weights fails the attempt cleanly (nothing half-written is loaded) and the retry resumes
    with a Range request from where the bytes stopped, downloading no byte twice; a cancel stops a stalled
    download and the job at once (its shard cancelled, not left for the reaper), keeping the part."""
    monkeypatch.setenv("JOBS_MAX_ATTEMPTS", "1000")  # the attempts while the server is down must not run out
    settings.reset()
    worker = spawn_worker([], **worker_env(tmp_path, "host-a"))
    v1 = finished(service.submit(owner="alice", spec_data=spec(tmp_path, revision="v1"))["id"], 180, [worker])
    assert v1["state"] == "succeeded" and v1["load_options"]["revision"] == hub_env.v1
    assert v1["metrics"]["model"]["revision"] == "v1" and right_answers(v1["id"]) <= 1
    main = finished(service.submit(owner="alice", spec_data=spec(tmp_path))["id"], 180, [worker])
    assert main["load_options"]["revision"] == hub_env.main and right_answers(main["id"]) >= 5

    snapshot = tmp_path / "cache-host-a" / hub.folder(REPO) / "snapshots" / hub_env.main
    weights, tokenizer = ((snapshot / n).resolve() for n in ("model.safetensors", "tokenizer.json"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    tokenizer.write_bytes(tokenizer.read_bytes()[:100])
    gets = {n: hub_env.server.gets(REPO, n) for n in ("model.safetensors", "tokenizer.json")}
    repaired = finished(service.submit(owner="alice", spec_data=spec(tmp_path))["id"], 180, [worker])
    assert repaired["state"] == "succeeded" and right_answers(repaired["id"]) >= 5
    assert {n: hub_env.server.gets(REPO, n) - gets[n] for n in gets} == {"model.safetensors": 1, "tokenizer.json": 1}
    assert hub_cache.content_ok(weights, weights.name) and hub_cache.content_ok(tokenizer, tokenizer.name)

    copy = hub_env.server.add("acme/copy", hub_env.tiny)
    half = hub_env.weights // 2
    hub_env.server.die_after[("acme/copy", "model.safetensors")] = half
    job_id = service.submit(owner="alice", spec_data=spec(tmp_path, model="acme/copy"))["id"]
    wait_for(lambda: failed_attempts(job_id), 120, "the attempt to fail while the Hub is down", procs=[worker])
    assert hub_env.server.died.is_set()
    assert "HubUnreachable: cannot reach the Hub at" in failed_attempts(job_id)[0]["traceback"]
    root = tmp_path / "cache-host-a" / hub.folder("acme/copy")
    part = next((root / "blobs").glob("*.incomplete"))
    assert part.stat().st_size == half  # kept for the retry; never linked, never loaded
    assert not (root / "snapshots" / copy / "model.safetensors").exists()
    assert not (root / ".gpujobs" / f"{copy}.json").exists()
    hub_env.server.start()
    job = finished(job_id, 180, [worker])
    assert job["state"] == "succeeded" and right_answers(job_id) >= 5, job["error"]
    assert hub_env.server.ranges[("acme/copy", "model.safetensors")] == [0, half]
    assert hub_env.server.served[("acme/copy", "model.safetensors")] == hub_env.weights  # no byte twice

    held = threading.Event()
    hub_env.server.add("acme/slow", hub_env.tiny)
    hub_env.server.hold[("acme/slow", "model.safetensors")] = (half, held)
    job_id = service.submit(owner="alice", spec_data=spec(tmp_path, model="acme/slow"))["id"]
    wait_for(
        lambda: [d for d in views.get(job_id, owner=None).get("downloads", []) if d["bytes_done"] >= half],
        120,
        "the download to stall half-way",
        procs=[worker],
    )
    service.cancel(job_id, owner=None, by="alice")
    job = finished(job_id, 120, [worker])
    held.set()
    assert job["state"] == "cancelled"
    assert not [m for m in messages(job_id) if "re-enqueued by the reaper" in m]  # stopped, not left to expire
    assert (
        next((tmp_path / "cache-host-a" / hub.folder("acme/slow") / "blobs").glob("*.incomplete")).stat().st_size
        == half
    )  # kept for the next fetch


# --- files of one snapshot fetched in parallel (in this process: no worker, no model) ---------------------------


@pytest.fixture
def bare_hub(tmp_path, monkeypatch) -> HubServer:
    """The fake Hub with no repo, and this process pointed at it with a cache of its own and no token."""
    server = HubServer().start()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("JOBS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("JOBS_HUB_MIN_FREE_BYTES", "0")
    monkeypatch.setenv("JOBS_HUB_TIMEOUT", "5")
    settings.reset()
    yield server
    server.stop()
    settings.reset()


def in_thread(fn) -> tuple[threading.Thread, dict]:
    """Run `fn` in a thread; the dict gets its `result` or its `error`."""
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # noqa: BLE001  the test looks at it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_files_of_a_snapshot_are_fetched_in_parallel_never_more_at_once_than_the_setting(bare_hub, monkeypatch):
    """With JOBS_HUB_PARALLEL_FILES=3, a model of 6 weight shards has 3 of them downloading at once (the server holds
    each half-way and sees 3 requests in flight), never 4; once let go, every file is there, verified, fetched once.
    """
    monkeypatch.setenv("JOBS_HUB_PARALLEL_FILES", "3")
    monkeypatch.setenv("JOBS_HUB_TIMEOUT", "600")  # a held download is never given up and asked for again
    settings.reset()
    files = bare_hub.add_sharded("acme/sharded", shards=6, size=256 << 10)
    shards = sorted(n for n in files if n.startswith("model-"))
    let_go = threading.Event()
    for name in shards:
        bare_hub.hold[("acme/sharded", name)] = (64 << 10, let_go)
    thread, out = in_thread(lambda: hub_download.ensure("acme/sharded", None))
    try:
        wait_for(lambda: bare_hub.in_flight == 3, 120, "three shards downloading at once")
    finally:
        let_go.set()
    thread.join(120)
    assert "result" in out, out
    assert bare_hub.max_in_flight == 3
    fetched = out["result"]
    assert fetched.files == 8 and {n: bare_hub.gets("acme/sharded", n) for n in shards} == dict.fromkeys(shards, 1)
    for name in files:
        assert (fetched.path / name).read_bytes() == files[name]
    assert hub_cache.marker("acme/sharded", fetched.commit) is not None


def test_a_file_that_fails_fails_the_whole_snapshot_naming_it_and_the_next_fetch_resumes_the_others(
    bare_hub, monkeypatch
):
    """6 shards, 3 at a time: the largest (fetched first) is bad twice: ChecksumMismatch, naming that file. The two
    downloading beside it (held half-way) stop and keep their parts, the three not started are not started; nothing
    is linked, no marker. The next fetch resumes the two parts with Range requests from where they stopped."""
    monkeypatch.setenv("JOBS_HUB_PARALLEL_FILES", "3")
    settings.reset()
    files = bare_hub.add_sharded("acme/sharded", shards=6, size=256 << 10)
    shards = sorted(n for n in files if n.startswith("model-"))
    bad, beside, later = shards[-1], shards[:2], shards[2:5]  # the last is a byte longer: it goes first
    bare_hub.corrupt[("acme/sharded", bad)] = 2
    go_bad, let_go = threading.Event(), threading.Event()
    bare_hub.hold[("acme/sharded", bad)] = (0, go_bad)  # fails only once the two beside it are half-way
    for name in beside:
        bare_hub.hold[("acme/sharded", name)] = (100 << 10, let_go)
    seen = Seen()
    thread, out = in_thread(lambda: hub_download.ensure("acme/sharded", None, listener=seen))
    try:
        wait_for(lambda: seen.done == 200 << 10, 120, "the two shards beside the bad one half-way")
        go_bad.set()
        thread.join(120)
    finally:
        go_bad.set()
        let_go.set()
    assert isinstance(out.get("error"), ChecksumMismatch), out
    assert re.search(f"{bad} of acme/sharded@[0-9a-f]+ from .* does not match its hash", str(out["error"]))
    root = settings.get_settings().hub_cache / hub.folder("acme/sharded")
    assert sorted(p.stat().st_size for p in (root / "blobs").glob("*.incomplete")) == [100 << 10, 100 << 10]
    assert [bare_hub.gets("acme/sharded", n) for n in later] == [0, 0, 0]
    assert (
        not list((root / "snapshots").rglob("model-*"))
        and hub_cache.marker("acme/sharded", bare_hub_commit(bare_hub)) is None
    )

    fetched = hub_download.ensure("acme/sharded", None)
    for name in beside:
        assert bare_hub.ranges[("acme/sharded", name)] == [0, 100 << 10]
    for name in files:
        assert (fetched.path / name).read_bytes() == files[name]
    assert hub_cache.marker("acme/sharded", fetched.commit) is not None


class Seen(hub.Listener):
    """The bytes a fetch has counted so far."""

    done = 0

    def progress(self, done: int, total: int) -> None:
        self.done = done


def bare_hub_commit(server: HubServer) -> str:
    return server.repos["acme/sharded"].refs["main"]


def test_parallel_files_setting_is_a_whole_number_from_1_to_64(monkeypatch):
    """JOBS_HUB_PARALLEL_FILES: 8 by default; 0, 65 or `many` is refused naming the variable and the range."""
    monkeypatch.delenv("JOBS_HUB_PARALLEL_FILES", raising=False)
    settings.reset()
    assert settings.get_settings().hub_parallel_files == 8
    for value, message in (("0", "from 1 to 64"), ("65", "from 1 to 64"), ("many", "give a whole number")):
        monkeypatch.setenv("JOBS_HUB_PARALLEL_FILES", value)
        settings.reset()
        with pytest.raises(ValueError, match=f"JOBS_HUB_PARALLEL_FILES=.*{message}"):
            settings.get_settings()
    settings.reset()


HF_DOWNLOAD = "from huggingface_hub import snapshot_download; print(snapshot_download({repo!r}))"


def test_offline_workers_load_from_a_cache_filled_by_huggingface_hub_and_submit_refuses_what_none_has(
    hub_env, tmp_path, spawn_worker, monkeypatch
):
    """A cache filled by huggingface_hub's own snapshot_download (as `hf download` does) serves offline workers
    (HF_HUB_OFFLINE=1): the job runs with no request to the Hub, pinned to the commit the workers' caches hold;
    a model (or revision) that no live worker's cache holds is refused at submit, saying why and what to do."""
    cache = tmp_path / "cache-host-off"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    done = subprocess.run(
        [sys.executable, "-c", HF_DOWNLOAD.format(repo=REPO)],
        capture_output=True,
        text=True,
        env={**env, "HF_HUB_CACHE": str(cache), "HF_ENDPOINT": hub_env.server.url},
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip().splitlines()[-1]) == cache / hub.folder(REPO) / "snapshots" / hub_env.main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings.reset()
    worker = spawn_worker([], **worker_env(tmp_path, "host-off", HF_HUB_OFFLINE="1"))
    before = len(hub_env.server.requests)
    job = service.submit(owner="alice", spec_data=spec(tmp_path))
    assert job["spec"]["revision"] == hub_env.main and job["metrics"]["model"]["resolved_by"] == "worker cache"
    job = finished(job["id"], 180, [worker])
    assert job["state"] == "succeeded" and right_answers(job["id"]) >= 5, job["error"]
    assert len(hub_env.server.requests) == before  # nobody reached the Hub

    count = job_count()
    for model, revision in ((GATED, None), (REPO, "v1")):
        with pytest.raises(
            Unschedulable,
            match="not in the Hugging Face cache of any live worker, and every live "
            "worker is offline \\(HF_HUB_OFFLINE=1.*gpujobs models pull",
        ):
            service.submit(owner="alice", spec_data=spec(tmp_path, model=model, revision=revision))
    assert job_count() == count


def test_a_gated_model_runs_with_the_token_that_is_stored_nowhere_and_operators_pull_list_and_remove(
    hub_env, tmp_path, spawn_worker, api_server, jobs_env, monkeypatch
):
    """With HF_TOKEN on the API and the worker a gated repo runs; the token is sent to the Hub only (never to the
    CDN a download is redirected to) and appears in no table and no log. `gpujobs models pull --workers all --wait`
    has the worker's host fetch a model (the API here is offline: the worker resolves the revision), `models list`
    shows it, `models rm --workers all --wait` deletes it; without --workers both act on this host's cache. A pull
    that fails on the worker exits 1 with the host's error, which the worker logs and `models list` keeps."""
    from tests.test_e2e import jobs

    monkeypatch.setenv("HF_TOKEN", SECRET)
    settings.reset()
    worker = spawn_worker([], **worker_env(tmp_path, "host-t", HF_TOKEN=SECRET))
    job = finished(service.submit(owner="alice", spec_data=spec(tmp_path, model=GATED))["id"], 180, [worker])
    assert job["state"] == "succeeded" and right_answers(job["id"]) >= 5, job["error"]
    sent = [(path, auth) for _, path, auth in hub_env.server.requests if GATED in path]
    cdn = [auth for path, auth in sent if path.startswith("/cdn/")]
    assert cdn and all(auth is None for auth in cdn)  # the redirect to another host drops it
    assert all(auth == f"Bearer {SECRET}" for path, auth in sent if not path.startswith("/cdn/"))
    assert secret_in_database() == []
    logs = [worker.log, *tmp_path.glob("*.log")]
    assert [str(p) for p in logs if SECRET in p.read_text(errors="replace")] == []

    url, token, api = api_server
    env = dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)
    pulled = jobs(env, "models", "pull", REPO, "--workers", "all", "--wait", "--json")
    assert pulled.returncode == 0, pulled.stderr
    rows = json.loads(pulled.stdout)
    assert [(r["host"], r["commit"], r["state"]) for r in rows] == [("host-t", hub_env.main, "ready")]
    listed = json.loads(jobs(env, "models", "list", "--json", check=True).stdout)
    assert {(m["repo"], m["host"], m["state"]) for m in listed} >= {
        (REPO, "host-t", "ready"),
        (GATED, "host-t", "ready"),
    }
    removed = jobs(env, "models", "rm", REPO, "--workers", "all", "--wait", "--json")
    assert removed.returncode == 0, removed.stderr
    assert not (tmp_path / "cache-host-t" / hub.folder(REPO)).exists()
    assert (tmp_path / "cache-host-t" / hub.folder(GATED)).exists()
    assert REPO not in {m["repo"] for m in json.loads(jobs(env, "models", "list", "--json", check=True).stdout)}
    assert SECRET not in api.log.read_text(errors="replace")

    missing = jobs(env, "models", "pull", "acme/missing", "--workers", "all", "--wait")
    assert missing.returncode == 1, (missing.stdout, missing.stderr)
    (error,) = re.findall(r"error: (.+)", missing.stdout)
    assert "acme/missing" in error, missing.stdout
    listed = json.loads(jobs(env, "models", "list", "--repo", "acme/missing", "--json", check=True).stdout)
    assert [(m["host"], m["state"], m["error"]) for m in listed] == [("host-t", "failed", error)]
    assert f"could not pull acme/missing@main in {tmp_path / 'cache-host-t'}: {error}" in worker.log.read_text()

    here = {**env, "HF_HUB_CACHE": str(tmp_path / "cache-here"), "HF_ENDPOINT": hub_env.server.url}
    here.pop("HF_HUB_OFFLINE", None)
    local = jobs(here, "models", "pull", REPO, "--revision", "v1", "--json")
    assert local.returncode == 0, local.stderr
    assert json.loads(local.stdout)["commit"] == hub_env.v1
    assert (tmp_path / "cache-here" / hub.folder(REPO) / "snapshots" / hub_env.v1 / "model.safetensors").is_file()
    assert jobs(here, "models", "rm", REPO, check=True).returncode == 0
    assert not (tmp_path / "cache-here" / hub.folder(REPO)).exists()


MAKE_LORA = """
import sys
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
get_peft_model(model, config).save_pretrained(sys.argv[2])
"""


def test_a_hub_lora_adapter_is_checked_at_submit_fetched_and_applied_at_its_commit(
    hub_env, tmp_path, tiny_model, spawn_worker
):
    """`adapter: org/name` names a Hub LoRA repo: its config is checked at submit (LoRA, its base by name, weights
    in safetensors), its revision pinned to a commit; the worker fetches its two files and applies it, and the job
    records the adapter's source and commit. A model whose architecture the live workers' transformers cannot load
    as a causal LM is refused at submit."""
    folder = tmp_path / "lora"
    subprocess.run(
        [sys.executable, "-c", MAKE_LORA, str(tiny_model), str(folder)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    config = json.loads((folder / "adapter_config.json").read_text())
    files = {"adapter_model.safetensors": (folder / "adapter_model.safetensors").read_bytes(), "README.md": b"lora"}
    lora = hub_env.server.add(
        "acme/tiny-lora",
        {**files, "adapter_config.json": json.dumps({**config, "base_model_name_or_path": REPO}).encode()},
    )
    hub_env.server.add(
        "acme/other-lora",
        {
            **files,
            "adapter_config.json": json.dumps({**config, "base_model_name_or_path": "acme/another-model"}).encode(),
        },
    )
    hub_env.server.add(
        "acme/pickled-lora",
        {
            "adapter_model.bin": b"\x80\x04pickle",
            "adapter_config.json": json.dumps({**config, "base_model_name_or_path": REPO}).encode(),
        },
    )
    for adapter, match in (
        ("acme/other-lora", "was trained on 'acme/another-model', not on 'acme/tiny-qa'"),
        ("acme/pickled-lora", "has no adapter_model.safetensors \\(only adapter_model.bin, a pickled checkpoint"),
    ):
        with pytest.raises(InvalidInput, match=match):
            service.submit(owner="alice", spec_data=spec(tmp_path, adapter=adapter))

    worker = spawn_worker([], **worker_env(tmp_path, "host-l"))
    encoder = json.loads(hub_env.tiny["config.json"]) | {"model_type": "vit", "architectures": ["ViTModel"]}
    hub_env.server.add("acme/encoder", {**hub_env.tiny, "config.json": json.dumps(encoder).encode()})
    with pytest.raises(
        InvalidInput,
        match="model_type 'vit' \\(ViTModel\\) is not a causal language model that "
        "transformers .* on the live workers loads",
    ):
        service.submit(owner="alice", spec_data=spec(tmp_path, model="acme/encoder"))  # the workers' registrations
    job = service.submit(owner="alice", spec_data=spec(tmp_path, adapter="acme/tiny-lora"))
    assert job["spec"]["adapter_revision"] == lora and job["metrics"]["adapter"]["commit"] == lora
    assert any("adapter acme/tiny-lora: LoRA r=4 on base 'acme/tiny-qa'" in m for m in messages(job["id"]))
    job = finished(job["id"], 180, [worker])
    assert job["state"] == "succeeded", job["error"]
    ran = job["load_options"]["adapter"]
    assert (ran["id"], ran["source"], ran["revision"], ran["merged"]) == ("acme/tiny-lora", "hub", lora, True)
    assert hub_env.server.gets("acme/tiny-lora", "adapter_model.safetensors") == 1
    assert hub_env.server.gets("acme/tiny-lora", "README.md") == 0


def test_the_api_reads_a_hub_models_config_and_tokenizer_without_importing_torch(hub_env, jobs_env, tmp_path):
    """A submit of a Hub model through the real FastAPI app resolves it and reads config.json and tokenizer.json
    (json and `tokenizers`) with torch, transformers and worker/ left out of the API process."""
    from tests.test_layering import SCRIPT

    env = {k: v for k, v in jobs_env.env.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=hub_env.server.url, HF_HUB_CACHE=str(tmp_path / "cache-api"), JOBS_HUB_MIN_FREE_BYTES="0")
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, REPO], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["heavy"] == []
    with session_scope() as session:
        job = session.get(Job, report["job"])
        assert job.spec["revision"] == hub_env.main and job.metrics["input"]["token_check"] is True


def test_the_cache_record_claims_each_request_once_and_follows_scans_on_sqlite_and_postgres(any_jobs_env):
    """A pull request per place is claimed by one worker only (a conditional UPDATE), a second claim finds none; an
    upsert of an existing (place, repo, commit) reuses its row; a scan's sync adds what it found and drops what
    vanished, leaving requests in flight alone; a failed request's row keeps its state and error through scans,
    whether the scan finds its snapshot (partial) or not."""
    from core import model_cache

    places = {("h1", "/c1"), ("h2", "/c2")}
    record = {
        "repo": REPO,
        "commit": "a" * 40,
        "kind": "model",
        "refs": ["main"],
        "files": 6,
        "bytes": 10,
        "state": "ready",
    }
    with session_scope() as session:
        rows = model_cache.request(session, places=places, repo=REPO, action="pull", by="ops", revision="main")
        assert sorted(r.state for r in rows) == ["pull_requested"] * 2
    with session_scope() as session:
        first = model_cache.claim(session, host="h1", cache_dir="/c1", worker="w1")
        assert first is not None and first.state == "downloading" and first.worker == "w1"
    with session_scope() as session:
        assert model_cache.claim(session, host="h1", cache_dir="/c1", worker="w2") is None
        model_cache.sync(session, host="h1", cache_dir="/c1", records=[record])
        model_cache.sync(session, host="h2", cache_dir="/c2", records=[record])
    with session_scope() as session:
        again = model_cache.upsert(session, host="h2", cache_dir="/c2", repo=REPO, commit="a" * 40, last_used_at=1.0)
        assert again.state == "ready" and again.bytes == 10
        model_cache.sync(session, host="h2", cache_dir="/c2", records=[])
        for commit in ("b" * 40, "c" * 40):
            model_cache.upsert(
                session, host="h2", cache_dir="/c2", repo=REPO, commit=commit, state="failed", error="Hub said 503"
            )
    with session_scope() as session:
        model_cache.sync(
            session, host="h2", cache_dir="/c2", records=[{**record, "commit": "c" * 40, "state": "partial"}]
        )
    with session_scope() as session:
        left = {(r.host, r.commit, r.state, r.error) for r in model_cache.listing(session, REPO)}
    assert left == {
        ("h1", "", "downloading", None),
        ("h1", "a" * 40, "ready", None),
        ("h2", "", "pull_requested", None),
        ("h2", "b" * 40, "failed", "Hub said 503"),
        ("h2", "c" * 40, "failed", "Hub said 503"),
    }


def test_a_cache_scan_names_refs_only_never_a_ref_being_written(tmp_path):
    """refs/main and refs/v1 name the snapshot; `.main.<hex>.tmp` (another worker's ref mid-write, or one a crash
    left) is not a ref. Seen on CI: two workers of one host, one listing its cache while the other wrote the ref."""
    commit = "a" * 40
    root = tmp_path / "models--acme--tiny"
    (root / "snapshots" / commit).mkdir(parents=True)
    (root / "refs").mkdir()
    for name in ("main", "v1", ".main.39cc7d83.tmp"):
        (root / "refs" / name).write_text(commit)
    (found,) = hub_cache.scan(tmp_path)
    assert (found["repo"], found["refs"]) == ("acme/tiny", ["main", "v1"])


def test_the_models_thread_rides_out_a_store_outage_with_one_traceback_then_one_line_per_poll(
    jobs_env, monkeypatch, caplog
):
    """While the store is unreachable, the models thread logs its first failure with the traceback and each later
    one in a single line (not a traceback every poll: thousands of lines a minute), then says when it works again."""
    import logging

    from core import db
    from core.embedded import free_port
    from worker import hubfetch

    monkeypatch.setattr(hubfetch, "POLL_SECONDS", 0.05)
    caplog.set_level(logging.INFO, logger="worker.hubfetch")
    monkeypatch.setenv("JOBS_DATABASE_URL", f"postgresql+psycopg://nobody@127.0.0.1:{free_port()}/none")
    settings.reset()
    db.dispose()
    closed = threading.Event()
    thread = threading.Thread(target=hubfetch.serve, args=("w1-cpu@h", closed), daemon=True)
    thread.start()
    try:

        def records() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == "worker.hubfetch" and "models thread" in r.getMessage()]

        wait_for(lambda: len(records()) >= 4, 60, "four failed polls")
        failing = records()[:4]
        assert failing[0].exc_info is not None and "failed; retrying" in failing[0].getMessage()
        for record in failing[1:]:
            assert record.exc_info is None, record.getMessage()
            assert "still failing after" in record.getMessage() and "\n" not in record.getMessage(), record.getMessage()

        monkeypatch.setenv("JOBS_DATABASE_URL", jobs_env.database_url)
        settings.reset()
        db.dispose()
        wait_for(lambda: any("works again" in r.getMessage() for r in records()), 60, "the store back")
    finally:
        closed.set()
        thread.join(10)
