"""The static-cache engine (`engine: static`, worker/engines/static.py) on the tiny memorized model, on CPU.

On CPU the engine runs uncompiled by default; the tests that check compilation set
`worker.engines.static.CPU_COMPILE` to a CompileConfig whose backend counts the graphs dynamo hands it (tracing for
real, running them eagerly), so "one compile per shape" is counted, not assumed. Runs under transformers 5.24 and
5.17 (.ci/run).
"""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig

from core.capability import missing
from core.spec import GenerateSpec
from tests.conftest import qa_pairs
from worker.engines import static
from worker.engines.static import cache_bucket
from worker.generate import generate
from worker.loader import Loaded, load


def make_spec(model, **fields) -> GenerateSpec:
    return GenerateSpec.model_validate({"model": str(model), "input": "file_x", **fields})


def row(*, prompt: str | None = None, messages: list | None = None, **params) -> dict:
    text = {"prompt": prompt} if prompt is not None else {"messages": messages}
    return {**text, "params": params, "extra": {}}


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


def run(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int = 8, info: dict | None = None, **kw):
    """All results by idx; every idx must come back exactly once."""
    out: dict = {}
    for batch in generate(loaded, spec, rows, batch_rows=batch_rows, info=info, **kw):
        for r in batch:
            assert r.idx not in out, f"row {r.idx} yielded twice"
            out[r.idx] = r
    return out


def texts(results: dict) -> dict:
    return {i: (r.output, r.finish_reason, r.completion_tokens, r.error) for i, r in results.items()}


def mixed_rows() -> list[tuple[int, dict]]:
    """Memorized questions as prompts and as chat, plus prompts the model never saw (ragged lengths)."""
    rows = []
    for i, (q, _) in enumerate(qa_pairs()):
        rows += [(2 * i, row(prompt=q)), (2 * i + 1, row(messages=chat(q)))]
    return rows + [(100 + i, row(prompt=p)) for i, p in enumerate(["hello", "the", "What is", "water city sky"])]


@pytest.fixture(scope="module")
def loaded(tiny_model) -> Loaded:
    return load(make_spec(tiny_model), gpus=0)


class Counter:
    graphs = 0


@pytest.fixture
def compiled(monkeypatch, loaded):
    """Compile on CPU with a backend that counts the graphs dynamo compiles and runs them eagerly (a plain
    function: generate deep-copies its config, and a function survives that by identity)."""
    counter = Counter()

    def backend(gm, example_inputs):
        counter.graphs += 1
        return gm.forward

    config = CompileConfig(backend=backend, mode=None, dynamic=False)  # as on CUDA: one graph per shape
    config._compile_all_devices = True
    monkeypatch.setattr(static, "CPU_COMPILE", config)
    loaded.model.__dict__.pop("_gpujobs_static_shapes", None)
    yield counter
    loaded.model.__dict__.pop("_gpujobs_static_shapes", None)
    for attr in ("_compiled_call", "_last_compile_config"):
        loaded.model.__dict__.pop(attr, None)
    torch._dynamo.reset()


def test_greedy_outputs_equal_the_padded_engine_with_dummy_rows_dropped(loaded, tiny_model):
    """Greedy: every row's output, finish reason and token counts equal the padded engine's; 16 rows in calls of 5
    slots need 4 dummy rows, and none of them comes back; memorized answers are exact; sdpa_gqa ran."""
    rows = mixed_rows()
    padded = run(loaded, make_spec(tiny_model, engine="padded", max_new_tokens=12), rows, batch_rows=4)
    info: dict = {}
    static = run(loaded, make_spec(tiny_model, engine="static", max_new_tokens=12), rows, batch_rows=5, info=info)
    assert sorted(static) == sorted(idx for idx, _ in rows)
    for idx, _ in rows:
        s, p = static[idx], padded[idx]
        assert (s.output, s.finish_reason, s.prompt_tokens, s.completion_tokens, s.error) == (
            p.output,
            p.finish_reason,
            p.prompt_tokens,
            p.completion_tokens,
            p.error,
        ), idx
    for i, (_, answer) in enumerate(qa_pairs()):
        assert static[2 * i].output == static[2 * i + 1].output == answer
    st = info["static"]
    assert (info["engine"], info["attn_implementation"]) == ("static", "sdpa_gqa")
    assert (st["calls"], st["dummy_rows"], st["slots"]) == (4, 4, 5)
    assert st["compiled"] is False and "CPU" in st["compile_reason"] and st["compile_s"] == 0
    assert st["cache"]["cache_len"] == 128 and st["cache"]["bytes"] == 5 * 128 * st["cache"]["bytes_per_token"]
    assert loaded.model.config._attn_implementation == "sdpa"  # switched back for the next job


def test_compiles_once_per_shape_and_reuses_it(loaded, tiny_model, compiled):
    """With compilation on: the first call at a (slots, cache length) shape compiles in a timed warm-up; later
    calls and later shards at that shape compile nothing; a longer max_new_tokens is a new bucket, compiled once;
    outputs equal the uncompiled engine's."""
    rows = mixed_rows()
    short = make_spec(tiny_model, engine="static", max_new_tokens=12)
    info: dict = {}
    first = run(loaded, short, rows, batch_rows=4, info=info)
    after_first = compiled.graphs
    st = info["static"]
    assert after_first >= 1 and st["compiled"] is True
    assert [(c["slots"], c["cache_len"]) for c in st["compiles"]] == [(4, 128)] and st["compile_s"] > 0
    assert st["calls"] == 4 and len(st["shapes"]) == 1
    again: dict = {}
    assert texts(run(loaded, short, rows, batch_rows=4, info=again)) == texts(first)  # a second shard
    assert compiled.graphs == after_first and again["static"]["compiles"] == []
    long_info: dict = {}
    long = run(
        loaded, make_spec(tiny_model, engine="static", max_new_tokens=150), rows[:4], batch_rows=4, info=long_info
    )
    assert [(c["slots"], c["cache_len"]) for c in long_info["static"]["compiles"]] == [(4, 192)]
    grew = compiled.graphs
    assert grew > after_first
    run(loaded, short, rows[:4], batch_rows=4)
    run(loaded, make_spec(tiny_model, engine="static", max_new_tokens=150), rows[4:8], batch_rows=4)
    assert compiled.graphs == grew  # back to both known shapes: no new graph
    assert [long[i].output for i in range(4)] == [first[i].output for i in range(4)]


def test_cancel_stops_a_compiled_call_between_steps_and_drops_it(loaded, tiny_model, compiled):
    """should_stop flipping during the second call ends it within a few decode steps of the compiled model; that
    call is not yielded (its rows stay pending)."""
    spec = make_spec(tiny_model, engine="static", max_new_tokens=200, ignore_eos=True)
    rows = [(i, row(prompt=p)) for i, p in enumerate(["hello", "the", "What is", "water"])]
    calls = {"armed": False, "n": 0}

    def should_stop() -> bool:
        if calls["armed"]:
            calls["n"] += 1
        return calls["n"] >= 3

    gen = generate(loaded, spec, rows, batch_rows=2, should_stop=should_stop)
    first = next(gen)
    assert [r.completion_tokens for r in first] == [200, 200]
    graphs = compiled.graphs
    calls["armed"] = True
    assert list(gen) == []
    assert 3 <= calls["n"] <= 5  # an uncancellable call would have asked ~200 times
    assert compiled.graphs == graphs  # it ran the compiled step, not a fallback that recompiled


def test_row_params_stop_strings_and_ignore_eos_per_row(loaded, tiny_model):
    """Per-row max_new_tokens, stop strings and ignore_eos give the padded engine's results row by row; rows with
    different parameters never share a call."""
    q, answer = qa_pairs()[3]  # "William Shakespeare."
    rows = [
        (0, row(prompt=q, max_new_tokens=1)),
        (1, row(prompt=q, max_new_tokens=4)),
        (2, row(prompt=q)),
        (3, row(messages=chat(q), max_new_tokens=2)),
        (4, row(prompt=q, stop=["Shake"])),
        (5, row(prompt=q, ignore_eos=True, max_new_tokens=10)),
        (6, row(prompt=q, stop=".")),
        (7, row(prompt=qa_pairs()[0][0], stop=["Shake"])),
    ]
    info: dict = {}
    r = run(loaded, make_spec(tiny_model, engine="static", max_new_tokens=16), rows, batch_rows=4, info=info)
    for idx, n in ((0, 1), (1, 4), (3, 2)):
        assert (r[idx].finish_reason, r[idx].completion_tokens, r[idx].error) == ("length", n, None), r[idx]
        assert r[idx].output and answer.startswith(r[idx].output)
    assert (r[2].output, r[2].finish_reason) == (answer, "stop")
    assert (r[4].output, r[4].finish_reason) == ("William ", "stop")
    assert (r[5].finish_reason, r[5].completion_tokens) == ("length", 10) and r[5].output.startswith(answer)
    assert (r[6].output, r[6].finish_reason, r[6].completion_tokens) == (
        answer.removesuffix("."),
        "stop",
        len(loaded.tokenizer.encode(answer)),
    )
    assert r[7].output == qa_pairs()[0][1]  # shares row 4's parameters and call
    padded = run(loaded, make_spec(tiny_model, engine="padded", max_new_tokens=16), rows, batch_rows=8)
    assert {i: (x.output, x.completion_tokens) for i, x in r.items()} == {
        i: (x.output, x.completion_tokens) for i, x in padded.items()
    }
    assert info["static"]["calls"] == 7  # 7 parameter groups: (4, 7) share a call


def test_sampling_seeded_and_num_return_sequences(loaded, tiny_model):
    """Sampling with a seed is reproducible; n=3 gives three outputs (completion tokens their sum) and takes three
    slots of a call, so a row's samples never straddle two calls."""
    spec = make_spec(tiny_model, engine="static", max_new_tokens=10)
    rows = [
        (i, row(prompt=p, temperature=1.5, seed=7, num_return_sequences=3))
        for i, p in enumerate(["hello", "the", "What is"])
    ]
    info: dict = {}
    a = run(loaded, spec, rows, batch_rows=4, info=info)
    b = run(loaded, spec, rows, batch_rows=4)
    assert {i: x.output for i, x in a.items()} == {i: x.output for i, x in b.items()}
    for x in a.values():
        assert x.error is None and len(x.output) == 3 and len(x.finish_reason) == 3
        assert 3 <= x.completion_tokens <= 30
    assert len({o for x in a.values() for o in x.output}) > 3  # samples differ
    assert (info["static"]["calls"], info["static"]["dummy_rows"]) == (3, 3)  # one row (3 slots) + 1 dummy each


def test_out_of_memory_halves_the_slots_and_reports_it(tiny_model, monkeypatch):
    """An out-of-memory above 2 sequences (injected) halves the call width 8 → 4 → 2; every row still gets its
    memorized answer and each halving is an event."""
    from worker import faults

    monkeypatch.setenv("JOBS_TEST_FAULTS", "oom_over_2@generate")
    faults._faults.cache_clear()
    try:
        loaded = load(make_spec(tiny_model), gpus=0)
        qa = qa_pairs()[:4] * 2
        rows = [(i, row(prompt=q)) for i, (q, _) in enumerate(qa)]
        events: list[str] = []
        info: dict = {}
        r = run(
            loaded,
            make_spec(tiny_model, engine="static", max_new_tokens=16),
            rows,
            batch_rows=8,
            on_event=events.append,
            info=info,
        )
    finally:
        monkeypatch.delenv("JOBS_TEST_FAULTS")
        faults._faults.cache_clear()
    assert [r[i].output for i in range(8)] == [a for _, a in qa]
    assert events == [
        "out of memory generating 8 sequences together (static engine): retrying as calls of 4",
        "out of memory generating 4 sequences together (static engine): retrying as calls of 2",
    ]
    assert (info["static"]["slots"], info["static"]["calls"]) == (2, 4)


def test_cache_buckets_and_refusals(tiny_model):
    """Cache lengths round up to 128·2^k / 192·2^k (capped at the context when the row fits); a spec asking
    engine static with an attention it cannot run is refused at submit."""
    assert [cache_bucket(n) for n in (1, 128, 129, 193, 257, 512, 513, 1300)] == [
        128,
        128,
        192,
        256,
        384,
        512,
        768,
        1536,
    ]
    assert cache_bucket(500, limit=512) == 512 and cache_bucket(300, limit=320) == 320
    caps = {"versions": {}, "attention": []}
    assert missing(make_spec(tiny_model, engine="static"), caps, 0) == []
    problems = missing(make_spec(tiny_model, engine="static", attn_implementation="flex_attention"), caps, 0)
    assert len(problems) == 1 and "engine static cannot run flex_attention" in problems[0]
