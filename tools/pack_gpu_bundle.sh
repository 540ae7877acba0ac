#!/usr/bin/env bash
# Pack the Bazel-built GPU tests and `twin` into one small archive for a GPU machine that has
# no Bazel: ../shared/device/bundle.sh, then one copy of golden/ shared by every runfiles tree
# (each test carries its own otherwise), then xz. Usage, from the repo root, after
#   bazel build --config=gpu --dynamic_mode=off //tests:all //tools:twin
#   tools/pack_gpu_bundle.sh OUT_DIR          # writes OUT_DIR/b.tar.xz (unpacks to bund/)
#   tools/pack_gpu_bundle.sh OUT_DIR ep moe   # only tests/ep_gpu_test, moe_gpu_test and twin
# Each executable carries every kernel (~45 MB); all twelve tests come to ~105 MB packed, over
# the device's 64 MiB, so a call takes the tests it runs (five: ~45 MB).
# On the GPU machine: tar xJf OUT_DIR/b.tar.xz -C /tmp && tools/gpu_suite.sh /tmp/bund OUT ...
set -euo pipefail
out=${1:?usage: pack_gpu_bundle.sh OUT_DIR}
bundler=${BUNDLER:-../shared/device/bundle.sh}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
shift
exes=(bazel-bin/tests/*_gpu_test)
if [ $# -gt 0 ]; then exes=(); for t in "$@"; do exes+=("bazel-bin/tests/${t}_gpu_test"); done; fi
"$bundler" "$tmp/bund" "${exes[@]}" bazel-bin/tools/twin >/dev/null
# golden/ once, at bund/golden; each runfiles tree links to it.
first=$(ls -d "$tmp"/bund/bin/*.runfiles/twin/golden 2>/dev/null | head -1)
if [ -n "$first" ]; then
  cp -r "$first" "$tmp/bund/golden"
  for g in "$tmp"/bund/bin/*.runfiles/twin/golden; do
    rm -rf "$g"; ln -s ../../../golden "$g"
  done
fi
# each runfiles tree holds a second copy of its executable (44 MB): a link to bin/NAME instead
for x in "$tmp"/bund/bin/*; do
  [ -f "$x" ] || continue
  n=$(basename "$x")
  for c in "$tmp/bund/bin/$n.runfiles"/*/*/"$n"; do
    [ -f "$c" ] && cmp -s "$c" "$x" && rm "$c" && ln -s "$(realpath --relative-to="$(dirname "$c")" "$x")" "$c"
  done
done
# TW_BUNDLE_GOLDEN=repo: leave golden/ out (the checkout carries it; link bund/golden to the
# repo's golden/ after unpacking, as tools/gpu_multi.sh does)
[ "${TW_BUNDLE_GOLDEN:-}" = repo ] && rm -rf "$tmp/bund/golden"
mkdir -p "$out"
tar -C "$tmp" -cf - bund | xz -9 -T2 >"$out/b.tar.xz"
du -h "$out/b.tar.xz"
