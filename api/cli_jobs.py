"""`gpujobs submit|status|list|wait|results|events|cancel|retry|workers|usage|quota`: commands that talk to the HTTP
API."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

import click
import yaml

from api.cli_base import cli, client, emit, job_exit_code, json_option
from core.errors import InvalidInput
from core.hub import HUB_ID, human_bytes


def _size(n: Any) -> str:
    return human_bytes(int(n or 0))


TERMINAL = ("succeeded", "failed", "cancelled")


# --- submit -------------------------------------------------------------------------------------------------


class SpecLoader(yaml.SafeLoader):
    """YAML as a spec means it: PyYAML (YAML 1.1) reads `2e-4`, a number without a dot, as a string, and the API
    checks a spec's types strictly (core/spec.py), so such a number is read as the float YAML 1.2 says it is."""


SpecLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_spec_file(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        data = yaml.load(Path(path).read_text(), Loader=SpecLoader)  # noqa: S506  (a SafeLoader)
    except (OSError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read spec file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"spec file {path} must hold a mapping of spec fields")
    return data


def parse_sets(pairs: tuple[str, ...]) -> dict[str, Any]:
    """--set key=value, the value read as YAML (numbers, booleans, lists)."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidInput(f"--set {pair!r}: expected key=value")
        out[key.strip().replace("-", "_")] = yaml.load(value, Loader=SpecLoader)  # noqa: S506  (a SafeLoader)
    return out


def parse_columns(pairs: tuple[str, ...]) -> dict[str, str]:
    """--column ours=theirs pairs as the spec's input_columns."""
    out = {}
    for pair in pairs:
        ours, sep, theirs = pair.partition("=")
        if not sep or not ours.strip() or not theirs:
            raise InvalidInput(f"--column {pair!r}: expected OURS=THEIRS, e.g. prompt=question")
        out[ours.strip()] = theirs
    return out


def resolve_local_paths(spec: dict[str, Any], api) -> dict[str, Any]:
    """Upload a local input file (so it works against a remote server) and make a local model path absolute."""
    spec = dict(spec)
    source = spec.get("input")
    if source and not str(source).startswith("file_") and Path(source).expanduser().is_file():
        spec["input"] = api.upload(Path(source).expanduser())["id"]
    elif source and not str(source).startswith("file_") and Path(source).expanduser().is_dir():
        with pack_saved_dataset(Path(source).expanduser()) as packed:
            spec["input"] = api.upload(packed)["id"]
    model = spec.get("model")
    if model and Path(model).expanduser().exists():
        spec["model"] = str(Path(model).expanduser().resolve())
    adapter = spec.get("adapter")
    if (
        adapter
        and spec.get("kind") == "generate"
        and not str(adapter).startswith(("file_", "job_"))
        and (Path(adapter).expanduser().exists() or not HUB_ID.match(str(adapter)))
    ):
        spec["adapter"] = _upload_adapter(Path(adapter).expanduser(), api)  # a Hub repo id stays as it is
    return spec


def _upload_adapter(source: Path, api) -> str:
    """A local LoRA adapter (a save_pretrained directory, or its zip) uploaded; its file id names it in the spec."""
    if source.is_file() and source.suffix == ".zip":
        return api.upload(source)["id"]
    if not source.is_dir():
        raise InvalidInput(
            f"--adapter {source}: not a fine-tune job id (job_…), a file id (file_…), a Hub repo "
            "(org/name), nor a local adapter directory (adapter_config.json + "
            "adapter_model.safetensors) or its .zip"
        )
    with pack_adapter(source) as packed:
        return api.upload(packed)["id"]


@contextlib.contextmanager
def pack_adapter(folder: Path):
    """A PEFT LoRA adapter directory (as `save_pretrained` writes it) packed into one zip for upload: only
    adapter_config.json and adapter_model.safetensors, the two files the worker loads (the server checks them)."""
    from core.adapters import ADAPTER_CONFIG, WEIGHTS

    if not (folder / WEIGHTS).is_file() and (folder / "adapter_model.bin").is_file():
        raise InvalidInput(
            f"{folder} holds pickle weights (adapter_model.bin), which are refused: save the adapter "
            "with save_pretrained(..., safe_serialization=True)"
        )
    for name in (ADAPTER_CONFIG, WEIGHTS):
        if not (folder / name).is_file():
            raise InvalidInput(f"{folder} has no {name}: pass the directory that PEFT's save_pretrained wrote")
    with tempfile.TemporaryDirectory(prefix="gpujobs-") as tmp:
        packed = Path(tmp) / f"{folder.resolve().name or 'adapter'}.adapter.zip"
        with zipfile.ZipFile(packed, "w", zipfile.ZIP_STORED) as archive:  # weights barely compress
            for name in (ADAPTER_CONFIG, WEIGHTS):
                archive.write(folder / name, name)
        yield packed


@contextlib.contextmanager
def pack_saved_dataset(folder: Path):
    """A directory written by `Dataset.save_to_disk`, packed into one zip for upload (removed afterwards).

    Only the files a saved dataset has at its top level are packed (state.json, dataset_info.json, *.arrow)."""
    if (folder / "dataset_dict.json").is_file():
        raise InvalidInput(
            f"{folder} is a DatasetDict (it holds splits): save one split, e.g. "
            "`ds['train'].save_to_disk(path)`, and pass that directory"
        )
    if not (folder / "state.json").is_file():
        raise InvalidInput(
            f"{folder} is a directory but not a dataset saved with save_to_disk (no state.json): "
            "pass a JSONL, CSV or Parquet file, or a save_to_disk directory"
        )
    with tempfile.TemporaryDirectory(prefix="gpujobs-") as tmp:
        packed = Path(tmp) / f"{folder.name or 'dataset'}.hf.zip"
        with zipfile.ZipFile(packed, "w", zipfile.ZIP_STORED) as archive:  # Arrow files barely compress
            for path in sorted(folder.iterdir()):
                if path.is_file() and (path.suffix in (".arrow", ".json")):
                    archive.write(path, path.name)
        yield packed


def common_submit_options(fn):
    options = [
        click.option(
            "--spec", "spec_file", type=click.Path(dir_okay=False), help="YAML or JSON spec; flags override it"
        ),
        click.option(
            "--model",
            help="model directory, or a Hub id (org/name): fetched once per worker host, or read "
            "from its cache offline",
        ),
        click.option(
            "--input",
            "input_",
            help="dataset: a local file or save_to_disk directory (uploaded), a file_… id, or a server path",
        ),
        click.option("--name", help="a label for the job"),
        click.option("--gpus", type=click.IntRange(0, 64), help="slice size: 0 = CPU (default: smallest live slice)"),
        click.option(
            "--priority",
            type=click.Choice(["low", "normal", "high"]),
            help="which queued work free workers take first (normal); high needs a token with the "
            "priority or admin scope",
        ),
        click.option(
            "--revision", help="Hub revision of the model: branch, tag or commit (the job records the commit)"
        ),
        click.option(
            "--dtype", type=click.Choice(["auto", "bfloat16", "float16", "float32"]), help="weights dtype (auto)"
        ),
        click.option(
            "--attn-implementation",
            "--attn",
            "attn_implementation",
            help="sdpa (default), sdpa_gqa, eager, flex_attention, flash_attention_2/3/4, paged|…, or a Hub kernel repo",
        ),
        click.option("--quantization", help="bnb-4bit, bnb-8bit, torchao-int8, torchao-int4, torchao-float8, fp8"),
        click.option("--device-map", type=click.Choice(["cuda", "auto", "cpu"]), help="cuda: one GPU; auto: split"),
        click.option(
            "--adapter",
            help="LoRA adapter: a fine-tune job id, a file id, a Hub LoRA repo (org/name), "
            "or a local PEFT adapter directory (uploaded as a zip)",
        ),
        click.option(
            "--set",
            "sets",
            multiple=True,
            metavar="KEY=VALUE",
            help="any other spec field (repeatable), e.g. engine=continuous, num_return_sequences=4",
        ),
        click.option(
            "--wait", is_flag=True, help="wait for the job, with a progress bar on stderr; exit with its code"
        ),
        json_option("print the job as JSON instead of its id"),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def submit_spec(kind: str, spec_file: str | None, sets: tuple[str, ...], flags: dict[str, Any]) -> dict[str, Any]:
    spec = load_spec_file(spec_file)
    spec.update({k: v for k, v in flags.items() if v not in (None, ())})
    spec.update(parse_sets(sets))
    if spec.setdefault("kind", kind) != kind:
        raise InvalidInput(f"the spec file is a {spec['kind']!r} job, not {kind!r}")
    for field in ("model", "input"):
        if not spec.get(field) and not (field == "model" and _model_in_lines(kind, spec)):
            raise InvalidInput(
                f"missing --{field} (or `{field}:` in the spec file)"
                + (
                    "; only OpenAI batch lines may name the model instead, in body.model"
                    if field == "model" and kind == "generate"
                    else ""
                )
            )
    return spec


def _model_in_lines(kind: str, spec: dict[str, Any]) -> bool:
    """A generation job may leave the model to its OpenAI batch lines' body.model (the server checks them all);
    for a local file the CLI looks at its format first, so a plain JSONL without --model is refused at once."""
    from core import formats

    source = Path(str(spec.get("input") or "")).expanduser()
    if kind != "generate" or spec.get("input_format", "auto") not in ("auto", "openai"):
        return False
    return not source.is_file() or formats.detect(source, source.name) == "openai"


def finish_submit(spec: dict[str, Any], wait: bool, as_json: bool) -> None:
    """Submit and print the job's id. A fine-tune's chained job (`then_generate`) is named on stderr; with --wait
    both ids are printed (the fine-tune's first), both are waited for, and the exit code is the chain's."""
    api = client()
    job = api.submit(resolve_local_paths(spec, api))
    chained = (job.get("metrics") or {}).get("then_generate_job")
    if chained and not wait:
        click.echo(f"then-generate: {chained} runs once {job['id']} has trained its adapter", err=True)
    if wait:
        job = wait_with_progress(api, job["id"])
    if wait and chained:
        then = wait_with_progress(api, chained)
        emit({**job, "chained_job": then}, as_json, lambda j: click.echo(f"{j['id']}\n{chained}"))
        raise SystemExit(chain_exit_code(job, then))
    emit(job, as_json, lambda j: click.echo(j["id"]))
    if wait:
        raise SystemExit(job_exit_code(job))


def chain_exit_code(finetune: dict[str, Any], then: dict[str, Any]) -> int:
    """A chain's outcome: the fine-tune's code if it did not succeed (its chained job then fails too), else the
    chained generation job's (0, 1, or 4 with failed rows)."""
    return job_exit_code(finetune) or job_exit_code(then)


@cli.group()
def submit() -> None:
    """Submit a job; prints its id (`ID=$(gpujobs submit generate …)`)."""


@submit.command("generate")
@common_submit_options
@click.option("--max-new-tokens", type=click.IntRange(1), help="tokens to generate per row (256)")
@click.option("--temperature", type=float, help="sampling temperature; > 0 samples, default greedy")
@click.option("--top-p", type=float, help="nucleus sampling")
@click.option("--top-k", type=int, help="top-k sampling")
@click.option("--do-sample/--greedy", default=None, help="force sampling or greedy decoding")
@click.option(
    "--seed",
    type=int,
    help="sampling seed: the same samples on the same engine and batch composition "
    'only, not across engines nor per row (README, "What a seed promises")',
)
@click.option("--stop", multiple=True, help="stop string (repeatable)")
@click.option("--repetition-penalty", type=float, help="repetition penalty (> 0)")
@click.option("--adapter-revision", help="revision of a Hub --adapter: branch, tag or commit")
@click.option("--shard-rows", type=int, help="rows per shard (one task each)")
@click.option("--batch-rows", type=int, help="rows per micro-batch commit")
@click.option(
    "--input-format",
    type=click.Choice(["auto", "jsonl", "openai", "csv", "parquet", "hf"]),
    help="how to read --input (auto: by content and file name); a save_to_disk directory is packed",
)
@click.option(
    "--column",
    "columns",
    multiple=True,
    metavar="OURS=THEIRS",
    help="map a column of a CSV/Parquet/dataset input, e.g. prompt=question, custom_id=id (repeatable)",
)
def submit_generate(spec_file, sets, wait, as_json, input_, columns, **flags) -> None:
    """Generate text for every row of a JSONL dataset (`prompt` or `messages` per line)."""
    flags["input"] = input_
    if flags.get("stop"):
        flags["stop"] = list(flags["stop"])
    if columns:
        flags["input_columns"] = parse_columns(columns)
    finish_submit(submit_spec("generate", spec_file, sets, flags), wait, as_json)


@submit.command("finetune")
@common_submit_options
@click.option("--max-steps", type=click.IntRange(1), help="training steps (overrides --epochs)")
@click.option("--epochs", type=float, help="passes over the dataset (1)")
@click.option("--learning-rate", type=float, help="peak learning rate (2e-4)")
@click.option("--batch-size", type=click.IntRange(1), help="per-device batch size (4)")
@click.option("--lora-r", type=click.IntRange(1), help="LoRA rank (16)")
@click.option("--lora-alpha", type=click.IntRange(1), help="LoRA alpha (32)")
@click.option("--max-seq-length", type=click.IntRange(8), help="longest sequence in tokens (2048)")
@click.option(
    "--truncation",
    type=click.Choice(["refuse", "truncate"]),
    help="rows longer than --max-seq-length: refuse the job (default) or truncate them",
)
@click.option("--lr-scheduler", help="linear, cosine (default), constant, constant_with_warmup, …")
@click.option("--gradient-accumulation", type=click.IntRange(1), help="micro-batches per optimizer step (1)")
@click.option("--target-modules", help="comma-separated module names, or all-linear (default)")
@click.option("--packing/--no-packing", default=None, help="pack rows into max-seq-length blocks")
@click.option("--checkpoint-steps", type=click.IntRange(1), help="checkpoint every N steps (50); resume uses them")
@click.option(
    "--validation-input",
    help="validation rows: a local file or save_to_disk directory (uploaded), a file_… id, or a server path",
)
@click.option(
    "--then-generate",
    help="after training, generate over this dataset with the new adapter: a second job, named on "
    "stderr, with generate defaults (max_new_tokens 256; other fields: `then_generate:` as an "
    "object in --spec). With --wait both ids are printed and both are waited for",
)
@click.option(
    "--file-format",
    type=click.Choice(["auto", "jsonl", "csv", "parquet", "hf"]),
    help="how to read --input and --validation-input (auto: by content and file name); a save_to_disk "
    "directory is packed",
)
@click.option(
    "--column",
    "columns",
    multiple=True,
    metavar="OURS=THEIRS",
    help="map a column to messages, prompt, completion or text, e.g. completion=answer (repeatable)",
)
def submit_finetune(spec_file, sets, wait, as_json, input_, columns, **flags) -> None:
    """Fine-tune a LoRA adapter (QLoRA with --quantization bnb-4bit) on a JSONL, CSV, Parquet or saved-dataset
    input whose rows are chat `messages` (loss on assistant turns), `prompt`/`completion` (loss on the
    completion) or `text`. Prints the job id, which is also the adapter's id (`--adapter ID` on a generate job)."""
    flags["input"] = input_
    if columns:
        flags["input_columns"] = parse_columns(columns)
    if flags.get("target_modules") and flags["target_modules"] != "all-linear":
        flags["target_modules"] = [m.strip() for m in flags["target_modules"].split(",") if m.strip()]
    spec = submit_spec("finetune", spec_file, sets, flags)
    api = client()
    for key in ("validation_input", "then_generate"):
        spec[key] = _uploaded(spec.get(key), api)
    if isinstance(spec.get("then_generate"), dict):
        spec["then_generate"] = {**spec["then_generate"], "input": _uploaded(spec["then_generate"].get("input"), api)}
    finish_submit(spec, wait, as_json)


def _uploaded(source: Any, api) -> Any:
    """A local file (or save_to_disk directory, packed) named by a fine-tune option, uploaded (so it works against
    a remote server); else unchanged."""
    if isinstance(source, str) and not source.startswith("file_") and Path(source).expanduser().is_file():
        return api.upload(Path(source).expanduser())["id"]
    if isinstance(source, str) and not source.startswith("file_") and Path(source).expanduser().is_dir():
        with pack_saved_dataset(Path(source).expanduser()) as packed:
            return api.upload(packed)["id"]
    return source


# --- read ---------------------------------------------------------------------------------------------------


def wait_with_progress(api, job_id: str, timeout: float | None = None) -> dict[str, Any]:
    with click.progressbar(length=1, label=job_id, file=click.get_text_stream("stderr"), show_pos=True) as bar:

        def update(job: dict[str, Any]) -> None:
            rows = job["rows"]
            bar.length = max(rows["total"], 1)
            bar.update(rows["succeeded"] + rows["failed"] - bar.pos)
            bar.label = f"{job_id} {job['state']}"

        return api.wait(job_id, on_update=update, timeout=timeout)


def describe(job: dict[str, Any]) -> None:
    """A job for people: what every job has, then a generation job's tokens and rates or a fine-tune's training
    (a fine-tune generates nothing, so it shows no tokens, tok/s or first result)."""
    rows = job["rows"]
    click.echo(f"{job['id']}  {job['state']}  {job.get('name') or ''}".rstrip())
    click.echo(f"  model    {job['model']}  (queue {job['queue']}, priority {job.get('priority', 'normal')})")
    place = job.get("scheduling")
    if place:
        click.echo(
            f"  queued   {place['shards_queued']} shards, position {place['position']} "
            f"({place['shards_ahead']} shards ahead); {place['waiting']}"
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
            (f"; per shard {per_shard['min']}-{per_shard['max']} s after its claim ({per_shard['shards']} shards)")
            if per_shard
            else ""
        )
        click.echo(f"  first    result {metrics['time_to_first_result_s']} s after the start{shards}")
    if metrics.get("output_tok_s") is not None:
        click.echo(f"  done in  {metrics['duration_s']} s, {metrics['output_tok_s']} tok/s")


def _describe_training(job: dict[str, Any]) -> None:
    """Step, epoch, loss, training tok/s and ETA (the job's `training`: its current run's last logged step)."""
    training, metrics = job.get("training"), job.get("metrics") or {}
    if training:
        loss = training.get("loss", training.get("train_loss"))
        parts = [
            f"step {training.get('step', 0)}/{training.get('max_steps') or '?'}",
            f"epoch {training.get('epoch') or 0:.2f}",
        ]
        parts += [f"loss {loss:.4f}"] if loss is not None else []
        parts += [f"{training['tokens_per_s']} training tok/s"] if training.get("tokens_per_s") is not None else []
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
@json_option()
def list_jobs(state: str | None, limit: int, as_json: bool) -> None:
    """List jobs, newest first."""

    def table(jobs):
        for j in jobs:
            done = j["rows"]["succeeded"] + j["rows"]["failed"]
            place = j.get("scheduling")
            waits = f"  [#{place['position']}, {place['waiting']}]" if place else ""
            click.echo(
                f"{j['id']}  {j['state']:<10} {j.get('priority', 'normal'):<6} {done:>7}/"
                f"{j['rows']['total']:<7} {j['kind']:<9} {j['model']}{waits}"
            )

    found, more = client().jobs_page(state=state, limit=limit)
    emit(found, as_json, table)
    if more:
        click.echo(f"(the newest {limit} shown; older jobs exist: --limit {min(limit * 4, 1000)})", err=True)


@cli.command()
@click.argument("job_id")
@click.option("--timeout", type=float, help="give up after this many seconds (exit 124; the job goes on)")
@json_option("print the finished job as JSON")
def wait(job_id: str, timeout: float | None, as_json: bool) -> None:
    """Wait for a job to end (progress on stderr); exit 0 succeeded, 1 failed/cancelled, 4 with failed rows,
    124 when --timeout passed first (the job goes on)."""
    job = wait_with_progress(client(), job_id, timeout=timeout)
    emit(job, as_json, describe)
    raise SystemExit(job_exit_code(job))


@cli.command()
@click.argument("job_id")
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="write here, not to stdout")
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
def results(job_id: str, output: str | None, errors: bool, fmt: str, order: str) -> None:
    """Finished rows (or, with --errors, failed rows); works while the job still runs."""
    if fmt == "parquet" and not output and sys.stdout.isatty():
        raise InvalidInput("Parquet is binary: write it to a file with -o FILE (or pipe stdout)")
    chunks = client().download(job_id, format=fmt, errors=errors, order=order)
    out = open(output, "wb") if output else click.get_binary_stream("stdout")
    size = lines = 0
    try:
        for chunk in chunks:
            out.write(chunk)
            size, lines = size + len(chunk), lines + chunk.count(b"\n")
    finally:
        if output:
            out.close()
    if output:
        what = f"{lines} rows" if fmt in ("jsonl", "openai") else f"{size} bytes"
        click.echo(f"{what} written to {output}", err=True)


@cli.command()
@click.argument("job_id")
@click.option("--follow", "-f", is_flag=True, help="keep printing new events until the job ends")
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
    api, after = client(), 0
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
        if not follow or (run and run < current) or (not batch and api.job(job_id)["state"] in TERMINAL):
            return
        if not batch:
            time.sleep(1.0)


@cli.command()
@click.argument("job_id")
@json_option("print the job as JSON")
def cancel(job_id: str, as_json: bool) -> None:
    """Cancel a job: running work stops within seconds, finished rows are kept."""
    emit(client().cancel(job_id), as_json, lambda j: click.echo(f"{j['id']} {j['state']}"))


@cli.command()
@click.argument("job_id")
@click.option("--failed-only", is_flag=True, help="re-run only failed rows, not rows a cancel left unfinished")
@click.option("--wait", "wait_", is_flag=True, help="wait for the retried job; exit with its code")
@json_option("print the job as JSON")
def retry(job_id: str, failed_only: bool, wait_: bool, as_json: bool) -> None:
    """Re-open a finished job under the same id and re-run its failed rows. A job that has not finished is
    refused (exit 2): wait for it or cancel it first."""
    api = client()
    job = api.retry(job_id, failed_only=failed_only)
    if wait_:
        job = wait_with_progress(api, job_id)
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
    """Registered workers: state (online, lost: no heartbeat, offline: stopped), restarts of their slot, slice,
    GPUs and heartbeat age; for a stopped worker its exit code and why it stopped."""
    emit(client().workers(all=all_), as_json, lambda ws: [click.echo(worker_line(w)) for w in ws])


def worker_line(w: dict) -> str:
    gpus = ", ".join(f"{g['name']} ({g['uuid']})" for g in w["gpus"]) or "CPU"
    restarts = f"  restarts={w['restarts']}" if w.get("restarts") else ""
    line = f"{w['name']}  {w['state']:<7}{restarts} queues={','.join(w['queues'])}"
    if w["state"] != "offline":
        return f"{line}  heartbeat {time.time() - w['heartbeat_at']:.0f}s ago  {gpus}"
    stopped = time.time() - (w.get("stopped_at") or w["heartbeat_at"])
    code = f"exit {w['exit_code']}" if w.get("exit_code") is not None else "stopped"
    return f"{line}  {code} {stopped:.0f}s ago" + (f": {w['reason']}" if w.get("reason") else "")


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
    type=click.FloatRange(0),
    metavar="S",
    help="at most S GPU-seconds over the last 24 hours (a CPU shard counts 1 a second); past it new shards wait, "
    "running ones finish",
)
@click.option("--no-cap", is_flag=True, help="remove both of the owner's caps")
@click.option("--json", "as_json", is_flag=True, help="print the quota as JSON")
def quota_set(
    owner: str, max_running_shards: int | None, max_gpu_seconds_per_day: float | None, no_cap: bool, as_json: bool
) -> None:
    """Set OWNER's quota: `--max-running-shards N` and/or `--max-gpu-seconds-per-day S` (a cap not given stays as it
    is), or `--no-cap`."""
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
