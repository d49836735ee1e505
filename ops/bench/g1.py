"""Workload G1 (DESIGN.md, "Performance: the yardstick") on one GPU: plain-transformers baselines and our service,
measured in one run so that the ratios compare like with like.

    python ops/bench/g1.py --out ops/bench/results/g1.json          # on a GPU host, from the repo root
    python ops/bench/g1.py --out ... --slow --slow-prompts 256      # also transformers' `generate_batch` defaults
    python ops/bench/g1.py --phase static --budget-s 170 --out ...  # engine static vs static-cache generate

G1: Qwen3-0.6B architecture with random bf16 weights (`worker.tinymodel --arch qwen3-0.6b`), 1024 prompts of exactly
256 token ids, 256 new tokens each, EOS off, greedy. Phases, in this order (each skipped if its time would not fit
in `--budget-s`, so that the later ones still run):

1. `generate_padded` — `model.generate`, dynamic cache, `--padded-batch` rows a call (4 calls of 256).
2. `static_cache` — `model.generate(cache_implementation="static")` at `--static-batch` (1024) rows: transformers
   compiles the decode step (torch.compile + CUDA graphs). Run twice; the second is the throughput, the first minus
   the second is the compile/warm-up cost.
3. `service` — `gpujobs up --detach --gpus 0`, a small warm-up job with the same load options, then the G1 job over
   HTTP (`batch_rows` 256, `shard_rows` 1024, `ignore_eos`, prompts as text that tokenizes to exactly 256 tokens).
   Throughput = Σ rows.completion_tokens ÷ (last row's finished_at − first shard's started_at), read from SQL.
4. `generate_batch_defaults` (`--slow`) — transformers continuous batching with its defaults.

Phases 1, 2 and 4 run in child processes of this one (each releases all GPU memory when it exits, so the service's
worker starts on an empty GPU); the token ids are the same in all phases (seeded), and the service's text prompts
are drawn from the same seed. Writes JSON (`{"g1": {...}}`) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BOUND_TOK_S = 94_000  # DESIGN.md: KV-cache reads dominate, 112 KiB per token of context on an H200
SEED = 0


def log(message: str) -> None:
    print(f"[g1 {time.strftime('%H:%M:%S')}] {message}", flush=True)


def prompt_ids(n: int, length: int, vocab: int, specials: set[int], seed: int = SEED) -> list[list[int]]:
    """n prompts of exactly `length` ids drawn from the tokenizer's vocabulary, special tokens excluded."""
    pool = [i for i in range(vocab) if i not in specials]
    rng = random.Random(seed)
    return [[rng.choice(pool) for _ in range(length)] for _ in range(n)]


def one_token_words(tok) -> list[str]:
    """Strings ' word' that our byte-level BPE tokenizes as exactly one token (so N of them are N tokens)."""
    words = []
    for tid in range(len(tok)):
        piece = tok.convert_ids_to_tokens(tid)
        if piece and piece.startswith("Ġ") and piece[1:].isalpha():
            text = tok.convert_tokens_to_string([piece])
            if tok(text, add_special_tokens=False)["input_ids"] == [tid]:
                words.append(text)
    return words


def text_prompts(tok, n: int, length: int, seed: int = SEED) -> list[str]:
    words = one_token_words(tok)
    if len(words) < 20:
        raise RuntimeError(f"only {len(words)} one-token words in the tokenizer: cannot build text prompts")
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(words) for _ in range(length)) for _ in range(n)]
    counts = {len(tok(p)["input_ids"]) for p in prompts}  # the call worker.generate.render makes
    if counts != {length}:
        raise RuntimeError(f"text prompts tokenize to {sorted(counts)} tokens, not {length}")
    return prompts


# --- in-process baselines (child process) -------------------------------------------------------------------


def _sync(torch) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _peak(torch) -> int | None:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def _reset_peak(torch) -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_inproc(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(args.child_out)
    report: dict = {"errors": {}, "windows": {}}  # wall-clock (epoch) spans of the timed calls, for nvidia-smi

    def save() -> None:
        out.write_text(json.dumps(report, indent=2, default=str))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report["torch"], report["transformers"] = torch.__version__, transformers.__version__
    report["cuda"] = torch.version.cuda
    if device == "cuda":
        report["device_name"] = torch.cuda.get_device_name(0)
        report["device_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map=device).eval()
    _sync(torch)
    report["load_s"] = round(time.perf_counter() - t0, 2)
    pad = tok.pad_token_id
    # EOS off: `generate` fills unset fields from model.generation_config, so clear it there (not just per call).
    model.generation_config.eos_token_id = None
    prompts = prompt_ids(args.prompts, args.input_len, len(tok), set(tok.all_special_ids))
    n_new, L = args.new_tokens, args.input_len
    log(f"model loaded in {report['load_s']} s on {device}; {len(prompts)} prompts × {L} ids, {n_new} new tokens")

    def ids(rows: list[list[int]]):
        x = torch.tensor(rows, device=device)
        return x, torch.ones_like(x)

    def gen(rows: list[list[int]], window: str | None = None, **kw) -> tuple[float, int]:
        x, mask = ids(rows)
        _sync(torch)
        t, wall = time.perf_counter(), time.time()
        with torch.inference_mode():
            y = model.generate(input_ids=x, attention_mask=mask, max_new_tokens=n_new, do_sample=False,
                               temperature=None, top_p=None, top_k=None, pad_token_id=pad, **kw)
        _sync(torch)
        dt_ = time.perf_counter() - t
        if window:
            report["windows"][window] = [wall, time.time()]
        new = y.shape[1] - x.shape[1]
        if new != n_new:
            raise RuntimeError(f"generate returned {new} new tokens, not {n_new} (EOS not off?)")
        return dt_, new * len(rows)

    # one small call first: CUDA context, cuBLAS handles and kernel loading stay out of the numbers
    gen(prompts[:4])

    if "padded" in args.phases:
        try:
            _reset_peak(torch)
            times, tokens = [], 0
            for start in range(0, len(prompts), args.padded_batch):
                call = start // args.padded_batch + 1
                s, t = gen(prompts[start : start + args.padded_batch], window=f"padded call {call}")
                times.append(round(s, 3))
                tokens += t
                log(f"padded generate: batch {start // args.padded_batch + 1}: {s:.1f} s ({t / s:,.0f} tok/s)")
            report["generate_padded"] = {
                "batch": args.padded_batch, "calls": len(times), "seconds_per_call": times,
                "seconds": round(sum(times), 3), "output_tokens": tokens,
                "output_tok_s": round(tokens / sum(times), 1), "peak_memory_bytes": _peak(torch),
                # the first call at a new batch shape ran ~2.5x slower on the H200 (2026-12-02): shown apart
                "output_tok_s_after_first_call": round(tokens * (len(times) - 1) / len(times) / sum(times[1:]), 1)
                if len(times) > 1 else None,
            }
        except Exception as exc:  # keep going: the other phases still mean something
            report["errors"]["generate_padded"] = f"{type(exc).__name__}: {exc}"
            log(f"padded generate failed: {exc!r}")
        save()

    if "static" in args.phases:
        try:
            _reset_peak(torch)
            batch = prompts[: args.static_batch]
            first, tokens = gen(batch, window="static run 1", cache_implementation="static")
            log(f"static cache, batch {len(batch)}, first run (compile + capture + run): {first:.1f} s")
            report["static_cache"] = {"batch": len(batch), "first_run_s": round(first, 3)}
            save()
            second, tokens = gen(batch, window="static run 2", cache_implementation="static")
            log(f"static cache, second run: {second:.1f} s ({tokens / second:,.0f} tok/s)")
            report["static_cache"].update(
                second_run_s=round(second, 3), output_tokens=tokens, output_tok_s=round(tokens / second, 1),
                compile_warmup_s=round(first - second, 3), peak_memory_bytes=_peak(torch),
                compiled=hasattr(model, "_compiled_call"),  # set by generate's auto-compile of the decode step
                compile_config=str(getattr(model, "_last_compile_config", None)),
            )
        except Exception as exc:
            report["errors"]["static_cache"] = f"{type(exc).__name__}: {exc}"
            log(f"static cache failed: {exc!r}")
        save()

    if "slow" in args.phases:
        try:
            _reset_peak(torch)
            cfg = GenerationConfig(max_new_tokens=n_new, do_sample=False, eos_token_id=-1, pad_token_id=pad)
            batch = prompts[: args.slow_prompts]
            t = time.perf_counter()
            model.generate_batch(inputs=batch[:8], generation_config=GenerationConfig(
                max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=pad))
            warm = time.perf_counter() - t
            _sync(torch)
            t, wall = time.perf_counter(), time.time()
            results = model.generate_batch(inputs=batch, generation_config=cfg)
            _sync(torch)
            s = time.perf_counter() - t
            report["windows"]["generate_batch timed call"] = [wall, time.time()]
            lengths = [len(r.generated_tokens) for r in results.values()]
            failed = sum(r.error is not None for r in results.values())
            tokens = sum(lengths)
            report["generate_batch_defaults"] = {
                "prompts": len(batch), "returned": len(results), "failed": failed,
                "min_new": min(lengths, default=0), "max_new": max(lengths, default=0),
                "seconds": round(s, 3), "output_tokens": tokens, "output_tok_s": round(tokens / s, 1),
                "small_first_call_s": round(warm, 3), "peak_memory_bytes": _peak(torch),
                "note": "one call, manager creation and its CUDA-graph warm-up included (generate_batch's defaults)",
            }
            log(f"generate_batch defaults: {len(batch)} prompts, {s:.1f} s ({tokens / s:,.0f} tok/s), "
                f"new tokens {min(lengths, default=0)}..{max(lengths, default=0)}, {failed} failed")
        except Exception as exc:
            report["errors"]["generate_batch_defaults"] = f"{type(exc).__name__}: {exc}"
            log(f"generate_batch failed: {exc!r}")
        save()
    return 0


def run_child(args: argparse.Namespace, phases: list[str], timeout: float, work: Path) -> dict:
    child_out = work / f"child-{'-'.join(phases)}.json"
    child_out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--phase", "inproc", "--phases", ",".join(phases),
           "--child-out", str(child_out), "--model", str(args.model), "--prompts", str(args.prompts),
           "--input-len", str(args.input_len), "--new-tokens", str(args.new_tokens),
           "--padded-batch", str(args.padded_batch), "--static-batch", str(args.static_batch),
           "--slow-prompts", str(args.slow_prompts or args.prompts)]
    log(f"child {phases} with a {timeout:.0f} s limit")
    rc: int | str
    try:
        rc = subprocess.run(cmd, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    report = json.loads(child_out.read_text()) if child_out.exists() else {"errors": {}}
    if rc != 0:
        report.setdefault("errors", {})[f"child {','.join(phases)}"] = f"exit {rc}"
    return report


# --- the engine check (--phase engine) -----------------------------------------------------------------------


def run_engine_check(args: argparse.Namespace) -> int:
    """Short, in one process: (1) correctness of `sdpa_gqa` on G1's architecture (per-step logits of 64 left-padded
    rows against plain `sdpa` `generate`, bf16 tolerance) and of both our engines on the memorized tiny model
    (greedy outputs equal plain `generate`'s); (2) throughput on `--prompts` G1 rows: plain padded `generate` with
    sdpa (baseline) and with sdpa_gqa, then our engine alone (`worker.generate.generate`, padded and continuous),
    each after the others so the allocator is warm. Phases that would overrun `--budget-s` are skipped."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.spec import GenerateSpec
    from worker import attention
    from worker.generate import generate
    from worker.loader import Loaded

    deadline = time.monotonic() + args.budget_s
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g1: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **commit_info(),
                "phase": "engine", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                "torch": torch.__version__, "transformers": transformers.__version__,
                "workload": {"prompts": args.prompts, "input_tokens": args.input_len, "output_tokens": args.new_tokens,
                             "eos": "off", "decoding": "greedy", "dtype": str(dtype)},
                "bound_tok_s": BOUND_TOK_S, "baselines": {}, "engine": {}, "correctness": {}, "skipped": [],
                "errors": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps({"g1": g1}, indent=2, default=str))

    for path, cmd in ((args.model, ["--arch", "qwen3-0.6b"] if args.arch == "qwen3-0.6b" else ["--steps", "1"]),
                      (args.qa_model, ["--qa", str(ROOT / "examples" / "qa.jsonl")])):
        if not (path / "model.safetensors").exists():
            subprocess.run([sys.executable, "-m", "worker.tinymodel", str(path), *cmd], check=True,
                           stdout=subprocess.DEVNULL, cwd=ROOT)
    attention.register()

    def load(path: Path, attn: str):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device,
                                                     attn_implementation=attn).eval()
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        return model, tok

    # 1a. sdpa_gqa vs sdpa: per-step logits of 64 left-padded rows of G1's architecture (bf16)
    try:
        model, tok = load(args.model, "sdpa")
        rng = random.Random(SEED)
        rows = prompt_ids(64, args.input_len, len(tok), set(tok.all_special_ids))
        rows = [r[: rng.randint(args.input_len // 4, args.input_len)] for r in rows]  # ragged: a mask is passed
        enc = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt").to(device)
        steps = 16
        outs = {}
        for attn in ("sdpa", attention.NAME):
            model.set_attn_implementation(attn)
            with torch.inference_mode():
                y = model.generate(**enc, max_new_tokens=steps, do_sample=False, temperature=None, top_p=None,
                                   top_k=None, output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                   pad_token_id=tok.pad_token_id)
            outs[attn] = (y.sequences, torch.stack(y.logits, 1).float())
        (seq_a, lg_a), (seq_b, lg_b) = outs["sdpa"], outs[attention.NAME]
        diff = (lg_a - lg_b).abs()
        scale = lg_a.abs().amax().item()
        first_diverge = (seq_a != seq_b).any(0).nonzero()
        # compare logits only up to the first step where any row's greedy token differs (then inputs differ)
        upto = int(first_diverge[0]) - enc["input_ids"].shape[1] if len(first_diverge) else steps
        upto = max(upto, 1)
        max_abs = diff[:, :upto].amax().item()
        tol = 0.05 * max(scale, 1.0) if dtype == torch.bfloat16 else 1e-4 * max(scale, 1.0)
        g1["correctness"]["logits_sdpa_gqa_vs_sdpa"] = {
            "rows": 64, "steps_compared": upto, "of_steps": steps, "max_abs_diff": max_abs, "max_abs_logit": scale,
            "tolerance": tol, "greedy_rows_equal": int((seq_a == seq_b).all(1).sum()), "passed": max_abs <= tol}
        log(f"logits sdpa_gqa vs sdpa: max |diff| {max_abs:.4f} over {upto} steps (|logit| up to {scale:.1f}, "
            f"tolerance {tol:.3f}); greedy rows equal {g1['correctness']['logits_sdpa_gqa_vs_sdpa']['greedy_rows_equal']}/64")
        del model
    except Exception as exc:
        g1["errors"]["logits"] = f"{type(exc).__name__}: {exc}"
        log(f"logits check failed: {exc!r}")
    save()

    # 1b. the memorized model: greedy outputs of our engines (padded with sdpa_gqa on CUDA, continuous) = generate
    try:
        qa = [json.loads(line) for line in (ROOT / "examples" / "qa.jsonl").read_text().splitlines() if line]
        model, tok = load(args.qa_model, "sdpa")
        loaded = Loaded(model, tok, model.device, {})
        rows = [(i, {"prompt": d["question"], "params": {}}) for i, d in enumerate(qa * 16)]
        enc = tok.pad({"input_ids": [tok(r["prompt"])["input_ids"] for _, r in rows]}, padding=True,
                      return_tensors="pt").to(device)
        with torch.inference_mode():
            y = model.generate(**enc, max_new_tokens=16, do_sample=False, temperature=None, top_p=None, top_k=None,
                               pad_token_id=tok.pad_token_id)
        eos = tok.eos_token_id
        plain = []
        for t in y[:, enc["input_ids"].shape[1]:].tolist():
            plain.append(tok.decode(t[: t.index(eos) + 1] if eos in t else t, skip_special_tokens=True))
        for name in ("padded", "continuous"):
            spec = GenerateSpec(model=str(args.qa_model), input="x", max_new_tokens=16, engine=name)
            info: dict = {}
            got = {r.idx: r.output for b in generate(loaded, spec, rows, batch_rows=32, info=info) for r in b}
            equal = sum(got[i] == plain[i] for i in range(len(rows)))
            g1["correctness"][f"greedy_{name}_vs_generate"] = {
                "rows": len(rows), "equal": equal, "share": round(equal / len(rows), 4),
                "passed": equal >= 0.99 * len(rows), "engine": info}
            log(f"greedy {name} engine vs generate: {equal}/{len(rows)} equal ({info.get('attn_implementation')})")
        del model, loaded
    except Exception as exc:
        g1["errors"]["greedy"] = f"{type(exc).__name__}: {exc}"
        log(f"greedy check failed: {exc!r}")
    save()

    # 2. throughput on G1 rows, every phase in this process, the slowest-to-warm first
    model, tok = load(args.model, "sdpa")
    model.generation_config.eos_token_id = None
    ids = prompt_ids(args.prompts, args.input_len, len(tok), set(tok.all_special_ids))
    n_new = args.new_tokens

    def timed(name: str, fn, estimate_s: float) -> None:
        if time.monotonic() + estimate_s > deadline:
            g1["skipped"].append(name)
            log(f"skipped {name}: would not fit the budget")
            return
        try:
            _reset_peak(torch)
            _sync(torch)
            t = time.perf_counter()
            tokens = fn()
            _sync(torch)
            s = time.perf_counter() - t
            entry = {"seconds": round(s, 3), "output_tokens": tokens, "output_tok_s": round(tokens / s, 1),
                     "peak_memory_bytes": _peak(torch)}
            (g1["engine"] if name.startswith("engine") else g1["baselines"])[name] = entry
            log(f"{name}: {s:.1f} s, {tokens / s:,.0f} output tok/s")
        except Exception as exc:
            g1["errors"][name] = f"{type(exc).__name__}: {exc}"
            log(f"{name} failed: {exc!r}")
        save()

    def plain_generate(attn: str) -> int:
        model.set_attn_implementation(attn)
        tokens = 0
        for start in range(0, len(ids), args.padded_batch):
            x = torch.tensor(ids[start : start + args.padded_batch], device=device)
            with torch.inference_mode():
                y = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n_new,
                                   do_sample=False, temperature=None, top_p=None, top_k=None,
                                   pad_token_id=tok.pad_token_id)
            tokens += (y.shape[1] - x.shape[1]) * x.shape[0]
        model.set_attn_implementation("sdpa")
        return tokens

    texts = text_prompts(tok, args.prompts, args.input_len)
    rows = [(i, {"prompt": p, "params": {}}) for i, p in enumerate(texts)]
    loaded = Loaded(model, tok, model.device, {})

    def ours(engine: str, **fields) -> int:
        spec = GenerateSpec(model=str(args.model), input="x", max_new_tokens=n_new, ignore_eos=True, engine=engine,
                            **fields)
        info: dict = {}
        tokens = sum(r.completion_tokens or 0 for b in generate(loaded, spec, rows, batch_rows=args.padded_batch,
                                                                 info=info) for r in b)
        g1.setdefault("engine_info", {})[engine] = info
        return tokens

    timed("warm_up_generate_padded", lambda: plain_generate("sdpa"), 60)  # first call at this shape: slow
    g1["baselines"].pop("warm_up_generate_padded", None)
    timed(f"generate_padded_{args.padded_batch}", lambda: plain_generate("sdpa"), 30)
    timed(f"generate_padded_{args.padded_batch}_sdpa_gqa", lambda: plain_generate(attention.NAME), 20)
    timed("engine_padded", lambda: ours("padded"), 20)
    timed("engine_continuous", lambda: ours("continuous", cuda_graphs="on" if device == "cuda" else "off"), 60)
    base = g1["baselines"].get(f"generate_padded_{args.padded_batch}", {}).get("output_tok_s")
    for name, entry in [*g1["baselines"].items(), *g1["engine"].items()]:
        if base:
            entry["ratio_vs_generate_padded"] = round(entry["output_tok_s"] / base, 3)
    best = max((e["output_tok_s"] for e in g1["engine"].values()), default=None)
    g1["engine"]["output_tok_s"] = best
    save()
    print(json.dumps({k: g1[k] for k in ("baselines", "engine", "correctness", "skipped", "errors")}, indent=1,
                     default=str))
    return 0


# --- the static-cache engine check (--phase static) ----------------------------------------------------------

# seconds each step needs on an H200 at 1024 G1 rows (the budget check): compile ~50 s, static generate ~22 s
STATIC_ESTIMATE_S = {"greedy": 20, "engine": 75, "logits": 8, "baseline": 75}


def run_static_check(args: argparse.Namespace) -> int:
    """`engine: static` against plain `generate(cache_implementation="static")`, in one process (≤ 170 s on an
    H200 by design; `--budget-s`). Steps, each skipped and listed if its estimate would overrun the budget:

    1. greedy: our static engine (compiled on CUDA) vs plain `generate` on the tiny memorized model (96 rows);
    2. ours: `worker.generate.generate(engine=static)` on `--prompts` G1 rows at `--static-batch` slots, text
       prompts of exactly `--input-len` tokens, EOS off; compile (the engine's warm-up call) reported apart;
    3. logits: 64 ragged G1 rows through our exact configuration (sdpa_gqa, static cache, the compiled graph of
       step 2: same slots and cache length, dummy rows filling the call) vs plain `generate` (sdpa, dynamic cache),
       per-step logits until the first greedy divergence, bf16 tolerance. After step 2 so it reuses its compile;
    4. baseline: plain `generate(cache_implementation="static")` with `sdpa` at `--static-batch` rows: a 4-token
       call first (its compile, timed apart), then the timed call. Last: switching the model's compile config
       back to ours would recompile.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.spec import GenerateSpec
    from worker import attention
    from worker import generate as engine
    from worker.loader import Loaded

    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g1: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **commit_info(),
                "phase": "static", "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                "torch": torch.__version__, "transformers": transformers.__version__,
                "workload": {"arch": args.arch, "prompts": args.prompts, "input_tokens": args.input_len,
                             "output_tokens": args.new_tokens, "batch": args.static_batch, "eos": "off",
                             "decoding": "greedy", "dtype": str(dtype)},
                "bound_tok_s": BOUND_TOK_S, "baselines": {}, "engine": {}, "correctness": {}, "skipped": [],
                "errors": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps({"g1": g1}, indent=2, default=str))

    def fits(name: str) -> bool:
        left = deadline - time.monotonic()
        if left >= STATIC_ESTIMATE_S[name] * args.estimate_scale:
            return True
        g1["skipped"].append(f"{name} (estimated {STATIC_ESTIMATE_S[name] * args.estimate_scale:.0f} s, "
                             f"{left:.0f} s left)")
        log(f"skipped {name}: would not fit the budget")
        return False

    # the G1 model (~24 s to build on the H200 host) builds in a child process while step 1 runs
    t_build = time.monotonic()
    building = None
    if not (args.model / "model.safetensors").exists():
        cmd = ["--arch", "qwen3-0.6b"] if args.arch == "qwen3-0.6b" else ["--steps", "1"]
        building = subprocess.Popen([sys.executable, "-m", "worker.tinymodel", str(args.model), *cmd],
                                    stdout=subprocess.DEVNULL, cwd=ROOT)
    if not (args.qa_model / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "worker.tinymodel", str(args.qa_model), "--qa",
                        str(ROOT / "examples" / "qa.jsonl")], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    attention.register()

    def load(path: Path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device,
                                                     attn_implementation="sdpa").eval()
        tok = AutoTokenizer.from_pretrained(path)
        tok.padding_side = "left"
        return model, tok

    def plain(model, tok, rows: list[list[int]], new: int, **kw):
        enc = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt").to(device)
        with torch.inference_mode():
            y = model.generate(**enc, max_new_tokens=new, do_sample=False, temperature=None, top_p=None, top_k=None,
                               pad_token_id=tok.pad_token_id, **kw)
        return enc, y

    # 1. greedy outputs on the memorized model: our static engine (compiled on CUDA) vs plain generate
    if fits("greedy"):
        try:
            qa = [json.loads(line) for line in (ROOT / "examples" / "qa.jsonl").read_text().splitlines() if line]
            model, tok = load(args.qa_model)
            rows = [(i, {"prompt": d["question"], "params": {}}) for i, d in enumerate(qa * 16)]
            enc, y = plain(model, tok, [tok(r["prompt"])["input_ids"] for _, r in rows], 16)
            eos = tok.eos_token_id
            want = [tok.decode(t[: t.index(eos) + 1] if eos in t else t, skip_special_tokens=True)
                    for t in y[:, enc["input_ids"].shape[1]:].tolist()]
            spec = GenerateSpec(model=str(args.qa_model), input="x", max_new_tokens=16, engine="static")
            info: dict = {}
            got = {r.idx: r.output for b in engine.generate(Loaded(model, tok, model.device, {}), spec, rows,
                                                             batch_rows=len(rows), info=info) for r in b}
            equal = sum(got[i] == want[i] for i in range(len(rows)))
            g1["correctness"]["greedy_static_vs_generate"] = {
                "rows": len(rows), "equal": equal, "share": round(equal / len(rows), 4),
                "passed": equal >= 0.99 * len(rows), "engine": info}
            log(f"greedy static engine vs generate: {equal}/{len(rows)} equal (compiled "
                f"{info['static']['compiled']}, compile {info['static']['compile_s']} s)")
            del model
        except Exception as exc:
            g1["errors"]["greedy"] = f"{type(exc).__name__}: {exc}"
            log(f"greedy check failed: {exc!r}")
        save()

    if building is not None and building.wait() != 0:
        raise RuntimeError(f"building {args.model} failed (exit {building.returncode})")
    g1["model_build_wait_s"] = round(time.monotonic() - t_build, 2)  # build, overlapped with step 1
    model, tok = load(args.model)
    model.generation_config.eos_token_id = None  # EOS off for the baseline (ours passes ignore_eos)
    loaded = Loaded(model, tok, model.device, {})
    n_new = args.new_tokens

    # 2. ours: the static engine on G1 rows, compile (its warm-up call at the new shape) reported apart
    ours_shape = None
    if fits("engine"):
        try:
            texts = text_prompts(tok, args.prompts, args.input_len)
            rows = [(i, {"prompt": p, "params": {}}) for i, p in enumerate(texts)]
            spec = GenerateSpec(model=str(args.model), input="x", max_new_tokens=n_new, ignore_eos=True,
                                engine="static")
            info = {}
            _reset_peak(torch)
            _sync(torch)
            t = time.perf_counter()
            tokens = sum(r.completion_tokens or 0 for b in engine.generate(
                loaded, spec, rows, batch_rows=args.static_batch, info=info) for r in b)
            _sync(torch)
            total = time.perf_counter() - t
            st = info["static"]
            run_s = total - st["compile_s"]
            g1["engine"]["static"] = {
                "batch_rows": args.static_batch, "rows": len(rows), "output_tokens": tokens,
                "seconds_incl_compile": round(total, 3), "compile_s": st["compile_s"], "seconds": round(run_s, 3),
                "output_tok_s": round(tokens / run_s, 1), "output_tok_s_incl_compile": round(tokens / total, 1),
                "peak_memory_bytes": _peak(torch), "info": info}
            g1["engine"]["output_tok_s"] = g1["engine"]["static"]["output_tok_s"]
            ours_shape = st["shapes"][-1] if st["shapes"] else None
            log(f"ours (static engine): {tokens / run_s:,.0f} output tok/s excluding compile "
                f"({st['compile_s']:.1f} s), {tokens / total:,.0f} including; {st['calls']} calls, "
                f"peak {(_peak(torch) or 0) / 2**30:.1f} GiB")
        except Exception as exc:
            g1["errors"]["engine_static"] = f"{type(exc).__name__}: {exc}"
            log(f"static engine failed: {exc!r}")
        save()

    # 3. per-step logits of 64 ragged rows: our configuration (the compiled shape of step 2) vs plain generate
    if fits("logits"):
        try:
            g1["correctness"]["logits_static_vs_generate"] = _static_logits(
                torch, engine, loaded, args, ours_shape, dtype, device)
            c = g1["correctness"]["logits_static_vs_generate"]
            log(f"logits static vs generate: max |diff| {c['max_abs_diff']:.4f} over {c['steps_compared']} steps "
                f"(|logit| up to {c['max_abs_logit']:.1f}, tolerance {c['tolerance']:.3f}); greedy rows equal "
                f"{c['greedy_rows_equal']}/{c['rows']}; passed {c['passed']}")
        except Exception as exc:
            g1["errors"]["logits"] = f"{type(exc).__name__}: {exc}"
            log(f"logits check failed: {exc!r}")
        save()

    # 4. baseline: plain generate, static cache, sdpa, auto-compiled by transformers (default CompileConfig)
    if fits("baseline"):
        try:
            model.set_attn_implementation("sdpa")
            ids = prompt_ids(args.prompts, args.input_len, len(tok), set(tok.all_special_ids))[: args.static_batch]
            _reset_peak(torch)
            _sync(torch)
            t = time.perf_counter()
            # the compile happens on this call; max_cache_len: the same cache as the timed call's (its own length)
            same = dict(cache_implementation="static", max_cache_len=args.input_len + n_new)
            plain(model, tok, ids, 4, **same)
            _sync(torch)
            compile_s = time.perf_counter() - t
            log(f"baseline static generate: compile call {compile_s:.1f} s")
            t = time.perf_counter()
            enc, y = plain(model, tok, ids, n_new, **same)
            _sync(torch)
            run_s = time.perf_counter() - t
            new = y.shape[1] - enc["input_ids"].shape[1]
            if new != n_new:
                raise RuntimeError(f"generate returned {new} new tokens, not {n_new} (EOS not off?)")
            tokens = new * len(ids)
            g1["baselines"]["static_generate"] = {
                "batch": len(ids), "attn_implementation": "sdpa", "output_tokens": tokens, "compile_s":
                round(compile_s, 3), "seconds": round(run_s, 3), "output_tok_s": round(tokens / run_s, 1),
                "output_tok_s_incl_compile": round(tokens / (run_s + compile_s), 1),
                "peak_memory_bytes": _peak(torch), "compiled": hasattr(model, "_compiled_call"),
                "compile_config": str(getattr(model, "_last_compile_config", None)),
                "note": "compile_s is a 4-token call at the same batch and cache length (compile + CUDA graphs)"}
            log(f"baseline static generate: {tokens / run_s:,.0f} output tok/s excluding compile, "
                f"{tokens / (run_s + compile_s):,.0f} including")
        except Exception as exc:
            g1["errors"]["baseline_static_generate"] = f"{type(exc).__name__}: {exc}"
            log(f"baseline failed: {exc!r}")
        save()

    g1["ratios"] = _static_ratios(g1)
    g1["total_s"] = round(time.monotonic() - t_start, 1)
    save()
    _print_static(g1)
    log(f"wrote {args.out}")
    return 0 if not g1["errors"] else 1


def _static_logits(torch, engine, loaded, args, shape, dtype, device) -> dict:
    """64 ragged, left-padded rows: per-step logits of our configuration vs plain `generate` (sdpa, dynamic cache)."""
    model, tok = loaded.model, loaded.tokenizer
    steps, n = 8, 64
    rng = random.Random(SEED + 1)
    rows = prompt_ids(n, args.input_len, len(tok), set(tok.all_special_ids), seed=SEED + 1)
    rows = [r[: rng.randint(max(1, args.input_len // 4), args.input_len)] for r in rows]
    common = dict(max_new_tokens=steps, do_sample=False, temperature=None, top_p=None, top_k=None,
                  output_logits=True, return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    model.set_attn_implementation("sdpa")
    enc = tok.pad({"input_ids": rows}, padding=True, return_tensors="pt").to(device)
    with torch.inference_mode():
        want = model.generate(**enc, **common)
    # ours: the engine's call as `_static_call` makes it (dummy rows to the slots, the bucketed cache length, the
    # same CompileConfig object), at the shape step 2 compiled when it ran
    slots, cache_len = (shape[0], shape[1]) if shape else (n, engine.cache_bucket(args.input_len + steps))
    slots, cache_len = max(slots, n), max(cache_len, engine.cache_bucket(args.input_len + steps))
    padded = rows + [rows[0]] * (slots - n)
    enc2 = tok.pad({"input_ids": padded}, padding=True, return_tensors="pt").to(device)
    config, _ = engine._static_compile_config(loaded)
    fixed = {"compile_config": config} if config is not None else {"disable_compile": True}
    with engine.padded_attention(loaded, on_cuda=True) as attn, torch.inference_mode():
        model._previous_max_cache_length = cache_len
        got = model.generate(**enc2, **common, cache_implementation="static", max_cache_len=cache_len, **fixed)
    lg_a = torch.stack(want.logits, 1).float()
    lg_b = torch.stack(got.logits, 1)[:n].float()
    seq_a = want.sequences[:, enc["input_ids"].shape[1]:]
    seq_b = got.sequences[:n, enc2["input_ids"].shape[1]:]
    differ = (seq_a != seq_b).any(0).nonzero()
    upto = max(int(differ[0]) if len(differ) else steps, 1)  # after a greedy divergence the inputs differ
    scale = lg_a.abs().amax().item()
    max_abs = (lg_a - lg_b)[:, :upto].abs().amax().item()
    tol = 0.05 * max(scale, 1.0) if dtype == torch.bfloat16 else 1e-3 * max(scale, 1.0)
    return {"rows": n, "slots": slots, "cache_len": cache_len, "attn_implementation": attn,
            "compiled": config is not None, "steps_compared": upto, "of_steps": steps, "max_abs_diff": max_abs,
            "max_abs_logit": scale, "tolerance": tol, "greedy_rows_equal": int((seq_a == seq_b).all(1).sum()),
            "passed": max_abs <= tol}


def _static_ratios(g1: dict) -> dict:
    ours, base = g1["engine"].get("static", {}), g1["baselines"].get("static_generate", {})
    out = {}
    for key in ("output_tok_s", "output_tok_s_incl_compile"):
        if ours.get(key):
            out[f"static_engine/bound ({key})"] = round(ours[key] / g1["bound_tok_s"], 4)
        if base.get(key):
            out[f"static_generate/bound ({key})"] = round(base[key] / g1["bound_tok_s"], 4)
        if ours.get(key) and base.get(key):
            out[f"static_engine/static_generate ({key})"] = round(ours[key] / base[key], 3)
    checks = g1["correctness"].values()
    out["correctness_passed"] = bool(checks) and all(c.get("passed") for c in checks)
    return out


def _print_static(g1: dict) -> None:
    w = g1["workload"]
    print()
    print(f"G1 static phase on {g1['device']}: {w['prompts']} prompts × {w['input_tokens']} in + "
          f"{w['output_tokens']} out, batch {w['batch']}, EOS off; torch {g1['torch']}, transformers "
          f"{g1['transformers']}; commit {str(g1.get('commit'))[:12]}")
    print(f"{'':<40} {'tok/s':>9} {'tok/s incl. compile':>20} {'compile s':>10} {'run s':>7} {'peak GiB':>9}")
    for name, e in (("plain generate, static cache, sdpa", g1["baselines"].get("static_generate")),
                    ("ours: engine static (sdpa_gqa)", g1["engine"].get("static"))):
        if e:
            peak = f"{e['peak_memory_bytes'] / 2**30:.1f}" if e.get("peak_memory_bytes") else "-"
            print(f"{name:<40} {e['output_tok_s']:>9,.0f} {e['output_tok_s_incl_compile']:>20,.0f} "
                  f"{e['compile_s']:>10.1f} {e['seconds']:>7.1f} {peak:>9}")
    print(f"{'bound (DESIGN.md)':<40} {g1['bound_tok_s']:>9,}")
    for k, v in g1["ratios"].items():
        print(f"  {k} = {v}")
    for k, v in g1["correctness"].items():
        print(f"  correctness {k}: passed {v.get('passed')} "
              f"({', '.join(f'{x}={v[x]}' for x in ('equal', 'rows', 'max_abs_diff', 'tolerance') if x in v)})")
    if g1["skipped"]:
        print("skipped:", g1["skipped"])
    if g1["errors"]:
        print("errors:", json.dumps(g1["errors"])[:2000])



# --- the service ---------------------------------------------------------------------------------------------


def run_service(args: argparse.Namespace, deadline: float, work: Path, out_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = text_prompts(tok, args.prompts, args.input_len)
    data = work / "g1.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "custom_id": f"g1-{i}"}) + "\n" for i, p in enumerate(prompts)))
    warm = work / "g1-warm.jsonl"
    warm.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts[:16]))
    report: dict = {"prompt_check": f"{len(prompts)} text prompts, each {args.input_len} tokens by tok(prompt)"}
    t = time.monotonic()
    up = subprocess.run([sys.executable, "-m", "api", "up", "--detach", "--gpus", args.up_gpus, "--port",
                         str(args.port)], capture_output=True, text=True)
    report["up_s"] = round(time.monotonic() - t, 2)
    if up.returncode != 0:
        raise RuntimeError(f"gpujobs up failed: {up.stderr[-2000:]}")
    log(f"stack up in {report['up_s']} s")
    try:
        _service_jobs(args, deadline, data, warm, report)
    finally:
        subprocess.run([sys.executable, "-m", "api", "down"], capture_output=True, text=True)
        home = Path(os.environ.get("JOBS_HOME", "~/.gpujobs")).expanduser()
        for name in ("worker-0.log",):
            if (home / "logs" / name).exists():
                shutil.copy(home / "logs" / name, out_dir / f"g1-{name}")
    return report


def _service_jobs(args, deadline: float, data: Path, warm: Path, report: dict) -> None:
    from api.client import Client
    from core.errors import JobsError

    client = Client()  # after `up`: settings (token, URL) are read on first use
    report["workers"] = client.workers()
    base = {"model": str(args.model), "ignore_eos": True, "batch_rows": args.batch_rows,
            "shard_rows": args.shard_rows, "gpus": args.spec_gpus}
    t = time.monotonic()
    job = client.submit({**base, "input": client.upload(warm)["id"], "max_new_tokens": 16, "name": "g1-warm-up"})
    job = client.wait(job["id"], poll=0.5, timeout=max(deadline - time.monotonic() - 60, 10))
    report["warm_up"] = {"id": job["id"], "state": job["state"], "wall_s": round(time.monotonic() - t, 2),
                         "load_options": job["load_options"], "error": job["error"]}
    log(f"warm-up job {job['state']} in {report['warm_up']['wall_s']} s")
    if job["state"] != "succeeded":
        raise RuntimeError(f"warm-up job {job['state']}: {job['error']}")
    t = time.monotonic()
    file_id = client.upload(data)["id"]
    job = client.submit({**base, "input": file_id, "max_new_tokens": args.new_tokens, "name": "g1"})
    report["submit_s"] = round(time.monotonic() - t, 2)
    log(f"G1 job {job['id']} submitted ({report['submit_s']} s incl. upload); waiting")
    try:
        job = client.wait(job["id"], poll=1.0, timeout=max(deadline - time.monotonic() - 10, 10))
    except JobsError as exc:
        report["timeout"] = str(exc)
        client.cancel(job["id"])
        job = client.job(job["id"])
    report["job"] = {k: job.get(k) for k in ("id", "state", "error", "tokens", "metrics", "load_options",
                                             "created_at", "started_at", "finished_at")}
    report.update(_sql_numbers(job["id"]))


def _after_first(rows: int, completion: int | None, commits: list[float], first_shard: float | None) -> float | None:
    """Throughput over the micro-batches after the first (equal-sized batches of equal rows assumed, as in G1)."""
    if not (rows and completion and first_shard) or len(commits) < 2:
        return None
    return round(completion * (len(commits) - 1) / len(commits) / (commits[-1] - commits[0]), 1)


def _sql_numbers(job_id: str) -> dict:
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import JobRow, Shard

    with session_scope() as s:
        r = s.execute(select(
            func.count(), func.sum(JobRow.completion_tokens), func.sum(JobRow.prompt_tokens),
            func.min(JobRow.prompt_tokens), func.max(JobRow.prompt_tokens), func.min(JobRow.completion_tokens),
            func.max(JobRow.completion_tokens), func.max(JobRow.executions), func.min(JobRow.started_at),
            func.max(JobRow.finished_at),
        ).where(JobRow.job_id == job_id, JobRow.state == "succeeded")).one()
        commits = sorted(t for (t,) in s.execute(select(JobRow.finished_at).where(
            JobRow.job_id == job_id, JobRow.finished_at.is_not(None)).distinct()))
        shards = s.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.idx)).all()
        shard_info = [{"idx": sh.idx, "state": sh.state, "attempts": sh.attempts, "started_at": sh.started_at,
                       "finished_at": sh.finished_at, "metrics": sh.metrics} for sh in shards]
    rows, completion, prompt, pmin, pmax, cmin, cmax, execs, row_start, row_end = r
    first_shard = min((sh["started_at"] for sh in shard_info if sh["started_at"]), default=None)
    window = (row_end - first_shard) if (row_end and first_shard) else None
    out = {
        "rows_succeeded": rows, "completion_tokens": completion, "prompt_tokens": prompt,
        "prompt_tokens_min_max": [pmin, pmax], "completion_tokens_min_max": [cmin, cmax], "max_executions": execs,
        "first_shard_started_at": first_shard, "last_row_finished_at": row_end, "window_s": window and round(window, 3),
        "output_tok_s": round(completion / window, 1) if (window and completion) else None,
        "throughput_definition": "sum(job_rows.completion_tokens) / (max(job_rows.finished_at) - "
                                 "min(shards.started_at)), read with core.db.session_scope from JOBS_HOME's SQLite",
        # each micro-batch commits its rows with one finished_at: the gaps are the per-batch times
        "commit_times_s": [round(c - first_shard, 3) for c in commits] if first_shard else commits,
        "output_tok_s_after_first_micro_batch": _after_first(rows, completion, commits, first_shard),
        "shards": shard_info,
    }
    return out


# --- GPU utilisation sampling ----------------------------------------------------------------------------------


def start_sampler(path: Path):
    if not shutil.which("nvidia-smi"):
        return None
    f = path.open("w")
    return subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,utilization.gpu,memory.used,power.draw,"
                             "clocks.sm", "--format=csv,noheader,nounits", "-lms", "500"], stdout=f,
                            stderr=subprocess.DEVNULL), f


def utilisation(path: Path, windows: dict[str, tuple[float, float]]) -> dict:
    """Mean / median GPU utilisation (nvidia-smi's 'fraction of time a kernel ran') per phase window."""
    samples = []
    for line in path.read_text().splitlines() if path.exists() else []:
        parts = [p.strip() for p in line.split(",")]
        try:
            ts = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            samples.append((ts, float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])))
        except (ValueError, IndexError):
            continue
    result = {}
    for name, (a, b) in windows.items():
        inside = [s for s in samples if a <= s[0] <= b]
        if inside:
            util = sorted(s[1] for s in inside)
            result[name] = {"samples": len(inside), "util_mean_pct": round(sum(util) / len(util), 1),
                            "util_median_pct": util[len(util) // 2], "mem_used_mib_max": max(s[2] for s in inside),
                            "power_w_mean": round(sum(s[3] for s in inside) / len(inside), 1),
                            "sm_clock_mhz_mean": round(sum(s[4] for s in inside) / len(inside))}
    return result


# --- main ---------------------------------------------------------------------------------------------------------


def commit_info() -> dict:
    info = {"commit": os.environ.get("G1_COMMIT"), "tree_note": os.environ.get("G1_TREE_NOTE")}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        info["commit"] = head.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        info["modified"] = [ln[3:] for ln in dirty.splitlines() if ln[:2].strip() and not ln.startswith("??")]
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "ops" / "bench" / "results" / "g1.json")
    p.add_argument("--model", type=Path, default=Path("/tmp/g1-model"), help="built there if missing")
    p.add_argument("--arch", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b", help="tiny: CPU smoke test")
    p.add_argument("--prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--padded-batch", type=int, default=256)
    p.add_argument("--static-batch", type=int, default=1024)
    p.add_argument("--batch-rows", type=int, default=256, help="service: rows per micro-batch")
    p.add_argument("--shard-rows", type=int, default=1024, help="service: rows per shard")
    p.add_argument("--slow", action="store_true", help="also generate_batch with its defaults (last, if time fits)")
    p.add_argument("--slow-prompts", type=int, default=0, help="prompts for --slow (default: all)")
    p.add_argument("--skip", default="", help="comma list of padded,static,service")
    p.add_argument("--budget-s", type=float, default=530, help="wall-clock budget for the whole script")
    p.add_argument("--service-reserve-s", type=float, default=180, help="kept for the service phase")
    p.add_argument("--up-gpus", default="0", help="`gpujobs up --gpus` (none: a CPU worker)")
    p.add_argument("--spec-gpus", type=int, default=1)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--work", type=Path, default=Path("/tmp/g1-work"))
    p.add_argument("--phase", default="main", help="main: the whole G1 run; engine: the short in-process engine "
                   "check (correctness of sdpa_gqa and both engines, then padded sdpa vs sdpa_gqa vs our engines); "
                   "static: engine static vs plain static-cache generate, correctness first (--budget-s 170)")
    p.add_argument("--estimate-scale", type=float, default=1.0,
                   help="static phase: scale its per-step time estimates (the budget check; e.g. 0 on CPU)")
    p.add_argument("--qa-model", type=Path, default=Path("/tmp/g1-qa-model"),
                   help="engine phase: the tiny memorized model for the greedy-equality check (built if missing)")
    p.add_argument("--phases", default="", help=argparse.SUPPRESS)
    p.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.phases = [x for x in args.phases.split(",") if x]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.phase == "inproc":
        return run_inproc(args)
    if args.phase == "engine":
        return run_engine_check(args)
    if args.phase == "static":
        return run_static_check(args)
    t_start = time.monotonic()
    deadline = t_start + args.budget_s
    skip = {x for x in args.skip.split(",") if x}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    out_dir = args.out.parent
    g1: dict = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **commit_info(),
        "workload": {"arch": args.arch, "prompts": args.prompts, "input_tokens": args.input_len,
                     "output_tokens": args.new_tokens, "eos": "off", "decoding": "greedy", "dtype": "bfloat16",
                     "attn_implementation": "sdpa (default)"},
        "bound_tok_s": BOUND_TOK_S, "baselines": {}, "service": {}, "skipped": [], "errors": {},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("phase", "phases", "child_out")},
    }
    try:
        g1["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    except OSError:
        g1["nvidia_smi"] = None

    def save() -> None:
        args.out.write_text(json.dumps({"g1": g1}, indent=2, default=str))

    if not (args.model / "model.safetensors").exists():
        t = time.monotonic()
        cmd = [sys.executable, "-m", "worker.tinymodel", str(args.model)]
        cmd += ["--arch", "qwen3-0.6b"] if args.arch == "qwen3-0.6b" else ["--steps", "1"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        g1["model_build_s"] = round(time.monotonic() - t, 2)
        log(f"built {args.model} in {g1['model_build_s']} s")
    sampler = start_sampler(out_dir / "g1-nvidia-smi.csv")
    windows: dict[str, tuple[float, float]] = {}
    remaining = lambda: deadline - time.monotonic()  # noqa: E731

    phases = [p for p in ("padded", "static") if p not in skip]
    reserve = 0 if "service" in skip else args.service_reserve_s
    if phases and remaining() - reserve > 60:
        w0 = time.time()
        child = run_child(args, phases, remaining() - reserve, args.work)
        windows["inproc"] = (w0, time.time())
        for key in ("torch", "transformers", "cuda", "device_name", "device_memory_bytes", "load_s"):
            if key in child:
                g1[key] = child[key]
        if "generate_padded" in child:
            g1["baselines"][f"generate_padded_{args.padded_batch}"] = child["generate_padded"]
        if "static_cache" in child:
            g1["baselines"][f"static_cache_{args.static_batch}"] = child["static_cache"]
        g1["errors"].update(child.get("errors", {}))
        windows.update({k: tuple(v) for k, v in child.get("windows", {}).items()})
    else:
        g1["skipped"] += phases
    save()

    if "service" not in skip and remaining() > 90:
        w0 = time.time()
        try:
            g1["service"] = run_service(args, deadline, args.work, out_dir)
            svc = g1["service"]
            if svc.get("first_shard_started_at") and svc.get("last_row_finished_at"):
                a, b = svc["first_shard_started_at"], svc["last_row_finished_at"]
                windows["service job"] = (a, b)
                if len(svc["commit_times_s"]) > 1:
                    windows["service job after first micro-batch"] = (a + svc["commit_times_s"][0], b)
        except Exception as exc:
            g1["errors"]["service"] = f"{type(exc).__name__}: {exc}"
            log(f"service phase failed: {exc!r}")
        windows["service"] = (w0, time.time())
    elif "service" not in skip:
        g1["skipped"].append("service")
    save()

    if args.slow:
        n = args.slow_prompts or args.prompts
        estimate = n * args.new_tokens / 1200 + 60  # DESIGN.md: ≈1.2–1.4k tok/s, plus start and CUDA-graph warm-up
        if remaining() > estimate:
            w0 = time.time()
            child = run_child(args, ["slow"], remaining(), args.work)
            windows["generate_batch"] = (w0, time.time())
            if "generate_batch_defaults" in child:
                g1["baselines"]["generate_batch_defaults"] = child["generate_batch_defaults"]
            g1["errors"].update(child.get("errors", {}))
            windows.update({k: tuple(v) for k, v in child.get("windows", {}).items()})
        else:
            g1["skipped"].append(f"generate_batch_defaults (estimated {estimate:.0f} s, {remaining():.0f} s left)")

    if sampler:
        sampler[0].terminate()
        sampler[0].wait()
        sampler[1].close()
        g1["gpu_utilisation"] = utilisation(out_dir / "g1-nvidia-smi.csv", windows)
    g1["ratios"] = ratios(g1)
    g1["total_s"] = round(time.monotonic() - t_start, 1)
    save()
    print_table(g1)
    log(f"wrote {args.out}")
    return 0 if not g1["errors"] else 1


def ratios(g1: dict) -> dict:
    rates = {name: b.get("output_tok_s") for name, b in g1["baselines"].items()}
    rates["service"] = g1["service"].get("output_tok_s")
    out = {f"{name}/bound": round(v / g1["bound_tok_s"], 4) for name, v in rates.items() if v}
    svc = rates.get("service")
    if svc:
        out.update({f"service/{name}": round(svc / v, 3) for name, v in rates.items() if v and name != "service"})
    return out


def print_table(g1: dict) -> None:
    def gib(b):
        return f"{b / 2**30:.1f}" if b else "-"

    print()
    print(f"G1 on {g1.get('device_name', '?')}: {g1['workload']['prompts']} prompts × {g1['workload']['input_tokens']} "
          f"in + {g1['workload']['output_tokens']} out, EOS off; torch {g1.get('torch')}, transformers "
          f"{g1.get('transformers')}; commit {str(g1.get('commit'))[:12]}")
    print(f"{'engine':<34} {'out tok/s':>10} {'÷ bound':>8} {'seconds':>9} {'compile/warm s':>15} {'peak GiB':>9} "
          f"{'after 1st batch':>15}")
    bound = g1["bound_tok_s"]
    for name, b in g1["baselines"].items():
        secs = b.get("second_run_s", b.get("seconds"))
        warm = b.get("compile_warmup_s", b.get("small_first_call_s", "-"))
        rate = b.get("output_tok_s")
        label = name + (f" ({b['prompts']} prompts)" if name == "generate_batch_defaults" else "")
        after = b.get("output_tok_s_after_first_call")
        print(f"{label:<34} {rate or 0:>10,.0f} {(rate or 0) / bound:>8.3f} {secs or 0:>9.1f} {warm!s:>15} "
              f"{gib(b.get('peak_memory_bytes')):>9} {f'{after:,.0f}' if after else '-':>15}")
    s = g1["service"]
    if s.get("output_tok_s"):
        peak = max((sh.get("metrics") or {}).get("peak_memory_bytes", 0) for sh in s.get("shards", [{}]))
        label = f"service (batch_rows {g1['settings']['batch_rows']}, warm)"
        after = s.get("output_tok_s_after_first_micro_batch")
        print(f"{label:<34} {s['output_tok_s']:>10,.0f} {s['output_tok_s'] / bound:>8.3f} "
              f"{s['window_s']:>9.1f} {'-':>15} {gib(peak):>9} {f'{after:,.0f}' if after else '-':>15}")
    print(f"{'bound (DESIGN.md)':<34} {bound:>10,}")
    for k, v in g1["ratios"].items():
        if k.startswith("service/"):
            print(f"  {k} = {v}")
    if g1.get("gpu_utilisation"):
        print("GPU utilisation (nvidia-smi, 0.5 s samples), mean / median %, mean W:")
        for k, v in g1["gpu_utilisation"].items():
            print(f"  {k:<40} {v['util_mean_pct']:>5} / {v['util_median_pct']:>5}  {v['power_w_mean']:>6} W")
    if g1["skipped"]:
        print("skipped:", g1["skipped"])
    if g1["errors"]:
        print("errors:", json.dumps(g1["errors"])[:2000])


if __name__ == "__main__":
    sys.exit(main())
