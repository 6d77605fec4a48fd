#!/usr/bin/env bash
# Install the parts written by benchmarks/device/pack.sh on the H200 machine (README.md beside this file):
#
#     bash benchmarks/device/unpack.sh /tmp/parts [SITE]        # SITE defaults to /tmp/site
#     source SITE/env.sh                                        # in every later command, from the repo root
#
# Checks every part and the whole stream against MANIFEST.sha256, installs all carried wheels, the
# vLLM bundle and the deepspeed sdist (DS_BUILD_OPS=0) into SITE with one
# `pip install --no-index --no-deps --target`, and writes SITE/env.sh. Sourcing env.sh from a checkout
# links that checkout's verl/remote_backend, verl/workers/remote_client and
# verl/trainer/config/remote_backend into SITE's verl (PyPI verl is a regular package: a second `verl/`
# folder on PYTHONPATH is never merged into it) and puts the checkout first on PYTHONPATH for
# arctic_rl and hydra_plugins.
set -euo pipefail
parts=$(cd "${1:?usage: bash benchmarks/device/unpack.sh PARTS_DIR [SITE]}" && pwd)
site=${2:-/tmp/site}
py=${PYTHON:-python3}
say() { echo "[unpack] $*" >&2; }
die() { echo "unpack.sh: $*" >&2; exit 1; }

cd "$parts"
[ -f MANIFEST.sha256 ] || die "no MANIFEST.sha256 in $parts (copy each .devparts/pN/* there)"
missing=$(awk '$2 ~ /^part/ {print $2}' MANIFEST.sha256 | while read -r p; do [ -f "$p" ] || echo "$p"; done)
[ -z "$missing" ] || die "parts missing in $parts: $(echo "$missing" | tr '\n' ' ')(expected $(grep -c ' part' MANIFEST.sha256))"
grep ' part' MANIFEST.sha256 | sha256sum --quiet -c - || die "a part fails its sha256 (copy it again)"
want=$(awk '$2 == "stream.tar" {print $1}' MANIFEST.sha256)
names=$(awk '$2 ~ /^part/ {print $2}' MANIFEST.sha256 | sort)
# shellcheck disable=SC2086
got=$(cat $names | sha256sum | cut -d' ' -f1)
[ "$got" = "$want" ] || die "the joined stream's sha256 is $got, the manifest says $want"
say "$(echo "$names" | wc -l) parts verified"

work="$parts/x"
rm -rf "$work" && mkdir -p "$work/bundle_wheels"
# shellcheck disable=SC2086
cat $names | tar -xf - -C "$work"
tar -xf "$work/vllm_bundle.tar" -C "$work" && rm "$work/vllm_bundle.tar"
tar -xf "$work/deps.tar" -C "$work/bundle_wheels"
[ -e "$site" ] && { say "replacing $site"; rm -rf "$site"; }
say "installing $(ls "$work"/bundle_wheels/*.whl "$work"/wheels/*.whl | wc -l) wheels and the deepspeed sdist into $site"
DS_BUILD_OPS=0 "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
  --no-build-isolation --target "$site" "$work"/bundle_wheels/*.whl "$work"/wheels/*.whl "$work"/sdist/deepspeed-*.tar.gz
tar -xJf "$work/vllm_slim.txz" -C "$site"
cp "$work/meta/deps-check.txt" "$work/meta/CONTENTS" "$site/" 2>/dev/null || true
rm -rf "$work"
# What pip sees there (image + SITE): versions the image has that a specifier here rules out, if any.
PYTHONPATH="$site" "$py" -m pip check --disable-pip-version-check > "$site/pip-check.txt" 2>&1 || true
say "pip check ($site/pip-check.txt):"
head -40 "$site/pip-check.txt" >&2

cat > "$site/env.sh" <<EOF
# Written by benchmarks/device/unpack.sh. Source it from the repo root of the checkout to run:
#   source $site/env.sh
# VERL_REMOTE_BACKEND_LINKS=0 removes the links instead (tests/conftest.py takes them for stale copies).
_vrb_repo=\${VERL_REMOTE_BACKEND_REPO:-\$PWD}
if [ "\${VERL_REMOTE_BACKEND_LINKS:-1}" = 0 ]; then
  rm -f "$site/verl/remote_backend" "$site/verl/workers/remote_client" "$site/verl/trainer/config/remote_backend"
  export PYTHONPATH="$site:\$_vrb_repo"
elif [ -d "\$_vrb_repo/verl/remote_backend" ]; then
  for _vrb_p in verl/remote_backend verl/workers/remote_client verl/trainer/config/remote_backend; do
    ln -sfn "\$_vrb_repo/\$_vrb_p" "$site/\$_vrb_p"
  done
  export PYTHONPATH="\$_vrb_repo:$site"
else
  echo "env.sh: \$_vrb_repo is not a verl-remote-backend checkout; only stock verl is on the path" >&2
  export PYTHONPATH="$site"
fi
export PATH="$site/bin:\$PATH" VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
unset _vrb_repo _vrb_p
EOF
say "done: run  source $site/env.sh  from the repo root (it links this checkout's packages into $site/verl)"
echo "source $site/env.sh"
