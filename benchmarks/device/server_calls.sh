#!/usr/bin/env bash
# The reference server's line per call (its own seconds for /generate, /forward, /forward-backward, /step, weight
# syncs, checkpoint saves and loads, ZoRRO's choices, the process group's backend, and the memory lines: vLLM's own,
# the sampler's start, sleep and wake, and what a save used while it ran; the jobs' warm-ups and the garbage
# collector's freezes; Dynamo's recompiles and the guards that failed) from a run directory's server logs into one file; nothing when the run has no server
# (a stock-verl run). Used by grpo_runs.sh when a run ends and by collect.sh for runs still going.
#
#   bash benchmarks/device/server_calls.sh RUN_DIR OUT_FILE
set -uo pipefail
run_dir=${1:?usage: server_calls.sh RUN_DIR OUT_FILE}
out=${2:?usage: server_calls.sh RUN_DIR OUT_FILE}
compgen -G "$run_dir/server/*.log" >/dev/null || exit 0
grep -hE "(generate|forward|forward-backward|step|save|load-checkpoint) job=|weight-sync|save: |zorro|GiB|sampler ready|asleep|woke|process group:|job: warm-up|gc: |__recompiles" \
    "$run_dir"/server/*.log >"$out"
exit 0
