"""`gpujobs models list|pull|rm`: Hub models in the hosts' Hugging Face caches (core/hub.py, core/model_cache.py).

`pull` and `rm` act on THIS host's cache (HF_HUB_CACHE; no server needed: a pull here needs network access, and fills
a cache that workers started here, or that share it, read offline); with `--workers all|NAMES` they ask the hosts of
live workers through the API (admins), and `--wait` follows them until every host is done. `list` reads the API:
what each host's cache holds (as its workers last saw it), sizes, last use, downloads in flight.
"""

from __future__ import annotations

import time
from typing import Any

import click

from api.cli_base import EXIT_FAILED, cli, client, emit, json_option
from core import hub, hub_cache, hub_download
from core.errors import InvalidInput

IN_FLIGHT = ("pull_requested", "downloading", "remove_requested", "removing")


@cli.group()
def models() -> None:
    """Hub models in the hosts' Hugging Face caches: list, pull (fetch ahead of jobs), rm."""


def _size(n: int | None) -> str:
    return hub.human_bytes(int(n or 0))


def _when(ts: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(ts)) if ts else "never"


def _line(m: dict[str, Any]) -> str:
    refs = ",".join(m["refs"]) or "-"
    line = (
        f"{m['host']:<16} {m['repo']:<32} {(m['commit'] or '?')[:12]:<12} {refs:<12} {m['state']:<16} "
        f"{_size(m['bytes']):>10} {m['files']:>5}  used {_when(m['last_used_at'])}"
    )
    download = m.get("download")
    if download:
        eta = f", ETA {download['eta_s']:.0f} s" if download.get("eta_s") is not None else ""
        rate = f", {_size(download['rate_bytes_per_s'])}/s" if download.get("rate_bytes_per_s") else ""
        line += f"\n{'':<16} downloading {_size(download['bytes_done'])} of {_size(download['bytes_total'])}{rate}{eta}"
    if m.get("error"):
        line += f"\n{'':<16} error: {m['error']}"
    return line


@models.command("list")
@click.option("--repo", help="only this Hub id (org/name)")
@json_option()
def list_models(repo: str | None, as_json: bool) -> None:
    """What each host's Hugging Face cache holds: repo, commit, refs, state, size, files, last use (and any
    download in flight: bytes, rate, ETA). Hosts report what their workers found at start and fetched since."""

    def table(rows: list[dict[str, Any]]) -> None:
        if not rows:
            click.echo(
                "no Hub model in any worker's cache (pull one: gpujobs models pull ORG/NAME --workers all)", err=True
            )
            return
        click.echo(f"{'host':<16} {'repo':<32} {'commit':<12} {'refs':<12} {'state':<16} {'size':>10} {'files':>5}")
        for m in rows:
            click.echo(_line(m))

    emit(client().models(repo=repo), as_json, table)


@models.command("pull")
@click.argument("repo")
@click.option("--revision", help="branch, tag or commit (default main)")
@click.option(
    "--workers",
    help="`all`, or worker names separated by commas: their hosts fetch it (through the API, "
    "admins). Without it: into this host's cache (HF_HUB_CACHE)",
)
@click.option("--wait", "wait_", is_flag=True, help="with --workers: wait until every host has it (or failed)")
@json_option()
def pull(repo: str, revision: str | None, workers: str | None, wait_: bool, as_json: bool) -> None:
    """Fetch a Hub model (only the files a load reads: config, tokenizer, safetensors weights) into a Hugging Face
    cache, verified; exit 1 if a host failed."""
    if workers is None:
        emit(
            _pull_here(repo, revision),
            as_json,
            lambda f: click.echo(
                f"{f['repo']}@{f['commit']} in {f['path']}: {f['files']} files, {_size(f['bytes'])} "
                f"({_size(f['downloaded'])} downloaded)"
            ),
        )
        return
    api = client()
    rows = api.pull_models(repo, revision=revision, workers=workers)
    _report(api, repo, rows, wait_, as_json)


@models.command("rm")
@click.argument("repo")
@click.option("--revision", help="only the snapshot this branch, tag or commit names (default: every snapshot)")
@click.option(
    "--workers",
    help="`all`, or worker names separated by commas: their hosts delete it (through the API, "
    "admins). Without it: from this host's cache (HF_HUB_CACHE)",
)
@click.option("--wait", "wait_", is_flag=True, help="with --workers: wait until every host has deleted it")
@json_option()
def rm(repo: str, revision: str | None, workers: str | None, wait_: bool, as_json: bool) -> None:
    """Delete a Hub model's snapshots (and the blobs no other snapshot uses) from a Hugging Face cache."""
    if workers is None:
        commits = None
        if revision:
            commit = hub_cache.cached_commit(repo, revision)
            if commit is None:
                raise InvalidInput(
                    f"{hub.describe(repo, revision)} is not in this host's cache ({hub.get_settings().hub_cache})"
                )
            commits = [commit]
        result = hub_cache.remove(repo, commits)
        emit(
            result,
            as_json,
            lambda r: click.echo(f"removed {len(r['removed'])} snapshot(s) of {repo}, {_size(r['freed_bytes'])} freed"),
        )
        return
    api = client()
    rows = api.remove_models(repo, revision=revision, workers=workers)
    _report(api, repo, rows, wait_, as_json)


def _pull_here(repo: str, revision: str | None) -> dict[str, Any]:
    """core.hub_download.ensure in this process, with a progress bar on stderr."""
    bar = None

    class Bar(hub.Listener):
        def started(self, snap, *, files: int, total: int, done: int) -> None:
            nonlocal bar
            bar = click.progressbar(
                length=max(total, 1),
                label=f"{repo}@{hub.short(snap.commit)} ({files} files)",
                file=click.get_text_stream("stderr"),
            )
            bar.__enter__()
            bar.update(done)

        def progress(self, done: int, total: int) -> None:
            if bar is not None:
                bar.update(done - bar.pos)

        def waiting(self, snap) -> None:
            click.echo(
                f"another process of this host is downloading {repo}@{hub.short(snap.commit)}: waiting", err=True
            )

    try:
        fetched = hub_download.ensure(repo, revision, kind="auto", listener=Bar())
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    for note in fetched.notes:
        click.echo(note, err=True)
    return {
        "repo": fetched.repo,
        "revision": fetched.revision,
        "commit": fetched.commit,
        "kind": fetched.kind,
        "path": str(fetched.path),
        "files": fetched.files,
        "bytes": fetched.bytes,
        "downloaded": fetched.downloaded,
    }


def _report(api, repo: str, rows: list[dict[str, Any]], wait_: bool, as_json: bool) -> None:
    places = {(r["host"], r["cache_dir"]) for r in rows}
    if wait_:
        rows = _wait(api, repo, places)
    emit(rows, as_json, lambda rs: [click.echo(_line(r)) for r in rs] or None)
    if any(r["state"] == "failed" for r in rows):
        raise SystemExit(EXIT_FAILED)


def _wait(api, repo: str, places: set[tuple[str, str]]) -> list[dict[str, Any]]:
    """Until no row of `repo` in these places is requested or in flight; progress on stderr: one line redrawn on a
    terminal, else a line each time it changes (a log file or a CI page shows no carriage return as one)."""
    tty, shown = click.get_text_stream("stderr").isatty(), None
    while True:
        rows = [r for r in api.models(repo=repo) if (r["host"], r["cache_dir"]) in places]
        busy = [r for r in rows if r["state"] in IN_FLIGHT]
        if not busy:
            if tty and shown is not None:
                click.echo("", err=True)
            return rows
        summary = "; ".join(
            f"{r['host']}: {r['state']}"
            + (
                f" {_size(r['download']['bytes_done'])}/{_size(r['download']['bytes_total'])}"
                if r.get("download")
                else ""
            )
            for r in busy
        )
        if tty:
            click.echo(f"\r{summary:<{len(shown or '')}}", err=True, nl=False)  # over all of a longer one
        elif summary != shown:
            click.echo(summary, err=True)
        shown = summary
        time.sleep(1.0)
