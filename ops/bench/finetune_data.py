"""How long a fine-tune's rows take to become training blocks (worker/training/data.py), on F1's corpus.

F1's rows (ops/bench/f1.py's corpus for 200 steps of 16 × 2,048 tokens: 13,423 rows, 7.3M tokens) are tokenized
two ways, interleaved `--repeat` times: one tokenizer call per text, as build_examples did until 2026-12-07, and
build_examples as it is (every row's texts in batched calls, which a fast tokenizer spreads over the CPUs; workers
run with TOKENIZERS_PARALLELISM on, core/slices.py). Both must give the same examples. Then the packing. Prints a
table and writes JSON; CPU only, no GPU needed.

    python ops/bench/finetune_data.py [--model DIR] [--repeat 3] [--out PATH]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")  # as in a worker
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench import f1, harness  # after the repository root is on sys.path

log = harness.logger("finetune_data")


def one_call_per_text(tok, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """build_examples' tokenization before 2026-12-07 (text rows only, which is what F1's corpus holds)."""
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    out = []
    for row in rows:
        ids = tok.encode(row["text"], add_special_tokens=False) + eos
        out.append((ids, list(ids)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, out=Path("/tmp/finetune-data.json"), model=Path("/tmp/f1-work/model"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="rows for this many F1 steps (16 × 2,048 tokens each)")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from core.spec import FinetuneSpec
    from worker.training.data import build_examples, pack

    built_s = harness.ensure_model(args.model, "--arch", "qwen3-0.6b")
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = f1.corpus(tok, int(args.steps * 16 * 2048 * 1.12), words=8, branch=2, min_words=64, max_words=1024)
    spec = FinetuneSpec.model_validate(
        {"kind": "finetune", "model": "bench", "input": "bench", "packing": True, "max_seq_length": 2048}
    )
    log(f"{len(rows)} rows (model {args.model}, built in {built_s} s); {os.cpu_count()} CPUs")
    times: dict[str, list[float]] = {"one call per text": [], "build_examples (batched)": [], "pack": []}
    same = True
    for run in range(args.repeat):
        t = time.perf_counter()
        reference = one_call_per_text(tok, rows)
        times["one call per text"].append(time.perf_counter() - t)
        t = time.perf_counter()
        examples, _ = build_examples(tok, list(enumerate(rows, 1)), spec)
        times["build_examples (batched)"].append(time.perf_counter() - t)
        same = same and [(e.input_ids, e.labels) for e in examples] == reference
        t = time.perf_counter()
        blocks = pack(examples, spec.max_seq_length, tok.pad_token_id or 0)
        times["pack"].append(time.perf_counter() - t)
        log(f"run {run + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    result = {k: harness.repeated([round(x, 3) for x in v]) for k, v in times.items()}
    old, new = result["one call per text"]["median"], result["build_examples (batched)"]["median"]
    report = {
        "finetune_data": {
            "rows": len(rows),
            "tokens": sum(len(e.input_ids) for e in examples),
            "blocks": len(blocks),
            "cpus": os.cpu_count(),
            "seconds": result,
            "batched_gain": round(old / new, 3),
            "same_examples": same,
        },
        "machine": harness.machine(),
        **harness.commit_info(),
    }
    print(f"\n{'way':28} {'median s':>9} {'spread':>7}")
    for name, r in result.items():
        print(f"{name:28} {r['median']:9.3f} {r['spread']:7.1%}")
    print(f"batched over one call per text: {old / new:.2f}x; same examples: {same}")
    harness.write_json(args.out, report)
    log(f"wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
