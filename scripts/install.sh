#!/usr/bin/env bash
# Install verl-remote-backend (and verl 0.9.1, the reference server's DeepSpeed, the examples' plotting) into ./.venv.
#
#   bash scripts/install.sh           # runtime + reference server + what the examples need
#   bash scripts/install.sh --test    # ... + test tools
#
# The checkout is installed in editable mode: edits under verl/remote_backend/, verl/workers/remote_client/
# and arctic_rl/ are what Python, the tests and Ray's worker processes import (docs/DEVELOPMENT.md).
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# TORCH_SPEC (default torch==2.13.0; point it at a CPU or CUDA build as you need).
#
# Output: a few "[install]" lines. pip's own output is kept back and shown in full, uncoloured, when pip
# fails (the script then exits with pip's status); on success only what is not known noise is shown
# (pip's "WARNING: Location ... is ignored" for absent index locations, setuptools' editable-install notice).
set -euo pipefail
cd "$(dirname "$0")/.."

# Known noise of a successful install, on uncoloured text: pip's warnings about absent index locations, and
# warnings of the build backend (setuptools' editable-install notice: a "...Warning:" line from pip's build
# environment followed by its indented block).
drop_noise() {
  awk '
    /^WARNING: Location .* is ignored/ { next }
    /^[[:space:]]*\/.*pip-build-env-.*Warning: / { block = 1; next }
    block && (/^[[:space:]]/ || /^$/) { next }
    { block = 0; print }
  '
}

# pip "$@", its output held back: in full on failure (then exit with pip's status), else only what is not noise.
run_pip() {
  local out rc=0
  out="$(mktemp "${TMPDIR:-/tmp}/install-pip.XXXXXX")"
  PIP_NO_COLOR=1 "${pip[@]}" "$@" > "$out" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then
    sed -E 's/\x1b\[[0-9;]*[A-Za-z]//g' "$out" >&2
    rm -f "$out"
    echo "[install] FAILED (pip exit status $rc): pip $*" >&2
    exit "$rc"
  fi
  sed -E 's/\x1b\[[0-9;]*[A-Za-z]//g' "$out" | drop_noise
  rm -f "$out"
}

extras="server,examples"
for arg in "$@"; do
  case "$arg" in
    --test) extras="server,examples,test" ;;
    *) echo "usage: bash scripts/install.sh [--test]" >&2; exit 2 ;;
  esac
done

venv="${VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "[install] creating $venv"
  "${PYTHON:-python3}" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-color -q)
run_pip install --upgrade pip setuptools wheel
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "[install] torch (${TORCH_SPEC:-torch==2.13.0})"
  run_pip install "${TORCH_SPEC:-torch==2.13.0}"
fi
echo "[install] verl-remote-backend[$extras] with constraints.txt (verl 0.9.1, deepspeed, ...)"
# DS_BUILD_OPS=0: DeepSpeed builds no C++/CUDA ops at install time (the server uses torch's AdamW on CPU).
DS_BUILD_OPS=0 run_pip install -c constraints.txt -e ".[$extras]"
if [ "$extras" = "server,examples,test" ]; then
  # The vendor's Arctic RL v1 code (PyPI arctic-platform 0.1.2) for the v1 conformance tests
  # (tests/conformance/vendor_v1_server.py), without its GPU dependencies (vLLM, flash-attn, ...) and
  # outside site-packages, so that it never shadows another copy of the vendor package.
  v1_dir="$("$venv/bin/python" -c 'import sys; print(sys.prefix)')/arctic-platform-v1"
  if [ ! -f "$v1_dir/arctic_platform/rl/http_server.py" ]; then
    echo "[install] arctic-platform==0.1.2 (vendor v1 code, no dependencies) into $v1_dir"
    run_pip install --no-deps --target "$v1_dir" "arctic-platform==0.1.2"
  fi
fi
"$venv/bin/python" - <<'PY'
import importlib, pathlib, sys
root = pathlib.Path.cwd().resolve()
for name in ("verl.remote_backend", "arctic_rl"):
    mod = importlib.import_module(name)
    where = pathlib.Path(mod.__file__).resolve()
    if root not in where.parents:
        sys.exit(f"[install] {name} imports from {where}, not from this checkout ({root})")
import verl
print(f"[install] ok: verl {verl.__version__} at {pathlib.Path(verl.__file__).parent}; our packages from {root}")
PY
