#!/usr/bin/env bash
# One GPU call for the fast engine (issue 6): the decode-attention kernel at G1's shapes, then a workload of
# ops/bench/gen.py (engine alone, correctness, baselines, the service), then optional extra commands.
#   WORKLOADS="g1 g2" GEN_S=420 bash ops/gpu/fast.sh      (via the device tool, .whl carried)
# KERNEL=0 skips the kernel check; TUNE=1 adds ops/bench/fast_tune.py (TUNE_S); OOM=1 adds the forced out-of-memory
# and the refusals through the service (OOM_S; ops/gpu/soak.py has a faster forced OOM).
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
transformers.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
rc=0
if [[ ${KERNEL:-1} == 1 ]]; then
    timeout 90 python3 ops/bench/decode_kernel.py --out "$OUT/decode-kernel.json" > "$OUT/decode-kernel.log" 2>&1
    r=$?; echo "decode kernel: exit $r"; ((rc)) || rc=$r
fi
if [[ ${TUNE:-0} == 1 ]]; then
    timeout "${TUNE_S:-240}" python3 ops/bench/fast_tune.py --out "$OUT/fast-tune.json" > "$OUT/fast-tune.log" 2>&1
    r=$?; echo "fast tune: exit $r"; ((rc)) || rc=$r
fi
if [[ ${OOM:-0} == 1 ]]; then  # issue 4: a forced real CUDA out-of-memory through the service, and the refusals
    python3 -m api up --detach --gpus 0 --port 8765 > "$OUT/oom-up.log" 2>&1
    timeout "${OOM_S:-150}" python3 ops/gpu/check_service.py --only oom,refusals --out "$OUT/oom_check.json" \
        > "$OUT/oom_check.log" 2>&1; r=$?; echo "oom check: exit $r"; ((rc)) || rc=$r
    python3 -m api down > /dev/null 2>&1
    cp "$JOBS_HOME"/logs/worker-0.log "$OUT/oom-worker-0.log" 2>/dev/null
fi
for w in ${WORKLOADS:-g1}; do
    timeout "${GEN_S:-420}" python3 ops/bench/gen.py "$w" --out "$OUT/$w.json" ${GEN_ARGS:-} > "$OUT/$w.log" 2>&1
    r=$?; echo "$w: exit $r"; ((rc)) || rc=$r
    python3 -m api down > /dev/null 2>&1
    cp "$JOBS_HOME"/logs/worker-0.log "$OUT/$w-worker-0.log" 2>/dev/null
done
tail -n 12 "$OUT/decode-kernel.log" 2>/dev/null; grep -v "^{'ctx'" "$OUT/fast-tune.log" 2>/dev/null | tail -n 45
tail -n 14 "$OUT/oom_check.log" 2>/dev/null
for w in ${WORKLOADS:-g1}; do grep -v "Loading weights\|Warning\|warn" "$OUT/$w.log" | tail -n 40; done
exit $rc
