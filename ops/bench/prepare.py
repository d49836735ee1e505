"""A worker's preparation of the fast engine (compiled layers) in fresh processes, from an empty compile cache and
then from the one it filled: Dynamo's frames and graphs, its seconds, and the engine's compile seconds.

    python ops/bench/prepare.py --out ops/bench/results/prepare.json     # --runs cold,warm,warm --slots 8
    python ops/bench/prepare.py --runs cold,warm,warm:1,warm:2:greedy,warm:1:greedy   # CUDA: the capture's options

Each run is a new Python process, as a restarted worker is: it points the compile cache at `--work`/home
(worker/compile_cache.py), does what a worker does at start-up (worker/preload.py: its imports and, on CUDA,
Inductor's source hashes; `imports_s`), loads the model (Qwen3-0.6B's shape, random weights, built if missing) and
calls `fastgen.prepare` with the layers compiled (Inductor: C++ on CPU, Triton on CUDA) and, on CUDA, the decode
step's graphs, so that `prepare_s` is what a restarted worker pays when it loads the model. It reports `compile_s`
(the warm-up: Dynamo, the compile cache, and the warm-up's own forwards), Dynamo's frames and unique graphs and its
`_compile` seconds (tracing, guards, loading what the cache holds), and on CUDA `capture_s` and the graphs
captured. A run is `kind[:warm-up runs per capture[:modes[:imports]]]`: kind `cold` (an empty compile cache) or
`warm`, `fastgen.CAPTURE_WARMUPS` (default 2), modes `both` (greedy and sampling graphs, as before 2026-12-05) or
`greedy` (what a worker loading for a greedy job captures now), then `preloaded` (default: the child's start-up runs
`preload.import_compiler`, as a worker's does) or `lazy` (it does not: the first compile imports those modules, as
before stop 37, 2026-12-05). On CPU the warm-up's forwards of the 0.6B model weigh in `compile_s`; Dynamo's
numbers are the host's alone and carry over to a GPU host. Until 2026-12-05 the child did not preload: Inductor's
import (~2 s) then fell in `prepare_s` (ops/bench/results/2026-12-05-h100-families).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from ops.bench import harness  # noqa: E402

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
from worker import compile_cache
compile_cache.use(Path(sys.argv[1]))
from worker import preload
if sys.argv[6] == "lazy":  # as before 2026-12-05: the first compile imports what it needs (in prepare_s)
    preload.import_compiler = lambda: None
preload.preload()  # what a worker imports and hashes at start-up, before its first job (imports_s)
import torch
from torch._dynamo.utils import compilation_time_metrics, counters
from ops.bench import harness
from worker.engines import fastgen, slot_state
from worker.engines.common import eos_ids
from worker.loader import Loaded
t1 = time.perf_counter()
cuda = torch.cuda.is_available()
model, tok = harness.load_plain(Path(sys.argv[2]), "cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32)
slot_state.CPU_SLOTS, slot_state.CPU_PAGES = int(sys.argv[3]), 64
fastgen.CAPTURE_WARMUPS = int(sys.argv[4])
sampling = (False,) if sys.argv[5] == "greedy" else (False, True)
t2 = time.perf_counter()
loaded = Loaded(model, tok, model.device, {})
state = fastgen.prepare(loaded, eos_ids(loaded), graphs=cuda, compiled=True, sampling=sampling)
t3 = time.perf_counter()
print(json.dumps({
    "imports_s": round(t1 - t0, 2), "load_s": round(t2 - t1, 2), "prepare_s": round(t3 - t2, 2),
    "compile_s": round(state.compile_s, 2), "capture_s": round(state.capture_s, 2), "captured": len(state.graphs),
    "frames": counters["frames"]["ok"],
    "graphs": counters["stats"]["unique_graphs"], "dynamo_s": round(sum(compilation_time_metrics.get("_compile.compile_inner", [])), 2),
    **{k: v for k, v in compile_cache.stats().items() if k in ("hits", "misses")},
}))
"""


def main() -> int:
    p = harness.parser(__doc__, out=None, model=ROOT / ".bench" / "qwen3-0.6b-random", work=None)
    p.add_argument(
        "--runs",
        default="cold,warm,warm",
        help="kind[:warm-up runs per capture[:both|greedy[:preloaded|lazy]]], comma-separated; kind cold: an empty "
        "compile cache, warm: the one the runs before filled; lazy: the first compile imports what preload's "
        "import_compiler would have",
    )
    p.add_argument("--slots", type=int, default=8, help="the engine's slots on CPU")
    args = p.parse_args()
    harness.ensure_model(args.model, "--arch", "qwen3-0.6b")
    work = args.work or Path(tempfile.mkdtemp(prefix="gpujobs-prepare-"))
    home = work / "home"
    runs = []
    for spec in args.runs.split(","):
        kind, warmups, modes, imports = (spec.split(":") + ["2", "both", "preloaded"][spec.count(":") :])[:4]
        if (
            kind not in ("cold", "warm")
            or modes not in ("both", "greedy")
            or imports not in ("preloaded", "lazy")
            or not warmups.isdigit()
        ):
            raise SystemExit(
                f"--runs: {spec!r} is not kind[:warm-up runs[:both|greedy[:preloaded|lazy]]] (e.g. warm:1:greedy)"
            )
        if kind == "cold":
            shutil.rmtree(home, ignore_errors=True)
        t = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", CHILD, str(home), str(args.model), str(args.slots), warmups, modes, imports],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if done.returncode:
            raise SystemExit(f"the {spec} run failed:\n{done.stderr[-3000:]}")
        run = {"run": spec, "process_s": round(time.perf_counter() - t, 2), **json.loads(done.stdout.splitlines()[-1])}
        runs.append(run)
        print(json.dumps(run))
        if args.out:  # after each run: a time box that cuts the next keeps this one
            harness.write_json(args.out, {"runs": runs, "commit": harness.commit_info(), "machine": harness.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
