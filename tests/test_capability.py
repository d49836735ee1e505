"""Submit refuses what no live worker can run, naming what is missing, and accepts it once a registered worker
reports the capability. Workers here are registrations in SQL, as real workers write them."""

from __future__ import annotations

import json

import pytest

from api import service, views
from core import registry
from core.capability import missing
from core.db import session_scope
from core.errors import Unschedulable
from core.spec import GenerateSpec, LoadOptions

CPU = {
    "device_count": 0,
    "min_compute_capability": None,
    "attention": ["sdpa", "eager", "flex_attention"],
    "versions": {"torch": "2.13.0", "bitsandbytes": "0.50.2", "torchao": None, "kernels": None, "flash-attn": None},
}
H200 = {
    **CPU,
    "device_count": 1,
    "min_compute_capability": 9.0,
    "attention": ["sdpa", "eager", "flex_attention", "flash_attention_2"],
    "versions": {**CPU["versions"], "flash-attn": "2.8.3", "torchao": "0.18.0"},
}
T4 = {**CPU, "device_count": 1, "min_compute_capability": 7.5, "versions": {**CPU["versions"], "torchao": "0.18.0"}}


def opts(**kw) -> LoadOptions:
    return LoadOptions(model="m", **kw)


def gen(**kw) -> GenerateSpec:
    return GenerateSpec(model="m", input="file_x", **kw)


FLEX_FAILED = {
    "ok": False,
    "reason": "flex_attention does not compile on this worker's cpu: torch.compile failed "
    "on this worker, CppCompileError: C++ compile error",
}


@pytest.mark.parametrize(
    "spec, caps, expected",
    [
        (
            gen(attn_implementation="paged|sdpa", engine="padded"),
            CPU,
            [
                "engine padded cannot run paged|sdpa (paged attention is the attention of transformers' continuous batching, "
                "engine continuous): use engine continuous (or auto, which runs paged attention there), or "
                "attn_implementation sdpa"
            ],
        ),
        (gen(attn_implementation="paged|sdpa"), CPU, []),
        (gen(attn_implementation="paged|sdpa", engine="continuous"), CPU, []),
        (
            gen(attn_implementation="paged|sdpa_gqa"),
            CPU,
            [
                "engine continuous cannot run sdpa_gqa (transformers' continuous batching takes sdpa, eager or flash "
                "attention): use engine padded or another attn_implementation"
            ],
        ),
        (
            gen(attn_implementation="flex_attention"),
            {**CPU, "flex_attention": FLEX_FAILED},
            [f"{FLEX_FAILED['reason']}: use attn_implementation sdpa or eager"],
        ),
        (
            gen(attn_implementation="flex_attention"),
            {**CPU, "flex_attention": {"ok": None, "reason": "pending"}},
            [
                "its flex_attention compile probe has not finished yet (it runs just after the worker starts; the first "
                "compile on a CPU takes up to a minute): submit again shortly"
            ],
        ),
        (gen(attn_implementation="flex_attention"), {**CPU, "flex_attention": {"ok": True, "reason": None}}, []),
    ],
)
def test_paged_attention_runs_on_the_continuous_engine_and_flex_where_it_compiles(spec, caps, expected):
    """`paged|…` is refused on the padded engine (which would run the plain backend: no silent fallback) and
    accepted under auto (which runs it on the continuous engine); flex_attention is refused where the worker's
    compile probe failed (naming why) or has not answered yet."""
    assert missing(spec, caps, 0) == expected


@pytest.mark.parametrize(
    "spec, caps, gpus, expected",
    [
        (opts(), CPU, 0, []),
        (opts(attn_implementation="paged|sdpa"), CPU, 0, []),
        (
            opts(attn_implementation="flash_attention_2"),
            CPU,
            0,
            ["flash_attention_2 needs the flash-attn package (missing) and an Ampere or newer GPU (worker has no GPU)"],
        ),
        (opts(attn_implementation="flash_attention_2"), H200, 1, []),
        (
            opts(attn_implementation="flash_attention_3"),
            H200,
            1,
            [
                "flash_attention_3 needs the flash-attn package (installed) and an Ampere or newer GPU (worker has compute "
                "capability 9.0)"
            ],
        ),
        (
            opts(attn_implementation="kernels-community/flash-attn"),
            H200,
            1,
            ["attention kernel 'kernels-community/flash-attn' needs the `kernels` package"],
        ),
        (opts(use_kernels=True), H200, 1, ["use_kernels needs the `kernels` package and Hub access"]),
        (opts(quantization="torchao-int8"), CPU, 0, ["torchao-int8 needs torchao (pip install torchao)"]),
        (opts(quantization="bnb-4bit"), CPU, 0, []),
        (
            opts(quantization="torchao-float8"),
            T4,
            1,
            ["torchao-float8 needs a GPU of compute capability 8.9 or newer (worker has compute capability 7.5)"],
        ),
        (opts(quantization="torchao-float8"), H200, 1, []),
        (opts(quantization="fp8"), H200, 1, ["fp8 (FineGrainedFP8Config) needs the `kernels` package and Hub access"]),
        (opts(device_map="cuda"), CPU, 0, ["device_map='cuda' needs a GPU slice (gpus >= 1)"]),
    ],
)
def test_missing_names_each_gap(spec, caps, gpus, expected):
    """Each backend, kernel and quantization is checked against the registered capabilities, with a message."""
    assert missing(spec, caps, gpus) == expected


@pytest.mark.parametrize(
    "spec, caps, gpus, expected",
    [
        (gen(kv_cache_dtype="fp8"), H200, 1, []),
        (gen(kv_cache_dtype="fp8", engine="fast"), CPU, 0, []),
        (
            gen(kv_cache_dtype="fp8"),
            CPU,
            0,
            [
                "kv_cache_dtype fp8 is the fast engine's cache, and on a CPU slice engine auto runs padded: set "
                "engine fast (it runs on CPU too), or kv_cache_dtype auto"
            ],
        ),
        (
            gen(kv_cache_dtype="fp8", engine="static"),
            H200,
            1,
            [
                "kv_cache_dtype fp8 is the fast engine's cache, and engine static does not run the fast engine: use "
                "engine fast or auto (and attn_implementation sdpa), or kv_cache_dtype auto"
            ],
        ),
        (
            gen(kv_cache_dtype="fp8", attn_implementation="paged|sdpa"),
            H200,
            1,
            [
                "kv_cache_dtype fp8 is the fast engine's cache, and engine auto with paged|sdpa does not run the "
                "fast engine: use engine fast or auto (and attn_implementation sdpa), or kv_cache_dtype auto"
            ],
        ),
        (
            gen(kv_cache_dtype="fp8"),
            {**T4, "versions": CPU["versions"]},
            1,
            [
                "kv_cache_dtype fp8 needs a GPU of compute capability 8.9 or newer (Ada, Hopper: Triton's fp8 type), "
                "and the worker has compute capability 7.5: use kv_cache_dtype int8 or auto"
            ],
        ),
        (gen(kv_cache_dtype="int8"), {**T4, "versions": CPU["versions"]}, 1, []),
        (
            gen(kv_cache_dtype="int8", engine="padded"),
            H200,
            1,
            [
                "kv_cache_dtype int8 is the fast engine's cache, and engine padded does not run the fast engine: use "
                "engine fast or auto (and attn_implementation sdpa), or kv_cache_dtype auto"
            ],
        ),
    ],
)
def test_a_quantized_kv_cache_is_refused_where_the_fast_engine_would_not_run_it(spec, caps, gpus, expected):
    """kv_cache_dtype fp8 and int8 are the fast engine's: refused at submit on engines that never run it, under auto
    where auto runs padded (a CPU slice), and fp8 on GPUs without Triton's fp8 type (int8 runs there); accepted on
    an H200 and on CPU's fast engine."""
    assert missing(spec, caps, gpus) == expected


def register(name: str, slice_: str, caps: dict) -> None:
    with session_scope() as session:
        registry.register(
            session,
            name=name,
            host="h",
            pid=1,
            slice=slice_,
            queues=["gpu1" if slice_ else "cpu"],
            gpus=[],
            capabilities=caps,
        )


def test_submit_refuses_then_accepts_when_a_capable_worker_registers(tmp_path, jobs_env, tiny_model):
    """flash_attention_2 with only a CPU worker live is refused naming the worker and the gap; once a worker
    registers flash-attn on an H200 the same submit is accepted on its queue."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n")
    spec = {"model": str(tiny_model), "input": str(data), "attn_implementation": "flash_attention_2"}
    register("cpu-worker", "", CPU)
    with pytest.raises(Unschedulable, match=r"cpu-worker \(cpu\): flash_attention_2 needs the flash-attn package"):
        service.submit(owner="t", spec_data=spec)
    assert views.list_jobs(owner=None) == []
    register("h200-worker", "0", H200)
    job = service.submit(owner="t", spec_data=spec)
    assert (job["queue"], job["gpus"], job["state"]) == ("gpu1", 1, "running")
