# The GSM8K GRPO recipe's parts shared by the examples of every backend (examples/grpo/run_gsm8k_grpo_*.sh),
# sourced by those scripts; it sources recipe.sh and console.sh (bash only; not run on its own). Batch sizes,
# learning rates, the model and the backend's options stay in the scripts (they add to these groups).
#
#   gsm8k_groups   # the Hydra groups DATA, ACTOR, ALGO and TRAINER
#
# It reads, from the calling script: DATA_DIR (train.parquet and test.parquet from
# examples/data_preprocess/gsm8k.py), SEED, STEPS, RUN_NAME, RUN_DIR, PROJECT_NAME; it exports
# VERL_FILE_LOGGER_PATH (default RUN_DIR/metrics.jsonl; see recipe_trainer_group).

source "$(dirname "${BASH_SOURCE[0]}")/recipe.sh"

gsm8k_groups() {
    DATA=(
        data.train_files="${DATA_DIR}/train.parquet"
        data.val_files="${DATA_DIR}/test.parquet"
        data.max_prompt_length=512
        data.max_response_length=1024
        data.filter_overlong_prompts=True
        data.truncation=error
        data.seed="${SEED}"
    )
    ACTOR=(
        actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.actor.entropy_coeff=0
        actor_rollout_ref.actor.loss_agg_mode=token-mean
        actor_rollout_ref.actor.data_loader_seed="${SEED}"
    )
    ALGO=(
        algorithm.adv_estimator=grpo
        algorithm.use_kl_in_reward=False
    )
    recipe_trainer_group "${PROJECT_NAME}"
    TRAINER+=(trainer.total_epochs=15)
}
