#!/usr/bin/env bash
# Reverse-text GRPO on a tiny Qwen3 through verl + the Tinker remote backend, all on this machine (CPU is enough).
#
# verl (PyPI 0.9.1, unmodified) runs the GRPO loop; LoRA training, log-probs and generation go through the
# official Tinker SDK (tinker==0.24.1) to a local Tinker API server: SkyRL's, on CPU (JAX), from the peer kit
# in TINKER_PEER_KIT (its setup.sh builds the server's own venv once, ~1 min; start.sh/stop.sh run it).
# The model, a short SFT warm start and the data are built under OUT_DIR (cached), exactly as for the Arctic
# example; the warm-started model is what the server serves and what Tinker puts a LoRA adapter on.
# Results: OUT_DIR/runs/<run>/{metrics.jsonl,metrics.csv,reward_curve.png}.
#
#   bash examples/grpo/run_reverse_text_grpo_tinker_local.sh                        # defaults below
#   STEPS=10 LORA_RANK=16 bash examples/grpo/run_reverse_text_grpo_tinker_local.sh  # env knobs
#   bash examples/grpo/run_reverse_text_grpo_tinker_local.sh actor_rollout_ref.actor.optim.lr=5e-3  # Hydra overrides
#
# Terminal: a header, one line per GRPO step and the summary; everything else goes to RUN_DIR/run.log.
set -euo pipefail

############################ User-adjustable ############################

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_DIR="$(cd "${SCRIPT_DIR}/../.." && pwd)"
TASK_DIR="$(cd "${SCRIPT_DIR}/../reverse_text" && pwd)"
OUT_DIR="${OUT_DIR:-${PWD}/outputs/reverse_text}"
STEPS="${STEPS:-40}"
SEED="${SEED:-0}"
# LoRA rank of the Tinker run (the peer allows 1..32).
LORA_RANK="${LORA_RANK:-32}"
MODEL_DIR="${MODEL_DIR:-${OUT_DIR}/model_warm_seed${SEED}}"
INIT_MODEL_DIR="${INIT_MODEL_DIR:-${OUT_DIR}/model_init_seed${SEED}}"
DATA_DIR="${DATA_DIR:-${OUT_DIR}/data_seed${SEED}}"
WARM_TARGET="${WARM_TARGET:-0.45}"
PYTHON="${PYTHON:-python3}"
# The Tinker peer kit (setup.sh, start.sh, stop.sh); a running Tinker server at TINKER_URL is used instead when set.
TINKER_PEER_KIT="${TINKER_PEER_KIT:-${REPO_DIR}/../shared/peers/tinker}"
TINKER_URL="${TINKER_URL:-}"
PEER_PORT="${PEER_PORT:-8765}"

source "${SCRIPT_DIR}/../common/reverse_text.sh"  # with recipe.sh and console.sh
recipe_local_env
recipe_run_dir "${OUT_DIR}/runs" "grpo_tinker_rank${LORA_RANK}_seed${SEED}"  # a new directory per run (recipe.sh)
# The SDK insists on a key of the hosted service's shape; a local server checks nothing.
export TINKER_API_KEY="${TINKER_API_KEY:-tml-local-peer}"
PRINT_ONLY="$(recipe_print_only "$@")"
# The server this run talks to: a remote_backend.server.url=... override wins over TINKER_URL.
TINKER_URL="$(recipe_server_url "${TINKER_URL}" "$@")"
if [ -n "${TINKER_URL}" ]; then
    SERVER_LINE="the Tinker server at ${TINKER_URL} (given; none is started here)"
else
    SERVER_LINE="the SkyRL Tinker server, started here on 127.0.0.1:${PEER_PORT} (stopped at the end)"
fi

if [ "${PRINT_ONLY}" = false ]; then
    recipe_claim_run_dir
    console_init "${RUN_DIR}/run.log"
    console_header \
        "reverse-text GRPO through Tinker: a tiny Qwen3 + LoRA rank ${LORA_RANK}; ${STEPS} steps, seed ${SEED}" \
        "  stock verl 0.9.1 + remote backend 'tinker' -> ${SERVER_LINE}" \
        "  results: ${RUN_DIR}" \
        "  log:     ${RUN_DIR}/run.log (Ray, verl, the Tinker server's start-up; VERBOSE=1 prints it here)"
    reverse_text_prepare
fi

############################ The Tinker server ############################

PEER_STATE="${RUN_DIR}/tinker-peer"
if [ "${PRINT_ONLY}" = false ] && [ -z "${TINKER_URL}" ]; then
    [ -f "${TINKER_PEER_KIT}/start.sh" ] || { echo "no Tinker peer kit at ${TINKER_PEER_KIT} (set TINKER_PEER_KIT or TINKER_URL)" >&2; exit 2; }
    console_run '^tinker-peer:' bash "${TINKER_PEER_KIT}/setup.sh"
    console_say "[tinker] starting the Tinker server on 127.0.0.1:${PEER_PORT} (JIT warm-up, ~20 s) ..."
    console_run '^READY' bash "${TINKER_PEER_KIT}/start.sh" "${MODEL_DIR}" "${PEER_PORT}" "${PEER_STATE}"
    trap 'bash "${TINKER_PEER_KIT}/stop.sh" "${PEER_STATE}" >/dev/null 2>&1 || true' EXIT
    TINKER_URL="http://127.0.0.1:${PEER_PORT}"
fi
# the server's base model is the directory's absolute path: the same string goes to verl
MODEL_ABS="$(cd "${MODEL_DIR}" 2>/dev/null && pwd || echo "${MODEL_DIR}")"

############################ Parameter groups ############################

LR=2e-3
PROJECT_NAME=reverse_text_grpo_tinker
reverse_text_groups  # DATA ACTOR ROLLOUT ALGO REWARD TRAINER: the recipe both backends run

MODEL=(
    actor_rollout_ref.model.path="${MODEL_ABS}"
    actor_rollout_ref.model.lora_rank="${LORA_RANK}"
    actor_rollout_ref.model.use_remove_padding=False
)

REMOTE_BACKEND=(
    remote_backend.server.url="'${TINKER_URL:-http://127.0.0.1:${PEER_PORT}}'"
    # all 32 prompts x 8 samples of a step in one batch: 32 sample calls with num_samples=8, in flight together
    remote_backend.rollout.max_batch_size=256
    remote_backend.rollout.max_wait_ms=100
)

############################ Launch ############################

recipe_launch tinker DATA MODEL ACTOR ROLLOUT ALGO REWARD TRAINER REMOTE_BACKEND -- "$@"
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_say "[grpo] starting verl and Ray, connecting to ${TINKER_URL} (about a minute before step 1) ..."
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
reverse_text_finish "reverse-text GRPO through Tinker finished."
