"""Temperature sampling draws from the model's distribution, on the fast engine and on plain `generate` (the padded
engine): a goodness-of-fit test of the first and second sampled tokens against softmax(logits / T) computed
exactly from the model, on the tiny model's small vocabulary, on CPU. Seeds are fixed, so the test is
deterministic; the threshold is the chi-square critical value at p = 1e-4.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch

from core.spec import GenerateSpec
from worker.engines import common, fastgen, slot_state
from worker.loader import load

TEMPERATURE = 1.5
SAMPLES = 1200
PROMPT = "What is"


def chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square value exceeded with probability ~1e-4 (z of 1e-4), by the Wilson-Hilferty approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def fit(counts: collections.Counter, probs: torch.Tensor, min_expected: float = 8.0) -> tuple[float, float]:
    """Pearson's chi-square of `counts` against `probs`, tokens with fewer than `min_expected` expected draws
    pooled into one cell; returns (statistic, critical value)."""
    n = sum(counts.values())
    expected = probs * n
    big = [t for t in range(len(probs)) if expected[t] >= min_expected]
    stat = sum((counts.get(t, 0) - expected[t].item()) ** 2 / expected[t].item() for t in big)
    rest_e = n - sum(expected[t].item() for t in big)
    rest_o = n - sum(counts.get(t, 0) for t in big)
    cells = len(big)
    if rest_e >= 1:
        stat += (rest_o - rest_e) ** 2 / rest_e
        cells += 1
    return stat, chi2_critical(cells - 1)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load(GenerateSpec.model_validate({"model": str(tiny_model), "input": "file_x"}), gpus=0)


def draws(loaded, tiny_model, engine: str) -> list[list[int]]:
    """SAMPLES continuations of the same prompt, two tokens each: through the fast engine (`fastgen.Engine`, as the
    worker runs it) or plain `model.generate` (top_k and top_p off: temperature alone)."""
    spec = GenerateSpec.model_validate(
        {
            "model": str(tiny_model),
            "input": "file_x",
            "engine": "fast",
            "temperature": TEMPERATURE,
            "max_new_tokens": 2,
            "ignore_eos": True,
        }
    )
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    torch.manual_seed(11)
    if engine == "generate":
        out = []
        with torch.inference_mode():
            for _ in range(SAMPLES // 200):
                y = loaded.model.generate(
                    torch.tensor([prompt] * 200),
                    attention_mask=torch.ones(200, len(prompt)),
                    do_sample=True,
                    temperature=TEMPERATURE,
                    top_k=0,
                    top_p=1.0,
                    max_new_tokens=2,
                    min_new_tokens=2,
                    pad_token_id=0,
                )
                out += y[:, len(prompt) :].tolist()
        return out
    rows = [(i, {"prompt": PROMPT, "params": {}, "extra": {}}) for i in range(SAMPLES)]
    seqs = [fastgen.Seq(p, 0) for p in common.prepare(loaded, spec, rows, 0.0)]
    state = slot_state.state_for(loaded.model, loaded.device, loaded.model.config.vocab_size)
    eng = fastgen.Engine(loaded, state, common.eos_ids(loaded), slots=16, graphs=False)
    with torch.inference_mode():
        return [s.tokens for finished in eng.run(seqs, lambda: False) for s in finished]


def exact(loaded, prefix: list[int]) -> torch.Tensor:
    """softmax(logits / T) of the next token after `prefix`, in float64, EOS excluded (both engines mask it: the
    rows ignore EOS, as min_new_tokens does for plain generate)."""
    with torch.inference_mode():
        logits = loaded.model(torch.tensor([prefix])).logits[0, -1].double().clone()
        logits[list(common.eos_ids(loaded))] = float("-inf")
    return torch.softmax(logits / TEMPERATURE, dim=-1)


@pytest.mark.parametrize("engine", ["fast", "generate"])
def test_temperature_samples_follow_the_models_distribution(loaded, tiny_model, engine, monkeypatch):
    """First tokens fit softmax(logits / T) of the prompt, and second tokens after the most frequent first token
    fit the distribution that follows it (the decode step's sampling), on the fast engine and on plain generate
    (which checks the test itself)."""
    monkeypatch.setattr(slot_state, "CPU_SLOTS", 16)
    slot_state.release(loaded.model)
    ids = draws(loaded, tiny_model, engine)
    assert len(ids) == SAMPLES and all(len(t) == 2 for t in ids)
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    first = collections.Counter(t[0] for t in ids)
    stat, critical = fit(first, exact(loaded, prompt))
    assert stat < critical, (engine, "first token", stat, critical)
    top, _ = first.most_common(1)[0]
    second = collections.Counter(t[1] for t in ids if t[0] == top)
    assert sum(second.values()) >= 200, "enough draws after the most frequent first token"
    stat, critical = fit(second, exact(loaded, prompt + [top]))
    assert stat < critical, (engine, "second token", stat, critical)
    wrong = exact(loaded, prompt).roll(7)  # the test can fail: a distribution that is not the model's is refused
    assert fit(first, wrong)[0] > fit(first, wrong)[1]
    slot_state.release(loaded.model)


def _sampled_outputs(tmp_path, prompts: list[str], name: str, **spec) -> dict[str, str]:
    """Run one sampled generation job over `prompts` through the worker; its outputs by custom_id."""
    import json

    from api import service, views
    from core.db import session_scope
    from core.models import JobRow
    from tests.conftest import wait_for

    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"custom_id": p, "prompt": p}) + "\n" for p in prompts))
    job = service.submit(
        owner="alice",
        spec_data={
            "model": spec.pop("model"),
            "input": str(data),
            "gpus": 0,
            "temperature": 1.5,
            "max_new_tokens": 6,
            "ignore_eos": True,
            **spec,
        },
    )
    done = wait_for(
        lambda: (j := views.get(job["id"], owner=None))["state"] in ("succeeded", "failed") and j,
        300,
        f"job {job['id']}",
    )
    assert done["state"] == "succeeded" and done["rows"]["failed"] == 0, done
    with session_scope() as session:
        return {r.custom_id: r.output for r in session.query(JobRow).filter(JobRow.job_id == job["id"])}


def test_a_seed_repeats_samples_for_the_same_engine_and_batching_and_per_row_with_padded_batch_rows_1(
    tmp_path, jobs_env, spawn_worker, tiny_model
):
    """What README's "What a seed promises" says: the same seed, engine, rows and batching give the same samples;
    with engine padded and batch_rows 1 a row's samples do not depend on the other rows of the job."""
    spawn_worker([])
    prompts = ["What is", "The capital of France is", "Spiders have", "Hello"]
    spec = dict(model=str(tiny_model), seed=7, engine="padded")
    first = _sampled_outputs(tmp_path, prompts, "a", **spec)
    assert _sampled_outputs(tmp_path, prompts, "b", **spec) == first
    alone = dict(spec, batch_rows=1)
    together = _sampled_outputs(tmp_path, prompts, "d", **alone)
    by_itself = _sampled_outputs(tmp_path, prompts[2:3], "e", **alone)
    assert by_itself["Spiders have"] == together["Spiders have"]
    assert len(set(together.values())) > 1  # sampled: the rows are not all the same text


def warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What transformers' `generate` samples from: its warpers in its order (temperature, top_k, top_p), softmaxed."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = logits[None].double() / temperature
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)[0]


def test_top_k_1_and_a_tiny_top_p_pick_the_argmax_and_greedy_rows_stay_greedy():
    """The filtered pick (`fastgen.Engine._pick` with top_k/top_p) of top_k 1, or of a top_p too small for a second
    token, is the argmax, whatever the draw; a greedy row (temperature 0) beside them stays the argmax."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(60, 100, generator=gen) * 3
    top_k = torch.tensor([1, 0, 1] * 20)
    top_p = torch.tensor([1.0, 1e-4, 0.5] * 20)
    temp = torch.tensor([1.0, 2.0, 0.0] * 20)
    for seed in range(5):
        torch.manual_seed(seed)
        assert torch.equal(fastgen.Engine._pick(logits, temp, True, top_k, top_p), logits.argmax(dim=-1))


def test_top_k_and_top_p_samples_follow_transformers_warpers_each_row_with_its_own():
    """Rows of one batch, each with its own top_k and top_p (ties at the k-th value, a grammar-masked row), sample
    from the distribution transformers' TemperatureLogitsWarper, TopKLogitsWarper then TopPLogitsWarper leave:
    tokens they filter out are never drawn, and the counts fit the rest (chi-square at p = 1e-4, seeded)."""
    base = torch.tensor([2.0, 1.5, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0])
    masked = base.clone()
    masked[[0, 4]] = float("-inf")  # a grammar's mask: -inf before the pick
    temperature, draws = 0.8, 4000
    # (logits, top_k, top_p): off, a tie at the k-th value (3 kept), top_p alone (3, 5 kept), both (3, 5 kept),
    # both and top_p alone over the tokens a mask left (2, 3 kept)
    cases = [(base, 0, 1.0), (base, 2, 1.0), (base, 0, 0.6), (base, 0, 0.9), (base, 4, 0.8), (base, 6, 0.95)]
    cases += [(masked, 3, 0.7), (masked, 0, 0.85)]
    logits = torch.stack([c[0] for c in cases] * draws)
    top_k = torch.tensor([c[1] for c in cases] * draws)
    top_p = torch.tensor([c[2] for c in cases] * draws)
    torch.manual_seed(5)
    picked = fastgen.Engine._pick(logits, torch.full((len(logits),), temperature), True, top_k, top_p)
    kept = []
    for i, (row, k, p) in enumerate(cases):
        want = warped(row, temperature, k, p)
        counts = collections.Counter(picked[i :: len(cases)].tolist())
        assert all(want[t] > 0 for t in counts), (k, p, "a filtered token was drawn", counts)
        stat, critical = fit(counts, want)
        assert stat < critical, (k, p, stat, critical)
        kept.append(int((want > 0).sum()))
    assert kept == [10, 3, 3, 5, 3, 5, 2, 3]  # the cases filter what their comments say
    unfiltered = collections.Counter(picked[2 :: len(cases)].tolist())  # the test can fail: top_p 0.6's draws do
    assert fit(unfiltered, warped(base, temperature, 0, 1.0))[0] > 100  # not fit the unfiltered distribution
