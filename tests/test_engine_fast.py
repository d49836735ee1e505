"""The fast engine (`engine: fast`, worker/engines/fastgen.py) on the tiny memorized model, on CPU.

On CPU the engine runs without CUDA graphs and with the SDPA reference of its decode attention; the Triton kernel
itself runs under `TRITON_INTERPRET=1` in a subprocess (the interpreter is chosen when triton is imported), against
the reference and through the whole engine. Scheduling (admission into fewer slots than rows, refill, moving rows
down into lower slots, per-row lengths) is checked by equality with the padded engine. Runs under transformers 5.24
and 5.17 (.ci/run).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from core import logprob_store
from core.capability import missing
from core.dataset import fast_unsupported
from core.errors import InvalidInput
from core.spec import GenerateSpec
from tests.conftest import qa_pairs
from worker import faults
from worker import generate as engine
from worker.engines import common, decode_attention, fast, fastgen, paged_attention, slot_state
from worker.generate import generate
from worker.loader import Loaded, load
from worker.progress import Progress

ROOT = Path(__file__).resolve().parents[1]


def make_spec(model, **fields) -> GenerateSpec:
    return GenerateSpec.model_validate({"model": str(model), "input": "file_x", **fields})


def row(prompt: str, **params) -> dict:
    return {"prompt": prompt, "params": params, "extra": {}}


def run(loaded: Loaded, spec: GenerateSpec, rows, *, batch_rows: int = 4, info: dict | None = None, **kw) -> dict:
    out: dict = {}
    for batch in generate(loaded, spec, rows, batch_rows=batch_rows, info=info, **kw):
        for r in batch:
            assert r.idx not in out, f"row {r.idx} yielded twice"
            out[r.idx] = r
    return out


def run_auto(loaded: Loaded, model, rows, on_event=print, **fields) -> dict:
    """`rows` under engine auto as the worker runs it on CUDA (`run_engine` with the fast engine chosen), by index:
    the rows the fast engine cannot run go to the padded one."""
    out: dict = {}
    for batch in engine.run_engine(
        "fast",
        loaded,
        make_spec(model, **fields),
        rows,
        batch_rows=4,
        should_stop=lambda: False,
        on_event=on_event,
        info={},
        progress=Progress(),
    ):
        for r in batch:
            out[r.idx] = r
    return out


def fields(results: dict) -> dict:
    return {i: (r.output, r.finish_reason, r.prompt_tokens, r.completion_tokens, r.error) for i, r in results.items()}


def ragged_rows() -> list[tuple[int, dict]]:
    """Memorized questions (they end in EOS), unseen prompts of several lengths run to their own max_new_tokens."""
    rows = [(i, row(q)) for i, (q, _) in enumerate(qa_pairs())]
    others = ["hello", "the", "What is", "water city sky", "the the the the the the the the the"]
    rows += [(100 + i, row(p, max_new_tokens=3 + 7 * i, ignore_eos=True)) for i, p in enumerate(others)]
    return rows + [(200, row("sky", max_new_tokens=1))]


@pytest.fixture(scope="module")
def loaded(tiny_model) -> Loaded:
    return load(make_spec(tiny_model), gpus=0)


@pytest.fixture
def slots(monkeypatch, loaded):
    """Set the CPU slot count of the fast engine for one test (the resident state, sized when it is made, is
    dropped before and after)."""

    def set_slots(n: int) -> None:
        monkeypatch.setattr(slot_state, "CPU_SLOTS", n)
        slot_state.release(loaded.model)

    yield set_slots
    slot_state.release(loaded.model)


@pytest.mark.parametrize("n_slots", [16, 3, 1])
def test_greedy_results_equal_the_padded_engine_with_any_number_of_slots(loaded, tiny_model, slots, n_slots):
    """Greedy, ragged prompts and per-row max_new_tokens: every row's text, finish reason and token counts equal
    the padded engine's, whether all rows fit in the slots at once or wait for a free one (3 slots, 1 slot);
    memorized answers are exact."""
    slots(n_slots)
    rows = ragged_rows()
    padded = run(loaded, make_spec(tiny_model, engine="padded", max_new_tokens=24), rows)
    info: dict = {}
    fast = run(loaded, make_spec(tiny_model, engine="fast", max_new_tokens=24), rows, info=info)
    assert fields(fast) == fields(padded)
    for i, (_, answer) in enumerate(qa_pairs()):
        assert fast[i].output == answer and fast[i].finish_reason == "stop"
    assert fast[200].completion_tokens == 1 and fast[104].completion_tokens == 31
    stats = info["fast"]
    assert info["engine"] == "fast" and info["attn_implementation"].startswith(paged_attention.NAME)
    assert stats["slots"] == min(n_slots, len(rows)) and stats["cuda_graphs"] is False
    assert stats["steps"] >= 30 and stats["runs"] == 1
    assert {"wait_s", "book_s", "mask_s", "caller_s"} <= set(stats)  # where the host's time went
    assert stats["wait_s"] == 0  # on the CPU a step's tokens are there when it returns
    assert loaded.model.config._attn_implementation == "sdpa"  # switched back for the next job


def test_rows_are_yielded_in_micro_batches_as_they_finish(loaded, tiny_model, slots):
    """A micro-batch is yielded once at least batch_rows rows are ready (the last one the rest), sorted by idx;
    rows that finish in the same decode step share one, however many: 8 equal rows with batch_rows 2 are one
    commit, not 4. A one-token row finishes (at prefill) before the long ones."""
    slots(16)
    rows = ragged_rows()
    batches = list(generate(loaded, make_spec(tiny_model, engine="fast", max_new_tokens=24), rows, batch_rows=4))
    assert all(len(b) >= 4 for b in batches[:-1]) and sum(map(len, batches)) == len(rows) and len(batches) > 1
    assert all([r.idx for r in b] == sorted(r.idx for r in b) for b in batches)
    assert 200 in [r.idx for r in batches[0]]
    equal = [(i, row("hello", max_new_tokens=5, ignore_eos=True)) for i in range(8)]
    batches = list(generate(loaded, make_spec(tiny_model, engine="fast"), equal, batch_rows=2))
    assert [[r.idx for r in b] for b in batches] == [list(range(8))]


@pytest.mark.parametrize("sync_free", [False, True])
def test_moving_rows_down_keeps_their_cache(loaded, tiny_model, slots, monkeypatch, sync_free):
    """With the queue empty, rows still running are moved into lower free slots (so the step shrinks to a smaller
    bucket); their outputs equal the padded engine's, so the move carried their K/V. Rows are admitted longest
    (prompt + max_new_tokens) first, so long prompts with short outputs take the low slots and finish first. The
    same with the slot state written by index kernels, all of a compaction's moves at once (SYNC_FREE)."""
    slots(4)
    monkeypatch.setattr(fastgen, "SYNC_FREE", sync_free)
    moved = []
    real_move = fastgen.Engine.move

    def spy(self, src, dst):
        moved.append(list(zip(src, dst)))
        real_move(self, src, dst)

    rows = [
        (i, row(p, max_new_tokens=n, ignore_eos=True))
        for i, (p, n) in enumerate([("the sky " * 15, 2), ("water city " * 14, 3), ("hello", 20), ("the", 18)])
    ]
    fastgen.Engine.move = spy
    try:
        fast = run(loaded, make_spec(tiny_model, engine="fast"), rows)
    finally:
        fastgen.Engine.move = real_move
    padded = run(loaded, make_spec(tiny_model, engine="padded"), rows)
    assert fields(fast) == fields(padded)
    assert moved == [[(3, 0), (2, 1)], [(1, 0)]]  # at 2 running rows (bucket 2), then at 1: a call for each


def test_the_host_books_one_step_behind_without_wasting_the_last_step(loaded, tiny_model, slots):
    """The host books step k after launching step k+1. Rows whose prompt + max_new_tokens fill their pages exactly
    (need = 64 = one page) and rows that stop at EOS (which run one extra step, dropped) still equal the padded
    engine; rows that all end by max_new_tokens take exactly max_new_tokens - 1 decode steps (the prefill gives
    the first token): no step is launched past the last one any row needs."""
    slots(4)
    tok = loaded.tokenizer
    prompt = "the sky " * 6
    fill = 64 - len(tok(prompt)["input_ids"])
    rows = [
        (0, row(prompt, max_new_tokens=fill, ignore_eos=True)),
        (1, row("hello", max_new_tokens=fill, ignore_eos=True)),
    ]
    rows += [(2 + i, row(q)) for i, (q, _) in enumerate(qa_pairs()[:4])]  # 6 rows, 4 slots: waits and refills
    info: dict = {}
    fast = run(loaded, make_spec(tiny_model, engine="fast", max_new_tokens=fill), rows, info=info)
    assert len(tok(prompt)["input_ids"]) + fill == decode_attention.PAGE  # row 0 fills its one page exactly
    assert fields(fast) == fields(run(loaded, make_spec(tiny_model, engine="padded", max_new_tokens=fill), rows))
    assert fast[0].completion_tokens == fill and [fast[2 + i].output for i in range(4)] == [
        a for _, a in qa_pairs()[:4]
    ]
    info = {}
    run(
        loaded,
        make_spec(tiny_model, engine="fast", max_new_tokens=9, ignore_eos=True),
        [(0, row("hello")), (1, row("the sky"))],
        info=info,
    )
    assert info["fast"]["steps"] == 8


def test_sampling_is_reproducible_per_seed_and_n_samples_are_lists(loaded, tiny_model, slots):
    """temperature sampling on the GPU path's exponential race: the same seed gives the same outputs, another
    seed others; num_return_sequences 3 gives a list of 3 texts and the summed token count."""
    slots(16)
    rows = [(i, row(p)) for i, p in enumerate(["hello", "the", "What is", "water city sky"])]
    spec = make_spec(tiny_model, engine="fast", temperature=1.5, seed=7, max_new_tokens=12, ignore_eos=True)
    a, b = fields(run(loaded, spec, rows)), fields(run(loaded, spec, rows))
    other = fields(
        run(
            loaded,
            make_spec(tiny_model, engine="fast", temperature=1.5, seed=8, max_new_tokens=12, ignore_eos=True),
            rows,
        )
    )
    assert a == b and a != other
    n = run(
        loaded,
        make_spec(
            tiny_model, engine="fast", temperature=1.0, num_return_sequences=3, max_new_tokens=5, ignore_eos=True
        ),
        rows[:2],
    )
    assert all(isinstance(r.output, list) and len(r.output) == 3 and r.completion_tokens == 15 for r in n.values())


def test_unsupported_sampling_fails_under_fast_and_runs_padded_under_auto(loaded, tiny_model, slots):
    """top_p / top_k / repetition_penalty: a failed row naming the fix under engine fast; under auto (here called
    directly, as on CUDA) those rows run on the padded engine and the rest on the fast one."""
    slots(16)
    q, a = qa_pairs()[0]
    rows = [(0, row(q, repetition_penalty=1.1)), (1, row(q)), (2, row(q, temperature=0.7, top_p=0.9))]
    r = run(loaded, make_spec(tiny_model, engine="fast"), rows)
    assert r[0].output is None and "repetition_penalty is not supported by the fast engine" in r[0].error
    assert "top_p is not supported by the fast engine" in r[2].error
    assert r[1].output == a
    out = run_auto(loaded, tiny_model, rows)
    assert out[0].error is None and out[0].output and out[2].error is None and out[1].output == a
    events: list[str] = []
    run_auto(loaded, tiny_model, rows, events.append, kv_cache_dtype="fp8")
    assert events == ["kv_cache_dtype fp8 not applied to 2 rows the fast engine cannot run"]


def decode_extras(monkeypatch) -> list[tuple[str, ...]]:
    """The extras of every decode step the fast engine runs from now on (in the test)."""
    calls: list[tuple[str, ...]] = []
    real = fastgen.Engine._decode

    def spy(self, batch, sample, extras=(), phase=None):
        calls.append(extras)
        return real(self, batch, sample, extras, phase)

    monkeypatch.setattr(fastgen.Engine, "_decode", spy)
    return calls


def test_top_k_1_sampling_gives_the_greedy_outputs_through_filtered_steps(loaded, tiny_model, slots, monkeypatch):
    """fastgen.FILTERED_SAMPLING on: rows sampling at temperature 1 with top_k 1 give the greedy outputs, in 3 slots
    (rows wait and refill freed slots), and beside a plain sampled row whose slot one of them is moved down into
    (each slot's top_k follows its row); such steps are "filtered", and a greedy job runs none."""
    monkeypatch.setattr(fastgen, "FILTERED_SAMPLING", True)
    slots(3)
    calls = decode_extras(monkeypatch)
    rows = ragged_rows()
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=24)
    greedy = run(loaded, spec, rows)
    assert calls and not any("filtered" in extras for extras in calls)
    top_k_1 = [(i, {**r, "params": {**r["params"], "temperature": 1.0, "top_k": 1}}) for i, r in rows]
    assert fields(run(loaded, spec, top_k_1)) == fields(greedy)
    assert any("filtered" in extras for extras in calls)
    # the plain row (the longest: slot 0) ends first; the row in slot 2 is then moved down into slot 0
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=20, ignore_eos=True, seed=3)
    prompts = [(1, "hello"), (2, "What is")]
    greedy = run(loaded, spec, [(i, row(p)) for i, p in prompts])
    plain = (0, row("the " * 25, temperature=1.0, max_new_tokens=2))
    sampled = run(loaded, spec, [plain] + [(i, row(p, temperature=1.0, top_k=1)) for i, p in prompts])
    assert fields({i: sampled[i] for i in greedy}) == fields(greedy) and sampled[0].completion_tokens == 2


@pytest.mark.parametrize("flag", [True, False])
def test_top_p_and_top_k_rows_run_on_the_fast_engine_only_with_the_flag(loaded, tiny_model, slots, monkeypatch, flag):
    """Under auto, the fast engine keeps the rows that sample with top_p or top_k where FILTERED_SAMPLING is on
    (none returned to the padded engine, the job's record is the fast engine's), and returns them as before where it
    is off; repetition_penalty is returned either way."""
    monkeypatch.setattr(fastgen, "FILTERED_SAMPLING", flag)
    slots(4)
    q = qa_pairs()[0][0]
    rows = [(0, row(q)), (1, row(q, temperature=0.7, top_p=0.9)), (2, row(q, temperature=0.7, top_k=5))]
    rows += [(3, row(q, temperature=0.7, top_p=0.5, top_k=3)), (4, row(q, repetition_penalty=1.1))]
    info: dict = {}
    results = fast.run(
        loaded,
        make_spec(tiny_model, max_new_tokens=6),
        rows,
        batch_rows=1,
        should_stop=lambda: False,
        on_event=print,
        info=info,
        progress=Progress(),
    )
    done: dict = {}
    while True:
        try:
            done.update((r.idx, r) for r in next(results))
        except StopIteration as stop:
            left = [i for i, _ in stop.value]
            break
    assert left == ([4] if flag else [1, 2, 3, 4])
    assert sorted(done) == ([0, 1, 2, 3] if flag else [0])
    assert all(r.error is None and r.output for r in done.values())
    assert info["fast"]["steps"] > 0 and info["fast"]["runs"] == 1


def test_the_submit_check_judges_top_p_and_top_k_as_the_fast_engines_default_does():
    """core/dataset.py cannot import the worker: its `fast_unsupported` takes `filtered` (the worker passes
    fastgen.FILTERED_SAMPLING) and its default, which the submit check uses, is the flag's default."""
    import inspect

    default = inspect.signature(fast_unsupported).parameters["filtered"].default
    assert default is fastgen.FILTERED_SAMPLING
    params = {"do_sample": True, "top_p": 0.9, "top_k": None, "repetition_penalty": None}
    assert fast_unsupported(params, filtered=True) is None and fast_unsupported(params, filtered=False) == "top_p"
    assert fast_unsupported({**params, "repetition_penalty": 1.1}, filtered=True) == "repetition_penalty"


def test_an_fp8_cache_that_engine_auto_does_not_run_is_an_event_of_the_job(loaded, tiny_model):
    """Where engine auto picks another engine than the fast one (padded on CPU), an fp8 cache asked for is not
    applied, and the job's events say so (submit refuses the cases it can foresee: core/capability.py)."""
    events: list[str] = []
    rows = [(0, row(qa_pairs()[0][0]))]
    out = run(loaded, make_spec(tiny_model, kv_cache_dtype="fp8"), rows, on_event=events.append)
    assert out[0].output == qa_pairs()[0][1]
    assert events == [
        "kv_cache_dtype fp8 not applied: the rows run on engine padded with the model's dtype (auto: padded on CPU "
        "(the fast engine's kernels and CUDA graphs need a GPU))"
    ]


def test_cancel_stops_between_steps_and_keeps_unfinished_rows_pending(loaded, tiny_model, slots):
    """should_stop turning true mid-run ends the engine within a few steps; rows not yet yielded stay pending."""
    slots(4)
    calls = {"n": 0}

    def stop() -> bool:
        calls["n"] += 1
        return calls["n"] > 20

    spec = make_spec(tiny_model, engine="fast", max_new_tokens=300, ignore_eos=True)
    batches = list(
        generate(
            loaded, spec, [(i, row(p)) for i, p in enumerate(["hello", "the"] * 3)], batch_rows=1, should_stop=stop
        )
    )
    assert batches == [] and calls["n"] < 40


def test_out_of_memory_halves_the_slots_and_reports_it(loaded, tiny_model, monkeypatch, slots):
    """An out-of-memory with more than 2 rows in a prefill (injected) reruns the unfinished rows with half the
    slots, down to 2; every row still gets its answer and each retry is an event."""
    slots(8)
    monkeypatch.setenv("JOBS_TEST_FAULTS", "oom_over_2@generate")
    faults._faults.cache_clear()
    try:
        events: list[str] = []
        r = run(
            loaded,
            make_spec(tiny_model, engine="fast"),
            [(i, row(q)) for i, (q, _) in enumerate(qa_pairs()[:6])],
            on_event=events.append,
        )
    finally:
        monkeypatch.delenv("JOBS_TEST_FAULTS")
        faults._faults.cache_clear()
    assert [r[i].output for i in range(6)] == [a for _, a in qa_pairs()[:6]]
    assert events == [
        "out of memory in the fast engine with 6 slots: retrying the 6 unfinished sequences with at most 3",
        "out of memory in the fast engine with 3 slots: retrying the 6 unfinished sequences with at most 1",
    ]


def test_auto_is_padded_on_cpu_and_fast_refuses_what_it_cannot_run(loaded, tiny_model):
    """auto: padded on CPU, with the reason; engine fast refuses flex_attention at submit (capabilities) and in
    the worker, and a model split over several GPUs, naming what to use instead."""
    assert engine.choose_engine(make_spec(tiny_model), loaded) == (
        "padded",
        "auto: padded on CPU (the fast engine's kernels and CUDA graphs need a GPU)",
    )
    caps = {"versions": {"torch": torch.__version__}, "attention": ["sdpa", "eager", "flex_attention"]}
    problems = missing(make_spec(tiny_model, engine="fast", attn_implementation="flex_attention"), caps, 1)
    assert any("engine fast cannot honour flex_attention" in p for p in problems)
    flex = load(make_spec(tiny_model, attn_implementation="eager"), gpus=0)
    flex.model.config._attn_implementation = "flex_attention"
    with pytest.raises(InvalidInput, match="engine fast replaces the attention"):
        engine.choose_engine(make_spec(tiny_model, engine="fast"), flex)
    split = load(make_spec(tiny_model), gpus=0)
    split.model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}  # as device_map auto over 2 GPUs
    with pytest.raises(InvalidInput, match="engine fast runs a model on one device"):
        engine.choose_engine(make_spec(tiny_model, engine="fast"), split)


def test_size_gives_slots_and_pages_and_buckets_cover_every_batch(loaded, monkeypatch):
    """CPU: CPU_SLOTS slots and enough pages for each to hold the longest sequence (the model's context, whole
    pages), or CPU_PAGES; buckets cover every batch size up to the slots."""
    assert slot_state.max_len(loaded.model) == 512 and decode_attention.PAGE == 64
    assert slot_state.size(loaded.model, loaded.device, 640) == (slot_state.CPU_SLOTS, slot_state.CPU_SLOTS * 8 + 1)
    monkeypatch.setattr(slot_state, "CPU_PAGES", 5)
    assert slot_state.size(loaded.model, loaded.device, 640) == (slot_state.CPU_SLOTS, 5)
    sizes = fastgen.buckets(1024)
    assert sizes[:8] == [1, 2, 4, 8, 16, 32, 64, 128] and sizes[-1] == 1024 and 896 in sizes
    assert [fastgen.bucket(sizes, n) for n in (1, 3, 129, 1000)] == [1, 4, 256, 1024]
    assert fastgen.buckets(5) == [1, 2, 4, 5]


def paged(cache: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A contiguous cache (B, KVH, L, D), L a multiple of PAGE, as shuffled pages (with a trash page 0 of noise)
    and its page table."""
    b, kvh, length, dim = cache.shape
    w = length // decode_attention.PAGE
    order = torch.randperm(b * w, generator=torch.Generator().manual_seed(seed)) + 1
    pages = torch.randn(b * w + 1, kvh, decode_attention.PAGE, dim, dtype=cache.dtype)
    blocks = cache.view(b, kvh, w, decode_attention.PAGE, dim).permute(0, 2, 1, 3, 4).reshape(b * w, kvh, -1, dim)
    pages[order] = blocks
    return pages, order.view(b, w)


def test_reference_decode_matches_full_attention_per_row():
    """The SDPA reference of the decode attention, reading shuffled pages through the page table, equals attention
    over each row's own prefix, with grouped heads, and gives zeros for a free slot (length 0)."""
    torch.manual_seed(0)
    q, cache = torch.randn(4, 4, 8), torch.randn(2, 4, 2, 128, 8)
    lengths = torch.tensor([0, 1, 70, 128])
    (k_pages, table), (v_pages, _) = paged(cache[0]), paged(cache[1])
    out = decode_attention.reference_decode(q, k_pages, v_pages, table, lengths, 0.5)
    assert torch.all(out[0] == 0)
    for b in range(1, 4):
        n = int(lengths[b])
        k, v = cache[0, b, :, :n].repeat_interleave(2, 0), cache[1, b, :, :n].repeat_interleave(2, 0)
        want = torch.softmax(q[b, :, None] @ k.transpose(1, 2) * 0.5, -1) @ v
        assert torch.allclose(out[b], want[:, 0], atol=1e-5)


def gen_smoke(workload: str, tmp_path: Path, model: Path, *args: str) -> dict:
    """`ops/bench/gen.py WORKLOAD --smoke` (CPU) on `model`, its work under `tmp_path`: it must end well; returns its
    report."""
    out = tmp_path / f"{workload}.json"
    proc = subprocess.run(
        [sys.executable, "ops/bench/gen.py", workload, "--smoke", "--out", str(out), "--work", str(tmp_path / "work")]
        + ["--model", str(model), "--qa-model", str(model), *args],
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())[workload]


def interpreted(script: str, ok: str, model: Path | None = None, timeout: int = 300) -> None:
    """Run `script` (with the repository root and `model` as its arguments) in a process under Triton's CPU
    interpreter (chosen when triton is imported); it must end well and print `ok`."""
    pytest.importorskip("triton")
    out = subprocess.run(
        [sys.executable, "-c", script, str(ROOT), *([str(model)] if model else [])],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="1", HF_HUB_OFFLINE="1"),
        timeout=timeout,
    )
    assert out.returncode == 0 and ok in out.stdout, out.stderr[-3000:]


TRITON_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from worker.engines import decode_attention as da
from tests.test_engine_fast import paged
assert da.available(torch.device("cpu"))
torch.manual_seed(0)
# head widths of a power of two and not (80 or 96 in some models, here 24: padded lanes in the kernels)
for dtype, dim in ((torch.float32, 32), (torch.float16, 32), (torch.float32, 24)):
    # (the interpreter misreads bf16; bf16 is checked on the GPU)
    q, cache = torch.randn(5, 4, dim, dtype=dtype), torch.randn(2, 5, 2, 192, dim, dtype=dtype)
    (k, table), (v, _) = paged(cache[0], 1), paged(cache[1], 1)
    lengths = torch.tensor([0, 1, 64, 65, 192], dtype=torch.int32)
    ref = da.masked_decode(q.float(), cache[0].float(), cache[1].float(), lengths, 0.3)
    for splits in (1, 2, 3):
        got = da._triton_decode(q, k, v, table, lengths, 0.3, splits).float()
        tol = 1e-5 if dtype == torch.float32 else 5e-3
        diff = (got - ref).abs().max().item()
        assert diff < tol, (dtype, dim, splits, diff)
        assert torch.all(got[0] == 0)
    # the step's K/V written by the kernel (FOLD_WRITE): the pages of write_step, then the kernel, and its output
    # within rounding (the new position is summed last); row 0, of length 0 (a free slot), writes nothing
    da.FOLD_WRITE = True
    last = (lengths - 1).clamp(min=0)
    page, offset = table[torch.arange(5), last // da.PAGE], last % da.PAGE
    kn, vn = torch.randn(5, 2, dim, dtype=dtype), torch.randn(5, 2, dim, dtype=dtype)
    for splits in (1, 2, 3):
        k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
        da.write_step(k1, None, page[1:], offset[1:], kn[1:])
        da.write_step(v1, None, page[1:], offset[1:], vn[1:])
        want = da._triton_decode(q, k1, v1, table, lengths, 0.3, splits)
        got = da.decode(q, k2, v2, table, lengths, 0.3, splits, new=(kn, vn, page, offset))
        diff = (got.float() - want.float()).abs().max().item()
        assert diff < tol and torch.equal(k1, k2) and torch.equal(v1, v2), (dtype, dim, splits, diff)
        assert not torch.equal(k1, k), (dtype, dim, splits)  # the new vectors are in the pages
    da.FOLD_WRITE = False
    # a prefill chunk's write in one kernel (PREFILL_WRITE): the pages of write_pages' index_put. Three rows of 150
    # positions (the last block partial) into shuffled pages; row 2 holds two pages, so its positions past 128 go to
    # the trash page 0, which rows may share and nothing reads
    da.PREFILL_WRITE = True
    xs = torch.randn(3, 2, 150, dim, dtype=dtype).transpose(1, 2)  # (rows, positions, kv heads, dim), as the layers
    rows_pages = torch.tensor([[5, 2, 7], [1, 8, 3], [6, 4, 0]])
    at = (rows_pages[:, torch.arange(150) // da.PAGE], torch.arange(150) % da.PAGE)
    want, got = torch.zeros(9, 2, da.PAGE, dim, dtype=dtype), torch.zeros(9, 2, da.PAGE, dim, dtype=dtype)
    assert da.write_prefill(got, None, *at, xs) is xs
    da.write_pages(want, None, (at[0], slice(None), at[1]), xs)
    assert torch.equal(got[1:], want[1:]) and not torch.equal(got[1:], torch.zeros_like(got[1:])), (dtype, dim)
    da.PREFILL_WRITE = False
    # quantized pages with a scale per position and head: the kernel equals the reference over the same pages
    for kind in (da.FP8, torch.int8):
        (k8, ks), (v8, vs) = da.quantize(k, kind), da.quantize(v, kind)
        ref = da.reference_decode(q.float(), k8, v8, table, lengths, 0.3, ks, vs)
        exact = da.masked_decode(q.float(), cache[0].float(), cache[1].float(), lengths, 0.3)
        assert (ref - exact).abs().max() < 0.2, kind
        for splits in (1, 3):
            got = da._triton_decode(q, k8, v8, table, lengths, 0.3, splits, None, ks, vs).float()
            diff = (got - ref).abs().max().item()
            assert diff < tol, (kind, dtype, dim, splits, diff)
    # a decode step's fp8 write in one kernel: the bytes and scales of write_pages' torch operations. The vectors
    # are fp8 values (one of them ±448) times powers of two, so that no value needs rounding: the interpreter's
    # float-to-fp8 conversion does not carry a rounded mantissa into the exponent (126.8 gives 64, not 128); the
    # GPU's does, and decode_kernel.py compares the bytes there
    pages8, scales = torch.zeros(9, 2, da.PAGE, dim, dtype=da.FP8), torch.zeros(9, 2, da.PAGE)
    want8, want_scales = pages8.clone(), scales.clone()
    grid = torch.randint(0, 256, (3, 2, dim), dtype=torch.uint8).view(da.FP8).float().nan_to_num(0).clamp(-448, 448)
    grid[:, :, 7] = 448.0 * torch.tensor([1.0, -1.0])
    x = grid * torch.tensor([2.0**-10, 1.0, 2.0**6])[:, None, None]  # fp16 holds them all
    x[1, 1] = 0
    page, offset = torch.tensor([4, 1, 7]), torch.tensor([0, da.PAGE - 1, 5])
    da.write_step(pages8, scales, page, offset, x.to(dtype))
    da.write_pages(want8, want_scales, (page, slice(None), offset), x.to(dtype))
    assert torch.equal(pages8.view(torch.uint8), want8.view(torch.uint8)), (dtype, dim)
    assert torch.equal(scales, want_scales) and scales[4, :, 0].min() > 0, (dtype, dim)
    # int8: any values (the rounding, half away from zero, is the kernel's own arithmetic)
    pages8, scales = torch.zeros(9, 2, da.PAGE, dim, dtype=torch.int8), torch.zeros(9, 2, da.PAGE)
    want8, want_scales = pages8.clone(), scales.clone()
    x = torch.randn(3, 2, dim) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None]
    x[1, 1] = 0
    x[2, 0, :4] = torch.tensor([0.5, -0.5, 1.5, -2.5]) * x[2, 0].abs().max() / 127  # ties
    da.write_step(pages8, scales, page, offset, x.to(dtype))
    da.write_pages(want8, want_scales, (page, slice(None), offset), x.to(dtype))
    assert torch.equal(pages8, want8) and torch.equal(scales, want_scales), (dtype, dim)
    # a prefill chunk's quantized write in one kernel (QUANT_PREFILL_WRITE): the bytes and scales of write_pages over
    # the pages rows own (row 2's positions past 128 go to the trash page 0, as above), and its returned values. fp8:
    # values that need no rounding (see the step's write above); int8: any values, ties among them
    assert da.QUANT_PREFILL_WRITE  # the default
    grid = torch.randint(0, 256, (3, 150, 2, dim), dtype=torch.uint8).view(da.FP8).float().nan_to_num(0)
    grid = grid.clamp(-448, 448)
    grid[..., 3] = 448.0
    ints = torch.randn(3, 150, 2, dim) * torch.tensor([1e-3, 1.0, 1e3])[:, None, None, None]
    ints[2, 5, 0, :4] = torch.tensor([0.5, -0.5, 1.5, -2.5]) * ints[2, 5, 0].abs().max() / 127
    for kind, x in ((da.FP8, grid * 2.0 ** torch.randint(-8, 4, (3, 150, 2, 1))), (torch.int8, ints)):
        x[1, 7] = 0
        xs = x.to(dtype).transpose(1, 2).contiguous().transpose(1, 2)  # (rows, positions, kv heads, dim) as the layers
        got8, got_scales = torch.zeros(9, 2, da.PAGE, dim, dtype=kind), torch.zeros(9, 2, da.PAGE)
        want8, want_scales = got8.clone(), got_scales.clone()
        held = da.write_prefill(got8, got_scales, *at, xs)
        want_held = da.write_pages(want8, want_scales, (at[0], slice(None), at[1]), xs)
        assert torch.equal(got8[1:].view(torch.uint8), want8[1:].view(torch.uint8)), (kind, dtype, dim)
        assert torch.equal(got_scales[1:], want_scales[1:]) and got_scales[5].min() > 0, (kind, dtype, dim)  # row 0's
        assert torch.equal(held, want_held) and held.shape == xs.shape, (kind, dtype, dim)
        assert held.transpose(1, 2).is_contiguous(), (kind, dtype, dim)  # as the layers' (rows, heads, length, dim)
        da.QUANT_PREFILL_WRITE = False  # write_pages itself: the same
        again8, again_scales = torch.zeros_like(got8), torch.zeros_like(got_scales)
        assert torch.equal(da.write_prefill(again8, again_scales, *at, xs), want_held)
        da.QUANT_PREFILL_WRITE = True
print("kernel ok")
"""


def test_triton_kernel_matches_the_reference_in_the_interpreter():
    """The Triton decode kernel (Triton's CPU interpreter) over shuffled pages equals SDPA over the contiguous cache
    for fp32 and fp16, one and several context splits, lengths 0, 1, a page edge and the full cache, heads of a
    power-of-two width and not (padded inside the kernels); writing the step's K/V itself (FOLD_WRITE) it leaves
    the pages of the write, then the kernel, and its output within rounding; over fp8 and int8 pages with their scales it equals the reference over
    the same pages, and the decode step's and a prefill chunk's write kernels leave the bytes and scales of the torch
    write. (bf16 is misread by the interpreter; on the H200 the bf16 kernel is checked by ops/bench/decode_kernel.py
    and gen.py's logits check.)"""
    interpreted(TRITON_SCRIPT, "kernel ok")


CASCADE_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from worker.engines import decode_attention as da
from tests.test_engine_fast import paged
P = da.PAGE
torch.manual_seed(0)
for dtype, dim in ((torch.float32, 32), (torch.float16, 32), (torch.float32, 24)):  # 24: padded head lanes
    b, w = 7, 4
    q, cache = torch.randn(b, 8, dim, dtype=dtype), torch.randn(2, b, 2, w * P, dim, dtype=dtype)
    (k, table), (v, _) = paged(cache[0], 2), paged(cache[1], 2)
    # rows 2 and 3 start with row 1's two pages, row 4 with its first; row 6 holds it but is shorter than it
    for r, n in ((2, 2), (3, 2), (4, 1), (6, 1)):
        cache[:, r, :, : n * P] = cache[:, 1, :, : n * P]
        table[r, :n] = table[1, :n]
    lengths = torch.tensor([0, 3 * P + 5, 2 * P + 1, 4 * P, 2 * P + 9, P + 3, 30], dtype=torch.int32)
    for kind in (None, da.FP8, torch.int8):  # bf16/fp16/fp32 pages, then quantized pages with their scales
        if kind is not None:
            (k8, ks), (v8, vs) = da.quantize(k, kind), da.quantize(v, kind)
        quant = kind and (ks, vs)
        if quant:
            ref = da.reference_decode(q.float(), k8, v8, table, lengths, 0.3, *quant)
        else:
            ref = da.masked_decode(q.float(), cache[0].float(), cache[1].float(), lengths, 0.3)
        for n, starts in ((1, [0, 1, 1, 1, 1, 0, 1]), (2, [0, 2, 2, 2, 1, 0, 1])):
            shared = torch.full((w,), -1, dtype=torch.long)
            shared[:n] = table[1, :n]
            start = da.cascade_start(table, shared)
            assert start.tolist() == starts, (n, start.tolist())
            # quantized pages at 3 splits only: the pages' loads and scales are the same code at any split count
            for splits in (1, 3) if kind is None else (3,):
                cascade = (shared, torch.tensor([n], dtype=torch.int32), start)
                pages = (k8, v8) if quant else (k, v)
                got = da._triton_decode(q, *pages, table, lengths, 0.3, splits, cascade, *(quant or ()))
                diff = (got.float() - ref).abs().max().item()
                assert diff < (1e-5 if dtype == torch.float32 else 5e-3), (dtype, dim, quant is None, n, splits, diff)
                assert torch.all(got[0] == 0)
                if kind is None and dtype == torch.float32 and (n, splits) == (2, 3):  # K/V written by the kernel
                    da.FOLD_WRITE = True
                    last = (lengths - 1).clamp(min=0)
                    page, offset = table[torch.arange(b), last // P], last % P
                    kn, vn = torch.randn(b, 2, dim, dtype=dtype), torch.randn(b, 2, dim, dtype=dtype)
                    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
                    da.write_step(k1, None, page[1:], offset[1:], kn[1:])
                    da.write_step(v1, None, page[1:], offset[1:], vn[1:])
                    want = da._triton_decode(q, k1, v1, table, lengths, 0.3, splits, cascade)
                    got = da.decode(q, k2, v2, table, lengths, 0.3, splits, cascade, new=(kn, vn, page, offset))
                    diff = (got - want).abs().max().item()
                    assert diff < 1e-5 and torch.equal(k1, k2) and torch.equal(v1, v2), (n, splits, diff)
                    da.FOLD_WRITE = False
print("cascade ok")
"""


def test_cascade_kernels_match_the_reference_in_the_interpreter():
    """The cascade (decode_attention's docstring) in Triton's CPU interpreter: shared pages read once by the prefix
    kernel for the rows whose tables start with them, the rest by the row kernel, merged, equal SDPA over each row's
    contiguous cache (fp8 and int8 pages: the reference over the same pages). Rows share two pages, one, or none; a
    free row gives zeros; a row that holds a shared page but is shorter than it attends only to its own length."""
    interpreted(CASCADE_SCRIPT, "cascade ok")


PAGES_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from worker.engines import decode_attention as da
from tests.test_engine_fast import paged
P = da.PAGE
torch.manual_seed(0)
b, w = 11, 5  # five pages a row: 2 and 4 pages a step leave a last step short of the table's end
q, cache = torch.randn(b, 4, 32), torch.randn(2, b, 2, w * P, 32)
(k, table), (v, _) = paged(cache[0], 3), paged(cache[1], 3)
for r in (2, 3):  # rows 2 and 3 start with row 1's first two pages (the cascade's shared pages)
    cache[:, r, :, : 2 * P] = cache[:, 1, :, : 2 * P]
    table[r, :2] = table[1, :2]
# page edges, and steps filled exactly (2P, 4P) or but one position (4P + 1: the folded write reads one less)
lengths = torch.tensor([0, 1, 2 * P + 7, w * P, P, P + 1, 4 * P + 3, 3 * P, 2 * P, 4 * P, 4 * P + 1], dtype=torch.int32)
# the kernels get the table with columns past its end holding an id no page has: a read of one fails
padded = torch.cat([table, torch.full((b, 4), 10**12, dtype=table.dtype)], dim=1)
exact = da.masked_decode(q, cache[0], cache[1], lengths, 0.3)
cascades = []  # rows 1-3 share two pages, then one (an odd first page: a step of 2 or 4 starts inside it)
for n, starts in ((2, [0, 2, 2, 2] + [0] * 7), (1, [0, 1, 1, 1] + [0] * 7)):
    shared = torch.full((w + 4,), -1, dtype=torch.long)
    shared[:n] = table[1, :n]
    cascades.append((shared, torch.tensor([n], dtype=torch.int32), da.cascade_start(padded, shared)))
    assert cascades[-1][2].tolist() == starts, (n, cascades[-1][2])
quantized = {kind: (*da.quantize(k, kind), *da.quantize(v, kind)) for kind in (da.FP8, torch.int8)}
for pages in (2, 4):
    da.CONFIG["pages"] = da.QUANTIZED_CONFIG["pages"] = pages
    # one part a row (several pages a step), then 3 parts (a split row takes one page a step)
    for splits, c in ((1, None), (1, cascades[0]), (1, cascades[1]), (3, None), (3, cascades[1])):
        diff = (da._triton_decode(q, k, v, padded, lengths, 0.3, splits, c) - exact).abs().max().item()
        assert diff < 1e-5, (pages, splits, c is None, diff)
    for kind, (k8, ks, v8, vs) in quantized.items():
        ref = da.reference_decode(q, k8, v8, table, lengths, 0.3, ks, vs)
        for splits, c in ((1, None), (1, cascades[1]), (3, None)):
            got = da._triton_decode(q, k8, v8, padded, lengths, 0.3, splits, c, ks, vs)
            assert (got - ref).abs().max().item() < 1e-5, (pages, kind, splits, c is None)
    # the step's K/V written by the kernel (FOLD_WRITE): the pages of write_step, and SDPA over them
    da.FOLD_WRITE = True
    last = (lengths - 1).clamp(min=0)
    page, offset = table[torch.arange(b), last // P], last % P
    kn, vn = torch.randn(b, 2, 32), torch.randn(b, 2, 32)
    k1, v1, k2, v2 = k.clone(), v.clone(), k.clone(), v.clone()
    da.write_step(k1, None, page[1:], offset[1:], kn[1:])
    da.write_step(v1, None, page[1:], offset[1:], vn[1:])
    want = da.reference_decode(q, k1, v1, table, lengths, 0.3)
    for c in (None, cascades[1]):
        k2, v2 = k.clone(), v.clone()
        got = da.decode(q, k2, v2, padded, lengths, 0.3, 1, c, new=(kn, vn, page, offset))
        assert (got - want).abs().max().item() < 1e-5 and torch.equal(k1, k2) and torch.equal(v1, v2), pages
    da.FOLD_WRITE = False
print("pages ok")
"""


def test_row_kernel_takes_several_pages_a_step_in_the_interpreter():
    """CONFIG["pages"] (and QUANTIZED_CONFIG's) of 2 and 4: the row kernel's inner step finds each of its pages in
    the table, so it equals SDPA over the contiguous cache, under the cascade (its rows starting past the shared
    pages, at an odd page too), over fp8 and int8 pages (the reference over the same pages) and writing the step's
    K/V itself; a last step reaching past the row's pages reads nothing there (the table's columns past its end hold
    an id no page has); split rows (one page a step) are unchanged."""
    interpreted(PAGES_SCRIPT, "pages ok")


ENGINE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from core.spec import GenerateSpec
from worker import generate as engine
from worker.engines import decode_attention as da, slot_state
from worker.loader import load
spec = lambda **f: GenerateSpec.model_validate({"model": sys.argv[2], "input": "file_x", **f})
loaded = load(spec(), gpus=0)
slot_state.CPU_SLOTS = 3
# two parts a row (the split and merge path, as on a GPU at small batches) instead of the GPU's 32: the interpreter
# runs each program in Python
da.TARGET_PROGRAMS = 3 * loaded.model.config.num_key_value_heads * 2
rows = [(i, {"prompt": p, "params": {"max_new_tokens": n}, "extra": {}}) for i, (p, n) in
        enumerate([("What is the capital of France?", 8), ("hello", 3), ("the sky", 6), ("water", 5)])]
def run(s, info=None):
    return {r.idx: (r.output, r.completion_tokens) for b in engine.generate(loaded, s, rows, batch_rows=2,
            info=info) for r in b}
info = {}
assert da.PREFILL_WRITE and not da.FOLD_WRITE  # the defaults: each prefill chunk's K/V by the prefill write kernel
fast, padded = run(spec(engine="fast"), info), run(spec(engine="padded"))
assert info["attn_implementation"] == "gpujobs_fast (decode: triton)", info
assert fast == padded, (fast, padded)
da.FOLD_WRITE, da.PREFILL_WRITE = True, False  # each step's K/V by the decode kernel itself, each chunk's by index_put
assert run(spec(engine="fast")) == padded
da.FOLD_WRITE, da.PREFILL_WRITE = False, True
info = {}  # an fp8 cache: the write kernel and the kernel's fp8 pages; the memorized answer stays exact
fp8 = run(spec(engine="fast", kv_cache_dtype="fp8"), info)
assert info["fast"]["kv_cache_dtype"] == "fp8" and fp8[0] == padded[0], (fp8, padded)
assert da.QUANT_PREFILL_WRITE  # an int8 cache's prefill chunks by the kernel (the default), or by write_pages
int8 = run(spec(engine="fast", kv_cache_dtype="int8"))
da.QUANT_PREFILL_WRITE = False
assert run(spec(engine="fast", kv_cache_dtype="int8")) == int8 and int8[0] == padded[0], (int8, padded)
da.QUANT_PREFILL_WRITE = True
print("engine ok")
"""


CASCADE_ENGINE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from core import logprob_store
from core.spec import GenerateSpec
from tests.test_engine_fast import prefixed_rows
from worker import generate as engine
from worker.engines import decode_attention as da, fastgen, slot_state
from worker.loader import load
spec = lambda **f: GenerateSpec.model_validate({"model": sys.argv[2], "input": "file_x", "engine": "fast", **f})
loaded = load(spec(), gpus=0)
slot_state.CPU_SLOTS = 4
fastgen.CASCADE_MIN_READS = 4
da.TARGET_PROGRAMS = 1  # one part per row and one for the prefix: the interpreter runs each program in Python
rows = prefixed_rows(6)
def run(cascade):
    fastgen.CASCADE = cascade
    slot_state.release(loaded.model)
    info = {}
    got = {r.idx: r for b in engine.generate(loaded, spec(logprobs=True), rows, batch_rows=2, info=info) for r in b}
    return got, info["fast"]["cascade_steps"]
(on, steps_on), (off, steps_off) = run(True), run(False)
assert steps_on > 0 and steps_off == 0, (steps_on, steps_off)
assert {i: r.output for i, r in on.items()} == {i: r.output for i, r in off.items()}
for i in on:  # each step's log-probabilities: the decode attention's output, not only its argmax
    a, b = ([e["logprob"] for e in logprob_store.render(r[i].logprobs)] for r in (on, off))
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (i, a, b)
print("cascade engine ok", steps_on)
"""


def test_the_engine_with_the_cascade_on_the_triton_kernels_equals_it_without(tiny_model):
    """The whole fast engine on the Triton kernels (interpreter), rows sharing an instruction of several cached
    pages: decode steps with the cascade (its thresholds lowered to the test's size) give the greedy outputs and
    the per-token log-probabilities of the same engine without it."""
    interpreted(CASCADE_ENGINE_SCRIPT, "cascade engine ok", tiny_model, timeout=600)


def test_the_engine_on_the_triton_kernel_equals_the_padded_engine(tiny_model):
    """The whole fast engine with the Triton kernel (interpreter) instead of the reference: same greedy results
    as the padded engine, with admission into 3 slots (each prefill chunk's K/V by the prefill write kernel, the
    default), also with the step's K/V written by the decode kernel (FOLD_WRITE) and each chunk's by index_put;
    with an fp8 cache, the memorized answer; with an int8 cache, the same results whether each chunk's quantized
    K/V is written by the prefill write kernel (QUANT_PREFILL_WRITE, the default) or by torch's operations."""
    interpreted(ENGINE_SCRIPT, "engine ok", tiny_model, timeout=600)


def test_compiled_layers_give_the_same_results(loaded, tiny_model, slots, monkeypatch):
    """The compiled decoder layers (dynamo tracing for real, backend eager on CPU) give the same greedy results as
    the eager engine, and are removed from the model afterwards. The warm-up compiles every variant a job needs:
    a job with a one-row prefill and decode steps at batch 1 compiles nothing more. Size-oblivious compiling
    (`fastgen._size_oblivious`) makes the warm-up compile fewer graphs than with sizes of 1 specialized apart."""
    from torch._dynamo.utils import counters

    slots(4)
    monkeypatch.setattr(fastgen, "COMPILE_BACKEND", "eager")
    rows = [(i, row(q)) for i, (q, _) in enumerate(qa_pairs()[:4])] + [(9, row("hello", max_new_tokens=6))]
    prepared = list(common.prepare(loaded, make_spec(tiny_model, engine="fast"), rows, 0.0))
    seqs = [fastgen.Seq(p, 0) for p in prepared]

    def warmed_engine() -> tuple[fastgen.Engine, int]:
        """A fresh state and compiled engine, warmed up; the graphs its warm-up compiled."""
        slot_state.release(loaded.model)
        torch._dynamo.reset()
        state = slot_state.state_for(loaded.model, loaded.device, 640)
        eng = fastgen.Engine(loaded, state, common.eos_ids(loaded), slots=4, graphs=False, compiled=True)
        before = counters["stats"]["unique_graphs"]
        with torch.inference_mode():
            eng.warm_up()
        return eng, counters["stats"]["unique_graphs"] - before

    try:
        with monkeypatch.context() as patched:
            patched.setattr(fastgen, "_size_oblivious", contextlib.nullcontext)
            _, specialized = warmed_engine()
        eng, oblivious = warmed_engine()
        assert 0 < oblivious < specialized, (oblivious, specialized)
        compiled = counters["stats"]["unique_graphs"]
        with torch.inference_mode():
            done = {
                s.row.idx: loaded.tokenizer.decode(s.tokens, skip_special_tokens=True)
                for finished in eng.run(seqs, lambda: False)
                for s in finished
            }
        assert counters["stats"]["unique_graphs"] == compiled, "the job compiled a variant the warm-up did not"
    finally:
        slot_state.release(loaded.model)
        torch._dynamo.reset()
    want = run(loaded, make_spec(tiny_model, engine="padded"), rows)
    assert done == {i: r.output for i, r in want.items()}
    assert eng.state.first_prefill_s is not None
    assert all(layer._compiled_call_impl is None for layer in eng.decoder.layers)


def test_the_layers_get_position_ids_of_one_layout_and_the_warm_up_fails_no_guard_on_them(
    loaded, tiny_model, slots, monkeypatch
):
    """Dynamo guards on whether a layer's input is a view and on its strides: a prefill's expanded positions, a
    one-row prefill's slice and a decode step's slice once made the compiled layers compile up to three times each
    (the Qwen3-0.6B shape: 17 frames for 8 graphs, 7 for 4 now; ops/bench/results/2026-12-05-cpu-restart). Every
    prefill (one row and several) and decode step hands the layers position_ids as a contiguous tensor of its own,
    and the compiled warm-up fails no guard on them."""
    from torch._dynamo.utils import guard_failures

    slots(4)
    seen = []

    def layout(module, args, kwargs):
        ids = kwargs["position_ids"]
        seen.append((tuple(ids.shape), ids._base is None and ids.is_contiguous()))

    hook = loaded.model.model.layers[0].register_forward_pre_hook(layout, with_kwargs=True)
    try:
        spec = make_spec(tiny_model, engine="fast", max_new_tokens=5, ignore_eos=True)
        run(loaded, spec, [(0, row("hello"))])
        run(loaded, spec, [(i, row(p)) for i, p in enumerate(["the sky", "What is", "water city sky", "a"])])
    finally:
        hook.remove()
    shapes = {shape for shape, _ in seen}
    assert any(rows == 1 and width > 1 for rows, width in shapes)  # a one-row prefill
    assert any(rows > 1 and width > 1 for rows, width in shapes)  # a prefill of several rows
    assert any(width == 1 for _, width in shapes)  # decode steps
    assert all(plain for _, plain in seen), seen

    monkeypatch.setattr(fastgen, "COMPILE_BACKEND", "eager")
    slot_state.release(loaded.model)
    torch._dynamo.reset()
    guard_failures.clear()
    try:
        state = slot_state.state_for(loaded.model, loaded.device, 640)
        eng = fastgen.Engine(loaded, state, common.eos_ids(loaded), slots=4, graphs=False, compiled=True)
        with torch.inference_mode():
            eng.warm_up()
        failed = [str(reason) for reasons in guard_failures.values() for reason in reasons]
    finally:
        slot_state.release(loaded.model)
        torch._dynamo.reset()
    assert not [reason for reason in failed if "position_ids" in reason], failed


@pytest.mark.parametrize("temperature", [None, 0.8], ids=["greedy-job", "sampling-job"])
def test_the_worker_captures_the_graphs_of_the_loading_jobs_mode_and_the_others_on_first_use(
    loaded, tiny_model, slots, monkeypatch, temperature
):
    """`prepare_engine` captures the decode graph of every bucket in the mode of the job that loads the model,
    greedy or sampling, not both: a restarted worker's first row waits for half the captures. A later job in the
    other mode captures a bucket's graph when a step first needs it, and runs. CUDA graphs are the edge here:
    `_capture` records what it would capture and its graph replays the step eagerly."""
    slots(4)
    captured = []

    def capture(self, batch, sample, extras=(), phase=None):
        key = (batch, sample, *extras) if phase is None else (phase, batch, sample, *extras)
        captured.append(key)
        self.state.graphs[key] = graph = SimpleNamespace(replay=lambda: self._decode(batch, sample, extras, phase))
        return graph

    monkeypatch.setattr(fastgen.Engine, "_capture", capture)
    monkeypatch.setattr(fast, "_fast_graphs", lambda loaded: True)
    monkeypatch.setattr(fastgen, "COMPILE", False)
    sampling = temperature is not None
    engine.prepare_engine(loaded, make_spec(tiny_model, engine="fast", temperature=temperature))
    sizes = fastgen.buckets(4)
    assert captured == [(batch, sampling) for batch in sizes]
    other = {"temperature": None} if sampling else {"temperature": 0.8, "seed": 1}
    rows = [(i, row(p, max_new_tokens=4, ignore_eos=True)) for i, p in enumerate(["hello", "the sky", "a"])]
    results = run(loaded, make_spec(tiny_model, engine="fast", **other), rows)
    assert all(r.error is None and r.completion_tokens == 4 for r in results.values())
    later = captured[len(sizes) :]
    assert later and all(key[1] is not sampling for key in later)  # the other mode's, on first use


def test_the_prepared_record_says_what_making_the_cache_took(loaded, slots):
    """`slot_state.summary` (the load event's and the job's `prepared` record) splits preparing into sizing and
    allocating the cache (`alloc_s`), compiling and capturing."""
    slots(4)
    state = slot_state.state_for(loaded.model, loaded.device, 640)
    summary = slot_state.summary(state)
    assert state.alloc_s > 0 and summary["alloc_s"] == round(state.alloc_s, 3)
    assert {"compile_s", "capture_s", "prepare_s", "cache_gib"} <= summary.keys()


def test_a_torch_without_size_oblivious_compiling_compiles_as_before(monkeypatch):
    """`_size_oblivious` patches torch's option where it exists, and is a no-op where it does not (entering a patch
    of an unknown option would raise, inside every compiled call of the engine)."""
    import types

    import torch.fx.experimental

    with fastgen._size_oblivious():
        assert torch.fx.experimental._config.backed_size_oblivious is True
    assert torch.fx.experimental._config.backed_size_oblivious is False
    monkeypatch.setattr(torch.fx.experimental, "_config", types.SimpleNamespace())
    with fastgen._size_oblivious() as entered:
        assert entered is None


def test_a_model_that_fails_to_compile_size_oblivious_is_compiled_as_before(loaded, slots, monkeypatch, caplog):
    """Should the warm-up fail to compile size-oblivious (a model or torch whose tracing cannot), `prepare` logs why
    and compiles the layers again the default way: the engine is prepared, not broken."""
    slots(4)
    monkeypatch.setattr(fastgen, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(fastgen, "SIZE_OBLIVIOUS", True)

    @contextlib.contextmanager
    def failing():
        raise RuntimeError("Could not guard on data-dependent expression (a stand-in)")
        yield

    monkeypatch.setattr(fastgen, "_size_oblivious", failing)
    try:
        with caplog.at_level("WARNING", logger="worker.engines.fastgen"):
            state = fastgen.prepare(loaded, common.eos_ids(loaded), graphs=False, compiled=True)
        assert state.prepare_s is not None and fastgen.SIZE_OBLIVIOUS is False
        assert "size-oblivious failed (RuntimeError: Could not guard" in caplog.text
    finally:
        slot_state.release(loaded.model)
        torch._dynamo.reset()


def test_a_free_slot_left_in_the_batch_never_writes_past_the_cache(loaded, tiny_model, slots, monkeypatch):
    """A row whose prompt + max_new_tokens fills the longest sequence the engine holds (need = max_len, here 128) ends
    with its slot's position at max_len after its extra step. When three other rows keep the decode batch at the
    same bucket, that free slot stays in the batch: its K/V write must go to position 0 of the trash page, not past
    the page table (IndexError on CPU, an out-of-bounds write on the GPU). Every row equals the padded engine."""
    monkeypatch.setattr(slot_state, "MAX_LEN", 128)  # sequences of up to two pages: a short test
    slots(4)
    prompt = "the sky " * 20
    fill = slot_state.max_len(loaded.model) - len(loaded.tokenizer(prompt)["input_ids"])
    rows = [(0, row(prompt, max_new_tokens=fill, ignore_eos=True))]
    rows += [(i, row("the", max_new_tokens=fill + 30, ignore_eos=True)) for i in (1, 2, 3)]
    info: dict = {}
    fast = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)
    assert fast[0].completion_tokens == fill
    assert fields(fast) == fields(run(loaded, make_spec(tiny_model, engine="padded"), rows))


def mixed_rows(n: int, seed: int, longest: int) -> list[tuple[int, dict]]:
    """`n` rows of mixed prompt and output lengths (a small G2): some memorized questions, the rest runs of words to
    their own max_new_tokens, one of them filling `longest` tokens exactly."""
    import random

    rng = random.Random(seed)
    words = ["the", "sky", "water", "city", "hello", "What is"]
    rows = []
    for i in range(n):
        if i % 7 == 0:
            rows.append((i, row(qa_pairs()[i % len(qa_pairs())][0], max_new_tokens=24)))
        else:
            prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 30)))
            rows.append((i, row(prompt, max_new_tokens=rng.randint(1, 40), ignore_eos=True)))
    rows.append((n, row("the " * 10, max_new_tokens=longest - 11, ignore_eos=True)))
    return rows


def test_consecutive_runs_of_different_shapes_on_one_resident_state_equal_a_fresh_engine(loaded, tiny_model, slots):
    """Large runs of different shapes (G2-like, G2-like again, G1-like uniform, G2-like) one after another on the
    resident slot state give exactly the outputs of a fresh engine for each (the state released before each)."""
    slots(6)
    uniform = [(i, row("the sky " * 4, max_new_tokens=20, ignore_eos=True)) for i in range(20)]
    shapes = [mixed_rows(40, 1, 64), mixed_rows(40, 2, 64), uniform, mixed_rows(30, 3, 128)]
    slot_state.release(loaded.model)
    resident = [fields(run(loaded, make_spec(tiny_model, engine="fast"), rows)) for rows in shapes]
    fresh = []
    for rows in shapes:
        slot_state.release(loaded.model)
        fresh.append(fields(run(loaded, make_spec(tiny_model, engine="fast"), rows)))
    slot_state.release(loaded.model)
    for got, want in zip(resident, fresh):
        assert got == want


def test_the_cache_is_sized_with_the_resident_cache_counted_as_free(loaded, tiny_model, monkeypatch):
    """The pages of a new state come from the device's memory (simulated: a 'GPU' whose driver reports its total
    and what is free, the model and the resident cache allocated). The resident cache counts as free, since a new
    state replaces it: counted as taken, a second large run on a resident engine saw only the slack beside it (a
    handful of slots or none). A second job reuses the resident state as it is: same pages, no new capture."""
    per_page = slot_state.page_bytes(loaded.model)
    working = slot_state.reserve(loaded.model) + slot_state.MAX_SLOTS * 640 * slot_state.GRAPH_BYTES_PER_VOCAB
    model_bytes = 10 * per_page
    total = int((40.5 * per_page + model_bytes + working) / 0.9)  # JOBS_GPU_MEMORY_UTILIZATION's default

    def driver_memory(device):  # what mem_get_info would report: the model and the resident cache are allocated
        return total - model_bytes - slot_state.resident_bytes(loaded.model), total

    monkeypatch.setattr(slot_state, "device_memory", driver_memory)
    slot_state.release(loaded.model)
    try:
        assert slot_state.size(loaded.model, loaded.device, 640) == (slot_state.MAX_SLOTS, 40)
        state = slot_state.state_for(loaded.model, loaded.device, 640)
        assert slot_state.size(loaded.model, loaded.device, 640) == (slot_state.MAX_SLOTS, 40)
        assert slot_state.state_for(loaded.model, loaded.device, 640) is state
        smaller = 0.9 - 20 * per_page / total  # the setting takes 20 pages' worth away
        assert slot_state.size(loaded.model, loaded.device, 640, utilization=smaller) == (slot_state.MAX_SLOTS, 20)
    finally:
        slot_state.release(loaded.model)


def test_the_cache_takes_the_configured_share_of_the_gpu_less_what_is_in_use():
    """cache_budget: JOBS_GPU_MEMORY_UTILIZATION x the GPU's total memory, less what is in use (this model, another
    process's memory) and the engine's working memory; never negative."""
    gib = 2**30
    assert slot_state.cache_budget(100 * gib, 90 * gib, 5 * gib, 0.9) == 75 * gib  # 10 GiB of model
    assert slot_state.cache_budget(100 * gib, 70 * gib, 5 * gib, 0.9) == 55 * gib  # another process holds 20 GiB
    assert slot_state.cache_budget(100 * gib, 90 * gib, 5 * gib, 1.0) == 85 * gib
    assert slot_state.cache_budget(100 * gib, 40 * gib, 5 * gib, 0.5) == 0


def test_no_room_for_the_cache_names_the_setting(loaded, monkeypatch):
    """A share too small for any page fails with a message that names JOBS_GPU_MEMORY_UTILIZATION and what to do."""
    monkeypatch.setattr(slot_state, "device_memory", lambda device: (90 * 2**30, 100 * 2**30))
    with pytest.raises(torch.OutOfMemoryError, match="JOBS_GPU_MEMORY_UTILIZATION=0.1 allows 10.0 GiB.*raise the"):
        slot_state.size(loaded.model, loaded.device, 640, utilization=0.1)


def test_rows_wait_for_pages_and_a_row_too_long_for_the_cache_runs_padded_or_fails(
    loaded, tiny_model, slots, monkeypatch
):
    """With fewer pages than the rows need at once, rows are admitted as pages come back (longest first, never
    passed over), and every row equals the padded engine. A row needing more pages than the cache has fails with
    a message under engine fast and runs padded under auto."""
    slots(8)
    monkeypatch.setattr(slot_state, "CPU_PAGES", 7)  # 6 usable pages of 64 positions: 384 at once
    slot_state.release(loaded.model)
    rows = mixed_rows(24, 5, 128)  # 2 pages each at most
    info: dict = {}
    fast = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)
    assert info["fast"]["pages"] == 7
    assert fields(fast) == fields(run(loaded, make_spec(tiny_model, engine="padded"), rows))
    long = [(0, row("the", max_new_tokens=420, ignore_eos=True)), (1, row(qa_pairs()[0][0]))]
    r = run(loaded, make_spec(tiny_model, engine="fast"), long)
    assert r[0].output is None and "more than the 384 the fast engine holds here" in r[0].error
    assert r[1].output == qa_pairs()[0][1]
    out = run_auto(loaded, tiny_model, long)
    assert out[0].error is None and out[0].completion_tokens == 420 and out[1].output == qa_pairs()[0][1]
    slot_state.release(loaded.model)


def test_gpu_memory_utilization_setting_is_a_share_of_the_gpu(monkeypatch):
    """JOBS_GPU_MEMORY_UTILIZATION: unset is 0.9, a number above 0 and at most 1 is taken, anything else is refused
    with the variable's name and what to give."""
    from core.settings import get_settings, reset

    for value, expected in (("", 0.9), ("0.5", 0.5), ("1", 1.0)):
        monkeypatch.setenv("JOBS_GPU_MEMORY_UTILIZATION", value)
        reset()
        assert get_settings().gpu_memory_utilization == expected
    for value in ("0", "1.5", "most"):
        monkeypatch.setenv("JOBS_GPU_MEMORY_UTILIZATION", value)
        reset()
        with pytest.raises(ValueError, match=f"JOBS_GPU_MEMORY_UTILIZATION='{value}': give a number above 0 and at"):
            get_settings()
    reset()


# --- a shared prompt prefix computed once (worker/engines/pages.py; issue 26) --------------------------------------

INSTRUCTION = "Answer the question in one word, the way the sky is blue and the water is wet: " * 12


def prefixed_rows(n: int, instruction: str = INSTRUCTION) -> list[tuple[int, dict]]:
    """`n` rows that share a long instruction (several full pages) and differ after it."""
    questions = [q for q, _ in qa_pairs()] + ["hello", "What is", "water city sky", "the the the"]
    return [(i, row(instruction + questions[i % len(questions)] + " #" * (i % 5), max_new_tokens=12)) for i in range(n)]


def test_rows_sharing_a_prefix_prefill_only_the_rest_and_give_the_outputs_of_a_whole_prefill(loaded, tiny_model, slots):
    """Rows whose prompts start with one instruction of several full pages: with the prefix cache the first row
    prefills it and the others (admitted in the same round) prefill only their own tokens after it, reading the
    instruction's cached pages; every greedy output equals the run without reuse (prefix_cache off), and the engine
    counts the prompt tokens it read from the cache."""
    slots(16)
    rows = prefixed_rows(12)
    tok = loaded.tokenizer
    shared_pages = len(tok(INSTRUCTION)["input_ids"]) // decode_attention.PAGE
    assert shared_pages >= 2
    off_info: dict = {}
    off = run(loaded, make_spec(tiny_model, engine="fast", prefix_cache="off"), rows, info=off_info)
    slot_state.release(loaded.model)
    info: dict = {}
    cached = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)
    assert fields(cached) == fields(off)
    assert off_info["fast"]["prefix_tokens_reused"] == 0 and off_info["fast"]["prefix_cache"] is False
    stats = info["fast"]
    assert stats["prompt_tokens"] == sum(r.prompt_tokens for r in cached.values())
    assert stats["prefix_tokens_reused"] >= (len(rows) - 1) * shared_pages * decode_attention.PAGE


def test_the_cascade_reads_the_prefix_most_running_rows_share(loaded, tiny_model, slots, monkeypatch):
    """The host side of the cascade: after an admission the engine names the cached prefix that saves the most
    reads (rows holding it × its pages), writes it into the state for the decode step (-1 past its end) and counts
    the running rows whose tables start with it; decode steps use it while enough rows do, and `cascade_steps`
    counts them. (On CPU the attention is the reference, which reads every table whole; the kernels are checked
    in the interpreter above.)"""
    slots(16)
    monkeypatch.setattr(fastgen, "CASCADE_MIN_READS", 12)
    state = slot_state.state_for(loaded.model, loaded.device, loaded.model.get_output_embeddings().weight.shape[0])
    eng = fastgen.Engine(loaded, state, common.eos_ids(loaded), slots=16, graphs=False)
    seq = lambda pages, prefix: fastgen.Seq(None, 0, pages=pages, prefix=prefix)  # noqa: E731
    running = {0: seq([5, 6, 7, 8], 0), 1: seq([5, 6, 7, 9], 3), 2: seq([5, 6, 10], 2), 3: seq([11, 12, 13], 2)}
    running.update({4 + i: seq([5, 6, 7, 20 + i], 3) for i in range(3)})
    eng._choose_shared(running)
    assert eng._cascade_pages == (5, 6, 7) and eng._sharing == 5  # 4 rows × 3 pages beats 5 rows × 2 pages
    assert state.shared[:4].tolist() == [5, 6, 7, -1] and state.shared_n.item() == 3
    assert "cascade" in eng._extras(running)  # 5 rows × 3 pages saves 15 page reads a step: at least 12
    eng._cascade_pages, eng._sharing = (5, 6, 7), 3
    assert "cascade" not in eng._extras(running)  # 9
    eng._cascade_pages, eng._sharing = (5, 6, 7, 8), 3
    assert "cascade" in eng._extras(running)  # 12

    rows = prefixed_rows(12)
    off_info: dict = {}
    monkeypatch.setattr(fastgen, "CASCADE", False)
    off = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=off_info)
    monkeypatch.setattr(fastgen, "CASCADE", True)
    slot_state.release(loaded.model)
    info: dict = {}
    on = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)
    assert fields(on) == fields(off)
    assert off_info["fast"]["cascade_steps"] == 0
    assert 0 < info["fast"]["cascade_steps"] <= info["fast"]["steps"]

    # constrained rows: the grammar's forward phase runs the cascade, its choosing phase reads the logits
    choice = [(i, {**r, "params": {**r["params"], "guided_choice": ["Paris", "London"]}}) for i, r in rows]
    slot_state.release(loaded.model)
    constrained: dict = {}
    got = run(loaded, make_spec(tiny_model, engine="fast"), choice, info=constrained)
    assert constrained["fast"]["cascade_steps"] > 0
    assert {r.output for r in got.values()} <= {"Paris", "London"}


def test_a_cached_prefix_serves_the_next_job_on_a_resident_engine(loaded, tiny_model, slots):
    """The cached pages outlive the run: a second job with the same instruction reads it from the cache for every
    row, its first included, and gives the same outputs; rows with another instruction prefill it whole."""
    slots(16)
    rows = prefixed_rows(8)
    first_info: dict = {}
    first = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=first_info)
    assert first_info["fast"]["prefill_chunks"] == 2  # the rows that share the instruction wait for the one writing it
    info: dict = {}
    second = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)
    assert fields(second) == fields(first)
    pages = len(loaded.tokenizer(INSTRUCTION)["input_ids"]) // decode_attention.PAGE
    assert info["fast"]["prefix_tokens_reused"] >= len(rows) * pages * decode_attention.PAGE
    assert info["fast"]["prefill_chunks"] == 1  # every row reads the same cached pages: one forward
    other: dict = {}
    run(loaded, make_spec(tiny_model, engine="fast"), prefixed_rows(2, "Say it backwards: " * 30), info=other)
    assert other["fast"]["prefix_tokens_reused"] < 2 * decode_attention.PAGE * pages


def test_the_benchmarks_repeated_runs_send_prompts_the_prefix_cache_has_not_seen(loaded, tiny_model, slots):
    """ops/bench/gen.py and profile_gen.py time a workload several times on one resident engine, each run on its
    own prompts (`workload`'s `run`): the same token counts and the same shared instruction within a run, but no
    page of another run. Sent again, a run's prompts come from the cache (what flattered G1's later runs on
    2026-12-06); the next run's prompts reuse only what its own rows share, as the first run's did."""
    from ops.bench import gen

    tok = loaded.tokenizer
    for name in ("g1", "g2", "g3"):
        runs = [gen.workload(name, tok, True, number) for number in range(4)]
        counts = [[(len(tok(p)["input_ids"]), o) for p, o in rows] for rows in runs]
        assert counts[1:] == counts[:1] * 3, name  # the workload's lengths: the bound stays the bound
        assert len({rows[0][0] for rows in runs}) == 4, name
    slots(8)

    def timed(number: int) -> dict:
        data = gen.workload("g3", tok, True, number)[:6]  # an instruction of two full pages, then each row's own
        rows = [(i, {"prompt": p, "params": {"max_new_tokens": 2}}) for i, (p, _) in enumerate(data)]
        info: dict = {}
        assert len(run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)) == len(rows)
        return info["fast"]

    first = timed(1)["prefix_tokens_reused"]
    assert first == 5 * 2 * decode_attention.PAGE  # the rows after the one that writes the instruction's pages
    assert timed(1)["prefix_tokens_reused"] >= 6 * 2 * decode_attention.PAGE  # the same prompts again: all cached
    assert timed(2)["prefix_tokens_reused"] == first  # another run's prompts: only what its own rows share


def test_profile_gen_flips_an_engine_flag_between_interleaved_runs(tmp_path):
    """ops/bench/profile_gen.py --flip (CPU smoke): every round runs the engine as it is and with the flags flipped
    (two at once here), each run on prompts of its own, on the cache type given (int8 here), and reports both
    medians and their ratio."""
    out = tmp_path / "flip.json"
    cmd = [
        sys.executable,
        "ops/bench/profile_gen.py",
        "g1",
        "--smoke",
        "--repeat",
        "2",
        "--flip",
        "prefill_both",
        "--syncs",
        "--kv-cache-dtype",
        "int8",
    ]
    done = subprocess.run(
        [*cmd, "--model", str(tmp_path / "model"), "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    g1 = report["g1"]
    assert report["kv_cache_dtype"] == g1["cold"]["fast"]["kv_cache_dtype"] == "int8"
    names = ["worker.engines.decode_attention.PREFILL_WRITE", "worker.engines.fastgen.SYNC_FREE"]
    assert g1["flip"] == {  # both on by default: the flipped runs take the old paths
        "flag": ", ".join(names),
        "as_is": True,
        "flipped": False,
        "flags": {n: {"as_is": True, "flipped": False} for n in names},
    }
    assert len(g1["warm"]) == len(g1["flipped_warm"]) == 2 and g1["cold"] and g1["flipped_cold"]
    assert all(r["prefix_tokens_reused"] == 0 for r in g1["warm"] + g1["flipped_warm"])
    for r in g1["warm"] + g1["flipped_warm"]:  # the time outside the engine's two timers, and the host's parts
        assert r["outside_s"] == pytest.approx(r["seconds"] - r["prefill_s"] - r["decode_s"], abs=0.002), r
        assert r["prefill_chunks"] >= 1, r
        assert min(r["wait_s"], r["book_s"], r["mask_s"], r["caller_s"]) >= 0, r
    assert g1["flip_gain"] == round(g1["warm_median_tok_s"] / g1["flipped"]["median"], 4)
    assert "as it is over flipped" in done.stdout
    # no CUDA here: nothing to count either way (the next test counts a stand-in's)
    assert g1["syncs"] == g1["flipped_syncs"] == []


def test_profile_gen_flips_a_decode_kernel_setting_to_a_number(monkeypatch):
    """--flip pages sets the decode kernel's CONFIG["pages"] to --flip-to's value and back; without --flip-to it is
    refused before anything loads."""
    from ops.bench import profile_gen

    monkeypatch.setitem(decode_attention.CONFIG, "pages", 1)
    (flag,) = [profile_gen.Flag(importlib.import_module(m), *rest, to=4) for m, *rest in profile_gen.FLIPS["pages"]]
    assert flag.name == "worker.engines.decode_attention.CONFIG['pages']"
    assert (flag.get(), flag.other(flag.get())) == (1, 4)
    flag.set(flag.other(1))
    assert decode_attention.CONFIG["pages"] == 4
    flag.set(1)
    assert decode_attention.CONFIG["pages"] == 1
    monkeypatch.setitem(decode_attention.QUANTIZED_CONFIG, "pages", 2)  # fp8/int8 pages' own setting
    (quant,) = [
        profile_gen.Flag(importlib.import_module(m), *rest, to=1) for m, *rest in profile_gen.FLIPS["quant_pages"]
    ]
    quant.set(quant.other(quant.get()))
    assert decode_attention.QUANTIZED_CONFIG["pages"] == 1 and decode_attention.CONFIG["pages"] == 1
    fold = profile_gen.Flag(decode_attention, "FOLD_WRITE", to=4)  # a bool flips to its opposite, whatever `to`
    assert fold.other(True) is False
    with pytest.raises(SystemExit) as refused:
        profile_gen.main(["g1", "--flip", "pages", "--out", "/dev/null"])
    assert refused.value.code == 2


def test_profile_gen_flips_filtered_sampling_and_refuses_spec_fields_that_are_no_spec():
    """--flip filtered_sampling turns fastgen.FILTERED_SAMPLING (off) on; --spec's fields (the runs' sampling) are
    refused before anything loads where they are not a JSON object of valid spec fields."""
    from ops.bench import profile_gen

    targets = profile_gen.FLIPS["filtered_sampling"]
    (flag,) = [profile_gen.Flag(importlib.import_module(m), *rest) for m, *rest in targets]
    assert flag.name == "worker.engines.fastgen.FILTERED_SAMPLING" and flag.other(flag.get()) is True
    for bad in ('{"top_p": 2}', "[1]", "top_p"):
        with pytest.raises(SystemExit) as refused:
            profile_gen.main(["g1", "--spec", bad, "--out", "/dev/null"])
        assert refused.value.code == 2


def test_profile_gen_counts_where_the_host_waits_on_the_device():
    """profile_gen.py --syncs: the warnings CUDA's sync debug mode raises during a run, counted by the repository
    frames they came from (innermost first); the debug mode is set for the run only. (A stand-in for torch.cuda:
    this host has no CUDA; the smoke run above covers the CPU path, which counts nothing.)"""
    import warnings
    from types import SimpleNamespace

    from ops.bench import profile_gen

    modes = []
    fake = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True, set_sync_debug_mode=modes.append))

    def launch():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    def run():
        for _ in range(3):
            launch()
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)

    sites = profile_gen.synchronizing(fake, run)
    line = launch.__code__.co_firstlineno + 1
    assert [s["calls"] for s in sites] == [3, 1], sites
    here = "tests/test_engine_fast.py"
    assert f"operation @ {here}:{line} <- {here}:{line + 4} <- {here}:" in sites[0]["site"], sites  # 3 frames
    assert modes == ["warn", "default"]


def test_the_benchmarks_bound_on_a_gpu_of_another_rate_scales_with_its_measured_rate(tiny_model):
    """gen.py's bound is the yardstick's (the H200's rate) on any GPU; on a GPU model with a measured rate of its own
    (an H100) `bound_here` is the same bytes at that rate, and a GPU nobody measured gets none."""
    from transformers import AutoConfig

    from ops.bench import gen

    assert gen.rate_of("NVIDIA H100 80GB HBM3") == gen.RATES["H100"] < gen.BANDWIDTH
    assert gen.rate_of("NVIDIA H200") == gen.BANDWIDTH
    assert gen.rate_of("NVIDIA A100-SXM4-80GB") is None and gen.rate_of(None) is None
    config, rows = AutoConfig.from_pretrained(tiny_model), [(256, 256)] * 8 + [(32, 512)] * 3
    full, half = gen.bound(config, rows), gen.bound(config, rows, bandwidth=gen.BANDWIDTH / 2)
    assert half["kv_bytes"] == full["kv_bytes"] and half["weight_bytes"] == full["weight_bytes"]
    assert half["bound_tok_s"] == pytest.approx(full["bound_tok_s"] / 2, rel=1e-3)


def test_the_overlap_experiment_runs_every_way_over_the_same_rows(tmp_path):
    """ops/bench/overlap.py --smoke (CPU, tiny shapes): every way of running a decode step (whole, halves, quarters)
    and the prefill beside it runs and is timed, and the halves and quarters pick the tokens the whole batch picks
    (their slices of the slot inputs are the whole batch's rows)."""
    out = tmp_path / "overlap.json"
    done = subprocess.run(
        [sys.executable, "ops/bench/overlap.py", "--smoke", "--out", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    (row,) = result["decode"]
    assert row["same_tokens"] == dict.fromkeys(("halves_serial", "halves_streams", "quarters_streams"), row["batch"])
    assert all(row[f"{name}_ms"] > 0 for name in ("one", "halves_serial", "halves_streams", "quarters_streams"))
    mixed = result["prefill_beside_decode"]
    assert mixed["gain"] > 0 and mixed["serial_ms"] > 0 and mixed["streams_ms"] > 0
    assert "| batch × context |" in done.stdout and "side by side" in done.stdout


def test_cached_prefixes_are_evicted_when_the_cache_needs_room_and_outputs_stay_right(
    loaded, tiny_model, slots, monkeypatch
):
    """A cache of few pages and rows of three instructions one after another: cached prefix pages are evicted
    (least recently used first) to make room, and every output still equals the run without reuse."""
    slots(4)
    monkeypatch.setattr(slot_state, "CPU_PAGES", 16)
    slot_state.release(loaded.model)
    rows = []
    for k, text in enumerate(("First tell: ", "Then say: ", "Now write: ")):
        rows += [(10 * k + i, r) for i, (_, r) in enumerate(prefixed_rows(5, text * 25))]
    off = run(loaded, make_spec(tiny_model, engine="fast", prefix_cache="off"), rows)
    slot_state.release(loaded.model)
    info: dict = {}
    cached = run(loaded, make_spec(tiny_model, engine="fast"), rows, info=info)
    assert fields(cached) == fields(off)
    assert info["fast"]["prefix_tokens_reused"] > 0


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_a_quantized_cache_keeps_the_memorized_answers_and_its_own_prefix_reuse_exact(loaded, tiny_model, slots, kind):
    """kv_cache_dtype fp8 or int8 (slot_state's docstring): the cache holds float8 or int8 values with a float32
    scale per position and head, and decode attends over them dequantized. On the memorized model every answer
    stays exact; outputs with the prefix cache equal those without it (the prefill attends over the dequantized
    values too); a job of another type on the resident engine gets a cache of its own type and the outputs of a
    fresh one."""
    slots(16)
    rows = ragged_rows()
    fp8 = make_spec(tiny_model, engine="fast", max_new_tokens=24, kv_cache_dtype=kind)
    plain = run(loaded, make_spec(tiny_model, engine="fast", max_new_tokens=24), rows)
    info: dict = {}
    quantized = run(loaded, fp8, rows, info=info)
    state = loaded.model.__dict__["_gpujobs_fast"]
    assert state.cache.dtype == decode_attention.QUANTIZED[kind] and state.scales.dtype == torch.float32
    assert state.scales.shape == state.cache.shape[:-1]
    assert info["fast"]["kv_cache_dtype"] == kind
    for i, (_, answer) in enumerate(qa_pairs()):
        assert quantized[i].output == answer and quantized[i].finish_reason == "stop"
    assert fields(run(loaded, make_spec(tiny_model, engine="fast", max_new_tokens=24), rows)) == fields(plain)
    assert loaded.model.__dict__["_gpujobs_fast"].scales is None
    # a switch keeps the compiled layers (the attention they call reads the cache; they do not)
    state = slot_state.state_for(loaded.model, loaded.device, 640)
    state.compiled = layers = [object()]
    switched = slot_state.state_for(loaded.model, loaded.device, 640, kv_cache_dtype=kind)
    assert switched is not state and switched.compiled is layers and switched.kv_cache_dtype == kind
    assert slot_state.state_for(loaded.model, loaded.device, 640, kv_cache_dtype=kind) is switched
    slot_state.release(loaded.model)
    # bytes per page: head_dim one-byte values and a float32 scale per position and head
    layers, kv_heads, head_dim = slot_state._shape(loaded.model)
    assert slot_state.page_bytes(loaded.model, kind) == 2 * layers * kv_heads * decode_attention.PAGE * (head_dim + 4)

    prefixed, fp8_lp = prefixed_rows(12), fp8.model_copy(update={"logprobs": True})
    off = run(loaded, fp8_lp.model_copy(update={"prefix_cache": "off"}), prefixed)
    slot_state.release(loaded.model)
    reused: dict = {}
    on = run(loaded, fp8_lp, prefixed, info=reused)
    assert fields(on) == fields(off)
    assert reused["fast"]["prefix_tokens_reused"] > 0
    for i in on:  # each token's log-probability, not only the argmax: the rounding would show here (~1e-2)
        a, b = ([e["logprob"] for e in logprob_store.render(r[i].logprobs)] for r in (on, off))
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-4, (i, a, b)


def test_the_g1kv_benchmark_times_each_cache_type_and_checks_their_greedy_outputs(tmp_path, tiny_model):
    """`ops/bench/gen.py g1kv --smoke` (CPU, the tiny model): interleaved runs with each cache type (each run on the
    type it names), their ratios to auto, and the memorized model's greedy outputs with each quantized cache
    checked against plain `generate` (the device runs decide by these)."""
    got = gen_smoke("g1kv", tmp_path, tiny_model, "--repeat", "1")
    kinds = ("auto", "fp8", "int8")
    assert {kind: len(got["g1kv_tok_s"][kind]["runs"]) for kind in kinds} == dict.fromkeys(kinds, 1)
    assert got["ratios"]["fp8/auto"] > 0 and got["ratios"]["int8/auto"] > 0
    assert [got["engine"][f"{kind}_1"]["kv_cache_dtype"] for kind in kinds] == list(kinds)
    for kind in ("fp8", "int8"):
        check = got["correctness"][f"{kind}_greedy_vs_generate"]
        assert check["passed"] and check["engine"]["fast"]["kv_cache_dtype"] == kind, check
        assert got["kv_logits_vs_generate"][kind]["of_tokens"] > 0
    assert got["ratios"]["correctness_passed"] is True


@pytest.mark.parametrize("kind, bound", [(torch.float8_e4m3fn, 2**-4), (torch.int8, 0.5 / 127 + 1e-6)])
def test_quantizing_scales_each_vector_to_its_own_range(kind, bound):
    """Each vector (a position's head) is scaled to the type's range by its own largest magnitude: a tiny vector and
    a huge one beside it both come back within the type's rounding (fp8: a relative 2^-4 of the largest value; int8:
    half a step of largest / 127), a zero vector as zeros, nothing overflows; int8 rounds ties away from zero."""
    x = torch.randn(3, 2, 64) * torch.tensor([1e-4, 1.0, 1e4])[:, None, None]
    x[0, 1] = 0
    values, scales = decode_attention.quantize(x, kind)
    assert values.dtype == kind and scales.shape == (3, 2)
    back = decode_attention.dequantize(values, scales, torch.float32)
    assert torch.all(back[0, 1] == 0) and torch.isfinite(back).all()
    err = (back - x).abs() / x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    assert err.max() <= bound
    if kind == torch.int8:
        ties, tie_scales = decode_attention.quantize(torch.tensor([127.0, 0.5, -0.5, 1.5, -2.5]), kind)
        assert tie_scales.item() == 1.0 and ties.tolist() == [127, 1, -1, 2, -3]


def test_the_page_pool_counts_references_and_evicts_the_least_recently_used_prefix():
    """pages.Pool: shared pages are reference-counted; a registered page no sequence uses stays cached (idle) and
    is evicted least recently used first, which unregisters it (and makes the blocks after it unreachable); a
    registration whose prefill never launched is forgotten; a new run keeps the cache."""
    from worker.engines.pages import Pool

    a, b, c = (1,) * 4, (2,) * 4, (3,) * 4
    pool = Pool(7)  # pages 1..6
    first = pool.take([], 3)
    assert pool.register(first, [a, b]) == first[:2]  # only full prompt pages are blocks
    assert pool.match([a, b, c]) == first[:2] and pool.match([b]) == []
    second = pool.take(pool.match([a, b]), pool.cost(first[:2], 3))
    assert second[:2] == first[:2] and pool.refs[first[0]] == 2 and pool.reused == 2
    pool.give_back(first)
    assert pool.refs[first[0]] == 1 and first[0] not in pool.idle and first[2] in pool.free
    pool.give_back(second)
    assert list(pool.idle) == first[:2] and pool.available() == 6
    assert pool.cost(first[:2], 7) is None and pool.cost(first[:2], 6) == 4
    other = pool.take([], 5)  # 4 free pages, then the least recently used cached one
    assert first[0] in other and pool.match([a, b]) == []
    pool.give_back(other)
    pending = pool.take([], 1)
    pool.register(pending, [c])
    pool.forget(pending)  # its sequence still holds it: free once given back, not cached
    pool.give_back(pending)
    assert pool.match([c]) == [] and pending[0] in pool.free and pending[0] not in pool.idle
    pool.start_run()
    assert pool.refs == {} and set(pool.idle) == {first[1]} and pool.available() == 6


def test_a_prefill_after_a_cached_prefix_compiles_nothing_the_warm_up_did_not(loaded, tiny_model, slots, monkeypatch):
    """Rows that read a cached prefix (the attention gathers its pages first) run the layers the warm-up compiled:
    a job whose rows share an instruction compiles no variant of its own. (On an H100 a resident engine's first
    prefill after a cached prefix took 0.45-0.53 s against 0.06 s without one, ops/bench/results/
    2026-12-05-h100-session38: that cost is not Dynamo's.)"""
    from torch._dynamo.utils import counters

    slots(4)
    monkeypatch.setattr(fastgen, "COMPILE_BACKEND", "eager")
    prepared = list(common.prepare(loaded, make_spec(tiny_model, engine="fast"), prefixed_rows(6), 0.0))
    slot_state.release(loaded.model)
    torch._dynamo.reset()
    try:
        state = slot_state.state_for(loaded.model, loaded.device, 640)
        eng = fastgen.Engine(loaded, state, common.eos_ids(loaded), slots=4, graphs=False, compiled=True)
        with torch.inference_mode():
            eng.warm_up()
            compiled = counters["stats"]["unique_graphs"]
            done = [s for finished in eng.run([fastgen.Seq(p, 0) for p in prepared], lambda: False) for s in finished]
        assert eng.reused_tokens > 0 and len(done) == 6
        assert counters["stats"]["unique_graphs"] == compiled, "the job compiled a variant the warm-up did not"
    finally:
        slot_state.release(loaded.model)
        torch._dynamo.reset()
