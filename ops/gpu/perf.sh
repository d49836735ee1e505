#!/usr/bin/env bash
# One GPU call per part for issue 25/26's measurements, each in its own time box (a stuck part dumps every thread's
# stack: SIGABRT with PYTHONFAULTHANDLER=1); results under $OUT. Via the device tool, `.whl` carried, timeout_s 590:
#   PART=g2 bash ops/gpu/perf.sh     # gen.py g2: engine (cold + 3 warm), baselines, the peer, service x3, restart
#   PART=g1 bash ops/gpu/perf.sh     # the same for G1 (and the static-cache baseline)
#   PART=g2-service bash ops/gpu/perf.sh  # G2 through the service only (x3, then the restart), no engine step;
#                                         # PROFILE_RESTART=1: py-spy on the restarted worker's first job;
#                                         # PROFILE_WARM_START=1: on the resident worker's second small job
#   PART=g3 bash ops/gpu/perf.sh     # G3: the prefix cache off, on, on without the cascade (3 interleaved runs each)
#   PART=kernel bash ops/gpu/perf.sh # the decode attention alone (decode_kernel.py), the cascade against the plain kernel,
#                                    # fp8 and int8 pages against bf16 ones; CONFIGS_ONLY=1: the launch configs (warps,
#                                    # stages, pages a step) and the shapes alone
#   PART=overlap bash ops/gpu/perf.sh # a decode step as halves on two CUDA streams, a prefill chunk beside a decode
#                                    # step (ops/bench/overlap.py: ~1 minute)
#   PART=writes bash ops/gpu/perf.sh # decode_kernel.py's K/V writes alone (seconds): the kernels' bytes against torch's,
#                                    # and the write folded into the decode kernel against write + kernel
#   FLIP=fold_write PART=flip bash ops/gpu/perf.sh  # G1, the engine alone, with an engine flag as it is and flipped
#                                    # (profile_gen.py --flip: 3 interleaved rounds in one process; ~150 s);
#                                    # ON=g2: G2 instead (~250 s on an H200); FLIP=pages FLIP_TO=2: the decode
#                                    # kernel's pages a step (a number) as it is and at FLIP_TO; KV=fp8 (or
#                                    # int8): with that cache (FLIP=quant_prefill_write, FLIP=quant_pages FLIP_TO=1)
#   PART=g1kv bash ops/gpu/perf.sh   # G1 with kv_cache_dtype fp8 and int8 against auto (3 interleaved runs each),
#                                    # their greedy outputs on the memorized model; KV=fp8 (or int8) PART=g1-service
#                                    # (or g1, g2, g2-service): our runs with that cache
#   PART=prepare bash ops/gpu/perf.sh      # the engine's compile in fresh processes, empty then full cache (prepare.py);
#                                          # the warm runs alternate lazy compiler imports with preloaded ones
#   PART=i26 bash ops/gpu/perf.sh    # issue 26 in one call: G3, then g1json and g1lp, each a third of the box
#   PART=f1 bash ops/gpu/perf.sh     # F1: auto and batch16 variants (F1_VARIANTS), 3 interleaved runs each, 30 steps;
#                                    # F1_VARIANTS=auto,fp8: the FP8 experiment (torchao carried: EXTRA in wheels.sh)
#   PART=f1-service bash ops/gpu/perf.sh   # F1 through the service against plain PEFT, 60 steps, 3 interleaved runs
#   PART=f1-full bash ops/gpu/perf.sh      # F1 as issue 25 states it: 200 steps through the service and of plain PEFT
#                                          # (the curve rule over all of them), repeated while the box allows
#   PART=f1-profile bash ops/gpu/perf.sh   # F1 auto and batch16 (F1_VARIANTS), 2 steps each profiled: a kernel table
#                                          # and a timeline (.trace.json.gz) per variant
#   PART=attention bash ops/gpu/perf.sh    # packed-row attention alone on F1's shapes: torch's flash varlen kernel
#                                          # against cuDNN's ragged one (ops/bench/varlen_attention.py: ~1 minute)
#   PART=grammar bash ops/gpu/perf.sh      # the host parts of a structured-output step (ops/bench/grammar_step.py),
#                                          # on the benchmark model's tokenizer; TOKENIZER_SIZE=151936: a real size
#                                          # (g1json and g1lp take TOKENIZER_SIZE too)
#   PART=check-first bash ops/gpu/perf.sh  # CHECK_FIRST on a model that follows its schema (ops/bench/check_first.py),
#                                          # TOKENIZER_SIZE (default 151936: its model built in ~100 s); SPACED=1: a
#                                          # model that writes its JSON with spaces, SPACED=0.25 a quarter of it;
#                                          # COMPACT=1: under the compact JSON grammar, which refuses those spaces
# PART_S bounds the part (default 540 s). Set BENCH_COMMIT to the commit the device copy holds. PROFILE=1 samples the
# part's Python stacks with py-spy (carried in .whl), child processes included, into $OUT/PART.speedscope.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
source ops/gpu/env.sh || exit 1
export PYTHONFAULTHANDLER=1
PART=${PART:?set PART to one of the parts listed at the top of ops/gpu/perf.sh}
LIMIT=${PART_S:-540}
python3 -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers",
transformers.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
if [[ $PART == i26 ]]; then  # one box per workload; a stuck one leaves the others their time
    third=$((LIMIT / 3)) rc=0
    for part in g3 g1json g1lp; do
        PART=$part PART_S=$third bash "$0" || rc=$?
    done
    exit "$rc"
fi
case $PART in
    g1 | g2) cmd=(python3 ops/bench/gen.py "$PART" --repeat 3 --inproc-s 300 --service-s $((LIMIT - 320))
                  --kv-cache-dtype "${KV:-auto}" --out "$OUT/$PART${KV:+-$KV}.json") ;;
    g1-service | g2-service) cmd=(python3 ops/bench/gen.py "${PART%-service}" --repeat 3 --skip inproc
                                  --kv-cache-dtype "${KV:-auto}" --service-s $((LIMIT - 20))
                                  --out "$OUT/$PART${KV:+-$KV}.json")
        if [[ ${PROFILE_RESTART:-0} == 1 ]]; then  # py-spy on the restarted worker's first job
            export PYSPY=$SITE/bin/py-spy; cmd+=(--profile-restart "$OUT/restart.speedscope.json")
        fi
        if [[ ${PROFILE_WARM_START:-0} == 1 ]]; then  # py-spy on the resident worker's second small job
            export PYSPY=$SITE/bin/py-spy; cmd+=(--profile-warm-start "$OUT/warm-start.speedscope.json")
        fi ;;
    g3) cmd=(python3 ops/bench/gen.py g3 --repeat 3 --no-peer --skip service --inproc-s $((LIMIT - 20)) --out "$OUT/g3.json") ;;
    g1kv) cmd=(python3 ops/bench/gen.py g1kv --repeat 3 --inproc-s $((LIMIT - 20)) --out "$OUT/g1kv.json") ;;
    g1json | g1lp) size=${TOKENIZER_SIZE:-640}  # another size: a BPE of that many tokens instead of the model's 640
                   cmd=(python3 ops/bench/gen.py "$PART" --tokenizer-size "$size" --inproc-s $((LIMIT - 20))
                        --out "$OUT/$PART-$size.json") ;;
    f1) cmd=(python3 ops/bench/f1.py --phases variants --variants "${F1_VARIANTS:-auto,batch16}" --variant-steps 30 --repeat 3
             --budget-s $((LIMIT - 15)) --out "$OUT/f1-variants.json") ;;
    grammar) size=${TOKENIZER_SIZE:-640}
             cmd=(python3 ops/bench/grammar_step.py --tokenizer-size "$size" --out "$OUT/grammar-step-$size.json") ;;
    attention) cmd=(python3 ops/bench/varlen_attention.py --out "$OUT/varlen-attention.json") ;;
    kernel) cmd=(python3 ops/bench/decode_kernel.py ${CONFIGS_ONLY:+--configs-only} --out "$OUT/decode-kernel.json") ;;
    overlap) cmd=(python3 ops/bench/overlap.py --out "$OUT/overlap.json") ;;
    flip) flag=${FLIP:?set FLIP to a name in FLIPS of ops/bench/profile_gen.py}
          cmd=(python3 ops/bench/profile_gen.py "${ON:-g1}" --repeat 3 --flip "$flag" ${FLIP_TO:+--flip-to "$FLIP_TO"}
               --model /tmp/g1-model --kv-cache-dtype "${KV:-auto}"
               --out "$OUT/flip-$flag${FLIP_TO:+-$FLIP_TO}${ON:+-$ON}${KV:+-$KV}.json") ;;
    writes) cmd=(python3 ops/bench/decode_kernel.py --writes-only --out "$OUT/decode-kernel-writes.json") ;;
    check-first) size=${TOKENIZER_SIZE:-151936} name=check-first-$size${SPACED:+-spaced-$SPACED}
                 cmd=(python3 ops/bench/check_first.py --tokenizer-size "$size" ${SPACED:+--spaced "$SPACED"})
                 if [[ ${COMPACT:-0} == 1 ]]; then cmd+=(--compact) name+=-compact; fi
                 cmd+=(--out "$OUT/$name.json") ;;
    prepare) cmd=(python3 ops/bench/prepare.py --out "$OUT/prepare.json"  # ~40 s a run on an H100: PART_S >= 250
                  --runs cold:2:greedy,warm:2:greedy:lazy,warm:2:greedy,warm:2:greedy:lazy,warm:2:greedy) ;;
    f1-profile) cmd=(python3 ops/bench/f1.py --phases variants --variants "${F1_VARIANTS:-auto,batch16}"
                     --variant-steps 12 --profile-steps 2 --budget-s $((LIMIT - 15)) --out "$OUT/f1-profile.json") ;;
    f1-service) cmd=(python3 ops/bench/f1.py --phases service,baseline --steps 60 --repeat 3 --budget-s $((LIMIT - 15))
                     --out "$OUT/f1-service.json") ;;
    f1-full) cmd=(python3 ops/bench/f1.py --budget-s $((LIMIT - 15)) --out "$OUT/f1.json") ;;
    *) echo "perf.sh: unknown PART $PART" >&2; exit 2 ;;
esac
if [[ ${PROFILE:-0} == 1 ]]; then
    cmd=("$SITE/bin/py-spy" record --subprocesses --nonblocking --rate 100 --format speedscope
         -o "$OUT/$PART.speedscope.json" -- "${cmd[@]}")
fi
touch "$OUT/.start"
timeout -s ABRT -k 10 "$LIMIT" "${cmd[@]}" 2>&1 | tee "$OUT/$PART.log" | grep -v "Warning\|warn(" | tail -n 60
rc=${PIPESTATUS[0]}
python3 -m api down > /dev/null 2>&1
log=$JOBS_HOME/logs/worker-0.log  # only a worker this part ran (an earlier part's log is that part's)
if [[ $log -nt $OUT/.start ]]; then
    cp "$log" "$OUT/$PART-worker-0.log"
    grep "WARNING worker.preload" "$log"  # a start-up step that failed here passes on the CPU host (2026-12-05)
fi
rm -f "$OUT/.start"
exit "$rc"
