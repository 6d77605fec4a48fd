#!/usr/bin/env bash
# GSM8K GRPO with a LoRA adapter on a Qwen3 model, trained and sampled by the hosted Tinker service.
#
# verl (PyPI 0.9.1) runs the GRPO loop on this machine (no GPU needed); LoRA training, log-probs and
# generation run on Tinker through its official SDK (pip install '.[tinker]', Python >= 3.11). The API key
# comes from TINKER_API_KEY (never from a config file). TINKER_URL selects another Tinker-compatible service
# (empty: the SDK's default, the hosted service). verl reads the tokenizer from MODEL (a hub name or a local
# copy of the same model); the service trains the base model of the same name (BASE_MODEL to override).
#
# Data: python examples/data_preprocess/gsm8k.py --local_dataset_path /path/to/gsm8k --local_save_dir "$DATA_DIR"
#
#   export TINKER_API_KEY=...
#   bash examples/grpo/run_gsm8k_grpo_tinker.sh trainer.total_training_steps=10
set -euo pipefail

############################ User-adjustable ############################

MODEL="${MODEL:-Qwen/Qwen3-8B}"
BASE_MODEL="${BASE_MODEL:-}"
LORA_RANK="${LORA_RANK:-32}"
DATA_DIR="${DATA_DIR:-${HOME}/data/gsm8k}"
OUT_DIR="${OUT_DIR:-${PWD}/outputs/gsm8k}"
STEPS="${STEPS:-80}"
SEED="${SEED:-42}"
TINKER_URL="${TINKER_URL:-}"
PYTHON="${PYTHON:-python3}"
SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

source "${SCRIPT_DIR}/../common/gsm8k.sh"  # with recipe.sh and console.sh
recipe_env
PRINT_ONLY="$(recipe_print_only "$@")"
recipe_run_dir "${OUT_DIR}" "gsm8k_grpo_tinker_rank${LORA_RANK}"  # a new directory per run (RESUME=true RUN_NAME=<run> continues one)
if [ "${PRINT_ONLY}" = false ]; then recipe_claim_run_dir; fi
# The service this run talks to: a remote_backend.server.url=... override wins over TINKER_URL.
SERVICE_URL="$(recipe_server_url "${TINKER_URL}" "$@")"
if [ "${PRINT_ONLY}" = false ] && [ -z "${TINKER_API_KEY:-}" ]; then
    echo "TINKER_API_KEY is not set: export your Tinker API key first" >&2
    exit 2
fi

############################ Parameter groups ############################

PROJECT_NAME=gsm8k_grpo_tinker
gsm8k_groups  # DATA ACTOR ALGO TRAINER: the GSM8K recipe of every backend
DATA+=(data.train_batch_size=32)
TRAINER+=(trainer.save_freq=20)

MODEL_ARGS=(
    actor_rollout_ref.model.path="${MODEL}"
    actor_rollout_ref.model.lora_rank="${LORA_RANK}"
)

ACTOR+=(
    # LoRA learning rates are ~10x full fine-tuning's
    actor_rollout_ref.actor.optim.lr=4e-5
    actor_rollout_ref.actor.optim.weight_decay=0.0
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32
)

ROLLOUT=(
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32
    actor_rollout_ref.rollout.agent.num_workers=1
)

REMOTE_BACKEND=(
    remote_backend.server.url="$(recipe_hydra_str "${TINKER_URL}")"
    remote_backend.server.base_model="$(recipe_hydra_str "${BASE_MODEL}")"
    # all 32 prompts x 8 samples of a step at once: 32 sample calls with num_samples=8
    remote_backend.rollout.max_batch_size=256
    remote_backend.rollout.max_wait_ms=200
)

############################ Launch ############################

recipe_launch tinker DATA MODEL_ARGS ACTOR ROLLOUT ALGO TRAINER REMOTE_BACKEND -- "$@"
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_init "${RUN_DIR}/run.log"
console_header \
    "GSM8K GRPO, ${MODEL} + LoRA rank ${LORA_RANK}, ${STEPS} steps, verl 0.9.1 + remote backend 'tinker'" \
    "  service: ${SERVICE_URL:-the SDK's default (the hosted Tinker service)}" \
    "  results: ${RUN_DIR} (metrics.jsonl: verl's per-step metrics)" \
    "  log:     ${RUN_DIR}/run.log (everything else; VERBOSE=1 prints it here)"
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
console_say "GSM8K GRPO finished: metrics in ${VERL_FILE_LOGGER_PATH}, full log in ${RUN_DIR}/run.log"
