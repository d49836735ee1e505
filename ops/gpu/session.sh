#!/usr/bin/env bash
# One GPU call that checks everything a GPU can tell us, each part under its own time limit so one slow part
# cannot eat the others (a device call lasts at most 10 minutes): the service check (ops/gpu/run.sh: backends,
# quantizations, engines, fine-tune → generate, forced OOM), the fine-tune F1 check through `finetune()`, and
# the static-cache engine phase of G1 in whatever time is left of TOTAL_S. Results in $OUT; exit status: the
# first part that failed.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
TOTAL_S=${TOTAL_S:-540} SERVICE_S=${SERVICE_S:-260} FINETUNE_S=${FINETUNE_S:-120}
rc=0
timeout "$SERVICE_S" bash ops/gpu/run.sh > "$OUT/service.log" 2>&1; r=$?; echo "service check: exit $r"; ((rc)) || rc=$r
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 JOBS_HOME=${JOBS_HOME:-/tmp/gpujobs-home}
python3 -m api down > /dev/null 2>&1  # a service check cut short by its time limit leaves the stack up
cp "$JOBS_HOME"/logs/worker-0.log "$OUT/worker-0.log" 2>/dev/null
timeout "$FINETUNE_S" python3 ops/gpu/finetune_check.py --steps 20 --out "$OUT" > "$OUT/finetune.log" 2>&1; r=$?
echo "fine-tune check: exit $r"; ((rc)) || rc=$r
left=$((TOTAL_S - SECONDS))
if ((left > 60)); then
    timeout "$left" python3 ops/bench/g1.py --phase static --budget-s $((left - 10)) --out "$OUT/g1-static-h200.json" \
        > "$OUT/g1-static.log" 2>&1; r=$?
    echo "g1 static phase ($left s): exit $r"; ((rc)) || rc=$r
else
    echo "g1 static phase: skipped, $left s left"
fi
tail -n 25 "$OUT/service.log" "$OUT/finetune.log" "$OUT/g1-static.log" 2>/dev/null
exit $rc
