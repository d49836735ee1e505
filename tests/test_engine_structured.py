"""Structured outputs and log-probabilities in the engines (worker/engines/grammar.py, logprobs.py), on the tiny
model, on CPU: every constrained output of the padded, static and fast engines parses and validates against its
schema (or is one of its choices, or matches its regex), greedy and sampled, except rows cut by max_new_tokens,
which say `length`; the continuous engine fails such rows with its reason; a chosen token's log-probability equals
a plain forward pass's. Runs under transformers 5.24 and 5.17 (.ci/run).
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema_rs
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from core import logprob_store
from core.spec import GenerateSpec
from tests.test_engine_fast import gen_smoke, interpreted  # gen.py's smoke run; a script under Triton's interpreter
from worker.engines import common, fastgen, grammar, logprobs, slot_state
from worker.generate import generate
from worker.loader import Loaded, load

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
# the compact JSON grammar, for the tests whose greedy outputs are compared across runs that batch rows differently
# (CHECK_FIRST redoes a refused row's step): on CPU a row's logits move in their last bits with the rows beside it,
# and the random tiny model has near-ties between the space our grammar allows and the next token
COMPACT = {
    **FORMAT,
    "json_schema": {**FORMAT["json_schema"], "schema": {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}},
}
PROMPTS = ["hello", "What is the capital of France?", "the sky", "water city", "4 + 4 =", "yes"]
ENGINES = ["padded", "static", "fast"]


def make_spec(model, **fields) -> GenerateSpec:
    return GenerateSpec.model_validate({"model": str(model), "input": "file_x", **fields})


def row(prompt: str, **params) -> dict:
    return {"prompt": prompt, "params": params, "extra": {}}


def run(loaded: Loaded, spec: GenerateSpec, rows, batch_rows: int = 4) -> dict:
    return {r.idx: r for batch in generate(loaded, spec, rows, batch_rows=batch_rows, info={}) for r in batch}


@pytest.fixture(scope="module")
def loaded(tiny_model) -> Loaded:
    return load(make_spec(tiny_model), gpus=0)


@pytest.fixture
def slots(monkeypatch, loaded):
    """The fast engine's CPU slot count for one test (its resident state dropped before and after)."""

    def set_slots(n: int) -> None:
        monkeypatch.setattr(slot_state, "CPU_SLOTS", n)
        slot_state.release(loaded.model)

    yield set_slots
    slot_state.release(loaded.model)


def constrained_rows(compact: bool = False) -> list[tuple[int, dict]]:
    """The job's schema on most rows; a choice, a regex, any JSON object (`compact`: in the compact grammar) and a
    row with no constraint beside."""
    rows = [(i, row(p)) for i, p in enumerate(PROMPTS)]
    rows.append((10, row("is the sky blue?", guided_choice=["yes", "no", "maybe not"])))
    rows.append((11, row("a date", guided_regex=r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]")))
    any_object = {"type": "json_object"}
    if compact:
        schema = {"type": "object", "x-guidance": {"whitespace_flexible": False}}
        any_object = {"type": "json_schema", "json_schema": {"name": "object", "schema": schema}}
    rows.append((12, row("any object", response_format=any_object, max_new_tokens=40)))
    rows.append((13, row("free text", response_format={"type": "text"}, max_new_tokens=6)))
    return rows


def check(results: dict) -> int:
    """Every row that did not stop at max_new_tokens holds what its constraint asks; returns how many did."""
    valid = 0
    for idx, r in results.items():
        assert r.error is None, (idx, r.error)
        if idx == 13:
            continue  # unconstrained
        if r.finish_reason == "length":
            continue  # cut by max_new_tokens: not counted as valid (and said so)
        assert r.finish_reason == "stop", (idx, r.finish_reason)
        if idx == 10:
            assert r.output in ("yes", "no", "maybe not")
        elif idx == 11:
            assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]", r.output), r.output
        else:
            value = json.loads(r.output)
            schema = {"type": "object"} if idx == 12 else SCHEMA
            assert jsonschema_rs.validator_for(schema).is_valid(value), (idx, r.output)
        valid += 1
    return valid


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("engine", ENGINES)
def test_constrained_outputs_validate_on_every_engine(loaded, tiny_model, slots, engine, sampled):
    """The job's json_schema (and rows' choice, regex and json_object) on a random-ish tiny model: every output not
    cut by max_new_tokens parses and validates; most rows end on their own (the grammar leaves only EOS once the
    object is closed). Sampling at temperature 1.5 picks unlikely tokens, which the mask must still refuse. The
    fast engine runs with 3 slots for 10 rows (admission while rows run, the grammar booked step by step)."""
    slots(3)
    sampling = {"temperature": 1.5, "seed": 3} if sampled else {}
    spec = make_spec(tiny_model, engine=engine, max_new_tokens=48, response_format=FORMAT, **sampling)
    results = run(loaded, spec, constrained_rows())
    assert len(results) == 10
    assert check(results) >= 7
    if engine == "fast" and not sampled:  # a second job on the resident state (its buffers kept, the engine new)
        assert check(run(loaded, spec, constrained_rows())) >= 7


def test_the_fast_engine_gives_the_same_outputs_in_families_and_booked_in_one_call(
    loaded, tiny_model, slots, monkeypatch
):
    """Greedy constrained rows through the fast engine with their matchers in three families (two executor threads),
    booked by `grammar.advance` in one call a step (PARALLEL_ADVANCE), and with each family on an executor and a
    thread of its own (FAMILY_THREADS), give the outputs of one family booked row by row: grouping the rows by
    family changes no row's mask, and the step's booking no row's state."""
    import llguidance

    slots(4)
    monkeypatch.setattr(grammar, "_executor", llguidance.LLExecutor(num_threads=2))
    monkeypatch.setattr(grammar, "_family_executors", [])
    monkeypatch.setattr(grammar, "_pool", None)
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=48, response_format=FORMAT)
    outputs = {}
    calls = collections.Counter()
    by_family = grammar.by_family
    monkeypatch.setattr(
        grammar,
        "by_family",
        lambda groups, call, *args: calls.update([call, len(groups)]) or by_family(groups, call, *args),
    )
    try:
        for families, parallel, threads in (
            (1, False, False),
            (3, False, False),
            (3, True, False),
            (3, False, True),
            (3, True, True),
        ):
            monkeypatch.setattr(grammar, "FAMILIES", families)
            monkeypatch.setattr(grammar, "PARALLEL_ADVANCE", parallel)
            monkeypatch.setattr(grammar, "FAMILY_THREADS", threads)
            results = run(loaded, spec, constrained_rows())
            assert check(results) >= 7
            outputs[families, parallel, threads] = {idx: r.output for idx, r in results.items()}
    finally:
        if grammar._pool is not None:
            grammar._pool.shutdown()
    assert len(set(map(str, outputs.values()))) == 1, outputs
    assert len(grammar._family_executors) == 3 and grammar._pool is not None  # FAMILY_THREADS ran its own
    assert calls[3] > 0 and calls["consume_token_par"] > 0, (
        calls
    )  # steps with rows of all 3 families, and booked in one call


@pytest.mark.parametrize("sampled", [False, True])
def test_the_fast_engine_computes_masks_while_it_books_and_outputs_stay_the_same(
    loaded, tiny_model, slots, monkeypatch, sampled
):
    """With OVERLAP the fast engine books a step's rows family by family and starts each family's next masks as
    soon as its rows are booked (three families: several calls a step), then copies them once all are back; rows
    that finish, rows with no constraint (all tokens allowed) and rows waiting for a slot (4 slots, 10 rows) change
    nothing: greedy and seeded sampled outputs equal those of the masks computed after the booking, and every one
    is valid. A run stopped at its first finished row leaves the next run right."""
    slots(4)
    monkeypatch.setattr(grammar, "FAMILIES", 3)
    monkeypatch.setattr(grammar, "_family_executors", [])
    monkeypatch.setattr(grammar, "_pool", None)
    fields = {"temperature": 0.9, "seed": 7} if sampled else {}
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=48, response_format=FORMAT, **fields)
    finished = collections.Counter()
    finish = grammar.Masks.finish
    monkeypatch.setattr(grammar.Masks, "finish", lambda self: finished.update([len(self.sent)]) or finish(self))
    outputs = {}
    for overlap in (False, True):
        monkeypatch.setattr(grammar, "OVERLAP", overlap)
        results = run(loaded, spec, constrained_rows())
        assert check(results) >= 7
        outputs[overlap] = {idx: (r.output, r.finish_reason) for idx, r in results.items()}
    if not sampled:  # a consumer that stops at the first finished row (a cancelled job) closes a booking mid-way
        batches = generate(loaded, spec, constrained_rows(), batch_rows=1, info={})
        next(batches)
        batches.close()
        again = run(loaded, spec, constrained_rows())
        assert {idx: (r.output, r.finish_reason) for idx, r in again.items()} == outputs[False]
    grammar._pool.shutdown()
    assert outputs[True] == outputs[False]
    assert max(finished) >= 2, finished  # steps whose rows' masks went in a call per family


@pytest.mark.parametrize("sampled", [False, True])
def test_check_first_picks_without_masks_redoes_each_refused_token_and_outputs_stay_right(
    loaded, tiny_model, slots, monkeypatch, sampled
):
    """With CHECK_FIRST the fast engine picks constrained rows' tokens without their masks and checks each as it is
    booked: the tiny model writes no JSON of its own, so many are refused (each such row redoes the position under
    its mask: the step launched after it is dropped) and many pass (inside a string almost any token does). Steps
    where every running constrained row is checked run without the grammar phase at all. Greedy outputs equal the
    masked run's, with and without OVERLAP (4 slots, 11 rows: rows finish and wait beside the redone ones); sampled
    ones are all valid; a row with logprobs stays masked and its log-probabilities come back whole."""
    slots(4)
    monkeypatch.setattr(grammar, "FAMILIES", 3)
    monkeypatch.setattr(grammar, "_family_executors", [])
    monkeypatch.setattr(grammar, "_pool", None)
    monkeypatch.setattr(grammar, "CHECK_BACKOFF", 1)  # back to unmasked picks soon after each refusal
    monkeypatch.setattr(grammar, "CHECK_GIVE_UP", 1.0)  # never stops checking (the next test does)
    monkeypatch.setattr(grammar, "CHECK_ROW_GIVE_UP", 0)  # nor does a row (the test after it)
    fields = {"temperature": 0.9, "seed": 7} if sampled else {}
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=48, response_format=COMPACT, **fields)
    rows = constrained_rows(compact=True) + [(14, row("the sky", logprobs=True, top_logprobs=2))]
    plain_steps = collections.Counter()  # steps of constrained rows without the grammar phase, by CHECK_FIRST
    extras = fastgen.Engine._extras

    def counted(self, running):
        got = extras(self, running)
        plain_steps[grammar.CHECK_FIRST] += any(s.guide for s in running.values()) and "grammar" not in got
        return got

    monkeypatch.setattr(fastgen.Engine, "_extras", counted)
    outputs, records = {}, {}
    for first, overlap in ((False, False), (True, False), (True, True)):
        monkeypatch.setattr(grammar, "CHECK_FIRST", first)
        monkeypatch.setattr(grammar, "OVERLAP", overlap)
        info: dict = {}
        results = {r.idx: r for b in generate(loaded, spec, rows, batch_rows=4, info=info) for r in b}
        assert check(results) >= 8
        assert len(logprob_store.render(results[14].logprobs)) == results[14].completion_tokens
        outputs[first, overlap] = {idx: (r.output, r.finish_reason) for idx, r in results.items()}
        records[first, overlap] = info["fast"]
    grammar._pool.shutdown()
    assert "grammar_checked" not in records[False, False]
    for key in ((True, False), (True, True)):
        assert records[key]["grammar_checked"] > 0 and records[key]["grammar_refused"] > 0, records[key]
        if not sampled:
            assert outputs[key] == outputs[False, False]
    assert plain_steps[True] > 0 and plain_steps[False] == 0
    assert not any(r.get("grammar_check_stopped") for r in records.values())


def test_a_run_whose_model_refuses_too_much_stops_checking_and_outputs_stay_right(
    loaded, tiny_model, slots, monkeypatch
):
    """CHECK_FIRST on a model that writes no JSON of its own: once CHECK_SAMPLE tokens were checked and more than
    CHECK_GIVE_UP of them refused, every row is masked from then on (the steps already launched are still booked as
    they were picked), the engine record says so, and the greedy outputs equal the masked run's."""
    slots(4)
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=48, response_format=COMPACT)
    monkeypatch.setattr(grammar, "CHECK_FIRST", False)
    masked = run(loaded, spec, constrained_rows(compact=True))
    monkeypatch.setattr(grammar, "CHECK_FIRST", True)
    monkeypatch.setattr(grammar, "CHECK_SAMPLE", 12)
    monkeypatch.setattr(grammar, "CHECK_GIVE_UP", 0.1)
    info: dict = {}
    rows = constrained_rows(compact=True)
    checked = {r.idx: r for b in generate(loaded, spec, rows, batch_rows=4, info=info) for r in b}
    record = info["fast"]
    assert record["grammar_check_stopped"] and record["grammar_refused"] > 0.1 * 12, record
    constrained = sum(r.completion_tokens for i, r in checked.items() if i != 13)
    assert record["grammar_checked"] + record["grammar_refused"] < constrained / 2, (record, constrained)
    assert {i: (r.output, r.finish_reason) for i, r in checked.items()} == {
        i: (r.output, r.finish_reason) for i, r in masked.items()
    }


def test_a_row_refused_check_row_give_up_times_is_masked_from_then_on(loaded, tiny_model, slots, monkeypatch):
    """CHECK_FIRST with CHECK_ROW_GIVE_UP 1: a row's first refused token masks that row for the rest of its output
    (the tiny model writes no JSON of its own: every constrained row is refused early), so the run refuses at most
    one token a row, where the same run without the per-row give-up refuses more; greedy outputs equal the masked
    run's either way."""
    slots(4)
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=48, response_format=COMPACT)
    rows = constrained_rows(compact=True)
    monkeypatch.setattr(grammar, "CHECK_FIRST", False)
    masked = {i: (r.output, r.finish_reason) for i, r in run(loaded, spec, rows).items()}
    monkeypatch.setattr(grammar, "CHECK_FIRST", True)
    monkeypatch.setattr(grammar, "CHECK_BACKOFF", 1)
    monkeypatch.setattr(grammar, "CHECK_GIVE_UP", 1.0)  # the run never stops checking
    refused = {}
    for give_up in (0, 1):
        monkeypatch.setattr(grammar, "CHECK_ROW_GIVE_UP", give_up)
        info: dict = {}
        checked = {r.idx: r for b in generate(loaded, spec, rows, batch_rows=4, info=info) for r in b}
        refused[give_up] = info["fast"]["grammar_refused"]
        assert {i: (r.output, r.finish_reason) for i, r in checked.items()} == masked
    constrained = sum(i != 13 for i, _ in rows)  # row 13 asks for text
    assert 0 < refused[1] <= constrained < refused[0], refused


def test_a_row_cut_by_max_new_tokens_says_length(loaded, tiny_model):
    """With too few tokens for the object the output is a valid prefix cut short: finish_reason `length`."""
    spec = make_spec(tiny_model, engine="padded", max_new_tokens=5, response_format=FORMAT)
    results = run(loaded, spec, [(0, row("hello"))])
    assert results[0].finish_reason == "length" and results[0].completion_tokens == 5
    assert re.match(r'\{ ?"name', results[0].output), results[0].output
    with pytest.raises(ValueError):
        json.loads(results[0].output)


def test_unconstrained_rows_are_unchanged_by_constrained_ones_beside_them(loaded, tiny_model, slots):
    """Greedy rows without a constraint give the same outputs alone and batched with constrained rows (the mask
    is all ones on their rows) on every engine."""
    slots(4)
    free = [(i, row(p)) for i, p in enumerate(PROMPTS)]
    mixed = free + [(20, row("x", guided_choice=["a", "b"])), (21, row("y", response_format=FORMAT))]
    for engine in ENGINES:
        spec = make_spec(tiny_model, engine=engine, max_new_tokens=12)
        alone, beside = run(loaded, spec, free), run(loaded, spec, mixed)
        assert [alone[i].output for i in range(len(PROMPTS))] == [beside[i].output for i in range(len(PROMPTS))]
        assert beside[20].output in ("a", "b")


def test_continuous_engine_fails_constrained_and_logprob_rows_with_the_reason(loaded, tiny_model):
    """transformers' continuous batching takes no logits processor of ours: such rows fail with a reason naming the
    engines that run them, the others run."""
    spec = make_spec(tiny_model, engine="continuous", max_new_tokens=8)
    rows = [(0, row("hello", guided_choice=["a", "b"])), (1, row("the", logprobs=True)), (2, row("sky"))]
    results = run(loaded, spec, rows)
    for i, what in ((0, "a constrained output (response_format, guided_choice, guided_regex)"), (1, "logprobs")):
        assert results[i].error == (
            f"{what} is not supported by the continuous engine (transformers' continuous batching takes no logits "
            "processor of ours): use engine auto, fast, padded or static"
        )
    assert results[2].error is None and results[2].output


def test_a_grammar_is_compiled_once_per_schema_and_tokenizer(loaded):
    """The compiled matcher is kept per (grammar, tokenizer): rows share it, each sequence gets its own copy."""
    tok, eos, vocab = loaded.tokenizer, common.eos_ids(loaded), common.vocab_width(loaded)
    params = {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}}
    first = grammar.guides(tok, vocab, eos, [params, params])
    again = grammar.guides(tok, vocab, eos, [params])
    from core import structured

    text = structured.grammar(params)
    assert grammar.compiled(tok, vocab, eos, text) is grammar.compiled(tok, vocab, eos, text)
    assert len({id(g.matcher) for g in first + again}) == 3  # copies of the one compiled matcher
    with pytest.raises(ValueError, match="cannot compile"):
        grammar.compiled(tok, vocab, eos, '{"grammars": [{"json_schema": {"type": "nonsense"}}]}')


def test_json_may_hold_one_space_between_tokens_and_a_schema_can_ask_for_compact(loaded):
    """A JSON constraint takes the compact form and the one most chat models write (a space after ':' and ','), but
    no second space, no newline (no layout to spend tokens on); a schema's `x-guidance` can ask for compact only."""
    from core import structured

    tok, eos, vocab = loaded.tokenizer, common.eos_ids(loaded), common.vocab_width(loaded)

    def takes(schema: dict, text: str) -> bool:
        params = {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
        matcher = grammar.compiled(tok, vocab, eos, structured.grammar(params)).deep_copy()
        ids = tok.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    texts = {
        '{"name":"ann","age":3,"color":"red"}': (True, True),
        '{"name": "ann", "age": 3, "color": "red"}': (True, False),
        '{"name":  "ann","age":3,"color":"red"}': (False, False),
        '{\n"name":"ann","age":3,"color":"red"}': (False, False),
    }
    assert {text: (takes(SCHEMA, text), takes(compact, text)) for text in texts} == texts


def test_each_family_has_its_own_compiled_matcher_and_sequences_are_dealt_in_turn(loaded, monkeypatch):
    """With FAMILIES families a grammar has one compiled matcher per family (a copy of another family's would share
    its lexer's mutex), and consecutive sequences go to the families in turn."""
    monkeypatch.setattr(grammar, "FAMILIES", 3)
    tok, eos, vocab = loaded.tokenizer, common.eos_ids(loaded), common.vocab_width(loaded)
    params = {"guided_choice": ["north", "south"]}
    from core import structured

    text = structured.grammar(params)
    bases = [grammar.compiled(tok, vocab, eos, text, family) for family in range(3)]
    assert len({id(b) for b in bases}) == 3
    assert all(grammar.compiled(tok, vocab, eos, text, family) is bases[family] for family in range(3))
    families = [g.family for g in grammar.guides(tok, vocab, eos, [params] * 6)]
    assert sorted(families) == [0, 0, 1, 1, 2, 2] and families[:3] == families[3:]


def test_masks_in_families_equal_the_masks_of_one_family(loaded, monkeypatch):
    """`fill` hands the executor its rows grouped by family, in another order than the batch's: every row still
    gets its own state's mask. Rows at different points of their outputs, two executor threads, three families
    against one, for every step of the outputs."""
    import llguidance

    tok, eos, vocab = loaded.tokenizer, common.eos_ids(loaded), common.vocab_width(loaded)
    monkeypatch.setattr(grammar, "_executor", llguidance.LLExecutor(num_threads=2))
    outputs = ['{"name":"Ann","age":7,"color":"red"}', '{"name":"Bo","age":120,"color":"blue"}']
    traces = [tok(text, add_special_tokens=False)["input_ids"] for text in outputs]
    params = {"response_format": FORMAT}
    sets = {}
    for families in (1, 3):
        monkeypatch.setattr(grammar, "FAMILIES", families)
        sets[families] = grammar.guides(tok, vocab, eos, [params] * 7)
    assert {g.family for g in sets[3]} == {0, 1, 2}
    starts = [0, 3, 1, 5, 2, 4, 6]  # row i is starts[i] tokens into its output
    for guides in sets.values():
        for i, g in enumerate(guides):
            for token in traces[i % 2][: starts[i]]:
                g.take(token)
    rows = {families: [(i, g) for i, g in enumerate(guides)] for families, guides in sets.items()}
    for step in range(min(len(t) for t in traces) - max(starts)):
        masks = {}
        for families in (1, 3):
            masks[families] = torch.zeros((7, grammar.words(vocab)), dtype=torch.int32)
            grammar.fill(masks[families], rows[families])
        assert torch.equal(masks[1], masks[3]), step
        assert len({tuple(m.tolist()) for m in masks[3]}) > 1  # the rows are in different states
        for guides in sets.values():
            grammar.advance([(g, traces[i % 2][starts[i] + step]) for i, g in enumerate(guides)])
    assert grammar.failure(sets[1] + sets[3]) is None


def test_fill_writes_every_row_whatever_the_buffer_held(loaded):
    """`grammar.fill` into a reused buffer full of garbage: each live row gets its grammar's mask (as into a zeroed
    buffer), and every other row (unconstrained, ended, failed) allows every token."""
    tok, eos, vocab = loaded.tokenizer, common.eos_ids(loaded), common.vocab_width(loaded)
    params = {"guided_choice": ["Paris", "London"]}
    guides = grammar.guides(tok, vocab, eos, [params] * 4)
    guides[1].ended = True
    guides[2].error = "refused"
    rows = [(0, guides[0]), (1, guides[1]), (2, guides[2]), (4, guides[3])]  # row 3: unconstrained
    garbage = torch.full((5, grammar.words(vocab)), 0x5A5A5A5A, dtype=torch.int32)
    grammar.fill(garbage, rows)
    clean = torch.zeros_like(garbage)
    grammar.executor().unsafe_compute_mask_ptr(
        [(guides[0].matcher, 0), (guides[3].matcher, 4)], clean.data_ptr(), clean.shape[1] * 4, 5
    )
    for i in (0, 4):  # a choice's first token: a few tokens allowed, not all
        allowed = sum(bin(word & 0xFFFFFFFF).count("1") for word in garbage[i].tolist())
        assert torch.equal(garbage[i], clean[i]) and 0 < allowed < vocab
    assert torch.all(garbage[1:4] == -1)


# --- log-probabilities ---------------------------------------------------------------------------------------


def forward_logprobs(loaded: Loaded, prompt: str, tokens: list[int], no_eos: bool = False) -> torch.Tensor:
    """log-softmax of a plain forward pass over prompt + generated tokens, at each generated token (`no_eos`: with
    EOS masked, as an ignore_eos row's distribution is)."""
    ids = loaded.tokenizer(prompt)["input_ids"]
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([ids + tokens])).logits[0].float()
        if no_eos:
            logits[:, sorted(common.eos_ids(loaded))] = float("-inf")
    lsm = torch.log_softmax(logits, dim=-1)[len(ids) - 1 : len(ids) - 1 + len(tokens)]
    return lsm.gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("engine", ENGINES)
def test_logprobs_match_a_plain_forward_pass(loaded, tiny_model, slots, engine, sampled):
    """Each output token's logprob equals the log-softmax of a plain forward pass over prompt + output at that
    token (fp32: within 1e-3), one entry per completion token (EOS included); top_logprobs has k entries, most
    likely first, and greedy picks the first of them; bytes are the token's UTF-8 bytes. A row that did not ask
    has none. Sampled logprobs are still the model's distribution (before temperature)."""
    slots(3)
    sampling = {"temperature": 1.5, "seed": 5} if sampled else {}
    spec = make_spec(tiny_model, engine=engine, max_new_tokens=10, logprobs=True, top_logprobs=3, **sampling)
    rows = [(i, row(p)) for i, p in enumerate(PROMPTS[:4])] + [(9, row("the", logprobs=False))]
    results = run(loaded, spec, rows)
    tok = loaded.tokenizer
    assert results[9].logprobs is None and results[9].output is not None
    for i, prompt in enumerate(PROMPTS[:4]):
        r = results[i]
        entries = logprob_store.render(r.logprobs)  # stored compact, read in OpenAI's shape
        assert r.logprobs["format"] == 1 and r.logprobs["n"] == len(entries) == r.completion_tokens
        tokens = [_ids_by_bytes(tok)[bytes(e["bytes"])] for e in entries]
        assert tok.decode(tokens, skip_special_tokens=True).startswith(r.output)
        want = forward_logprobs(loaded, prompt, tokens)
        got = torch.tensor([e["logprob"] for e in entries])
        assert torch.allclose(got, want, atol=1e-3), (got, want)
        for entry in entries:
            top = entry["top_logprobs"]
            assert len(top) == 3 and [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
            assert entry["logprob"] <= top[0]["logprob"] + 1e-5
            if not sampled:
                assert entry["token"] == top[0]["token"] and abs(entry["logprob"] - top[0]["logprob"]) < 1e-5


def _ids_by_bytes(tok) -> dict[bytes, int]:
    """Token ids by their exact bytes (a logprob entry's `bytes`; a token that is part of a character decodes to the
    replacement character, its bytes do not). The tiny byte-level BPE vocabulary has no two tokens alike."""
    cache = tok.__dict__.setdefault("_test_ids_by_bytes", {})
    if not cache:
        _, raw = logprobs.Tokens(tok, len(tok), set()).table(np.arange(len(tok)))
        for i, hexed in enumerate(raw):
            cache.setdefault(bytes.fromhex(hexed), i)
    return cache


@pytest.mark.parametrize("vocab", [151936, 50_001, 640], ids=["qwen", "partial-chunk", "small"])
def test_the_chunked_top_k_gives_torchs_top_k_values(vocab):
    """logprobs.top_k (one max per chunk, then the top k of the best k chunks) gives torch.topk's values, most
    likely first, and ids that hold them: bf16 logits with many ties, a masked (-inf) column, a vocabulary that
    is no multiple of the chunk, and one small enough for the plain topk."""
    torch.manual_seed(0)
    logits = (torch.randn(6, vocab) * 3).to(torch.bfloat16)
    logits[0, 5] = logits[1, -1] = float("-inf")
    logits[2, -1] = 100.0  # the largest value in the last, partial chunk
    for k in (1, 5, 20):
        values, ids = logprobs.top_k(logits, k)
        assert torch.equal(values, logits.topk(k, dim=-1).values)
        assert torch.equal(logits.gather(1, ids), values) and all(len(set(row)) == k for row in ids.tolist())
    assert logprobs.top_k(logits, 5)[1][2, 0] == vocab - 1


LSE_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from worker.engines import logprobs
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for rows, vocab in ((3, 5000), (2, 2048), (2, 1)):
        x = (torch.randn(rows, vocab) * 4).to(dtype)
        x[0, :3] = float("-inf")
        got, want = logprobs.logsumexp(x), torch.logsumexp(x.float(), dim=-1)
        assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-4), (dtype, vocab, got, want)
x = torch.full((2, 3000), float("-inf"))
x[1, 2999] = 5.0
assert logprobs.logsumexp(x).tolist() == [float("-inf"), 5.0]
print("logsumexp ok")
"""


def test_the_logsumexp_kernel_matches_torch_in_the_interpreter():
    """The Triton logsumexp (Triton's CPU interpreter) equals torch's in fp32 for fp32 and fp16 rows of any width:
    several blocks, exactly one, one column; masked (-inf) columns; a row with nothing but -inf. (bf16 is misread
    by the interpreter; on the H200 ops/bench/gen.py g1lp checks the logprobs against a forward pass.)"""
    pytest.importorskip("triton")
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", LSE_SCRIPT, root],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        timeout=300,
    )
    assert out.returncode == 0 and "logsumexp ok" in out.stdout, out.stderr[-3000:]


PICK_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from core import logprob_store
from tests.test_engine_structured import FORMAT, check, make_spec, row, run
from worker.engines import decode_attention as da, grammar, slot_state
from worker.loader import load
grammar.FUSED_PICK = True
assert grammar.fused_pick(torch.device("cpu"))
grammar.PICK_BLOCK = 64  # several blocks a row
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):  # the interpreter misreads bf16 (grammar_step.py checks it on a GPU)
    for rows, vocab in ((6, 5000), (4, 64), (4, 33), (2, 1)):  # many blocks, one, a partial word
        bits = torch.randint(-2**31, 2**31 - 1, (rows, grammar.words(vocab)), dtype=torch.int32)
        x = torch.randn(rows, vocab).to(dtype)
        bits[0] = -1  # all allowed
        bits[1] = 0  # none allowed: token 0, as torch's argmax of all -inf
        if rows > 2:
            x[2] = -float("inf")  # allowed, but all -inf: token 0 too
        if rows > 3 and vocab > 40:  # ties, within a block and across blocks: the first allowed one wins
            bits[3] = -1
            x[3, [7, 40, vocab - 1]] = 10.0
        if rows > 4:
            bits[4, :] = 0
            bits[4, -1] = 1 << ((vocab - 1) % 32)  # only the last token allowed
        want = grammar.apply(x, bits).argmax(dim=-1)
        out = torch.full((rows,), -1, dtype=torch.long)
        assert grammar.masked_argmax(x, bits, out) is out and torch.equal(out, want), (dtype, vocab, out, want)
        if rows > 4:
            assert out[4] == vocab - 1 and out[1] == 0 and (vocab <= 40 or out[3] == 7), out
loaded = load(make_spec(sys.argv[2]), gpus=0)
slot_state.CPU_SLOTS = 3
da.TARGET_PROGRAMS = 1  # one program per row and head: the interpreter runs each in Python
spec = make_spec(sys.argv[2], engine="fast", max_new_tokens=16, response_format=FORMAT)
picks = []
masked_argmax = grammar.masked_argmax
grammar.masked_argmax = lambda *args: picks.append(1) or masked_argmax(*args)
plain = [(0, row("hello")), (1, row("the sky")), (2, row("is it?", guided_choice=["yes", "no"]))]
# every step of this batch reads logprobs
with_logprobs = [(0, row("hello", logprobs=True)), (1, row("is it?", guided_choice=["yes", "no"], logprobs=True))]
got = {}
for fused in (True, False):
    grammar.FUSED_PICK = fused
    del picks[:]
    slot_state.release(loaded.model)
    results = run(loaded, spec, plain)
    assert bool(picks) == fused, len(picks)  # the fused pick ran every greedy constrained step, or never
    check({i: r for i, r in results.items() if i < 2})
    assert results[2].output in ("yes", "no"), results[2].output
    del picks[:]
    slot_state.release(loaded.model)
    lp = run(loaded, spec, with_logprobs)
    assert not picks  # a step that reads logprobs masks a copy and takes torch's argmax
    got[fused] = {i: r.output for i, r in results.items()}, [logprob_store.render(lp[i].logprobs) for i in (0, 1)]
assert got[True][0] == got[False][0], got
for i in (0, 1):
    a, b = ([e["logprob"] for e in got[k][1][i]] for k in (True, False))
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)
print("fused pick ok")
"""


def test_the_fused_greedy_pick_equals_mask_then_argmax_in_the_interpreter(tiny_model):
    """grammar.masked_argmax (FUSED_PICK's Triton kernel, in Triton's CPU interpreter) picks the token that masking
    the logits and taking torch's argmax picks: in fp32 and fp16, over many blocks a row, one, and a vocabulary that
    ends inside a word; the first of tied logits, within a block and across blocks; token 0 where nothing allowed is
    above -inf; the last token where only it is allowed. The fast engine gives the same constrained greedy outputs
    with it as without, uses it on every greedy constrained step, and never where a step reads logprobs."""
    interpreted(PICK_SCRIPT, "fused pick ok", tiny_model, timeout=600)


def test_the_g1json_benchmark_reports_each_lever_it_times(tmp_path, tiny_model):
    """`ops/bench/gen.py g1json --smoke` (CPU, the tiny model) runs G1-JSON's interleaved rounds and writes what the
    device runs decide levers by: every round's seconds of each variant (the constrained run, one family, booked and
    picked the other way, each family on a thread of its own with and without the booking flipped, the masks
    computed while booking or after it, picked without the masks and checked, four families a thread, the compact
    JSON grammar, length-matched), their ratios, the grammar settings, and every output valid (the checked run's
    too). With `--tokenizer-size` (151936 on a GPU: a real tokenizer's mask cost) on a model linked beside the given
    one, whose own tokenizer stays as it was."""
    before = {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file()}
    got = gen_smoke("g1json", tmp_path, tiny_model, "--repeat", "2", "--tokenizer-size", "600")
    variants = ("constrained", "one_family", "other_advance", "other_pick", "other_threads", "other_threads_advance")
    variants += ("other_overlap", "other_check", "more_families", "compact", "length_matched")
    assert {name: len(got["g1json_seconds"][name]["runs"]) for name in variants} == dict.fromkeys(variants, 2)
    gains = (
        "families_gain",
        "other_advance_gain",
        "other_pick_gain",
        "other_threads_gain",
        "other_threads_advance_gain",
        "other_overlap_gain",
        "other_check_gain",
        "more_families_gain",
        "compact_gain",
    )
    gains += ("constrained/length_matched",)
    assert all(got["ratios"][name] > 0 for name in gains), got["ratios"]
    settings = {"families": grammar.FAMILIES, "parallel_advance": grammar.PARALLEL_ADVANCE}
    settings |= {"fused_pick": grammar.FUSED_PICK, "family_threads": grammar.FAMILY_THREADS}
    assert got["grammar"] == {**settings, "overlap": grammar.OVERLAP, "check_first": grammar.CHECK_FIRST}
    assert got["correctness"]["g1json_valid"]["passed"], got["correctness"]
    check_first = got["correctness"]["check_first"]
    assert check_first["passed"] and check_first["valid"] == check_first["not_truncated"] > 0, check_first
    checked = "constrained_1" if grammar.CHECK_FIRST else "other_check_1"
    assert got["engine"][checked]["grammar_refused"] > 0  # the tiny model writes no JSON of its own
    assert got["tokenizer_size"] == 600 and len(AutoTokenizer.from_pretrained(tiny_model)) == 640
    assert {p.name: p.read_bytes() for p in tiny_model.iterdir() if p.is_file()} == before


def test_the_check_first_benchmark_times_a_model_that_follows_its_schema(tmp_path):
    """`ops/bench/check_first.py` builds a tiny model that memorized objects of G1-JSON's schema, with the larger
    tokenizer `--tokenizer-size` asks for, and times the fast engine masked, with CHECK_FIRST, with it but no
    per-row give-up, and unconstrained: the model writes what the schema allows, so every checked token passes and
    no step computes a mask; every output is valid, the memorized answer, and the same every way; the constrained
    runs' output tok/s are given against the unconstrained run's."""
    model, out = tmp_path / "model", tmp_path / "check-first.json"
    proc = subprocess.run(
        [sys.executable, "ops/bench/check_first.py", "--model", str(model), "--tokenizer-size", "700"]
        + ["--answers", "4", "--rows", "24", "--slots", "8", "--repeat", "1", "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["correctness"]["passed"] and got["correctness"]["same_outputs"] == 24, got["correctness"]
    for way in ("masked", "check_first", "rows_kept", "unconstrained"):
        assert got["correctness"][way] == {"valid": 24, "memorized": 24, "rows": 24}, way
    unconstrained = got["runs"]["unconstrained_1"]
    assert unconstrained["mask_s"] == 0 and unconstrained["grammar_checked"] is None, unconstrained
    rates = got["output_tok_s"]
    assert got["constrained_vs_unconstrained"] == round(
        rates["check_first"]["median"] / rates["unconstrained"]["median"], 3
    )
    assert got["masked_vs_unconstrained"] > 0
    masked, checked = got["runs"]["masked_1"], got["runs"]["check_first_1"]
    assert masked["mask_s"] > 0 and masked["grammar_checked"] is None, masked
    assert checked["mask_s"] == 0 and checked["grammar_refused"] == 0 and checked["grammar_checked"] > 24, checked
    assert got["row_give_up_gain"] > 0 and got["row_give_up"] == grammar.CHECK_ROW_GIVE_UP and not got["compact"]
    assert got["tokenizer_size"] == 700 == len(AutoTokenizer.from_pretrained(model))


def test_logprobs_work_where_the_install_has_no_triton():
    """Without triton (CPU builds of torch may lack it) the engines still import, and the logsumexp is torch's."""
    script = (
        "import sys; sys.modules['triton'] = None; sys.path.insert(0, sys.argv[1]); import torch; "
        "from worker.engines import logprobs, fastgen; x = torch.randn(2, 300); "
        "assert logprobs.triton is None and torch.equal(logprobs.logsumexp(x), torch.logsumexp(x, dim=-1)); "
        "print('no triton ok')"
    )
    root = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "no triton ok" in out.stdout, out.stderr[-3000:]


def test_fast_engine_logprobs_outlive_the_ring_rows_later_steps_reuse(loaded, tiny_model, slots, monkeypatch):
    """The fast engine copies each decode step's log-probabilities into a ring of host rows, one per step, that
    later steps reuse: with 2 slots, 6 rows of 10 tokens take 27 steps through a 14-row ring, and every
    row's logprobs still equal its own forward pass (EOS masked: the rows ignore it to run 10 tokens each)."""
    slots(2)
    puts, rings = [], []
    real_put, real_init = logprobs.Ring.put, logprobs.Ring.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        rings.append(self)

    def put(self, step, *args):
        puts.append(step)
        return real_put(self, step, *args)

    monkeypatch.setattr(logprobs.Ring, "__init__", init)
    monkeypatch.setattr(logprobs.Ring, "put", put)
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=10, logprobs=True, top_logprobs=2, ignore_eos=True)
    results = run(loaded, spec, [(i, row(p)) for i, p in enumerate(PROMPTS[:6])], batch_rows=6)
    assert len(rings) == 1 and max(puts) > rings[0].rows + 10  # most of the ring's rows were reused
    tok = loaded.tokenizer
    for i, prompt in enumerate(PROMPTS[:6]):
        entries = logprob_store.render(results[i].logprobs)
        assert len(entries) == 10
        tokens = [_ids_by_bytes(tok)[bytes(e["bytes"])] for e in entries]
        got = torch.tensor([e["logprob"] for e in entries])
        assert torch.allclose(got, forward_logprobs(loaded, prompt, tokens, no_eos=True), atol=1e-3), (i, got)
        assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_logprobs_with_a_constraint_are_the_unmasked_distribution(loaded, tiny_model):
    """A constrained row's logprobs are the model's own (the grammar mask is applied after they are read): a
    forward pass gives the same numbers, and the chosen tokens' logprobs are not renormalized over the allowed
    ones (a choice's first token has a logprob below 0 though the grammar allowed only two tokens)."""
    spec = make_spec(tiny_model, engine="fast", max_new_tokens=8, logprobs=True, guided_choice=["yes", "no"])
    r = run(loaded, spec, [(0, row("is it?"))])[0]
    assert r.output in ("yes", "no")
    entries = logprob_store.render(r.logprobs)
    tokens = [_ids_by_bytes(loaded.tokenizer)[bytes(e["bytes"])] for e in entries]
    want = forward_logprobs(loaded, "is it?", tokens)
    assert torch.allclose(torch.tensor([e["logprob"] for e in entries]), want, atol=1e-3)
    assert entries[0]["logprob"] < -0.01


def test_nothing_extra_runs_when_no_row_asks(loaded, tiny_model, slots):
    """Cost when off: a batch that asks for neither constraint nor logprobs gets no logits processor in
    `generate`, and the fast engine runs its plain decode step (no per-slot outputs allocated, no step variant)."""
    assert common.Extras(loaded, [{"max_new_tokens": 4}] * 3).processors() == []
    slots(4)
    calls = []
    real = fastgen.Engine._decode

    def spy(self, batch, sample, extras=(), phase=None):
        calls.append(extras)
        return real(self, batch, sample, extras, phase)

    fastgen.Engine._decode = spy
    try:
        run(
            loaded, make_spec(tiny_model, engine="fast", max_new_tokens=6), [(i, row(p)) for i, p in enumerate(PROMPTS)]
        )
        state = loaded.model.__dict__["_gpujobs_fast"]
        assert calls and set(calls) == {()} and state.outputs == {}
        run(loaded, make_spec(tiny_model, engine="fast", max_new_tokens=6, logprobs=True), [(0, row("hello"))])
        assert ("logprobs",) in calls and set(state.outputs) == {"picked", "values", "ids"}
    finally:
        fastgen.Engine._decode = real
