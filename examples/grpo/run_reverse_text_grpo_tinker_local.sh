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
RUN_NAME="${RUN_NAME:-grpo_tinker_rank${LORA_RANK}_seed${SEED}}"
RUN_DIR="${RUN_DIR:-${OUT_DIR}/runs/${RUN_NAME}}"
PYTHON="${PYTHON:-python3}"
# The Tinker peer kit (setup.sh, start.sh, stop.sh); a running Tinker server at TINKER_URL is used instead when set.
TINKER_PEER_KIT="${TINKER_PEER_KIT:-${REPO_DIR}/../shared/peers/tinker}"
TINKER_URL="${TINKER_URL:-}"
PEER_PORT="${PEER_PORT:-8765}"

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 RAY_DEDUP_LOGS=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1 TQ_NUM_THREADS="${TQ_NUM_THREADS:-1}"
# The SDK insists on a key of the hosted service's shape; a local server checks nothing.
export TINKER_API_KEY="${TINKER_API_KEY:-tml-local-peer}"

PRINT_ONLY=false
for arg in "$@"; do
    case "${arg}" in --cfg|--cfg=*|-c|--help|--hydra-help|--info|--info=*) PRINT_ONLY=true ;; esac
done

if [ "${PRINT_ONLY}" = false ]; then
    source "${SCRIPT_DIR}/../common/console.sh"
    console_init "${RUN_DIR}/run.log"
    console_say "================================================================================"
    console_say "reverse-text GRPO through Tinker: a tiny Qwen3 + LoRA rank ${LORA_RANK}; ${STEPS} steps, seed ${SEED}"
    console_say "  stock verl 0.9.1 + remote backend 'tinker': ${TINKER_URL:-the SkyRL Tinker server, started on 127.0.0.1:${PEER_PORT}}"
    console_say "  results: ${RUN_DIR}"
    console_say "  log:     ${RUN_DIR}/run.log"
    console_say "================================================================================"
fi

############################ Model, warm start, data (cached) ############################

if [ "${PRINT_ONLY}" = false ] && [ ! -f "${MODEL_DIR}/warm_start.json" ]; then
    if [ ! -f "${INIT_MODEL_DIR}/config.json" ]; then
        console_run '^\[make_model\]' "${PYTHON}" "${TASK_DIR}/make_model.py" --out "${INIT_MODEL_DIR}" --seed "${SEED}"
    fi
    console_say "[warm_start] supervised warm start until sampled reward ${WARM_TARGET} (about a minute) ..."
    console_run '^\[warm_start\] (reached|did NOT reach)' "${PYTHON}" "${TASK_DIR}/warm_start.py" \
        --model "${INIT_MODEL_DIR}" --out "${MODEL_DIR}" --target "${WARM_TARGET}" --seed "${SEED}"
fi
if [ "${PRINT_ONLY}" = false ] && { [ ! -f "${DATA_DIR}/train.parquet" ] || [ ! -f "${DATA_DIR}/val.parquet" ]; }; then
    console_run '^\[make_data\]' "${PYTHON}" "${TASK_DIR}/make_data.py" --out "${DATA_DIR}" --n-train 4096 --n-val 128 \
        --seed "${SEED}"
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
MODEL_ABS="$(cd "${MODEL_DIR}" 2>/dev/null && pwd || echo "${MODEL_DIR}")"

export VERL_FILE_LOGGER_PATH="${RUN_DIR}/metrics.jsonl"
if [ "${PRINT_ONLY}" = false ]; then mkdir -p "${RUN_DIR}" && rm -f "${VERL_FILE_LOGGER_PATH}"; fi

############################ Parameter groups ############################

DATA=(
    data.train_files="${DATA_DIR}/train.parquet"
    data.val_files="${DATA_DIR}/val.parquet"
    data.train_batch_size=32
    data.max_prompt_length=64
    data.max_response_length=10
    data.truncation=error
    data.filter_overlong_prompts=False
    data.shuffle=True
    data.seed="${SEED}"
    data.dataloader_num_workers=0
)

MODEL=(
    actor_rollout_ref.model.path="${MODEL_ABS}"
    actor_rollout_ref.model.lora_rank="${LORA_RANK}"
    actor_rollout_ref.model.use_remove_padding=False
)

ACTOR=(
    actor_rollout_ref.actor.optim.lr=2e-3
    actor_rollout_ref.actor.optim.betas=[0.9,0.99]
    actor_rollout_ref.actor.optim.weight_decay=0.0
    actor_rollout_ref.actor.optim.clip_grad=1.0
    actor_rollout_ref.actor.ppo_mini_batch_size=32
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=256
    actor_rollout_ref.actor.ppo_epochs=1
    actor_rollout_ref.actor.clip_ratio=0.2
    actor_rollout_ref.actor.loss_agg_mode=token-mean
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
    actor_rollout_ref.actor.data_loader_seed="${SEED}"
)

ROLLOUT=(
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256
    actor_rollout_ref.rollout.agent.num_workers=1
    actor_rollout_ref.rollout.seed="${SEED}"
)

ALGO=(
    algorithm.adv_estimator=grpo
    algorithm.norm_adv_by_std_in_grpo=True
    algorithm.use_kl_in_reward=False
)

REWARD=(
    reward.custom_reward_function.path="${TASK_DIR}/reward.py"
    reward.custom_reward_function.name=compute_score
    reward.num_workers=1
)

TRAINER=(
    trainer.logger=[console,file]
    trainer.project_name=reverse_text_grpo_tinker
    trainer.experiment_name="${RUN_NAME}"
    trainer.total_training_steps="${STEPS}"
    trainer.total_epochs=1000
    trainer.val_before_train=False
    trainer.test_freq=-1
    trainer.save_freq=-1
    trainer.default_local_dir="${RUN_DIR}/checkpoints"
)

REMOTE_BACKEND=(
    remote_backend.server.url="'${TINKER_URL:-http://127.0.0.1:${PEER_PORT}}'"
    # all 32 prompts x 8 samples of a step in one batch: 32 sample calls with num_samples=8, in flight together
    remote_backend.rollout.max_batch_size=256
    remote_backend.rollout.max_wait_ms=100
)

############################ Launch ############################

LAUNCH=(
    "${PYTHON}" -m verl.remote_backend.main_ppo
    "${DATA[@]}" "${MODEL[@]}" "${ACTOR[@]}" "${ROLLOUT[@]}" "${ALGO[@]}" "${REWARD[@]}" "${TRAINER[@]}"
    "${REMOTE_BACKEND[@]}"
    remote_backend=tinker
    hydra.run.dir="${RUN_DIR}/hydra"
    "$@"
)
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_say "[grpo] starting verl and Ray (about a minute before step 1) ..."
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
console_run '^\[plot\]' "${PYTHON}" "${TASK_DIR}/plot.py" "${VERL_FILE_LOGGER_PATH}" --out-dir "${RUN_DIR}"

console_say "================================================================================"
console_say "reverse-text GRPO through Tinker finished. Results in ${RUN_DIR}:"
console_say "  metrics.jsonl, metrics.csv, reward_curve.png, summary.json, run.log"
console_say "================================================================================"
