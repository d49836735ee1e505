#!/usr/bin/env bash
# One GPU call (issue 25): the fast engine on G1 and G2, this tree and a base tree side by side (repeated warm runs),
# G2 through the service with py-spy sampling the worker, F1's engine with py-spy and torch.profiler tables. Each part
# in its own time box (a stuck part dumps its threads' stacks: SIGABRT with PYTHONFAULTHANDLER). Results under $OUT.
#   BASE=.base bash ops/gpu/diagnose.sh     (device tool, carry [".whl", ".base"]; .whl holds py-spy's wheel)
# BASE: a copy of the tree to compare with (`git archive COMMIT | tar -x -C .base`, ops/bench/profile_gen.py copied
# in); PARTS: any of "new base service f1" (default all).
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
export PYTHONFAULTHANDLER=1
LOGS=$(mktemp -d)
PARTS=${PARTS:-new base service f1}
SPY=$SITE/bin/py-spy
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
transformers.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
rc=0
timebox() {  # timebox NAME SECONDS CMD...
    local name=$1 s=$2; shift 2
    local t0=$SECONDS
    timeout -s ABRT -k 10 "$s" "$@" > "$LOGS/$name.log" 2>&1
    local r=$?; echo "$name: exit $r in $((SECONDS - t0)) s"; ((rc)) || rc=$r
}
has() { [[ " $PARTS " == *" $1 "* ]]; }
has new && timebox new "${NEW_S:-170}" python3 ops/bench/profile_gen.py g1 g2 --repeat 3 --out "$OUT/profile-new.json"
if has base && [[ -n ${BASE:-} ]]; then
    (cd "$BASE" && BENCH_COMMIT=${BASE_COMMIT:-} PYTHONPATH=$SITE:$PWD timebox base "${BASE_S:-130}" python3 ops/bench/profile_gen.py g1 g2 --repeat 2 \
        --out "$OUT/profile-base.json")
fi
if has service; then
    ( for _ in $(seq 240); do pid=$(pgrep -f "worker\.main" | head -n 1); [[ -n $pid ]] && break; sleep 0.5; done
      [[ -n ${pid:-} ]] && timeout 150 "$SPY" record -p "$pid" -r 100 -d 140 --threads --nonblocking -f raw \
          -o "$OUT/spy-worker-g2.txt" > "$LOGS/spy-worker.log" 2>&1 ) &
    timebox service "${SERVICE_S:-150}" python3 ops/bench/gen.py g2 --skip inproc --service-s 140 --out "$OUT/g2-service.json"
    cp "$JOBS_HOME"/logs/worker-0.log "$LOGS/worker-0.log" 2>/dev/null
    python3 -m api down > /dev/null 2>&1; pkill -f "worker\.main"; wait
fi
if has f1; then
    timebox f1 "${F1_S:-150}" "$SPY" record -s -r 50 --nonblocking -f raw -o "$OUT/spy-f1.txt" -- \
        python3 ops/bench/f1.py --phases variants --variants auto --variant-steps 25 --warm-steps 8 --profile-steps 2 \
        --budget-s $(( ${F1_S:-150} - 15 )) --out "$OUT/f1.json"
fi
for f in "$LOGS"/*.log; do echo "=== $(basename "$f")"; cat "$f"; done > "$OUT/logs.txt"
grep -h "warm: median\|cold:" "$LOGS"/new.log "$LOGS"/base.log 2>/dev/null
grep -h "output tok/s\|overhead\|service" "$LOGS"/service.log 2>/dev/null | tail -n 12
tail -n 4 "$LOGS"/f1.log 2>/dev/null
exit $rc
