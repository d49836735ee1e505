"""What the benchmark scripts share: machine and commit info, phases in a time box, the greedy correctness check,
the JSON writer, the argument parser's common options, and the measuring helpers (GPU sync and peak memory,
throughput read from SQL, one-token-word prompts, the benchmark model built if missing).

Imported as `from ops.bench import harness` by gen.py, f1.py, load.py, decode_kernel.py, fast_tune.py and
hub_download.py (each puts the repository root on sys.path first) and by ops/gpu/multi_gpu_check.py. Imports no
torch, no transformers and no service code at module level: load.py's parent process and the parents of the child
processes stay light.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import sysconfig
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "ops" / "bench" / "results"
SEED = 0


def logger(name: str, stream=None) -> Callable[[str], None]:
    """`log(message)`: one timestamped line `[name HH:MM:SS] message`, flushed (stdout unless `stream`)."""

    def log(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=stream or sys.stdout, flush=True)

    return log


# --- machine and commit -------------------------------------------------------------------------------------------


def commit_info() -> dict[str, Any]:
    """The checkout's commit and the tracked files modified in it. `BENCH_COMMIT`, where set, says which commit the
    tree is and wins over git's HEAD (kept as `git_head`): a GPU host's copy of the tree may carry no .git, or a
    stale one (the device tool's copies reported an older HEAD with today's files as modified); `BENCH_TREE_NOTE`
    says what else was in the tree."""
    info: dict[str, Any] = {"commit": os.environ.get("BENCH_COMMIT"), "tree_note": os.environ.get("BENCH_TREE_NOTE")}
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        info["git_head"] = head.stdout.strip()
        info["commit"] = info["commit"] or info["git_head"]
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False
        ).stdout
        info["modified"] = [ln[3:] for ln in dirty.splitlines() if ln[:2].strip() and not ln.startswith("??")]
        info["dirty"] = bool(info["modified"])
    except (OSError, subprocess.CalledProcessError):
        pass
    return info


def machine() -> dict[str, Any]:
    """Host, CPU, cores (and this process's share), memory, platform, Python, load average now."""
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "host": platform.node(),
        "nproc": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "memory_bytes": mem,
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions(
    names: tuple[str, ...] = ("torch", "transformers", "sqlalchemy", "celery", "fastapi", "uvicorn", "redis", "httpx"),
) -> dict[str, str]:
    """Installed versions of `names` (those installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            pass
    return out


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# --- arguments, output, the model ---------------------------------------------------------------------------------


def parser(
    doc: str, *, out: Path | None, out_help: str = "the JSON written", **options: Any
) -> argparse.ArgumentParser:
    """The script's parser (its description: the docstring's first line) with `--out` and, for each keyword given,
    the option every script spells and explains the same way: model=PATH (built there if missing), work=PATH,
    port=N, budget_s=SECONDS, smoke=True."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--out", type=Path, default=out, help=out_help + (f" (default {out})" if out else ""))
    helps = {
        "model": "the model folder (built there if missing)",
        "work": "folder for scratch files",
        "port": "port of the API the benchmark starts",
        "budget_s": "wall-clock seconds for the whole run: "
        "a phase that would not fit is skipped and listed in `skipped`",
        "smoke": "CPU smoke run: tiny model, a few rows",
    }
    types = {"model": Path, "work": Path, "port": int, "budget_s": float}
    for name, default in options.items():
        flag = "--" + name.replace("_", "-")
        if name == "smoke":
            p.add_argument(flag, action="store_true", help=helps[name])
        else:
            p.add_argument(flag, type=types[name], default=default, help=helps[name])
    return p


def write_json(path: Path | str, data: Any, *, indent: int | None = 2) -> None:
    """Write `data` as JSON in one step (a temp file renamed over `path`): a reader never sees half a file, and a
    run cut short keeps the last complete report. Objects JSON cannot hold are written as their str()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    tmp.replace(path)


def ensure_model(path: Path, *build_args: str) -> float:
    """Build the benchmark model into `path` with worker/tinymodel.py (`build_args`: e.g. --arch qwen3-0.6b) unless
    it is there; returns the seconds it took (0 when it was there)."""
    if (path / "model.safetensors").exists():
        return 0.0
    t = time.monotonic()
    subprocess.run(
        [sys.executable, "-m", "worker.tinymodel", str(path), *build_args],
        check=True,
        stdout=subprocess.DEVNULL,
        cwd=ROOT,
    )
    return round(time.monotonic() - t, 1)


CORPUS_BYTES = 20_000_000  # of standard-library sources, to train a larger tokenizer on (~10 s for 150k tokens)
MODEL_FILES = ("config.json", "generation_config.json", ".safetensors", ".safetensors.index.json")


@functools.cache
def corpus() -> tuple[str, ...]:
    texts, size = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        texts.append(path.read_text(errors="replace"))
        size += len(texts[-1])
        if size > CORPUS_BYTES:
            break
    return tuple(texts)


def tokenizer(size: int):
    """The benchmark model's tokenizer (640 tokens), or a byte-level BPE trained to `size` tokens (up to 640: on
    the small seed corpus alone; more: on the standard library's sources, where 151936 gives ~59k, all they teach):
    a real tokenizer's size, whose grammar masks cost 4-5x the 640-token one's (issue 26)."""
    from worker import tinymodel

    return tinymodel.build_tokenizer(list(corpus()) if size > 640 else [], vocab_size=size)


def with_tokenizer(model: Path, size: int, work: Path) -> Path:
    """`model` with `tokenizer(size)` instead of its own: a folder under `work` whose weights and configs link to
    `model`'s (nothing copied, `model` untouched), built once per (model, size). Exits with the reason when the
    tokenizer does not fit the model: more tokens than its vocabulary, or another EOS id."""
    from transformers import AutoConfig

    from worker import tinymodel

    out = work / f"{model.name}-tokenizer-{size}"
    made = out / "gpujobs_tokenizer.json"
    key = {"model": str(model.resolve()), "size": size}
    if made.exists() and json.loads(made.read_text()) == key:
        return out
    tok, config = tokenizer(size), AutoConfig.from_pretrained(model)
    if len(tok) > config.vocab_size:
        raise SystemExit(f"--tokenizer-size {size}: {len(tok)} tokens do not fit {model}'s {config.vocab_size}")
    if tok.convert_tokens_to_ids(tinymodel.EOS) != config.eos_token_id:
        raise SystemExit(f"--tokenizer-size {size}: its EOS id is not {model}'s ({config.eos_token_id})")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    for path in model.iterdir():
        if path.name.endswith(MODEL_FILES):
            (out / path.name).symlink_to(path.resolve())
    tok.save_pretrained(out)
    made.write_text(json.dumps(key) + "\n")
    return out


# --- phases in a time box -----------------------------------------------------------------------------------------


class TimeBox:
    """Phases of a run inside one wall-clock budget. A phase whose estimate no longer fits in what is left is
    skipped and listed in `report["skipped"]`; one that raises is recorded in `report["errors"][name]` (its
    traceback logged) and the later phases still run; `save()` writes the report after each phase that ran."""

    def __init__(
        self,
        budget_s: float,
        report: dict[str, Any],
        *,
        save: Callable[[], None] = lambda: None,
        log: Callable[[str], None] = print,
    ) -> None:
        self.deadline = time.monotonic() + budget_s
        self.report, self.save, self.log = report, save, log

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, name: str, estimate_s: float, *, keep_s: float = 0.0) -> bool:
        """Whether `estimate_s` fits, with `keep_s` kept for later phases; if not, `name` is listed as skipped."""
        left = self.left()
        if left - keep_s >= estimate_s:
            return True
        kept = f", {keep_s:.0f} s kept for later" if keep_s else ""
        self.report.setdefault("skipped", []).append(f"{name} (estimated {estimate_s:.0f} s, {left:.0f} s left{kept})")
        self.log(f"skipped {name}")
        return False

    def run(self, name: str, estimate_s: float, fn: Callable[[], Any]) -> bool:
        """Run phase `name` if it fits; True when it ran to its end."""
        if not self.fits(name, estimate_s):
            return False
        ok = False
        try:
            fn()
            ok = True
        except Exception as exc:  # noqa: BLE001  a failed phase is reported; the others still run
            # cut: an exception's text can hold a whole object's repr (a page pool's free list once filled 100 kB)
            self.report.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:2000]
            self.log(f"{name} failed: {traceback.format_exc()}")
        self.save()
        return ok


# --- measuring -----------------------------------------------------------------------------------------------------


def repeated(values: list[float]) -> dict[str, Any]:
    """The median of repeated measurements of one thing and their spread ((max - min) / median): a change smaller
    than the spread is not a measured change."""
    import statistics

    values = [v for v in values if v]
    if not values:
        return {"runs": [], "median": None, "spread": None}
    median = statistics.median(values)
    return {"runs": values, "median": median, "spread": round((max(values) - min(values)) / median, 4)}


def sync() -> None:
    """Wait for the GPU's queued work (nothing on CPU): a timer read after it measures the work, not the launch."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak() -> int | None:
    import torch

    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None


def reset_peak() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


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
    """`n` prompts of exactly `length` tokens as text (one-token words), checked with the call the worker makes."""
    words = one_token_words(tok)
    if len(words) < 20:
        raise RuntimeError(f"only {len(words)} one-token words in the tokenizer: cannot build text prompts")
    rng = random.Random(seed)
    prompts = ["".join(rng.choice(words) for _ in range(length)) for _ in range(n)]
    counts = {len(tok(p)["input_ids"]) for p in prompts}  # as worker/engines/common.py render_many tokenizes
    if counts != {length}:
        raise RuntimeError(f"text prompts tokenize to {sorted(counts)} tokens, not {length}")
    return prompts


def sql_numbers(job_id: str) -> dict[str, Any]:
    """A job's throughput and per-row facts from SQL (JOBS_HOME's store): Σ completion tokens ÷ (last row committed
    − first shard started), token counts, executions, each micro-batch's commit time, the shards."""
    from sqlalchemy import func, select

    from core.db import session_scope
    from core.models import JobRow, Shard

    with session_scope() as s:
        r = s.execute(
            select(
                func.count(),
                func.sum(JobRow.completion_tokens),
                func.sum(JobRow.prompt_tokens),
                func.min(JobRow.prompt_tokens),
                func.max(JobRow.prompt_tokens),
                func.min(JobRow.completion_tokens),
                func.max(JobRow.completion_tokens),
                func.max(JobRow.executions),
                func.min(JobRow.started_at),
                func.max(JobRow.finished_at),
            ).where(JobRow.job_id == job_id, JobRow.state == "succeeded")
        ).one()
        commits = sorted(
            t
            for (t,) in s.execute(
                select(JobRow.finished_at).where(JobRow.job_id == job_id, JobRow.finished_at.is_not(None)).distinct()
            )
        )
        shards = s.scalars(select(Shard).where(Shard.job_id == job_id).order_by(Shard.idx)).all()
        shard_info = [
            {
                "idx": sh.idx,
                "state": sh.state,
                "attempts": sh.attempts,
                "started_at": sh.started_at,
                "finished_at": sh.finished_at,
                "metrics": sh.metrics,
            }
            for sh in shards
        ]
    rows, completion, prompt, pmin, pmax, cmin, cmax, execs, _row_start, row_end = r
    first_shard = min((sh["started_at"] for sh in shard_info if sh["started_at"]), default=None)
    window = (row_end - first_shard) if (row_end and first_shard) else None
    out = {
        "rows_succeeded": rows,
        "completion_tokens": completion,
        "prompt_tokens": prompt,
        "prompt_tokens_min_max": [pmin, pmax],
        "completion_tokens_min_max": [cmin, cmax],
        "max_executions": execs,
        "first_shard_started_at": first_shard,
        "last_row_finished_at": row_end,
        "window_s": window and round(window, 3),
        "output_tok_s": round(completion / window, 1) if (window and completion) else None,
        "throughput_definition": "sum(job_rows.completion_tokens) / (max(job_rows.finished_at) - "
        "min(shards.started_at)), read with core.db.session_scope from JOBS_HOME's SQLite",
        # each micro-batch commits its rows with one finished_at: the gaps are the per-batch times
        "commit_times_s": [round(c - first_shard, 3) for c in commits] if first_shard else commits,
        "output_tok_s_after_first_micro_batch": _after_first(rows, completion, commits, first_shard),
        "shards": shard_info,
    }
    return out


def _after_first(rows: int, completion: int | None, commits: list[float], first_shard: float | None) -> float | None:
    """Throughput over the micro-batches after the first (equal-sized batches of equal rows assumed, as in G1)."""
    if not (rows and completion and first_shard) or len(commits) < 2:
        return None
    return round(completion * (len(commits) - 1) / len(commits) / (commits[-1] - commits[0]), 1)


# --- correctness -----------------------------------------------------------------------------------------------------


def load_plain(path: Path, device: str, dtype):
    """A model as plain transformers loads it (sdpa, on `device`) and its tokenizer, padding on the left."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, device_map=device, attn_implementation="sdpa"
    ).eval()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    return model, tok


def greedy_check(
    qa_model: Path, engine: str, device: str, dtype, *, copies: int = 16, new_tokens: int = 16, **spec_fields
) -> dict[str, Any]:
    """Greedy outputs of our `engine` (worker/generate.py, with `spec_fields`: kv_cache_dtype fp8) against plain
    `generate` on the model that memorized examples/qa.jsonl, each question `copies` times (96 rows): passed when
    ≥ 99 % of rows are equal. `engine` records what ran. The fast engine's resident state is released afterwards."""
    import torch

    from core.spec import GenerateSpec
    from worker import generate
    from worker.engines import slot_state
    from worker.loader import Loaded

    qa = [json.loads(line) for line in (ROOT / "examples" / "qa.jsonl").read_text().splitlines() if line]
    model, tok = load_plain(qa_model, device, dtype)
    rows = [(i, {"prompt": d["question"], "params": {}}) for i, d in enumerate(qa * copies)]
    enc = tok.pad(
        {"input_ids": [tok(r["prompt"])["input_ids"] for _, r in rows]}, padding=True, return_tensors="pt"
    ).to(device)
    with torch.inference_mode():
        y = model.generate(
            **enc,
            max_new_tokens=new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=tok.pad_token_id,
        )
    eos = tok.eos_token_id
    want = [
        tok.decode(t[: t.index(eos) + 1] if eos in t else t, skip_special_tokens=True)
        for t in y[:, enc["input_ids"].shape[1] :].tolist()
    ]
    spec = GenerateSpec(model=str(qa_model), input="x", max_new_tokens=new_tokens, engine=engine, **spec_fields)
    info: dict = {}
    got = {
        r.idx: r.output
        for b in generate.generate(Loaded(model, tok, model.device, {}), spec, rows, batch_rows=len(rows), info=info)
        for r in b
    }
    equal = sum(got[i] == want[i] for i in range(len(rows)))
    slot_state.release(model)  # its cache would take the memory the next model's needs
    return {
        "rows": len(rows),
        "equal": equal,
        "share": round(equal / len(rows), 4),
        "passed": equal >= 0.99 * len(rows),
        "engine": info,
    }
