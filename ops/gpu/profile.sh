#!/usr/bin/env bash
# One GPU call (issue 25): where the time goes. The fast engine on G1 and G2 under torch.profiler and cProfile
# (ops/bench/profile_gen.py), then F1's engine under torch.profiler for a few steps (ops/bench/f1.py --profile-steps),
# each part in its own time box; results and tables under $OUT.
#   bash ops/gpu/profile.sh            (via the device tool, .whl carried; GEN_S, F1_S, F1_VARIANTS)
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
export PYTHONFAULTHANDLER=1
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
transformers.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
nvidia-smi --query-gpu=name,uuid,memory.used,memory.total,clocks.sm,power.draw --format=csv
rc=0
timebox() {  # timebox SECONDS LOG CMD...: a stuck part dumps every thread's stack (SIGABRT after SIGTERM grace)
    local s=$1 log=$2; shift 2
    timeout -s ABRT -k 10 "$s" "$@" > "$log" 2>&1
    local r=$?; echo "$(basename "$log" .log): exit $r"; ((rc)) || rc=$r
}
timebox "${GEN_S:-300}" "$OUT/profile-gen.log" python3 ops/bench/profile_gen.py ${WORKLOADS:-g1 g2} --out "$OUT/profile.json"
timebox "${F1_S:-230}" "$OUT/f1-profile.log" python3 ops/bench/f1.py --phases variants --variants "${F1_VARIANTS:-auto,batch16}" \
    --variant-steps "${F1_STEPS:-20}" --warm-steps 5 --profile-steps 2 --budget-s "$(( ${F1_S:-230} - 15 ))" --out "$OUT/f1.json"
grep "^\[profile" "$OUT/profile-gen.log" | tail -n 40
grep -A 30 "Name" "$OUT"/f1-profile-f1-auto.txt 2>/dev/null | head -n 34
tail -n 8 "$OUT/f1-profile.log"
exit $rc
