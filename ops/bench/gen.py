"""Generation workloads G1 and G2 (DESIGN.md, issue 6) on one GPU: the fast engine alone, through the whole service,
its correctness, and plain-transformers baselines, all in one run so the ratios compare like with like.

    python ops/bench/gen.py g1 --out ops/bench/results/g1.json     # on the H200, from the repo root
    python ops/bench/gen.py g2 --out ops/bench/results/g2.json
    python ops/bench/gen.py g1 --slow ...                          # also transformers' generate_batch defaults
    python ops/bench/gen.py g1 --smoke --out /tmp/g1-smoke.json    # CPU: tiny model, a few rows, every step
    python ops/bench/gen.py g1json --out ops/bench/results/g1json.json  # structured outputs vs G1 (issue 26)
    python ops/bench/gen.py g1lp --out ops/bench/results/g1lp.json      # logprobs (top 5) on vs off on G1
    python ops/bench/gen.py g1kv --out ops/bench/results/g1kv.json      # kv_cache_dtype fp8 and int8 vs auto

Workloads (Qwen3-0.6B architecture, random bf16 weights, EOS off, greedy; the benchmark model's tokenizer has 640
tokens: `--tokenizer-size 151936` puts a byte-level BPE of ~59k in its place, whose grammar masks cost what a real
tokenizer's do, 4-5x the 640-token one's; `tokenizer_size` in the JSON):
- G1: 1024 prompts × 256 input tokens, 256 output tokens each.
- G2: 2048 prompts, input lengths uniform in 32–1024, outputs uniform in 16–512 (per-row `max_new_tokens`).
- G3: 1024 prompts of one shared 1,024-token instruction and a unique 64-token part, 128 output tokens: the engine
  with its prefix cache off, on, and on without the cascade decode (`fastgen.CASCADE` off: the shared pages read
  per row), interleaved `--repeat` times (rows/s, outputs equal: `prefix_cache`); each run with the cache on starts
  from an empty cache (it reuses what its own rows share, not the previous run's prompts).
- G1-JSON (`g1json`): G1's rows, each constrained by SCHEMA_G1JSON (a string, an integer, an enum), EOS on (the
  grammar ends each output), up to 256 tokens. Engine alone, in one child process, warm runs: unconstrained G1
  (tok/s), the constrained run (its valid fraction of the outputs not cut by max_new_tokens, checked by
  `valid_g1json`, and tok/s), and the same rows unconstrained with each row's max_new_tokens set to the length of
  its constrained output (EOS off: same tokens, same prefill), whose seconds over the constrained run's isolate
  what the grammar costs (`ratios.constrained/length_matched`); `ratios.constrained/g1` is the tok/s ratio the
  issue names (shorter outputs make prefill weigh more there). The constrained run again with its matchers in one
  family (`grammar.FAMILIES` = 1, the engine before families) gives `ratios.families_gain`, and booked the other
  way (`grammar.PARALLEL_ADVANCE` flipped: every row's matcher advanced by the executor in one call, or row by row)
  `ratios.other_advance_gain` (> 1: the other way is faster), and picked the other way (`grammar.FUSED_PICK`
  flipped: one Triton kernel for the mask and the argmax, or the mask then torch's argmax)
  `ratios.other_pick_gain`, and with each family on an executor and a thread of its own or not
  (`grammar.FAMILY_THREADS` flipped) `ratios.other_threads_gain`, also with the booking flipped
  `ratios.other_threads_advance_gain`, and with each family's masks computed while the next family is booked or
  after the whole booking (`grammar.OVERLAP` flipped) `ratios.other_overlap_gain`, and picked without the masks
  and checked when booked or not (`grammar.CHECK_FIRST` flipped) `ratios.other_check_gain` (its outputs against the
  constrained run's: `correctness.check_first`), and with four families a thread (`grammar.FAMILIES` = 4 ×
  THREADS) `ratios.more_families_gain`, and with the compact JSON grammar (no space between tokens; ours allows
  one) `ratios.compact_gain` (in tok/s: the outputs may differ in length). These runs and the length-matched run
  are interleaved `--repeat` times; the ratios are of their median seconds (`g1json_seconds`: each one's runs,
  median and spread).
- `g1lp`: G1 with logprobs on (top_logprobs 5) vs off, both warm, in one child process (`ratios.logprobs_on/off`).
- `g1kv`: G1 with `kv_cache_dtype` auto, fp8 and int8, each quantized type's cold run, then warm runs of the
  three interleaved `--repeat` times, in one child process (`ratios.fp8/auto`, `ratios.int8/auto`: median tok/s;
  `g1kv_tok_s`: each one's runs and spread; `engine.*.pages`: the rows the cache holds);
  `correctness.<kind>_greedy_vs_generate`: the memorized model's greedy outputs with that cache against plain
  `generate`; `kv_same_as_auto.<kind>`: how many of G1's random-model outputs equal auto's, and
  `kv_logits_vs_generate.<kind>`: the per-step logits with that cache against plain `generate` (step 1c's check;
  both informational, not checks: a random model's logits are near ties).
  These three run only step 1's engine runs (no baselines, no service).

Steps (each in its own time box; a step that would not fit is listed under `skipped`):
1. In a child process (it releases the GPU before the service starts):
   a. correctness, greedy: the fast engine vs plain `generate` on the tiny memorized model (96 rows);
   b. engine: `worker.generate.generate(engine=fast)` over the workload's rows, 1 + `--repeat` times, each run on
      prompts of its own (`workload`'s `run`: the same lengths, no page another run could have left in the prefix
      cache): the first run pays the preparation (compile, CUDA-graph captures; reported as `cold`), the median of
      the others is `engine.output_tok_s` (`engine.warm_runs`: each run, the median and the spread (max - min) /
      median); then the other workload and this one again on the same resident state, and both on a fresh state:
      the outputs must be equal (`correctness.resident_equals_fresh`; issue 12's stall came from a second large run);
   c. correctness, logits: 64 of the workload's rows inside a batch of the engine's slot count, teacher-forced
      along plain `generate`'s greedy tokens for 8 steps: per-step logits within a bf16 tolerance;
   d. baselines: plain `generate` padded (batches of 256), and for G1 `generate(cache_implementation="static")`
      at batch 1024 (transformers compiles it; compile time reported apart); `--slow`: `generate_batch` defaults;
   e. the peer a user tries first (unless `--no-peer`): transformers' continuous batching as its docs recommend
      (no_grad, a cache sized for the GPU, max_batch_tokens set), in its own `--peer-s` time box; a run the box
      cuts records the rate it reached (`run_peer`).
2. The service: `gpujobs up --gpus 0`, a warm-up job (loads the model, captures graphs), a small second job
   (warm start: seconds from submit to its first committed row), then the workload `--repeat` times, each as one
   job of one shard on prompts of its own (as in 1b; while the next fits the `--service-s` box):
   `service.output_tok_s` is the median,
   `service.runs` each run, the median and the spread. Throughput of a job = Σ completion_tokens ÷ (last row
   committed − first shard started), read from SQL. Unless `--no-restart`, the stack is then restarted and the small
   job sent again: `restart_warm_up` is a fresh worker's first job on a model it compiled before (the compile cache
   under JOBS_HOME); `warm_up` is the first ever (cold, unless JOBS_HOME's cache already had it), `warm_start` the
   resident model. Each records `prepared` (compile and capture seconds, the compile cache's hits and misses).

The bound is computed from the dataset alone: Σ over rows and decode steps of the row's real context × the KV
bytes per token (112 KiB for this model), plus the weight bytes once per decode step of a full batch of 1024, at
4.3 TB/s (measured on the H200): the yardstick's bound on any GPU. On another GPU model whose rate was measured
(`RATES`: an H100's 3.07 TB/s) `bound_here` is the same sum at that rate, with `ratios.service/bound_here`.
Writes `{"g1": {...}}` (or g2) with `service.output_tok_s`, `engine.output_tok_s`, `baselines.*`, `bound_tok_s`,
`correctness.*`, `ratios`, job ids, commit and device; prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ops.bench import harness  # after the repository root is on sys.path

BANDWIDTH = 4.3e12  # bytes/s, measured on the H200 (issue 6): the yardstick's bound, whatever GPU runs
RATES = {  # bytes/s SDPA's decode attention read at G1's shapes (decode_kernel.py), per GPU model: `bound_here`
    "H200": BANDWIDTH,
    "H100": 3.07e12,  # H100 80GB HBM3, batch 1,024 x context 512 (results/2026-12-06-h100-session46)
}
COMPARISONS = ("g1json", "g1lp", "g1kv")  # G1's rows in other settings, compared in one child process
QUANTIZED_KV = ("fp8", "int8")  # the quantized kv_cache_dtype values g1kv times against auto
FULL_BATCH = 1024
SEED = harness.SEED
log = harness.logger("gen")


# --- workloads -----------------------------------------------------------------------------------------------


def workload(name: str, tok, smoke: bool, run: int = 0) -> list[tuple[str, int]]:
    """(prompt text, max_new_tokens) per row; prompts are one-token words, so a prompt of n words is n tokens.

    `run` > 0: the same rows with every word swapped through a permutation of the words drawn for that run. The
    lengths, and the prefixes rows share (G3's instruction), stay; the prompts are ones no other run sent. The
    repeated runs of a workload each take their own `run`: on a resident engine the prefix cache would otherwise
    serve a run's prompts from an earlier run's pages (G1's second run skipped 3/4 of its prefill on 2026-12-06),
    which no user running a dataset once gets."""
    rng = random.Random(SEED)
    words = harness.one_token_words(tok)
    swap = dict(zip(words, random.Random(f"{SEED}:{run}").sample(words, len(words)))) if run else {}

    def text(count: int) -> str:
        return "".join(swap.get(w, w) for w in (rng.choice(words) for _ in range(count)))

    if name in ("g1", *COMPARISONS):
        n, lengths = (24, [(16, 96 if name == "g1json" else 16)]) if smoke else (1024, [(256, 256)])
        return [(text(i), o) for i, o in lengths * n]
    if name == "g3":  # one shared instruction, then a unique part (issue 26: a shared prefix computed once)
        n, shared, unique, out = (16, 130, 8, 8) if smoke else (1024, 1024, 64, 128)
        instruction = text(shared)
        return [(instruction + text(unique), out) for _ in range(n)]
    n, (lo_in, hi_in), (lo_out, hi_out) = (32, (4, 40), (2, 24)) if smoke else (2048, (32, 1024), (16, 512))
    return [(text(rng.randint(lo_in, hi_in)), rng.randint(lo_out, hi_out)) for _ in range(n)]


def bound(config, rows: list[tuple[int, int]], dtype_bytes: int = 2, bandwidth: float = BANDWIDTH) -> dict:
    """The bandwidth bound of `rows` = [(prompt tokens, output tokens)] for this model config, reading at
    `bandwidth` bytes/s."""
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    params = _param_count(config)
    kv = sum(per_token * (p * o + o * (o - 1) // 2) for p, o in rows)  # contexts p, p+1, …, p+o-1
    outputs = sum(o for _, o in rows)
    steps = outputs / min(len(rows), FULL_BATCH)
    weights = params * dtype_bytes * steps
    seconds = (kv + weights) / bandwidth
    return {
        "bound_tok_s": round(outputs / seconds, 1),
        "kv_bytes": kv,
        "weight_bytes": weights,
        "kv_bytes_per_token": per_token,
        "params": params,
        "output_tokens": outputs,
        "definition": "sum over rows and steps of context x KV bytes/token, plus weights once per step of a "
        f"full batch of {FULL_BATCH}, at {bandwidth / 1e12} TB/s",
    }


def _param_count(config) -> int:
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h + 2 * head_dim
    embed = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return layers * per_layer + embed + h


SCHEMA_G1JSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 48},
        "count": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
    },
    "required": ["name", "count", "kind"],
    "additionalProperties": False,
}


def valid_g1json(text: str) -> bool:
    """`text` is JSON valid against SCHEMA_G1JSON (checked by hand: the GPU image has no JSON Schema validator; the
    CPU tests check the engines with jsonschema_rs)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == {"name", "count", "kind"}
        and isinstance(value["name"], str)
        and len(value["name"]) <= 48
        and isinstance(value["count"], int)
        and not isinstance(value["count"], bool)
        and 0 <= value["count"] <= 1_000_000
        and value["kind"] in ("alpha", "beta", "gamma")
    )


def logprobs_check(loaded, rows: list, results: list) -> dict:
    """The stored logprobs of `results` (G1 rows, EOS ignored) against a plain forward pass over prompt + output,
    EOS masked as the engine's distribution has it: the largest difference, and whether it is within bf16's."""
    import base64

    import numpy as np
    import torch

    from core import logprob_store
    from worker.engines.common import eos_ids

    worst = 0.0
    prompts = dict(rows)
    for r in results:
        ids = np.frombuffer(base64.b64decode(r.logprobs["ids"]), dtype="<i4").tolist()
        got = torch.tensor([e["logprob"] for e in logprob_store.render(r.logprobs)])
        prompt = loaded.tokenizer(prompts[r.idx]["prompt"])["input_ids"]
        with torch.inference_mode():
            logits = loaded.model(torch.tensor([prompt + ids], device=loaded.model.device)).logits[0].float()
            logits[:, sorted(eos_ids(loaded))] = float("-inf")
            lsm = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) - 1 + len(ids)]
            want = lsm.gather(1, torch.tensor(ids, device=lsm.device)[:, None])[:, 0].cpu()
        worst = max(worst, (got - want).abs().max().item())
    return {"rows": len(results), "max_abs_diff": round(worst, 4), "passed": worst < 0.1}


def compare_runs(args: argparse.Namespace, loaded, rows: list, out: dict, box) -> None:
    """g1json, g1lp and g1kv (see the docstring): warm engine runs in this process, each timed alone."""
    import torch  # noqa: F401  (the child's torch, already imported)

    from core.spec import GenerateSpec
    from worker import generate as engine
    from worker.engines import grammar

    # prefix cache off: the runs repeat the same prompts on one resident engine, and later runs would read them
    # from the cache (their prefill skipped), which is not what these ratios compare
    base = {"model": str(args.model), "input": "x", "engine": "fast", "prefix_cache": "off"}

    def timed(name: str, spec_fields: dict, these: list) -> dict:
        spec = GenerateSpec.model_validate({**base, **spec_fields})
        info: dict = {}
        harness.sync()
        t = time.perf_counter()
        results = [r for b in engine.generate(loaded, spec, these, batch_rows=256, info=info) for r in b]
        harness.sync()
        seconds = time.perf_counter() - t
        tokens = sum(r.completion_tokens or 0 for r in results)
        run = {
            "rows": len(these),
            "output_tokens": tokens,
            "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 1),
            "failed": sum(r.error is not None for r in results),
            **{
                key: info.get("fast", {}).get(key)
                for key in (
                    *("steps", "prefill_s", "decode_s", "wait_s", "book_s", "mask_s", "caller_s", "cascade_steps"),
                    *("pages", "cache_gib", "kv_cache_dtype"),
                    *("grammar_checked", "grammar_refused", "grammar_check_stopped"),
                )
            },
        }
        out["engine"][name] = run
        log(f"{name}: {run['output_tok_s']:,.0f} output tok/s, {seconds:.2f} s, {tokens} tokens")
        run["_results"] = results
        return run

    plain = {"ignore_eos": True}
    for name in ("g1_cold", "g1"):
        box.run(name, 40, lambda name=name: timed(name, plain, rows))
    if args.workload == "g1kv":
        kinds = {"auto": plain, **{kind: {**plain, "kv_cache_dtype": kind} for kind in QUANTIZED_KV}}
        for kind in QUANTIZED_KV:  # each a new state: its cache and graphs
            box.run(f"{kind}_cold", 60, lambda kind=kind: timed(f"{kind}_cold", kinds[kind], rows))
        rates: dict[str, list[float]] = {kind: [] for kind in kinds}
        for i in range(max(1, args.repeat)):  # each switch makes a new state: the runs after it are its warm ones
            for kind, fields in kinds.items():
                box.run(f"{kind}_warm_up_{i + 1}", 60, lambda fields=fields: timed("_warm_up", fields, rows[:8]))
                if box.run(f"{kind}_{i + 1}", 60, lambda n=f"{kind}_{i + 1}", f=fields: timed(n, f, rows)):
                    rates[kind].append(out["engine"][f"{kind}_{i + 1}"]["output_tok_s"])
        out["engine"].pop("_warm_up", None)
        stats = {kind: harness.repeated(values) for kind, values in rates.items()}
        out["g1kv_tok_s"] = stats
        out["ratios"] = {
            f"{kind}/auto": round(stats[kind]["median"] / stats["auto"]["median"], 3)
            for kind in QUANTIZED_KV
            if stats[kind]["median"] and stats["auto"]["median"]
        }
        device, dtype = str(loaded.device.type), loaded.model.dtype
        for kind in QUANTIZED_KV:
            a, b = out["engine"].get("auto_1"), out["engine"].get(f"{kind}_1")
            if a and b:  # informational: no pass or fail
                auto_out = {r.idx: r.output for r in a["_results"]}
                same = sum(r.output == auto_out.get(r.idx) for r in b["_results"])
                out.setdefault("kv_same_as_auto", {})[kind] = {"rows": len(rows), "equal": same}

            def greedy(kind=kind) -> None:
                from worker.engines import slot_state

                slot_state.release(loaded.model)  # the last timed run's cache: room for the QA model's (OOM on an H100)
                check = harness.greedy_check(args.qa_model, "fast", device, dtype, kv_cache_dtype=kind)
                out["correctness"][f"{kind}_greedy_vs_generate"] = check
                log(f"greedy fast engine with an {kind} cache vs generate: {check['equal']}/{check['rows']} equal")

            box.run(f"{kind}_greedy", 40, greedy)

            def logits(kind=kind) -> None:  # how far the cache moves the logits (bf16's tolerance: no pass or fail)
                from worker.engines import fastgen, slot_state

                check = _logits_check(torch, fastgen, slot_state, loaded, rows, device, dtype, kv_cache_dtype=kind)
                drop = ("passed", "tolerance")
                out.setdefault("kv_logits_vs_generate", {})[kind] = {k: v for k, v in check.items() if k not in drop}
                log(
                    f"logits with an {kind} cache vs generate: max |diff| {check['max_abs_diff']:.4f} (|logit| up "
                    f"to {check['max_abs_logit']:.1f}), greedy tokens equal {check['greedy_tokens_equal']}/"
                    f"{check['of_tokens']}"
                )

            box.run(f"{kind}_logits", 30, logits)
    elif args.workload == "g1lp":
        lp = {**plain, "logprobs": True, "top_logprobs": 5}
        for name in ("logprobs_cold", "logprobs"):
            box.run(name, 40, lambda name=name: timed(name, lp, rows))
        box.run("g1_again", 40, lambda: timed("g1_again", plain, rows))
        on, off = out["engine"].get("logprobs", {}), out["engine"].get("g1", {})
        if on and off:
            out["ratios"] = {"logprobs_on/off": round(on["output_tok_s"] / off["output_tok_s"], 3)}
            entries = [(r.logprobs or {}).get("n") for r in on["_results"]]
            out["correctness"]["logprobs_entries"] = {
                "passed": entries == [r.completion_tokens for r in on["_results"]],
                "rows": len(entries),
            }
            out["correctness"]["logprobs_values"] = logprobs_check(loaded, rows, on["_results"][:8])
    else:
        fmt = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
        constrained = {"response_format": fmt}
        schema = {**SCHEMA_G1JSON, "x-guidance": {"whitespace_flexible": False}}
        compact = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": schema, "strict": True}}
        for name in ("constrained_cold", "constrained"):
            box.run(name, 60, lambda name=name: timed(name, constrained, rows))
        got = out["engine"].get("constrained")
        if got:
            results = sorted(got["_results"], key=lambda r: r.idx)
            cut = [r for r in results if r.finish_reason == "length"]
            ended = [r for r in results if r.error is None and r.finish_reason != "length"]
            valid = sum(valid_g1json(r.output) for r in ended)
            out["correctness"]["g1json_valid"] = {
                "passed": bool(ended) and valid == len(ended) and not got["failed"],
                "valid": valid,
                "not_truncated": len(ended),
                "truncated": len(cut),
                "valid_fraction": round(valid / len(ended), 4) if ended else None,
                "sample": [r.output for r in results[:3]],
            }
            log(f"g1json: {valid}/{len(ended)} valid outputs not cut by max_new_tokens ({len(cut)} cut)")
            matched = [
                (i, {**r, "params": {"max_new_tokens": max(1, res.completion_tokens or 1)}})
                for (i, r), res in zip(rows, results)
            ]
            # interleaved, --repeat times: the constrained run as the engine is, in one family (the engine before
            # families), booked, picked, threaded and overlapped the other way (grammar.PARALLEL_ADVANCE,
            # FUSED_PICK, FAMILY_THREADS, OVERLAP, CHECK_FIRST flipped), and the length-matched run
            variants = {
                "constrained": (constrained, rows, {}),
                "one_family": (constrained, rows, {"FAMILIES": 1}),
                "other_advance": (constrained, rows, {"PARALLEL_ADVANCE": not grammar.PARALLEL_ADVANCE}),
                "other_pick": (constrained, rows, {"FUSED_PICK": not grammar.FUSED_PICK}),
                "other_threads": (constrained, rows, {"FAMILY_THREADS": not grammar.FAMILY_THREADS}),
                "other_threads_advance": (
                    constrained,
                    rows,
                    {"FAMILY_THREADS": not grammar.FAMILY_THREADS, "PARALLEL_ADVANCE": not grammar.PARALLEL_ADVANCE},
                ),
                "other_overlap": (constrained, rows, {"OVERLAP": not grammar.OVERLAP}),
                "other_check": (constrained, rows, {"CHECK_FIRST": not grammar.CHECK_FIRST}),
                # four families a thread: rayon's threads would less often take rows of one family at once (they
                # contend for its mutex: 12 families on 12 threads were only 3.3x faster than one)
                "more_families": (constrained, rows, {"FAMILIES": 4 * grammar.THREADS}),
                # the JSON without the one space between tokens that core/structured.py allows (its output may
                # differ in length: compared in tok/s)
                "compact": ({"response_format": compact}, rows, {}),
                "length_matched": (plain, matched, {}),
            }
            seconds: dict[str, list[float]] = {name: [] for name in variants}
            tokens_of: dict[str, int] = {}
            for i in range(max(1, args.repeat)):
                for name, (fields, these, settings) in variants.items():
                    saved = {key: getattr(grammar, key) for key in settings}

                    def one(name=name, fields=fields, these=these, settings=settings, i=i) -> None:
                        for key, value in settings.items():
                            setattr(grammar, key, value)
                        run = timed(f"{name}_{i + 1}", fields, these)
                        seconds[name].append(run["seconds"])
                        tokens_of[name] = run["output_tokens"]

                    try:
                        box.run(f"{name}_{i + 1}", 60, one)
                    finally:
                        for key, value in saved.items():
                            setattr(grammar, key, value)
            stats = {name: harness.repeated(values) for name, values in seconds.items()}
            out["g1json_seconds"] = stats

            def ratio(a: str, b: str) -> float | None:  # median seconds of a over b
                x, y = stats[a]["median"], stats[b]["median"]
                return round(x / y, 3) if x and y else None

            def compact_gain() -> float | None:  # the compact grammar's tok/s over ours (medians)
                x, y = stats["compact"]["median"], stats["constrained"]["median"]
                if not (x and y and tokens_of.get("compact") and tokens_of.get("constrained")):
                    return None
                return round(tokens_of["compact"] / x / (tokens_of["constrained"] / y), 3)

            g1 = out["engine"].get("g1")
            tokens = got["output_tokens"]
            med = stats["constrained"]["median"]
            out["ratios"] = {
                "constrained/g1": g1 and med and round(tokens / med / g1["output_tok_s"], 3),
                "constrained/length_matched": ratio("length_matched", "constrained"),
                "one_family/length_matched": ratio("length_matched", "one_family"),
                "families_gain": ratio("one_family", "constrained"),
                "other_advance_gain": ratio("constrained", "other_advance"),
                "other_pick_gain": ratio("constrained", "other_pick"),
                "other_threads_gain": ratio("constrained", "other_threads"),
                "other_threads_advance_gain": ratio("constrained", "other_threads_advance"),
                "other_overlap_gain": ratio("constrained", "other_overlap"),
                "other_check_gain": ratio("constrained", "other_check"),
                "more_families_gain": ratio("constrained", "more_families"),
                "compact_gain": compact_gain(),
            }
            checked = out["engine"].get("other_check_1", {}).get("_results")
            if checked:  # greedy: the same tokens either way, but for near-ties a redone step's batch may flip
                mine = {r.idx: r.output for r in checked}
                same = sum(mine.get(r.idx) == r.output for r in results)
                ended = [r for r in checked if r.error is None and r.finish_reason != "length"]
                valid, failed = sum(valid_g1json(r.output) for r in ended), sum(r.error is not None for r in checked)
                out["correctness"]["check_first"] = {
                    "passed": bool(ended) and valid == len(ended) and not failed,
                    "same_outputs": round(same / len(results), 4),
                    "valid": valid,
                    "not_truncated": len(ended),
                    "failed": failed,
                }
            out["grammar"] = {
                "families": grammar.FAMILIES,
                "parallel_advance": grammar.PARALLEL_ADVANCE,
                "fused_pick": grammar.FUSED_PICK,
                "family_threads": grammar.FAMILY_THREADS,
                "overlap": grammar.OVERLAP,
                "check_first": grammar.CHECK_FIRST,
            }
            log(
                "g1json seconds, median (spread) of "
                + ", ".join(f"{n} {v['median']} ({v['spread']})" for n, v in stats.items())
            )
    for run in out["engine"].values():
        run.pop("_results", None)


# --- in-process steps (child) -------------------------------------------------------------------------------


def run_inproc(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.dump_traceback_later(args.budget_s + 5)  # every thread's stack before the parent's time box kills us
    import torch
    import transformers

    from core.spec import GenerateSpec
    from worker import generate as engine
    from worker.engines import fastgen, pages, slot_state
    from worker.loader import Loaded

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out: dict = {
        "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "engine": {},
        "baselines": {},
        "correctness": {},
        "errors": {},
        "skipped": [],
    }
    box = harness.TimeBox(args.budget_s, out, save=lambda: harness.write_json(args.child_out, out), log=log)
    step = box.run

    # a. greedy outputs on the memorized model: fast engine vs plain generate
    def greedy() -> None:
        check = harness.greedy_check(args.qa_model, "fast", device, dtype)
        out["correctness"]["greedy_fast_vs_generate"] = check
        log(f"greedy fast engine vs generate: {check['equal']}/{check['rows']} equal")

    if args.workload in COMPARISONS:
        model, tok = harness.load_plain(args.model, device, dtype)
        loaded = Loaded(model, tok, model.device, {})
        data = workload(args.workload, tok, args.smoke)
        rows = [(i, {"prompt": p, "params": {"max_new_tokens": o}}) for i, (p, o) in enumerate(data)]
        compare_runs(args, loaded, rows, out, box)
        harness.write_json(args.child_out, out)
        return 0

    step("greedy", 30, greedy)

    model, tok = harness.load_plain(args.model, device, dtype)
    model.generation_config.eos_token_id = None  # EOS off for the baselines (ours passes ignore_eos)
    loaded = Loaded(model, tok, model.device, {})
    data = workload(args.workload, tok, args.smoke)
    rows = [(i, {"prompt": p, "params": {"max_new_tokens": o}}) for i, (p, o) in enumerate(data)]
    spec = GenerateSpec(
        model=str(args.model), input="x", ignore_eos=True, engine="fast", kv_cache_dtype=args.kv_cache_dtype
    )

    # b. the engine alone: cold (pays the preparation), then --repeat warm runs (median and spread), each run on
    # prompts of its own (workload's `run`): the resident prefix cache serves none of them from an earlier run
    def engine_runs() -> None:
        warm = []
        for i in range(1 + args.repeat):
            name = "cold" if i == 0 else "warm"
            these = [
                (j, {**row, "prompt": p})
                for (j, row), (p, _) in zip(rows, workload(args.workload, tok, args.smoke, i + 1))
            ]
            info: dict = {}
            harness.reset_peak()
            harness.sync()
            t = time.perf_counter()
            tokens = sum(
                r.completion_tokens or 0
                for b in engine.generate(loaded, spec, these, batch_rows=256, info=info)
                for r in b
            )
            harness.sync()
            seconds = time.perf_counter() - t
            run = {
                "rows": len(rows),
                "output_tokens": tokens,
                "seconds": round(seconds, 3),
                "output_tok_s": round(tokens / seconds, 1),
                "peak_memory_bytes": harness.peak(),
                "info": info,
            }
            if i == 0:
                out["engine"]["cold"] = run
            else:
                warm.append(run)
            log(
                f"engine fast ({name}): {tokens / seconds:,.0f} output tok/s, {seconds:.2f} s, "
                f"{info.get('fast', {}).get('steps')} steps, capture {info.get('fast', {}).get('capture_s')} s, "
                f"prefix tokens reused {info.get('fast', {}).get('prefix_tokens_reused')}"
            )
        stats = harness.repeated([w["output_tok_s"] for w in warm])
        out["engine"]["warm"] = min(warm, key=lambda w: abs(w["output_tok_s"] - stats["median"]))  # the median run
        out["engine"]["warm_runs"] = stats
        out["engine"]["output_tok_s"] = stats["median"]
        log(
            f"engine fast (warm): median {stats['median']:,.0f} tok/s over {len(warm)} runs, spread {stats['spread']:.1%}"
        )

    # b1. G3: the prefix cache on and off, interleaved, on the resident engine; outputs must be equal
    def prefix_compare() -> None:
        off_spec = spec.model_copy(update={"prefix_cache": "off"})
        modes = (("off", off_spec, True), ("auto", spec, True), ("no_cascade", spec, False))
        rates: dict[str, list[float]] = {mode: [] for mode, _, _ in modes}
        outputs: dict[str, dict] = {}
        reused, cascade_steps = {}, {}
        for s in (off_spec, spec):  # untimed: they pay the preparation and the cascade's kernel and graph
            for _ in engine.generate(loaded, s, rows, batch_rows=256):
                pass
        try:
            for _ in range(args.repeat):
                for mode, s, cascade in modes:
                    fastgen.CASCADE = cascade
                    if s is spec:  # an empty prefix cache: each run reuses only what its own rows share
                        state = model.__dict__["_gpujobs_fast"]
                        state.pool = pages.Pool(state.pool.count)
                    info: dict = {}
                    harness.sync()
                    t = time.perf_counter()
                    got = {
                        r.idx: r.output for b in engine.generate(loaded, s, rows, batch_rows=256, info=info) for r in b
                    }
                    harness.sync()
                    rates[mode].append(round(len(rows) / (time.perf_counter() - t), 2))
                    outputs.setdefault(mode, got)
                    reused[mode] = info.get("fast", {}).get("prefix_tokens_reused")
                    cascade_steps[mode] = info.get("fast", {}).get("cascade_steps")
        finally:
            fastgen.CASCADE = True
        stats = {mode: harness.repeated(r) for mode, r in rates.items()}
        same = {
            mode: sum(outputs[mode][i] == outputs["off"][i] for i in outputs["off"]) for mode in ("auto", "no_cascade")
        }
        out["prefix_cache"] = {
            "rows_per_s_on": stats["auto"],
            "rows_per_s_off": stats["off"],
            "rows_per_s_on_without_cascade": stats["no_cascade"],
            "ratio": round(stats["auto"]["median"] / stats["off"]["median"], 3),
            "ratio_without_cascade": round(stats["no_cascade"]["median"] / stats["off"]["median"], 3),
            "cascade_gain": round(stats["auto"]["median"] / stats["no_cascade"]["median"], 3),
            "prefix_tokens_reused_last_run": reused,
            "cascade_steps_last_run": cascade_steps,
            "outputs_equal": f"{same['auto']}/{len(rows)}",
            "outputs_equal_without_cascade": f"{same['no_cascade']}/{len(rows)}",
            "passed": same["auto"] == same["no_cascade"] == len(rows),
        }
        out["correctness"]["prefix_cache_equals_whole_prefill"] = out["prefix_cache"]
        log(
            f"prefix cache: {stats['auto']['median']:,.1f} rows/s on, {stats['no_cascade']['median']:,.1f} on without"
            f" the cascade, {stats['off']['median']:,.1f} off ({out['prefix_cache']['ratio']}x, cascade "
            f"{out['prefix_cache']['cascade_gain']}x); outputs equal {same['auto']}/{len(rows)} and "
            f"{same['no_cascade']}/{len(rows)}"
        )

    if args.workload == "g3":  # G3's point, first: a later step may not fit in the time box
        step("prefix_cache", 40 + 30 * args.repeat, prefix_compare)
    step("engine", 20 + 20 * args.repeat, engine_runs)

    # b2. a resident engine across jobs of other shapes (issue 12: the second large run once stalled): G1, then
    # this workload again, on the same state; then each on a fresh state (released and prepared again). Outputs
    # of the resident runs must equal the fresh ones, row for row.
    def sequence() -> None:
        other = "g1" if args.workload != "g1" else "g2"
        other_data = workload(other, tok, args.smoke)
        other_rows = [(i, {"prompt": p, "params": {"max_new_tokens": o}}) for i, (p, o) in enumerate(other_data)]
        runs, outputs = [], {}
        for name, these, fresh in (
            (other, other_rows, False),
            (args.workload, rows, False),
            (other, other_rows, True),
            (args.workload, rows, True),
        ):
            if fresh:
                slot_state.release(model)
            info: dict = {}
            harness.sync()
            t = time.perf_counter()
            got = {r.idx: r.output for b in engine.generate(loaded, spec, these, batch_rows=256, info=info) for r in b}
            harness.sync()
            seconds = time.perf_counter() - t
            tokens = sum(o for _, o in (other_data if name == other else data))
            runs.append(
                {
                    "workload": name,
                    "state": "fresh" if fresh else "resident",
                    "seconds": round(seconds, 3),
                    "output_tok_s": round(tokens / seconds, 1),
                    "slots": info.get("fast", {}).get("slots"),
                    "pages": info.get("fast", {}).get("pages"),
                    "steps": info.get("fast", {}).get("steps"),
                }
            )
            log(f"sequence: {name} on a {runs[-1]['state']} state: {seconds:.2f} s, {tokens / seconds:,.0f} tok/s")
            if fresh:
                same = sum(outputs[name][i] == got[i] for i in got)
                runs[-1]["equal_to_resident"] = f"{same}/{len(got)}"
            else:
                outputs[name] = got
        equal = all(
            r["equal_to_resident"].split("/")[0] == r["equal_to_resident"].split("/")[1]
            for r in runs
            if "equal_to_resident" in r
        )
        out["engine"]["sequence"] = runs
        out["correctness"]["resident_equals_fresh"] = {"passed": equal, "runs": runs}

    step("sequence", 120, sequence)

    # c. per-step logits of 64 rows inside a full batch, teacher-forced along plain generate's tokens
    def logits() -> None:
        out["correctness"]["logits_fast_vs_generate"] = _logits_check(
            torch, fastgen, slot_state, loaded, rows, device, dtype
        )
        c = out["correctness"]["logits_fast_vs_generate"]
        log(
            f"logits fast vs generate: max |diff| {c['max_abs_diff']:.4f} (|logit| up to {c['max_abs_logit']:.1f}, "
            f"tolerance {c['tolerance']:.3f}) over {c['steps']} steps at batch {c['batch']}; passed {c['passed']}"
        )

    step("logits", 20, logits)
    slot_state.release(model)

    # d. baselines
    ids = [tok(p)["input_ids"] for p, _ in data]

    def padded() -> None:
        n = min(len(ids), args.padded_rows)
        order = sorted(range(n), key=lambda i: len(ids[i]))
        useful, t = 0, time.perf_counter()
        for start in range(0, n, args.padded_batch):
            part = order[start : start + args.padded_batch]
            new = max(data[i][1] for i in part)
            enc = tok.pad({"input_ids": [ids[i] for i in part]}, padding=True, return_tensors="pt").to(device)
            with torch.inference_mode():
                model.generate(
                    **enc,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    temperature=None,
                    top_p=None,
                    top_k=None,
                    pad_token_id=tok.pad_token_id,
                )
            useful += sum(data[i][1] for i in part)
        harness.sync()
        seconds = time.perf_counter() - t
        out["baselines"][f"generate_padded_{args.padded_batch}"] = {
            "rows": n,
            "output_tokens": useful,
            "seconds": round(seconds, 3),
            "output_tok_s": round(useful / seconds, 1),
            "note": "rows sorted by prompt length, each call runs to its longest max_new_tokens; only each row's "
            "own max_new_tokens count",
        }
        log(f"baseline padded generate: {useful / seconds:,.0f} output tok/s ({n} rows)")

    step("baseline_padded", 20 if args.smoke else 60, padded)

    def static() -> None:
        n = min(len(ids), FULL_BATCH)
        same = dict(cache_implementation="static", max_cache_len=max(len(i) for i in ids[:n]) + data[0][1])
        enc = tok.pad({"input_ids": ids[:n]}, padding=True, return_tensors="pt").to(device)
        common = dict(do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=tok.pad_token_id)
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=4, **common, **same)
        harness.sync()
        compile_s = time.perf_counter() - t
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(**enc, max_new_tokens=data[0][1], min_new_tokens=data[0][1], **common, **same)
        harness.sync()
        seconds = time.perf_counter() - t
        tokens = n * data[0][1]
        out["baselines"]["static_generate_1024"] = {
            "rows": n,
            "output_tokens": tokens,
            "compile_s": round(compile_s, 3),
            "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 1),
            "attn_implementation": "sdpa",
            "note": "compile_s: a 4-token call at the same batch and cache length (transformers compiles it)",
        }
        log(f"baseline static-cache generate: {tokens / seconds:,.0f} output tok/s (compile {compile_s:.1f} s)")

    if args.workload == "g1":
        step("baseline_static", 30 if args.smoke else 150, static)

    def slow() -> None:
        n = min(len(ids), args.slow_rows)
        with torch.inference_mode():
            harness.sync()
            t = time.perf_counter()
            model.generate_batch(
                inputs=ids[:n],
                generation_config=transformers.GenerationConfig(
                    max_new_tokens=data[0][1], min_new_tokens=data[0][1], do_sample=False, eos_token_id=-1
                ),
            )
            harness.sync()
        seconds = time.perf_counter() - t
        tokens = sum(o for _, o in data[:n])
        out["baselines"]["generate_batch_defaults"] = {
            "rows": n,
            "output_tokens": tokens,
            "seconds": round(seconds, 3),
            "output_tok_s": round(tokens / seconds, 1),
        }
        log(f"baseline generate_batch defaults: {tokens / seconds:,.0f} output tok/s ({n} rows)")

    if args.slow:
        step("baseline_generate_batch", 150, slow)

    # e. the peer a user tries first: transformers' continuous batching, as its docs recommend
    def peer() -> None:
        out["baselines"]["transformers_continuous"] = run_peer(torch, model, tok, ids, data, device, args.peer_s)
        b = out["baselines"]["transformers_continuous"]
        log(
            f"baseline transformers continuous batching: {b['output_tok_s']:,.0f} output tok/s, {b['rows_done']}/"
            f"{b['rows']} rows in {b['seconds']} s{'' if b['finished'] else ' (cut by its time box)'}"
        )

    if args.peer:
        step("baseline_transformers_continuous", args.peer_s + 30, peer)
    harness.write_json(args.child_out, out)
    return 0


def run_peer(torch, model, tok, ids: list[list[int]], data: list[tuple[str, int]], device: str, limit_s: float) -> dict:
    """Every row of the workload through transformers' continuous batching (the engine of `generate_batch`) the way
    its docs recommend: under torch.no_grad (not inference_mode: its loop runs in another thread), a KV cache of
    `num_blocks` sized for this GPU (80 % of the memory free after the model) and `max_batch_tokens` set, EOS off.
    Driven through its manager (what generate_batch does inside) so that a run cut by `limit_s` still gives the rate
    it reached: output tokens of the rows finished by then over the seconds since the manager started (the tokens
    of unfinished rows are not counted). The manager's start (its cache and CUDA graphs) is timed apart."""
    import inspect

    from transformers import ContinuousBatchingConfig, GenerationConfig

    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    per_token = 2 * text.num_hidden_layers * text.num_key_value_heads * head_dim * model.dtype.itemsize
    accepted = inspect.signature(ContinuousBatchingConfig).parameters
    block = 256 if device == "cuda" else 16
    if device == "cuda":
        torch.cuda.empty_cache()
        blocks = int(0.8 * torch.cuda.mem_get_info()[0] / (block * per_token))
        batch_tokens = 8192
    else:
        blocks = sum(-(-(len(i) + o) // block) for i, (_, o) in zip(ids, data)) + 1
        batch_tokens = 512
    kwargs = {"num_blocks": blocks, "max_batch_tokens": batch_tokens}
    kwargs["page_size" if "page_size" in accepted else "block_size"] = block  # 5.24 / 5.17 name
    if device != "cuda":
        kwargs.update(use_cuda_graph=False, use_async_batching=False)
    config = GenerationConfig(max_new_tokens=max(o for _, o in data), do_sample=False, pad_token_id=tok.pad_token_id)
    record = {"rows": len(ids), "config": kwargs, "per_token_kv_bytes": per_token}
    with torch.no_grad():
        t = time.perf_counter()
        manager = model.init_continuous_batching(
            generation_config=config, continuous_batching_config=ContinuousBatchingConfig(**kwargs)
        )
        manager.start()
        for i, (row_ids, (_, new)) in enumerate(zip(ids, data)):
            manager.add_request(row_ids, request_id=str(i), max_new_tokens=new, eos_token_id=-1)
        record["start_s"] = round(time.perf_counter() - t, 3)
        t0 = time.perf_counter()
        deadline, done, tokens = t0 + limit_s, 0, 0
        try:
            while done < len(ids) and time.perf_counter() < deadline:
                result = manager.get_result(timeout=0.5)
                if result is not None and result.is_finished():
                    done += 1
                    tokens += len(result.generated_tokens)
        finally:
            seconds = time.perf_counter() - t0
            manager.stop(block=True, timeout=60, hard_stop=True)
    record.update(
        rows_done=done,
        output_tokens=tokens,
        seconds=round(seconds, 3),
        output_tok_s=round(tokens / max(seconds, 1e-9), 1),
        finished=done == len(ids),
    )
    return record


def _logits_check(
    torch, fastgen, slot_state, loaded, rows, device, dtype, n: int = 64, steps: int = 8, kv_cache_dtype="auto"
) -> dict:
    """Per-step logits of `n` rows: plain `generate` (sdpa, dynamic cache) vs the fast engine (its cache of
    `kv_cache_dtype`) at a full batch of the engine's slot count (the other slots hold further rows of the
    workload), teacher-forced along plain generate's greedy tokens so both see the same inputs at every step."""
    model, tok = loaded.model, loaded.tokenizer
    ids = [tok(r["prompt"])["input_ids"] for _, r in rows]
    slot_state.release(model)
    vocab = model.get_output_embeddings().weight.shape[0]
    state = slot_state.state_for(model, loaded.device, vocab, kv_cache_dtype=kv_cache_dtype)
    slots = state.slots
    n = min(n, slots)
    enc = tok.pad({"input_ids": ids[:n]}, padding=True, return_tensors="pt").to(device)
    with torch.inference_mode():
        want = model.generate(
            **enc,
            max_new_tokens=steps + 1,
            min_new_tokens=steps + 1,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tok.pad_token_id,
        )
    forced = want.sequences[:, enc["input_ids"].shape[1] :]  # (n, steps + 1)
    from worker.engines.common import Prepared

    eng = fastgen.Engine(loaded, state, set(), slots=slots, graphs=False)
    params = {"max_new_tokens": steps + 2, "do_sample": False, "temperature": None, "ignore_eos": True}
    free, seqs = list(range(state.pages - 1, 0, -1)), []
    for i in range(min(slots, len(rows))):  # as many rows as slots and pages allow, each with its own pages
        seq = fastgen.Seq(Prepared(i, params, ids[i]), 0, slot=i)
        if seq.pages_needed > len(free):
            break
        seq.pages = [free.pop() for _ in range(seq.pages_needed)]
        seqs.append(seq)
    state.active.zero_()
    state.pos.zero_()
    state.table.zero_()
    diffs, scale, agree = [], 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(seqs), 128):
            first = eng.prefill(seqs[start : start + 128])
            if start == 0:
                agree += int((first[:n] == forced[:, 0]).sum())
        batch = len(seqs)
        for k in range(steps):
            state.tok[:n] = forced[:, k]
            got = eng.logits(batch)[:n]
            ref = want.logits[k + 1].float()
            diffs.append((got - ref).abs().amax().item())
            scale = max(scale, ref.abs().amax().item())
            agree += int((got.argmax(-1) == forced[:, k + 1]).sum())
            state.pos[:batch] += state.active[:batch]
    slot_state.release(model)
    tol = 0.05 * max(scale, 1.0) if dtype == torch.bfloat16 else 1e-3 * max(scale, 1.0)
    return {
        "rows": n,
        "batch": batch,
        "steps": steps,
        "max_abs_diff": max(diffs),
        "per_step_max_abs_diff": [round(d, 4) for d in diffs],
        "max_abs_logit": scale,
        "tolerance": tol,
        "greedy_tokens_equal": agree,
        "of_tokens": n * (steps + 1),
        "passed": max(diffs) <= tol,
    }


# --- the service ---------------------------------------------------------------------------------------------


def run_service(args: argparse.Namespace, work: Path, report: dict) -> None:
    from transformers import AutoTokenizer

    from api.client import Client

    tok = AutoTokenizer.from_pretrained(args.model)
    data = workload(args.workload, tok, args.smoke)

    def dataset(run: int) -> Path:  # each measured run's own prompts (workload's `run`): none served from the cache
        path = work / f"{args.workload}-{run}.jsonl"
        rows = workload(args.workload, tok, args.smoke, run)
        path.write_text(
            "".join(
                json.dumps({"prompt": p, "max_new_tokens": o, "custom_id": f"r{i}"}) + "\n"
                for i, (p, o) in enumerate(rows)
            )
        )
        return path

    small = work / "small.jsonl"
    small.write_text("".join(json.dumps({"prompt": p, "max_new_tokens": 16}) + "\n" for p, _ in data[:16]))
    t = time.monotonic()
    deadline = t + args.service_s - 20  # the repeats stop when the next would not fit; 20 s to stop the stack
    up = subprocess.run(
        [sys.executable, "-m", "api", "up", "--detach", "--gpus", args.up_gpus, "--port", str(args.port)],
        capture_output=True,
        text=True,
    )
    if up.returncode != 0:
        raise RuntimeError(f"gpujobs up failed: {up.stderr[-2000:]}")
    report["up_s"] = round(time.monotonic() - t, 2)
    try:
        client = Client()
        base = {
            "model": str(args.model),
            "ignore_eos": True,
            "batch_rows": args.batch_rows,
            "shard_rows": len(data),
            "gpus": args.spec_gpus,
            "kv_cache_dtype": args.kv_cache_dtype,
        }
        if args.kv_cache_dtype != "auto":  # auto is fast on a GPU; on a CPU (--smoke) it is padded, which refuses it
            base["engine"] = "fast"
        small_id = client.upload(small)["id"]

        def small_job(name: str) -> None:
            t = time.monotonic()
            job = client.submit({**base, "input": small_id, "max_new_tokens": 16, "name": name})
            job = client.wait(job["id"], poll=0.2, timeout=300)
            numbers = harness.sql_numbers(job["id"])
            first = min(numbers["commit_times_s"]) if numbers["commit_times_s"] else None
            report[name] = {
                "id": job["id"],
                "state": job["state"],
                "wall_s": round(time.monotonic() - t, 2),
                "first_row_after_shard_start_s": first,
                "engine": (job.get("load_options") or {}).get("engine"),
                "prepared": (job.get("load_options") or {}).get("prepared"),  # compile, capture, compile cache
                "error": job["error"],
            }
            log(
                f"{name} job {job['state']} in {report[name]['wall_s']} s (first row {first} s after its shard started)"
            )
            if job["state"] != "succeeded":
                raise RuntimeError(f"{name} job {job['state']}: {job['error']}")

        small_job("warm_up")  # a fresh worker: cold, or warm-cache when JOBS_HOME's compile cache has this model
        spy = profile_worker(client, args.profile_warm_start)
        small_job("warm_start")  # the model resident
        stop_profile(spy)
        runs = []
        for i in range(args.repeat):  # the workload --repeat times, one job each: median and spread
            if runs and time.monotonic() + 1.5 * runs[-1]["window_s"] > deadline:
                log(f"service: run {i + 1} of {args.repeat} would not fit the time box: stopping at {len(runs)}")
                break
            main_id = client.upload(dataset(i + 1))["id"]
            job = client.submit({**base, "input": main_id, "name": f"{args.workload}-{i + 1}"})
            log(f"{args.workload} job {job['id']} submitted (run {i + 1} of {args.repeat})")
            job = client.wait(job["id"], poll=0.5, timeout=max(60, deadline - time.monotonic()))
            run = {k: job.get(k) for k in ("id", "state", "error", "tokens", "metrics", "load_options")}
            runs.append({"job": run, **harness.sql_numbers(job["id"])})
            fast = ((run.get("load_options") or {}).get("engine") or {}).get("fast") or {}
            log(
                f"service run {i + 1}: {runs[-1].get('output_tok_s')} output tok/s over {runs[-1].get('window_s')} s, "
                f"prefix tokens reused {fast.get('prefix_tokens_reused')}"
            )
        stats = harness.repeated([r.get("output_tok_s") for r in runs])
        median_run = min(runs, key=lambda r: abs((r.get("output_tok_s") or 0) - (stats["median"] or 0)))
        report.update(median_run)  # the run at the median, as before: its job, commit times, shards
        report["runs"] = stats
        report["output_tok_s"] = stats["median"]
        log(f"service: median {stats['median']} output tok/s over {len(runs)} runs, spread {stats['spread']}")
        if args.restart and time.monotonic() + 90 < deadline:  # a fresh worker on a model it compiled before
            subprocess.run([sys.executable, "-m", "api", "down"], capture_output=True, text=True)
            up = subprocess.run(
                [sys.executable, "-m", "api", "up", "--detach", "--gpus", args.up_gpus, "--port", str(args.port)],
                capture_output=True,
                text=True,
            )
            if up.returncode != 0:
                raise RuntimeError(f"gpujobs up (restart) failed: {up.stderr[-2000:]}")
            from core.settings import reset

            reset()  # the new stack's file: its URL and token
            client = Client()
            spy = profile_worker(client, args.profile_restart)
            small_job("restart_warm_up")  # warm-cache: compiled code read from JOBS_HOME/compile-cache
            stop_profile(spy)
    except Exception:
        dump_worker_stacks()
        raise
    finally:
        subprocess.run([sys.executable, "-m", "api", "down"], capture_output=True, text=True)


def profile_worker(client, out: str):
    """py-spy recording the stack's online worker (its Python stacks, 200 Hz) into `out` (speedscope), or None
    without `out`; py-spy from PYSPY, else PATH."""
    if not out:
        return None
    import shutil

    spy = shutil.which(os.environ.get("PYSPY") or "py-spy")  # None where it is not there: the run goes on
    pids = [w["pid"] for w in client.workers() if w["state"] == "online"]
    if not spy or not pids:
        log(f"profile of {out} skipped: py-spy {spy}, online workers {pids}")
        return None
    cmd = [spy, "record", "--pid", str(pids[0]), "--rate", "200", "--nonblocking", "--format", "speedscope", "-o", out]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_profile(spy) -> None:
    if spy:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=30)


def dump_worker_stacks() -> None:
    """SIGABRT to the stack's workers: with PYTHONFAULTHANDLER=1 (ops/gpu scripts set it) each writes every
    thread's stack to its log before dying, so a time box that expired says whether the work was slow or stuck."""
    from api.stack import read_stack

    for pid in read_stack().get("workers", []):
        try:
            os.kill(pid, signal.SIGABRT)
            log(f"sent SIGABRT to worker {pid} (stacks in its log)")
        except OSError:
            pass


# --- main ------------------------------------------------------------------------------------------------------


def gpu_name() -> str | None:
    """GPU 0's name from nvidia-smi (None without one): this process must not hold a CUDA context, whose memory
    the service's cache sizing would count as taken."""
    try:
        names = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if names.returncode != 0:
        return None
    return names.stdout.strip() or None


def rate_of(name: str | None) -> float | None:
    """The measured decode-attention rate of the GPU model `name` names (RATES), None when none was measured."""
    return next((rate for model, rate in RATES.items() if name and model in name), None)


def ratios(r: dict) -> dict:
    out = {}
    service, engine = r["service"].get("output_tok_s"), r["engine"].get("output_tok_s")
    bound_tok_s, here = r.get("bound_tok_s"), (r.get("bound_here") or {}).get("bound_tok_s")
    best = max((b.get("output_tok_s") or 0 for b in r["baselines"].values()), default=0)
    for name, value in (("service", service), ("engine", engine)):
        if value and bound_tok_s:
            out[f"{name}/bound"] = round(value / bound_tok_s, 4)
        if value and here:
            out[f"{name}/bound_here"] = round(value / here, 4)
        if value and best:
            out[f"{name}/best_baseline"] = round(value / best, 2)
        for base, b in r["baselines"].items():
            if value and b.get("output_tok_s"):
                out[f"{name}/{base}"] = round(value / b["output_tok_s"], 2)
    if service and engine:
        out["service_overhead"] = round(1 - service / engine, 4)
    checks = r["correctness"].values()  # none when the engine did not run (--skip inproc): null, not false
    out["correctness_passed"] = all(c.get("passed") for c in checks) if checks else None
    return out


def print_table(name: str, r: dict) -> None:
    print(
        f"\n{name.upper()} on {r.get('device')}: {r['workload']}; torch {r.get('torch')}, transformers "
        f"{r.get('transformers')}; commit {r.get('commit')}"
    )
    print(f"{'':44}{'tok/s':>10}{'peak GiB':>10}{'compile s':>11}")
    lines = [
        ("ours: service (fast engine, SQL)", r["service"].get("output_tok_s"), None, None),
        (
            "ours: engine alone (warm)",
            r["engine"].get("output_tok_s"),
            r["engine"].get("warm", {}).get("peak_memory_bytes"),
            None,
        ),
        (
            "ours: engine alone (cold)",
            r["engine"].get("cold", {}).get("output_tok_s"),
            None,
            r["engine"].get("cold", {}).get("info", {}).get("fast", {}).get("capture_s"),
        ),
    ]
    if r["workload"] in COMPARISONS:  # warm and cold engine runs of G1's rows in other settings
        lines = [(f"ours: engine, {k}", v.get("output_tok_s"), None, None) for k, v in r["engine"].items()]
    lines += [(f"baseline: {k}", b.get("output_tok_s"), None, b.get("compile_s")) for k, b in r["baselines"].items()]
    lines.append(("bound (from the dataset)", r.get("bound_tok_s"), None, None))
    if r.get("bound_here"):
        here = r["bound_here"]
        lines.append((f"bound on this GPU ({here['rate_tb_s']} TB/s)", here["bound_tok_s"], None, None))
    for label, tps, peak, comp in lines:
        print(
            f"{label:44}{(f'{tps:,.0f}' if tps else '-'):>10}{(f'{peak / 2**30:.1f}' if peak else ''):>10}"
            f"{(f'{comp:.1f}' if comp else ''):>11}"
        )
    for label, stats in (("engine warm", r["engine"].get("warm_runs")), ("service", r["service"].get("runs"))):
        if stats and stats.get("runs"):
            runs = ", ".join(f"{v:,.0f}" for v in stats["runs"])
            print(f"  {label} runs: {runs} tok/s; median {stats['median']:,.0f}, spread {stats['spread']:.1%}")
    for k, v in r["ratios"].items():
        print(f"  {k} = {v}")
    for k, c in r["correctness"].items():
        print(f"  correctness {k}: passed {c.get('passed')}")
    if r["skipped"] or r["errors"]:
        print(f"skipped: {r['skipped']}\nerrors: {r['errors']}")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(
        __doc__,
        out=None,
        out_help="the JSON written (default: ops/bench/results/<workload>.json)",
        model=Path("/tmp/g1-model"),
        smoke=True,
        port=8765,
        work=Path("/tmp/gen-work"),
    )
    p.add_argument("workload", choices=["g1", "g2", "g3", *COMPARISONS])
    p.add_argument(
        "--repeat", type=int, default=3, help="warm engine runs and service jobs of the workload (median, spread)"
    )
    p.add_argument("--qa-model", type=Path, default=Path("/tmp/g1-qa-model"), help="built there if missing")
    p.add_argument("--slow", action="store_true", help="also transformers' generate_batch with its defaults")
    p.add_argument("--slow-rows", type=int, default=256)
    p.add_argument(
        "--no-peer",
        dest="peer",
        action="store_false",
        help="skip transformers' continuous batching sized for the GPU (run by default, in its own time box)",
    )
    p.add_argument("--peer-s", type=float, default=90, help="time box of the transformers continuous-batching run")
    p.add_argument(
        "--no-restart",
        dest="restart",
        action="store_false",
        help="skip restarting the stack after the service runs (a fresh worker's first job on a compiled model)",
    )
    p.add_argument(
        "--profile-restart",
        default="",
        metavar="FILE",
        help="record the restarted worker with py-spy (speedscope FILE) while it runs its first job",
    )
    p.add_argument(
        "--profile-warm-start",
        default="",
        metavar="FILE",
        help="record the worker with py-spy (speedscope FILE) while it runs the small job again, its model resident",
    )
    p.add_argument(
        "--tokenizer-size",
        type=int,
        default=640,
        help="640: the benchmark model's own tokenizer; another size: a byte-level BPE of that many tokens in its "
        "place (151936 gives ~59k, a real tokenizer's grammar-mask cost), the model linked under --work",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", *QUANTIZED_KV],
        default="auto",
        help="g1, g2, g3: our engine runs and service jobs with this KV cache (the checks and baselines as they are)",
    )
    p.add_argument("--padded-batch", type=int, default=256)
    p.add_argument("--padded-rows", type=int, default=512, help="rows of the padded-generate baseline")
    p.add_argument("--batch-rows", type=int, default=256, help="service: rows per micro-batch commit")
    p.add_argument("--inproc-s", type=float, default=330, help="time box of step 1 (the child process)")
    p.add_argument("--service-s", type=float, default=150, help="time box of step 2")
    p.add_argument("--skip", default="", help="comma list of inproc,service")
    p.add_argument("--up-gpus", default="0")
    p.add_argument("--spec-gpus", type=int, default=1)
    p.add_argument("--phase", default="main", help=argparse.SUPPRESS)
    p.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    p.add_argument("--budget-s", type=float, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phase == "inproc":
        return run_inproc(args)
    args.out = args.out or harness.RESULTS / f"{args.workload}.json"
    if args.smoke and args.up_gpus == "0":
        args.up_gpus, args.spec_gpus = "none", 0
    skip = set(args.skip.split(",")) - {""} | ({"service"} if args.workload in COMPARISONS else set())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    harness.ensure_model(args.model, *(["--steps", "1"] if args.smoke else ["--arch", "qwen3-0.6b"]))
    harness.ensure_model(args.qa_model, "--qa", str(ROOT / "examples" / "qa.jsonl"))
    if args.tokenizer_size != 640:
        args.model = harness.with_tokenizer(args.model, args.tokenizer_size, args.work)
    r: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        **harness.commit_info(),
        "workload": args.workload,
        "kv_cache_dtype": args.kv_cache_dtype,
        "engine": {},
        "baselines": {},
        "correctness": {},
        "service": {},
        "skipped": [],
        "errors": {},
        "model_build_s": round(time.monotonic() - t0, 1),
    }

    def save() -> None:
        harness.write_json(args.out, {args.workload: r})

    # the bound first, from the dataset alone, in this process: no failed phase can hide it
    from transformers import AutoConfig, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    r["tokenizer_size"] = len(tok)
    config = AutoConfig.from_pretrained(args.model)
    lengths = [(len(tok(p)["input_ids"]), o) for p, o in workload(args.workload, tok, args.smoke)]
    r["bound"] = bound(config, lengths)
    r["bound_tok_s"] = r["bound"]["bound_tok_s"]
    log(f"bound of {args.workload}: {r['bound_tok_s']:,.0f} output tok/s ({r['bound']['output_tokens']:,} tokens)")
    gpu = gpu_name()
    rate = rate_of(gpu)
    if rate and rate != BANDWIDTH:  # another GPU than the yardstick's: its own bound beside it
        r["bound_here"] = {**bound(config, lengths, bandwidth=rate), "gpu": gpu, "rate_tb_s": rate / 1e12}
        log(f"bound on this {gpu}: {r['bound_here']['bound_tok_s']:,.0f} output tok/s at {rate / 1e12} TB/s")
    save()
    if "inproc" not in skip:
        child_out = args.work / "child.json"
        child_out.unlink(missing_ok=True)
        cmd = (
            [
                sys.executable,
                str(Path(__file__).resolve()),
                args.workload,
                "--phase",
                "inproc",
                "--child-out",
                str(child_out),
                "--model",
                str(args.model),
                "--qa-model",
                str(args.qa_model),
                "--budget-s",
                str(args.inproc_s - 10),
                "--padded-batch",
                str(args.padded_batch),
                "--padded-rows",
                str(args.padded_rows),
                "--slow-rows",
                str(args.slow_rows),
                "--repeat",
                str(args.repeat),
                "--peer-s",
                str(args.peer_s),
                "--kv-cache-dtype",
                args.kv_cache_dtype,
            ]
            + ["--no-peer"] * (not args.peer)
            + ["--smoke"] * args.smoke
            + ["--slow"] * args.slow
        )
        try:
            rc = subprocess.run(cmd, timeout=args.inproc_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        child = json.loads(child_out.read_text()) if child_out.exists() else {}
        if rc != 0:
            r["errors"]["inproc"] = f"exit {rc}"
        for key in ("device", "torch", "transformers", "engine", "baselines", "correctness", "ratios"):
            r[key] = child.get(key, r.get(key))
        for key in (
            "g1json_seconds",
            "grammar",
            "prefix_cache",
            "g1kv_tok_s",
            "kv_same_as_auto",
            "kv_logits_vs_generate",
        ):  # what one workload's step 1 adds
            if key in child:
                r[key] = child[key]
        r["errors"].update(child.get("errors", {}))
        r["skipped"] += child.get("skipped", [])
        save()
    if "service" not in skip:
        try:
            run_service(args, args.work, r["service"])
        except Exception as exc:
            r["errors"]["service"] = f"{type(exc).__name__}: {exc}"
            log(f"service failed: {exc!r}")
    r["ratios"] = {**(r.get("ratios") or {}), **ratios(r)}
    r["total_s"] = round(time.monotonic() - t0, 1)
    save()
    print_table(args.workload, r)
    log(f"wrote {args.out}")
    return 0 if not r["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
