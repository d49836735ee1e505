"""Where the fast engine's time goes on G1 and G2 (issue 25): the engine alone, warm, under torch.profiler and
cProfile, one process.

    python ops/bench/profile_gen.py g1 g2 --out $OUT/profile.json     # GPU host, repo root (~3 minutes)
    python ops/bench/profile_gen.py g1 --smoke --out /tmp/prof.json   # CPU: tiny model, a few rows

For each workload: one cold run (prepares the engine: compile, graph capture), `--repeat` warm runs timed plainly,
one warm run under torch.profiler (CPU + CUDA activities) and one under cProfile. It writes the device time per kernel
(the 40 largest, grouped by name), the device time split into prefill and decode by the profiler's record_function
ranges, the host's cumulative time per Python function (the 40 largest), and the engine's own counters
(prefill_s, decode_s, steps; each run's time outside both, `outside_s`, beside the host's booking and caller time
in it). What it answers: how far each part is from its floor (decode: KV bytes over
bandwidth; prefill: FLOPs over the matrix rate), and how much of a run is the host's (tokenizing, detokenizing,
result rows) rather than the GPU's. Each run sends prompts of its own (gen.py's `workload(..., run)`), so the
resident prefix cache serves none of them from an earlier run.

`--flip NAME` (FLIPS) measures one engine lever in the same process: every round runs the flag as it is and flipped,
interleaved, each way with the CUDA graphs it captured itself (its first run, cold, captures them), and reports
`flipped` (median and spread of the flipped runs) and `flip_gain`: the median as it is over the flipped median.
A name may flip several flags at once (`prefill_both`): the levers together, for a call that has time for one pair.
A setting that is a number (`pages`: the decode kernel's pages a step) is flipped to `--flip-to`'s value.
`--spec` sets fields of the runs' spec: `--spec '{"engine": "auto", "temperature": 1, "top_p": 0.9}' --flip
filtered_sampling` runs G1's rows sampling with top_p on the padded engine (the flag as it is, off) and on the fast
engine's filtered steps (flipped), in one process.

`--syncs`: one more warm run under CUDA's sync debug mode (with `--flip`, one each way: `flipped_syncs`), counting
the torch calls that made the host wait on the device, by where in this repository they came from (`syncs`; a
prefill chunk's launch waited ~41 ms of its ~85 ms on the H200, 2026-12-06, with no Python line to show for it).
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import importlib
import io
import json
import pstats
import sys
import time
import traceback
import warnings
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ops.bench import gen, harness  # after the repository root is on sys.path

log = harness.logger("profile")
FLIPS = {  # --flip NAME: the flags it flips, as (module, flag)
    "fold_write": [("worker.engines.decode_attention", "FOLD_WRITE")],  # the step's K/V write in the decode kernel
    "prefill_write": [("worker.engines.decode_attention", "PREFILL_WRITE")],  # a prefill chunk's K/V write kernel
    "sync_free": [("worker.engines.fastgen", "SYNC_FREE")],  # the slot state written without waiting for the GPU
    # top_k/top_p rows on the fast engine (its "filtered" steps) rather than padded: with --spec's top_p, engine auto
    "filtered_sampling": [("worker.engines.fastgen", "FILTERED_SAMPLING")],
    "prefill_both": [("worker.engines.decode_attention", "PREFILL_WRITE"), ("worker.engines.fastgen", "SYNC_FREE")],
    # a quantized cache's prefill write kernel (with --kv-cache-dtype fp8 or int8)
    "quant_prefill_write": [("worker.engines.decode_attention", "QUANT_PREFILL_WRITE")],
    # a launch setting of the decode kernel (a key of a dict), flipped to --flip-to's value: pages a step, warps
    "pages": [("worker.engines.decode_attention", "CONFIG", "pages")],
    "warps": [("worker.engines.decode_attention", "CONFIG", "warps")],
    "quant_pages": [("worker.engines.decode_attention", "QUANTIZED_CONFIG", "pages")],  # fp8/int8 pages' (with --kv...)
}


class Flag:
    """One flipped setting: a module's bool (`FOLD_WRITE`), or a key of a module's dict (`CONFIG["pages"]`), which is
    flipped to `to`."""

    def __init__(self, owner, attr: str, key: str | None = None, to: int | None = None):
        self.owner, self.attr, self.key, self.to = owner, attr, key, to
        self.name = f"{owner.__name__}.{attr}" + (f"[{key!r}]" if key else "")

    def get(self):
        value = getattr(self.owner, self.attr)
        return value[self.key] if self.key else value

    def set(self, value) -> None:
        if self.key:
            getattr(self.owner, self.attr)[self.key] = value
        else:
            setattr(self.owner, self.attr, value)

    def other(self, default):
        return self.to if self.key else not default


def synchronizing(torch, run) -> list[dict]:
    """Run `run()` under CUDA's sync debug mode: every torch call that makes the host wait on the device warns
    (`.item()`, a copy to pageable memory, ...; not an explicit event's wait). Returns where they came from, as this
    repository's innermost three frames, by count (nothing on a CPU)."""
    if not torch.cuda.is_available():
        run()
        return []
    sites: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(str(ROOT) + "/")]
        frames = [f for f in frames if "site-packages" not in f.filename]  # a virtual environment inside the tree
        frames = [f for f in frames if not f.filename.endswith("profile_gen.py")][-3:]
        where = " <- ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in reversed(frames))
        sites[f"{str(message)[:80]} @ {where or filename + ':' + str(lineno)}"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [{"site": site, "calls": n} for site, n in sites.most_common()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("workloads", nargs="+", choices=["g1", "g2"])
    p.add_argument("--model", type=Path, default=Path("/tmp/g1-model"), help="built there if missing")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, a few rows")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--repeat", type=int, default=3, help="warm runs timed plainly (median and spread reported)")
    p.add_argument("--profile", action="store_true", help="also a warm run under torch.profiler and one under cProfile")
    p.add_argument("--flip", choices=sorted(FLIPS), help="warm runs alternate this engine flag as it is and flipped")
    p.add_argument("--flip-to", type=int, help="the value a numeric --flip (pages, warps) is set to")
    p.add_argument("--syncs", action="store_true", help="also a warm run that counts where the host waits on CUDA")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "int8"], default="auto", help="the spec's cache type")
    p.add_argument(
        "--spec",
        type=json.loads,
        default={},
        help='fields of the runs\' spec, a JSON object: {"engine": "auto", "temperature": 1, "top_p": 0.9}',
    )
    args = p.parse_args(argv)
    numeric = args.flip and any(len(target) == 3 for target in FLIPS[args.flip])
    if numeric and args.flip_to is None:
        p.error(f"--flip {args.flip} is a number: give the value to flip it to with --flip-to")
    from core.spec import GenerateSpec

    if not isinstance(args.spec, dict):
        p.error(f"--spec takes a JSON object of spec fields, not {args.spec!r}")
    fields = {"ignore_eos": True, "engine": "fast", "kv_cache_dtype": args.kv_cache_dtype, **args.spec}
    try:
        spec = GenerateSpec(model=str(args.model), input="x", **fields)
    except ValueError as exc:  # pydantic's ValidationError is one
        p.error(f"--spec: {exc}")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    import torch

    from worker import generate as engine
    from worker.engines import fastgen, slot_state
    from worker.loader import Loaded

    cuda = torch.cuda.is_available()
    build = ["--steps", "1"] if args.smoke else ["--arch", "qwen3-0.6b"]
    built_s = harness.ensure_model(args.model, *build)
    model, tok = harness.load_plain(args.model, "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
    loaded = Loaded(model, tok, model.device, {})
    report: dict = {"commit": harness.commit_info(), "machine": harness.machine(), "model_built_s": built_s}
    report["kv_cache_dtype"] = args.kv_cache_dtype
    report["spec"] = args.spec
    if not cuda:
        fastgen.COMPILE_BACKEND = "eager"

    for name in args.workloads:
        data = gen.workload(name, tok, args.smoke)
        rows = [(i, {"prompt": p, "params": {"max_new_tokens": o}}) for i, (p, o) in enumerate(data)]

        def run(info: dict, number: int, name=name, rows=rows) -> tuple[float, int]:
            """Run `number` on prompts of its own (gen.workload's `run`): the resident prefix cache serves none of
            them from an earlier run."""
            prompts = gen.workload(name, tok, args.smoke, number)
            these = [(i, {**row, "prompt": p}) for (i, row), (p, _) in zip(rows, prompts)]
            harness.sync()
            t = time.perf_counter()
            tokens = sum(
                r.completion_tokens or 0
                for b in engine.generate(loaded, spec, these, batch_rows=256, info=info)
                for r in b
            )
            harness.sync()
            return time.perf_counter() - t, tokens

        result: dict = {"rows": len(rows), "warm": []}
        flags = [Flag(importlib.import_module(m), *rest, to=args.flip_to) for m, *rest in FLIPS.get(args.flip, [])]
        defaults = [flag.get() for flag in flags]  # each flag as it is
        graphs: dict[bool, dict] = {}  # the CUDA graphs of the way not running, swapped into the resident state
        ways, now = ((False, True) if flags else (False,)), [False]  # the way the flags are

        def turn(flipped: bool, flags=flags, defaults=defaults, graphs=graphs, now=now) -> None:
            """The flags flipped (or as they are), with the CUDA graphs that way captured itself."""
            for flag, default in zip(flags, defaults):
                flag.set(flag.other(default) if flipped else default)
            state = model.__dict__.get("_gpujobs_fast")
            if state is not None and now[0] != flipped:
                graphs[now[0]], state.graphs = state.graphs, graphs.get(flipped, {})
            now[0] = flipped

        number = 0
        for i in range(1 + args.repeat):
            for flipped in ways:
                turn(flipped)
                info: dict = {}
                number += 1
                seconds, tokens = run(info, number)
                fast = info.get("fast", {})
                one = {
                    "seconds": round(seconds, 3),
                    "output_tok_s": round(tokens / seconds, 1),
                    "prefill_s": fast.get("prefill_s"),
                    "decode_s": fast.get("decode_s"),
                    "steps": fast.get("steps"),
                    "prefix_tokens_reused": fast.get("prefix_tokens_reused"),
                    "capture_s": fast.get("capture_s"),
                    # the run's time outside both engine timers, and the host's parts of it (fastgen.Engine's
                    # book_s, mask_s, caller_s; wait_s is inside decode_s)
                    "outside_s": round(seconds - fast["prefill_s"] - fast["decode_s"], 3) if fast else None,
                    **{k: fast.get(k) for k in ("wait_s", "book_s", "mask_s", "caller_s", "prefill_chunks")},
                }
                way = ("flipped_" if flipped else "") + ("cold" if i == 0 else "warm")
                if i == 0:
                    result[way] = {**one, "fast": fast}
                else:
                    result.setdefault(way, []).append(one)
                log(f"{name} {way}: {tokens / seconds:,.0f} tok/s, {seconds:.2f} s, {one}")
        turn(False)
        if flags:
            names = [flag.name for flag in flags]
            as_is, other = defaults[0], flags[0].other(defaults[0])
            result["flip"] = {"flag": ", ".join(names), "as_is": as_is, "flipped": other}
            if len(flags) > 1:
                result["flip"]["flags"] = {f.name: {"as_is": d, "flipped": f.other(d)} for f, d in zip(flags, defaults)}
        if result["warm"]:
            stats = harness.repeated([r["output_tok_s"] for r in result["warm"]])
            result["warm_median_tok_s"], result["warm_spread"] = stats["median"], stats["spread"]
            log(f"{name} warm: median {result['warm_median_tok_s']:,.0f} tok/s, spread {result['warm_spread']:.1%}")
        if result.get("flipped_warm"):
            result["flipped"] = harness.repeated([r["output_tok_s"] for r in result["flipped_warm"]])
            result["flip_gain"] = round(result["warm_median_tok_s"] / result["flipped"]["median"], 4)
            turned = ", ".join(f"{flag.name} = {flag.other(default)}" for flag, default in zip(flags, defaults))
            log(
                f"{name} flipped ({turned}): median {result['flipped']['median']:,.0f} tok/s, spread "
                f"{result['flipped']['spread']:.1%}; as it is over flipped: {result['flip_gain']}"
            )
        for flipped in ways if args.syncs else ():
            turn(flipped)
            number += 1
            way = "flipped_syncs" if flipped else "syncs"
            result[way] = synchronizing(torch, partial(run, {}, number))
            for site in result[way][:10]:
                log(f"{name} {way}: {site['calls']} × {site['site']}")
        turn(False)
        if not args.profile:
            report[name] = result
            harness.write_json(args.out, report)
            slot_state.release(model)
            continue

        # host only: tokenizing and detokenizing the workload, as the engine does them
        from worker.engines.common import render_many

        t = time.perf_counter()
        ids = render_many(loaded, [r for _, r in rows])
        result["host_tokenize_s"] = round(time.perf_counter() - t, 3)
        outs = [[7] * o for _, o in data]
        t = time.perf_counter()
        for o in outs:
            tok.decode(o, skip_special_tokens=True)
        result["host_decode_per_row_s"] = round(time.perf_counter() - t, 3)
        t = time.perf_counter()
        tok.batch_decode(outs, skip_special_tokens=True)
        result["host_batch_decode_s"] = round(time.perf_counter() - t, 3)
        del ids, outs

        # the device's kernels, warm, grouped by name
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities, record_shapes=False) as prof:
            info = {}
            seconds, tokens = run(info, number + 1)
        result["profiled"] = {"seconds": round(seconds, 3), "output_tok_s": round(tokens / seconds, 1)}
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        averages = prof.key_averages()  # once: on G2's trace it took over a minute (2026-12-06, an H100)
        events = sorted(averages, key=lambda e: -getattr(e, key, 0))
        total = sum(getattr(e, key, 0) for e in events)
        result["kernels"] = [
            {
                "name": e.key[:160],
                "calls": e.count,
                "ms": round(getattr(e, key, 0) / 1e3, 3),
                "share": round(getattr(e, key, 0) / max(total, 1), 4),
            }
            for e in events[: args.top]
        ]
        result["device_ms_total"] = round(total / 1e3, 1)
        table = averages.table(sort_by=key, row_limit=args.top, max_name_column_width=90)
        args.out.with_name(f"{args.out.stem}-{name}-kernels.txt").write_text(table)

        # the host, warm: cumulative time per function
        profiler = cProfile.Profile()
        profiler.enable()
        seconds, _ = run({}, number + 2)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(args.top)
        args.out.with_name(f"{args.out.stem}-{name}-host.txt").write_text(text.getvalue())
        result["cprofiled_s"] = round(seconds, 3)
        report[name] = result
        harness.write_json(args.out, report)
        log(f"{name}: device total {result['device_ms_total']} ms in {result['profiled']['seconds']} s")
        for k in result["kernels"][:15]:
            log(f"  {k['ms']:>9.1f} ms {k['share']:6.1%} {k['calls']:>7} × {k['name'][:100]}")
        log(
            f"  host: tokenize {result['host_tokenize_s']} s, decode per row {result['host_decode_per_row_s']} s, "
            f"batch decode {result['host_batch_decode_s']} s"
        )
        slot_state.release(model)
    harness.write_json(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
