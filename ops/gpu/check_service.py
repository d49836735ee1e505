"""GPU check: the whole service on a real NVIDIA GPU, one generation job per attention backend and quantization
the machine can run, and a record of what it refused and why. Prints a table, writes JSON.

Run by ops/gpu/run.sh on the GPU host, with a stack already up (`gpujobs up --detach --gpus 0`).
"""

from __future__ import annotations

import argparse
import json
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
]
# what this machine cannot run: each must be refused at submit with the missing piece named
REFUSALS = [
    ("flash_attention_2", {"attn_implementation": "flash_attention_2"}),
    ("flash_attention_3", {"attn_implementation": "flash_attention_3"}),
    ("hub kernel", {"attn_implementation": "kernels-community/flash-attn"}),
    ("use_kernels", {"use_kernels": True}),
    ("fp8 (FineGrainedFP8Config)", {"quantization": "fp8"}),
]


def build_models(models: Path) -> dict[str, Path]:
    built = {"tiny-qa": models / "tiny-qa", "qwen3-0.6b": models / "qwen3-0.6b"}
    if not (built["tiny-qa"] / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "worker.tinymodel", str(built["tiny-qa"]), "--qa",
                        str(ROOT / "examples" / "qa.jsonl")], check=True, stdout=subprocess.DEVNULL)
    if not (built["qwen3-0.6b"] / "model.safetensors").exists():
        subprocess.run([sys.executable, "-m", "worker.tinymodel", str(built["qwen3-0.6b"]), "--arch", "qwen3-0.6b"],
                       check=True, stdout=subprocess.DEVNULL)
    return built


def datasets(tmp: Path) -> dict[str, Path]:
    qa = tmp / "qa.jsonl"
    qa.write_text("".join(json.dumps({"prompt": r["question"], "custom_id": f"q{i}"}) + "\n"
                          for i, r in enumerate(MEMORIZED)))
    bulk = tmp / "bulk.jsonl"
    bulk.write_text("".join(json.dumps({"prompt": f"Row {i}: " + "tell me about the sky and the sea. " * 8}) + "\n"
                            for i in range(256)))
    return {"qa": qa, "bulk": bulk}


def run_job(client: Client, spec: dict, timeout: float) -> dict:
    t0 = time.monotonic()
    job = client.submit(spec)
    try:
        job = client.wait(job["id"], poll=0.5, timeout=timeout)
    except JobsError as exc:
        client.cancel(job["id"])
        return {"id": job["id"], "state": "timeout", "error": str(exc)}
    result = {"id": job["id"], "state": job["state"], "error": job["error"], "wall_s": round(time.monotonic() - t0, 2),
              "rows": job["rows"], "metrics": job["metrics"], "load_options": job["load_options"]}
    if job["state"] != "succeeded":
        result["events"] = [e["message"] for e in client.events(job["id"])][-8:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpujobs-check"))
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    client = Client()
    models, data = build_models(args.work / "models"), datasets(args.work)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "workers": client.workers(), "runs": [],
                    "refusals": []}
    report["nvidia_smi"] = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip()
    for label, extra in RUNS:
        qa = run_job(client, {"model": str(models["tiny-qa"]), "input": client.upload(data["qa"])["id"],
                              "max_new_tokens": 16, "gpus": 1, **extra}, timeout=300)
        answers = {r["custom_id"]: r["output"] for r in client.results(qa["id"])} if qa["state"] == "succeeded" else {}
        qa["memorized_correct"] = sum(answers.get(f"q{i}") == r["answer"] for i, r in enumerate(MEMORIZED))
        bulk = run_job(client, {"model": str(models["qwen3-0.6b"]), "input": client.upload(data["bulk"])["id"],
                                "max_new_tokens": 128, "ignore_eos": True, "batch_rows": 64, "gpus": 1, **extra},
                       timeout=420)
        report["runs"].append({"label": label, "spec": extra, "tiny_qa": qa, "qwen3_0.6b_bulk": bulk})
        print(f"{label:<16} tiny-qa {qa['state']:<9} {qa['memorized_correct']}/6   "
              f"0.6B {bulk['state']:<9} {bulk.get('metrics', {}).get('output_tok_s', '-')} tok/s", flush=True)
    for label, extra in REFUSALS:
        try:
            job = client.submit({"model": str(models["tiny-qa"]), "input": client.upload(data["qa"])["id"], "gpus": 1,
                                 **extra})
            report["refusals"].append({"label": label, "refused": False, "job": job["id"]})
            client.cancel(job["id"])
        except JobsError as exc:
            report["refusals"].append({"label": label, "refused": True, "reason": str(exc)})
    args.out.write_text(json.dumps(report, indent=2, default=str))
    print()
    print(f"{'backend / quantization':<26} {'tiny-qa answers':<16} {'0.6B job':<10} {'out tok/s':>10} {'dtype':<9} attn")
    for r in report["runs"]:
        b, q = r["qwen3_0.6b_bulk"], r["tiny_qa"]
        lo = b.get("load_options") or {}
        print(f"{r['label']:<26} {q['state'] + ' ' + str(q['memorized_correct']) + '/6':<16} {b['state']:<10} "
              f"{b.get('metrics', {}).get('output_tok_s', '-'):>10} {lo.get('dtype', '-'):<9} {lo.get('attn_implementation', '-')}")
    for r in report["refusals"]:
        print(f"{r['label']:<26} {'refused' if r['refused'] else 'ACCEPTED'}: {r.get('reason', '')[:150]}")
    w = report["workers"][0] if report["workers"] else {}
    print(f"\nworker {w.get('name')}: {json.dumps(w.get('gpus'))}")
    print(report["nvidia_smi"])
    ok = all(r["qwen3_0.6b_bulk"]["state"] == "succeeded" for r in report["runs"]) and all(
        r["refused"] for r in report["refusals"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
