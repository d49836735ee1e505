"""`gpujobs adapters list|show|export`: the LoRA adapters fine-tune jobs registered."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from api.cli_base import cli, client, emit, json_option
from core.errors import InvalidInput, JobsError


@cli.group()
def adapters() -> None:
    """LoRA adapters made by fine-tune jobs (an adapter's id is its fine-tune job's id)."""


def _line(a: dict[str, Any]) -> str:
    loss = (a.get("metrics") or {}).get("final_loss")
    return f"{a['id']}  r={a['lora_config'].get('r')}  {a['bytes']:>10} bytes  loss {loss}  base {a['base_model']}"


@adapters.command("list")
@click.option(
    "--limit",
    type=click.IntRange(1, 1000),
    default=100,
    show_default=True,
    help="how many, newest first (stderr says when older adapters exist beyond them)",
)
@click.option("--after", metavar="ADAPTER_ID", help="the adapters listed after this one: the next page")
@json_option()
def list_adapters(limit: int, after: str | None, as_json: bool) -> None:
    """Registered adapters, newest first."""
    found, more = client().adapters_page(limit=limit, after=after)
    emit(found, as_json, lambda rows: [click.echo(_line(a)) for a in rows])
    if more:
        click.echo(f"(older adapters exist: the next page is --after {found[-1]['id']})", err=True)


@adapters.command("show")
@click.argument("adapter_id")
@json_option()
def show(adapter_id: str, as_json: bool) -> None:
    """An adapter: base model, tokenizer, LoRA config, training metrics, the job that made it."""

    def human(a: dict[str, Any]) -> None:
        click.echo(_line(a))
        click.echo(f"  path       {a['path']}")
        click.echo(f"  tokenizer  {a['tokenizer']}")
        click.echo(f"  lora       {a['lora_config'].get('target_modules')} alpha={a['lora_config'].get('lora_alpha')}")
        metrics = a.get("metrics") or {}
        click.echo(
            f"  trained    {metrics.get('steps')} steps, {metrics.get('precision')}, "
            f"{metrics.get('train_tokens_per_s')} tok/s"
        )

    emit(client().adapter(adapter_id), as_json, human)


@adapters.command("export")
@click.argument("adapter_id")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--merged", is_flag=True, help="merge into the base (merge_and_unload): a plain transformers model")
def export(adapter_id: str, out_dir: str, merged: bool) -> None:
    """Copy the adapter to OUT_DIR, or with --merged write its base with the adapter merged in (loads with plain
    AutoModelForCausalLM). Needs the artifacts dir on this host; --merged also needs torch, transformers and peft."""
    a = client().adapter(adapter_id)
    source, out = Path(a["path"]), Path(out_dir)
    if not source.is_dir():
        raise InvalidInput(
            f"adapter files {source} are not reachable from this host: run the export where JOBS_ARTIFACTS is mounted"
        )
    if out.exists() and any(out.iterdir()):
        raise InvalidInput(f"{out} exists and is not empty: give a new directory")
    if not merged:
        shutil.copytree(source, out, dirs_exist_ok=True)
        click.echo(str(out))
        return
    command = [
        sys.executable,
        "-m",
        "worker.export",
        "--base",
        a["base_model"],
        "--adapter",
        str(source),
        "--out",
        str(out),
    ] + (["--revision", a["base_revision"]] if a.get("base_revision") else [])
    done = subprocess.run(command, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True)
    if done.returncode:
        raise JobsError(f"merging {adapter_id} failed: {done.stderr.strip().splitlines()[-1] if done.stderr else ''}")
    click.echo(str(out))
