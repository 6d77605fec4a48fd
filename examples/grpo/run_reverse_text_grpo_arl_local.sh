#!/usr/bin/env bash
# Reverse-text GRPO on a tiny Qwen3 through verl + the Arctic RL remote backend, all on this machine (CPU is enough).
#
# verl (PyPI 0.9.1, unmodified) runs the GRPO loop; actor training, log-probs and generation go over HTTP
# to the bundled reference Arctic RL server, which the adapter starts on 127.0.0.1 and stops at the end
# (remote_backend.server.url=null; ARCTIC_RL_URL=http://host:port uses a running server instead). First run: builds
# the model, a short SFT warm start and the data under OUT_DIR (17-45 s on a 2-core machine, cached afterwards).
# Then 40 GRPO steps; the mean reward climbs from ~0.45 to ~0.8 (4-5 min on a 2-core machine at load 2-4, twice
# that when it is busier: docs/RESULTS_reverse_text.md). Results: a new directory per run,
# OUT_DIR/runs/<run>_<time>/{run.log,metrics.jsonl,metrics.csv,reward_curve.png,summary.json} (runs/latest).
#
#   bash examples/grpo/run_reverse_text_grpo_arl_local.sh                      # defaults below
#   ZORRO=true STEPS=20 bash examples/grpo/run_reverse_text_grpo_arl_local.sh  # env knobs
#   ASYNC=true bash examples/grpo/run_reverse_text_grpo_arl_local.sh           # asynchronous GRPO (docs/ASYNC.md)
#   bash examples/grpo/run_reverse_text_grpo_arl_local.sh actor_rollout_ref.actor.optim.lr=5e-4  # Hydra overrides
#
# Terminal: a header, one line per GRPO step (reward, seconds per phase, ETA) and the summary; everything
# else (Ray, verl, the server's start-up) goes to RUN_DIR/run.log, named in the header. VERBOSE=1 prints it all.
set -euo pipefail

############################ User-adjustable ############################

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TASK_DIR="$(cd "${SCRIPT_DIR}/../reverse_text" && pwd)"
OUT_DIR="${OUT_DIR:-${PWD}/outputs/reverse_text}"
STEPS="${STEPS:-40}"
# ZoRRO: train each unique prompt of a GRPO group once (same maths, less compute) -- true or false.
ZORRO="${ZORRO:-false}"
# Asynchronous GRPO (docs/ASYNC.md): the server generates the next batch while this one trains -- true or false.
ASYNC="${ASYNC:-false}"
# Seeds the model init, the warm start, the data and verl's samplers.
SEED="${SEED:-0}"
# Warm-started model, its untrained init and the parquet data: built when absent, cached per seed.
MODEL_DIR="${MODEL_DIR:-${OUT_DIR}/model_warm_seed${SEED}}"
INIT_MODEL_DIR="${INIT_MODEL_DIR:-${OUT_DIR}/model_init_seed${SEED}}"
DATA_DIR="${DATA_DIR:-${OUT_DIR}/data_seed${SEED}}"
# Stop the SFT warm start once temperature-1 samples score this much (see examples/reverse_text/warm_start.py).
WARM_TARGET="${WARM_TARGET:-0.45}"
# true: run the warm start on the reference server too (its cross_entropy loss) instead of in plain PyTorch.
WARM_VIA_SERVER="${WARM_VIA_SERVER:-false}"
PYTHON="${PYTHON:-python3}"
# A running Arctic RL server (e.g. `python -m arctic_rl.server`); empty: the adapter starts one on 127.0.0.1.
ARCTIC_RL_URL="${ARCTIC_RL_URL:-}"

source "${SCRIPT_DIR}/../common/reverse_text.sh"  # with recipe.sh and console.sh
recipe_bool ZORRO "${ZORRO}"
recipe_bool ASYNC "${ASYNC}"
mapfile -t ASYNC_CORRECTION < <(recipe_async_correction "${ASYNC}")
recipe_bool WARM_VIA_SERVER "${WARM_VIA_SERVER}"
# A new directory per run, OUT_DIR/runs/grpo_zorro_<Z>_seed<S>_<time> (OUT_DIR/runs/latest points at it); a given
# RUN_NAME or RUN_DIR that holds files is refused unless OVERWRITE=true (deletes them) or RESUME=true (keeps them).
recipe_run_dir "${OUT_DIR}/runs" "grpo_zorro_${ZORRO}_seed${SEED}"
recipe_local_env
PRINT_ONLY="$(recipe_print_only "$@")"
# The server this run talks to: a remote_backend.server.url=... override wins over ARCTIC_RL_URL.
SERVER_URL="$(recipe_server_url "${ARCTIC_RL_URL}" "$@")"
if [ -n "${SERVER_URL}" ]; then
    SERVER_LINE="the Arctic RL server at ${SERVER_URL} (given; none is started here)"
    START_LINE="[grpo] starting verl and Ray, connecting to ${SERVER_URL} (step 1 comes once they are up: under"
    START_LINE+=" a minute to two minutes on a 2-core machine, depending on its load) ..."
else
    SERVER_LINE="the reference Arctic RL server, started here on 127.0.0.1 (stopped at the end)"
    START_LINE="[grpo] starting verl, Ray and the reference server (step 1 comes once they are up: 46 s to two"
    START_LINE+=" minutes on a 2-core machine, depending on its load) ..."
fi

if [ "${PRINT_ONLY}" = false ]; then
    recipe_claim_run_dir
    console_init "${RUN_DIR}/run.log"
    console_header \
        "reverse-text GRPO: a tiny Qwen3 (built here) learns to reverse strings; ${STEPS} steps, ZoRRO ${ZORRO}, async ${ASYNC}, seed ${SEED}" \
        "  stock verl 0.9.1 + remote backend 'arctic' -> ${SERVER_LINE}" \
        "  results: ${RUN_DIR}" \
        "  log:     ${RUN_DIR}/run.log (Ray, verl, server start-up; VERBOSE=1 prints it here)"
    WARM_ARGS=()
    if [ "${WARM_VIA_SERVER}" = true ]; then WARM_ARGS+=(--via-server); fi
    reverse_text_prepare "${WARM_ARGS[@]}"
fi

############################ Parameter groups ############################

LR=1e-3
PROJECT_NAME=reverse_text_grpo_arl
reverse_text_groups  # DATA ACTOR ROLLOUT ALGO REWARD TRAINER: the recipe both backends run

MODEL=(
    actor_rollout_ref.model.path="${MODEL_DIR}"
    actor_rollout_ref.model.use_remove_padding=False
    actor_rollout_ref.model.enable_gradient_checkpointing=False
)

ROLLOUT+=(actor_rollout_ref.rollout.name=arctic)
# One checkpoint on the server, at the last step: examples/common/export_hf.py turns it into a Hugging Face directory.
TRAINER+=(trainer.save_freq="${STEPS}")

REF=(
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=256
)

REMOTE_BACKEND=(
    remote_backend.server.url="$(recipe_hydra_str "${ARCTIC_RL_URL}")"
    remote_backend.server.local.checkpoint_root="${RUN_DIR}/server"
    remote_backend.train.zorro_train.enable="${ZORRO}"
    trainer.v1.remote_backend.async_mode="${ASYNC}"
    remote_backend.train.deepspeed.bf16=false
    # all 32x8 samples of a step in one /generate call (verl sends them one by one; the replica batches)
    remote_backend.rollout.max_batch_size=256
    remote_backend.rollout.max_wait_ms=100
)

############################ Launch ############################

recipe_launch arctic DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER REMOTE_BACKEND ASYNC_CORRECTION -- "$@"
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_say "${START_LINE}"
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
reverse_text_finish "reverse-text GRPO finished."
