"""The generation engine as plain functions: worker/loader.py and worker/generate.py on the tiny memorized model.

No queue, no database, no worker process. Runs under the CI venv (transformers 5.24, bitsandbytes, torchao) and
under the GPU hosts' transformers 5.17 (.ci/run's second phase), where the quantized tests skip.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch

from core.errors import InvalidInput
from core.spec import GenerateSpec, LoadOptions
from tests.conftest import qa_pairs
from worker.engines import common, padded
from worker.generate import generate
from worker.loader import Loaded, load, resolve_dtype

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def make_spec(model: Path, **fields) -> GenerateSpec:
    return GenerateSpec.model_validate({"model": str(model), "input": "file_x", **fields})


def row(*, prompt: str | None = None, messages: list | None = None, **params) -> dict:
    """A row input as core/dataset.py stores it."""
    text = {"prompt": prompt} if prompt is not None else {"messages": messages}
    return {**text, "params": params, "extra": {"id": "r"}}


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def memorized_rows() -> list[tuple[int, dict]]:
    return [(i, row(prompt=q)) for i, (q, _) in enumerate(qa_pairs())]


def run(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int = 64, should_stop=lambda: False):
    """All results of `generate`, flattened, by idx."""
    return {
        r.idx: r
        for batch in generate(loaded, spec, rows, batch_rows=batch_rows, should_stop=should_stop)
        for r in batch
    }


@pytest.fixture(scope="module")
def spec(tiny_model) -> GenerateSpec:
    return make_spec(tiny_model)


@pytest.fixture(scope="module")
def loaded(spec) -> Loaded:
    return load(spec, gpus=0)


# --- generation --------------------------------------------------------------------------------------------


def test_greedy_reproduces_memorized_answers_for_prompt_and_chat_rows_in_one_batch(loaded, spec):
    """Greedy decoding answers every memorized question, as a prompt and as chat messages, in one mixed batch."""
    tok = loaded.tokenizer
    qa = qa_pairs()
    rows = []
    for i, (q, _) in enumerate(qa):
        rows += [(2 * i, row(prompt=q)), (2 * i + 1, row(messages=chat(q)))]
    batches = list(generate(loaded, spec, rows, batch_rows=len(rows)))
    assert len(batches) == 1
    results = {r.idx: r for r in batches[0]}
    for i, (q, answer) in enumerate(qa):
        chat_ids = tok.apply_chat_template(chat(q), add_generation_prompt=True)
        chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
        for idx, prompt_len in ((2 * i, len(tok(q)["input_ids"])), (2 * i + 1, len(chat_ids))):
            r = results[idx]
            assert (r.error, r.output, r.finish_reason) == (None, answer, "stop"), r
            assert r.prompt_tokens == prompt_len
            assert r.completion_tokens == len(tok.encode(answer, add_special_tokens=False)) + 1  # + terminator


def test_micro_batches_cover_every_row_once_in_order(loaded, spec):
    """batch_rows=2 over 5 rows yields 3 micro-batches that cover every idx once, in order."""
    idxs = [3, 7, 8, 20, 21]
    qa = qa_pairs()
    rows = [(idx, row(prompt=qa[n][0])) for n, idx in enumerate(idxs)]
    batches = list(generate(loaded, spec, rows, batch_rows=2))
    assert [[r.idx for r in b] for b in batches] == [[3, 7], [8, 20], [21]]
    assert [r.output for b in batches for r in b] == [a for _, a in qa[:5]]


def test_row_params_override_the_spec_per_row_within_one_micro_batch(loaded, spec):
    """A row's max_new_tokens ends it with finish_reason "length" after exactly that many tokens; others keep theirs."""
    q, answer = qa_pairs()[3]  # "William Shakespeare." is 6 tokens + the terminator
    rows = [
        (0, row(prompt=q, max_new_tokens=1)),
        (1, row(prompt=q, max_new_tokens=4)),
        (2, row(prompt=q)),
        (3, row(messages=chat(q), max_new_tokens=2)),
        (4, row(prompt=q, stop=["Shake"])),
    ]
    r = run(loaded, spec, rows, batch_rows=len(rows))
    for idx, n in ((0, 1), (1, 4), (3, 2)):
        assert (r[idx].finish_reason, r[idx].completion_tokens, r[idx].error) == ("length", n, None), r[idx]
        assert r[idx].output and answer.startswith(r[idx].output)
    assert len(r[1].output) > len(r[0].output)
    assert (r[2].output, r[2].finish_reason) == (answer, "stop")
    assert (r[4].output, r[4].finish_reason) == ("William ", "stop")


def test_stop_string_truncates_before_it_with_finish_reason_stop(loaded, tiny_model):
    """A stop string inside the answer cuts the output before it (finish "stop"); token counts do not depend on the batch."""
    spec = make_spec(tiny_model, stop=".")
    qa = qa_pairs()
    together = run(loaded, spec, memorized_rows())
    for i, (_, answer) in enumerate(qa):
        r = together[i]
        assert (r.output, r.finish_reason, r.error) == (answer.removesuffix("."), "stop", None), r
        alone = run(loaded, spec, [(i, row(prompt=qa[i][0]))])[i]
        # tokens through the "." only: "Paris" "." is 2, never the padding a batch adds after a row stopped
        assert r.completion_tokens == alone.completion_tokens == len(loaded.tokenizer.encode(answer))


def test_row_over_the_context_fails_alone_naming_both_numbers(loaded, spec):
    """prompt + max_new_tokens beyond max_position_embeddings fails that row with both numbers; the others succeed."""
    limit = loaded.model.config.max_position_embeddings
    (q0, a0), (q1, a1) = qa_pairs()[:2]
    long_prompt = " ".join(["the"] * limit)
    rows = [
        (0, row(prompt=q0)),
        (1, row(prompt=q1, max_new_tokens=limit)),
        (2, row(prompt=long_prompt)),
        (3, row(messages=chat(q1))),
    ]
    r = run(loaded, spec, rows, batch_rows=4)
    assert (r[0].output, r[0].error) == (a0, None)
    assert (r[3].output, r[3].error) == (a1, None)
    n1 = len(loaded.tokenizer(q1)["input_ids"])
    assert r[1].output is None and r[1].prompt_tokens == n1
    assert f"{n1} tokens" in r[1].error and f"max_new_tokens {limit}" in r[1].error and str(limit) in r[1].error
    assert r[2].prompt_tokens >= limit and f"{r[2].prompt_tokens} tokens" in r[2].error
    assert f"max_new_tokens {spec.max_new_tokens}" in r[2].error and f"context of {limit}" in r[2].error


def test_should_stop_before_the_first_batch_yields_nothing(loaded, spec):
    """should_stop() already True: generate yields no micro-batch at all."""
    assert list(generate(loaded, spec, memorized_rows(), batch_rows=2, should_stop=lambda: True)) == []


def test_should_stop_during_a_batch_stops_generation_and_drops_that_batch(loaded, tiny_model):
    """Flipping should_stop during the second micro-batch ends it within a few decode steps; it is not yielded."""
    spec = make_spec(tiny_model, max_new_tokens=200)
    qa = qa_pairs()
    rows = [(0, row(prompt=qa[0][0])), (1, row(prompt=qa[1][0])), (2, row(prompt="hello")), (3, row(prompt="the"))]
    calls = {"armed": False, "n": 0}

    def should_stop() -> bool:
        if calls["armed"]:
            calls["n"] += 1
        return calls["n"] >= 3  # the check before batch 2 and its first decode step pass, the second step stops

    gen = generate(loaded, spec, rows, batch_rows=2, should_stop=should_stop)
    first = next(gen)
    assert [(r.idx, r.output) for r in first] == [(0, qa[0][1]), (1, qa[1][1])]
    calls["armed"] = True
    assert list(gen) == []
    assert 3 <= calls["n"] <= 5  # a generate that ran on would have asked ~200 times


def test_sampling_with_a_seed_is_reproducible_and_temperature_alone_samples(loaded, tiny_model):
    """temperature > 0 without do_sample samples; the same seed gives the same outputs, other seeds other outputs."""
    spec = make_spec(tiny_model, max_new_tokens=12)
    prompts = ["hello", "the", "What is"]
    greedy = run(loaded, spec, [(i, row(prompt=p)) for i, p in enumerate(prompts)])

    def sample(seed: int) -> list[str]:
        r = run(loaded, spec, [(i, row(prompt=p, temperature=1.5, seed=seed)) for i, p in enumerate(prompts)])
        assert all(x.error is None for x in r.values())
        return [r[i].output for i in range(len(prompts))]

    assert sample(7) == sample(7)
    outputs = {tuple(sample(seed)) for seed in range(4)}
    assert len(outputs) >= 2
    assert any(list(o) != [greedy[i].output for i in range(len(prompts))] for o in outputs)


# --- loading -----------------------------------------------------------------------------------------------


def test_loader_records_what_it_resolved_on_cpu(loaded, tiny_model):
    """On CPU, dtype auto resolves to float32 with sdpa; `resolved` records dtype, backend, device and parameters."""
    meta = json.loads((tiny_model / "gpujobs_tiny.json").read_text())
    res = loaded.resolved
    assert (res["dtype"], res["attn_implementation"], res["device"], res["device_map"]) == (
        "float32",
        "sdpa",
        "cpu",
        "cpu",
    )
    assert res["parameters"] == meta["params"] and res["quantization"] is None
    assert loaded.device == torch.device("cpu") and loaded.model.dtype == torch.float32
    assert resolve_dtype("auto", on_gpu=False) == torch.float32
    assert resolve_dtype("bfloat16", on_gpu=False) == torch.bfloat16


def test_loader_honours_eager_attention(tiny_model):
    """attn_implementation eager is what the model gets and what `resolved` records; it answers the same."""
    spec = make_spec(tiny_model, attn_implementation="eager")
    loaded = load(spec, gpus=0)
    assert loaded.resolved["attn_implementation"] == "eager" == loaded.model.config._attn_implementation
    q, answer = qa_pairs()[0]
    assert run(loaded, spec, [(0, row(prompt=q))])[0].output == answer


@CPU_ONLY
@pytest.mark.parametrize(("fields", "gpus"), [({"device_map": "cuda"}, 0), ({"device_map": "auto"}, 0), ({}, 1)])
def test_loader_refuses_gpu_requests_without_cuda(tiny_model, fields, gpus):
    """device_map cuda/auto or gpus=1 on a machine without CUDA is InvalidInput about GPUs, not a CPU fallback."""
    with pytest.raises(InvalidInput, match="GPU"):
        load(make_spec(tiny_model, **fields), gpus=gpus)


def test_loader_refuses_a_pickle_checkpoint(tiny_model, loaded, tmp_path):
    """A model dir with only a pickle pytorch_model.bin fails to load (safetensors only), never loads silently."""
    pickled = tmp_path / "pickle-only"
    shutil.copytree(tiny_model, pickled)
    (pickled / "model.safetensors").unlink()
    # transformers 5 always writes safetensors (save_pretrained ignores safe_serialization=False): write the pickle
    # ourselves, the file a v4 save_pretrained(safe_serialization=False) made.
    torch.save(loaded.model.state_dict(), pickled / "pytorch_model.bin")
    assert torch.load(pickled / "pytorch_model.bin", weights_only=True).keys() == loaded.model.state_dict().keys()
    with pytest.raises(InvalidInput, match="safetensors"):
        load(make_spec(pickled), gpus=0)


# --- quantized loading on CPU --------------------------------------------------------------------------------


def _missing(module: str) -> bool:
    return importlib.util.find_spec(module) is None


BNB = pytest.mark.skipif(_missing("bitsandbytes"), reason="bitsandbytes is not installed")
TORCHAO = pytest.mark.skipif(_missing("torchao"), reason="torchao is not installed")


@pytest.mark.parametrize(
    ("method", "layer_type", "min_right"),
    [
        pytest.param("bnb-8bit", "Linear8bitLt", 4, marks=BNB),
        pytest.param("bnb-4bit", "Linear4bit", 0, marks=BNB),
        pytest.param("torchao-int8", "Int8Tensor", 4, marks=TORCHAO),
    ],
)
def test_quantized_load_generates_on_cpu(tiny_model, method, layer_type, min_right):
    """bnb 8-bit, bnb 4-bit nf4 and torchao int8 load on CPU, quantize the linears, record it and still answer."""
    spec = make_spec(tiny_model, quantization=method)
    loaded = load(spec, gpus=0)
    assert loaded.resolved["quantization"]["method"] == method and loaded.resolved["device"] == "cpu"
    if method == "bnb-4bit":
        assert loaded.resolved["quantization"]["quant_type"] == "nf4"
    proj = loaded.model.model.layers[0].self_attn.q_proj
    assert layer_type in (type(proj).__name__, type(proj.weight).__name__)  # really quantized, not a no-op
    qa = qa_pairs()
    r = run(loaded, spec, memorized_rows())
    assert sorted(r) == list(range(len(qa)))
    assert all(x.error is None and x.output is not None and x.finish_reason in ("stop", "length") for x in r.values())
    right = sum(r[i].output == answer for i, (_, answer) in enumerate(qa))
    assert right >= min_right, {i: x.output for i, x in r.items()}


def test_out_of_memory_splits_the_group_and_reports_it(tiny_model, monkeypatch):
    """A CUDA out-of-memory on a group of 8 rows (injected above 2 rows) is retried as halves down to groups of 2;
    every row still gets its memorized answer and each split is reported as an event."""
    from worker import faults

    monkeypatch.setenv("JOBS_TEST_FAULTS", "oom_over_2@generate")
    faults._faults.cache_clear()
    try:
        loaded = load(LoadOptions(model=str(tiny_model)), gpus=0)
        qa = qa_pairs()[:4] * 2
        rows = [(i, {"prompt": q, "params": {}, "extra": {}}) for i, (q, _) in enumerate(qa)]
        events: list[str] = []
        spec = GenerateSpec.model_validate({"model": str(tiny_model), "input": "file_x", "max_new_tokens": 16})
        results = [r for batch in generate(loaded, spec, rows, batch_rows=8, on_event=events.append) for r in batch]
    finally:
        monkeypatch.delenv("JOBS_TEST_FAULTS")
        faults._faults.cache_clear()
    assert [r.output for r in results] == [a for _, a in qa]
    assert events == [
        "out of memory generating 8 rows together: retrying as 4 + 4",
        "out of memory generating 4 rows together: retrying as 2 + 2",
        "out of memory generating 4 rows together: retrying as 2 + 2",
    ]


def test_a_split_retry_runs_after_the_failed_call_released_its_tensors(tiny_model, monkeypatch):
    """The retry of a group that ran out of memory starts only once the failed call's tensors are freed (on an H200
    a retry inside the `except` block kept them alive through the traceback, and every smaller retry failed too)."""
    import weakref

    loaded = load(LoadOptions(model=str(tiny_model)), gpus=0)
    real = padded._run_group
    held: list = []

    def run_group(loaded, group, started, should_stop, progress):
        if held:
            assert held[-1]() is None, "the failed call's tensor is still alive during the retry"
        if len(group) > 1:
            activations = torch.zeros(1024)  # stands for the failed generate's activations
            held.append(weakref.ref(activations))
            raise torch.OutOfMemoryError("injected")
        return real(loaded, group, started, should_stop, progress)

    monkeypatch.setattr(padded, "_run_group", run_group)
    rows = [(i, {"prompt": q, "params": {}, "extra": {}}) for i, (q, _) in enumerate(qa_pairs()[:2])]
    spec = GenerateSpec.model_validate(
        {"model": str(tiny_model), "input": "file_x", "max_new_tokens": 16, "engine": "padded"}
    )
    results = [r for batch in generate(loaded, spec, rows, batch_rows=2) for r in batch]
    assert [r.output for r in results] == [a for _, a in qa_pairs()[:2]] and len(held) == 1


def test_a_row_the_chat_template_refuses_fails_alone(tiny_model):
    """A row whose messages the chat template rejects becomes a failed row naming the template's error; the rest
    of the micro-batch still gets its answers."""
    loaded = load(LoadOptions(model=str(tiny_model)), gpus=0)
    loaded.tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}"
        "{% endif %}" + loaded.tokenizer.chat_template
    )
    ((q, a),) = qa_pairs()[:1]
    rows = [
        (0, {"messages": [{"role": "system", "content": "x"}], "params": {}, "extra": {}}),
        (1, {"prompt": q, "params": {}, "extra": {}}),
    ]
    spec = GenerateSpec.model_validate({"model": str(tiny_model), "input": "file_x", "max_new_tokens": 16})
    bad, good = next(generate(loaded, spec, rows, batch_rows=2))
    assert bad.error.startswith("cannot build the prompt:") and "no system" in bad.error
    assert good.output == a and good.error is None


def test_prompts_tokenized_as_a_batch_equal_one_by_one(loaded):
    """render_many (one tokenizer call per kind of row) gives each row the ids of tokenizing it alone: plain
    prompts with the tokenizer's special tokens, chat rows through the template without adding them again; a
    prompt the tokenizer rejects (not text) is that row's exception, the others keep their ids."""
    tok = loaded.tokenizer
    rows = [{"prompt": q} for q, _ in qa_pairs()] + [
        {"messages": [{"role": "user", "content": "hello there"}]},
        {"prompt": "x " * 300},
    ]
    alone = [
        tok(r["prompt"])["input_ids"]
        if "prompt" in r
        else tok(
            tok.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False), add_special_tokens=False
        )["input_ids"]
        for r in rows
    ]
    assert common.render_many(loaded, rows) == alone
    mixed = common.render_many(loaded, [{"prompt": 7}, rows[0]])
    assert isinstance(mixed[0], Exception) and mixed[1] == alone[0]


def test_texts_decoded_as_a_batch_equal_one_by_one(loaded):
    """decode_many (one call to the Rust tokenizer for many rows) gives each row tok.decode's text, special tokens
    skipped; `sequences` cuts each at its EOS and stop string as `sequence` does row by row."""
    import random

    tok = loaded.tokenizer
    rng = random.Random(0)
    specials = sorted(set(tok.all_special_ids))
    rows = [[rng.randrange(len(tok)) for _ in range(rng.randint(0, 40))] + specials[:1] for _ in range(50)]
    assert common.decode_many(tok, rows) == [tok.decode(r, skip_special_tokens=True) for r in rows]
    eos = {tok.eos_token_id}
    items = [
        (r, eos, [tok.decode(r[3:5], skip_special_tokens=True)] if i % 3 == 0 else None) for i, r in enumerate(rows)
    ]
    assert common.sequences(tok, items) == [common.sequence(tok, *item) for item in items]


# --- sdpa_gqa (worker/attention.py) --------------------------------------------------------------------------


def test_sdpa_gqa_matches_sdpa_logits_and_greedy_outputs(tiny_model, loaded, spec):
    """A model loaded with attn_implementation sdpa_gqa (enable_gqa instead of repeat_kv) records it, gives the
    logits of sdpa on a left-padded batch (float32, 1e-5) and the same greedy answers."""
    gqa = load(make_spec(tiny_model, attn_implementation="sdpa_gqa"), gpus=0)
    assert gqa.resolved["attn_implementation"] == "sdpa_gqa"
    assert gqa.model.config.num_key_value_heads < gqa.model.config.num_attention_heads  # the case it is for
    tok = loaded.tokenizer
    enc = tok.pad({"input_ids": [tok(q)["input_ids"] for q, _ in qa_pairs()]}, padding=True, return_tensors="pt")
    assert (enc["attention_mask"] == 0).any()  # really padded: a mask is passed, the case repeat_kv hurt
    with torch.inference_mode():
        want = loaded.model(**enc).logits
        got = gqa.model(**enc).logits
    real = enc["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    r = run(gqa, make_spec(tiny_model, attn_implementation="sdpa_gqa"), memorized_rows())
    assert [r[i].output for i in range(len(qa_pairs()))] == [a for _, a in qa_pairs()]


def test_padded_engine_switches_to_sdpa_gqa_on_cuda_and_back(tiny_model):
    """On CUDA (forced here on CPU) the padded engine runs a grouped-query sdpa model with sdpa_gqa, records it,
    answers the same, and leaves the resident model on sdpa afterwards; off CUDA it keeps sdpa."""
    from worker.engines.common import padded_attention

    loaded = load(make_spec(tiny_model), gpus=0)
    with padded_attention(loaded, on_cuda=True) as attn:
        assert attn == "sdpa_gqa" == loaded.model.config._attn_implementation
        q, a = qa_pairs()[2]
        assert run(loaded, make_spec(tiny_model, engine="padded"), [(0, row(prompt=q))])[0].output == a
    assert loaded.model.config._attn_implementation == "sdpa"
    with padded_attention(loaded, on_cuda=False) as attn:
        assert attn == "sdpa"
    eager = load(make_spec(tiny_model, attn_implementation="eager"), gpus=0)
    with padded_attention(eager, on_cuda=True) as attn:
        assert attn == "eager"  # only sdpa is replaced
