#!/usr/bin/env bash
# The soak run (issue 12, ops/gpu/soak.py) as one device call: the carried wheels installed (ops/gpu/env.sh), the
# soak under a hard limit, the stack stopped whatever happened, the JSON and the logs in $OUT.
#
#   bash ops/gpu/soak.sh              # full: one H200, at most 9.5 minutes of soak (hard limit SOAK_S, 590)
#   bash ops/gpu/soak.sh --quick      # at most 6.5 minutes: after every engine change
#   bash ops/gpu/soak.sh --smoke      # CPU (NO_WHEELS=1 where the service is installed): the same steps, tiny
#
# SOAK_S (whole seconds) sets the hard limit; the soak's own budget (--budget-s, unless given) is then 30 s less (a
# quarter less under 120 s), so a short limit skips the steps that no longer fit instead of cutting one mid-step
# (session 55's SOAK_S=300 cut the quick soak's yield step).
#
# $OUT gets soak.log (this output), soak-<mode>.json, worker-0.log, api.log, up.log and, if a step passed its
# bound, stacks.txt. Exit status: the soak's (0 passed, 1 failed), 124 if the hard limit cut it.
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
case " $* " in
    *" --smoke "*) limit=${SOAK_S:-1560} ;;
    *" --quick "*) limit=${SOAK_S:-390} ;;
    *) limit=${SOAK_S:-590} ;;
esac
budget=()  # a SOAK_S: the soak fits its steps into it (skips, not a cut mid-step), unless --budget-s is given
if [[ -n ${SOAK_S:-} ]]; then
    if [[ ! $SOAK_S =~ ^[0-9]+$ ]]; then
        echo "soak.sh: SOAK_S=$SOAK_S: give whole seconds" >&2
        exit 2
    fi
    if [[ " $* " != *" --budget-s"* ]]; then
        budget=(--budget-s $((limit > 120 ? limit - 30 : limit * 3 / 4)))
    fi
fi
WORK=${SOAK_WORK:-/tmp/gpujobs-soak}
command -v nvidia-smi > /dev/null && nvidia-smi -L
timeout -k 15 "$limit" "$PYTHON" ops/gpu/soak.py --work "$WORK" "$@" "${budget[@]}" 2>&1 | tee "$OUT/soak.log"
rc=${PIPESTATUS[0]}
if ((rc == 124 || rc == 137)); then  # cut by the limit: the soak may not have stopped its stack
    JOBS_HOME=$WORK/home "$PYTHON" -m api down > /dev/null 2>&1
    cp "$WORK"/home/logs/worker-0.log "$WORK"/home/logs/api.log "$WORK"/home/stacks.txt "$WORK"/up.log "$OUT"/ \
        2> /dev/null
fi
echo "soak.sh: exit $rc"
exit "$rc"
