#!/usr/bin/env bash
# Start gpujobs workers on a bare host: one supervised worker per slice (`jobs supervise --gpus SLICE`), in the
# background.
#
#   ops/launch-workers.sh "0,1" "2" "3"     three workers: GPUs 0+1, GPU 2, GPU 3 (nvidia-smi's indices)
#   ops/launch-workers.sh none              one CPU worker
#   ops/launch-workers.sh status            what this host runs (pid, slice, alive or not)
#   ops/launch-workers.sh stop [SLICE...]   stop all workers started here, or the named slices
#
# Each slice gets $JOBS_HOME/run/worker-<slice>.pid (its supervisor's pid) and $JOBS_HOME/logs/worker-<slice>.log
# (supervisor and worker), commas written as dashes (worker-0-1.pid); JOBS_HOME defaults to ~/.gpujobs, as for
# `jobs up`. Cluster settings (JOBS_REDIS_URL, JOBS_DATABASE_URL, JOBS_ARTIFACTS, ...) come from this script's
# environment: see docs/cluster.md. The worker gets CUDA_DEVICE_ORDER=PCI_BUS_ID and CUDA_VISIBLE_DEVICES=<slice>
# on its own environment.
#
# The supervisor restarts a worker that exits, as `jobs up` does: after 1 s, doubling up to 60 s; a slice whose
# worker exited 5 times in 10 minutes, or with a configuration error (exit 2, 5, 6, 77, 78), stays down: its
# supervisor exits 1, `status` shows it dead, and `jobs workers` says why (JOBS_RESTART_* settings change the limits).
#
# Refuses (nothing is started) when two slices share a GPU, when a slice overlaps a worker already running
# from this JOBS_HOME, or when an inherited CUDA_VISIBLE_DEVICES does not contain every slice.
# Starting returns once every worker consumes its queue (or died: then its log's last lines are shown).
# Exit status: 0 ok, 1 a worker stays down at start, was not ready in time or did not stop, 2 usage, 5 GPU
# conflict (as `jobs`).
# JOBS_BIN: the `jobs` program (default: the one on PATH; the shell's `jobs` builtin hides it from plain calls).
# START_TIMEOUT: seconds to wait for the workers to consume (default 180; they import torch first).
# STOP_TIMEOUT: seconds a worker gets to hand back its shard on stop before SIGKILL (default 120; the supervisor
# itself gets 30 s more).
set -euo pipefail

HOME_DIR=${JOBS_HOME:-$HOME/.gpujobs}
RUN_DIR=$HOME_DIR/run
LOG_DIR=$HOME_DIR/logs
STOP_TIMEOUT=${STOP_TIMEOUT:-120}

die() { local code=$1; shift; echo "launch-workers: $*" >&2; exit "$code"; }

usage() {
    sed -n '2,8p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# A slice as `jobs` spells it: "none" for the CPU, else indices or GPU-/MIG- UUIDs joined by commas.
# Sets SLICE (no subshell, so that a refusal exits the script with its status).
normalize() {
    local text=${1// /} dev seen=","
    case ${text,,} in "" | none | cpu) SLICE=none; return ;; esac
    IFS=, read -r -a devs <<<"$text"
    for dev in "${devs[@]}"; do
        if ! [[ $dev =~ ^[0-9]+$ || $dev == GPU-* || $dev == MIG-* ]]; then
            die 2 "bad GPU '$dev' in slice '$1': use indices as nvidia-smi shows them (0,1), GPU UUIDs, or none"
        fi
        if [[ $seen == *",$dev,"* ]]; then die 2 "slice '$1' names GPU $dev twice"; fi
        seen+="$dev,"
    done
    SLICE=$(IFS=,; echo "${devs[*]}")
}

devices_of() { [[ $1 == none ]] || tr , '\n' <<<"$1"; }
tag_of() { echo "${1//,/-}"; }                 # file-name form of a slice: 0,1 -> 0-1
pid_file() { echo "$RUN_DIR/worker-$(tag_of "$1").pid"; }

# A process that runs (a zombie, exited but not yet reaped, does not).
alive() {
    kill -0 "$1" 2>/dev/null || return 1
    local stat
    stat=$(<"/proc/$1/stat") 2>/dev/null || return 0
    [[ ${stat##*) } != Z* ]]
}

# The pid in a pid file, if that process is still our supervisor (not a recycled pid). From the launch on, its
# command line reads `env ... setsid .../jobs supervise --gpus S`, then `... jobs supervise --gpus S`.
live_pid() {
    local file=$1 pid
    [[ -f $file ]] || return 1
    pid=$(sed -n 1p "$file")
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -Eq 'jobs supervise' || return 1
    echo "$pid"
}

# Slices of the workers running from this JOBS_HOME (from their pid files).
running_slices() {
    local file
    for file in "$RUN_DIR"/worker-*.pid; do
        [[ -e $file ]] || continue
        if live_pid "$file" >/dev/null; then
            sed -n 2p "$file"
        fi
    done
}

start() {
    local slices=() slice dev
    for slice in "$@"; do normalize "$slice"; slices+=("$SLICE"); done

    local -A owner=() given=()
    for slice in "${slices[@]}"; do
        if [[ -n ${given[$slice]:-} ]]; then die 5 "slice '$slice' is given twice"; fi
        given[$slice]=1
    done
    # Two workers never share a GPU: not among the arguments, not with workers already running.
    local running
    running=$(running_slices)
    for slice in $running "${slices[@]}"; do
        for dev in $(devices_of "$slice"); do
            if [[ -n ${owner[$dev]:-} ]]; then
                die 5 "GPU $dev is in slice '${owner[$dev]}' and in slice '$slice': two workers never share a GPU"
            fi
            owner[$dev]=$slice
        done
    done
    for slice in "${slices[@]}"; do
        if [[ $slice == none ]] && grep -qx none <<<"$running"; then
            die 5 "a CPU worker already runs from $HOME_DIR (stop it first)"
        fi
    done

    # An inherited CUDA_VISIBLE_DEVICES (a scheduler's allocation) must contain every slice; each worker then
    # gets its own slice, set by `jobs worker`, never the inherited value.
    if [[ -n ${CUDA_VISIBLE_DEVICES+set} ]]; then
        local allowed=",${CUDA_VISIBLE_DEVICES// /},"
        for slice in "${slices[@]}"; do
            for dev in $(devices_of "$slice"); do
                if [[ $allowed != *",$dev,"* ]]; then
                    die 5 "CUDA_VISIBLE_DEVICES='$CUDA_VISIBLE_DEVICES' is set in this shell but slice '$slice'" \
                        "uses GPU $dev: unset it or pass slices within it"
                fi
            done
        done
    fi

    local jobs_bin=${JOBS_BIN:-$(type -P jobs || true)}
    if [[ -z $jobs_bin || ! -x $jobs_bin ]]; then
        die 2 "the jobs program was not found on PATH: activate the gpujobs environment or set JOBS_BIN"
    fi

    mkdir -p "$RUN_DIR" "$LOG_DIR"
    local started=() pid log
    local -A offset=()
    for slice in "${slices[@]}"; do
        log=$LOG_DIR/worker-$(tag_of "$slice").log
        offset[$slice]=$(stat -c %s "$log" 2>/dev/null || echo 0)
        # setsid: a session of its own, so that a Ctrl-C in this terminal does not reach the supervisor or its
        # worker. $! is the supervisor's pid (its worker is its child). 9>&-: not holding our lock.
        env -u CUDA_VISIBLE_DEVICES setsid "$jobs_bin" supervise --gpus "$slice" --stop-timeout "$STOP_TIMEOUT" \
            </dev/null >>"$log" 2>&1 9>&- &
        pid=$!
        printf '%s\n%s\n' "$pid" "$slice" >"$(pid_file "$slice")"
        started+=("$slice")
        echo "worker   slice $slice (pid $pid, log $log)"
    done
    wait_ready "${started[@]}"
}

# Until each worker consumes (Celery logs "ready.") or its slice stays down. A worker with a configuration error
# (bad slice, GPU conflict) stays down at once, one that keeps crashing (database unreachable) after 5 tries:
# either way its supervisor exits. One still starting after START_TIMEOUT seconds (e.g. Redis unreachable: it
# keeps retrying) is left running and reported. Uses `offset` from start().
wait_ready() {
    local pending=("$@") next slice log failed=0
    local deadline=$((SECONDS + ${START_TIMEOUT:-180}))
    while [[ ${#pending[@]} -gt 0 ]]; do
        next=()
        for slice in "${pending[@]}"; do
            log=$LOG_DIR/worker-$(tag_of "$slice").log
            if tail -c "+$((offset[$slice] + 1))" "$log" 2>/dev/null | grep -q ' ready\.'; then
                echo "ready    slice $slice"
            elif ! live_pid "$(pid_file "$slice")" >/dev/null; then
                failed=1
                echo "launch-workers: the worker for slice $slice stays down (its supervisor exited during start);" \
                    "last lines of $log:" >&2
                tail -n 20 "$log" >&2 || true
                rm -f "$(pid_file "$slice")"
            else
                next+=("$slice")
            fi
        done
        pending=("${next[@]}")
        if [[ ${#pending[@]} -gt 0 && $SECONDS -ge $deadline ]]; then
            for slice in "${pending[@]}"; do
                echo "launch-workers: the worker for slice $slice is still starting after ${START_TIMEOUT:-180}s" \
                    "(left running; see $LOG_DIR/worker-$(tag_of "$slice").log)" >&2
            done
            return 1
        fi
        [[ ${#pending[@]} -eq 0 ]] || sleep 0.5
    done
    return "$failed"
}

stop() {
    local files=() file slice
    if [[ $# -eq 0 ]]; then
        for file in "$RUN_DIR"/worker-*.pid; do [[ -e $file ]] && files+=("$file"); done
    else
        for slice in "$@"; do
            normalize "$slice"
            file=$(pid_file "$SLICE")
            if [[ ! -e $file ]]; then die 2 "no worker for slice '$slice' was started from $HOME_DIR"; fi
            files+=("$file")
        done
    fi
    [[ ${#files[@]} -gt 0 ]] || { echo "no workers were started from $HOME_DIR"; return 0; }

    # SIGTERM to the supervisor: it stops restarting; its worker stops taking tasks and hands its shard back.
    local pids=() pid
    for file in "${files[@]}"; do
        if pid=$(live_pid "$file"); then
            kill -TERM "$pid"
            pids+=("$pid")
            echo "stopping slice $(sed -n 2p "$file") (pid $pid)"
        fi
    done
    local deadline=$((SECONDS + STOP_TIMEOUT + 30)) still=()
    while [[ ${#pids[@]} -gt 0 ]]; do
        still=()
        for pid in "${pids[@]}"; do
            if alive "$pid"; then still+=("$pid"); fi
        done
        if [[ ${#still[@]} -eq 0 || $SECONDS -ge $deadline ]]; then break; fi
        sleep 0.5
    done
    local rc=0
    for pid in "${still[@]}"; do
        echo "launch-workers: pid $pid did not stop in $((STOP_TIMEOUT + 30))s: killing it" >&2
        kill -KILL "$pid" 2>/dev/null || true
        rc=1
    done
    rm -f "${files[@]}"
    return "$rc"
}

status() {
    local file pid found=0
    for file in "$RUN_DIR"/worker-*.pid; do
        [[ -e $file ]] || continue
        found=1
        if pid=$(live_pid "$file"); then
            echo "running  slice $(sed -n 2p "$file") (pid $pid)"
        else
            echo "dead     slice $(sed -n 2p "$file") (pid $(sed -n 1p "$file"); see $LOG_DIR)"
        fi
    done
    [[ $found -eq 1 ]] || echo "no workers were started from $HOME_DIR"
}

main() {
    [[ $# -ge 1 ]] || usage
    case $1 in
        -h | --help) usage ;;
        stop) shift; stop "$@" ;;
        status) status ;;
        start) shift; [[ $# -ge 1 ]] || usage; start "$@" ;;
        *) start "$@" ;;
    esac
}

# One launcher at a time per JOBS_HOME: the overlap check and the starts are one step.
mkdir -p "$RUN_DIR"
exec 9>"$RUN_DIR/launch-workers.lock"
flock -n 9 || die 1 "another launch-workers.sh is running for $HOME_DIR"
main "$@"
