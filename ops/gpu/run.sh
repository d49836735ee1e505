#!/usr/bin/env bash
# Run on an NVIDIA GPU host from the repo root: the service end to end on GPU 0, then ops/gpu/check_service.py.
# Wheels the host lacks may be carried in .whl/ (see ops/gpu/README.md); results go to $OUT (default ./gpu-out).
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export JOBS_HOME=${JOBS_HOME:-/tmp/gpujobs-home} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
unset CUDA_VISIBLE_DEVICES
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
python3 -m api up --detach --gpus 0 --port 8765 || { tail -50 "$JOBS_HOME"/logs/*.log; exit 1; }
python3 ops/gpu/check_service.py --out "$OUT/gpu_checks.json"; rc=$?
python3 -m api down
cp "$JOBS_HOME"/logs/worker-0.log "$OUT/worker-0.log" 2>/dev/null
exit $rc
