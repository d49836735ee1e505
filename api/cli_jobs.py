"""`gpujobs status|list|wait|results|events|cancel|retry|workers|dashboard|usage|quota`: commands that talk to the
HTTP API about jobs and the service (`gpujobs submit` is api/cli_submit.py)."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import tempfile
import time
import webbrowser
from pathlib import Path
from typing import Any

import click

from api.cli_base import Seconds, cli, client, emit, job_exit_code, json_option
from api.client import job_path
from core.errors import InvalidInput, WaitInterrupted
from core.hub import human_bytes
from core.text import counted


def _size(n: Any) -> str:
    return human_bytes(int(n or 0))


TERMINAL = ("succeeded", "failed", "cancelled")


# --- read ---------------------------------------------------------------------------------------------------


def wait_with_progress(api, job_id: str, timeout: float | None = None) -> dict[str, Any]:
    """Wait for the job with a progress bar on stderr; Ctrl-C stops the wait, not the job (WaitInterrupted: 130)."""
    job_path(job_id)  # a bad id is refused before the bar draws anything
    with (
        watching(job_id),
        click.progressbar(length=1, label=job_id, file=click.get_text_stream("stderr"), show_pos=True) as bar,
    ):

        def update(job: dict[str, Any]) -> None:
            rows = job["rows"]
            bar.length = max(rows["total"], 1)
            bar.update(rows["succeeded"] + rows["failed"] - bar.pos)
            bar.label = f"{job_id} {job['state']}"

        return api.wait(job_id, on_update=update, timeout=timeout)


@contextlib.contextmanager
def watching(job_id: str, what: str = "waiting for", again: str = "gpujobs wait {id}"):
    """Ctrl-C inside ends only the watching: the job goes on on the workers, so the command exits 130 (not 1, a
    failed job's code) saying how to watch it again, rather than with click's "Aborted!"."""
    try:
        yield
    except KeyboardInterrupt:
        raise WaitInterrupted(
            f"interrupted: stopped {what} {job_id}; Ctrl-C does not cancel the job: watch it again with "
            f"`{again.format(id=job_id)}`, or stop it with `gpujobs cancel {job_id}`"
        ) from None


def describe(job: dict[str, Any]) -> None:
    """A job for people: what every job has, then a generation job's tokens and rates or a fine-tune's training
    (a fine-tune generates nothing, so it shows no tokens, tok/s or first result)."""
    rows = job["rows"]
    click.echo(f"{job['id']}  {job['state']}  {job.get('name') or ''}".rstrip())
    click.echo(f"  model    {job['model']}  (queue {job['queue']}, priority {job.get('priority', 'normal')})")
    adapter = adapter_text(job)
    if adapter:
        click.echo(f"  adapter  {adapter}")
    place = job.get("scheduling")
    if place:
        click.echo(
            f"  queued   {counted(place['shards_queued'], 'shard')}, position {place['position']} "
            f"({counted(place['shards_ahead'], 'shard')} ahead); {place['waiting']}"
        )
    click.echo(
        f"  rows     {rows['succeeded']} succeeded, {rows['failed']} failed, {rows['pending']} pending "
        f"of {rows['total']}"
    )
    for d in job.get("downloads") or []:
        rate = f", {_size(d['rate_bytes_per_s'])}/s" if d.get("rate_bytes_per_s") else ""
        eta = f", ETA {d['eta_s']:.0f} s" if d.get("eta_s") is not None else ""
        click.echo(
            f"  download {d['repo']}@{(d['commit'] or '?')[:12]} on {d['host']}: {_size(d['bytes_done'])} of "
            f"{_size(d['bytes_total'])}{rate}{eta}"
        )
    model = (job.get("metrics") or {}).get("model")
    if model and model.get("commit"):
        click.echo(f"  commit   {model['repo']}@{model['revision']} = {model['commit']}")
    if job.get("run", 1) > 1:
        click.echo(
            f"  run      {job['run']} (a retry started it; what follows is this run's; earlier runs: "
            f"`gpujobs status {job['id']} --all-runs`)"
        )
    if job["kind"] == "finetune":
        _describe_training(job)
    else:
        _describe_generation(job)
    if job.get("error"):
        click.echo(f"  error    {job['error']}")


def adapter_text(job: dict[str, Any]) -> str | None:
    """The job's LoRA adapter for people: what the spec names and where it comes from, and once a worker loaded it,
    how (merged into the base or not) and its weights' hash; a fine-tune's own adapter is the job's id."""
    spec = job.get("spec") or {}
    if job["kind"] == "finetune":
        use = "use it: --adapter " + job["id"] if job["state"] == "succeeded" else "registered once this job succeeds"
        return f"{job['id']} (trained by this fine-tune; {use})"
    ref = spec.get("adapter")
    if not ref:
        return None
    if ref.startswith("job_"):
        source = "a fine-tune's"
    elif ref.startswith("file_"):
        source = "an uploaded file"
    else:
        source = f"a Hub repo, revision {spec.get('adapter_revision') or 'main'}"
    loaded = (job.get("load_options") or {}).get("adapter") or {}
    how = ""
    if loaded:
        merged = "merged into the base" if loaded.get("merged") else "unmerged"
        how = f"; loaded {merged}, sha256 {loaded.get('sha256', '?')[:12]}"
    return f"{ref} ({source}{how})"


def describe_runs(job: dict[str, Any]) -> None:
    """The job, then one line per earlier run (metrics.runs): how it ended, its duration, rate and rows."""
    describe(job)
    for r in (job.get("metrics") or {}).get("runs", []):
        numbers = [
            f"{r['duration_s']} s" if r.get("duration_s") is not None else None,
            f"{r['output_tok_s']} tok/s" if r.get("output_tok_s") is not None else None,
            f"{r['rows_succeeded']} rows succeeded, {r['rows_failed']} failed",
        ]
        error = f": {r['error']}" if r.get("error") else ""
        click.echo(f"  run {r['run']}    {r['state']}, {', '.join(n for n in numbers if n)}{error}")


def _describe_generation(job: dict[str, Any]) -> None:
    metrics, live = job.get("metrics") or {}, job.get("live") or {}
    click.echo(f"  tokens   {job['tokens']['prompt']} prompt, {job['tokens']['completion']} completion")
    if live:
        eta = f"{live['eta_s']:.0f} s" if live.get("eta_s") is not None else "unknown"
        click.echo(f"  rate     {live['tokens_per_s']} tok/s, {live['rows_per_s']} rows/s (last minute); ETA {eta}")
    if metrics.get("time_to_first_result_s") is not None:
        per_shard = metrics.get("shard_time_to_first_result_s")
        shards = (
            (
                f"; per shard {per_shard['min']}-{per_shard['max']} s after its claim "
                f"({counted(per_shard['shards'], 'shard')})"
            )
            if per_shard
            else ""
        )
        click.echo(f"  first    result {metrics['time_to_first_result_s']} s after the start{shards}")
    if metrics.get("output_tok_s") is not None:
        rows = f", {metrics['rows_per_s']} rows/s" if metrics.get("rows_per_s") is not None else ""
        click.echo(f"  done in  {metrics['duration_s']} s, {metrics['output_tok_s']} tok/s{rows}")


def _describe_training(job: dict[str, Any]) -> None:
    """Step, epoch, loss, training tok/s and ETA (the job's `training`: its current run's last logged step). The
    rate is the last step's while the job runs; once it ended, the run's (metrics.training.train_tokens_per_s, as
    `adapters show` gives it): one step's rate can be many times the run's."""
    training, metrics = job.get("training"), job.get("metrics") or {}
    run_rate = (metrics.get("training") or {}).get("train_tokens_per_s") if job["state"] in TERMINAL else None
    if training:
        loss = training.get("loss", training.get("train_loss"))
        parts = [
            f"step {training.get('step', 0)}/{training.get('max_steps') or '?'}",
            f"epoch {training.get('epoch') or 0:.2f}",
        ]
        parts += [f"loss {loss:.4f}"] if loss is not None else []
        if run_rate is not None:
            parts.append(f"{run_rate} training tok/s (whole run)")
        elif training.get("tokens_per_s") is not None:
            parts.append(f"{training['tokens_per_s']} training tok/s (last step)")
        eta = f"; ETA {training['eta_s']:.0f} s" if training.get("eta_s") is not None else ""
        click.echo(f"  training {', '.join(parts)}{eta}")
    elif job["state"] not in TERMINAL:
        click.echo("  training not started yet (no step logged)")
    if metrics.get("duration_s") is not None:
        click.echo(f"  done in  {metrics['duration_s']} s")


@cli.command()
@click.argument("job_id")
@click.option(
    "--all-runs",
    is_flag=True,
    help="also how each earlier run (before a retry) ended: state, duration, rate, rows (JSON: metrics.runs, always)",
)
@json_option("print the job as JSON")
def status(job_id: str, all_runs: bool, as_json: bool) -> None:
    """Show a job's state, progress, rates, ETA and metrics: of its current run (a retry starts a new one)."""
    emit(client().job(job_id), as_json, describe_runs if all_runs else describe)


@cli.command("list")
@click.option("--state", help="only jobs in this state")
@click.option(
    "--limit",
    type=click.IntRange(1, 1000),
    default=50,
    show_default=True,
    help="how many, newest first (stderr says when older jobs exist beyond them)",
)
@click.option("--after", metavar="JOB_ID", help="the jobs listed after this one: the next page")
@json_option()
def list_jobs(state: str | None, limit: int, after: str | None, as_json: bool) -> None:
    """List jobs, newest first."""

    def table(jobs):
        if not jobs:
            click.echo(f"no jobs{f' in state {state}' if state else ''}", err=True)
            return
        click.echo(f"{'job':<16}  {'state':<10} {'priority':<8} {'done':>7}/{'rows':<7} {'kind':<9} model")
        for j in jobs:
            done = j["rows"]["succeeded"] + j["rows"]["failed"]
            place = j.get("scheduling")
            waits = f"  [#{place['position']}, {place['waiting']}]" if place else ""
            click.echo(
                f"{j['id']:<16}  {j['state']:<10} {j.get('priority', 'normal'):<8} {done:>7}/"
                f"{j['rows']['total']:<7} {j['kind']:<9} {j['model']}{waits}"
            )

    found, more = client().jobs_page(state=state, limit=limit, after=after)
    emit(found, as_json, table)
    if more:
        click.echo(f"(older jobs exist: the next page is --after {found[-1]['id']})", err=True)


@cli.command()
@click.argument("job_id")
@click.option(
    "--timeout",
    type=Seconds(),
    help="give up after this many seconds (exit 124; the job goes on); 0: look once",
)
@json_option("print the finished job as JSON")
def wait(job_id: str, timeout: float | None, as_json: bool) -> None:
    """Wait for a job to end (progress on stderr); exit 0 succeeded, 1 failed/cancelled, 4 with failed rows,
    2 no such job of yours, 124 when --timeout passed first, 130 on Ctrl-C (the job goes on after both)."""
    job = wait_with_progress(client(), job_id, timeout=timeout)
    emit(job, as_json, describe)
    raise SystemExit(job_exit_code(job))


@cli.command()
@click.argument("job_id")
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False),
    help="write here, not to stdout: a file is replaced only once every row has come; a FIFO or device "
    "(/dev/stdout, >(…)) is written as it is; - is stdout",
)
@click.option("--errors", is_flag=True, help="failed rows (with their line and error) instead of results")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["jsonl", "openai", "csv", "parquet"]),
    default="jsonl",
    show_default=True,
    help="jsonl (ours), openai (Batch output file; with --errors its error file), csv, parquet",
)
@click.option(
    "--order",
    type=click.Choice(["input", "finished"]),
    default="input",
    show_default=True,
    help="input order, or the order rows finished",
)
@click.option(
    "--with-input",
    is_flag=True,
    help="put each row's prompt (or chat messages) beside its output, in every format (off by default: prompts are "
    "often far longer than outputs)",
)
def results(job_id: str, output: str | None, errors: bool, fmt: str, order: str, with_input: bool) -> None:
    """Finished rows (or, with --errors, failed rows); works while the job still runs. How many is said on
    stderr ("0 failed rows"). A fine-tune has none (exit 2): its adapter is `gpujobs adapters show ID`."""
    output = None if output == "-" else output
    if fmt == "parquet" and not output and sys.stdout.isatty():
        raise InvalidInput("Parquet is binary: write it to a file with -o FILE (or pipe stdout)")
    chunks = client().download(job_id, format=fmt, errors=errors, order=order, with_input=with_input)
    records = RecordCount(fmt)
    with opened(output) as (out, regular):
        for chunk in chunks:
            out.write(chunk)
            records.feed(chunk)
        out.flush()  # here, where a reader gone (`| head`) ends the command quietly (cli_base.reader_gone), not at exit
    rows = records.records(output if regular else None)
    noun = "failed row" if errors else "finished row"
    what = f"{records.size} bytes of Parquet" if rows is None else counted(rows, noun)
    click.echo(what + (f" written to {output}" if output else ""), err=True)


@contextlib.contextmanager
def opened(output: str | None):
    """Where `results` writes, and whether it is a regular file: stdout; a regular file, made or replaced whole
    (`replacing`; through a symbolic link, its target, so the link stays); or, written as it is, what is no regular
    file (/dev/stdout, /dev/null, a FIFO, bash's `>(…)`), which a rename over it would have replaced with one."""
    if output is None:
        yield click.get_binary_stream("stdout"), False
        return
    path = Path(output)
    target = Path(os.path.realpath(path)) if path.is_symlink() else path
    if path.exists() and not target.is_file():
        with open(path, "wb") as out:
            yield out, False
        return
    with replacing(target) as out:
        yield out, True


@contextlib.contextmanager
def replacing(path: Path):
    """A file written beside `path` and renamed over it once complete: a download that fails (a wrong id, the API
    gone, the connection cut) leaves a file already there as it was, and never a part of the results. It gets the
    mode of the file it replaces, or a new file's (0666 less the umask, as `> path` gives), not mkstemp's 0600."""
    if not path.parent.is_dir():
        raise InvalidInput(f"-o {path}: there is no folder {str(path.parent)!r}: create it first")
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        os.fchmod(fd, stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as out:
            yield out
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def _umask() -> int:
    mask = os.umask(0)  # reading it means setting it: put back at once
    os.umask(mask)
    return mask


class RecordCount:
    """The records of a results stream, counted as it passes: JSONL and OpenAI lines, CSV line ends outside quoted
    cells (a cell may hold a line break) less the header, and a Parquet file's rows from its footer once written
    to a file (None for Parquet on stdout)."""

    def __init__(self, fmt: str):
        self.fmt, self.size, self.ends, self.quoted = fmt, 0, 0, False

    def feed(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.fmt != "csv":
            self.ends += chunk.count(b"\n")
            return
        parts = chunk.split(b'"')  # between quotes, a doubled quote "" closes and reopens: the parity holds
        outside = parts[::2] if not self.quoted else parts[1::2]
        self.ends += sum(p.count(b"\n") for p in outside)
        self.quoted ^= (len(parts) - 1) % 2 == 1

    def records(self, path: str | None) -> int | None:
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            return pq.read_metadata(path).num_rows if path else None
        return max(self.ends - 1, 0) if self.fmt == "csv" else self.ends


@cli.command()
@click.argument("job_id")
@click.option(
    "--follow", "-f", is_flag=True, help="keep printing new events until the job ends (Ctrl-C: 130, the job goes on)"
)
@click.option(
    "--run",
    "run",
    type=click.IntRange(1),
    help="the events of this run (1, then one more per retry); default: the current run",
)
@click.option(
    "--all-runs",
    is_flag=True,
    help="every run's events as written, with the step events a resumed fine-tune ran again (marked superseded)",
)
@json_option("one JSON object per event")
def events(job_id: str, follow: bool, run: int | None, all_runs: bool, as_json: bool) -> None:
    """A job's events, every one (page after page): state changes, loads, errors, metrics. Each run (a retry
    starts one) has its own; the current run's are shown, each training step once."""
    if run and all_runs:
        raise InvalidInput("give --run N or --all-runs, not both")
    api = client()
    current = api.job(job_id).get("run", 1)
    if run and run > current:
        raise InvalidInput(
            f"job {job_id} has runs 1 to {current}: give one of them"
            if current > 1
            else f"job {job_id} has only run 1 (each retry starts the next)"
        )
    if current > 1 and not run and not all_runs:
        click.echo(f"(run {current} of job {job_id}: earlier runs with --run N or --all-runs)", err=True)
    scope = {"run": None, "superseded": True} if all_runs else {"run": run or "current"}
    after, ended = 0, False  # ended: seen in a terminal state: one more read gets the events its end wrote, then stop
    with watching(job_id, "following", "gpujobs events {id} --follow"):  # as Ctrl-C ends `tail -f`: 130
        while True:
            batch, more = api.events_page(job_id, after=after, **scope)
            for e in batch:
                after = e["id"]
                if as_json:
                    click.echo(json.dumps(e, default=str))
                else:
                    stamp = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
                    tags = (f"[run {e.get('run', 1)}] " if all_runs else "") + (
                        "(superseded) " if e.get("superseded") else ""
                    )
                    click.echo(f"{stamp} {e['level']:<5} {tags}{e['message']}")
            if more:
                continue  # the next page at once
            if not follow or (run and run < current) or (ended and not batch):
                return
            if not batch:
                # the state and its event are one transaction: a page read before it and a state read after it would
                # otherwise end the follow without the job's last events
                ended = api.job(job_id)["state"] in TERMINAL
                if not ended:
                    time.sleep(1.0)


@cli.command()
@click.argument("job_id")
@json_option("print the job as JSON")
def cancel(job_id: str, as_json: bool) -> None:
    """Cancel a job: running work stops within seconds, finished rows are kept."""
    emit(client().cancel(job_id), as_json, lambda j: click.echo(f"{j['id']} {j['state']}"))


@cli.command()
@click.argument("job_id")
@click.option(
    "--failed-only",
    is_flag=True,
    help="re-run only failed rows, not rows a cancel left unfinished (the job then ends cancelled again)",
)
@click.option(
    "--wait", "wait_", is_flag=True, help="wait for the retried job; exit with its code (Ctrl-C: 130, it goes on)"
)
@json_option("print the job as JSON")
def retry(job_id: str, failed_only: bool, wait_: bool, as_json: bool) -> None:
    """Re-open a finished job under the same id and re-run its failed rows. A job that has not finished is
    refused (exit 2): wait for it or cancel it first; so is an OpenAI batch past its 24 h completion window, and a
    fine-tune the worker refused for its spec and input (`cannot train as submitted: …`): submit a new one."""
    api = client()
    job = api.retry(job_id, failed_only=failed_only)
    if wait_:
        try:
            job = wait_with_progress(api, job_id)
        except WaitInterrupted:
            emit(job, as_json, lambda j: click.echo(j["id"]))  # retried all the same: said as without --wait
            raise
    emit(job, as_json, lambda j: click.echo(j["id"]))
    if wait_:
        raise SystemExit(job_exit_code(job))


@cli.command()
@click.option(
    "--all",
    "all_",
    is_flag=True,
    help="also workers that stopped over JOBS_STOPPED_WORKERS_SHOWN "
    "seconds (1 h) ago or were replaced by a newer worker on their host and slice",
)
@json_option()
def workers(all_: bool, as_json: bool) -> None:
    """Registered workers, a header row, then one row each: state (online, lost: no heartbeat, offline: stopped),
    restarts of their slot, queues, when last seen (its heartbeat, or its stop), and its GPUs or, for a stopped
    worker, its exit code and why it stopped. `--json`: what each registered, no header."""

    def table(ws: list[dict[str, Any]]) -> None:
        if not ws:
            more = "" if all_ else " (--all: also those stopped long ago)"
            click.echo(f"no workers{more}: start one with `gpujobs up` or `gpujobs worker`", err=True)
            return
        width = max(len("worker"), *(len(w["name"]) for w in ws))
        click.echo(f"{'worker':<{width}}  {'state':<7} {'restarts':>8} {'queues':<8} {'last seen':>10}  gpus or exit")
        for w in ws:
            click.echo(worker_line(w, width))

    emit(client().workers(all=all_), as_json, table)


def worker_line(w: dict, width: int) -> str:
    """A row of `workers`: a live worker's heartbeat age and GPUs, a stopped one's stop age, exit code and reason."""
    queues = ",".join(w["queues"])
    line = f"{w['name']:<{width}}  {w['state']:<7} {w.get('restarts') or 0:>8} {queues:<8}"
    if w["state"] != "offline":
        gpus = ", ".join(f"{g['name']} ({g['uuid']})" for g in w["gpus"]) or "CPU"
        return f"{line} {_ago(w['heartbeat_at']):>10}  {gpus}"
    code = f"exit {w['exit_code']}" if w.get("exit_code") is not None else "stopped"
    reason = f": {w['reason']}" if w.get("reason") else ""
    return f"{line} {_ago(w.get('stopped_at') or w['heartbeat_at']):>10}  {code}{reason}"


def _ago(at: float) -> str:
    return f"{time.time() - at:.0f}s ago"


@cli.command()
@click.option("--open", "open_", is_flag=True, help="also open it in this machine's web browser")
def dashboard(open_: bool) -> None:
    """Print a URL that opens the web dashboard signed in as your token's owner. It works once, within 60 s, and
    carries a one-time code, never the token: neither the server's access log nor the browser's history keeps
    anything that signs in again (README, "Dashboard and monitoring")."""
    url = client().dashboard_url()
    click.echo(url)
    click.echo("(this link signs in once, within 60 s; run `gpujobs dashboard` again for another)", err=True)
    if open_ and not webbrowser.open(url):
        click.echo("no web browser could be started here: open the link above yourself", err=True)


@cli.command()
@click.option("--owner", help="one owner's usage (admins; a user always sees their own)")
@click.option("--since", help="jobs created since: a duration (7d, 12h, 30m) or an ISO date (2026-01-31)")
@json_option()
def usage(owner: str | None, since: str | None, as_json: bool) -> None:
    """Usage per owner: jobs, rows, tokens, GPU-seconds (wall time × slice size) and engine seconds."""

    def table(data):
        click.echo(
            f"{'owner':<20} {'jobs':>6} {'rows ok':>9} {'failed':>7} {'prompt tok':>11} {'output tok':>11} "
            f"{'GPU-s':>10} {'engine-s':>10}"
        )
        for u in data["owners"] + ([{"owner": "total", **data["total"]}] if len(data["owners"]) > 1 else []):
            click.echo(
                f"{u['owner']:<20} {u['jobs']:>6} {u['rows_succeeded']:>9} {u['rows_failed']:>7} "
                f"{u['prompt_tokens']:>11} {u['completion_tokens']:>11} {u['gpu_seconds']:>10.1f} "
                f"{u['engine_seconds']:>10.1f}"
            )

    emit(client().usage(owner=owner, since=since), as_json, table)


@cli.group()
def quota() -> None:
    """Owners' quotas (admins): caps on the shards an owner runs at once and on its GPU-seconds per day; work over
    a cap waits queued."""


@quota.command("set")
@click.argument("owner")
@click.option(
    "--max-running-shards",
    type=click.IntRange(0),
    metavar="N",
    help="at most N of the owner's shards run at once (0 holds new work)",
)
@click.option(
    "--max-gpu-seconds-per-day",
    type=Seconds(),
    metavar="S",
    help="at most S GPU-seconds over the last 24 hours (a CPU shard counts 1 a second); past it new shards wait, "
    "running ones finish",
)
@click.option("--no-cap", is_flag=True, help="remove both of the owner's caps: the owner has no quota any more")
@click.option("--json", "as_json", is_flag=True, help="print the quota as JSON")
def quota_set(
    owner: str, max_running_shards: int | None, max_gpu_seconds_per_day: float | None, no_cap: bool, as_json: bool
) -> None:
    """Set OWNER's quota: `--max-running-shards N` and/or `--max-gpu-seconds-per-day S` (a cap not given stays as it
    is), or `--no-cap`. OWNER is a name as `tokens create --owner` takes it (no spaces or control characters)."""
    limits = {
        k: v
        for k, v in (("max_running_shards", max_running_shards), ("max_gpu_seconds_per_day", max_gpu_seconds_per_day))
        if v is not None
    }
    if bool(limits) == no_cap:
        raise InvalidInput("give --max-running-shards N and/or --max-gpu-seconds-per-day S, or --no-cap alone")
    if no_cap:
        limits = {"max_running_shards": None, "max_gpu_seconds_per_day": None}
    emit(client().set_quota(owner, **limits), as_json, lambda q: click.echo(quota_line(q)))


@quota.command("show")
@click.argument("owner", required=False)
@click.option("--json", "as_json", is_flag=True, help="print JSON")
def quota_show(owner: str | None, as_json: bool) -> None:
    """Every owner with a quota or with work queued or running (or only OWNER): caps, running and queued shards,
    GPU-seconds over the fair-share window and over the last 24 hours."""
    rows = [q for q in client().quotas() if owner is None or q["owner"] == owner]
    if owner is not None and not rows:
        rows = [
            {
                "owner": owner,
                "max_running_shards": None,
                "max_gpu_seconds_per_day": None,
                "running_shards": 0,
                "queued_shards": 0,
                "gpu_seconds": 0.0,
                "gpu_seconds_day": 0.0,
            }
        ]
    emit(
        rows,
        as_json,
        lambda qs: (
            [click.echo(quota_line(q)) for q in qs] or click.echo("no owner has a quota or work queued or running")
        ),
    )


def quota_line(q: dict[str, Any]) -> str:
    cap = "no cap" if q["max_running_shards"] is None else f"max {q['max_running_shards']} running shards"
    day = q.get("max_gpu_seconds_per_day")
    daily = f"{q.get('gpu_seconds_day', 0.0):.1f}" + (f" of {day:g}" if day is not None else "")
    return (
        f"{q['owner']:<20} {cap:<26} running {q['running_shards']:>4}  queued {q['queued_shards']:>6}  "
        f"{q['gpu_seconds']:>10.1f} GPU-s recently  {daily} GPU-s in 24 h"
    )
