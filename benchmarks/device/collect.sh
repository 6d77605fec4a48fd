#!/usr/bin/env bash
# Pack what the detached runner (grpo_runs.sh) has so far into one tarball, for a polling command to bring back:
# RESULTS_DIR as it is, plus the live metrics.jsonl, the last lines of run.log and the reference server's line per
# call (server_calls.log) of every run directory under OUT_BASE/runs (the runner copies them into RESULTS_DIR only
# when a run ends). Prints the status file.
#
#   bash benchmarks/device/collect.sh RESULTS_DIR OUT_BASE TARBALL      # e.g. /tmp/results /tmp/arith $OUT/results.tgz
set -uo pipefail
results=${1:?usage: collect.sh RESULTS_DIR OUT_BASE TARBALL}
out_base=${2:?usage: collect.sh RESULTS_DIR OUT_BASE TARBALL}
tarball=${3:?usage: collect.sh RESULTS_DIR OUT_BASE TARBALL}
[ -d "$results" ] || { echo "collect.sh: no $results" >&2; exit 2; }
for run_dir in "$out_base"/runs/*/; do
    [ -d "$run_dir" ] || continue
    name=$(basename "$run_dir")
    mkdir -p "$results/$name"
    [ -f "$run_dir/metrics.jsonl" ] && cp "$run_dir/metrics.jsonl" "$results/$name/metrics.jsonl"
    [ -f "$run_dir/run.log" ] && tail -n 200 "$run_dir/run.log" >"$results/$name/run_tail.log"
    bash "$(dirname "$0")/server_calls.sh" "$run_dir" "$results/$name/server_calls.log"
done
cat "$results/status" 2>/dev/null
for f in "$results"/*/metrics.jsonl; do
    [ -f "$f" ] && echo "$(basename "$(dirname "$f")"): $(wc -l <"$f") steps"
done
tar -czf "$tarball" -C "$(dirname "$results")" "$(basename "$results")"
