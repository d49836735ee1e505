"""Job spec validation (core.spec.parse_spec): defaults, refusals that name the field, shorthands. Messages are exact."""

from __future__ import annotations

import pytest

from core.errors import InvalidInput
from core.spec import ATTN_BACKENDS, FinetuneSpec, GenerateSpec, Quantization, parse_spec, sampling_of

BASE = {"model": "Qwen/Qwen3-0.6B", "input": "file_abc"}
ATTN_ERROR = (
    "invalid generate spec: attn_implementation: unknown attention backend {value!r}: use one of "
    "sdpa, sdpa_gqa, eager, flex_attention, flash_attention_2, flash_attention_3, flash_attention_4, 'paged|<backend>', "
    "or a Hub kernel repo id such as 'kernels-community/flash-attn'"
)


def refused(data: dict) -> str:
    with pytest.raises(InvalidInput) as info:
        parse_spec(data)
    return str(info.value)


def test_a_minimal_generate_spec_gets_the_defaults():
    """model + input is a whole generate spec; every other field takes its documented default."""
    spec = parse_spec(dict(BASE))
    assert isinstance(spec, GenerateSpec)
    assert (spec.kind, spec.model, spec.input) == ("generate", "Qwen/Qwen3-0.6B", "file_abc")
    assert spec.max_new_tokens == 256
    assert (spec.temperature, spec.top_p, spec.top_k, spec.do_sample, spec.seed, spec.stop) == (None,) * 6
    assert (spec.dtype, spec.attn_implementation, spec.use_kernels, spec.trust_remote_code) == (
        "auto",
        "sdpa",
        False,
        False,
    )
    assert (spec.quantization, spec.device_map, spec.adapter, spec.revision) == (None, None, None, None)
    assert (spec.gpus, spec.shard_rows, spec.batch_rows, spec.name, spec.metadata) == (None, None, None, None, None)


def test_explicit_kind_generate_is_the_same_as_the_default():
    """kind: generate parses exactly like a spec without kind."""
    assert parse_spec({**BASE, "kind": "generate"}) == parse_spec(dict(BASE))


def test_unknown_fields_are_refused_by_name():
    """A typo is never silently ignored: each unknown field is named."""
    assert refused({**BASE, "bogus": 1}) == "invalid generate spec: unknown field 'bogus'"
    assert refused({**BASE, "bogus": 1, "max_tokens": 5}) == (
        "invalid generate spec: unknown field 'bogus'; unknown field 'max_tokens' (did you mean 'max_new_tokens'?)"
    )
    # a field of the other kind says so; a rule of ours over several fields gives its own words, naming no field
    assert refused({**BASE, "learning_rate": 1e-3}) == (
        "invalid generate spec: unknown field 'learning_rate' (a finetune field: submit a fine-tune with kind finetune)"
    )
    assert refused({**BASE, "num_return_sequences": 4}) == (
        "invalid generate spec: num_return_sequences > 1 needs sampling (greedy decoding returns the same text n "
        "times): set temperature > 0 or do_sample true"
    )


def test_a_missing_required_field_is_named():
    """A spec without model names the missing field."""
    assert refused({"input": "file_abc"}) == "invalid generate spec: model: Field required"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_new_tokens", 0, "max_new_tokens: Input should be greater than or equal to 1"),
        ("max_new_tokens", 10**9, "max_new_tokens: Input should be less than or equal to 131072"),
        ("temperature", -1, "temperature: Input should be greater than or equal to 0"),
        ("top_p", 2, "top_p: Input should be less than or equal to 1"),
        ("top_p", 0, "top_p: Input should be greater than 0"),
        ("top_k", -1, "top_k: Input should be greater than or equal to 0"),
        ("repetition_penalty", 0, "repetition_penalty: Input should be greater than 0"),
        ("seed", -5, "seed: Input should be greater than or equal to 0"),
        ("gpus", -1, "gpus: Input should be greater than or equal to 0"),
        ("shard_rows", 0, "shard_rows: Input should be greater than or equal to 1"),
    ],
)
def test_absurd_generation_parameters_are_refused_naming_the_field(field, value, message):
    """Out-of-range generation and job parameters are refused with the field's name and its bound."""
    assert refused({**BASE, field: value}) == f"invalid generate spec: {message}"


def test_several_problems_are_all_reported():
    """Every bad field of one spec is reported in one message, separated by '; '."""
    assert refused({**BASE, "max_new_tokens": 0, "temperature": -1, "top_p": 2}) == (
        "invalid generate spec: max_new_tokens: Input should be greater than or equal to 1; "
        "temperature: Input should be greater than or equal to 0; top_p: Input should be less than or equal to 1"
    )


def test_quantization_shorthand_string_becomes_a_method_with_defaults():
    """`quantization: bnb-4bit` means {method: bnb-4bit} with nf4, double quantization and auto compute dtype."""
    spec = parse_spec({**BASE, "quantization": "bnb-4bit"})
    assert spec.quantization == Quantization(method="bnb-4bit")
    assert (spec.quantization.quant_type, spec.quantization.double_quant, spec.quantization.compute_dtype) == (
        "nf4",
        True,
        "auto",
    )
    full = parse_spec({**BASE, "quantization": {"method": "bnb-4bit", "quant_type": "fp4"}})
    assert full.quantization.quant_type == "fp4"


def test_an_unknown_quantization_method_lists_the_options():
    """A quantization method outside the supported list is refused and the options are named."""
    assert refused({**BASE, "quantization": "gptq"}) == (
        "invalid generate spec: quantization.method: Input should be 'bnb-4bit', 'bnb-8bit', 'torchao-int8', "
        "'torchao-int4', 'torchao-float8' or 'fp8', not 'gptq'"
    )


@pytest.mark.parametrize("value", ["flash", "paged|nope", "paged|", "flash attention 2", "a/b/c"])
def test_a_bad_attention_backend_lists_the_options(value):
    """An unknown attn_implementation is refused with every built-in backend, the paged form and the Hub form listed."""
    assert refused({**BASE, "attn_implementation": value}) == ATTN_ERROR.format(value=value)


@pytest.mark.parametrize(
    "value",
    [
        *ATTN_BACKENDS,
        "paged|sdpa",
        "paged|flash_attention_2",
        "kernels-community/flash-attn",
        "kernels-community/flash-attn@v1.2:flash_attn",
        "paged|kernels-community/flash-attn",
    ],
)
def test_built_in_paged_and_hub_kernel_backends_are_accepted(value):
    """Every built-in backend, `paged|<backend>` and a Hub kernel repo id are accepted unchanged."""
    assert parse_spec({**BASE, "attn_implementation": value}).attn_implementation == value


@pytest.mark.parametrize("kind", ["train", "", None, 3, ["generate"], {"a": 1}])
def test_an_unknown_kind_is_refused(kind):
    """Only generate and finetune are kinds; anything else (even a non-string) is refused by value, not crashed on."""
    assert refused({**BASE, "kind": kind}) == f"unknown job kind {kind!r}: use 'generate' or 'finetune'"


@pytest.mark.parametrize("data", [["model"], "model: x", None])
def test_a_spec_that_is_not_an_object_is_refused(data):
    """A list, a string or null is not a spec."""
    assert refused(data) == "a job spec must be a JSON/YAML object"


def test_a_finetune_spec_parses_with_its_defaults():
    """A minimal finetune spec gets the LoRA and training defaults and the shared load defaults."""
    spec = parse_spec({**BASE, "kind": "finetune"})
    assert isinstance(spec, FinetuneSpec)
    assert (spec.kind, spec.model, spec.input, spec.dtype, spec.attn_implementation) == (
        "finetune",
        "Qwen/Qwen3-0.6B",
        "file_abc",
        "auto",
        "sdpa",
    )
    assert (spec.lora_r, spec.lora_alpha, spec.lora_dropout, spec.target_modules) == (16, 32, 0.05, "all-linear")
    assert (spec.epochs, spec.max_steps, spec.learning_rate, spec.lr_scheduler) == (1.0, None, 2e-4, "cosine")
    assert (spec.batch_size, spec.gradient_accumulation, spec.max_seq_length, spec.packing) == (4, 1, 2048, False)
    assert (spec.seed, spec.gradient_checkpointing, spec.checkpoint_steps) == (0, False, 50)
    assert (spec.validation_input, spec.validation_split, spec.modules_to_save) == (None, None, None)


def test_a_finetune_spec_refuses_generation_parameters():
    """Sampling parameters are not finetune fields: refused by name under the finetune kind."""
    assert (
        refused({**BASE, "kind": "finetune", "temperature": 0.5})
        == "invalid finetune spec: unknown field 'temperature' (a generate field: a fine-tune's chained generation "
        "takes it under then_generate)"
    )
    assert refused({**BASE, "kind": "finetune", "validation_split": 1}) == (
        "invalid finetune spec: validation_split: Input should be less than 1"
    )


def test_sampling_of_applies_row_overrides_and_derives_do_sample():
    """A row's overrides win over the spec's values; do_sample defaults to temperature > 0."""
    spec = parse_spec({**BASE, "temperature": 0.7, "max_new_tokens": 32})
    assert sampling_of(spec, None)["do_sample"] is True
    row = sampling_of(spec, {"temperature": 0, "top_k": 5, "seed": None})
    assert (row["temperature"], row["top_k"], row["max_new_tokens"], row["do_sample"]) == (0, 5, 32, False)
    assert sampling_of(parse_spec(dict(BASE)), {})["do_sample"] is False
