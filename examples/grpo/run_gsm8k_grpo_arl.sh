#!/usr/bin/env bash
# GSM8K GRPO on Qwen3-0.6B through verl + an Arctic RL server, with or without ZoRRO.
#
# verl (PyPI 0.9.1) runs the GRPO loop on this machine; training, log-probs and generation run on the Arctic
# RL server at ARCTIC_RL_URL (a real Arctic deployment, or `python -m arctic_rl.server --device cuda ...`).
# Without ARCTIC_RL_URL the adapter starts the bundled reference server locally on DEVICE (cuda by default).
# ZORRO=true (default): each unique prompt of a GRPO group is trained once (same maths, less compute);
# ZORRO=false: every rollout is trained as is (the baseline). Nothing else differs between the two runs.
#
# Data: python examples/data_preprocess/gsm8k.py --local_dataset_path /path/to/gsm8k --local_save_dir "$DATA_DIR"
# Token: export ARCTIC_RL_TOKEN=... when the server requires one (read from the environment, never logged).
# Terminal: a header, one progress line per step, the summary; the full output goes to OUT_DIR/<run>/run.log
# (VERBOSE=1 prints it all).
#
#   ZORRO=false ARCTIC_RL_URL=http://arctic-head:7000 bash examples/grpo/run_gsm8k_grpo_arl.sh trainer.total_training_steps=10
set -euo pipefail

############################ User-adjustable ############################

MODEL_DIR="${MODEL_DIR:-Qwen/Qwen3-0.6B}"
DATA_DIR="${DATA_DIR:-${HOME}/data/gsm8k}"
OUT_DIR="${OUT_DIR:-${PWD}/outputs/gsm8k}"
STEPS="${STEPS:-80}"
# ZoRRO: train each unique prompt of a GRPO group once -- true or false.
ZORRO="${ZORRO:-true}"
# Asynchronous GRPO (docs/ASYNC.md): the server generates the next batch while this one trains -- true or false.
ASYNC="${ASYNC:-false}"
SEED="${SEED:-42}"
# A running Arctic RL server; empty/unset: start the bundled reference server on DEVICE.
ARCTIC_RL_URL="${ARCTIC_RL_URL:-}"
DEVICE="${DEVICE:-cuda}"
PYTHON="${PYTHON:-python3}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

source "${SCRIPT_DIR}/../common/gsm8k.sh"  # with recipe.sh and console.sh
recipe_bool ZORRO "${ZORRO}"
recipe_bool ASYNC "${ASYNC}"
mapfile -t ASYNC_CORRECTION < <(recipe_async_correction "${ASYNC}")
recipe_env
PRINT_ONLY="$(recipe_print_only "$@")"
recipe_run_dir "${OUT_DIR}" "qwen3_0p6b_gsm8k_grpo_arl_zorro_${ZORRO}"  # a new directory per run (RESUME=true RUN_NAME=<run> continues one)
if [ "${PRINT_ONLY}" = false ]; then recipe_claim_run_dir; fi
# The server this run talks to: a remote_backend.server.url=... override wins over ARCTIC_RL_URL.
SERVER_URL="$(recipe_server_url "${ARCTIC_RL_URL}" "$@")"

############################ Parameter groups ############################

PROJECT_NAME=gsm8k_grpo_arl
gsm8k_groups  # DATA ACTOR ALGO TRAINER: the GSM8K recipe of every backend
DATA+=(data.train_batch_size=16 data.shuffle=False)
TRAINER+=(trainer.save_freq=-1)

MODEL=(
    actor_rollout_ref.model.path="${MODEL_DIR}"
    actor_rollout_ref.model.use_remove_padding=False
    actor_rollout_ref.model.enable_gradient_checkpointing=True
)

ACTOR+=(
    actor_rollout_ref.actor.optim.lr=1e-6
    actor_rollout_ref.actor.ppo_mini_batch_size=16
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16
)

ROLLOUT=(
    actor_rollout_ref.rollout.name=arctic
    actor_rollout_ref.rollout.n=5
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16
    actor_rollout_ref.rollout.agent.num_workers=1
)

REF=(
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16
)

REWARD=(
    # data_source "openai/gsm8k" is scored by verl's built-in gsm8k rule reward: no custom function.
    reward.num_workers=1
)

REMOTE_BACKEND=(
    remote_backend.server.url="$(recipe_hydra_str "${ARCTIC_RL_URL}")"
    remote_backend.server.local.device="${DEVICE}"
    remote_backend.train.zorro_train.enable="${ZORRO}"
    trainer.v1.remote_backend.async_mode="${ASYNC}"
    remote_backend.train.deepspeed.zero_stage=2
    remote_backend.train.deepspeed.bf16=true
    remote_backend.train.deepspeed.offload_optimizer=false
    remote_backend.weight_sync.cuda_ipc=false
)

############################ Launch ############################

recipe_launch arctic DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER REMOTE_BACKEND ASYNC_CORRECTION -- "$@"
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_init "${RUN_DIR}/run.log"
console_header \
    "GSM8K GRPO, ${MODEL_DIR}, ZoRRO ${ZORRO}, async ${ASYNC}, ${STEPS} steps, verl 0.9.1 + remote backend 'arctic'" \
    "  server:  ${SERVER_URL:-the reference Arctic RL server, started here on ${DEVICE} (none given; stopped at the end)}" \
    "  results: ${RUN_DIR} (metrics.jsonl: verl's per-step metrics)" \
    "  log:     ${RUN_DIR}/run.log (everything else; VERBOSE=1 prints it here)"
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
console_say "GSM8K GRPO finished: metrics in ${VERL_FILE_LOGGER_PATH}, full log in ${RUN_DIR}/run.log"
