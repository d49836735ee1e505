"""The artifacts directory belongs to one store (core/artifacts.py): a fresh store adopts the first directory checked,
and a worker (exit 78), the API or `gpujobs up` on any other directory refuses to start, saying which directory is
the store's and what to do; two stores never share one directory silently; `gpujobs db adopt-artifacts` repairs."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from core import artifacts, exits
from core.db import session_scope, upgrade
from core.errors import WrongArtifacts
from core.models import StoreIdentity, Worker
from tests.conftest import ROOT


def store_identity() -> StoreIdentity:
    with session_scope() as session:
        return session.query(StoreIdentity).one()


def registration(database_url: str, pid: int) -> Worker | None:
    with session_scope(database_url) as session:
        return session.query(Worker).filter_by(pid=pid).one_or_none()


def test_a_worker_on_another_artifacts_directory_of_its_store_refuses_to_start_with_78(
    jobs_env, spawn_worker, tmp_path
):
    """A fresh store adopts the directory of the first worker that starts (zero setup) and that worker serves; a
    worker of the same store whose JOBS_ARTIFACTS is another, empty directory (a host that left it unset, or lacks
    the mount) exits 78 with one line naming both directories and the fix, is offline with that reason in its
    registration (`gpujobs workers`), and marks nothing."""
    shared = Path(jobs_env.env["JOBS_ARTIFACTS"])
    assert store_identity().artifacts_mark is None
    good = spawn_worker()  # waits until it registered online and started
    ident = store_identity()
    assert artifacts.read_marker(shared) == artifacts.Marker(ident.id, ident.artifacts_mark)
    assert ident.artifacts_path == str(shared)

    elsewhere = tmp_path / "home-of-another-host" / "artifacts"
    elsewhere.mkdir(parents=True)
    bad = spawn_worker(wait=False, JOBS_ARTIFACTS=str(elsewhere))
    assert bad.popen.wait(180) == exits.WRONG_ARTIFACTS, bad.tail()
    line = next(x for x in bad.log.read_text().splitlines() if "refusing to start" in x)
    assert f"refusing to start (exit 78): JOBS_ARTIFACTS={elsewhere} on host " in line, line
    assert f"is not the artifacts directory of store {ident.id}" in line and "has no .gpujobs-store marker" in line
    assert f"the store's artifacts directory is {shared}" in line, line
    assert "mount the shared artifacts directory on this host and set JOBS_ARTIFACTS to it" in line, line
    row = registration(jobs_env.database_url, bad.pid)
    assert (row.state, row.exit_code) == ("offline", exits.WRONG_ARTIFACTS)
    assert row.reason.startswith(f"refused to start: JOBS_ARTIFACTS={elsewhere} on host "), row.reason
    assert list(elsewhere.iterdir()) == []  # not adopted, nothing written
    assert good.alive() and registration(jobs_env.database_url, good.pid).state == "online"


def test_two_stores_cannot_share_one_artifacts_directory(jobs_env, spawn_worker, tmp_path):
    """A worker of a second store (another database) whose JOBS_ARTIFACTS is the first store's directory exits 78
    naming the other store's id: the second store adopts no directory that another store's marker claims, and
    `gpujobs db adopt-artifacts` refuses it too unless --force."""
    shared = Path(jobs_env.env["JOBS_ARTIFACTS"])
    first = artifacts.verify()
    second_url = f"sqlite:///{tmp_path / 'second.db'}"
    upgrade(second_url)
    worker = spawn_worker(wait=False, JOBS_DATABASE_URL=second_url)
    assert worker.popen.wait(180) == exits.WRONG_ARTIFACTS, worker.tail()
    row = registration(second_url, worker.pid)
    assert (row.state, row.exit_code) == ("offline", exits.WRONG_ARTIFACTS)
    assert f"its .gpujobs-store marker is another store's ({first})" in row.reason, row.reason
    assert "the store has adopted no artifacts directory yet: give each store a directory of its own" in row.reason
    assert artifacts.read_marker(shared).store == first

    env = dict(jobs_env.env, JOBS_DATABASE_URL=second_url)
    refused = adopt_artifacts(env)
    assert refused.returncode == 2 and f"holds the marker of another store ({first})" in refused.stderr, refused
    assert "pass --force if that other store is gone for good" in refused.stderr
    forced = adopt_artifacts(env, "--force")
    assert forced.returncode == 0, forced.stderr
    with pytest.raises(WrongArtifacts, match="marker is another store's"):
        artifacts.verify()  # now the first store's processes are refused here: the directory is the second's


def adopt_artifacts(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "api", "db", "adopt-artifacts", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_adopt_artifacts_makes_this_directory_the_stores_and_refuses_every_other(jobs_env, tmp_path, monkeypatch):
    """The repair of a wrong adoption (the first process of a new cluster had the wrong directory):
    `gpujobs db adopt-artifacts` with JOBS_ARTIFACTS=the right one makes it the store's; the old one is refused
    from then on, and so is a copy of it."""
    wrong = Path(jobs_env.env["JOBS_ARTIFACTS"])
    store = artifacts.verify()
    right = tmp_path / "shared" / "artifacts"
    with pytest.raises(WrongArtifacts, match=f"the store's artifacts directory is {wrong} "):
        artifacts.verify(right)
    result = adopt_artifacts(dict(jobs_env.env, JOBS_ARTIFACTS=str(right)))
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == f"{right} is the artifacts directory of store {store}"
    assert artifacts.verify(right) == store
    with pytest.raises(WrongArtifacts, match="marker is of this store but not of the directory it adopted"):
        artifacts.verify(wrong)
    assert adopt_artifacts(dict(jobs_env.env, JOBS_ARTIFACTS=str(right))).returncode == 0  # again: nothing changes
    assert artifacts.verify(right) == store


def test_a_store_with_files_adopts_no_directory_that_lacks_them(jobs_env, tmp_path):
    """A store from before the check (files stored, no directory adopted): a worker host with the wrong directory
    is refused, naming the newest stored file it lacks, instead of adopting its empty directory; the directory that
    holds the files is adopted."""
    from core import files

    with session_scope() as session:
        stored = files.save(session, owner="alice", filename="d.jsonl", stream=io.BytesIO(b'{"prompt": "hi"}\n'))
    empty = tmp_path / "empty"
    with pytest.raises(WrongArtifacts, match=f"it lacks files/{stored.id}, the newest stored file the store records"):
        artifacts.verify(empty)
    assert artifacts.read_marker(empty) is None and store_identity().artifacts_mark is None
    assert artifacts.verify() == store_identity().id
    assert store_identity().artifacts_path == jobs_env.env["JOBS_ARTIFACTS"]


def test_a_marker_written_before_a_crash_is_adopted_and_a_broken_one_is_named(jobs_env):
    """A process that wrote the marker and died before the store recorded it: the next one adopts that marker (it
    holds this store's id). A marker that is no JSON is refused with its path, never overwritten."""
    shared = Path(jobs_env.env["JOBS_ARTIFACTS"])
    shared.mkdir(parents=True)
    ident = store_identity()
    (shared / artifacts.MARKER).write_text(json.dumps({"store": ident.id, "mark": "dir_from_before"}))
    assert artifacts.verify() == ident.id
    assert store_identity().artifacts_mark == "dir_from_before"
    (shared / artifacts.MARKER).write_text("{not json")
    with pytest.raises(WrongArtifacts, match=f"{shared / artifacts.MARKER} is not a gpujobs store marker"):
        artifacts.verify()
    assert (shared / artifacts.MARKER).read_text() == "{not json"


def test_processes_adopting_two_directories_at_once_leave_exactly_one_adopted(any_jobs_env, tmp_path):
    """Four processes' first checks at once, two on each of two directories, on a fresh store: the checks of one
    directory pass (those on one directory agree on its marker), the other's are refused, and the store records the
    winner."""
    dirs = [tmp_path / "a", tmp_path / "b"]
    barrier = threading.Barrier(4)
    outcome: dict[int, str] = {}

    def check(i: int) -> None:
        barrier.wait()
        try:
            artifacts.verify(dirs[i % 2], host=f"host{i}")
            outcome[i] = "ok"
        except WrongArtifacts:
            outcome[i] = "refused"

    threads = [threading.Thread(target=check, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    won = [d for i, d in enumerate(dirs) if outcome[i] == outcome[i + 2] == "ok"]
    assert len(won) == 1 and sorted(outcome.values()) == ["ok", "ok", "refused", "refused"], outcome
    assert store_identity().artifacts_path == str(won[0])
    assert artifacts.read_marker(won[0]).mark == store_identity().artifacts_mark


def test_an_api_on_another_artifacts_directory_refuses_to_start(jobs_env, tmp_path):
    """An API whose JOBS_ARTIFACTS is not the store's directory does not start (uvicorn exits 3): it would keep
    uploads where no worker reads them; its log has the one-line reason."""
    from core.embedded import free_port

    artifacts.verify()
    env = dict(jobs_env.env, JOBS_ARTIFACTS=str(tmp_path / "elsewhere"))
    result = subprocess.run(
        [sys.executable, "-m", "uvicorn", "api.app:app", "--port", str(free_port())],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3, result.stderr
    assert f"refusing to start: JOBS_ARTIFACTS={tmp_path / 'elsewhere'} on host " in result.stderr, result.stderr
