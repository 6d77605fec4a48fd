#!/usr/bin/env bash
# Reverse-text GRPO on a tiny Qwen3 through verl + the Arctic RL remote backend, all on this machine (CPU is enough).
#
# verl (PyPI 0.9.1, unmodified) runs the GRPO loop; actor training, log-probs and generation go over HTTP
# to the bundled reference Arctic RL server, which the adapter starts on 127.0.0.1 and stops at the end
# (remote_backend.server.url=null; ARCTIC_RL_URL=http://host:port uses a running server instead). First run: builds the model, a short SFT warm start and the data
# under OUT_DIR (~1 min, cached afterwards). Then ~40 GRPO steps; the reward (critic/score/mean) climbs
# from ~0.45 to ~0.8. Results: OUT_DIR/runs/<run>/{metrics.jsonl,metrics.csv,reward_curve.png}.
#
#   bash examples/grpo/run_reverse_text_grpo_arl_local.sh                      # defaults below
#   ZORRO=true STEPS=20 bash examples/grpo/run_reverse_text_grpo_arl_local.sh  # env knobs
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
RUN_NAME="${RUN_NAME:-grpo_zorro_${ZORRO}_seed${SEED}}"
RUN_DIR="${RUN_DIR:-${OUT_DIR}/runs/${RUN_NAME}}"
PYTHON="${PYTHON:-python3}"
# A running Arctic RL server (e.g. `python -m arctic_rl.server`); empty: the adapter starts one on 127.0.0.1.
ARCTIC_RL_URL="${ARCTIC_RL_URL:-}"

case "${ZORRO}" in
    true|false) ;;
    *) echo "ZORRO: expected true or false, got '${ZORRO}'" >&2; exit 2 ;;
esac

# One torch thread per process: the server, Ray's workers and the driver share the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 RAY_DEDUP_LOGS=0
export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
# verl's TransferQueue asks torch for 8 threads per operation (and warns on every call on a 2-core machine).
export TQ_NUM_THREADS="${TQ_NUM_THREADS:-1}"

# `--cfg job` / `--help` (Hydra) only print the composed config: nothing to build, run or plot.
PRINT_ONLY=false
for arg in "$@"; do
    case "${arg}" in --cfg|--cfg=*|-c|--help|--hydra-help|--info|--info=*) PRINT_ONLY=true ;; esac
done

if [ "${PRINT_ONLY}" = false ]; then
    source "${SCRIPT_DIR}/../common/console.sh"
    console_init "${RUN_DIR}/run.log"
    console_say "================================================================================"
    console_say "reverse-text GRPO: a tiny Qwen3 (built here) learns to reverse strings; ${STEPS} steps, ZoRRO ${ZORRO}, seed ${SEED}"
    console_say "  stock verl 0.9.1 + remote backend 'arctic': ${ARCTIC_RL_URL:-the reference server, started on 127.0.0.1}"
    console_say "  results: ${RUN_DIR}"
    console_say "  log:     ${RUN_DIR}/run.log (Ray, verl, server start-up; VERBOSE=1 prints it here)"
    console_say "================================================================================"
fi

############################ Model, warm start, data (cached) ############################

if [ "${PRINT_ONLY}" = false ] && [ ! -f "${MODEL_DIR}/warm_start.json" ]; then
    if [ ! -f "${INIT_MODEL_DIR}/config.json" ]; then
        console_run '^\[make_model\]' "${PYTHON}" "${TASK_DIR}/make_model.py" --out "${INIT_MODEL_DIR}" --seed "${SEED}"
    fi
    WARM_ARGS=(--model "${INIT_MODEL_DIR}" --out "${MODEL_DIR}" --target "${WARM_TARGET}" --seed "${SEED}")
    if [ "${WARM_VIA_SERVER}" = true ]; then WARM_ARGS+=(--via-server); fi
    console_say "[warm_start] supervised warm start until sampled reward ${WARM_TARGET} (about a minute) ..."
    console_run '^\[warm_start\] (reached|did NOT reach)' "${PYTHON}" "${TASK_DIR}/warm_start.py" "${WARM_ARGS[@]}"
fi
if [ "${PRINT_ONLY}" = false ] && { [ ! -f "${DATA_DIR}/train.parquet" ] || [ ! -f "${DATA_DIR}/val.parquet" ]; }; then
    console_run '^\[make_data\]' "${PYTHON}" "${TASK_DIR}/make_data.py" --out "${DATA_DIR}" --n-train 4096 --n-val 128 \
        --seed "${SEED}"
fi

# verl's file logger writes one JSON line per step here (trainer.logger includes "file").
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
    actor_rollout_ref.model.path="${MODEL_DIR}"
    actor_rollout_ref.model.use_remove_padding=False
    actor_rollout_ref.model.enable_gradient_checkpointing=False
)

ACTOR=(
    actor_rollout_ref.actor.optim.lr=1e-3
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
    actor_rollout_ref.rollout.name=arctic
    actor_rollout_ref.rollout.n=8
    actor_rollout_ref.rollout.temperature=1.0
    actor_rollout_ref.rollout.top_p=1.0
    actor_rollout_ref.rollout.top_k=-1
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=256
    actor_rollout_ref.rollout.agent.num_workers=1
    actor_rollout_ref.rollout.seed="${SEED}"
)

REF=(
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=256
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
    # verl's file logger runs in Ray's TaskRunner: on a running cluster (ray job submit) its workers do not
    # inherit this shell's environment, so the path travels in the runtime_env verl passes to ray.init
    +ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH="'${VERL_FILE_LOGGER_PATH}'"
    trainer.project_name=reverse_text_grpo_arl
    trainer.experiment_name="${RUN_NAME}"
    trainer.total_training_steps="${STEPS}"
    trainer.total_epochs=1000
    trainer.val_before_train=False
    trainer.test_freq=-1
    trainer.save_freq=-1
    trainer.default_local_dir="${RUN_DIR}/checkpoints"
)

SERVER_URL=null
if [ -n "${ARCTIC_RL_URL}" ]; then SERVER_URL="'${ARCTIC_RL_URL}'"; fi

REMOTE_BACKEND=(
    remote_backend.server.url="${SERVER_URL}"
    remote_backend.server.local.checkpoint_root="${RUN_DIR}/server"
    remote_backend.train.zorro_train.enable="${ZORRO}"
    remote_backend.train.deepspeed.bf16=false
    # all 32x8 samples of a step in one /generate call (verl sends them one by one; the replica batches)
    remote_backend.rollout.max_batch_size=256
    remote_backend.rollout.max_wait_ms=100
)

############################ Launch ############################

LAUNCH=(
    "${PYTHON}" -m verl.remote_backend.main_ppo
    "${DATA[@]}"
    "${MODEL[@]}"
    "${ACTOR[@]}"
    "${ROLLOUT[@]}"
    "${REF[@]}"
    "${ALGO[@]}"
    "${REWARD[@]}"
    "${TRAINER[@]}"
    "${REMOTE_BACKEND[@]}"
    remote_backend=arctic
    hydra.run.dir="${RUN_DIR}/hydra"
    "$@"
)
if [ "${PRINT_ONLY}" = true ]; then exec "${LAUNCH[@]}"; fi

console_say "[grpo] starting verl, Ray and the server (about a minute before step 1) ..."
console_run '^\[remote_backend\] step [0-9]+' "${LAUNCH[@]}"
console_run '^\[plot\]' "${PYTHON}" "${TASK_DIR}/plot.py" "${VERL_FILE_LOGGER_PATH}" --out-dir "${RUN_DIR}"

console_say "================================================================================"
console_say "reverse-text GRPO finished. Results in ${RUN_DIR}:"
console_say "  metrics.jsonl    verl's per-step metrics (file logger)"
console_say "  metrics.csv      the same, one row per step"
console_say "  reward_curve.png critic/score/mean per step"
console_say "  summary.json     first-5 / last-5 mean reward, gain, peak"
console_say "  run.log          the full output of this run"
console_say "================================================================================"
