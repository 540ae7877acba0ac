#!/usr/bin/env bash
# The main job: installs dependencies, then `twin check` on its default case (the golden
# suite on every backend this machine has). Extra arguments go to `twin check`.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
bazel run //tools:twin -- check "$@"
