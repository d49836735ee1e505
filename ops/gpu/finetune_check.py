"""GPU check for fine-tunes (workload F1 of DESIGN.md): LoRA and QLoRA (bitsandbytes 4-bit) on the Qwen3-0.6B
architecture (random bf16 weights, built by `worker/tinymodel.py --arch qwen3-0.6b`), run through the same
`finetune()` the worker runs. Records peak GPU memory and train tokens/s, with a plain PEFT + AdamW loop on the same
batches as the baseline (same run, so the ratio is fair). Prints a table and writes DIR/finetune.json.

    python3 ops/gpu/finetune_check.py --out DIR            # on the GPU host (torch, transformers, peft, bitsandbytes)
    python3 ops/gpu/finetune_check.py --out DIR --arch tiny --steps 4 --seq 64   # a CPU smoke run of the script
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def dataset(tok, rows: int, seq: int, seed: int = 0) -> list[tuple[int, dict]]:
    """`text` rows of random words, each about one block long (packing cuts them into blocks of `seq` tokens)."""
    from worker.tinymodel import SEED_CORPUS

    words, rng = SEED_CORPUS.split(), random.Random(seed)
    out = []
    for i in range(rows):
        text, n = [], 0
        while n < seq:
            word = rng.choice(words)
            text.append(word)
            n += len(tok.encode(" " + word, add_special_tokens=False))
        out.append((i + 1, {"text": " ".join(text)}))
    return out


def run_ours(model: Path, rows, *, label: str, steps: int, seq: int, batch: int, gpus: int, extra: dict) -> dict:
    from core.spec import FinetuneSpec, LoadOptions
    from worker.finetune import finetune

    spec = FinetuneSpec(model=str(model), input="synthetic", max_steps=steps, batch_size=batch, max_seq_length=seq,
                        packing=True, lora_r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                        learning_rate=1e-4, lr_scheduler="constant", checkpoint_steps=10**6, **extra)
    opts = LoadOptions(model=str(model), **({"quantization": spec.quantization.model_dump()}
                                            if spec.quantization else {}))
    logs: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        result = finetune(opts, spec, rows, Path(work), gpus=gpus, on_log=logs.append)
    steady = [r["tokens_per_s"] for r in logs if r.get("tokens_per_s") and r["step"] > min(5, steps // 2)]
    return {"label": label, "steps": result.metrics["steps"], "precision": result.metrics["precision"],
            "quantization": result.metrics["load"].get("quantization"), "final_loss": result.metrics["final_loss"],
            "tokens_per_s_median": round(statistics.median(steady), 1) if steady else None,
            "tokens_per_s_overall": result.metrics["train_tokens_per_s"],
            "peak_memory_gib": round(result.metrics.get("peak_memory_bytes", 0) / 2**30, 2),
            "trainable_parameters": result.metrics["trainable_parameters"], "seq": seq, "batch": batch}


def run_baseline(model: Path, rows, *, steps: int, seq: int, batch: int) -> dict:
    """Plain PEFT + torch AdamW, bf16 autocast, the same packed blocks: what a hand-written loop gets."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.finetune import pack, tokenize_row

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    tok = AutoTokenizer.from_pretrained(model)
    blocks = pack([tokenize_row(tok, r) for _, r in rows], seq)
    blocks = [b for b in blocks if len(b.input_ids) == seq] or blocks
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    net = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                          task_type="CAUSAL_LM"))
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-4)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times, tokens = [], 0
    for step in range(steps):
        chunk = [blocks[(step * batch + i) % len(blocks)] for i in range(batch)]
        width = min(len(b.input_ids) for b in chunk)
        ids = torch.tensor([b.input_ids[:width] for b in chunk], device=device)
        t0 = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            loss = net(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tokens = ids.numel()
    steady = times[min(5, steps // 2):] or times
    return {"label": "baseline: PEFT + AdamW loop", "steps": steps, "final_loss": round(loss.item(), 4),
            "tokens_per_s_median": round(tokens / statistics.median(steady), 1),
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else 0.0,
            "seq": seq, "batch": batch}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for finetune.json")
    parser.add_argument("--arch", choices=["qwen3-0.6b", "tiny"], default="qwen3-0.6b")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seq", type=int, default=2048, help="tokens per packed sequence (F1: 2048)")
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    import torch
    from transformers import AutoTokenizer

    from worker import capabilities, tinymodel

    args.out.mkdir(parents=True, exist_ok=True)
    gpus = 1 if torch.cuda.is_available() else 0
    report = {"started": time.time(), "host": platform.node(), "gpus": capabilities.gpus(),
              "versions": capabilities.versions(), "arch": args.arch, "runs": [], "errors": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        if args.arch == "tiny":
            tinymodel.build_model(model, qa=[("a", "b")], memorize=False)
        else:
            tinymodel.build_random(model)
        tok = AutoTokenizer.from_pretrained(model)
        rows = dataset(tok, rows=args.batch * 4, seq=args.seq)
        runs = [("LoRA r=16 all-linear", {}), ("QLoRA bnb-4bit nf4 r=16 all-linear", {"quantization": "bnb-4bit"})]
        for label, extra in runs:
            try:
                report["runs"].append(run_ours(model, rows, label=label, steps=args.steps, seq=args.seq,
                                               batch=args.batch, gpus=gpus, extra=extra))
            except Exception:  # noqa: BLE001  record it and go on: the other run still tells something
                report["errors"][label] = traceback.format_exc()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            (args.out / "finetune.json").write_text(json.dumps(report, indent=2) + "\n")  # kept if cut short
        try:
            base = run_baseline(model, rows, steps=args.steps, seq=args.seq, batch=args.batch)
            report["runs"].append(base)
            for run in report["runs"][:-1]:
                if run.get("tokens_per_s_median") and base["tokens_per_s_median"]:
                    run["vs_baseline"] = round(run["tokens_per_s_median"] / base["tokens_per_s_median"], 3)
        except Exception:  # noqa: BLE001
            report["errors"]["baseline"] = traceback.format_exc()
    report["finished"] = time.time()
    (args.out / "finetune.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'run':<40} {'steps':>5} {'prec':>5} {'tok/s':>10} {'peak GiB':>9} {'loss':>8} {'vs base':>8}")
    for r in report["runs"]:
        print(f"{r['label']:<40} {r['steps']:>5} {r.get('precision', '-'):>5} {r.get('tokens_per_s_median')!s:>10} "
              f"{r['peak_memory_gib']:>9} {r.get('final_loss')!s:>8} {r.get('vs_baseline', '-')!s:>8}")
    for label, error in report["errors"].items():
        print(f"FAILED {label}: {error.strip().splitlines()[-1]}")
    print(args.out / "finetune.json")
    return 1 if report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
