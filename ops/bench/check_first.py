"""CHECK_FIRST on a model that writes what its schema allows (issue 26): G1-JSON's schema, a model that follows it.

G1-JSON's benchmark model has random weights: it writes no JSON of its own, so `grammar.CHECK_FIRST` (pick a
constrained row's token without its mask, check it when booked, mask only after a refusal) gives up after its
first CHECK_SAMPLE tokens there, and `gen.py g1json`'s `other_check_gain` can only show what that costs. A real
model asked for JSON mostly writes JSON the schema allows, which is the case the lever is for. This script times
that case: a tiny model (worker/tinymodel.py) memorizes `--answers` objects of G1-JSON's schema (a name, a count,
a kind; compact), and the fast engine answers `--rows` prompts (its questions in turn) under the schema, CHECK_FIRST
off, on, and on without its per-row give-up (CHECK_ROW_GIVE_UP 0: `rows_kept`), and the same rows unconstrained
(`unconstrained`: no response_format, the model writes what it memorized), interleaved `--repeat` times, after a
warm-up of each. `constrained_vs_unconstrained` (CHECK_FIRST's output tok/s over the unconstrained run's) is issue
26's G1-JSON ratio on a model that writes JSON, where gen.py's g1json measures a random model's worst case.
`--spaced` memorizes them as many real models write JSON, with a space after each `:` and `,`; `--spaced 0.25` only
a quarter of them. The JSON grammar allows one space between tokens (since 2026-12-06);
`--compact` constrains to compact JSON, as it did before, which refuses each of a spaced model's spaces (the case
where checking may cost more than it saves). `--tokenizer-size` gives the model a larger tokenizer
(ops/bench/harness.py's: 151936 asks for a BPE of as many tokens as its corpus teaches, ~89k), whose masks cost what
a real model's do.

    python ops/bench/check_first.py --out ops/bench/results/check-first.json    # CPU or GPU
    python ops/bench/check_first.py --tokenizer-size 151936 --out ...          # ~100 s more to build, on CPU

Reports each run's seconds and the engine's timers (`mask_s`: the masks, `book_s`: the booking, `steps`), the
tokens checked and refused, the median seconds and spread of each way, `check_first_gain` (off / on),
`row_give_up_gain` (`rows_kept` / on: > 1, the per-row give-up saves time), and the correctness: every output valid
against the schema, how many are the memorized object, the same outputs every way. On a GPU the tiny model's
forward is short, so the host's work (masks, booking) is most of a step and the gain is an upper bound for a real
model's; on CPU the forward is most of a step (ops/bench/results/2026-12-06-cpu-check-first), and the fast engine
runs `--slots` rows at a time (slot_state.CPU_SLOTS).
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gen import SCHEMA_G1JSON, valid_g1json  # noqa: E402

from ops.bench import harness  # noqa: E402

FORMAT = {"type": "json_schema", "json_schema": {"name": "g1json", "schema": SCHEMA_G1JSON, "strict": True}}
COMPACT = {**SCHEMA_G1JSON, "x-guidance": {"whitespace_flexible": False}}  # --compact: no space between tokens
NAMES = "lamp river copper orbit maple quartz harbor violet ember cedar falcon lantern meadow pebble".split()


def answers(n: int, spaced: float = 0.0) -> list[tuple[str, str]]:
    """`n` (question, answer) pairs: each answer an object of G1-JSON's schema, compact (the grammar's form) or,
    for the first `spaced` share of them, with json.dumps' default separators."""
    rng = random.Random(harness.SEED)
    pairs = []
    for i in range(n):
        name = " ".join(rng.sample(NAMES, rng.randint(1, 3)))
        obj = {"name": name, "count": rng.randint(0, 100_000), "kind": rng.choice(["alpha", "beta", "gamma"])}
        compact = i >= round(spaced * n)
        pairs.append((f"record {i} as JSON", json.dumps(obj, separators=(",", ":") if compact else None)))
    return pairs


def same_object(text: str, answer: str) -> bool:
    """Whether `text` is the JSON object `answer` (spaces apart: the grammar writes it compact)."""
    try:
        return json.loads(text) == json.loads(answer)
    except ValueError:
        return False


def main() -> int:
    p = harness.parser(__doc__, out=harness.RESULTS / "check-first.json")
    p.add_argument("--model", type=Path, help="built there if missing (default /tmp/gpujobs-check-first-SIZE)")
    p.add_argument("--tokenizer-size", type=int, default=640, help="640: tinymodel's own; more: a trained BPE")
    p.add_argument(
        "--spaced",
        type=float,
        nargs="?",
        const=1.0,
        default=0.0,
        help="the share of answers memorized with spaces after ':' and ',' (alone: all of them)",
    )
    p.add_argument(
        "--compact",
        action="store_true",
        help="constrain to compact JSON (no space between tokens: a --spaced model's spaces are refused)",
    )
    p.add_argument("--answers", type=int, default=24, help="objects the model memorizes")
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--slots", type=int, default=256, help="rows at a time on CPU (slot_state.CPU_SLOTS)")
    args = p.parse_args()
    log = harness.logger("check_first")

    import torch

    from core.spec import GenerateSpec
    from worker import generate as engine
    from worker import tinymodel
    from worker.engines import grammar, slot_state
    from worker.loader import load

    pairs = answers(args.answers, args.spaced)
    spaced = f"-spaced-{args.spaced:g}" if args.spaced else ""
    args.model = args.model or Path(f"/tmp/gpujobs-check-first-{args.tokenizer_size}{spaced}")
    if not (args.model / "model.safetensors").exists():
        t = time.monotonic()
        tok = harness.tokenizer(args.tokenizer_size) if args.tokenizer_size != 640 else None
        tinymodel.build_model(args.model, qa=pairs, tok=tok)
        log(f"built {args.model} in {time.monotonic() - t:.1f} s")
    meta = json.loads((args.model / "gpujobs_tiny.json").read_text())
    if not meta.get("memorized"):
        raise SystemExit(f"{args.model} did not memorize its answers ({meta}): remove it and run again")
    cuda = torch.cuda.is_available()
    slot_state.CPU_SLOTS = args.slots
    fmt = {**FORMAT, "json_schema": {**FORMAT["json_schema"], "schema": COMPACT}} if args.compact else FORMAT
    fields = {"model": str(args.model), "input": "x", "engine": "fast", "prefix_cache": "off"}
    plain, spec = GenerateSpec.model_validate(fields), GenerateSpec.model_validate({**fields, "response_format": fmt})
    loaded = load(spec, gpus=1 if cuda else 0)
    want = {i: pairs[i % len(pairs)][1] for i in range(args.rows)}
    rows = [(i, {"prompt": pairs[i % len(pairs)][0], "params": {"max_new_tokens": 48}}) for i in range(args.rows)]
    out: dict = {"runs": {}, "correctness": {}}
    outputs: dict[str, dict[int, str]] = {}
    saved = grammar.CHECK_FIRST, grammar.CHECK_ROW_GIVE_UP
    ways = {"masked": (False, None), "check_first": (True, None), "rows_kept": (True, 0)}  # CHECK_ROW_GIVE_UP 0
    ways["unconstrained"] = (False, None)  # the plain spec: no grammar

    def timed(name: str, way: str, these: list) -> dict:
        grammar.CHECK_FIRST, give_up = ways[way]
        grammar.CHECK_ROW_GIVE_UP = saved[1] if give_up is None else give_up
        info: dict = {}
        harness.sync()
        t = time.perf_counter()
        this = plain if way == "unconstrained" else spec
        results = [r for b in engine.generate(loaded, this, these, batch_rows=256, info=info) for r in b]
        harness.sync()
        seconds = time.perf_counter() - t
        fast = info.get("fast", {})
        keys = ("steps", "mask_s", "book_s", "wait_s", "grammar_checked", "grammar_refused", "grammar_check_stopped")
        run = {
            "seconds": round(seconds, 3),
            "output_tokens": sum(r.completion_tokens or 0 for r in results),
            "failed": sum(r.error is not None for r in results),
            **{key: fast.get(key) for key in keys},
        }
        outputs[way] = {r.idx: r.output for r in results}
        if name:
            out["runs"][name] = run
            log(f"{name}: {seconds:.2f} s, {run}")
        return run

    try:
        for way in ways:  # warm-up: the grammar compiled, the engine's state made
            timed("", way, rows[:64])
        seconds: dict[str, list[float]] = {way: [] for way in ways}
        tok_s: dict[str, list[float]] = {way: [] for way in ways}
        for i in range(max(1, args.repeat)):
            for way in ways:
                run = timed(f"{way}_{i + 1}", way, rows)
                seconds[way].append(run["seconds"])
                tok_s[way].append(run["output_tokens"] / run["seconds"])
    finally:
        grammar.CHECK_FIRST, grammar.CHECK_ROW_GIVE_UP = saved
    stats = {name: harness.repeated(values) for name, values in seconds.items()}
    rates = {name: harness.repeated(values) for name, values in tok_s.items()}
    masked, checked, kept = (stats[way]["median"] for way in ("masked", "check_first", "rows_kept"))
    for name in ways:
        got = outputs[name]
        out["correctness"][name] = {
            "valid": sum(valid_g1json(got[i]) for i in got),
            "memorized": sum(same_object(got[i], want[i]) for i in got),
            "rows": len(got),
        }
    constrained = [way for way in ways if way != "unconstrained"]  # the model's own outputs need not be valid
    same = [sum(outputs[way][i] == outputs["masked"][i] for i in outputs["masked"]) for way in constrained]
    out["correctness"]["same_outputs"] = min(same)
    all_valid = all(out["correctness"][way]["valid"] == out["correctness"][way]["rows"] for way in constrained)
    out["correctness"]["passed"] = all_valid and min(same) == len(rows)
    out |= {
        "seconds": stats,
        "output_tok_s": rates,
        "check_first_gain": round(masked / checked, 3) if masked and checked else None,
        "constrained_vs_unconstrained": round(rates["check_first"]["median"] / rates["unconstrained"]["median"], 3),
        "masked_vs_unconstrained": round(rates["masked"]["median"] / rates["unconstrained"]["median"], 3),
        "row_give_up_gain": round(kept / checked, 3) if kept and checked else None,
        "row_give_up": saved[1],
        "compact": args.compact,
        "rows": args.rows,
        "answers": args.answers,
        "spaced": args.spaced,
        "slots": args.slots if not cuda else None,
        "tokenizer_size": len(loaded.tokenizer),
        "grammar": {"families": grammar.FAMILIES, "family_threads": grammar.FAMILY_THREADS, "overlap": grammar.OVERLAP},
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        **harness.commit_info(),
    }
    harness.write_json(args.out, out)
    print(f"\nCHECK_FIRST on a model that follows G1-JSON's schema: {args.rows} rows, {out['device']}")
    for name, s in stats.items():
        print(f"  {name:<14} median {s['median']:.3f} s (spread {s['spread']})")
    print(f"  check_first_gain = {out['check_first_gain']}, row_give_up_gain = {out['row_give_up_gain']}")
    print(
        f"  output tok/s against the unconstrained run: check_first {out['constrained_vs_unconstrained']}, "
        f"masked {out['masked_vs_unconstrained']}"
    )
    print(f"  correctness = {json.dumps(out['correctness'])}")
    return 0 if out["correctness"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
