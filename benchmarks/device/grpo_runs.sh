#!/usr/bin/env bash
# Run the SmolLM2 arithmetic GRPO recipe several times in a row on one GPU machine, each run alone on the GPU,
# and collect what benchmarks/real_model_report.py reads (metrics.jsonl, gpu_mem.csv, summary.json) per run.
#
#   bash benchmarks/device/grpo_runs.sh RESULTS_DIR SPEC [SPEC ...]
#   SPEC = NAME:BACKEND:STYLE:ZORRO:SEED[:OVERRIDES]   BACKEND arl (remote_backend=arctic, reference server), arl_async
#          (the same in asynchronous mode, as ASYNC=true does for every arl run) or stock (stock verl, colocated
#          FSDP + vLLM); STYLE short or fewshot; ZORRO true/false (ignored for stock); SEED an integer; OVERRIDES
#          Hydra overrides for the script, comma-separated (e.g. verl's bypass mode:
#          algorithm.rollout_correction.bypass_mode=true,actor_rollout_ref.rollout.calculate_log_probs=true)
#   e.g. arl_off_short:arl:short:false:0 stock_short:stock:short:false:0 arl_on_fewshot:arl:fewshot:true:0
#
# Meant to be started detached (setsid) on the lent GPU machine after benchmarks/device/unpack.sh, then polled
# (benchmarks/device/collect.sh packs what is there so far): RESULTS_DIR/status gets a line when a run starts and
# ends, and ALLDONE at the end. The repository is copied first, so a later call that lays a new working tree does
# not change the scripts under a running job. One invocation at a time (a lock): a second queues behind the first
# (its status says so). Only this script holds the lock, not what it starts: a chain killed midway leaves samplers
# or a run behind, which must not keep the next invocation waiting.
#
# PARALLEL=0 (default): the runs one after another, each alone on the GPU; gpu_mem.csv is the GPU's total, and
#   gpu_procs.csv each process's share every 5 s (gpu_mem_by_run.py --procs).
# PARALLEL=1: all runs at once on the one GPU, started STAGGER_S seconds apart (default 15). In both modes the model
#   and every data set are built first (runs must not build them concurrently, and RUN_TIMEOUT is the run's own).
#   A SPEC of `--` ends a wave: the runs after it start when those before it have ended (keeps the GPU's memory
#   within bounds). Each run gets GRPO_RUN_NAME in its environment and gpu_mem_by_run.py attributes GPU memory to
#   runs by it. Set KV_CACHE_BYTES and a small
#   GPU_MEMORY_UTILIZATION so that the vLLM engines skip memory profiling, which fails when another process frees
#   memory meanwhile. Step times then include contention for the GPU and the CPUs: compare runs of one batch.
#
# Environment: TREE_TAR (a `git archive` of the tree to run; default: a copy of the current directory), ENV_FILE
# (sourced in that copy; what unpack.sh wrote), OUT_BASE (model, data and run directories; default /tmp/arith),
# STEPS (default 50), RUN_TIMEOUT (s per run, default 3000: stock verl measured 35 s a step on an H200 at 64 x 8,
# ~31 min for 50), SMOLLM2_WHEEL (the model wheel), and any knob of examples/common/arithmetic.sh and the scripts.
set -uo pipefail
results=${1:?usage: grpo_runs.sh RESULTS_DIR SPEC...}
shift
[ $# -gt 0 ] || { echo "grpo_runs.sh: no run given (SPEC = NAME:BACKEND:STYLE:ZORRO:SEED)" >&2; exit 2; }
mkdir -p "$results"
results=$(cd "$results" && pwd)
OUT_BASE=${OUT_BASE:-/tmp/arith}
snapshot=$(mktemp -d /tmp/grpo_repo.XXXX)
mkdir -p "$snapshot/repo"
if [ -n "${TREE_TAR:-}" ]; then  # a committed tree (git archive), not whatever the working tree holds
    tar -xf "$TREE_TAR" -C "$snapshot/repo" || exit 1
else
    tar --exclude=./.devparts --exclude='./.vllm?' --exclude=./.whl --exclude=./.arl --exclude=./outputs -cf - . \
        | tar -xf - -C "$snapshot/repo"
fi
cd "$snapshot/repo" || exit 1
if [ -n "${ENV_FILE:-}" ]; then  # from the snapshot: unpack.sh's env.sh links the current checkout's packages
    # shellcheck disable=SC1090
    source "$ENV_FILE"
fi

exec 9>/tmp/grpo_runs.lock
if ! flock -n 9; then  # say so where the poll looks: a run queued behind another shows nothing else until it starts
    # the holder wrote its PID and results beside the lock (fuser would list every waiting invocation too)
    echo "$(date -u +%H:%M:%S) waiting for /tmp/grpo_runs.lock (held by: $(cat /tmp/grpo_runs.lock.owner 2>/dev/null))" \
        >>"$results/status"
    flock 9
fi
echo "PID $$, $results" >/tmp/grpo_runs.lock.owner

cleanup_gpu() {  # whatever a run left behind: Ray, the run's own reference server, vLLM engines
    ray stop --force >/dev/null 2>&1 || true
    # only servers of these runs (their checkpoint root is under OUT_BASE), never another user's
    pkill -f -- "arctic_rl.server .*--checkpoint-root ${OUT_BASE}/" >/dev/null 2>&1 || true
    pkill -f "VLLM::EngineCore" >/dev/null 2>&1 || true
    sleep 3
}

run_one() {  # SPEC OWN_SMI: one run, its files copied into RESULTS/NAME (OWN_SMI=1: the GPU total in its gpu_mem.csv)
    local spec=$1 own_smi=$2 name backend style zorro seed extra script out smi="" procs="" start rc run_dir f steps
    local async="${ASYNC:-false}"
    local -a overrides=()
    IFS=: read -r name backend style zorro seed extra <<<"$spec"
    [ -n "$extra" ] && IFS=, read -r -a overrides <<<"$extra"
    case "$backend" in
        arl) script=examples/grpo/run_arithmetic_grpo_smollm2.sh ;;
        arl_async) script=examples/grpo/run_arithmetic_grpo_smollm2.sh async=true ;;
        stock) script=examples/grpo/run_arithmetic_grpo_smollm2_stock.sh ;;
        *) echo "$name: unknown backend '$backend' (arl, arl_async or stock)" >>"$results/status"; return ;;
    esac
    out="$results/$name"
    mkdir -p "$out"
    if [ "$own_smi" = 1 ]; then
        # every 200 ms with its wall-clock time (a step's update or a save lasts well under the 2 s used before
        # 2026-12-06, whose samples missed such peaks), to be lined up with the server's and verl's logs
        nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 200 >"$out/gpu_mem.csv" 2>/dev/null 9>&- &
        smi=$!
        # which process holds what (the run is alone on the GPU): gpu_procs.csv
        python3 benchmarks/device/gpu_mem_by_run.py --procs "$out/gpu_procs.csv" --interval 5 9>&- &
        procs=$!
    fi
    start=$(date +%s)
    echo "$(date -u +%H:%M:%S) start $name ($spec)" >>"$results/status"
    GRPO_RUN_NAME="$name" OUT_DIR="$OUT_BASE" RUN_NAME="$name" STEPS="${STEPS:-50}" SEED="$seed" PROMPT_STYLE="$style" \
        ZORRO="$zorro" ASYNC="$async" PYTHON=python3 timeout "${RUN_TIMEOUT:-3000}" bash "$script" "${overrides[@]}" >"$out/console.txt" 2>&1 9>&-
    rc=$?
    [ -n "$smi" ] && kill "$smi" 2>/dev/null
    [ -n "$procs" ] && kill "$procs" 2>/dev/null
    run_dir="$OUT_BASE/runs/$name"
    for f in metrics.jsonl metrics.csv summary.json reward_curve.png; do
        [ -f "$run_dir/$f" ] && cp "$run_dir/$f" "$out/"
    done
    [ -f "$run_dir/run.log" ] && tail -n 400 "$run_dir/run.log" >"$out/run_tail.log"
    bash benchmarks/device/server_calls.sh "$run_dir" "$out/server_calls.log"
    steps=$(wc -l <"$out/metrics.jsonl" 2>/dev/null || echo 0)
    echo "$(date -u +%H:%M:%S) done $name rc=$rc wall=$(( $(date +%s) - start ))s metric_lines=$steps" >>"$results/status"
}

prepare_all() {  # the model and each data set once, as the scripts build them, before runs that would race for them
    local spec name backend style zorro seed key done_keys=" "
    for spec in "$@"; do
        [ "$spec" = -- ] && continue
        IFS=: read -r name backend style zorro seed _ <<<"$spec"
        key="${style}_seed${seed}"
        case "$done_keys" in *" $key "*) continue ;; esac
        done_keys+="$key "
        (   # examples/common/arithmetic.sh's own settings and build, in a subshell of their own
            TASK_DIR="$PWD/examples/arithmetic" OUT_DIR="$OUT_BASE" PROMPT_STYLE="$style" SEED="$seed" PYTHON=python3
            RUN_DIR="$OUT_BASE/prepare/$key"
            source examples/common/arithmetic.sh
            arithmetic_settings
            console_init "$RUN_DIR/prepare.log"
            arithmetic_prepare
        ) >>"$results/prepare.log" 2>&1 || return 1
    done
}

# the model and data first in either mode: a run's RUN_TIMEOUT then covers the run alone (on a fresh machine the model's
# build took 54 s of a 420 s limit, and the first run hit the limit at its first step; RESULTS.md §2v)
echo "$(date -u +%H:%M:%S) preparing the model and data" >>"$results/status"
prepare_all "$@" || { echo "prepare failed: see prepare.log" >>"$results/status"; echo "ALLDONE" >>"$results/status"; exit 1; }
if [ "${PARALLEL:-0}" = 1 ]; then
    for spec in "$@"; do [ "$spec" = -- ] || mkdir -p "$results/${spec%%:*}"; done
    python3 benchmarks/device/gpu_mem_by_run.py "$results" 9>&- &
    sampler=$!
    pids=()
    for spec in "$@"; do
        if [ "$spec" = -- ]; then  # a wave ends: wait for its runs before the next one starts
            [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
            pids=()
            cleanup_gpu
            continue
        fi
        run_one "$spec" 0 9>&- &
        pids+=($!)
        sleep "${STAGGER_S:-15}"
    done
    [ ${#pids[@]} -gt 0 ] && wait "${pids[@]}"
    kill "$sampler" 2>/dev/null
    cleanup_gpu
else
    for spec in "$@"; do
        [ "$spec" = -- ] && continue
        run_one "$spec" 1
        cleanup_gpu
    done
fi
echo "ALLDONE $(date -u +%H:%M:%S)" >>"$results/status"
