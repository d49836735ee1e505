#!/usr/bin/env bash
# Run on an NVIDIA GPU host from the repo root: the service end to end on GPU 0, then ops/gpu/check_service.py.
# Wheels the host lacks are carried in .whl/ (ops/gpu/wheels.sh; installed by ops/gpu/env.sh); results go to $OUT
# (default ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
python3 -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"transformers", transformers.__version__, "gpus", torch.cuda.device_count())'
python3 -m api up --detach --gpus 0 --port 8765 || { tail -50 "$JOBS_HOME"/logs/*.log; exit 1; }
python3 ops/gpu/check_service.py --out "$OUT/gpu_checks.json"; rc=$?
python3 -m api down
cp "$JOBS_HOME"/logs/worker-0.log "$OUT/worker-0.log" 2>/dev/null
exit $rc
