"""The job spec (pydantic) and the dataset row model.

A spec is flat: loading knobs, generation parameters and job settings side by side, so a YAML file, the HTTP
body and the CLI flags (`--max-new-tokens` ↔ `max_new_tokens`) all read the same. Unknown fields are refused
with their name (`extra="forbid"`): a typo must never silently fall back to a default.

`gpus` is a slice *size* (0 = CPU), never device ids: which devices a worker owns is the worker's business
(`gpujobs worker --gpus 2,0`), so a spec runs unchanged on any host.

These models are also the HTTP API's contract: `POST /jobs` documents its body as their JSON Schema
(api/openapi.py), so every field carries a one-line description, its bounds and its enum, and a value the schema
refuses is refused here too (`parse_spec` validates strictly: no "5" for 5, no 1 for true). Where a validator
accepts a shorthand (a string for `stop`, `on`/`off` read by YAML as booleans), `json_schema_input_type` says so.
Rules between fields that a JSON Schema cannot state simply stay in the validators below; their answers are 422s
with a message that names the rule.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from core import structured
from core.errors import InvalidInput
from core.hub import HUB_ID
from core.slices import DISTRIBUTED, plan

ATTN_BACKENDS = (
    "sdpa",
    "sdpa_gqa",  # sdpa with enable_gqa instead of repeated K/V heads (worker/attention.py)
    "eager",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
# An attention backend: a name above, `paged|<name>`, or a Hub kernel repo (org/name[@revision][:kernel]). ASCII only
# and no \w (Python's is Unicode, JSON Schema's is not): the same pattern is the schema's (`attn_implementation`).
_NAME = r"[A-Za-z0-9_.-]+"
ATTN_PATTERN = re.compile(rf"^(paged\|)?({'|'.join(ATTN_BACKENDS)}|{_NAME}/{_NAME}(@{_NAME})?(:{_NAME})?)$")
ADAPTER_PATTERN = f"^(job_|file_|{HUB_ID.pattern[1:]})"  # a fine-tune's id, a stored file's, or a Hub repo
ON_OFF = Literal["auto", "on", "off"] | bool  # what the on/off fields take: YAML 1.1 reads on/off as booleans


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


QuantMethod = Literal["bnb-4bit", "bnb-8bit", "torchao-int8", "torchao-int4", "torchao-float8", "fp8"]


class Quantization(Strict):
    """How the weights are quantized when the model loads; a bare method name is shorthand for `{method: ...}`."""

    method: QuantMethod = Field(description="the quantization scheme (bnb: bitsandbytes; fine-tunes take bnb-4bit)")
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="bitsandbytes 4-bit data type")
    double_quant: bool = Field(True, description="bitsandbytes 4-bit nested quantization")
    compute_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="the dtype bitsandbytes computes in; auto: the model's dtype"
    )


def _attn_ok(value: str) -> str:
    if ATTN_PATTERN.match(value):
        return value
    raise ValueError(
        f"unknown attention backend {value!r}: use one of {', '.join(ATTN_BACKENDS)}, 'paged|<backend>', "
        "or a Hub kernel repo id such as 'kernels-community/flash-attn'"
    )


class LoadOptions(Strict):
    """How a worker loads the model. Equal load options share one resident model."""

    model: str = Field(
        description="a local model directory, or a Hub id (org/name): fetched once per host into the "
        "Hugging Face cache, or read from it offline (core/hub.py). Over HTTP a directory is an absolute path on the "
        "API server: a relative one that reads as a path (./, ../ or ~ in front, or present in the server's working "
        "directory) is refused",
        json_schema_extra={"minLength": 1},  # not a pydantic constraint: api/checks.py says what to give
    )
    revision: str | None = Field(
        None, description="Hub revision (branch, tag or commit); the job stores the commit it resolved to"
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="auto: bf16 on compute capability >= 8.0, fp16 below, fp32 on CPU"
    )
    attn_implementation: str = Field(
        "sdpa",
        description="attention backend: " + ", ".join(ATTN_BACKENDS) + "; `paged|<backend>`; or a Hub kernel repo "
        "(org/name[@revision][:kernel])",
        json_schema_extra={"pattern": ATTN_PATTERN.pattern},
    )
    use_kernels: bool = Field(False, description="replace layers with Hub kernels (transformers KernelConfig)")
    kernel_config: dict[str, Any] | None = Field(None, description="kernel mapping keyed by device, e.g. cuda")
    quantization: Quantization | None = Field(
        None, description="quantize the weights as they load: a method name, or an object; default: none"
    )
    device_map: Literal["cuda", "auto", "cpu"] | None = Field(
        None, description="cuda: one GPU; auto: split over the worker's slice; cpu. Default: cuda on a GPU slice"
    )
    adapter: str | None = Field(
        None,
        description="LoRA adapter: a fine-tune job id, a stored file id, or a Hub LoRA repo (org/name)",
        json_schema_extra={"pattern": ADAPTER_PATTERN},  # core/adapters.py refuses anything else, with a message
    )
    adapter_revision: str | None = Field(
        None, description="a Hub adapter's revision (branch, tag or commit); the job stores the commit it resolved to"
    )
    trust_remote_code: bool = Field(False, description="only where the server allows it")

    @field_validator("attn_implementation")
    @classmethod
    def _attn(cls, value: str) -> str:
        return _attn_ok(value)

    @field_validator("quantization", mode="before", json_schema_input_type=QuantMethod | Quantization | None)
    @classmethod
    def _quant_shorthand(cls, value: Any) -> Any:
        return {"method": value} if isinstance(value, str) else value

    def load_key(self) -> str:
        """Identity of a loaded model: jobs with equal keys reuse the resident model."""
        return self.model_dump_json(include=set(LoadOptions.model_fields))


class SamplingParams(Strict):
    """Generation parameters: job-wide in the spec, and overridable per row."""

    max_new_tokens: int | None = Field(None, ge=1, le=131072, description="tokens to generate at most")
    temperature: float | None = Field(None, ge=0, le=100, description="sampling temperature; above 0 samples")
    top_p: float | None = Field(
        None, gt=0, le=1, description="nucleus sampling: the smallest set of tokens of this mass"
    )
    top_k: int | None = Field(None, ge=0, le=100000, description="sample among the k likeliest tokens; 0: no limit")
    do_sample: bool | None = Field(None, description="default: sample when temperature > 0, else greedy")
    seed: int | None = Field(
        None,
        ge=0,
        le=2**63 - 1,
        description=(
            "sampling seed: the same seed gives the same samples on the same engine, model, hardware and library "
            "versions for the same batch composition (the same rows, shard_rows and batch_rows); not across engines, "
            "and not per row (a row's samples depend on the rows it is batched with) unless engine padded with "
            "batch_rows 1. Greedy decoding ignores it"
        ),
    )
    stop: list[str] | None = Field(
        None, max_length=16, description="stop strings (one string, or a list of at most 16)"
    )
    repetition_penalty: float | None = Field(None, gt=0, le=100, description="penalize repeated tokens; 1: none")
    ignore_eos: bool | None = Field(None, description="generate exactly max_new_tokens (benchmarks)")
    num_return_sequences: int | None = Field(
        None, ge=1, le=16, description="outputs per row (needs sampling); above 1 a row's output is a JSON list"
    )
    # structured outputs (core/structured.py): one constraint per row, a row's replacing the job's
    response_format: dict[str, Any] | None = Field(
        None,
        description='constrain the output, OpenAI\'s form: {"type": "json_schema", "json_schema": {"name": ..., '
        '"schema": {...}, "strict": true}}, {"type": "json_object"} (any JSON object) or {"type": "text"} (none)',
    )
    guided_choice: list[str] | None = Field(None, description="the output is exactly one of these strings")
    guided_regex: str | None = Field(None, description="the output matches this regular expression (no look-around)")
    logprobs: bool | None = Field(None, description="return each generated token's log-probability")
    top_logprobs: int | None = Field(
        None, ge=0, le=structured.TOP_LOGPROBS_MAX, description="and this many most likely tokens at each step"
    )

    @field_validator(
        "stop", mode="before", json_schema_input_type=str | Annotated[list[str], Field(max_length=16)] | None
    )
    @classmethod
    def _stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value and "" in value:  # every text starts with "": each row would end at once, empty, as if it stopped
            raise ValueError("an empty stop string would end every row before its first token: remove it")
        return value

    # before the type's own check, so that `response_format: json_object` or `guided_choice: yes` gets what to give
    @field_validator("response_format", mode="before", json_schema_input_type=dict[str, Any] | None)
    @classmethod
    def _response_format(cls, value: Any) -> Any:
        return structured.check_response_format(value)

    @field_validator("guided_choice", mode="before", json_schema_input_type=list[str] | None)
    @classmethod
    def _choice(cls, value: Any) -> Any:
        return structured.check_choice(value)

    @field_validator("guided_regex")
    @classmethod
    def _regex(cls, value: Any) -> Any:
        return structured.check_regex(value)


# What a generation's input_columns may map: our row fields and the sampling parameters a row may override
GENERATE_COLUMNS = ("prompt", "messages", "custom_id", *SamplingParams.model_fields)


class JobSettings(Strict):
    input: str = Field(
        description="a stored file id (file_…) or a server-side path under the data roots",
        json_schema_extra={"minLength": 1},  # not a pydantic constraint: api/checks.py says what to give
    )
    name: str | None = Field(None, max_length=200, description="a label for the job")
    gpus: int | None = Field(None, ge=0, le=64, description="slice size: 0 = CPU; default: the smallest live slice")
    metadata: dict[str, str] | None = Field(None, description="your own string labels, kept with the job")
    priority: Literal["low", "normal", "high"] = Field(
        "normal",
        description="which queued work a free worker takes first (core/scheduling.py); high needs a token "
        "with the priority or admin scope",
    )


class GenerateSpec(JobSettings, LoadOptions, SamplingParams):
    kind: Literal["generate"] = Field("generate", description="a generation job (the default when kind is left out)")
    max_new_tokens: int = Field(256, ge=1, le=131072, description="tokens to generate at most, per row")
    shard_rows: int | None = Field(None, ge=1, le=1_000_000, description="rows per shard (one task each)")
    batch_rows: int | None = Field(None, ge=1, le=65536, description="rows per micro-batch commit")
    # how the dataset is read (core/formats.py); a submitted `auto` is stored as the format it resolved to
    input_format: Literal["auto", "jsonl", "openai", "csv", "parquet", "hf"] = Field(
        "auto",
        description="auto: by content and file name; jsonl, openai (batch lines), csv, parquet, hf "
        "(a save_to_disk directory, packed by the CLI)",
    )
    input_columns: dict[str, str] | None = Field(
        None,
        description="our name -> the file's column, e.g. {prompt: question, custom_id: id}: prompt, messages, "
        "custom_id or a sampling parameter (api/checks.py refuses any other)",
        json_schema_extra={"propertyNames": {"enum": list(GENERATE_COLUMNS)}},
    )
    engine: Literal["auto", "fast", "padded", "static", "continuous"] = Field(
        "auto",
        description="fast: continuous batching over a slot KV cache with a Triton decode attention and "
        "CUDA graphs (worker/engines/fastgen.py); padded: batched model.generate; static: model.generate with a static KV "
        "cache, compiled on CUDA, fixed shapes (batch_rows slots, bucketed cache length); continuous: transformers "
        "continuous batching (generate_batch's engine); auto: fast on CUDA where it applies, else padded "
        "(docs/design.md 'Generation engines')",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto", description="continuous engine: CUDA graphs (true/false read as on/off)"
    )
    async_batching: Literal["auto", "on", "off"] = Field(
        "auto",
        description="continuous engine: overlap CPU scheduling with the GPU (double buffers; true/false read "
        "as on/off)",
    )
    prefix_cache: Literal["auto", "off"] = Field(
        "auto",
        description="fast engine: prompts that start with the same full pages (64 tokens) of an earlier prompt share "
        "their KV cache and prefill only the rest, within a job and across jobs on a worker; off: every prompt is "
        "prefilled whole",
    )
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = Field(
        "auto",
        description="fast engine: the KV cache's element type. auto: the model's dtype; fp8 (float8 e4m3; a GPU of "
        "compute capability 8.9+ or a CPU) or int8 (any GPU), with a scale per position and head: half the bytes, "
        "so about twice the rows fit and decode reads half; outputs can differ slightly from auto's. Other engines "
        "refuse them; under engine auto, rows that run padded keep the model's dtype and the job's events say so",
    )
    tp_plan: Literal["auto"] | None = Field(
        None,
        description="auto: tensor parallel over the slice (one process per GPU under torchrun); needs a slice "
        "of 2 or more GPUs, not with device_map auto. Refused at submit for now: docs/design.md 'Several GPUs'",
    )

    @field_validator("cuda_graphs", "async_batching", mode="before", json_schema_input_type=ON_OFF)
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 (and so `--set cuda_graphs=on` and spec files) reads on/off as booleans
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("prefix_cache", mode="before", json_schema_input_type=Literal["auto", "off"] | Literal[False])
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        # YAML 1.1 reads `off` as false (`--set prefix_cache=off`); true would be "on", which this field refuses
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _tp_plan_alone(self) -> GenerateSpec:
        if self.tp_plan and self.device_map == "auto":
            raise ValueError(
                "tp_plan auto shards every layer over the slice, device_map auto places whole layers "
                "on its GPUs: use one or the other"
            )
        return self

    @model_validator(mode="after")
    def _adapter_revision(self) -> GenerateSpec:
        if self.adapter_revision and not (self.adapter and "/" in self.adapter):
            raise ValueError(
                "adapter_revision is the revision of a Hub adapter: name the adapter's repo (adapter: org/name) too"
            )
        return self

    @model_validator(mode="after")
    def _n_needs_sampling(self) -> GenerateSpec:
        sampling = self.do_sample if self.do_sample is not None else bool(self.temperature)
        if (self.num_return_sequences or 1) > 1 and not sampling:
            raise ValueError(
                "num_return_sequences > 1 needs sampling (greedy decoding returns the same text "
                "n times): set temperature > 0 or do_sample true"
            )
        return self


TRAINING_COLUMNS = ("messages", "prompt", "completion", "text")  # what a fine-tune's input_columns may map


def _finetune_schema(schema: dict[str, Any]) -> None:
    """The fine-tune's JSON Schema as its validators read it, where a field's own type says less: `kind` required
    (the API's union tells a fine-tune by it; a spec without one is a generation, while the model keeps its default
    for code that builds one), no adapter (a fine-tune trains a new one), bnb-4bit the only quantization (QLoRA)."""
    schema.setdefault("required", []).insert(0, "kind")
    for name in ("adapter", "adapter_revision"):
        schema["properties"][name] = {"type": "null", "description": "none: a fine-tune trains a new adapter"}
    quantization = schema["properties"]["quantization"]
    quantization["description"] = "QLoRA: bnb-4bit, or an object with method bnb-4bit; default: none"
    quantization["anyOf"] = [
        {"const": "bnb-4bit"}
        if "enum" in branch
        else {**branch, "properties": {"method": {"const": "bnb-4bit"}}}
        if "$ref" in branch
        else branch
        for branch in quantization["anyOf"]
    ]


MODULE_NAME = r"^[A-Za-z0-9_.]+$"  # a module's name, or the dotted end of one (q_proj, self_attn.q_proj)
LR_SCHEDULERS = (
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "cosine_with_min_lr",
    "warmup_stable_decay",
)


class FinetuneSpec(JobSettings, LoadOptions):
    """A LoRA (or QLoRA, with `quantization: bnb-4bit`) fine-tune: one shard, checkpointed, resumable.

    `truncation` has no silent default: `refuse` (the default) fails the job before training and names the rows
    longer than `max_seq_length`; `truncate` cuts them and records how many were cut. `then_generate` chains a
    generation job (a dataset, or an object of generate-spec fields) that runs with the new adapter.

    Two fields say how the data is read, and they are not the generation spec's: `input_format` is the ROW shape
    (messages, prompt_completion, text; it predates file formats, and renaming it would break stored specs and
    scripts), `file_format` is the FILE format (auto, jsonl, csv, parquet, hf), for `input` and
    `validation_input` alike (with `auto` each file is detected on its own; the resolved formats are recorded in
    the job's metrics, `input.format` / `input.validation_format`, while the stored spec keeps what was
    submitted). `input_columns` means what it means for generation: our field -> the file's column, for both files.
    """

    model_config = ConfigDict(json_schema_extra=lambda schema: _finetune_schema(schema))

    kind: Literal["finetune"] = Field("finetune", description="a LoRA fine-tune")
    input_format: Literal["auto", "messages", "prompt_completion", "text"] = Field(
        "auto", description="the row shape; auto: each row is `messages`, `prompt`+`completion`, or `text`"
    )
    file_format: Literal["auto", "jsonl", "csv", "parquet", "hf"] = Field(
        "auto",
        description="how input and validation_input are read; auto: by content and file name; hf: a "
        "save_to_disk directory (packed by the CLI)",
    )
    input_columns: dict[str, str] | None = Field(
        None,
        description="our field -> the file's column, e.g. {prompt: question, completion: answer}",
        json_schema_extra={
            "propertyNames": {"enum": list(TRAINING_COLUMNS)},
            "additionalProperties": {"type": "string", "minLength": 1},
        },
    )
    validation_input: str | None = Field(None, description="a stored file id or server path of validation rows")
    validation_split: float | None = Field(None, gt=0, lt=1, description="fraction of rows held out for eval")
    lora_r: int = Field(16, ge=1, le=1024, description="LoRA rank")
    lora_alpha: int = Field(32, ge=1, le=4096, description="LoRA alpha (the update is scaled by alpha / r)")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the LoRA layers' input")
    target_modules: (
        Annotated[list[Annotated[str, Field(pattern=MODULE_NAME)]], Field(min_length=1)] | Literal["all-linear"]
    ) = Field(
        "all-linear",
        description="the modules that get LoRA layers: names (a name matches a module whose name ends in it), or "
        "all-linear",
    )
    modules_to_save: list[str] | None = Field(
        None, description="modules trained in full and saved with the adapter (e.g. lm_head)"
    )
    epochs: float = Field(1.0, gt=0, le=1000, description="passes over the training rows")
    max_steps: int | None = Field(None, ge=1, le=10_000_000, description="optimizer steps; overrides epochs")
    learning_rate: float = Field(2e-4, gt=0, le=1, description="peak learning rate")
    lr_scheduler: str = Field(
        "cosine",
        description="a transformers scheduler: " + ", ".join(LR_SCHEDULERS),
        json_schema_extra={"enum": list(LR_SCHEDULERS)},
    )
    warmup_steps: int = Field(0, ge=0, le=10_000_000, description="steps of linear warm-up to learning_rate")
    batch_size: int = Field(4, ge=1, le=4096, description="rows per step and process")
    gradient_accumulation: int = Field(1, ge=1, le=4096, description="micro-batches per optimizer step")
    max_seq_length: int = Field(2048, ge=8, le=1_048_576, description="longest row (or packed block) in tokens")
    truncation: Literal["refuse", "truncate"] = Field(
        "refuse", description="rows longer than max_seq_length: refuse the job, or truncate them"
    )
    packing: bool = Field(False, description="pack rows into blocks of max_seq_length tokens")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="the seed of the LoRA weights' initialization and data order")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward pass (less memory)")
    checkpoint_steps: int = Field(50, ge=1, le=10_000_000, description="save a resumable checkpoint every N steps")
    # speed levers (worker/training/setup.py, docs/design.md "Fine-tune speed"); what ran is recorded in metrics.speed
    liger: Literal["auto", "on", "off"] = Field(
        "auto",
        description="on: liger-kernel's fused linear cross-entropy (CUDA); off and auto: our chunked "
        "cross-entropy, exact on any device and faster on F1 (docs/design.md). Neither materializes the logits",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="torch.compile each decoder layer (compiled before the first step, time recorded); "
        "auto: on for packed training on CUDA without quantization",
    )
    packed_attention: Literal["auto", "varlen", "mask"] = Field(
        "auto",
        description="with packing, how rows in one block are kept apart: varlen (flash-attention over each "
        "row, CUDA, torch's varlen_attn), mask (transformers' block-diagonal mask for attn_implementation); auto: "
        "varlen where it runs, else mask",
    )
    strategy: Literal["auto", "single", "ddp", "fsdp2", "deepspeed_zero2", "deepspeed_zero3"] = Field(
        "auto",
        description="how a slice of several GPUs trains: auto (one process on one GPU or the CPU, ddp on a "
        "slice of 2 or more unless device_map auto), single (one process), ddp, fsdp2, deepspeed_zero2/3 (needs "
        "deepspeed on the worker); batch_size is per process",
    )
    nproc: int | None = Field(
        None,
        ge=1,
        le=64,
        description="processes of a distributed strategy; default: one per GPU of the slice. On "
        "the CPU (gloo; tests and debugging) give it to run several",
    )
    then_generate: dict[str, Any] | None = Field(
        None,
        description="a generation job run with the adapter once training succeeds: a dataset, or "
        "an object of generate-spec fields (`input` required)",
    )

    @field_validator("lr_scheduler")
    @classmethod
    def _scheduler(cls, value: str) -> str:
        if value not in LR_SCHEDULERS:
            raise ValueError(f"unknown lr_scheduler {value!r}: use one of {', '.join(LR_SCHEDULERS)}")
        return value

    @field_validator("target_modules", mode="before")
    @classmethod
    def _targets(cls, value: Any) -> Any:
        """Before the type's own checks (the same ones), for a message that says what to give."""
        if (isinstance(value, str) and value != "all-linear") or (
            isinstance(value, list)
            and (not value or not all(isinstance(v, str) and re.match(MODULE_NAME, v) for v in value))
        ):
            raise ValueError(
                f"{value!r}: give a list of module names such as [q_proj, v_proj] (letters, digits, _ and .; "
                "--target-modules q_proj,v_proj on the command line), or 'all-linear'"
            )
        return value

    @field_validator("liger", "compile", mode="before", json_schema_input_type=ON_OFF)
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 (and so `--set liger=on` and spec files) reads on/off as booleans
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @field_validator("then_generate", mode="before", json_schema_input_type=str | dict[str, Any] | None)
    @classmethod
    def _then_generate(cls, value: Any) -> Any:
        return {"input": value} if isinstance(value, str) else value

    @field_validator("input_columns")
    @classmethod
    def _training_columns(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        unknown = sorted(set(value or {}) - set(TRAINING_COLUMNS))
        if unknown:
            raise ValueError(
                f"cannot map {', '.join(map(repr, unknown))}: a fine-tune maps messages, prompt, "
                "completion or text to a column of the file"
            )
        if value is not None and any(not isinstance(v, str) or not v for v in value.values()):
            raise ValueError("each mapped column must be a non-empty column name")
        return value

    @model_validator(mode="after")
    def _training_knobs(self) -> "FinetuneSpec":
        if self.quantization is not None and self.quantization.method != "bnb-4bit":
            raise ValueError(
                f"quantization {self.quantization.method!r} cannot be trained: fine-tunes take "
                "bnb-4bit (QLoRA) or no quantization"
            )
        if self.adapter is not None or self.adapter_revision is not None:
            raise ValueError(
                "adapter: a fine-tune trains a new adapter on the base model; continuing an adapter is not supported"
            )
        if self.validation_input and self.validation_split:
            raise ValueError("give validation_input or validation_split, not both")
        self._check_strategy()
        if self.then_generate is not None and not self.then_generate.get("input"):
            raise ValueError("then_generate needs an input dataset")
        if self.packed_attention != "auto" and not self.packing:
            raise ValueError(
                f"packed_attention {self.packed_attention} applies to packed rows: set packing true, "
                "or leave packed_attention auto"
            )
        shape = {"messages": {"messages"}, "prompt_completion": {"prompt", "completion"}, "text": {"text"}}
        stray = set(self.input_columns or ()) - shape.get(self.input_format, set(self.input_columns or ()))
        if stray:
            raise ValueError(
                f"input_columns maps {', '.join(sorted(stray))}, which input_format "
                f"{self.input_format} rows do not have"
            )
        return self

    def _check_strategy(self) -> None:
        """Strategy and nproc against the slice size, when the spec names it; without `gpus`, what holds on any
        slice big enough (the submit then picks a slice that fits, core/capability.py)."""
        if self.strategy not in DISTRIBUTED and self.nproc is None:
            return
        gpus = self.gpus if self.gpus is not None else (self.nproc or 2)
        try:
            plan(
                self.strategy,
                self.nproc,
                gpus=gpus,
                device_map=self.device_map,
                quantized=self.quantization is not None,
            )
        except InvalidInput as exc:
            raise ValueError(str(exc)) from None


Spec = GenerateSpec | FinetuneSpec
KINDS: dict[str, type[GenerateSpec] | type[FinetuneSpec]] = {"generate": GenerateSpec, "finetune": FinetuneSpec}


def parse_spec(data: dict[str, Any]) -> Spec:
    """Validate a submitted spec dict; errors name each bad field. Strict, as the API's schema is: a number where a
    number is meant, true or false where a boolean is (the shorthands the fields document stay)."""
    if not isinstance(data, dict):
        raise InvalidInput("a job spec must be a JSON/YAML object")
    kind = data.get("kind", "generate")
    model = KINDS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise InvalidInput(f"unknown job kind {kind!r}: use 'generate' or 'finetune'", param="kind")
    data = {k: whole_number(v) for k, v in data.items()}
    try:
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        other = "finetune" if kind == "generate" else "generate"
        hint = {other: set(KINDS[other].model_fields) - set(model.model_fields), "near": set(model.model_fields)}
        raise InvalidInput(f"invalid {kind} spec: {describe(exc, hint)}", param=first_field(exc)) from None


def first_field(exc: ValidationError) -> str | None:
    """The field of the first problem (`metadata.run`; None for a rule over several fields), for the error's
    `param`."""
    return ".".join(str(p) for p in exc.errors()[0]["loc"]) or None


def whole_number(value: Any) -> Any:
    """5.0 as 5: JSON Schema's integer is any number without a fraction, pydantic's strict int takes only 5 (a
    float field takes 5 as well)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def describe(exc: ValidationError, hint: dict[str, set[str]] | None = None) -> str:
    """One readable line per problem, e.g. `max_new_tokens: Input should be greater than or equal to 1`; a rule of
    ours gives its own words (no "Value error,"; a rule over several fields names no field). `hint` (parse_spec's):
    an unknown field is matched against `near`, the spec's own fields (`max_tokens`: did you mean 'max_new_tokens'?),
    and against the other kind's (`temperature` on a fine-tune: a generate field)."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {where!r}{_unknown_hint(where, hint or {})}")
        elif err["type"] == "value_error" and "error" in err.get("ctx", {}):  # raised by a validator of ours
            parts.append(f"{where}: {err['ctx']['error']}" if where else str(err["ctx"]["error"]))
        elif err["type"] == "string_type" and type(err.get("input")) in (int, float) and where:
            parts.append(  # a commit id of digits (or digits and one e) written unquoted in YAML or --set
                f"{where}: give a string, not the number {err['input']!r} (YAML and --set read unquoted digits, "
                "and digits with one e, as a number: quote it)"
            )
        elif err["type"] == "too_long" and "max_length" in err.get("ctx", {}):  # pydantic's says "after validation"
            parts.append(f"{where}: at most {err['ctx']['max_length']} items, not {err['ctx'].get('actual_length')}")
        else:
            parts.append(f"{where or 'value'}: {err['msg']}{_received(err)}")
    return "; ".join(parts)


def _received(err: dict[str, Any]) -> str:
    """`, not 'abc'` where a short scalar had the wrong type or was not one of the choices, so the line shows what was
    read (YAML reads `yes` as true and `0x1F` as 31 in a spec file and in --set); a bound's message says enough."""
    value, kind = err.get("input"), err["type"]
    if not (kind.endswith(("_type", "_parsing")) or kind in ("enum", "literal_error")):
        return ""
    if not isinstance(value, (str, int, float, bool)) or len(repr(value)) > 60:
        return ""
    return f", not {value!r}"


def _unknown_hint(field: str, hint: dict[str, set[str]]) -> str:
    if field in hint.get("generate", ()):
        return " (a generate field: a fine-tune's chained generation takes it under then_generate)"
    if field in hint.get("finetune", ()):
        return " (a finetune field: submit a fine-tune with kind finetune)"
    near = difflib.get_close_matches(field, sorted(hint.get("near", ())), n=1, cutoff=0.75)
    return f" (did you mean {near[0]!r}?)" if near else ""


def sampling_of(spec: GenerateSpec, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The row's effective generation parameters: the spec's, overridden by the row's."""
    params = structured.override({k: getattr(spec, k) for k in SamplingParams.model_fields}, overrides or {})
    if params["do_sample"] is None:
        params["do_sample"] = bool(params["temperature"])
    return params
