"""`gpujobs up|down|worker|db|tokens|demo`: commands that run or manage local processes and the store."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from api.cli_base import cli, client, emit, job_exit_code, json_option
from api.cli_jobs import wait_with_progress
from core import writers
from core.errors import InvalidInput, JobsError
from core.settings import Settings, get_settings
from core.slices import parse_slice, parse_slices, worker_command, worker_env

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def port_option(help: str):  # noqa: A002  (click's own name for it)
    """`--port` of `up` and `demo`: JOBS_API_PORT (the setting the rest of the code reads), else its default."""
    return click.option(
        "--port",
        type=click.IntRange(1, 65535),
        metavar="PORT",
        default=lambda: get_settings().api_port,
        show_default=f"JOBS_API_PORT, else {Settings.api_port}",
        help=help,
    )


def host_option(help: str):  # noqa: A002  (click's own name for it)
    """`--host` of `up` and `demo`: JOBS_API_HOST (the setting the rest of the code reads), else its default."""
    return click.option(
        "--host",
        metavar="ADDRESS",
        default=lambda: get_settings().api_host,
        show_default=f"JOBS_API_HOST, else {Settings.api_host}",
        help=help,
    )


@cli.command()
@click.option(
    "--gpus",
    help="worker slices, ';' between workers: '0,1;2;3'; 'none' = one CPU worker "
    "(default: one worker per GPU that nvidia-smi lists, else one CPU worker)",
)
@host_option("API listen address (beyond loopback needs JOBS_MODEL_ROOTS and JOBS_DATA_ROOTS)")
@port_option("API port; one that another program listens on is refused before anything starts")
@click.option(
    "--detach",
    "-d",
    is_flag=True,
    help="return once the stack is healthy (a supervisor process keeps "
    "restarting workers); stop it with `gpujobs down`",
)
def up(gpus: str | None, host: str, port: int, detach: bool) -> None:
    """Start the local stack: Redis, migrations, the API and pinned workers, all under $JOBS_HOME.

    A worker that exits is restarted with backoff; a slot whose worker exited JOBS_RESTART_LIMIT times within
    JOBS_RESTART_WINDOW seconds, or with a configuration error (exit 2, 5, 6, 77, 78), stays down and `gpujobs
    workers` says why. In the foreground, Ctrl-C (or SIGTERM, SIGHUP) stops everything; so does `gpujobs down`.
    Exit codes: 0 stopped on request (or detached and healthy), 1 the stack failed to start or a part of it
    exited, 2 --port is in use (nothing was started) or JOBS_ARTIFACTS is not the store's artifacts directory,
    5 CUDA_VISIBLE_DEVICES contradicts --gpus, 130 interrupted while starting.
    """
    from api import stack
    from api.supervisor import StopSignals

    say = lambda m: click.echo(m, err=True)  # noqa: E731
    signals = StopSignals(say=say).install()  # before anything starts: whatever dispositions `up` inherited
    slices = parse_slices(gpus) if gpus is not None else None
    if host not in ("127.0.0.1", "localhost", "::1") and not (get_settings().model_roots and get_settings().data_roots):
        raise InvalidInput(f"--host {host} listens beyond loopback: set JOBS_MODEL_ROOTS and JOBS_DATA_ROOTS first")
    slices = stack.prepare(slices)
    stack.check_port(host, port)
    if not detach:
        _log_supervisor_to_stderr()
    sup = None
    try:
        started = stack.up(host=host, port=port, log=say, interrupted=signals.requested)
        sup = stack.start_workers(started, slices, detach=detach, log=say)
        started = stack.wait_healthy(started, sup=sup, interrupted=signals.requested)
    except BaseException:
        say("stopping what was started")
        stack.shutdown(sup, log=say)
        signals.restore()
        raise
    logs = get_settings().logs_dir
    for i, s in enumerate(started["slots"]):
        say(f"worker   slice {s['slice'] or 'none (CPU)'} (pid {s['pid']}, log {logs / f'worker-{i}.log'})")
    say(f"stack up: API {started['api_url']}, {len(started['slots'])} worker(s); home {get_settings().home}")
    if detach:
        signals.restore()
        return
    say("running in the foreground; Ctrl-C stops it")
    why = stack.supervise_stack(sup, started, signals.requested)
    say(f"{why}: stopping the rest" if why else f"{signals.received}: stopping the stack")
    stack.shutdown(sup, log=say)
    if why:
        raise JobsError(f"{why}: the stack was stopped; see the logs in {logs}")


def _log_supervisor_to_stderr() -> None:
    """The foreground supervisor's lines (a worker exited, restarted, stays down) on this terminal."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("supervisor")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


@cli.command()
def down() -> None:
    """Stop the local stack started by `gpujobs up`: its supervisor first (workers hand back their shards and are
    not restarted), then the API and Redis. Says what it stopped, or that nothing was running (exit 0 both)."""
    from api import stack

    if not stack.down(log=lambda m: click.echo(m, err=True)):
        click.echo(f"nothing to stop: no stack is running from {get_settings().home}", err=True)


@cli.command()
@click.option(
    "--gpus",
    required=True,
    help="this worker's slice: GPU indices as nvidia-smi shows them ('2,0'), or 'none' for a CPU worker",
)
@click.option("--loglevel", default="INFO", show_default=True, help="worker log level")
def worker(gpus: str, loglevel: str) -> None:
    """Run one worker in the foreground, pinned to a GPU slice (replaces this process: same pid). Not restarted
    when it exits: `gpujobs supervise`, systemd or compose do that.

    Sets CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES on the worker's own environment; refuses to
    start (exit 5) when an inherited CUDA_VISIBLE_DEVICES contradicts --gpus, exits 77 when Redis refuses the
    password of JOBS_REDIS_URL (never retried) and 78 when JOBS_ARTIFACTS is not the store's artifacts directory.
    A worker that joined the local stack's Redis exits (69) when that
    stack is stopped. Exit codes: README, "Supervised workers".
    """
    from api import stack

    devices = parse_slice(gpus)
    stack.check_inherited(devices)
    command = worker_command(devices) + ["--loglevel", loglevel]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, worker_env(devices))


@cli.command()
@click.option("--gpus", required=True, help="slices, ';' between workers: '0,1;2'; 'none' = one CPU worker")
@click.option(
    "--stop-timeout",
    default=120.0,
    show_default=True,
    help="seconds a worker gets to hand its shard back on SIGTERM before SIGKILL",
)
def supervise(gpus: str, stop_timeout: float) -> None:
    """Run one worker per slice in the foreground and restart a worker that exits, with the policy of `gpujobs up`
    (JOBS_RESTART_*); SIGTERM or Ctrl-C stops them. Workers write to this process's output (ops/launch-workers.sh
    starts one per slice). Exit codes: 0 stopped, 1 every slot stays down (the log says why), 5 as `worker`."""
    from api import stack
    from api.supervisor import supervise as run
    from core.logs import setup_logging

    slices = parse_slices(gpus)
    for devices in slices:
        stack.check_inherited_for_up(devices)
    setup_logging("INFO")
    raise SystemExit(run(slices, stop_timeout=stop_timeout))


@cli.group()
def db() -> None:
    """The SQL store."""


@db.command("upgrade")
def db_upgrade() -> None:
    """Apply the migrations to JOBS_DATABASE_URL (the embedded default does this on `gpujobs up`)."""
    from core.db import upgrade

    upgrade()
    click.echo(f"database at head: {get_settings().database_url.split('@')[-1]}", err=True)


@db.command("adopt-artifacts")
@click.option("--force", is_flag=True, help="adopt it even where it holds another store's marker (that store is gone)")
def db_adopt_artifacts(force: bool) -> None:
    """Make this host's JOBS_ARTIFACTS the store's artifacts directory (a repair).

    Every worker, the API and `gpujobs up` check that their JOBS_ARTIFACTS is the store's (its `.gpujobs-store`
    marker); a store adopts the first directory checked. Run this where the store's files really are when the
    wrong one was adopted, or the directory was replaced or restored: a directory with any other marker, or none,
    is refused from then on (a worker exits 78).
    """
    from core import artifacts

    store = artifacts.adopt(force=force)
    click.echo(f"{get_settings().artifacts} is the artifacts directory of store {store}", err=True)


@cli.group()
def tokens() -> None:
    """API tokens (admin; works directly on the database)."""


@tokens.command("create")
@click.option("--owner", required=True, help="the owner whose jobs this token submits and sees")
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    default=["user"],
    show_default=True,
    type=click.Choice(["user", "admin", "metrics", "priority"]),
    help="repeatable; priority (beside user) may submit priority high jobs",
)
@click.option("--name", help="a label")
def tokens_create(owner: str, scopes: tuple[str, ...], name: str | None) -> None:
    """Create a token and print it once (only its hash is stored)."""
    from core import auth
    from core.db import session_scope

    with session_scope() as session:
        token = auth.create_token(session, owner=owner, scopes=list(scopes), name=name)
    click.echo(token)  # only once stored: a token printed before a failed commit would exist nowhere


@tokens.command("list")
@json_option()
def tokens_list(as_json: bool) -> None:
    """List tokens, a header row, then one row each: id, owner, scopes, active or revoked, name (never the
    secrets). `--json`: the same fields, no header."""
    from core import auth
    from core.db import session_scope

    with session_scope() as session:
        rows = [
            {"id": t.id, "owner": t.owner, "scopes": t.scopes, "name": t.name, "revoked": t.revoked_at is not None}
            for t in auth.list_tokens(session)
        ]

    def table(ts: list[dict[str, Any]]) -> None:
        if not ts:
            click.echo("no tokens: create one with `gpujobs tokens create --owner NAME`", err=True)
            return
        click.echo(f"{'token':<16}  {'owner':<16} {'scopes':<20} {'state':<7} name")
        for t in ts:
            state = "revoked" if t["revoked"] else "active"
            click.echo(f"{t['id']:<16}  {t['owner']:<16} {t['scopes']:<20} {state:<7} {t['name'] or ''}".rstrip())

    emit(rows, as_json, table)


@tokens.command("revoke")
@click.argument("token_id")
def tokens_revoke(token_id: str) -> None:
    """Revoke a token by id."""
    from core import auth
    from core.db import session_scope

    with session_scope() as session:
        auth.revoke(session, token_id)


# what `demo` reads from --examples: the tiny model's answers, the fine-tune's spec and rows, the prompts
DEMO_FILES = ("qa.jsonl", "finetune.yaml", "finetune_qa.jsonl", "prompts.jsonl")


@cli.command()
@click.option(
    "--examples",
    type=click.Path(file_okay=False, exists=True),
    default=str(EXAMPLES),
    show_default=True,
    help="folder with the demo's files: " + ", ".join(DEMO_FILES),
)
@host_option("API listen address if the stack must be started")
@port_option("API port if the stack must be started")
@click.option("--keep-running/--stop", default=True, help="leave the stack up afterwards (default) or stop it")
def demo(examples: str, host: str, port: int, keep_running: bool) -> None:
    """Run a fine-tune and a generation job end to end on this machine: start the stack, build a tiny base model
    that knows no answer, fine-tune a LoRA adapter on examples/finetune_qa.jsonl through the service, then generate
    answers for examples/prompts.jsonl with that adapter (a chained job), and print them."""
    import yaml

    from api import stack

    if missing := [name for name in DEMO_FILES if not (Path(examples) / name).is_file()]:  # before anything starts
        raise click.BadParameter(f"{examples} has no {', '.join(missing)}", param_hint="--examples")
    settings = get_settings()
    if not stack.read_stack():
        click.echo("starting the local stack (`gpujobs up --detach`) ...", err=True)
        up.callback(gpus=None, host=host, port=port, detach=True)
    model = settings.home / "models" / "tiny-base"
    if not (model / "model.safetensors").exists():
        click.echo(f"building a tiny base model (untrained weights) into {model} ...", err=True)
        log = settings.logs_dir / "tinymodel.log"
        with open(log, "wb") as out:
            build = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "worker.tinymodel",
                    str(model),
                    "--base",
                    "--qa",
                    str(Path(examples) / "qa.jsonl"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=out,
                env=dict(os.environ, HF_HUB_OFFLINE="1"),
            )
        if build.returncode:
            raise JobsError(f"building the tiny model failed: see {log}")
    api = client()
    spec = yaml.safe_load((Path(examples) / "finetune.yaml").read_text())
    spec.update(
        model=str(model),
        name="demo fine-tune",
        input=api.upload(Path(examples) / "finetune_qa.jsonl")["id"],
        then_generate={
            "input": api.upload(Path(examples) / "prompts.jsonl")["id"],
            "max_new_tokens": 24,
            "name": "demo",
        },
    )
    finetune = api.submit(spec)
    click.echo(
        f"submitted fine-tune {finetune['id']} (`gpujobs events {finetune['id']} --follow` shows its training)",
        err=True,
    )
    finetune = wait_with_progress(api, finetune["id"])
    training = (finetune.get("metrics") or {}).get("training") or {}
    click.echo(
        f"fine-tune {finetune['state']}: {training.get('steps')} steps, final loss "
        f"{training.get('final_loss')}; adapter {finetune['id']}",
        err=True,
    )
    job_id = (finetune.get("metrics") or {}).get("then_generate_job")
    if finetune["state"] != "succeeded" or not job_id:
        raise JobsError(f"the demo fine-tune {finetune['state']}: {finetune.get('error')}")
    click.echo(f"generating with the adapter: job {job_id}", err=True)
    job = wait_with_progress(api, job_id)
    out = settings.home / "demo" / f"results-{job['id']}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = list(api.results(job["id"]))
    out.write_text("".join(map(writers.jsonl_line, rows)), encoding="utf-8")
    for r in rows:
        click.echo(f"  {r['custom_id']:<12} {r['output']!r}", err=True)
    click.echo(
        f"{job['state']}: {job['rows']['succeeded']} rows, {job['tokens']['completion']} tokens; results in {out}",
        err=True,
    )
    click.echo(str(out))
    if not keep_running:
        stack.down(log=lambda m: click.echo(m, err=True))
    else:
        click.echo(
            f"the demo's base model is {model} and its adapter is {finetune['id']}; a job of your own on them "
            f"(a JSONL of prompts, or a CSV with --column prompt=COLUMN):\n  {next_command(model, finetune['id'], examples)}"
            "\nthe stack is still up: try `gpujobs list`, `gpujobs status ID`, `gpujobs dashboard`; stop it with "
            "`gpujobs down`",
            err=True,
        )
    raise SystemExit(job_exit_code(job))


def next_command(model: Path, adapter: str, examples: str) -> str:
    """The command that runs a generation job on the demo's model and adapter, ready to paste."""
    prompts = Path(examples).resolve() / "prompts.jsonl"
    return shlex.join(
        ["gpujobs", "submit", "generate", "--model", str(model), "--adapter", adapter, "--input", str(prompts)]
        + ["--max-new-tokens", "24", "--wait"]
    )
