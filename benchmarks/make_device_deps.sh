#!/usr/bin/env bash
# Build .arl/arl_deps.txz: what `import verl.workers.remote_client.arctic.arctic_rl` needs on the H200 image
# beyond the image and the vLLM bundle (shared/tools/vllm-device), small enough to travel with the
# bundle's third part (see benchmarks/RESULTS.md §2c). Run from the repo root, with the project's venv:
#     bash benchmarks/make_device_deps.sh [VENV]         # VENV defaults to .venv
# Ray is slimmed to what `import ray` loads (the benchmark never starts Ray).
set -euo pipefail
venv=$(cd "${1:-.venv}" && pwd)
[ -x "$venv/bin/python" ] || { echo "no python in $venv (pass the venv holding antlr4-python3-runtime 4.9.3)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$work/whl" ray==2.60.0 verl==0.9.1 tensordict==0.10.0 omegaconf==2.3.1 pyvers==0.1.0
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
cd "$work/site"
rm -rf tests scripts pydevd_plugins ray/jars ray/core/src/ray/gcs/gcs_server ray/core/src/ray/raylet/raylet \
  ray/dashboard ray/_private/runtime_env/agent/thirdparty_files ray/rllib ray/serve ray/llm ray/tune ray/train \
  ray/data ray/air ray/workflow
strip --strip-unneeded ray/_raylet.so
antlr=$("$venv/bin/python" -c 'import antlr4, os; print(os.path.dirname(antlr4.__file__))')
cp -r "$antlr" .  # antlr4-python3-runtime 4.9.3 is pure Python and has no wheel on PyPI
find . -name __pycache__ -prune -exec rm -rf {} +
cd "$OLDPWD"
mkdir -p .arl
grep -qx '/.arl/' .git/info/exclude 2>/dev/null || echo '/.arl/' >> .git/info/exclude
tar -C "$work/site" -cf - . | xz -6 -T2 > .arl/arl_deps.txz
ls -la .arl/arl_deps.txz
