"""GPU pinning: `jobs worker --gpus` sets the worker's own environment and refuses contradictions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from api.stack import detect_gpus
from core import exits
from core.errors import GpuConflict, InvalidInput
from core.slices import NVLINK_MULTICAST_OFF, parse_slice, parse_slices
from tests.conftest import ROOT, Proc, registered, wait_for


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def start_jobs_worker(env: dict[str, str], gpus: str, log: Path) -> Proc:
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "api", "worker", "--gpus", gpus],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Proc(popen, log)


def test_jobs_worker_sets_its_own_cuda_environment(tmp_path, jobs_env):
    """`jobs worker --gpus none` runs a worker whose real environment has CUDA_DEVICE_ORDER=PCI_BUS_ID, an empty
    CUDA_VISIBLE_DEVICES and NVLink multicast off, and it registers what CUDA really gave it (a slice of GPUs this host
    lacks refuses to start: tests/test_watchdog.py; its recorded environment is checked below)."""
    proc = start_jobs_worker(jobs_env.env, "none", tmp_path / "w.log")
    try:
        wait_for(lambda: registered(jobs_env.database_url, proc.pid), 90, "registration", procs=[proc])
        env = environ_of(proc.pid)  # same pid: `jobs worker` execs the worker
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["NCCL_NVLS_ENABLE"] == "0"
        from core.db import session_scope
        from core.models import Worker

        with session_scope() as session:
            worker = session.query(Worker).filter_by(pid=proc.pid).one()
            assert worker.slice == "" and worker.queues == ["cpu"]
            assert worker.capabilities["cuda_visible_devices"] == ""
            assert worker.capabilities["multicast_off"] == NVLINK_MULTICAST_OFF
            assert worker.capabilities["device_count"] == 0
    finally:
        proc.stop()


def recorded(pid: int):
    """The registration of the worker process `pid` (None until it wrote one), whether it started or refused."""
    from core.db import session_scope
    from core.models import Worker

    with session_scope() as session:
        return session.query(Worker).filter_by(pid=pid).one_or_none()


def test_a_gpu_slice_worker_records_the_environment_it_got_even_when_it_cannot_start(tmp_path, jobs_env):
    """`jobs worker --gpus 2,0`: the worker's own environment has the slice in its order, PCI bus order and NVLink
    multicast off, as its registration records; on a host without those GPUs it refuses to start (exit 6)."""
    proc = start_jobs_worker(jobs_env.env, "2,0", tmp_path / "w.log")
    try:
        wait_for(lambda: recorded(proc.pid), 90, "the registration")
        row = recorded(proc.pid)
        assert row.slice == "2,0" and row.queues == ["gpu2"]
        assert row.capabilities["cuda_visible_devices"] == "2,0"
        assert row.capabilities["cuda_device_order"] == "PCI_BUS_ID"
        assert row.capabilities["multicast_off"] == NVLINK_MULTICAST_OFF
        if {"0", "2"} - set(detect_gpus()):
            assert proc.popen.wait(60) == exits.SLICE_MISSING
            assert recorded(proc.pid).state == "offline"
    finally:
        proc.stop()


def test_contradicting_inherited_cuda_visible_devices_exits_5(tmp_path, jobs_env):
    """An inherited CUDA_VISIBLE_DEVICES=1 with --gpus 0 is refused with exit code 5 and a message saying how to
    fix it; no worker starts."""
    env = dict(jobs_env.env, CUDA_VISIBLE_DEVICES="1")
    result = subprocess.run(
        [sys.executable, "-m", "api", "worker", "--gpus", "0"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 5
    assert "CUDA_VISIBLE_DEVICES='1'" in result.stderr and "unset CUDA_VISIBLE_DEVICES" in result.stderr


def test_matching_inherited_cuda_visible_devices_is_accepted(tmp_path, jobs_env):
    """An inherited CUDA_VISIBLE_DEVICES equal to --gpus is no contradiction: the worker passes the environment check
    (exit 5) and records that slice; on a host without GPU 3 it then refuses for the missing GPU (exit 6)."""
    proc = start_jobs_worker(dict(jobs_env.env, CUDA_VISIBLE_DEVICES="3"), "3", tmp_path / "w.log")
    try:
        wait_for(lambda: recorded(proc.pid), 90, "the registration")
        assert recorded(proc.pid).capabilities["cuda_visible_devices"] == "3"
        if "3" not in detect_gpus():
            assert proc.popen.wait(60) == exits.SLICE_MISSING
    finally:
        proc.stop()


def test_slice_parsing():
    """Slices are device lists in the given order; 'none' is the CPU; two slices may not share a GPU."""
    assert parse_slice("2,0") == ["2", "0"]
    assert parse_slice("none") == [] and parse_slice("") == []
    assert parse_slices("0,1;2;3") == [["0", "1"], ["2"], ["3"]]
    with pytest.raises(InvalidInput, match="share GPU"):
        parse_slices("0,1;1")
    with pytest.raises(InvalidInput, match="twice"):
        parse_slice("0,0")
    with pytest.raises(InvalidInput, match="bad GPU"):
        parse_slice("cuda:0")


def test_check_inherited_refuses_a_contradiction(monkeypatch):
    """The launcher's check names the inherited value and the requested slice."""
    from api.stack import check_inherited

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    check_inherited(["0", "1"])
    with pytest.raises(GpuConflict, match="'0,1'.*--gpus asks for 1,0"):
        check_inherited(["1", "0"])
