"""The continuous engine (transformers' continuous batching driven by worker/engines/continuous.py) against the
padded one, and num_return_sequences in both, on the tiny memorized model. No queue, no database.

Runs under transformers 5.24 and 5.17 (`/work/venv517/bin/python -m pytest tests/test_engine*.py`): the two
versions name the page size differently and 5.17 switches sdpa to `paged|sdpa` inside continuous batching.
"""

from __future__ import annotations

import importlib.util

import pytest

from core.capability import missing
from core.errors import InvalidInput
from core.spec import GenerateSpec
from tests.conftest import qa_pairs
from worker.engines import common
from worker.generate import generate
from worker.loader import Loaded, load


def make_spec(model, **fields) -> GenerateSpec:
    return GenerateSpec.model_validate({"model": str(model), "input": "file_x", "max_new_tokens": 16, **fields})


def row(prompt: str | None = None, messages: list | None = None, **params) -> dict:
    return {**({"prompt": prompt} if prompt is not None else {"messages": messages}), "params": params, "extra": {}}


def run(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int = 64, info: dict | None = None, **kw):
    batches = list(generate(loaded, spec, rows, batch_rows=batch_rows, info=info, **kw))
    flat = [r for b in batches for r in b]
    assert len({r.idx for r in flat}) == len(flat), "a row was yielded twice"
    return {r.idx: r for r in flat}, batches


@pytest.fixture(scope="module")
def loaded(tiny_model) -> Loaded:
    return load(make_spec(tiny_model), gpus=0)


def memorized(n_copies: int = 1) -> list[tuple[int, dict]]:
    rows = []
    for c in range(n_copies):
        for q, _ in qa_pairs():
            rows.append((len(rows), row(prompt=q) if c % 2 == 0 else row(messages=[{"role": "user", "content": q}])))
    return rows


def test_continuous_and_padded_give_identical_greedy_results(loaded, tiny_model):
    """Greedy, prompt and chat rows: the continuous engine returns exactly the padded engine's outputs, finish
    reasons and token counts; every row comes back once, in micro-batches of at most batch_rows."""
    rows = memorized(n_copies=3)
    padded, _ = run(loaded, make_spec(tiny_model, engine="padded"), rows, batch_rows=5)
    info: dict = {}
    cont, batches = run(loaded, make_spec(tiny_model, engine="continuous"), rows, batch_rows=5, info=info)
    assert sorted(cont) == sorted(padded) == list(range(len(rows)))
    assert all(len(b) <= 5 for b in batches) and len(batches) == 4
    for idx, p in padded.items():
        c = cont[idx]
        assert (c.output, c.finish_reason, c.prompt_tokens, c.completion_tokens, c.error) == (
            p.output,
            p.finish_reason,
            p.prompt_tokens,
            p.completion_tokens,
            p.error,
        ), idx
    answers = [a for _, a in qa_pairs()]
    assert [cont[i].output for i in range(len(answers))] == answers
    assert info["engine"] == "continuous"
    assert info["attn_implementation"] in ("sdpa", "paged|sdpa")  # 5.24 keeps sdpa, 5.17 switches to paged|sdpa
    assert info["cuda_graphs"] == {"varlen": False, "decode": False} and info["async_batching"] is False
    assert info["cache"]["num_blocks"] >= 1


def test_auto_runs_padded_and_says_why(loaded, tiny_model):
    """engine auto picks padded and records the reason and the attention that ran."""
    info: dict = {}
    r, _ = run(loaded, make_spec(tiny_model), memorized()[:2], info=info)
    assert info["engine"] == "padded" and info["engine_reason"].startswith("auto: padded on CPU")
    assert info["attn_implementation"] == "sdpa" and r[0].output == qa_pairs()[0][1]


def test_per_row_params_in_the_continuous_engine(loaded, tiny_model):
    """Per-row max_new_tokens, stop strings and ignore_eos hold in the continuous engine as in the padded one."""
    q, answer = qa_pairs()[3]  # "William Shakespeare." is 6 tokens + the terminator
    rows = [
        (0, row(prompt=q, max_new_tokens=1)),
        (1, row(prompt=q, max_new_tokens=4)),
        (2, row(prompt=q)),
        (3, row(prompt=q, stop=["Shake"])),
        (4, row(prompt=q, ignore_eos=True, max_new_tokens=12)),
    ]
    cont, _ = run(loaded, make_spec(tiny_model, engine="continuous"), rows)
    padded, _ = run(loaded, make_spec(tiny_model, engine="padded"), rows)
    for idx, n in ((0, 1), (1, 4), (4, 12)):
        assert (cont[idx].finish_reason, cont[idx].completion_tokens, cont[idx].error) == ("length", n, None)
    assert cont[1].output == padded[1].output and answer.startswith(cont[1].output)
    assert (cont[2].output, cont[2].finish_reason) == (answer, "stop")
    assert (cont[3].output, cont[3].finish_reason, cont[3].completion_tokens) == (
        "William ",
        "stop",
        padded[3].completion_tokens,
    )
    assert cont[4].output.startswith(answer)


def test_sampling_groups_share_a_seed_and_reproduce(loaded, tiny_model):
    """Rows with different temperatures run in separate managers; the same seed gives the same outputs."""
    spec = make_spec(tiny_model, engine="continuous", max_new_tokens=12, seed=11)
    rows = [
        (i, row(prompt=p, temperature=t))
        for i, (p, t) in enumerate([("hello", 1.5), ("the", 1.5), ("What is", 2.0), ("hello", 0.0)])
    ]
    first, _ = run(loaded, spec, rows)
    again, _ = run(loaded, spec, rows)
    assert [first[i].output for i in range(4)] == [again[i].output for i in range(4)]
    assert all(r.error is None and r.completion_tokens >= 1 for r in first.values())


@pytest.mark.parametrize("engine_name", ["padded", "continuous"])
def test_num_return_sequences_stores_lists_and_sums_tokens(loaded, tiny_model, engine_name):
    """n = 4 with sampling: output is a list of 4 strings (not all equal), finish_reason a list of 4 and
    completion_tokens their sum; a row overriding n to 1 keeps a plain string."""
    spec = make_spec(tiny_model, engine=engine_name, temperature=1.5, num_return_sequences=4, max_new_tokens=10, seed=3)
    rows = [
        (0, row(prompt="hello", ignore_eos=True)),
        (1, row(prompt="the", num_return_sequences=1)),
        (2, row(prompt=qa_pairs()[0][0], temperature=0.01)),
        (3, row(prompt="What is")),
    ]
    r, _ = run(loaded, spec, rows)
    out = r[0]
    assert out.error is None and isinstance(out.output, list) and len(out.output) == 4
    assert out.finish_reason == ["length"] * 4 and out.completion_tokens == 4 * 10  # the sum of the 4 samples
    assert len(set(out.output)) >= 2
    assert isinstance(r[3].finish_reason, list) and len(r[3].finish_reason) == 4 and len(r[3].output) == 4
    assert set(r[3].finish_reason) <= {"stop", "length"} and 4 <= r[3].completion_tokens <= 40
    assert isinstance(r[1].output, str) and isinstance(r[1].finish_reason, str)
    assert r[2].output == [qa_pairs()[0][1]] * 4  # near-greedy samples of a memorized answer agree


def test_num_return_sequences_without_sampling_is_refused(loaded, tiny_model):
    """n > 1 with greedy decoding: the spec is refused; a row that turns sampling off fails alone, saying why."""
    with pytest.raises(ValueError, match="num_return_sequences > 1 needs sampling"):
        make_spec(tiny_model, num_return_sequences=2)
    spec = make_spec(tiny_model, engine="continuous")
    r, _ = run(loaded, spec, [(0, row(prompt="hello", num_return_sequences=3)), (1, row(prompt=qa_pairs()[1][0]))])
    assert r[0].output is None and "num_return_sequences 3 needs sampling" in r[0].error
    assert r[1].output == qa_pairs()[1][1]


def test_a_request_that_fails_inside_the_engine_is_a_failed_row(loaded, tiny_model, monkeypatch):
    """A token id the model's embedding does not have makes transformers' continuous batching fail the request(s)
    with an error: those rows are failed rows carrying the engine's error, never successes with empty text."""
    real_render = common.render_many
    vocab = loaded.model.config.vocab_size

    def render_many(loaded_, row_inputs):
        return [
            [vocab + 5] if r.get("prompt") == "BROKEN" else ids
            for r, ids in zip(row_inputs, real_render(loaded_, row_inputs))
        ]

    monkeypatch.setattr(common, "render_many", render_many)
    rows = [(0, row(prompt="BROKEN"))] + [(i + 1, r) for i, r in memorized()]
    r, _ = run(loaded, make_spec(tiny_model, engine="continuous"), rows, batch_rows=3)
    assert sorted(r) == list(range(len(rows)))
    assert r[0].output is None and r[0].error.startswith("failed inside the continuous engine:")
    assert "index out of range" in r[0].error
    for res in r.values():  # the step failed for its whole batch: each row failed or answered, none empty
        assert (res.error is None) == (res.output is not None), res
        assert res.error is not None or res.output


def test_cancel_stops_the_continuous_engine_at_its_next_check(loaded, tiny_model):
    """should_stop turning true mid-run (its third check) ends a long continuous run at that check: no decode step
    follows (the run loop asks once more on its way out), and the unfinished micro-batch is not yielded. Counted in
    checks, not seconds: the engine checks between results, every 0.2 s at most."""
    spec = make_spec(tiny_model, engine="continuous", max_new_tokens=400, ignore_eos=True)
    rows = [(i, row(prompt=p)) for i, p in enumerate(["hello", "the", "What is", "Paris"] * 2)]
    checks = []

    def should_stop() -> bool:
        checks.append(len(checks) >= 2)
        return checks[-1]

    batches = list(generate(loaded, spec, rows, batch_rows=4, should_stop=should_stop))
    assert batches == []
    assert checks[:3] == [False, False, True] and len(checks) <= 4, f"the engine went on: {len(checks)} checks"


def test_out_of_memory_halves_concurrency_and_reports_it(tiny_model, loaded, monkeypatch):
    """An out-of-memory with more than 2 concurrent requests (injected) is retried with half as many, down to 2;
    every row still gets its answer and each retry is an event."""
    from worker import faults

    monkeypatch.setenv("JOBS_TEST_FAULTS", "oom_over_2@generate")
    faults._faults.cache_clear()
    try:
        events: list[str] = []
        r, _ = run(loaded, make_spec(tiny_model, engine="continuous"), memorized()[:4], on_event=events.append)
    finally:
        monkeypatch.delenv("JOBS_TEST_FAULTS")
        faults._faults.cache_clear()
    assert [r[i].output for i in range(4)] == [a for _, a in qa_pairs()[:4]]
    assert events == [
        "out of memory in continuous batching with up to 4 concurrent requests: retrying the 4 "
        "unfinished rows with up to 2"
    ]


def test_repetition_penalty_fails_the_row_under_continuous(loaded, tiny_model):
    """repetition_penalty (which transformers' continuous batching would drop silently) fails that row under
    engine continuous, naming the fix; the padded engine (auto) runs it."""
    q, a = qa_pairs()[0]
    rows = [(0, row(prompt=q, repetition_penalty=1.1)), (1, row(prompt=q))]
    r, _ = run(loaded, make_spec(tiny_model, engine="continuous"), rows)
    assert r[0].output is None and "repetition_penalty is not supported by the continuous engine" in r[0].error
    assert r[1].output == a
    r, _ = run(loaded, make_spec(tiny_model), rows)
    assert r[0].error is None and r[0].output


def test_continuous_refuses_flex_attention_at_submit_and_in_the_worker(tiny_model):
    """engine continuous with flex_attention is refused by the capability check and by the engine itself;
    cuda_graphs/async_batching on need a GPU slice and engine continuous."""
    caps = {"versions": {}, "attention": []}
    spec = make_spec(tiny_model, engine="continuous", attn_implementation="flex_attention")
    assert any("cannot run flex_attention" in p for p in missing(spec, caps, 0))
    assert any(
        "cuda_graphs=on needs a GPU slice" in p
        for p in missing(make_spec(tiny_model, engine="continuous", cuda_graphs="on"), caps, 0)
    )
    assert any(
        "async_batching=on applies to engine continuous only" in p
        for p in missing(make_spec(tiny_model, async_batching="on"), caps, 1)
    )
    assert missing(make_spec(tiny_model, engine="continuous"), caps, 0) == []
    loaded = load(make_spec(tiny_model, attn_implementation="flex_attention"), gpus=0)
    with pytest.raises(InvalidInput, match="engine continuous cannot run attention 'flex_attention'"):
        list(generate(loaded, spec, memorized()[:1], batch_rows=1))


def test_spec_refuses_unknown_engine_values(tiny_model):
    """engine / cuda_graphs / async_batching accept only their listed values."""
    for field, value in (("engine", "vllm"), ("cuda_graphs", "yes"), ("async_batching", 1.5)):
        with pytest.raises(ValueError, match=field):
            make_spec(tiny_model, **{field: value})
    # YAML reads `on`/`off` as booleans (spec files, `--set cuda_graphs=on`): they mean "on"/"off"
    spec = make_spec(tiny_model, engine="continuous", cuda_graphs=True, async_batching=False)
    assert (spec.cuda_graphs, spec.async_batching) == ("on", "off")


@pytest.mark.skipif(
    importlib.util.find_spec("celery") is None,
    reason="the worker needs celery (a venv with only the engine's packages, such as a local transformers 5.17 one)",
)
def test_a_continuous_job_through_a_worker_records_the_engine_and_stores_n_outputs(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """Through the service (SQLite, Redis, a real worker): engine continuous with num_return_sequences 2 stores a
    list of 2 outputs per row, and the job's load options and the shard's metrics say which engine and attention
    ran."""
    import json

    from sqlalchemy import select
    from transformers import AutoTokenizer

    from api import service, views
    from core.db import session_scope
    from core.models import JobRow, Shard
    from tests.conftest import wait_for

    data = tmp_path / "d.jsonl"
    qa = qa_pairs()
    data.write_text("".join(json.dumps({"prompt": q}) + "\n" for q, _ in qa[:3]))
    job = service.submit(
        owner="t",
        spec_data={
            "model": str(tiny_model),
            "input": str(data),
            "gpus": 0,
            "engine": "continuous",
            "max_new_tokens": 16,
            "temperature": 0.01,
            "num_return_sequences": 2,
            "batch_rows": 2,
        },
    )
    worker = spawn_worker([])
    wait_for(
        lambda: views.get(job["id"], owner=None)["state"] in ("succeeded", "failed"), 120, "the job", procs=[worker]
    )
    final = views.get(job["id"], owner=None)
    assert final["state"] == "succeeded", final
    engine_ran = final["load_options"]["engine"]
    assert engine_ran["engine"] == "continuous" and engine_ran["attn_implementation"] in ("sdpa", "paged|sdpa")
    with session_scope() as session:
        rows = session.scalars(select(JobRow).where(JobRow.job_id == job["id"]).order_by(JobRow.idx)).all()
        assert [r.output for r in rows] == [[a, a] for _, a in qa[:3]]
        tok = AutoTokenizer.from_pretrained(tiny_model)
        assert [r.completion_tokens for r in rows] == [2 * (len(tok.encode(a)) + 1) for _, a in qa[:3]]  # + EOS
        assert [r.finish_reason for r in rows] == [["stop", "stop"]] * 3  # a JSON list (migration 0004)
        shard = session.scalars(select(Shard).where(Shard.job_id == job["id"])).one()
        assert shard.metrics["engine"]["engine"] == "continuous"
        assert shard.metrics["engine"]["cuda_graphs"] == {"varlen": False, "decode": False}


def test_auto_runs_paged_attention_on_the_continuous_engine_and_padded_refuses_it(loaded, tiny_model):
    """`paged|sdpa` under engine auto runs on the continuous engine (the one that runs paged attention), saying
    why; engine padded refuses it instead of running plain sdpa without a word."""
    info: dict = {}
    results, _ = run(loaded, make_spec(tiny_model, attn_implementation="paged|sdpa"), memorized()[:2], info=info)
    assert info["engine"] == "continuous"
    assert info["engine_reason"] == "auto: continuous, the engine that runs paged|sdpa"
    assert all(r.error is None for r in results.values())
    with pytest.raises(InvalidInput, match=r"engine padded cannot run paged\|sdpa: use engine continuous or auto"):
        run(loaded, make_spec(tiny_model, attn_implementation="paged|sdpa", engine="padded"), memorized()[:1])
