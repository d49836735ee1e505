"""GPU check: the whole service on a real NVIDIA GPU, one generation job per attention backend, quantization and
engine the machine can run, and a record of what it refused and why; the README demo (a LoRA and a QLoRA fine-tune
job chained to a generation job with the new adapter); and a forced real CUDA out-of-memory that the engine must
survive by splitting its batch. Prints a table, writes JSON.

Run by ops/gpu/run.sh on the GPU host, with a stack already up (`gpujobs up --detach --gpus 0`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from api.client import Client
from core.errors import JobsError

ROOT = Path(__file__).resolve().parents[2]
MEMORIZED = [json.loads(line) for line in (ROOT / "examples" / "qa.jsonl").read_text().splitlines() if line.strip()]

# (label, spec overrides): every job here should run on an H200 with bitsandbytes and torchao installed
RUNS = [
    ("sdpa", {}),
    ("eager", {"attn_implementation": "eager"}),
    ("flex_attention", {"attn_implementation": "flex_attention"}),
    ("bnb-8bit", {"quantization": "bnb-8bit"}),
    ("bnb-4bit nf4", {"quantization": {"method": "bnb-4bit", "quant_type": "nf4"}}),
    ("torchao-int8", {"quantization": "torchao-int8"}),
    ("torchao-float8", {"quantization": "torchao-float8"}),
    ("continuous batching", {"engine": "continuous"}),
]
# what this machine cannot run: each must be refused at submit with the missing piece named
REFUSALS = [
    ("flash_attention_2", {"attn_implementation": "flash_attention_2"}),
    ("flash_attention_3", {"attn_implementation": "flash_attention_3"}),
    ("hub kernel", {"attn_implementation": "kernels-community/flash-attn"}),
    ("use_kernels", {"use_kernels": True}),
    ("fp8 (FineGrainedFP8Config)", {"quantization": "fp8"}),
]


def build_models(models: Path, smoke: bool = False) -> dict[str, Path]:
    built = {"tiny-qa": models / "tiny-qa", "qwen3-0.6b": models / ("tiny-qa" if smoke else "qwen3-0.6b")}
    if not (built["tiny-qa"] / "model.safetensors").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "worker.tinymodel",
                str(built["tiny-qa"]),
                "--qa",
                str(ROOT / "examples" / "qa.jsonl"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    if not (built["qwen3-0.6b"] / "model.safetensors").exists():
        subprocess.run(
            [sys.executable, "-m", "worker.tinymodel", str(built["qwen3-0.6b"]), "--arch", "qwen3-0.6b"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return built


def datasets(tmp: Path) -> dict[str, Path]:
    qa = tmp / "qa.jsonl"
    qa.write_text(
        "".join(json.dumps({"prompt": r["question"], "custom_id": f"q{i}"}) + "\n" for i, r in enumerate(MEMORIZED))
    )
    bulk = tmp / "bulk.jsonl"
    bulk.write_text(
        "".join(
            json.dumps({"prompt": f"Row {i}: " + "tell me about the sky and the sea. " * 8}) + "\n" for i in range(64)
        )
    )
    return {"qa": qa, "bulk": bulk}


def finetune_then_generate(client: Client, work: Path, data: dict[str, Path], extra: dict) -> dict:
    """The README demo on the GPU: a LoRA fine-tune job through the service on a tiny base model that knows no
    answer, chained to a generation job with the new adapter; counts the memorized answers it gets right."""
    import yaml

    base = work / "models" / "tiny-base"
    if not (base / "model.safetensors").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "worker.tinymodel",
                str(base),
                "--base",
                "--qa",
                str(ROOT / "examples" / "qa.jsonl"),
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
    spec = yaml.safe_load((ROOT / "examples" / "finetune.yaml").read_text())
    spec.update(
        model=str(base),
        input=client.upload(ROOT / "examples" / "finetune_qa.jsonl")["id"],
        then_generate={"input": client.upload(data["qa"])["id"], "max_new_tokens": 16},
        **extra,
    )
    tune = run_job(client, spec, timeout=300)
    job_id = (tune.get("metrics") or {}).get("then_generate_job")
    gen = run_job(client, {}, timeout=120, job_id=job_id) if job_id else {"state": "not started"}
    answers = {r["custom_id"]: r["output"] for r in client.results(job_id)} if gen["state"] == "succeeded" else {}
    gen["memorized_correct"] = sum(answers.get(f"q{i}") == r["answer"] for i, r in enumerate(MEMORIZED))
    return {"finetune": tune, "generate_with_adapter": gen}


def forced_oom(client: Client, model: Path, tmp: Path) -> dict:
    """A real CUDA out-of-memory: 2,048 prompts of ~4,000 tokens in one padded micro-batch cannot fit in 141 GB
    (KV cache alone ~0.9 TB); the engine must split the batch until it fits, say so in the job's events, and
    finish every row."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    text = ""
    while len(tok(text)["input_ids"]) < 4000:
        text += "tell me about the sky and the sea and the long road home. "
    data = tmp / "oom.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} {text}"}) + "\n" for i in range(2048)))
    result = run_job(
        client,
        {
            "model": str(model),
            "input": client.upload(data)["id"],
            "max_new_tokens": 4,
            "ignore_eos": True,
            "engine": "padded",
            "batch_rows": 2048,
            "shard_rows": 2048,
            "gpus": 1,
        },
        timeout=300,
    )
    splits = [e["message"] for e in client.events(result["id"]) if "out of memory" in e["message"]]
    result.update(prompt_tokens=len(tok(text)["input_ids"]), oom_events=splits)
    return result


def run_job(client: Client, spec: dict, timeout: float, job_id: str | None = None) -> dict:
    t0 = time.monotonic()
    job = {"id": job_id} if job_id else client.submit(spec)
    try:
        job = client.wait(job["id"], poll=0.5, timeout=timeout)
    except JobsError as exc:
        client.cancel(job["id"])
        return {"id": job["id"], "state": "timeout", "error": str(exc)}
    result = {
        "id": job["id"],
        "state": job["state"],
        "error": job["error"],
        "wall_s": round(time.monotonic() - t0, 2),
        "rows": job["rows"],
        "metrics": job["metrics"],
        "load_options": job["load_options"],
    }
    if job["state"] != "succeeded":
        result["events"] = [e["message"] for e in client.events(job["id"])][-8:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpujobs-check"))
    parser.add_argument("--gpus", type=int, default=1, help="slice size of the jobs (0: a CPU smoke run)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="sdpa, LoRA and the refusals only (a CPU check of this script); no forced OOM",
    )
    parser.add_argument(
        "--only",
        default="runs,finetune,oom,refusals",
        help="comma list of the parts to run: runs, finetune, oom, refusals",
    )
    parser.add_argument("--runs", default="", help="comma list of RUNS labels to run (default: all)")
    args = parser.parse_args()
    only = set(args.only.split(","))
    labels = set(args.runs.split(",")) - {""}
    args.work.mkdir(parents=True, exist_ok=True)
    client = Client()
    models, data = build_models(args.work / "models", args.smoke), datasets(args.work)
    report: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "workers": client.workers(),
        "runs": [],
        "refusals": [],
    }
    smi = shutil.which("nvidia-smi")
    report["nvidia_smi"] = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip() if smi else None
    runs = [r for r in (RUNS[:1] if args.smoke else RUNS) if "runs" in only and (not labels or r[0] in labels)]
    for label, extra in runs:
        qa = run_job(
            client,
            {
                "model": str(models["tiny-qa"]),
                "input": client.upload(data["qa"])["id"],
                "max_new_tokens": 16,
                "gpus": args.gpus,
                **extra,
            },
            timeout=300,
        )
        answers = {r["custom_id"]: r["output"] for r in client.results(qa["id"])} if qa["state"] == "succeeded" else {}
        qa["memorized_correct"] = sum(answers.get(f"q{i}") == r["answer"] for i, r in enumerate(MEMORIZED))
        bulk = run_job(
            client,
            {
                "model": str(models["qwen3-0.6b"]),
                "input": client.upload(data["bulk"])["id"],
                "max_new_tokens": 128,
                "ignore_eos": True,
                "batch_rows": 64,
                "gpus": args.gpus,
                **extra,
            },
            timeout=420,
        )
        report["runs"].append({"label": label, "spec": extra, "tiny_qa": qa, "qwen3_0.6b_bulk": bulk})
        args.out.write_text(json.dumps(report, indent=2, default=str))  # a run cut short keeps what it measured
        print(
            f"{label:<16} tiny-qa {qa['state']:<9} {qa['memorized_correct']}/6   "
            f"0.6B {bulk['state']:<9} {bulk.get('metrics', {}).get('output_tok_s', '-')} tok/s",
            flush=True,
        )
    tunes = (("LoRA", {}), ("QLoRA bnb-4bit", {"quantization": "bnb-4bit"}))
    for label, extra in (tunes[:1] if args.smoke else tunes) if "finetune" in only else ():
        tuned = report.setdefault("finetune_then_generate", {})[label] = finetune_then_generate(
            client, args.work, data, {"gpus": args.gpus, **extra}
        )
        print(
            f"fine-tune {label:<15} {tuned['finetune']['state']:<9} then generate "
            f"{tuned['generate_with_adapter']['state']} {tuned['generate_with_adapter'].get('memorized_correct')}/6",
            flush=True,
        )
    if not args.smoke and "oom" in only:
        report["forced_oom"] = forced_oom(client, models["qwen3-0.6b"], args.work)
        oom = report["forced_oom"]
        print(f"forced OOM: {oom['state']}, rows {oom.get('rows')}, {len(oom['oom_events'])} split events", flush=True)
    for label, extra in REFUSALS if "refusals" in only else ():
        try:
            job = client.submit(
                {"model": str(models["tiny-qa"]), "input": client.upload(data["qa"])["id"], "gpus": args.gpus, **extra}
            )
            report["refusals"].append({"label": label, "refused": False, "job": job["id"]})
            client.cancel(job["id"])
        except JobsError as exc:
            report["refusals"].append({"label": label, "refused": True, "reason": str(exc)})
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print()
    print(
        f"{'backend / quantization':<26} {'tiny-qa answers':<16} {'0.6B job':<10} {'out tok/s':>10} {'dtype':<9} attn"
    )
    for r in report["runs"]:
        b, q = r["qwen3_0.6b_bulk"], r["tiny_qa"]
        lo = b.get("load_options") or {}
        print(
            f"{r['label']:<26} {q['state'] + ' ' + str(q['memorized_correct']) + '/6':<16} {b['state']:<10} "
            f"{b.get('metrics', {}).get('output_tok_s', '-'):>10} {lo.get('dtype', '-'):<9} {lo.get('attn_implementation', '-')}"
        )
    for r in report["refusals"]:
        print(f"{r['label']:<26} {'refused' if r['refused'] else 'ACCEPTED'}: {r.get('reason', '')[:150]}")
    w = report["workers"][0] if report["workers"] else {}
    print(f"\nworker {w.get('name')}: {json.dumps(w.get('gpus'))}")
    print(report["nvidia_smi"])
    oom = report.get("forced_oom")
    ok = (
        all(r["qwen3_0.6b_bulk"]["state"] == "succeeded" for r in report["runs"])
        and all(r["refused"] for r in report["refusals"])
        and (oom is None or oom["state"] == "succeeded" and oom["oom_events"])
        and all(
            t["generate_with_adapter"].get("memorized_correct", 0) >= 5
            for t in report.get("finetune_then_generate", {}).values()
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
