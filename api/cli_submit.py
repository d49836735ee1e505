"""`gpujobs submit generate|finetune`: a job's spec from a spec file, flags and `--set`, its local files uploaded
(a dataset, a save_to_disk directory packed, a LoRA adapter directory zipped), then submitted through the HTTP API;
`--wait` follows it with the commands' progress bar (api/cli_jobs.py)."""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import click
import yaml

from api.cli_base import cli, client, emit, job_exit_code, json_option
from api.cli_jobs import wait_with_progress
from core.errors import Forbidden, InvalidInput, JobsError, WaitInterrupted
from core.hub import HUB_ID


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
        with open(path, encoding="utf-8") as text:  # a stream: YAML's error marks name the file, not "<unicode string>"
            data = yaml.load(text, Loader=SpecLoader)  # noqa: S506  (a SafeLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise InvalidInput(f"cannot read spec file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"spec file {path} must hold a mapping of spec fields")
    return data


def parse_sets(pairs: tuple[str, ...]) -> dict[str, Any]:
    """--set key=value, the value read as YAML (numbers, booleans, lists). A value YAML cannot read, or reads as
    nothing (empty, or a `#` comment), is refused with how to quote it; `null` clears a field."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise InvalidInput(f"--set {pair!r}: expected key=value")
        quote = f"quote it as YAML text: --set \"{key}='{value}'\""
        if not value.strip():
            raise InvalidInput(f"--set {pair!r}: no value: give one, or null to clear the field")
        if value.lstrip().startswith("#"):
            raise InvalidInput(f"--set {pair!r}: the value reads as nothing (`#` starts a YAML comment): {quote}")
        try:
            out[key.strip().replace("-", "_")] = yaml.load(value, Loader=SpecLoader)  # noqa: S506  (a SafeLoader)
        except yaml.YAMLError as exc:
            reason = str(getattr(exc, "problem", None) or exc).strip()
            raise InvalidInput(f"--set {pair!r}: the value is not valid YAML ({reason}): {quote}") from None
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
    """Upload the local datasets a spec names (its input; a fine-tune's validation input and chained input too) and
    a local LoRA adapter, so they work against a remote server, and make a local model path absolute (also one
    that is missing but reads as a path, so the server says it does not exist rather than that it is relative)."""
    spec = dict(spec)
    spec["input"] = _uploaded(spec.get("input"), api)
    for key in ("validation_input", "then_generate"):
        if key in spec:
            spec[key] = _uploaded(spec[key], api)
    if isinstance(spec.get("then_generate"), dict):
        spec["then_generate"] = {**spec["then_generate"], "input": _uploaded(spec["then_generate"].get("input"), api)}
    model = spec.get("model")
    if model and (Path(model).expanduser().exists() or str(model).startswith(("./", "../", "~"))):
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


def _uploaded(source: Any, api) -> Any:
    """A local file or save_to_disk directory (packed) uploaded, as its file id; anything else (a file id, a server
    path, an object) unchanged."""
    if isinstance(source, str) and not source.startswith("file_") and Path(source).expanduser().exists():
        return api.upload(Path(source).expanduser())["id"]
    return source


def _server_path(source: Any) -> str | None:
    """`source` when the CLI sends it as a path on the API's host: not a file id, and nothing of that name here."""
    if isinstance(source, str) and source and not source.startswith("file_") and not Path(source).expanduser().exists():
        return source
    return None


def _where_it_looked(source: str, exc: JobsError) -> JobsError:
    """A server's refusal of a dataset path, said from the CLI's side too: where the CLI looked first, and why
    the server then read the path as its own."""
    here = (
        "on this machine" if Path(source).expanduser().is_absolute() else f"in the CLI's working folder ({Path.cwd()})"
    )
    return type(exc)(
        f"--input {source}: no such file or directory {here}, so it was sent as a path on the API's host; there: {exc}"
    )


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


def common_submit_options(kind: str):
    """The options both submit commands take; the help of --quantization and --set, and --adapter (generate only:
    a fine-tune trains a new adapter), follow `kind`."""
    generate = kind == "generate"
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
            help="dataset: a local file or save_to_disk directory (uploaded; also a pipe: /dev/stdin, <(…)), a "
            "file_… id, or a server path",
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
        click.option(
            "--quantization",
            help="bnb-4bit, bnb-8bit, torchao-int8, torchao-int4, torchao-float8, fp8"
            if generate
            else "bnb-4bit: QLoRA, a 4-bit base (the one quantization a fine-tune trains on)",
        ),
        click.option("--device-map", type=click.Choice(["cuda", "auto", "cpu"]), help="cuda: one GPU; auto: split"),
        *(
            [
                click.option(
                    "--adapter",
                    help="LoRA adapter: a fine-tune job id, a file id, a Hub LoRA repo (org/name), "
                    "or a local PEFT adapter directory (uploaded as a zip)",
                )
            ]
            if generate
            else []
        ),
        click.option(
            "--set",
            "sets",
            multiple=True,
            metavar="KEY=VALUE",
            help="any other spec field (repeatable), e.g. "
            + ("engine=continuous, num_return_sequences=4" if generate else "warmup_steps=10, liger=off"),
        ),
        click.option(
            "--wait",
            is_flag=True,
            help="wait for the job, with a progress bar on stderr; exit with its code (Ctrl-C: 130, the job goes on)",
        ),
        json_option("print the job as JSON instead of its id"),
    ]

    def decorate(fn):
        for option in reversed(options):
            fn = option(fn)
        return fn

    return decorate


def submit_spec(kind: str, spec_file: str | None, sets: tuple[str, ...], flags: dict[str, Any]) -> dict[str, Any]:
    spec = load_spec_file(spec_file)
    spec.update({k: v for k, v in flags.items() if v not in (None, ())})
    spec.update(parse_sets(sets))
    if spec.setdefault("kind", kind) != kind:
        raise InvalidInput(
            f"kind {spec['kind']!r} (from --spec or --set) does not match `submit {kind}`: leave kind out"
            + (
                f", or submit it with `gpujobs submit {spec['kind']}`"
                if spec["kind"] in ("generate", "finetune")
                else ""
            )
        )
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
    both ids are printed (the fine-tune's first), both are waited for, and the exit code is the chain's (130 with
    the ids printed all the same when Ctrl-C stops the wait)."""
    api, server_path = client(), _server_path(spec.get("input"))
    try:
        with api.removed_if_refused():  # a refused submit leaves none of the files it uploaded behind
            job = api.submit(resolve_local_paths(spec, api))
    except (InvalidInput, Forbidden) as exc:
        if server_path and "dataset path" in str(exc):
            raise _where_it_looked(server_path, exc) from None
        raise
    chained = (job.get("metrics") or {}).get("then_generate_job")
    if chained and not wait:
        click.echo(f"then-generate: {chained} runs once {job['id']} has trained its adapter", err=True)
    if not wait:
        emit(job, as_json, lambda j: click.echo(j["id"]))
        return
    try:
        ended = wait_with_progress(api, job["id"])
        then = wait_with_progress(api, chained) if chained else None
    except WaitInterrupted:
        # the job exists and goes on: stdout still gets the ids --wait prints, so `ID=$(…)` has them
        emit(job, as_json, lambda j: click.echo(j["id"] + (f"\n{chained}" if chained else "")))
        raise
    if then is not None:
        emit({**ended, "chained_job": then}, as_json, lambda j: click.echo(f"{j['id']}\n{chained}"))
        raise SystemExit(chain_exit_code(ended, then))
    emit(ended, as_json, lambda j: click.echo(j["id"]))
    raise SystemExit(job_exit_code(ended))


def chain_exit_code(finetune: dict[str, Any], then: dict[str, Any]) -> int:
    """A chain's outcome: the fine-tune's code if it did not succeed (its chained job then fails too), else the
    chained generation job's (0, 1, or 4 with failed rows)."""
    return job_exit_code(finetune) or job_exit_code(then)


@cli.group()
def submit() -> None:
    """Submit a job; prints its id (`ID=$(gpujobs submit generate …)`)."""


@submit.command("generate")
@common_submit_options("generate")
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
@click.option(
    "--json-schema",
    "json_schema",
    type=click.Path(exists=True, dir_okay=False),
    help="constrain every output to JSON valid against this JSON Schema file (response_format json_schema)",
)
@click.option(
    "--choice", "guided_choice", multiple=True, help="the output is exactly one of these strings (repeatable)"
)
@click.option("--regex", "guided_regex", help="the output matches this regular expression, e.g. '[0-9]{3}-[0-9]{4}'")
@click.option("--logprobs", is_flag=True, default=None, help="return each generated token's log-probability")
@click.option(
    "--top-logprobs",
    type=click.IntRange(0, 20),
    help="and this many most likely tokens at each step (needs --logprobs)",
)
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
def submit_generate(spec_file, sets, wait, as_json, input_, columns, json_schema, **flags) -> None:
    """Generate text for every row of a dataset: JSONL (`prompt` or `messages` per line), OpenAI batch lines,
    CSV, Parquet or a save_to_disk directory (`--column prompt=COLUMN` names the column that holds the prompt).
    A dataset in which no row can run is refused (exit 2) and nothing is created.

    \b
    Structured outputs and log-probabilities, e.g.:
      gpujobs submit generate --model M --input rows.jsonl --json-schema person.schema.json
      gpujobs submit generate --model M --input rows.jsonl --choice positive --choice negative --logprobs --top-logprobs 2
      gpujobs submit generate --model M --input rows.jsonl --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}'
    """
    flags["input"] = input_
    for key in ("stop", "guided_choice"):
        if flags.get(key):
            flags[key] = list(flags[key])
    if json_schema:
        flags["response_format"] = schema_format(Path(json_schema))
    if columns:
        flags["input_columns"] = parse_columns(columns)
    finish_submit(submit_spec("generate", spec_file, sets, flags), wait, as_json)


def schema_format(path: Path) -> dict[str, Any]:
    """`--json-schema FILE` as OpenAI's response_format: the file holds one JSON Schema object."""
    try:
        schema = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InvalidInput(f"--json-schema {path}: not a readable JSON file ({exc}): give a JSON Schema file") from None
    if not isinstance(schema, dict):
        raise InvalidInput(
            f"--json-schema {path}: a JSON Schema is a JSON object, this file holds a {type(schema).__name__}"
        )
    name = re.sub(r"[^A-Za-z0-9_-]", "_", path.name.split(".")[0])[:64] or "schema"
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@submit.command("finetune")
@common_submit_options("finetune")
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
    finish_submit(submit_spec("finetune", spec_file, sets, flags), wait, as_json)
