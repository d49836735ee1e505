"""Multi-GPU check (issue 8): slices of several GPUs through the real service, on one host. Run by ops/gpu/multi_gpu.sh
(which carries the wheels and gives each part its own time limit); writes DIR/multi_gpu-<part>.json, prints a table.

    python3 ops/gpu/multi_gpu_check.py --out DIR --part slices     # pinning, UUIDs, routing, device_map auto, DDP/FSDP2
    python3 ops/gpu/multi_gpu_check.py --out DIR --part dp         # G1 data-parallel over 1, 2 and all GPUs
    python3 ops/gpu/multi_gpu_check.py --out DIR --part tp         # one GPU vs device_map auto vs tp_plan auto (plain)
    python3 ops/gpu/multi_gpu_check.py --out DIR --part all --smoke   # the same pieces on a CPU host, tiny sizes

Parts:

- `slices`: `jobs up --gpus "1,0;2;3;..."` (the first slice reversed, so the order check means something). Each
  worker's registered GPU UUIDs must equal `nvidia-smi --query-gpu=index,uuid` for its slice, in order. A gpus=2 job
  must run on the 2-GPU worker and a gpus=1 job on a 1-GPU worker. Generation of the Qwen3-0.6B-shaped model with
  device_map auto on the 2-GPU slice (recorded devices, tok/s) next to the same job on one GPU. LoRA fine-tunes of
  the same model (packed 2,048-token rows) as jobs: gpus 1 (single), gpus 2 ddp, gpus 2 fsdp2; tokens/s of each
  from the workers' events, and the tiny base learning the six answers under ddp (then generating them).
- `dp`: workload G1 (1,024 prompts x 256 tokens in, 256 out, EOS off) through the service with 1, 2 and all GPUs as
  that many 1-GPU workers; one shard per worker after a warm-up shard each; output tok/s and scaling efficiency
  (tok/s with k GPUs / (k x tok/s with 1)).
- `tp`: plain transformers (no service; the service refuses tp_plan for now): padded `generate` of 256 prompts on one
  GPU, with device_map auto over 2 GPUs, and with tp_plan auto under torchrun over 2 GPUs (and all GPUs).

With --smoke everything runs on the CPU with the tiny model: CPU workers stand in for slices (no UUIDs to compare),
the ddp fine-tune runs 2 gloo processes, and tp runs 2 gloo processes; the numbers mean nothing, the pieces run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]
QA = [json.loads(line) for line in (ROOT / "examples" / "qa.jsonl").read_text().splitlines() if line.strip()]


def log(message: str) -> None:
    print(f"[multi-gpu {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- GPUs as nvidia-smi sees them, and the registrations to compare -----------------------------------------------


def smi_gpus(text: str | None = None) -> dict[str, str]:
    """index -> UUID from `nvidia-smi --query-gpu=index,uuid --format=csv` (its text may be given)."""
    if text is None:
        if not shutil.which("nvidia-smi"):
            return {}
        text = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,uuid", "--format=csv"], capture_output=True, text=True, check=True
        ).stdout
    rows = [line.split(",") for line in text.strip().splitlines()[1:] if line.strip()]
    return {index.strip(): uuid.strip() for index, uuid in rows}


def compare_uuids(workers: list[dict], smi: dict[str, str]) -> list[dict]:
    """One row per worker: the UUIDs it registered (CUDA order) against nvidia-smi's for its slice (same order)."""
    rows = []
    for w in workers:
        devices = [d for d in w["slice"].split(",") if d]
        expected = [smi.get(d, d if d.startswith(("GPU-", "MIG-")) else None) for d in devices]
        got = [g.get("uuid") for g in w.get("gpus") or []]
        rows.append(
            {
                "worker": w["name"],
                "slice": w["slice"],
                "queues": w["queues"],
                "registered": got,
                "nvidia_smi": expected,
                "match": got == expected,
            }
        )
    return rows


def slices_for(n: int) -> str:
    """`jobs up --gpus` for n GPUs: a reversed 2-GPU slice first ("1,0"), then one worker per remaining GPU."""
    return ";".join(["1,0", *map(str, range(2, n))])


# --- the stack -----------------------------------------------------------------------------------------------------


class Stack:
    """`jobs up --detach` with the given slices, and a client; `down` on exit."""

    def __init__(self, gpus: str, port: int):
        self.gpus, self.port = gpus, port

    def __enter__(self):
        from core import settings

        t = time.monotonic()
        up = subprocess.run(
            [sys.executable, "-m", "api", "up", "--detach", "--gpus", self.gpus, "--port", str(self.port)],
            capture_output=True,
            text=True,
        )
        if up.returncode != 0:
            raise RuntimeError(f"jobs up --gpus {self.gpus!r} failed: {up.stderr[-3000:]}")
        settings.reset()
        from api.client import Client

        self.client, self.up_s = Client(), round(time.monotonic() - t, 1)
        log(f"stack up with --gpus {self.gpus!r} in {self.up_s} s")
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run([sys.executable, "-m", "api", "down"], capture_output=True, text=True)

    def run(self, spec: dict, timeout: float) -> dict:
        from core.errors import JobsError

        t = time.monotonic()
        job = self.client.submit(spec)
        try:
            job = self.client.wait(job["id"], poll=0.5, timeout=timeout)
        except JobsError as exc:
            self.client.cancel(job["id"])
            return {"id": job["id"], "state": "timeout", "error": str(exc)}
        return {
            **{
                k: job.get(k)
                for k in ("id", "state", "error", "queue", "gpus", "rows", "tokens", "metrics", "load_options")
            },
            "wall_s": round(time.monotonic() - t, 2),
        }

    def upload_rows(self, rows: list[dict], name: str, work: Path) -> str:
        path = work / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return self.client.upload(path)["id"]


# --- models and data -------------------------------------------------------------------------------------------------


def build(work: Path, smoke: bool) -> dict[str, Path]:
    """tiny-base (knows no answer), tiny-qa, and the Qwen3-0.6B shape with random weights (tiny-qa on --smoke)."""
    models = {
        "tiny-base": work / "tiny-base",
        "tiny-qa": work / "tiny-qa",
        "big": work / ("tiny-qa" if smoke else "qwen3-0.6b"),
    }
    args = {
        "tiny-base": ["--qa", str(ROOT / "examples" / "qa.jsonl"), "--base"],
        "tiny-qa": ["--qa", str(ROOT / "examples" / "qa.jsonl")],
        "big": ["--arch", "qwen3-0.6b"],
    }
    for name, path in models.items():
        if not (path / "model.safetensors").exists() and not (path / "model.safetensors.index.json").exists():
            subprocess.run(
                [sys.executable, "-m", "worker.tinymodel", str(path), *args[name]],
                check=True,
                stdout=subprocess.DEVNULL,
            )
    return models


def text_rows(rows: int, words_per_row: int, seed: int = 0) -> list[dict]:
    from worker.tinymodel import SEED_CORPUS

    words, rng = SEED_CORPUS.split(), random.Random(seed)
    return [{"text": " ".join(rng.choice(words) for _ in range(words_per_row))} for _ in range(rows)]


def prompts(model: Path, n: int, length: int) -> list[str]:
    from transformers import AutoTokenizer

    from ops.bench import harness

    return harness.text_prompts(AutoTokenizer.from_pretrained(model), n, length)


def training_rate(stack: Stack, job_id: str) -> float | None:
    """Median tokens/s of the logged steps after the first few (warm-up) from the job's metric events."""
    import statistics

    rates = [
        e["data"]["tokens_per_s"]
        for e in stack.client.events(job_id)
        if (e.get("data") or {}).get("tokens_per_s") and e["data"].get("step", 0) > 3
    ]
    return round(statistics.median(rates), 1) if rates else None


# --- part: slices ----------------------------------------------------------------------------------------------------


def part_slices(args, models: dict[str, Path], work: Path) -> dict:
    gpus = smi_gpus()
    n = len(gpus)
    up = "none;none" if args.smoke else slices_for(n)
    # the 1-GPU baselines: a 1-GPU worker where the host has one to spare, else one GPU of the 2-GPU slice
    two, one, cpu = (0, 0, True) if args.smoke else (2, 1 if n >= 3 else 2, False)
    report: dict = {"nvidia_smi": gpus, "up_gpus": up}
    with Stack(up, args.port) as stack:
        report["up_s"] = stack.up_s
        workers = stack.client.workers()
        report["workers"] = compare_uuids(workers, gpus)
        report["uuids_match"] = all(r["match"] for r in report["workers"])
        qa = stack.upload_rows(
            [{"prompt": r["question"], "custom_id": f"q{i}"} for i, r in enumerate(QA)], "qa.jsonl", work
        )
        report["routing"] = {}
        for size in sorted({two, one}):
            job = stack.run({"model": str(models["tiny-qa"]), "input": qa, "gpus": size, "max_new_tokens": 8}, 180)
            ran_on = ran_on_slices(job["id"], workers)
            report["routing"][f"gpus={size}"] = {
                "state": job["state"],
                "queue": job.get("queue"),
                "error": job.get("error"),
                "slices": ran_on,
                "ok": job["state"] == "succeeded" and all(len([d for d in s.split(",") if d]) == size for s in ran_on),
            }
        bulk = stack.upload_rows([{"prompt": p} for p in prompts(models["big"], args.gen_rows, 64)], "bulk.jsonl", work)
        gen = {
            "model": str(models["big"]),
            "input": bulk,
            "max_new_tokens": args.new_tokens,
            "ignore_eos": True,
            "engine": "padded",
            "batch_rows": 64,
            "shard_rows": args.gen_rows,
        }
        report["generate"] = {}
        for label, extra in (
            ("one GPU", {"gpus": one, **({} if cpu else {"device_map": "cuda"})}),
            ("device_map auto over 2", {"gpus": two, "device_map": "auto"}),
        ):
            if cpu and "auto" in label:
                continue  # device_map auto needs GPUs
            job = stack.run({**gen, **extra}, args.job_timeout)
            report["generate"][label] = _gen_summary(job)
            log(f"generate {label}: {report['generate'][label]}")
        report["finetune"] = part_finetune(args, stack, models, work, one=one, two=two)
    return report


def ran_on_slices(job_id: str, workers: list[dict]) -> list[str]:
    """The slices of the workers that ran the job's shards (from SQL, as ops/bench/gen.py reads them)."""
    from ops.bench import harness

    names = {s["metrics"].get("worker") for s in harness.sql_numbers(job_id)["shards"] if s.get("metrics")}
    return sorted(w["slice"] for w in workers if w["name"] in names)


def _gen_summary(job: dict) -> dict:
    load = job.get("load_options") or {}
    tokens = (job.get("tokens") or {}).get("completion")
    return {
        "state": job["state"],
        "error": job.get("error"),
        "device_map": load.get("device_map"),
        "devices": load.get("devices"),
        "completion_tokens": tokens,
        "wall_s": job.get("wall_s"),
        "output_tok_s_wall": round(tokens / job["wall_s"], 1) if tokens and job.get("wall_s") else None,
    }


def part_finetune(args, stack: Stack, models: dict[str, Path], work: Path, *, one: int, two: int) -> dict:
    """F1-like LoRA on the big model: 1 GPU single vs 2 GPUs ddp and fsdp2; then the tiny base learns the answers
    under ddp and a chained generation job answers with the adapter."""
    data = stack.upload_rows(text_rows(args.ft_rows, args.ft_words), "ft.jsonl", work)
    base = {
        "kind": "finetune",
        "model": str(models["big"]),
        "input": data,
        "max_steps": args.ft_steps,
        "packing": True,
        "max_seq_length": args.seq,
        "batch_size": args.batch,
        "lora_r": 16,
        "lora_alpha": 32,
        "lora_dropout": 0.0,
        "learning_rate": 1e-4,
        "lr_scheduler": "constant",
        "checkpoint_steps": 10**6,
    }
    runs = [
        ("single, 1 GPU", {"gpus": one, "strategy": "single"}),
        ("ddp, 2 GPUs", {"gpus": two, "strategy": "ddp", **({"nproc": 2} if args.smoke else {})}),
        ("fsdp2, 2 GPUs", {"gpus": two, "strategy": "fsdp2"}),
    ]
    out: dict = {}
    for label, extra in runs:
        if args.smoke and "fsdp2" in label:
            continue  # accelerate shards only on GPUs: refused on the CPU
        job = stack.run({**base, **extra, "name": label}, args.job_timeout)
        training = (job.get("metrics") or {}).get("training") or {}
        out[label] = {
            "state": job["state"],
            "error": job.get("error"),
            "strategy": training.get("strategy"),
            "processes": training.get("processes"),
            "train_tokens_per_s": training.get("train_tokens_per_s"),
            "median_tokens_per_s": training_rate(stack, job["id"]),
            "final_loss": training.get("final_loss"),
            "wall_s": job.get("wall_s"),
        }
        log(f"fine-tune {label}: {out[label]}")
    single = (out.get("single, 1 GPU") or {}).get("median_tokens_per_s")
    for row in out.values():
        row["speedup_vs_1_gpu"] = (
            round(row["median_tokens_per_s"] / single, 2) if single and row.get("median_tokens_per_s") else None
        )
    qa = stack.upload_rows(
        [{"prompt": r["question"], "custom_id": f"q{i}"} for i, r in enumerate(QA)], "qa2.jsonl", work
    )
    memorize = {
        "kind": "finetune",
        "model": str(models["tiny-base"]),
        "gpus": two,
        "strategy": "ddp",
        "input": stack.client.upload(ROOT / "examples" / "finetune_qa.jsonl")["id"],
        "max_steps": 60,
        "learning_rate": 1e-2,
        "lr_scheduler": "constant",
        "batch_size": 6,
        "lora_dropout": 0.0,
        "then_generate": {"input": qa, "max_new_tokens": 16, "gpus": two},
        **({"nproc": 2} if args.smoke else {}),
    }
    job = stack.run(memorize, args.job_timeout)
    gen_id = (job.get("metrics") or {}).get("then_generate_job")
    answers = {}
    if gen_id:
        stack.client.wait(gen_id, poll=0.5, timeout=args.job_timeout)
        answers = {r["custom_id"]: r["output"] for r in stack.client.results(gen_id)}
    out["ddp memorizes the answers"] = {
        "state": job["state"],
        "error": job.get("error"),
        "correct": sum(answers.get(f"q{i}") == r["answer"] for i, r in enumerate(QA)),
        "of": len(QA),
    }
    return out


# --- part: dp --------------------------------------------------------------------------------------------------------


def part_dp(args, models: dict[str, Path], work: Path) -> dict:
    """G1 through the service with k one-GPU workers, k in (1, 2, all): one shard per worker."""
    from ops.bench import harness

    n = len(smi_gpus())
    counts = [1, 2] if args.smoke else sorted({1, min(2, n), n})
    texts = prompts(models["big"], args.dp_prompts, args.input_len)
    report: dict = {
        "prompts": args.dp_prompts,
        "input_len": args.input_len,
        "new_tokens": args.dp_new_tokens,
        "runs": {},
    }
    for k in counts:
        up = ";".join(["none"] * k) if args.smoke else ";".join(map(str, range(k)))
        with Stack(up, args.port) as stack:
            per = args.dp_prompts // k
            base = {"model": str(models["big"]), "ignore_eos": True, "gpus": 0 if args.smoke else 1}
            warm = stack.upload_rows([{"prompt": p} for p in texts[: 8 * k]], f"warm{k}.jsonl", work)
            stack.run({**base, "input": warm, "max_new_tokens": 8, "shard_rows": 8}, args.job_timeout)
            data = stack.upload_rows(
                [{"prompt": p, "custom_id": f"g1-{i}"} for i, p in enumerate(texts)], f"g1-{k}.jsonl", work
            )
            job = stack.run(
                {
                    **base,
                    "input": data,
                    "max_new_tokens": args.dp_new_tokens,
                    "shard_rows": per,
                    "batch_rows": min(per, 256),
                },
                args.job_timeout,
            )
            numbers = harness.sql_numbers(job["id"]) if job["state"] == "succeeded" else {}
            workers = sorted({s["metrics"].get("worker") for s in numbers.get("shards", []) if s.get("metrics")})
            report["runs"][k] = {
                "state": job["state"],
                "error": job.get("error"),
                "output_tok_s": numbers.get("output_tok_s"),
                "window_s": numbers.get("window_s"),
                "workers_used": workers,
                "up_s": stack.up_s,
            }
            log(f"G1 over {k} worker(s): {report['runs'][k]}")
    one = (report["runs"].get(1) or {}).get("output_tok_s")
    for k, row in report["runs"].items():
        row["scaling_efficiency"] = round(row["output_tok_s"] / (k * one), 3) if one and row["output_tok_s"] else None
    return report


# --- part: tp (plain transformers, child processes) -----------------------------------------------------------------


def tp_child(args) -> int:
    """One process of a `tp` measurement: load as told, generate the same padded batches, rank 0 writes the time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    kwargs: dict = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if args.mode == "tp":
        try:  # transformers >= 5.18 takes the plan in a DistributedConfig; 5.17 as from_pretrained(tp_plan=)
            from transformers.distributed import DistributedConfig

            kwargs["distributed_config"] = DistributedConfig(tp_plan="auto")
        except ImportError:
            kwargs["tp_plan"] = "auto"
    else:
        kwargs["device_map"] = ("cuda" if args.mode == "one" else "auto") if cuda else "cpu"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    load_s = time.perf_counter() - t0
    texts = prompts(args.model, args.tp_prompts, args.input_len)
    device = model.device  # the first layer's: cuda:LOCAL_RANK under tp, the slice's first GPU under auto
    tokens, t0 = 0, None
    for i in range(0, len(texts), args.tp_batch):
        batch = tok(texts[i : i + args.tp_batch], return_tensors="pt", padding=True).to(device)
        if t0 is None:  # the first batch warms up (kernels, allocator); the clock starts after it
            model.generate(**batch, max_new_tokens=4, do_sample=False)
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
        tokens += (out.shape[1] - batch["input_ids"].shape[1]) * out.shape[0]
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if rank == 0:
        Path(args.child_out).write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "processes": int(os.environ.get("WORLD_SIZE", "1")),
                    "load_s": round(load_s, 2),
                    "output_tokens": tokens,
                    "seconds": round(seconds, 3),
                    "output_tok_s": round(tokens / seconds, 1),
                    "devices": sorted({str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}),
                }
            )
        )
    return 0


def part_tp(args, models: dict[str, Path], work: Path) -> dict:
    from worker.training.distributed import child_env

    n = 2 if args.smoke else len(smi_gpus())
    plans = [("one", 1, "0"), ("auto", 1, "0,1"), ("tp", 2, "0,1")] + (
        [("tp", n, ",".join(map(str, range(n))))] if n > 2 else []
    )
    report: dict = {}
    for mode, procs, devices in plans:
        if args.smoke and mode == "auto":
            continue
        label = f"{mode} x{procs} on {devices}"
        out = work / f"tp-{mode}-{procs}.json"
        out.unlink(missing_ok=True)
        child = [
            __file__,
            "--tp-child",
            "--mode",
            mode,
            "--model",
            str(models["big"]),
            "--child-out",
            str(out),
            *_shared_flags(args),
        ]
        cmd = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *child]
            if procs > 1
            else [sys.executable, *child]
        )
        env = child_env({**os.environ, "CUDA_VISIBLE_DEVICES": "" if args.smoke else devices})
        t = time.monotonic()
        done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.job_timeout)
        report[label] = (
            json.loads(out.read_text()) if out.exists() else {"error": f"exit {done.returncode}: {done.stderr[-2000:]}"}
        )
        report[label]["wall_s"] = round(time.monotonic() - t, 1)
        log(f"tp part {label}: {report[label]}")
    return report


def _shared_flags(args) -> list[str]:
    return [
        "--tp-prompts",
        str(args.tp_prompts),
        "--tp-batch",
        str(args.tp_batch),
        "--input-len",
        str(args.input_len),
        "--new-tokens",
        str(args.new_tokens),
    ]


# --- main ------------------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("multi-gpu-out"))
    p.add_argument("--work", type=Path, default=Path("/tmp/gpujobs-multi"))
    p.add_argument("--part", default="all", help="slices, dp, tp, or all (comma list)")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, CPU workers, gloo; checks the pieces run")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--job-timeout", type=float, default=300)
    p.add_argument("--gen-rows", type=int, default=256, help="slices: generation rows (64 tokens each)")
    p.add_argument("--new-tokens", type=int, default=128, help="slices/tp: new tokens per row")
    p.add_argument("--ft-rows", type=int, default=400, help="fine-tune rows (packed into --seq blocks)")
    p.add_argument("--ft-words", type=int, default=1200)
    p.add_argument("--ft-steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="fine-tune batch per process")
    p.add_argument("--dp-prompts", type=int, default=1024)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--dp-new-tokens", type=int, default=256)
    p.add_argument("--tp-prompts", type=int, default=256)
    p.add_argument("--tp-batch", type=int, default=64)
    p.add_argument("--tp-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="one", help=argparse.SUPPRESS)
    p.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--child-out", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:  # tiny sizes: every piece runs on two CPU cores in a few minutes
        for name, value in dict(
            gen_rows=16,
            new_tokens=8,
            ft_rows=24,
            ft_words=60,
            ft_steps=6,
            seq=64,
            batch=2,
            dp_prompts=32,
            input_len=16,
            dp_new_tokens=8,
            tp_prompts=8,
            tp_batch=4,
            job_timeout=240,
        ).items():
            if getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tp_child:
        return tp_child(args)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    if not args.smoke and len(smi_gpus()) < 2:
        log("needs 2 or more GPUs (nvidia-smi lists fewer); use --smoke on a CPU host")
        return 2
    models = build(args.work, args.smoke)
    parts = {"slices": part_slices, "dp": part_dp, "tp": part_tp}
    chosen = list(parts) if args.part == "all" else args.part.split(",")
    rc = 0
    for name in chosen:
        report = {
            "part": name,
            "smoke": args.smoke,
            "host": platform.node(),
            "date": time.strftime("%F %T"),
            "versions": _versions(),
        }
        t = time.monotonic()
        try:
            report["result"] = parts[name](args, models, args.work)
        except Exception:  # noqa: BLE001  one part failing must not hide the others' results
            report["error"] = traceback.format_exc()
            rc = 1
            log(f"part {name} failed:\n{report['error']}")
        report["seconds"] = round(time.monotonic() - t, 1)
        (args.out / f"multi_gpu-{name}.json").write_text(json.dumps(report, indent=2, default=str))
        log(f"part {name}: {report['seconds']} s -> {args.out / f'multi_gpu-{name}.json'}")
    return rc


def _versions() -> dict:
    from worker.capabilities import versions

    return versions()


if __name__ == "__main__":
    sys.exit(main())
