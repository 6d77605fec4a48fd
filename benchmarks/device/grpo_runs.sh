#!/usr/bin/env bash
# Run the SmolLM2 arithmetic GRPO recipe several times in a row on one GPU machine, each run alone on the GPU,
# and collect what benchmarks/real_model_report.py reads (metrics.jsonl, gpu_mem.csv, summary.json) per run.
#
#   bash benchmarks/device/grpo_runs.sh RESULTS_DIR SPEC [SPEC ...]
#   SPEC = NAME:BACKEND:STYLE:ZORRO:SEED   BACKEND arl (remote_backend=arctic, reference server) or stock (stock
#          verl, colocated FSDP + vLLM); STYLE short or fewshot; ZORRO true/false (ignored for stock); SEED an integer
#   e.g. arl_off_short:arl:short:false:0 stock_short:stock:short:false:0 arl_on_fewshot:arl:fewshot:true:0
#
# Meant to be started detached (setsid) on the lent GPU machine after benchmarks/device/unpack.sh, then polled:
# RESULTS_DIR/status gets one line per finished run and ALLDONE at the end. The repository is copied first, so a
# later call that lays a new working tree does not change the scripts under a running job. Runs never overlap
# (a lock), so a second invocation queues behind the first. Environment: TREE_TAR (a `git archive` of the tree to
# run; default: a copy of the current directory), ENV_FILE (sourced in that copy; what unpack.sh wrote), OUT_BASE (model, data and run directories; default /tmp/arith), STEPS (default 50), RUN_TIMEOUT (s per
# run, default 3000: stock verl measured 35 s a step on an H200, ~31 min for 50), SMOLLM2_WHEEL (the model wheel),
# and any knob of examples/common/arithmetic.sh.
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
flock 9

cleanup_gpu() {  # whatever a run left behind: Ray, the run's own reference server, vLLM engines
    ray stop --force >/dev/null 2>&1 || true
    # only servers of these runs (their checkpoint root is under OUT_BASE), never another user's
    pkill -f -- "arctic_rl.server .*--checkpoint-root ${OUT_BASE}/" >/dev/null 2>&1 || true
    pkill -f "VLLM::EngineCore" >/dev/null 2>&1 || true
    sleep 3
}

for spec in "$@"; do
    IFS=: read -r name backend style zorro seed <<<"$spec"
    case "$backend" in
        arl) script=examples/grpo/run_arithmetic_grpo_smollm2.sh ;;
        stock) script=examples/grpo/run_arithmetic_grpo_smollm2_stock.sh ;;
        *) echo "$name: unknown backend '$backend' (arl or stock)" >>"$results/status"; continue ;;
    esac
    out="$results/$name"
    mkdir -p "$out"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -l 2 >"$out/gpu_mem.csv" 2>/dev/null &
    smi=$!
    start=$(date +%s)
    echo "$(date -u +%H:%M:%S) start $name ($spec)" >>"$results/status"
    OUT_DIR="$OUT_BASE" RUN_NAME="$name" STEPS="${STEPS:-50}" SEED="$seed" PROMPT_STYLE="$style" ZORRO="$zorro" \
        PYTHON=python3 timeout "${RUN_TIMEOUT:-3000}" bash "$script" >"$out/console.txt" 2>&1
    rc=$?
    kill "$smi" 2>/dev/null
    run_dir="$OUT_BASE/runs/$name"
    for f in metrics.jsonl metrics.csv summary.json reward_curve.png; do
        [ -f "$run_dir/$f" ] && cp "$run_dir/$f" "$out/"
    done
    [ -f "$run_dir/run.log" ] && tail -n 400 "$run_dir/run.log" >"$out/run_tail.log"
    steps=$(wc -l <"$out/metrics.jsonl" 2>/dev/null || echo 0)
    echo "$(date -u +%H:%M:%S) done $name rc=$rc wall=$(( $(date +%s) - start ))s metric_lines=$steps" >>"$results/status"
    cleanup_gpu
done
echo "ALLDONE $(date -u +%H:%M:%S)" >>"$results/status"
