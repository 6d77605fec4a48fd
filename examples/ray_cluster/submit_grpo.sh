#!/usr/bin/env bash
# Submit a verl GRPO job that uses an Arctic RL server to a running Ray cluster (`ray job submit`).
#
# The job's runtime_env carries what every Ray process of the job needs:
#   * the package: this checkout as working_dir, pip-installed (--no-deps) into the job's environment
#     (PACKAGE_MODE=pip, default), or nothing when verl-remote-backend is already installed on every node
#     next to verl (PACKAGE_MODE=preinstalled); see README.md for when each applies;
#   * VERL_USE_EXTERNAL_MODULES=verl.remote_backend.register, so `import verl` registers the backend in
#     the driver and in every worker;
#   * ARCTIC_RL_URL / ARCTIC_RL_TOKEN, the server to talk to (the token stays out of verl's config, the
#     trace and the command line -- the runtime_env then travels in a private file; the adapter reads the
#     token from the environment).
# The GRPO recipe itself is a run_*.sh script (default: the reverse-text one, which builds its own tiny model
# and data; RECIPE=examples/grpo/run_gsm8k_grpo_arl.sh for GSM8K), run on the cluster with the
# same Hydra overrides; extra arguments of this script are appended to them. The recipe's knobs
# (DATA_DIR, MODEL_DIR, OUT_DIR, STEPS, ZORRO, SEED, RUN_NAME, OVERWRITE, RESUME, VERBOSE) reach it when set here.
#
#   ARCTIC_RL_URL=http://127.0.0.1:7000 STEPS=2 bash examples/ray_cluster/submit_grpo.sh   # README: try it here
#   ARCTIC_RL_URL=http://arctic-head:7000 ARCTIC_RL_TOKEN=... DATA_DIR=/shared/gsm8k \
#   RECIPE=examples/grpo/run_gsm8k_grpo_arl.sh RAY_ADDRESS=http://ray-head:8265 \
#   bash examples/ray_cluster/submit_grpo.sh trainer.total_training_steps=10
#
# By default `ray job submit` follows the job and prints its output (the recipe's header, one line per
# step, its summary); NO_WAIT=1 returns once the job is submitted. VERBOSE=1 traces this script.
# A head started moments ago may answer "No available agent to submit job, please try again later" (its
# job agent is not registered yet, Ray waits 10 s for it): the submission is retried every 5 s for up to
# SUBMIT_RETRY_S seconds (default 120); any other failure ends the script at once with Ray's exit status.
set -euo pipefail
if [ "${VERBOSE:-0}" = 1 ]; then set -x; fi

############################ User-adjustable ############################

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${SCRIPT_DIR}/../.." && pwd)"
# Ray dashboard / job server of the cluster.
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
# The recipe to run (a path relative to the checkout, as it will be inside the job's working_dir).
RECIPE="${RECIPE:-examples/grpo/run_reverse_text_grpo_arl_local.sh}"
# pip: install this checkout into the job's environment; preinstalled: the nodes already have it.
PACKAGE_MODE="${PACKAGE_MODE:-pip}"
# The recipe's knobs that travel to the job when set here (data and model as the cluster nodes see them:
# shared storage or a hub name); unset ones keep the recipe's defaults.
RECIPE_KNOBS=(DATA_DIR MODEL_DIR OUT_DIR STEPS ZORRO SEED RUN_NAME OVERWRITE RESUME VERBOSE)
SUBMISSION_ID="${SUBMISSION_ID:-verl_grpo_arl_$(date -u +%Y%m%dT%H%M%SZ)}"
# DRY_RUN=1: print the runtime_env (token redacted) and the entrypoint, submit nothing.
DRY_RUN="${DRY_RUN:-0}"
# NO_WAIT=1: return once submitted (follow with `ray job logs --follow`, or Ray's job API).
NO_WAIT="${NO_WAIT:-0}"
# How long to keep retrying while the head has no job agent yet (seconds; 0: never retry).
SUBMIT_RETRY_S="${SUBMIT_RETRY_S:-120}"
case "${SUBMIT_RETRY_S}" in
    ''|*[!0-9]*) echo "SUBMIT_RETRY_S: expected a whole number of seconds (0: never retry), got '${SUBMIT_RETRY_S}'" >&2
                 exit 2 ;;
esac
: "${ARCTIC_RL_URL:?set ARCTIC_RL_URL to the Arctic RL server (e.g. http://arctic-head:7000)}"
PYTHON="${PYTHON:-python3}"

############################ runtime_env ############################

# Built by Python so that every value is JSON-escaped; the token only ever travels inside it.
{ set +x; } 2>/dev/null  # do not echo the token
RUNTIME_ENV_JSON="$(PACKAGE_MODE="${PACKAGE_MODE}" REPO_ROOT="${REPO_ROOT}" ARCTIC_RL_URL="${ARCTIC_RL_URL}" \
    ARCTIC_RL_TOKEN="${ARCTIC_RL_TOKEN:-}" "${PYTHON}" - <<'PY'
import json, os

mode = os.environ["PACKAGE_MODE"]
if mode not in ("pip", "preinstalled"):
    raise SystemExit(f"PACKAGE_MODE: expected 'pip' or 'preinstalled', got {mode!r}")
env_vars = {
    "VERL_USE_EXTERNAL_MODULES": "verl.remote_backend.register",
    "ARCTIC_RL_URL": os.environ["ARCTIC_RL_URL"],
    "PYTHONUNBUFFERED": "1",
    "HYDRA_FULL_ERROR": "1",
}
if os.environ.get("ARCTIC_RL_TOKEN"):
    env_vars["ARCTIC_RL_TOKEN"] = os.environ["ARCTIC_RL_TOKEN"]
runtime_env = {
    "working_dir": os.environ["REPO_ROOT"],
    # keep the upload small: no hidden directories (.venv, .git, caches), build trees, outputs
    "excludes": [".*/", "build/", "dist/", "outputs/", "runs/", "*.egg-info/", "__pycache__/", "*.parquet",
                 "*.whl"],
    "env_vars": env_vars,
}
if mode == "pip":
    # Ray unpacks working_dir first; ${RAY_RUNTIME_ENV_CREATE_WORKING_DIR} is that directory on each node.
    # --no-deps: verl 0.9.1, torch, ... come from the nodes' own environment.
    runtime_env["pip"] = {
        "packages": ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"],
        "pip_install_options": ["--no-deps", "--disable-pip-version-check", "--no-cache-dir"],
        "pip_check": False,
    }
print(json.dumps(runtime_env))
PY
)"

############################ Submit ############################

# Not traced (set +x above): the runtime_env holds the token. Print it redacted instead.
echo "[submit] runtime_env: $(printf '%s' "${RUNTIME_ENV_JSON}" | sed -E 's/("ARCTIC_RL_TOKEN": ")[^"]*"/\1***"/')"
JOB_ENV=()
for knob in "${RECIPE_KNOBS[@]}"; do
    if [ -n "${!knob:-}" ]; then JOB_ENV+=("${knob}=${!knob}"); fi
done
echo "[submit] ${RAY_ADDRESS}: ${SUBMISSION_ID}: env ${JOB_ENV[*]} bash ${RECIPE} $*"
if [ "${DRY_RUN}" = 1 ]; then exit 0; fi
# Ray's stderr is copied here (and still shown) to tell "no job agent yet" from every other failure.
SUBMIT_ERR="$(mktemp "${TMPDIR:-/tmp}/submit_err.XXXXXX")"
RUNTIME_ENV_FILE=""
trap 'rm -f "${SUBMIT_ERR}" ${RUNTIME_ENV_FILE:+"${RUNTIME_ENV_FILE}"}' EXIT
# With a token, the runtime_env goes through a private file (--runtime-env) rather than the command line
# (--runtime-env-json), where any user of the submitting machine could read it in `ps`.
RUNTIME_ENV_ARGS=(--runtime-env-json "${RUNTIME_ENV_JSON}")
if [ -n "${ARCTIC_RL_TOKEN:-}" ]; then
    RUNTIME_ENV_FILE="$(mktemp "${TMPDIR:-/tmp}/runtime_env.XXXXXX.json")"  # mode 600
    printf '%s' "${RUNTIME_ENV_JSON}" > "${RUNTIME_ENV_FILE}"
    RUNTIME_ENV_ARGS=(--runtime-env "${RUNTIME_ENV_FILE}")
fi
WAIT_ARGS=()
if [ "${NO_WAIT}" = 1 ]; then WAIT_ARGS=(--no-wait); fi
RETRY_UNTIL=$((SECONDS + SUBMIT_RETRY_S))
while true; do
    # stdout goes straight to the terminal; stderr through tee into SUBMIT_ERR (the pipeline waits for tee)
    rc=0
    { ray job submit \
        --address "${RAY_ADDRESS}" \
        --submission-id "${SUBMISSION_ID}" \
        "${RUNTIME_ENV_ARGS[@]}" \
        "${WAIT_ARGS[@]}" \
        -- env "${JOB_ENV[@]}" \
        bash "${RECIPE}" \
        "$@" 2>&1 1>&3 3>&- | tee "${SUBMIT_ERR}" >&2; } 3>&1 || rc=$?
    if [ "${rc}" = 0 ]; then exit 0; fi
    # the refusal comes before any job exists, so the same submission id can be submitted again
    if grep -q "No available agent to submit job" "${SUBMIT_ERR}" && [ "${SECONDS}" -lt "${RETRY_UNTIL}" ]; then
        echo "[submit] the Ray head has no job agent yet (it answered 'No available agent to submit job'); retrying in 5 s, for up to ${SUBMIT_RETRY_S} s in all (SUBMIT_RETRY_S)" >&2
        sleep 5
        continue
    fi
    exit "${rc}"
done
