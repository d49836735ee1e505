"""Hub downloads: core/hub_download.py's own HTTP download against huggingface_hub's, from tests/hubserver.py on loopback.

    python ops/bench/hub_download.py                          # one 1 GiB file, 8 shards of 128 MiB, 3 rounds
    python ops/bench/hub_download.py --size-mib 256 --rounds 1 --out /tmp/hub.json        # quick

The fake Hub runs in a child process (its own interpreter: the client measured here shares no GIL with it) and
serves, from memory, `acme/large` (config.json and one `model.safetensors` of --size-mib random bytes) and
`acme/sharded` (config.json, an index and --shards shards that add up to the same size). Each round, in the same
process and in alternating order (a busy machine's drift hits both), each of these downloads into a fresh cache:

- large file, ours: `core.hub_download.ensure` (file list, download, sha256 of the bytes, link, marker) — what a worker does;
  `stream_s` is the part spent receiving the bytes (first to last byte), the rest is the listing and the hash.
- large file, huggingface_hub: `hf_hub_download(repo, "model.safetensors")` (a HEAD, the download, no hash).
- snapshot, ours with JOBS_HUB_PARALLEL_FILES=1 and =8, and huggingface_hub's `snapshot_download(max_workers=8)`.

Reported per case: the median over rounds of MB/s (10^6 bytes per second of wall time), wall seconds and this
process's CPU seconds (user + system: the number that moves least on a shared machine). JSON with the commit, the
machine and every round goes to --out. Loopback has no latency and no bandwidth limit: this measures what each
client costs (CPU, copies, hashing), not what a real link would give; on a real link both wait for the network.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from core import hub, hub_download, settings  # noqa: E402  (no settings are read at import)
from ops.bench import harness  # noqa: E402

OUT = harness.RESULTS / f"hub-download-{time.strftime('%Y-%m-%d')}.json"
log = harness.logger("hub")


def serve(size: int, shards: int) -> None:
    """The child process: start the fake Hub with both repos, print its URL, serve until stdin closes."""
    from tests.hubserver import HubServer

    server = HubServer().start()
    config = json.dumps({"model_type": "qwen3"}).encode()
    server.add("acme/large", {"config.json": config, "model.safetensors": os.urandom(size)})
    server.add_sharded("acme/sharded", shards=shards, size=size // shards)
    print(server.url, flush=True)
    sys.stdin.read()
    server.stop()


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Timing(hub.Listener):
    """Notes when the first and the last byte arrived."""

    first: float | None = None
    last: float | None = None

    def progress(self, done: int, total: int) -> None:
        self.last = time.perf_counter()
        self.first = self.first or self.last


def run_case(name: str, cache: Path, size: int, fetch) -> dict[str, Any]:
    """Time `fetch(cache)` into an empty `cache`; MB/s of `size` bytes over its wall time."""
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    os.environ["HF_HUB_CACHE"] = str(cache)
    settings.reset()
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    extra = fetch(cache) or {}
    wall = time.perf_counter() - t0
    cpu = cpu_seconds() - cpu0
    on_disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file() and not p.is_symlink())
    if on_disk < size:
        raise RuntimeError(f"{name}: {on_disk} bytes in the cache, expected at least {size}")
    shutil.rmtree(cache, ignore_errors=True)
    row = {"case": name, "mb_s": round(size / wall / 1e6, 1), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3)}
    return {**row, **extra}


def cases(size: int) -> dict[str, Any]:
    """name -> fetch(cache) for each case (the imports happen after HF_ENDPOINT is set)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    def ours(repo: str, parallel: int):
        def fetch(cache: Path) -> dict[str, Any]:
            os.environ["JOBS_HUB_PARALLEL_FILES"] = str(parallel)
            settings.reset()
            timing = Timing()
            hub_download.ensure(repo, None, listener=timing)
            stream = (timing.last - timing.first) if timing.first and timing.last else None
            return {"stream_s": round(stream, 3) if stream else None}

        return fetch

    return {
        "large file: ours (core.hub.ensure)": ours("acme/large", 8),
        "large file: hf_hub_download": lambda cache: (
            hf_hub_download("acme/large", "model.safetensors", cache_dir=cache) and None
        ),
        "snapshot: ours, 1 file at a time": ours("acme/sharded", 1),
        "snapshot: ours, 8 files at a time": ours("acme/sharded", 8),
        "snapshot: snapshot_download(max_workers=8)": lambda cache: (
            snapshot_download("acme/sharded", cache_dir=cache, max_workers=8) and None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, out=OUT, work=None)
    p.add_argument("--size-mib", type=int, default=1024, help="size of the large file and of the snapshot (MiB)")
    p.add_argument("--shards", type=int, default=8, help="weight shards of the snapshot")
    p.add_argument("--rounds", type=int, default=3, help="rounds; each runs every case once, in alternating order")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    size = args.size_mib << 20
    if args.serve:
        serve(size, args.shards)
        return 0
    host = harness.machine()  # its load average is the one at the start
    work = Path(args.work or tempfile.mkdtemp(prefix="hub-bench-"))
    child = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--size-mib", str(args.size_mib), "--shards", str(args.shards)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=harness.ROOT,
    )
    try:
        url = child.stdout.readline().strip()
        if not url:
            raise RuntimeError("the fake Hub did not start")
        for key in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
            os.environ.pop(key, None)
        os.environ.update(
            HF_ENDPOINT=url,
            HF_HOME=str(work / "hf-home"),
            HF_HUB_DISABLE_PROGRESS_BARS="1",
            HF_HUB_DISABLE_TELEMETRY="1",
            JOBS_HOME=str(work / "home"),
            JOBS_HUB_MIN_FREE_BYTES="0",
        )
        log(f"fake Hub at {url}: {args.size_mib} MiB in one file and in {args.shards} shards; {args.rounds} rounds")
        todo = cases(size)
        rounds: list[dict[str, Any]] = []
        for r in range(args.rounds):
            names = list(todo) if r % 2 == 0 else list(reversed(todo))
            for name in names:
                row = run_case(name, work / "cache", size, todo[name])
                rounds.append({"round": r, **row})
                log(f"round {r}: {name}: {row['mb_s']} MB/s, {row['wall_s']} s, {row['cpu_s']} CPU-s")
    finally:
        child.stdin.close()
        child.wait(30)
        shutil.rmtree(work, ignore_errors=True)
    summary = summarize(rounds, list(todo))
    table(summary, args)
    harness.write_json(
        args.out,
        {
            "benchmark": "hub_download",
            "args": {"size_mib": args.size_mib, "shards": args.shards, "rounds": args.rounds},
            **harness.commit_info(),
            "machine": host,
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
            "versions": harness.versions(("httpx", "huggingface_hub", "hf_xet", "filelock")),
            "summary": summary,
            "rounds": rounds,
        },
    )
    log(f"wrote {args.out}")
    return 0


def summarize(rounds: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Per case, the medians over rounds; for ours on the large file, the ratio to hf_hub_download's MB/s."""
    out = []
    for name in names:
        rows = [r for r in rounds if r["case"] == name]
        entry = {"case": name, "rounds": len(rows)}
        for key in ("mb_s", "wall_s", "cpu_s", "stream_s"):
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                entry[key] = round(statistics.median(values), 3)
        out.append(entry)
    by = {e["case"]: e for e in out}
    base = by.get("large file: hf_hub_download", {}).get("mb_s")
    if base:
        by["large file: ours (core.hub.ensure)"]["vs_hf"] = round(
            by["large file: ours (core.hub.ensure)"]["mb_s"] / base, 2
        )
    snap_base = by.get("snapshot: snapshot_download(max_workers=8)", {}).get("mb_s")
    if snap_base:
        for name in ("snapshot: ours, 1 file at a time", "snapshot: ours, 8 files at a time"):
            by[name]["vs_hf"] = round(by[name]["mb_s"] / snap_base, 2)
    return out


def table(summary: list[dict[str, Any]], args) -> None:
    print(f"\n{args.size_mib} MiB, {args.rounds} round(s), medians", flush=True)
    print(f"{'case':<46} {'MB/s':>8} {'wall s':>8} {'CPU s':>7} {'stream s':>9} {'vs hf':>6}")
    for e in summary:
        print(
            f"{e['case']:<46} {e.get('mb_s', ''):>8} {e.get('wall_s', ''):>8} {e.get('cpu_s', ''):>7} "
            f"{e.get('stream_s', '') if e.get('stream_s') is not None else '':>9} {e.get('vs_hf', ''):>6}"
        )


if __name__ == "__main__":
    sys.exit(main())
