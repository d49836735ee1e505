#!/usr/bin/env bash
# Issue 8 on one host with 2 or more NVIDIA GPUs, from the repo root; one part per device call (each < 10 min):
#
#   bash ops/gpu/multi_gpu.sh slices   # jobs up --gpus "1,0;2;3..": UUIDs vs nvidia-smi (order kept), routing by
#                                      # slice size, device_map auto generation, LoRA tok/s 1 GPU vs ddp/fsdp2 on 2
#   bash ops/gpu/multi_gpu.sh dp       # G1 through the service with 1, 2 and all GPUs: tok/s, scaling efficiency
#   bash ops/gpu/multi_gpu.sh tp       # plain generate: one GPU vs device_map auto vs tp_plan auto (torchrun)
#   bash ops/gpu/multi_gpu.sh --smoke slices dp tp   # the same pieces on a CPU host (tiny model, gloo)
#
# No part named: all three (needs about 20 minutes). Each part runs under its own limit (SLICES_S, DP_S, TP_S
# seconds) so that one slow part cannot eat the next; a part cut short still leaves its log. Wheels the host lacks
# are taken from .whl/ into /tmp/site by ops/gpu/env.sh (NO_WHEELS=1: use the environment as it is; PYTHON: the
# interpreter, default python3). Results: $OUT/multi_gpu-<part>.json (see ops/gpu/multi_gpu_check.py),
# $OUT/<part>.log, the workers' logs, nvidia-smi before and after. NVLink multicast is off for every process
# started here (and `jobs up` sets it on each worker, which passes it on to its children).
# Exit status: the first part that failed (2: usage, or fewer than 2 GPUs without --smoke).
set -uo pipefail
cd "$(dirname "$0")/../.."
SLICES_S=${SLICES_S:-540} DP_S=${DP_S:-540} TP_S=${TP_S:-420}
SMOKE=() PARTS=()
for arg in "$@"; do
    case $arg in
        --smoke) SMOKE=(--smoke) ;;
        slices | dp | tp) PARTS+=("$arg") ;;
        -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
        *) echo "multi_gpu.sh: unknown argument '$arg' (parts: slices dp tp; --smoke)" >&2; exit 2 ;;
    esac
done
[[ ${#PARTS[@]} -gt 0 ]] || PARTS=(slices dp tp)
export OUT=${OUT:-$PWD/multi-gpu-out} JOBS_HOME=${JOBS_HOME:-/tmp/gpujobs-multi-home}
# wheels, PYTHONPATH, NVLink multicast off, no inherited CUDA_VISIBLE_DEVICES (each worker gets its slice from `up`)
source ops/gpu/env.sh || exit 1

"$PYTHON" -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "gpus", torch.cuda.device_count())' | tee "$OUT/versions.txt"
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,uuid,name,memory.total,pci.bus_id --format=csv | tee "$OUT/nvidia-smi.csv"
    nvidia-smi topo -m > "$OUT/nvidia-smi-topo.txt" 2>&1
fi

rc=0
for part in "${PARTS[@]}"; do
    case $part in slices) limit=$SLICES_S ;; dp) limit=$DP_S ;; tp) limit=$TP_S ;; esac
    start=$SECONDS
    timeout "$limit" "$PYTHON" ops/gpu/multi_gpu_check.py --part "$part" --out "$OUT" "${SMOKE[@]}" \
        > "$OUT/$part.log" 2>&1
    r=$?
    "$PYTHON" -m api down > /dev/null 2>&1  # a part cut by its limit leaves its stack up
    for log in "$JOBS_HOME"/logs/worker-*.log; do
        [[ -e $log ]] && mv "$log" "$OUT/$part-$(basename "$log")"
    done
    echo "part $part: exit $r after $((SECONDS - start)) s (limit $limit s)"
    tail -n 12 "$OUT/$part.log"
    ((rc)) || rc=$r
done
command -v nvidia-smi >/dev/null && nvidia-smi > "$OUT/nvidia-smi-after.txt" 2>&1
exit $rc
