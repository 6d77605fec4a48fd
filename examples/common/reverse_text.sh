# The reverse-text GRPO recipe shared by the local examples of every backend
# (examples/grpo/run_reverse_text_grpo_{arl,tinker}_local.sh), sourced by those scripts; it sources recipe.sh
# and console.sh (bash only; not run on its own). What differs between backends -- the model group, the
# learning rate, the backend's own options -- stays in the scripts.
#
#   reverse_text_prepare [warm_start.py args]  # model, SFT warm start, data: built when absent (cached per seed)
#   reverse_text_groups                        # the Hydra groups DATA ACTOR ROLLOUT ALGO REWARD TRAINER
#   reverse_text_finish "title"                # metrics.csv, reward_curve.png, summary.json; the closing lines
#
# They read, from the calling script: TASK_DIR, SEED, STEPS, INIT_MODEL_DIR, MODEL_DIR, DATA_DIR, WARM_TARGET,
# RUN_NAME, RUN_DIR, PYTHON, and for the groups LR (the actor's learning rate) and PROJECT_NAME.

source "$(dirname "${BASH_SOURCE[0]}")/recipe.sh"

reverse_text_prepare() {
    if [ ! -f "${MODEL_DIR}/warm_start.json" ]; then
        if [ ! -f "${INIT_MODEL_DIR}/config.json" ]; then
            console_run '^\[make_model\]' "${PYTHON}" "${TASK_DIR}/make_model.py" --out "${INIT_MODEL_DIR}" --seed "${SEED}"
        fi
        console_say "[warm_start] supervised warm start until sampled reward ${WARM_TARGET} (8-26 s on a 2-core" \
            "machine, more under load) ..."
        console_run '^\[warm_start\] (reached|did NOT reach)' "${PYTHON}" "${TASK_DIR}/warm_start.py" \
            --model "${INIT_MODEL_DIR}" --out "${MODEL_DIR}" --target "${WARM_TARGET}" --seed "${SEED}" "$@"
    fi
    if [ ! -f "${DATA_DIR}/train.parquet" ] || [ ! -f "${DATA_DIR}/val.parquet" ]; then
        console_run '^\[make_data\]' "${PYTHON}" "${TASK_DIR}/make_data.py" --out "${DATA_DIR}" --n-train 4096 \
            --n-val 128 --seed "${SEED}"
    fi
}

reverse_text_groups() {
    VERL_FILE_LOGGER_PATH="${RUN_DIR}/metrics.jsonl"  # always the run directory's (prepare empties it)
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
    ACTOR=(
        actor_rollout_ref.actor.optim.lr="${LR}"
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
    recipe_generated_task_groups "${PROJECT_NAME}"  # ALGO REWARD TRAINER
}

reverse_text_finish() {
    recipe_finish "$1" 5
}
