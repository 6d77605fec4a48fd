#!/usr/bin/env bash
# How long verl waits for the reference server before its first step, with the jobs' compile warm-up on, for two
# trees in one run: a baseline commit and the working tree (CPU; the reverse-text recipe, 2 steps).
#
#   bash benchmarks/start_up.sh [BASELINE_COMMIT]     # default: a691244 (the warm-up inside /initialize)
#
# For each tree: a fresh reference server from that tree (`--device cpu --threads 1 --torch-compile layers
# --warm-up on`, its own inductor cache, so both compile from nothing), then verl's reverse-text GRPO run
# (examples/grpo/run_reverse_text_grpo_arl_local.sh, STEPS=2) against it. The model and data are built once, before
# both. From the server's log it prints, per tree: the training job's /initialize (seconds until it answered), the
# warm-up's seconds, when verl's first call on the jobs came (the initial weight sync) and its first /generate, all
# counted from the first /initialize; and the whole run. Work files: $OUT (default /tmp/start_up).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
BASELINE=${1:-a691244}
OUT=${OUT:-/tmp/start_up}
PY=${PYTHON:-$ROOT/.venv/bin/python}
rm -rf "$OUT" && mkdir -p "$OUT/baseline_tree"
git archive "$BASELINE" | tar -xf - -C "$OUT/baseline_tree"

run_tree() {  # LABEL TREE PORT
    local label=$1 tree=$2 port=$3 d="$OUT/$1" spid t0 t1
    mkdir -p "$d"
    (cd "$tree" && TORCHINDUCTOR_CACHE_DIR="$d/inductor" OMP_NUM_THREADS=1 PYTHONPATH="$tree" exec "$PY" -m arctic_rl.server \
        --device cpu --threads 1 --torch-compile layers --warm-up on --port "$port" --checkpoint-root "$d/ck" \
        >"$d/server.log" 2>&1) &
    spid=$!
    for _ in $(seq 1 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.5; done
    t0=$(date +%s.%N)
    MODEL_DIR="$OUT/model_warm" INIT_MODEL_DIR="$OUT/model_init" DATA_DIR="$OUT/data" OUT_DIR="$d/out" STEPS=2 \
        ARCTIC_RL_URL="http://127.0.0.1:$port" PATH="$(dirname "$PY"):$PATH" PYTHON="$PY" \
        bash examples/grpo/run_reverse_text_grpo_arl_local.sh >"$d/console.txt" 2>&1 || echo "$label: the run failed ($d)" >&2
    t1=$(date +%s.%N)
    echo "$t0 $t1" >"$d/wall"
    kill "$spid" 2>/dev/null || true
    wait "$spid" 2>/dev/null || true
    echo "[start_up] $label done" >&2
}

# the model and data once, as the recipe builds them (the first run would build them inside its own time otherwise)
TASK=examples/reverse_text
"$PY" "$TASK/make_model.py" --out "$OUT/model_init" --seed 0 >"$OUT/prep.log" 2>&1
"$PY" "$TASK/warm_start.py" --model "$OUT/model_init" --out "$OUT/model_warm" --target 0.45 --seed 0 >>"$OUT/prep.log" 2>&1
"$PY" "$TASK/make_data.py" --out "$OUT/data" --n-train 4096 --n-val 128 --seed 0 >>"$OUT/prep.log" 2>&1
run_tree baseline "$OUT/baseline_tree" 7391
run_tree working "$ROOT" 7392

"$PY" - "$OUT" "$BASELINE" <<'EOF'
import re, sys
from datetime import datetime
from pathlib import Path

out, baseline = Path(sys.argv[1]), sys.argv[2]

def stamp(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()

def first(lines, pattern):
    return next((line for line in lines if re.search(pattern, line)), None)

print(f"{'tree':<22} {'train /initialize':>18} {'warm-up':>8} {'first sync':>11} {'first gen':>10} {'run':>7}")
for label, name in (("baseline", baseline), ("working", "working tree")):
    lines = (out / label / "server.log").read_text().splitlines()
    start = stamp(first(lines, r"initialize: job 1 "))
    ready = first(lines, r"initialize: job 3 ready in")
    warm = first(lines, r"training job: warm-up of \d+ calls")
    sync = first(lines, r"weight-sync 3 -> ")
    gen = first(lines, r"generate job=1 ")
    t0, t1 = map(float, (out / label / "wall").read_text().split())
    warm_s = float(re.search(r"in ([\d.]+)s", warm).group(1)) if warm else float("nan")
    init_s = float(re.search(r"ready in ([\d.]+)s", ready).group(1))
    print(f"{name:<22} {init_s:>17.1f}s {warm_s:>7.1f}s {stamp(sync) - start:>10.1f}s {stamp(gen) - start:>9.1f}s"
          f" {t1 - t0:>6.1f}s")
print("first sync / first gen: seconds from the first /initialize (verl's driver creating the jobs); run: verl's"
      " whole 2-step run")
EOF
