"""The `jobs` CLI contract: the local stack, exit codes, read commands, bad input, a resident model."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
import subprocess
import sys

import pytest

from core.embedded import free_port
from tests.conftest import ROOT
from tests.test_e2e import jobs, write_rows


def test_up_demo_down_on_a_fresh_home(tmp_path, redis_server):
    """`jobs up --detach` on an empty JOBS_HOME starts embedded Redis, migrates, writes a 0600 admin token and
    starts one CPU worker; `jobs demo` runs a real job on it; `jobs down` stops every process it started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env["JOBS_HOME"] = str(tmp_path / "home")
    port = str(free_port())
    up = jobs(env, "up", "--detach", "--port", port)
    assert up.returncode == 0, up.stderr
    try:
        home = tmp_path / "home"
        assert stat.S_IMODE((home / "token").stat().st_mode) == 0o600
        stack = json.loads((home / "run" / "stack.json").read_text())
        pids = [stack["redis"], stack["api"], *stack["workers"]]
        assert all(os.path.exists(f"/proc/{p}") for p in pids)
        workers = json.loads(jobs(env, "workers", "--json", check=True).stdout)
        assert [(w["state"], w["queues"], w["slice"]) for w in workers] == [("online", ["cpu"], "")]
        again = jobs(env, "up", "--detach", "--port", port)
        assert again.returncode == 1 and "already running" in again.stderr

        demo = jobs(env, "demo", "--port", port)
        assert demo.returncode == 0, demo.stderr
        results = [json.loads(line) for line in open(demo.stdout.strip())]
        assert {r["custom_id"]: r["output"] for r in results}["france-plain"] == "Paris."
        # the demo says where its model is and prints the exact command of a job on that model and its adapter
        model = home / "models" / "tiny-base"
        assert f"the demo's base model is {model} and its adapter is job_" in demo.stderr
        [command] = [line.strip() for line in demo.stderr.splitlines() if line.startswith("  gpujobs submit")]
        args = shlex.split(command)
        assert args[:2] == ["gpujobs", "submit"] and args[args.index("--model") + 1] == str(model)
        mine = jobs(env, *args[1:])
        assert mine.returncode == 0 and mine.stdout.startswith("job_"), mine.stderr
        adapter = args[args.index("--adapter") + 1]
        job = json.loads(jobs(env, "status", mine.stdout.strip(), "--json", check=True).stdout)
        assert job["spec"]["adapter"] == adapter and job["rows"]["failed"] == 0
        # `status` (text) shows a job's adapter: the generation job's, and the fine-tune's own
        shown = jobs(env, "status", mine.stdout.strip(), check=True).stdout
        assert f"  adapter  {adapter} (a fine-tune's; loaded merged into the base, sha256 " in shown, shown
        trained = jobs(env, "status", adapter, check=True).stdout
        assert f"  adapter  {adapter} (trained by this fine-tune; use it: --adapter {adapter})" in trained, trained
    finally:
        down = jobs(env, "down")
    assert down.returncode == 0
    assert not any(
        os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z" for p in pids
    )
    assert not (tmp_path / "home" / "run" / "stack.json").exists()


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    """`up` on an API port another program listens on (given with --port, or by JOBS_API_PORT, which --port defaults
    to) names the port and exits 2 before Redis, the API or a worker starts: no stack.json, no Redis directory."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env["JOBS_HOME"] = str(tmp_path / "home")
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        for args, extra in ((["--port", str(port)], {}), ([], {"JOBS_API_PORT": str(port)})):
            up = jobs(dict(env, **extra), "up", "--detach", *args)
            assert (up.returncode, up.stderr) == (
                2,
                f"Error: port {port} on 127.0.0.1 is in use (by another program): pick another with --port\n",
            )
    assert not (tmp_path / "home" / "run").exists()


def test_up_and_demo_listen_on_JOBS_API_HOST_unless_given_host(tmp_path):
    """`up --host` defaulted to 127.0.0.1 whatever JOBS_API_HOST said, while --port followed JOBS_API_PORT. Both
    `up` and `demo` now take the setting (their help says so), and --host still overrides it: a JOBS_API_HOST beyond
    loopback is refused (no roots set) before anything starts, and `--host 127.0.0.1` gets past that check."""
    import socket

    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(JOBS_HOME=str(tmp_path / "home"), JOBS_API_HOST="192.0.2.1")  # TEST-NET-1: never this host's
    refused = "Error: --host 192.0.2.1 listens beyond loopback: set JOBS_MODEL_ROOTS and JOBS_DATA_ROOTS first\n"
    with socket.socket() as other:  # a busy port: nothing starts here even if the host were not refused
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = str(other.getsockname()[1])
        for command in (["up", "--detach"], ["demo"]):
            helped = " ".join(jobs(env, command[0], "--help", check=True).stdout.split())
            assert "--host ADDRESS" in helped and "[default: (JOBS_API_HOST, else 127.0.0.1)]" in helped, helped
            ran = jobs(env, *command, "--port", port)
            assert ran.returncode == 2 and ran.stderr.endswith(refused), (command, ran.stderr)
        up = jobs(env, "up", "--detach", "--host", "127.0.0.1", "--port", port)
        assert (up.returncode, up.stderr) == (
            2,
            f"Error: port {port} on 127.0.0.1 is in use (by another program): pick another with --port\n",
        )
    assert not (tmp_path / "home" / "run").exists()


@pytest.fixture
def cli_env(jobs_env, api_server):
    url, token, _ = api_server
    return dict(jobs_env.env, JOBS_API_URL=url, JOBS_TOKEN=token)


def test_bad_submissions_exit_2_and_write_nothing(tmp_path, cli_env, spawn_worker, tiny_model):
    """An unknown spec field, a model path that does not exist, a pickle-only model and a missing token each
    get one clear line and exit 2, and no job is created and no upload is left behind (the CLI uploads the input
    before the server checks the spec, and deletes it again when the submit is refused)."""
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import File

    spawn_worker([])
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    cases = [
        (["--model", str(tiny_model), "--set", "bogus=1"], "unknown field 'bogus'"),
        (["--model", str(tmp_path / "nope")], "does not exist"),
        (["--model", "./nope"], f"model '{ROOT / 'nope'}' does not exist"),  # made absolute, not sent relative
        (["--model", str(tiny_model), "--max-new-tokens", "0"], "Invalid value for '--max-new-tokens'"),
        (["--model", str(tiny_model), "--attn", "bogus"], "unknown attention backend 'bogus'"),
    ]
    pickle_only = tmp_path / "pickle-model"
    pickle_only.mkdir()
    (pickle_only / "config.json").write_text("{}")
    (pickle_only / "pytorch_model.bin").write_bytes(b"x")
    cases.append((["--model", str(pickle_only)], "pickle .bin checkpoints are refused"))
    for args, message in cases:
        result = jobs(cli_env, "submit", "generate", "--input", data, *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and result.stderr.count("\n") == 1, (args, result.stderr)
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(File)) == 0
    no_token = jobs({k: v for k, v in cli_env.items() if k != "JOBS_TOKEN"}, "list")
    assert no_token.returncode == 2 and "missing bearer token" in no_token.stderr
    assert json.loads(jobs(cli_env, "list", "--json", check=True).stdout) == []


def test_redis_down_at_submit_exits_3_and_writes_nothing(tmp_path, cli_env, redis_server, spawn_worker, tiny_model):
    """With Redis gone the submit says so, exits 3 and leaves no job behind; with Redis back it works."""
    spawn_worker([])
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    redis_server.kill()
    try:
        result = jobs(cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data)
        assert result.returncode == 3, result.stderr
        assert "Redis" in result.stderr and "jobs up" in result.stderr
    finally:
        redis_server.start()
    assert json.loads(jobs(cli_env, "list", "--json", check=True).stdout) == []


def test_read_commands_follow_a_job_and_the_model_stays_resident(tmp_path, cli_env, spawn_worker, tiny_model):
    """`events --follow` ends when the job ends and shows its state changes; `list --json` and `wait --json`
    report it; a second job with the same load options reuses the resident model (one load event in all)."""
    spawn_worker([])
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "What is the capital of France?"}] * 3)
    ids = []
    for _ in range(2):
        sub = jobs(
            cli_env,
            "submit",
            "generate",
            "--model",
            str(tiny_model),
            "--input",
            data,
            "--max-new-tokens",
            "8",
            check=True,
        )
        ids.append(sub.stdout.strip())
        follow = jobs(cli_env, "events", ids[-1], "--follow", check=True)
        assert "job → succeeded" in follow.stdout
    waited = jobs(cli_env, "wait", ids[1], "--json")
    assert waited.returncode == 0 and json.loads(waited.stdout)["state"] == "succeeded"
    listed = json.loads(jobs(cli_env, "list", "--json", check=True).stdout)
    assert [j["id"] for j in listed] == ids[::-1]
    loads = _load_events(cli_env, ids)
    assert len(loads) == 1


def test_events_follow_prints_the_end_of_a_job_that_ended_between_its_reads(tmp_path, cli_env, tiny_model, monkeypatch):
    """A job's end and its "job → …" event are one transaction. When `events --follow` reads an empty page, then
    the job ends, then it reads the state, the follow reads the events once more before it stops: the end's event
    is printed. (The job has no worker and is cancelled between the two reads.)"""
    from click.testing import CliRunner

    from api.cli import cli
    from api.client import Client

    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    job_id = jobs(
        cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True
    ).stdout.strip()
    state = Client.job
    reads = []

    def job(self, wanted):  # the follow's first read of the state comes after a page of no new events
        reads.append(wanted)
        if len(reads) == 2:
            jobs(cli_env, "cancel", wanted, check=True)
        return state(self, wanted)

    monkeypatch.setattr(Client, "job", job)
    for key, value in cli_env.items():
        monkeypatch.setenv(key, value)
    followed = CliRunner().invoke(cli, ["events", job_id, "--follow"])
    assert followed.exit_code == 0, followed.output
    assert len(reads) == 2 and "job → cancelled" in followed.output.splitlines()[-1], followed.output


def _load_events(env, ids) -> list[dict]:
    found = []
    for job_id in ids:
        lines = jobs(env, "events", job_id, "--json", check=True).stdout.splitlines()
        found += [e for e in map(json.loads, lines) if " loaded " in e["message"]]
    return found


def test_cancelled_job_waits_with_exit_1(tmp_path, cli_env, tiny_model):
    """A job cancelled before any worker took it ends `cancelled`; `jobs wait` exits 1, `jobs cancel` again is
    refused with a clear message (exit 2)."""
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}] * 4)
    job_id = jobs(
        cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True
    ).stdout.strip()
    assert jobs(cli_env, "cancel", job_id, check=True).stdout.split() == [job_id, "cancelled"]
    assert jobs(cli_env, "wait", job_id).returncode == 1
    again = jobs(cli_env, "cancel", job_id)  # the state refuses the command: 2, as `retry` of a running job
    assert again.returncode == 2 and "already cancelled" in again.stderr


def test_ctrl_c_stops_a_wait_with_130_and_the_job_goes_on(tmp_path, cli_env, tiny_model):
    """Ctrl-C (SIGINT) during `submit --wait`, `wait` and `events --follow` exits 130, not 1 (a failed job's code,
    with click's "Aborted!"): stderr says the job goes on and how to watch it again, `submit --wait` has printed the
    job's id on stdout all the same (`ID=$(…)` keeps it), and the job is still running."""
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}] * 2)
    submit = ["submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", "--wait"]
    code, out, err = interrupted(cli_env, tmp_path, submit, lambda o, e: e.startswith("job_"))  # no worker: it runs on
    job_id = out.strip()
    assert (code, out) == (130, f"{job_id}\n") and job_id.startswith("job_"), (code, out, err)
    assert f"Ctrl-C does not cancel the job: watch it again with `gpujobs wait {job_id}`" in err and "Abort" not in err
    code, out, err = interrupted(cli_env, tmp_path, ["wait", job_id], lambda o, e: e.startswith(job_id))
    assert (code, out) == (130, "") and f"`gpujobs wait {job_id}`" in err, (code, out, err)
    code, out, err = interrupted(cli_env, tmp_path, ["events", job_id, "--follow"], lambda o, e: "submitted" in o)
    assert code == 130 and f"watch it again with `gpujobs events {job_id} --follow`" in err, (code, out, err)
    assert json.loads(jobs(cli_env, "status", job_id, "--json", check=True).stdout)["state"] == "running"


def interrupted(env, tmp_path, args, ready) -> tuple[int, str, str]:
    """`gpujobs ARGS` sent SIGINT once `ready(stdout, stderr)`; its exit code, stdout and stderr. Its output goes
    to files (a pipe nobody reads could block it); SIGINT is restored to its default in the child, so Python
    installs its KeyboardInterrupt handler whatever this process inherited."""
    import signal

    from tests.conftest import Proc, wait_for

    out, err = tmp_path / "interrupted.out", tmp_path / "interrupted.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "api", *args],
            env=env,
            cwd=ROOT,
            stdout=stdout,
            stderr=stderr,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        wait_for(lambda: ready(out.read_text(), err.read_text()), 60, f"{args} to start", procs=[Proc(popen, err)])
        popen.send_signal(signal.SIGINT)
        popen.wait(60)
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
    return popen.returncode, out.read_text(), err.read_text()


def test_a_reader_that_goes_away_ends_the_command_silently_as_cat(tmp_path, cli_env, tiny_model):
    """`results ID | head -1` and `events ID | head -1`: once the reader has gone, the command ends as `cat` does,
    killed by SIGPIPE (a shell's 141) with nothing on stderr; it exited 1 (a failed job's code). The server is
    none the worse: the whole results come after."""
    import signal

    from core.db import session_scope
    from core.store import add_event

    rows = [{"prompt": "hi"}] + ["{not json"] * 3000  # 3,000 failed rows at submit: 300 kB of --errors, no worker
    data = write_rows(tmp_path / "d.jsonl", rows)
    job_id = jobs(
        cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True
    ).stdout.strip()
    with session_scope() as session:
        for i in range(2000):
            add_event(session, job_id, f"note {i}")
    for args in (["results", job_id, "--errors"], ["events", job_id], ["events", job_id, "--json"]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "api", *args], env=cli_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        first = proc.stdout.readline()
        proc.stdout.close()  # `head -1` has its line and exits
        err = proc.stderr.read().decode()
        assert (proc.wait(60), err) == (-signal.SIGPIPE, ""), args
        assert first.strip(), args
    whole = jobs(cli_env, "results", job_id, "--errors", check=True)
    assert len(whole.stdout.splitlines()) == 3000 and whole.stderr == "3000 failed rows\n", whole.stderr


def test_a_dataset_read_from_a_pipe_is_uploaded_whole(tmp_path, cli_env, tiny_model):
    """`--input /dev/stdin` fed by a pipe (as bash's `<(…)` is) uploads what the pipe holds: it failed with h11's
    traceback ("Too much data for declared Content-Length": a pipe's size is 0 until read). An empty pipe is an
    empty dataset: refused (exit 2), and nothing is left behind."""
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import File

    def submit(data: bytes) -> subprocess.CompletedProcess:
        args = ["submit", "generate", "--model", str(tiny_model), "--input", "/dev/stdin", "--gpus", "0"]
        return subprocess.run(
            [sys.executable, "-m", "api", *args], input=data, env=cli_env, cwd=ROOT, capture_output=True, timeout=120
        )

    piped = submit(b"".join(json.dumps({"prompt": f"hi {i}"}).encode() + b"\n" for i in range(5000)))
    assert piped.returncode == 0, piped.stderr
    job = json.loads(jobs(cli_env, "status", piped.stdout.decode().strip(), "--json", check=True).stdout)
    assert job["rows"]["total"] == 5000
    empty = submit(b"")
    assert empty.returncode == 2 and b"the dataset is empty" in empty.stderr, empty.stderr
    with session_scope() as session:
        assert session.scalar(select(func.count()).select_from(File)) == 1  # the piped job's only


def test_a_full_disk_under_stdout_is_one_line_not_a_traceback(tmp_path, cli_env, tiny_model):
    """`results ID > out.jsonl` or `list > jobs.txt` on a full disk (/dev/full) says so in one line and exits 1;
    it ended with a traceback."""
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}] + ["{not json"] * 100)
    job_id = jobs(
        cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True
    ).stdout.strip()
    for args in (["results", job_id, "--errors"], ["list"], ["status", job_id, "--json"]):
        with open("/dev/full", "w") as full:
            ran = subprocess.run(
                [sys.executable, "-m", "api", *args], env=cli_env, cwd=ROOT, stdout=full, stderr=subprocess.PIPE
            )
        assert (ran.returncode, ran.stderr.decode()) == (
            1,
            "Error: No space left on device: free some space, or write elsewhere\n",
        ), args


def test_models_pull_wait_writes_a_line_per_change_off_a_terminal(tmp_path, cli_env):
    """`models pull --workers all --wait` with stderr not a terminal (a log file, CI) writes a line each time the
    hosts' state changes, and stdout holds the JSON alone: it redrew one line with carriage returns every second,
    which a log keeps as one line of every redraw."""
    from sqlalchemy import select

    from core import model_cache, registry
    from core.db import session_scope
    from core.models import CachedModel
    from tests.conftest import Proc, wait_for

    with session_scope() as session:  # a live worker's registration, with the Hugging Face cache of its host
        hub = {"hub": {"cache": str(tmp_path / "cache")}}
        registry.register(
            session, name="w1", host="host-t", pid=os.getpid(), slice="", queues=["cpu"], gpus=[], capabilities=hub
        )
    err = tmp_path / "pull.err"
    args = ["models", "pull", "acme/tiny", "--workers", "all", "--wait", "--json"]
    with open(err, "w") as stderr:
        popen = subprocess.Popen(
            [sys.executable, "-m", "api", *args], env=cli_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr
        )
    proc = Proc(popen, err)

    def move_to(state: str, **values) -> None:
        with session_scope() as session:
            row = session.scalars(select(CachedModel).where(CachedModel.repo == "acme/tiny")).one()
            model_cache.update_row(session, row.id, state=state, **values)

    try:
        wait_for(lambda: "pull_requested" in err.read_text(), 60, "the pull's first progress", procs=[proc])
        move_to("downloading", bytes_done=1024, bytes_total=4096)
        wait_for(lambda: "downloading" in err.read_text(), 60, "the download's progress", procs=[proc])
        move_to("ready", bytes=4096, files=3)
        out = popen.communicate(timeout=60)[0]
    finally:
        proc.stop()
    assert popen.returncode == 0 and [r["state"] for r in json.loads(out)] == ["ready"]
    lines = err.read_text().split("\n")
    assert "\r" not in err.read_text() and lines[0] == "host-t: pull_requested", lines
    assert lines[1].startswith("host-t: downloading 1") and lines[2:] == [""], lines


def ignore_job_control_signals() -> None:
    """What a non-interactive shell does to a command it starts in the background (`cmd &`), and nohup to SIGHUP."""
    import signal

    for sig in (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


def test_up_in_the_foreground_stops_everything_on_ctrl_c_even_with_sigint_ignored_by_its_parent(tmp_path):
    """`gpujobs up` without --detach stays in the foreground; Ctrl-C (SIGINT) stops Redis, the API and the
    worker it started and removes its stack file, even when it inherited SIGINT as ignored (a CI runner started in
    the background by a non-interactive shell: Python then installs no KeyboardInterrupt handler, and this test
    failed in the whole suite only)."""
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, wait_for

    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBS_") and k != "CUDA_VISIBLE_DEVICES"}
    env["JOBS_HOME"] = str(tmp_path / "home")
    stack_file = tmp_path / "home" / "run" / "stack.json"
    # its output goes to a file, never to a pipe nobody reads (a full pipe would block `up` and what inherits it)
    out = tmp_path / "up.log"
    with open(out, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "api", "up", "--port", str(free_port())],
            env=env,
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            preexec_fn=ignore_job_control_signals,
        )
    try:

        def healthy():
            return (
                stack_file.exists()
                and json.loads(stack_file.read_text()).get("workers")
                and jobs(env, "workers", "--json").returncode == 0
                and any(w["state"] == "online" for w in json.loads(jobs(env, "workers", "--json").stdout))
            )

        wait_for(healthy, 120, "the foreground stack")
        wait_for(lambda: "Ctrl-C stops it" in out.read_text(), 60, "up to say it runs in the foreground")
        stack = json.loads(stack_file.read_text())
        time.sleep(1)
        assert proc.poll() is None, "up returned instead of staying in the foreground"
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)  # `down` gives each group (workers, API, Redis) 30 s before SIGKILL: 90 s at worst
        except subprocess.TimeoutExpired:
            pytest.fail(f"up did not stop within 120 s of SIGINT; its output:\n{out.read_text()}")
    finally:
        if proc.poll() is None:
            proc.kill()
    pids = [stack["redis"], stack["api"], *stack["workers"]]
    assert not any(
        os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z" for p in pids
    )
    assert not stack_file.exists()
    assert proc.returncode == 0 and "SIGINT: stopping the stack" in out.read_text()


def test_submit_reads_a_spec_file_and_flags_override_it(tmp_path, cli_env, spawn_worker, tiny_model):
    """`--spec job.yaml` supplies the spec; a flag given too wins over the file."""
    spawn_worker([])
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "What is the capital of France?"}])
    spec = tmp_path / "job.yaml"
    spec.write_text(f"kind: generate\nmodel: {tiny_model}\ninput: {data}\nmax_new_tokens: 2\nname: from-file\n")
    job_id = jobs(
        cli_env, "submit", "generate", "--spec", str(spec), "--max-new-tokens", "16", "--wait", check=True
    ).stdout.strip()
    job = json.loads(jobs(cli_env, "status", job_id, "--json", check=True).stdout)
    assert job["name"] == "from-file" and job["spec"]["max_new_tokens"] == 16
    assert json.loads(jobs(cli_env, "results", job_id, check=True).stdout)["output"] == "Paris."
    wrong_kind = jobs(cli_env, "submit", "finetune", "--spec", str(spec))
    assert (
        wrong_kind.returncode == 2
        and (
            "kind 'generate' (from --spec or --set) does not match `submit finetune`: leave kind out, or submit it "
            "with `gpujobs submit generate`"
        )
        in wrong_kind.stderr
    )


def test_api_url_and_token_options_override_their_environment_variables_and_show_them_in_help(jobs_env, api_server):
    """--api-url/--token (env JOBS_API_URL/JOBS_TOKEN, shown in --help) reach the API; a wrong token from the
    environment is overridden by --token, a wrong one given by option is refused (exit 2), an unreachable URL exits 3."""
    url, token, _ = api_server
    env = {**jobs_env.env, "JOBS_API_URL": url, "JOBS_TOKEN": "jt_wrong"}
    help_text = jobs(env, "--help", check=True).stdout
    assert "[env var: JOBS_API_URL]" in help_text and "[env var: JOBS_TOKEN]" in help_text
    assert jobs(env, "list", "--json").returncode == 2  # the environment's wrong token
    listed = jobs(env, "--token", token, "list", "--json", check=True)
    assert json.loads(listed.stdout) == []
    assert jobs({**env, "JOBS_TOKEN": token}, "--token", "jt_wrong", "list").returncode == 2
    unreachable = jobs({**env, "JOBS_TOKEN": token}, "--api-url", f"http://127.0.0.1:{free_port()}", "list")
    assert unreachable.returncode == 3 and "cannot reach the jobs API" in unreachable.stderr


def test_without_JOBS_API_URL_the_cli_reaches_an_api_listening_on_an_ipv6_JOBS_API_HOST(tmp_path, jobs_env):
    """On an API host whose settings say JOBS_API_HOST=::1 (or ::), the CLI's default URL was `http://::1:PORT`
    and every command died with a traceback on its port; it is `http://[::1]:PORT` now and reaches the API."""
    import httpx

    from core import auth
    from core.db import session_scope
    from tests.conftest import Proc, wait_for

    with session_scope() as session:
        token = auth.create_token(session, owner="alice", scopes=["user"], name="tests")
    port = free_port()
    env = dict(jobs_env.env, JOBS_API_HOST="::1", JOBS_API_PORT=str(port), JOBS_TOKEN=token)
    with open(tmp_path / "api.log", "wb") as out:
        popen = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "api.app:app", "--host", "::1", "--port", str(port)],
            env=env,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    api = Proc(popen, tmp_path / "api.log")
    try:

        def healthy() -> bool:
            try:
                return httpx.get(f"http://[::1]:{port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, 60, "the API on ::1", procs=[api])
        listed = jobs(env, "list", "--json")
        assert (listed.returncode, listed.stdout.strip()) == (0, "[]"), listed.stderr
        help_text = " ".join(jobs(env, "--help", check=True).stdout.split())
        assert "else http://$JOBS_API_HOST:$JOBS_API_PORT" in help_text, help_text
    finally:
        api.stop()
    unreachable = jobs(env, "list")
    assert unreachable.returncode == 3, unreachable.stderr
    assert f"cannot reach the jobs API at http://[::1]:{port}" in unreachable.stderr, unreachable.stderr


def test_wait_timeout_exits_124_and_retry_of_a_live_job_exits_2(tmp_path, cli_env, tiny_model):
    """`wait --timeout` on a job that has not ended exits 124 (not 1, a failed job's code) and says the job goes on;
    `retry` of a job that has not finished is a usage error (exit 2) that says what to do; nothing changes."""
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}] * 2)
    job_id = jobs(
        cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True
    ).stdout.strip()  # no worker: it stays queued
    waited = jobs(cli_env, "wait", job_id, "--timeout", "0.5")
    assert waited.returncode == 124, waited.stderr
    assert f"job {job_id} is still running" in waited.stderr and f"gpujobs cancel {job_id}" in waited.stderr
    retried = jobs(cli_env, "retry", job_id)
    assert retried.returncode == 2, retried.stderr
    assert "retry a job once it has finished" in retried.stderr and f"gpujobs cancel {job_id}" in retried.stderr
    status = json.loads(jobs(cli_env, "status", job_id, "--json", check=True).stdout)
    assert status["state"] == "running" and status["retries"] == 0


def test_lists_never_stop_without_saying_so(tmp_path, cli_env, tiny_model):
    """`events ID` prints every event (607, not the first 500 of one page), `GET /events` says X-Has-More while a
    page was cut, and `list --limit N` says on stderr when older jobs exist beyond the N it shows."""
    from core.db import session_scope
    from core.store import add_event

    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    ids = [
        jobs(
            cli_env, "submit", "generate", "--model", str(tiny_model), "--input", data, "--gpus", "0", check=True
        ).stdout.strip()
        for _ in range(2)
    ]
    with session_scope() as session:
        stored = len(jobs(cli_env, "events", ids[0], "--json", check=True).stdout.splitlines())
        for i in range(607 - stored):
            add_event(session, ids[0], f"note {i}")
    printed = jobs(cli_env, "events", ids[0], check=True).stdout.splitlines()
    assert len(printed) == 607 and printed[-1].endswith(f"note {606 - stored}")
    import httpx

    page = httpx.get(
        f"{cli_env['JOBS_API_URL']}/jobs/{ids[0]}/events",
        params={"limit": 600},
        headers={"Authorization": f"Bearer {cli_env['JOBS_TOKEN']}"},
    )
    assert len(page.json()) == 600 and page.headers["X-Has-More"] == "true"
    rest = httpx.get(
        f"{cli_env['JOBS_API_URL']}/jobs/{ids[0]}/events",
        params={"after": page.json()[-1]["id"]},
        headers={"Authorization": f"Bearer {cli_env['JOBS_TOKEN']}"},
    )
    assert len(rest.json()) == 7 and rest.headers["X-Has-More"] == "false"
    cut = jobs(cli_env, "list", "--limit", "1", check=True)
    assert cut.stdout.splitlines()[1].split()[0] == ids[1]
    assert f"older jobs exist: the next page is --after {ids[1]}" in cut.stderr
    rest = jobs(cli_env, "list", "--limit", "1", "--after", ids[1], check=True)  # the next page: the older job
    assert [line.split()[0] for line in rest.stdout.splitlines()[1:]] == [ids[0]] and "older" not in rest.stderr
    whole = jobs(cli_env, "list", "--limit", "2", check=True)
    assert len(whole.stdout.splitlines()) == 1 + 2 and "older jobs exist" not in whole.stderr
    gone = jobs(cli_env, "list", "--after", "job_000000000000")
    assert gone.returncode == 2 and "no job 'job_000000000000'" in gone.stderr


def test_a_retry_starts_a_new_run_that_status_and_events_show_apart_from_the_old(
    tmp_path, cli_env, spawn_worker, tiny_model
):
    """After cancel and retry, `status` shows run 2 without run 1's "done in", `events` shows run 2's events
    (`--run 1` and `--all-runs` the history), and run 2's duration starts at its own first claim, not counting the
    idle time between the cancel and the retry."""
    import time

    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "What is the capital of France?"}] * 2)
    job_id = jobs(
        cli_env,
        "submit",
        "generate",
        "--model",
        str(tiny_model),
        "--input",
        data,
        "--gpus",
        "0",
        "--max-new-tokens",
        "4",
        check=True,
    ).stdout.strip()  # no worker yet: it waits
    jobs(cli_env, "cancel", job_id, check=True)
    assert "done in" in jobs(cli_env, "status", job_id, check=True).stdout  # run 1's numbers, while it is current
    retried_at = time.time()
    jobs(cli_env, "retry", job_id, check=True)
    status = jobs(cli_env, "status", job_id, check=True).stdout
    assert "run      2" in status and "done in" not in status, status
    view = json.loads(jobs(cli_env, "status", job_id, "--json", check=True).stdout)
    assert view["run"] == 2 and "duration_s" not in view["metrics"] and view["started_at"] is None
    assert [(r["run"], r["state"]) for r in view["metrics"]["runs"]] == [(1, "cancelled")]
    now = jobs(cli_env, "events", job_id, check=True)
    assert "retry of 2 rows requested" in now.stdout and "submitted by" not in now.stdout
    assert "run 2 of job" in now.stderr
    old = jobs(cli_env, "events", job_id, "--run", "1", check=True).stdout
    assert "submitted by" in old and "cancel requested" in old and "retry of" not in old
    both = jobs(cli_env, "events", job_id, "--all-runs", check=True).stdout
    assert "[run 1] submitted by" in both and "[run 2] job → queued: retry of 2 rows" in both
    beyond = jobs(cli_env, "events", job_id, "--run", "3")
    assert beyond.returncode == 2 and f"job {job_id} has runs 1 to 2: give one of them" in beyond.stderr

    spawn_worker([])
    done = json.loads(jobs(cli_env, "wait", job_id, "--json").stdout)
    assert done["state"] == "succeeded" and done["started_at"] >= retried_at
    assert done["metrics"]["duration_s"] <= done["finished_at"] - retried_at
    history = jobs(cli_env, "status", job_id, "--all-runs", check=True).stdout
    assert "done in" in history and "run 1    cancelled" in history, history


def test_read_commands_say_what_they_show(tmp_path, cli_env):
    """`results` says on stderr how many rows it gave ("0 failed rows", "1 failed row"), also for CSV (a quoted
    line break is one row); `list` and `workers` have a header row (`--json` none); counts agree in number ("1
    shard"); `submit generate --help` names every input format; a path that is neither here nor on the API's host
    says where each was looked for."""
    from core import registry
    from core.db import session_scope
    from tests.test_bad_input import fake_model

    assert jobs(cli_env, "workers", check=True).stdout == ""  # none yet: stderr says so, no header alone

    model = fake_model(tmp_path / "model")
    data = write_rows(tmp_path / "d.jsonl", [{"prompt": 'hi\nthere, "you"'}, "{broken"])
    job_id = jobs(
        cli_env, "submit", "generate", "--model", str(model), "--input", data, "--gpus", "0", check=True
    ).stdout.strip()  # no worker: row 1 stays pending, row 2 failed at submit
    for args, stdout_lines, said in (
        ([], 0, "0 finished rows"),
        (["--errors"], 1, "1 failed row"),
        (["--errors", "--format", "csv"], None, "1 failed row"),
        (["--format", "csv", "--with-input"], 1, "0 finished rows"),
    ):
        result = jobs(cli_env, "results", job_id, *args, check=True)
        assert result.stderr == said + "\n", args
        assert stdout_lines is None or len(result.stdout.splitlines()) == stdout_lines, (args, result.stdout)
    assert jobs(cli_env, "results", job_id, "--format", "csv", "--with-input", check=True).stdout.startswith(
        "custom_id,line,prompt,output,"
    )
    out = tmp_path / "errors.csv"
    written = jobs(cli_env, "results", job_id, "--errors", "--format", "csv", "-o", str(out), check=True)
    assert written.stderr == f"1 failed row written to {out}\n"
    wrong = jobs(cli_env, "results", "job_000000000000", "-o", str(out))  # a typo in the id: the file stays as it was
    assert wrong.returncode == 2 and "no job 'job_000000000000'" in wrong.stderr  # 1 is a failed job's
    assert out.read_text().startswith("custom_id,line,error")
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []
    nowhere = tmp_path / "no" / "x.jsonl"
    refused = jobs(cli_env, "results", job_id, "-o", str(nowhere))
    assert (refused.returncode, refused.stderr) == (
        2,
        f"Error: -o {nowhere}: there is no folder '{nowhere.parent}': create it first\n",
    )
    dash = jobs(cli_env, "results", job_id, "--errors", "-o", "-", check=True)  # -: stdout
    assert len(dash.stdout.splitlines()) == 1 and dash.stderr == "1 failed row\n"

    # an id that is no job id never reaches the API (an empty $ID, or a path that would reach another route)
    for command in (["status"], ["wait"], ["events"], ["cancel"], ["results"], ["adapters", "show"]):
        for bad in ("", "../workers"):
            refused = jobs(cli_env, *command, bad)
            assert (refused.returncode, refused.stdout) == (2, ""), (command, bad, refused.stderr)
            what = "an adapter" if command[0] == "adapters" else "a job"
            assert refused.stderr.startswith(f"Error: {bad!r} is not {what} id (job_ and 12 hex digits"), refused.stderr
            assert ("is empty" in refused.stderr) == (bad == ""), refused.stderr
    looked = jobs(cli_env, "wait", job_id, "--timeout", "0")  # 0: one look (it waited for ever)
    assert looked.returncode == 124 and f"job {job_id} is still running after 0.0 s" in looked.stderr
    for bad in ("-1", "nan", "inf"):
        assert jobs(cli_env, "wait", job_id, "--timeout", bad).returncode == 2, bad
        refused = jobs(cli_env, "quota", "set", "alice", "--max-gpu-seconds-per-day", bad)
        assert refused.returncode == 2 and "is not a number of seconds (0 or more)" in refused.stderr, refused.stderr

    listed = jobs(cli_env, "list", check=True).stdout.splitlines()
    assert listed[0].split() == ["job", "state", "priority", "done/rows", "kind", "model"]
    assert listed[1].split()[:4] == [job_id, "running", "normal", "1/2"]
    assert "1 shard of up to 256 rows queued" in jobs(cli_env, "events", job_id, check=True).stdout
    status = jobs(cli_env, "status", job_id, check=True).stdout
    assert "queued   1 shard, position 1 (0 shards ahead)" in status

    helped = " ".join(jobs(cli_env, "submit", "generate", "--help", check=True).stdout.split())
    assert "JSONL" in helped and "CSV, Parquet or a save_to_disk directory" in helped and "JSONL dataset" not in helped

    missing = jobs(cli_env, "submit", "generate", "--model", str(model), "--input", "nosuch.csv", "--gpus", "0")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith(
        f"Error: --input nosuch.csv: no such file or directory in the CLI's working folder ({ROOT}), so it was "
        "sent as a path on the API's host; there: dataset path 'nosuch.csv' does not exist on the API's host "
        "(looked for "
    )

    gpu = {"name": "NVIDIA H100", "uuid": "GPU-1"}
    with session_scope() as session:  # a live worker and a stopped one, registered as workers register
        registry.register(session, name="w1-cpu@a", host="a", pid=1, slice="", queues=["cpu"], gpus=[], capabilities={})
        registry.register(
            session, name="w2-gpu0@b", host="b", pid=2, slice="0", queues=["gpu1"], gpus=[gpu], capabilities={}
        )
        registry.stopped(session, "w2-gpu0@b", exit_code=-9, reason="killed by SIGKILL")
    header, *lines = jobs(cli_env, "workers", check=True).stdout.splitlines()
    assert header.split() == ["worker", "state", "restarts", "queues", "last", "seen", "gpus", "or", "exit"]
    rows = {line.split()[0]: line for line in lines}
    assert rows["w1-cpu@a"].split()[1:4] == ["online", "0", "cpu"] and rows["w1-cpu@a"].endswith("s ago  CPU")
    assert rows["w2-gpu0@b"].split()[1:4] == ["offline", "0", "gpu1"]
    assert rows["w2-gpu0@b"].endswith("s ago  exit -9: killed by SIGKILL")
    assert {header.index("state")} == {line.index(line.split()[1]) for line in lines}  # the columns line up
    listed = json.loads(jobs(cli_env, "workers", "--json", check=True).stdout)  # no header: JSON as before
    assert sorted((w["name"], w["state"], w["gpus"]) for w in listed) == [
        ("w1-cpu@a", "online", []),
        ("w2-gpu0@b", "offline", [gpu]),
    ]


def failed_rows_job(tmp_path, cli_env, failed: int) -> str:
    """A job of one good row and `failed` unreadable ones on a CPU slice no worker serves: its failed rows are
    there at submit (`results --errors`), and nothing else changes."""
    from tests.test_bad_input import fake_model

    data = write_rows(tmp_path / "d.jsonl", [{"prompt": "hi"}] + ["{broken"] * failed)
    command = ["submit", "generate", "--model", str(fake_model(tmp_path / "model")), "--input", data, "--gpus", "0"]
    return jobs(cli_env, *command, check=True).stdout.strip()


def test_results_o_writes_a_fifo_in_place_and_a_links_target(tmp_path, cli_env):
    """`results -o` replaces only a regular file: a FIFO (as bash's `>(…)`, /dev/stdout or a device) is written as
    it is, and a symbolic link's target is replaced, the link kept. The rename over the path made either a regular
    file (as root, `-o /dev/null` replaced /dev/null), and as another user it failed with a traceback."""
    import stat

    job_id = failed_rows_job(tmp_path, cli_env, 3)
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # open before the writer, which then does not block
    try:
        written = jobs(cli_env, "results", job_id, "--errors", "-o", str(fifo), check=True)
        assert written.stderr == f"3 failed rows written to {fifo}\n"
        assert stat.S_ISFIFO(fifo.stat().st_mode)
        assert len(os.read(reader, 1 << 16).splitlines()) == 3
    finally:
        os.close(reader)
    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text("old\n")
    link.symlink_to(target.name)
    jobs(cli_env, "results", job_id, "--errors", "-o", str(link), check=True)
    assert link.is_symlink() and len(target.read_text().splitlines()) == 3
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".part")] == []


def test_results_o_makes_a_file_with_the_umasks_mode_and_keeps_a_replaced_files(tmp_path, cli_env):
    """A file `results -o` makes has the mode `> file` would give it (0666 less the umask: 0644 under 022), and a
    file it replaces keeps its own (0640 stays 0640); both were 0600, the temporary file's, so another user or a
    web server could no longer read results that a script rewrote."""
    import stat

    job_id = failed_rows_job(tmp_path, cli_env, 1)

    def results_o(path, umask: int) -> int:
        subprocess.run(
            [sys.executable, "-m", "api", "results", job_id, "--errors", "-o", str(path)],
            env=cli_env, cwd=ROOT, check=True, capture_output=True, preexec_fn=lambda: os.umask(umask),
        )  # fmt: skip
        return stat.S_IMODE(path.stat().st_mode)

    assert results_o(tmp_path / "new.jsonl", 0o022) == 0o644
    assert results_o(tmp_path / "private.jsonl", 0o077) == 0o600
    kept = tmp_path / "kept.jsonl"
    kept.write_text("old\n")
    kept.chmod(0o640)
    assert results_o(kept, 0o022) == 0o640 and kept.read_text().count("\n") == 1 and "invalid JSON" in kept.read_text()


def test_the_readmes_tables_have_as_many_cells_as_their_headers():
    """Every row of every table in README.md has the cells its header names (the exit-code table's row for 6 had a
    stray third cell)."""
    table: list[str] = []
    bad = []
    for line in [*(ROOT / "README.md").read_text().splitlines(), ""]:
        if line.startswith("|"):
            table.append(line)
            continue
        if table:
            width = _cells(table[0])
            bad += [row for row in table[2:] if _cells(row) != width]
            table = []
    assert not bad, bad


def _cells(row: str) -> int:
    return len(re.split(r"(?<!\\)\|", row.strip().strip("|")))  # `\|` inside a cell is not a border


def test_a_spec_file_and_set_read_exponent_numbers_as_numbers(tmp_path):
    """`learning_rate: 2e-4` is a number (YAML 1.1 would read a string, which the API's strict spec check refuses);
    words, `on` and dotted floats read as before."""
    from api.cli_submit import load_spec_file, parse_sets

    spec = tmp_path / "spec.yaml"
    spec.write_text("kind: finetune\nlearning_rate: 2e-4\nwarmup_steps: 10\nliger: on\nname: 1e5x\n")
    assert load_spec_file(str(spec)) == {
        "kind": "finetune",
        "learning_rate": 2e-4,
        "warmup_steps": 10,
        "liger": True,
        "name": "1e5x",
    }
    assert parse_sets(("learning_rate=1E-3", "epochs=2.5", "lr_scheduler=cosine")) == {
        "learning_rate": 1e-3,
        "epochs": 2.5,
        "lr_scheduler": "cosine",
    }
    # a file YAML cannot read names itself where the error is; one that is not UTF-8 is refused too (a traceback)
    from core.errors import InvalidInput

    spec.write_text("model: m\ninput: [unclosed\n")
    with pytest.raises(
        InvalidInput, match=f'(?s)cannot read spec file {re.escape(str(spec))}: .*in "{re.escape(str(spec))}", line 2'
    ):
        load_spec_file(str(spec))
    spec.write_bytes(b"\xff\xfe model: m")
    with pytest.raises(InvalidInput, match="cannot read spec file .*can't decode byte 0xff"):
        load_spec_file(str(spec))


def test_the_cli_imports_no_server_side_package():
    """`gpujobs` is called from shell scripts, often in loops: loading its commands imports none of the packages the
    server and the workers need (SQLAlchemy alone took 0.3 s of every call; `gpujobs --help` 0.47 -> 0.10 s on
    this 2-core machine). A command that runs the stack imports them when it runs."""
    heavy = ("sqlalchemy", "torch", "transformers", "celery", "redis", "fastapi")
    code = f"import sys, api.cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_each_submit_command_offers_only_what_its_kind_takes():
    """`submit finetune --help` offered --adapter (a fine-tune trains a new adapter: the spec refuses one), listed
    quantizations a fine-tune refuses and gave `--set engine=continuous` as its example. Each command's options and
    examples are now its kind's: every quantization its help names validates, every `--set` example is a field."""
    from api.cli import cli
    from core.spec import FinetuneSpec, GenerateSpec

    for kind, model in (("generate", GenerateSpec), ("finetune", FinetuneSpec)):
        params = {p.name: p for p in cli.commands["submit"].commands[kind].params}
        assert ("adapter" in params) == (kind == "generate"), kind
        methods = re.findall(r"(?:bnb|torchao)-\w+|\bfp8\b", params["quantization"].help)
        assert methods and all(
            model.model_validate({"model": "m", "input": "file_x", "quantization": m}).quantization for m in methods
        ), (kind, methods)
        examples = re.findall(r"(\w+)=", params["sets"].help.split("e.g.")[1])
        assert examples and set(examples) <= set(model.model_fields), (kind, examples)


def test_a_group_without_its_command_shows_its_help_not_an_error_around_it():
    """`gpujobs submit` (or `models`, `quota`…) without a command prints the group's help on stderr and exits 2 (a
    usage error); it printed "Error: Usage: …" with the whole help inside and "(see `gpujobs submit -h`)" after."""
    for group in ("submit", "models", "quota", "tokens", "adapters", "db"):
        shown = jobs(dict(os.environ), group)
        assert (shown.returncode, shown.stdout) == (2, ""), group
        assert shown.stderr.startswith(f"Usage: gpujobs {group} [OPTIONS] COMMAND [ARGS]...\n"), shown.stderr
        assert "Error" not in shown.stderr and "Commands:" in shown.stderr, shown.stderr


def test_demo_names_the_example_files_it_lacks_before_starting_anything(tmp_path):
    """`gpujobs demo --examples DIR` reads four files from DIR; its help named two, and a folder built from the help
    failed after the stack had started and the model had been built. A missing file is now refused at once (exit
    2, the files named) and nothing is started or written."""
    from click.testing import CliRunner

    from api.cli import cli

    examples = tmp_path / "examples"
    examples.mkdir()
    for name in ("qa.jsonl", "prompts.jsonl"):
        (examples / name).write_text((ROOT / "examples" / name).read_text())
    home = tmp_path / "home"
    result = CliRunner().invoke(cli, ["demo", "--examples", str(examples)], env={"JOBS_HOME": str(home)})
    assert result.exit_code == 2, result.output
    assert f"{examples} has no finetune.yaml, finetune_qa.jsonl" in result.output
    assert not home.exists()
    helped = " ".join(CliRunner().invoke(cli, ["demo", "--help"]).output.split())
    assert "qa.jsonl, finetune.yaml, finetune_qa.jsonl, prompts.jsonl" in helped


def test_a_set_value_yaml_cannot_read_is_refused_with_how_to_quote_it(tmp_path):
    """`--set guided_regex=[0-9]+` ended in a YAML traceback (exit 1); `--set stop=#` and `--set temperature=`
    silently read as nothing. Each is now refused (exit 2) saying how to write it, and the quoting it suggests
    reads back as the text given; `null` still clears a field. A kind that does not match the command says which
    command takes it."""
    from click.testing import CliRunner

    from api.cli import cli
    from api.cli_submit import parse_sets, submit_spec
    from core.errors import InvalidInput
    from core.spec import parse_spec

    for pair, said in (
        ("guided_regex=[0-9]+", "the value is not valid YAML"),
        ("stop=[", "the value is not valid YAML"),
        ("stop=#", "the value reads as nothing (`#` starts a YAML comment)"),
        ("stop=# END", "the value reads as nothing"),
        ("temperature=", "no value: give one, or null to clear the field"),
        (" =1", "expected key=value"),
    ):
        with pytest.raises(InvalidInput, match=re.escape(f"--set {pair!r}: {said}")):
            parse_sets((pair,))
    suggested = str(pytest.raises(InvalidInput, parse_sets, ("guided_regex=[0-9]{3}",)).value).split("--set ")[-1]
    assert shlex.split(suggested) == ["guided_regex='[0-9]{3}'"]
    assert parse_sets(tuple(shlex.split(suggested))) == {"guided_regex": "[0-9]{3}"}
    assert parse_sets(("adapter=null",)) == {"adapter": None}
    # a commit id YAML reads as a number (5e10293: a float, inf) is refused saying so, not as "a valid string"
    with pytest.raises(InvalidInput, match=r"revision: give a string, not the number inf \(.*quote it\)$"):
        parse_spec(submit_spec("generate", None, ("revision=5e10293",), {"model": "m", "input": "x"}))

    result = CliRunner().invoke(
        cli,
        ["submit", "generate", "--model", "m", "--input", "x.jsonl", "--set", "guided_regex=[0-9]+"],
        env={"JOBS_HOME": str(tmp_path / "home")},
    )
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert "quote it as YAML text" in result.output
    with pytest.raises(InvalidInput, match=r"kind 'finetune' .* `submit generate`: .* `gpujobs submit finetune`$"):
        submit_spec("generate", None, ("kind=finetune",), {"model": "m", "input": "x"})
