#!/usr/bin/env bash
# Pack the Bazel-built GPU tests and `twin` into one small archive for a GPU machine that has
# no Bazel: ../shared/device/bundle.sh, then one copy of golden/ shared by every runfiles tree
# (each test carries its own otherwise), then xz. Usage, from the repo root, after
#   bazel build --config=gpu --dynamic_mode=off //tests:all //tools:twin
#   tools/pack_gpu_bundle.sh OUT_DIR          # writes OUT_DIR/b.tar.xz (unpacks to bund/)
# On the GPU machine: tar xJf OUT_DIR/b.tar.xz -C /tmp && tools/gpu_suite.sh /tmp/bund OUT ...
set -euo pipefail
out=${1:?usage: pack_gpu_bundle.sh OUT_DIR}
bundler=${BUNDLER:-../shared/device/bundle.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$bundler" "$tmp/bund" bazel-bin/tests/*_gpu_test bazel-bin/tools/twin >/dev/null
# golden/ once, at bund/golden; each runfiles tree links to it.
first=$(ls -d "$tmp"/bund/bin/*.runfiles/twin/golden 2>/dev/null | head -1)
if [ -n "$first" ]; then
  cp -r "$first" "$tmp/bund/golden"
  for g in "$tmp"/bund/bin/*.runfiles/twin/golden; do
    rm -rf "$g"; ln -s ../../../golden "$g"
  done
fi
mkdir -p "$out"
tar -C "$tmp" -cf - bund | xz -9 -T2 >"$out/b.tar.xz"
du -h "$out/b.tar.xz"
