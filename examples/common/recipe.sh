# Helpers shared by the GRPO example scripts of every backend (examples/grpo/*.sh), sourced by the task
# files (gsm8k.sh, reverse_text.sh); it sources console.sh (bash only; not run on its own).
#
#   source "${SCRIPT_DIR}/../common/recipe.sh"  # or a task file, which sources this
#   PRINT_ONLY=$(recipe_print_only "$@")    # "true" when Hydra is only asked to print (--cfg job, --help, ...)
#   X=$(recipe_hydra_str "${VALUE}")        # a Hydra override value: null when VALUE is empty, else 'VALUE'
#   URL=$(recipe_server_url "${URL}" "$@")  # the server URL the run will use: the user's last
#                                           #   remote_backend.server.url=... override, else URL ("" = none)
#   recipe_env                              # unbuffered Python, full Hydra errors, every Ray worker's lines
#   recipe_local_env                        # recipe_env, plus one thread per process and an offline hub
#   recipe_bool NAME "${VALUE}"             # exits 2 unless VALUE is true or false, naming NAME
#   recipe_run_dir PARENT NAME              # RUN_NAME, RUN_DIR: PARENT/NAME_<time stamp> (a new one per run) unless
#                                           #   RUN_NAME or RUN_DIR is given
#   recipe_claim_run_dir                    # creates RUN_DIR (never reuses another run's unless OVERWRITE=true) and
#                                           #   points PARENT/latest at it
#   recipe_trainer_group PROJECT           # TRAINER=(verl's trainer options every example sets; a file logger)
#   recipe_generated_task_groups PROJECT   # ALGO, REWARD (TASK_DIR/reward.py) and TRAINER of a task generated
#                                           #   here (GRPO, no KL in the reward, run by steps, no checkpoints)
#   recipe_launch BACKEND GROUP... -- "$@"  # LAUNCH=(verl's entry point, the groups' overrides, remote_backend=BACKEND,
#                                           #         hydra.run.dir=RUN_DIR/hydra, the user's overrides)
#   recipe_finish "title" WINDOW [opts]     # metrics.csv, reward_curve.png, summary.json; the closing lines

source "$(dirname "${BASH_SOURCE[0]}")/console.sh"

# verl's metrics file -> metrics.csv, reward_curve.png, summary.json (every task's examples use it)
RECIPE_PLOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../reverse_text" && pwd)/plot.py"

# `--cfg job` / `--help` (Hydra) only print the composed config: nothing to build, start, run or plot.
recipe_print_only() {
    local arg
    for arg in "$@"; do
        case "${arg}" in
            --cfg|--cfg=*|-c|--help|--hydra-help|--info|--info=*) echo true; return ;;
        esac
    done
    echo false
}

# A string for a Hydra override that may be absent: `null` for "", else single-quoted (URLs hold ':' and '/').
recipe_hydra_str() {
    if [ -n "$1" ]; then printf "'%s'\n" "$1"; else echo null; fi
}

recipe_server_url() {
    local url="$1" arg
    shift
    for arg in "$@"; do
        case "${arg}" in
            remote_backend.server.url=*|++remote_backend.server.url=*)
                url="${arg#*remote_backend.server.url=}"
                url="${url#[\'\"]}"
                url="${url%[\'\"]}"
                if [ "${url}" = null ]; then url=""; fi
                ;;
        esac
    done
    printf '%s\n' "${url}"
}

recipe_bool() {
    case "$2" in
        true|false) ;;
        *) echo "$1: expected true or false, got '$2'" >&2; exit 2 ;;
    esac
}

# The overrides ASYNC=true adds (one per line; none when false): verl's own rollout correction for samples that are
# one policy version old -- decoupled mode, token-level IS weights truncated at 2 (docs/ASYNC.md, "Correcting for the
# lag"). The user's overrides come after them: algorithm.rollout_correction.rollout_is=null turns the weights off.
recipe_async_correction() {
    [ "$1" = true ] || return 0
    printf '%s\n' actor_rollout_ref.rollout.calculate_log_probs=true algorithm.rollout_correction.rollout_is=token \
        algorithm.rollout_correction.rollout_is_threshold=2.0
}

# Every run gets a directory of its own, so that no run erases another's files. Without RUN_NAME and RUN_DIR it is
# PARENT/NAME_<YYYYmmdd-HHMMSS> (NAME says what the run is; a second run in the same second gets a -2 suffix);
# with RUN_NAME it is PARENT/RUN_NAME, with RUN_DIR that directory. A given directory that already holds files is
# refused, naming it, unless OVERWRITE=true (its files are deleted first) or RESUME=true (they are kept: verl
# continues from its checkpoints, if the recipe saved any, and run.log is appended to).
recipe_run_dir() {
    local parent="$1" name="$2"
    RECIPE_RUN_DIR_GIVEN=true
    if [ -n "${RUN_DIR:-}" ]; then
        RUN_NAME="${RUN_NAME:-$(basename "${RUN_DIR}")}"
    elif [ -n "${RUN_NAME:-}" ]; then
        RUN_DIR="${parent}/${RUN_NAME}"
    else
        RECIPE_RUN_DIR_GIVEN=false
        RUN_NAME="${name}_$(date +%Y%m%d-%H%M%S)"
        RUN_DIR="${parent}/${RUN_NAME}"
    fi
}

recipe_claim_run_dir() {
    local base="${RUN_DIR}" n=1
    OVERWRITE="${OVERWRITE:-false}" RESUME="${RESUME:-false}"
    recipe_bool OVERWRITE "${OVERWRITE}"
    recipe_bool RESUME "${RESUME}"
    mkdir -p "$(dirname "${RUN_DIR}")"
    if [ "${RECIPE_RUN_DIR_GIVEN:-true}" = true ]; then
        if [ -d "${RUN_DIR}" ] && [ -n "$(ls -A "${RUN_DIR}")" ] && [ "${RESUME}" != true ]; then
            if [ "${OVERWRITE}" != true ]; then
                echo "RUN_DIR: ${RUN_DIR} already holds a run's files; set OVERWRITE=true to delete them first," \
                    "RESUME=true to continue that run, or leave RUN_NAME and RUN_DIR unset for a new directory" >&2
                exit 2
            fi
            find "${RUN_DIR}" -mindepth 1 -delete
        fi
        mkdir -p "${RUN_DIR}"
    else
        until mkdir "${RUN_DIR}" 2>/dev/null; do  # mkdir fails on an existing directory: never share one
            n=$((n + 1))
            if [ "${n}" -gt 99 ]; then echo "RUN_DIR: cannot create ${base} (or ${base}-N)" >&2; exit 2; fi
            RUN_DIR="${base}-${n}"
        done
        RUN_NAME="$(basename "${RUN_DIR}")"
    fi
    ln -sfn "$(basename "${RUN_DIR}")" "$(dirname "${RUN_DIR}")/latest"
}

recipe_env() {
    export PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 RAY_DEDUP_LOGS=0 TOKENIZERS_PARALLELISM=false
}

recipe_local_env() {
    recipe_env
    # One torch thread per process: a server, Ray's workers and the driver share the cores.
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
    export HF_HUB_OFFLINE=1 TRANSFORMERS_NO_ADVISORY_WARNINGS=1
    # verl's TransferQueue asks torch for 8 threads per operation (and warns on every call on a 2-core machine).
    export TQ_NUM_THREADS="${TQ_NUM_THREADS:-1}"
}

# The groups are the names of arrays of Hydra overrides, in order; the user's own overrides come last, so they win.
recipe_launch() {
    local backend="$1"
    shift
    LAUNCH=("${PYTHON}" -m verl.remote_backend.main_ppo)
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        local -n _recipe_group="$1"
        LAUNCH+=("${_recipe_group[@]}")
        unset -n _recipe_group
        shift
    done
    [ "${1:-}" = -- ] || { echo "recipe_launch: expected -- before the user's overrides" >&2; exit 2; }
    shift
    LAUNCH+=(remote_backend="${backend}" hydra.run.dir="${RUN_DIR}/hydra" "$@")
}

# The trainer options of every example: console and file logger, no validation, no test runs, checkpoints under
# RUN_DIR. Reads RUN_NAME, RUN_DIR and STEPS; exports VERL_FILE_LOGGER_PATH (default RUN_DIR/metrics.jsonl),
# where verl's file logger writes one JSON line of metrics per step. Callers add total_epochs and save_freq.
recipe_trainer_group() {
    export VERL_FILE_LOGGER_PATH="${VERL_FILE_LOGGER_PATH:-${RUN_DIR}/metrics.jsonl}"
    TRAINER=(
        trainer.logger=[console,file]
        # verl's file logger runs in Ray's TaskRunner: on a running cluster (ray job submit) its workers do not
        # inherit this shell's environment, so the path travels in the runtime_env verl passes to ray.init
        +ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH="'${VERL_FILE_LOGGER_PATH}'"
        trainer.project_name="$1"
        trainer.experiment_name="${RUN_NAME}"
        trainer.total_training_steps="${STEPS}"
        trainer.val_before_train=False
        trainer.test_freq=-1
        trainer.default_local_dir="${RUN_DIR}/checkpoints"
    )
}

recipe_generated_task_groups() {
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
    recipe_trainer_group "$1"
    TRAINER+=(trainer.total_epochs=1000 trainer.save_freq=-1)
}

# The end of every example run: metrics.csv, reward_curve.png and summary.json (first-WINDOW / last-WINDOW mean
# reward, when the run has that many steps) from verl's metrics file, then the closing lines naming the files it
# wrote. Reads PYTHON, RUN_DIR and VERL_FILE_LOGGER_PATH; further arguments go to plot.py (e.g. --title).
#   recipe_finish "title line" WINDOW [plot.py options...]
recipe_finish() {
    local line="$1" window="$2" summary
    shift 2
    console_run '^\[plot\]' "${PYTHON}" "${RECIPE_PLOT}" "${VERL_FILE_LOGGER_PATH}" --out-dir "${RUN_DIR}" \
        --window "${window}" "$@"
    # the closing lines name only what this run wrote (a run shorter than the window has no first/last means)
    if grep -q '"gain"' "${RUN_DIR}/summary.json" 2>/dev/null; then
        summary="first-${window} / last-${window} mean reward, gain, peak"
    else
        summary="steps logged (fewer than ${window}: no first-${window} / last-${window} means)"
    fi
    # SECONDS: bash's count since the script started (model, data, verl, Ray, the server and every step)
    local lines=("${line} $((SECONDS / 60)) min $((SECONDS % 60)) s in all. Results in ${RUN_DIR}:")
    [ -f "${VERL_FILE_LOGGER_PATH}" ] && lines+=("  metrics.jsonl    verl's per-step metrics (file logger)")
    [ -f "${RUN_DIR}/metrics.csv" ] && lines+=("  metrics.csv      the same, one row per step")
    [ -f "${RUN_DIR}/reward_curve.png" ] && lines+=("  reward_curve.png mean reward per step")
    [ -f "${RUN_DIR}/summary.json" ] && lines+=("  summary.json     ${summary}")
    lines+=("  run.log          the full output of this run")
    if [ -n "$(ls -A "${RUN_DIR}/checkpoints" 2>/dev/null)" ]; then  # verl saved the server's state (trainer.save_freq)
        lines+=("  checkpoints/     the last step's, kept on the server; as a Hugging Face directory:" \
                "                   python examples/common/export_hf.py ${RUN_DIR} --out <dir>")
    fi
    console_header "${lines[@]}"
}
