#!/usr/bin/env bash
# F1's variants in two trees in one call, interleaved round by round (old, new, old, new, ...), so that a change the
# spec cannot switch (host-side training code) is measured against its baseline on the same machine at the same time.
# OLD is a commit the device copy's git holds (its HEAD is the session's first commit); the new tree is this one.
# Via the device tool, `.whl` carried, timeout_s 595 (ops/bench/results/2026-12-06-h100-f1 ran this):
#   OLD=d37e7ef F1_VARIANTS=auto ROUNDS=2 F1_STEPS=20 PART_S=580 bash ops/gpu/f1_ab.sh
# PART_S is split evenly over the 2 × ROUNDS runs. A run needs ~60 s before its first step (start, corpus, model,
# compile from the cache) plus f1.py's margins: give each variant of a run ≥ 140 s (91 s cut every child short).
# Results: $OUT/f1-ab-{old,new}-ROUND.json (ops/bench/f1.py's JSON each) and $OUT/f1-ab.json (every run's train
# tok/s per tree and variant, with the medians and the new/old ratio of the medians).
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
export PYTHONFAULTHANDLER=1
OLD=${OLD:?set OLD to the baseline commit}
ROUNDS=${ROUNDS:-2}
VARIANTS=${F1_VARIANTS:-auto}
STEPS=${F1_STEPS:-20}
deadline=$((SECONDS + ${PART_S:-560}))
old=/tmp/f1-ab-old
rm -rf "$old" && mkdir -p "$old" && git archive "$OLD" | tar -x -C "$old" || { echo "f1_ab.sh: no commit $OLD here" >&2; exit 2; }
per_run=$(((${PART_S:-560} - 10) / (2 * ROUNDS)))
for round in $(seq "$ROUNDS"); do
    for tree in old new; do
        root=$PWD; [[ $tree == old ]] && root=$old
        left=$((deadline - SECONDS))
        ((left > 60)) || { echo "f1_ab.sh: ${left} s left, $tree round $round not run"; continue; }
        box=$((per_run < left ? per_run : left))
        echo "== $tree ($([[ $tree == old ]] && echo "$OLD" || echo this tree)), round $round, ${box} s"
        timeout -s ABRT -k 10 "$box" python3 "$root/ops/bench/f1.py" --phases variants --variants "$VARIANTS" \
            --variant-steps "$STEPS" --budget-s $((box - 10)) --out "$OUT/f1-ab-$tree-$round.json" 2>&1 |
            tee -a "$OUT/f1-ab.log" | grep "^variant\|Error\|error" | tail -n 8
    done
done
python3 - "$OUT" "$OLD" << 'EOF'
import json, statistics, sys
from pathlib import Path

out, old = Path(sys.argv[1]), sys.argv[2]
runs = {}
for path in sorted(out.glob("f1-ab-*-*.json")):
    tree = path.stem.split("-")[2]
    for name, v in json.loads(path.read_text()).get("f1", {}).get("variants", {}).items():
        if v.get("train_tok_s"):
            runs.setdefault(f"{tree}/{name}", []).append({"train_tok_s": v["train_tok_s"], "peak_gib": v.get("peak_gib")})
summary = {key: {"runs": r, "median": statistics.median(x["train_tok_s"] for x in r)} for key, r in runs.items()}
for key in [k for k in summary if k.startswith("new/")]:
    base = summary.get("old/" + key[4:])
    if base:
        summary[key]["new_over_old"] = round(summary[key]["median"] / base["median"], 3)
(out / "f1-ab.json").write_text(json.dumps({"old": old, "runs": summary}, indent=1))
for key, s in summary.items():
    print(f"{key:24} median {s['median']:>9.1f}  runs {[x['train_tok_s'] for x in s['runs']]}"
          f"  peak GiB {[x['peak_gib'] for x in s['runs']]}  {s.get('new_over_old', '')}")
EOF
