"""Tuning runs for the fast engine on a GPU (issue 6): which decode-kernel launch configuration, and what compiling
the decoder layers buys, measured as milliseconds per decode step and prefill seconds on G1-shaped rows.

    python ops/bench/fast_tune.py --out ops/bench/results/fast-tune.json     # on the H200

(The kernel's launch configurations are measured by ops/bench/decode_kernel.py.)

1. engine: 1024 G1 prompts (256 tokens) × `--new` tokens through `fastgen.Engine`, compiled and not; per-step
   decode time = decode seconds / steps, prefill seconds, first-prefill and capture seconds (compile);
2. profile: the top CUDA kernels of one eager decode step (no graph, not compiled), by total time.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench import harness  # after the repository root is on sys.path


def engine_runs(torch, args, out: dict) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from core.spec import GenerateSpec, sampling_of
    from worker.engines import fastgen, slot_state
    from worker.engines.common import Prepared
    from worker.loader import Loaded

    model = AutoModelForCausalLM.from_pretrained(
        args.model, dtype=torch.bfloat16, device_map="cuda", attn_implementation="sdpa"
    ).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    loaded = Loaded(model, tok, model.device, {})
    import random

    rng = random.Random(0)
    ids = [[rng.randrange(1000, 100000) for _ in range(256)] for _ in range(1024)]
    spec = GenerateSpec(model=str(args.model), input="x", ignore_eos=True, max_new_tokens=args.new, engine="fast")
    params = sampling_of(spec, None)
    out["engine"] = []
    for compiled in (False, True, True):
        slot_state.release(model)
        seqs = [fastgen.Seq(Prepared(i, params, ids[i]), 0) for i in range(1024)]
        state = slot_state.state_for(model, loaded.device, model.get_output_embeddings().weight.shape[0])
        if not compiled:
            state.compiled = None
        eng = fastgen.Engine(loaded, state, set(), slots=1024, graphs=True, compiled=compiled)
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.inference_mode():
            n = sum(len(s.tokens) for finished in eng.run(seqs, lambda: False) for s in finished)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        stats: dict = {"runs": 0, "steps": 0, "prefill_s": 0.0, "decode_s": 0.0}
        eng.record(stats)
        row = {
            "compiled": compiled,
            "tokens": n,
            "wall_s": round(wall, 3),
            "tok_s": round(n / wall, 1),
            "decode_ms_per_step": round(1000 * eng.decode_s / max(eng.steps, 1), 3),
            **stats,
        }
        out["engine"].append(row)
        print(row, flush=True)
        if compiled:
            model.__dict__.pop("_gpujobs_fast", None)  # keep compiled wrappers? no: a fresh state each run
    slot_state.release(model)

    # 3. profile one eager decode step
    state = slot_state.state_for(model, loaded.device, model.get_output_embeddings().weight.shape[0])
    eng = fastgen.Engine(loaded, state, set(), slots=1024, graphs=False, compiled=False)
    seqs = [fastgen.Seq(Prepared(i, params, ids[i]), 0, slot=i) for i in range(1024)]
    free = list(range(state.pages - 1, 0, -1))
    for seq in seqs:
        seq.pages = [free.pop() for _ in range(seq.pages_needed)]
    with torch.inference_mode():
        for start in range(0, 1024, 128):
            eng.prefill(seqs[start : start + 128])
        state.pos[:1024] += 128  # contexts of ~384 like G1's middle
        eng._decode(1024, False)
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng._decode(1024, False)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table, flush=True)
    out["profile_top"] = table


def main() -> int:
    import torch

    p = harness.parser(__doc__, out=harness.RESULTS / "fast-tune.json", model=Path("/tmp/g1-model"))
    p.add_argument("--new", type=int, default=64, help="new tokens per row")
    p.add_argument("--skip", default="", help="comma list of phases to skip: engine")
    args = p.parse_args()
    harness.ensure_model(args.model, "--arch", "qwen3-0.6b")
    out: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, **harness.commit_info()}
    box = harness.TimeBox(float("inf"), out, save=lambda: harness.write_json(args.out, out))
    for name, fn in (("engine", lambda: engine_runs(torch, args, out)),):
        if name not in args.skip:
            box.run(name, 0, fn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
