"""The `gpujobs` click group and what every command module shares: exit codes, error translation, output.
Commands are thin: parse, call the HTTP client or a stack function, format. They live in `api/cli_submit.py`,
`api/cli_jobs.py`, `api/cli_adapters.py`, `api/cli_models.py` and `api/cli_stack.py`; `api/cli.py` is the entry
point.

Exit codes (a contract for scripts; see README):
    0 succeeded    1 failed or cancelled (or an unexpected error)    2 usage or invalid input (also: an id that
    names no job of the caller's, a command the job's state or kind refuses such as `retry` of a job that has not
    finished, `cancel` of one that has, `results` of a fine-tune)    3 server, Redis or database unreachable
    4 succeeded with some failed rows
    5 CUDA_VISIBLE_DEVICES contradicts --gpus    124 `wait --timeout` gave up: the job goes on
    130 Ctrl-C: `gpujobs up` interrupted while starting (it stopped what it started), or a wait (`wait`, `--wait`,
    `events --follow`) stopped: the job goes on
    141 (killed by SIGPIPE, as `cat`) the reader of the output went away: `gpujobs results ID | head -1`

Why 124 for a timeout: a script must tell "the job failed" (1) from "I stopped waiting" (the job may still
succeed); 124 is what coreutils' `timeout(1)` exits with when its command outlived it, so scripts that already
handle `timeout` read it the same way, and it is far from the small codes above and from a worker's (core/exits.py).
"""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import sys
from typing import Any, NoReturn

import click

from core import errors

EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_PARTIAL, EXIT_GPU_CONFLICT, EXIT_INTERRUPTED = 1, 2, 3, 4, 5, 130
EXIT_TIMEOUT = 124
CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 110}
NO_ARGS_IS_HELP = getattr(click.exceptions, "NoArgsIsHelpError", ())  # click >= 8.2; 8.1 shows the help itself


def exit_code_for(exc: errors.JobsError) -> int:
    if isinstance(exc, errors.GpuConflict):
        return EXIT_GPU_CONFLICT
    if isinstance(exc, (errors.StartInterrupted, errors.WaitInterrupted)):
        return EXIT_INTERRUPTED
    if isinstance(exc, errors.WaitTimeout):
        return EXIT_TIMEOUT
    if isinstance(exc, errors.ServiceUnavailable):
        return EXIT_UNREACHABLE
    if isinstance(
        exc,
        (
            errors.InvalidInput,
            errors.Unschedulable,
            errors.Unauthorized,
            errors.Forbidden,
            errors.NotFound,  # a mistyped or foreign id: `wait "$ID" || resubmit` must not read it as a failed job
            errors.Conflict,  # a command the job's state refuses: `retry` of a running job, `cancel` of an ended one
            errors.WrongArtifacts,  # `up` with a JOBS_ARTIFACTS that is not the store's: a setting to fix
        ),
    ):
        return EXIT_USAGE
    return EXIT_FAILED


def job_exit_code(job: dict[str, Any]) -> int:
    if job["state"] != "succeeded":
        return EXIT_FAILED
    return EXIT_PARTIAL if job["rows"]["failed"] else 0


class Group(click.Group):
    """Turns our errors, and click's own usage errors (a bad option value, a missing argument), into one clear line
    and the documented exit code (2 for usage)."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except errors.JobsError as exc:
            click.echo(f"Error: {exc}", err=True)
            ctx.exit(exit_code_for(exc))
        except NO_ARGS_IS_HELP as exc:  # `gpujobs submit` alone: the group's help, not "Error: Usage: …" around it
            exc.show()
            ctx.exit(EXIT_USAGE)
        except click.UsageError as exc:  # click would print its usage line and a help hint on three more lines
            where = exc.ctx.command_path if exc.ctx else ctx.command_path
            click.echo(f"Error: {exc.format_message().rstrip('.')} (see `{where} -h`)", err=True)
            ctx.exit(EXIT_USAGE)
        except OSError as exc:
            if exc.errno == errno.EPIPE:
                reader_gone()
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            where = f" ({exc.filename})" if exc.filename else ""  # none for stdout (`results ID > out.jsonl`)
            click.echo(f"Error: {exc.strerror}{where}: free some space, or write elsewhere", err=True)
            ctx.exit(EXIT_FAILED)


def reader_gone() -> NoReturn:
    """The reader of our output went away (`gpujobs results ID | head -1`): end as `cat` does, silently and killed
    by SIGPIPE (a shell says 141), not with click's exit 1, which scripts read as a failed job. Python ignores
    SIGPIPE (a write to the closed pipe raises instead), so the default is put back and the signal sent; stdout and
    stderr point at /dev/null first, so that nothing buffered for the pipe is written, or complained about, after."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(devnull, stream.fileno())
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGPIPE)
    raise SystemExit(128 + signal.SIGPIPE)  # SIGPIPE blocked: the code a shell would report


class Seconds(click.ParamType):
    """A finite number of seconds, 0 or more: click's FloatRange lets `nan` and `inf` through, and JSON (the API's
    body) carries neither."""

    name = "seconds"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number) or number < 0:
            self.fail(f"{value!r} is not a number of seconds (0 or more)", param, ctx)
        return number


def emit(data: Any, as_json: bool, human) -> None:
    if as_json:
        click.echo(json.dumps(data, indent=2, default=str))
    else:
        human(data)


def json_option(help: str = "print JSON"):  # noqa: A002  (click's own name for it)
    """The `--json` flag of every command that prints something a script may read."""
    return click.option("--json", "as_json", is_flag=True, help=help)


def client():
    """The HTTP client, pointed where the group's --api-url/--token (or JOBS_API_URL/JOBS_TOKEN, or what `gpujobs up`
    wrote) say."""
    from api.client import Client  # httpx costs ~0.15 s of start-up: imported once a command talks to the API

    ctx = click.get_current_context(silent=True)
    where = (ctx.find_root().obj if ctx else None) or {}
    return Client(url=where.get("api_url"), token=where.get("token"))


@click.group(cls=Group, context_settings=CONTEXT)
@click.version_option(package_name="gpujobs")
@click.option(
    "--api-url",
    envvar="JOBS_API_URL",
    show_envvar=True,
    metavar="URL",
    help="the jobs API [default: the one `gpujobs up` started, else http://$JOBS_API_HOST:$JOBS_API_PORT, i.e. http://127.0.0.1:8765 unless set]",
)
@click.option(
    "--token",
    envvar="JOBS_TOKEN",
    show_envvar=True,
    metavar="TOKEN",
    help="bearer token for the API [default: the local admin token `gpujobs up` wrote]",
)
@click.pass_context
def cli(ctx: click.Context, api_url: str | None, token: str | None) -> None:
    """gpujobs: queued generation and LoRA fine-tune jobs on GPU workers.

    Start a local stack with `gpujobs up`, submit with `gpujobs submit generate`, read with `gpujobs status` and
    `gpujobs results`. Other settings come from JOBS_* environment variables (see README).
    """
    ctx.obj = {"api_url": api_url, "token": token}
