#!/usr/bin/env bash
# Installs what twin needs on a fresh Debian 12 machine (idempotent): Bazel 4.2.3
# (bazel-bootstrap), OpenBLAS, Criterion, and Python with NumPy + ml_dtypes for the golden
# generator. The CUDA toolkit is expected at /usr/local/cuda (or $CUDA_PATH).
set -euo pipefail
need=()
command -v bazel >/dev/null 2>&1 || need+=(bazel-bootstrap)
[ -e /usr/include/x86_64-linux-gnu/cblas.h ] || [ -e /usr/include/cblas.h ] || need+=(libopenblas-dev)
[ -d /usr/include/criterion ] || need+=(libcriterion-dev)
command -v python3 >/dev/null 2>&1 || need+=(python3)
python3 -c 'import numpy' >/dev/null 2>&1 || need+=(python3-numpy)
python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
command -v gcc >/dev/null 2>&1 || need+=(build-essential)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
# ml_dtypes is only on PyPI; only the golden generator and its checks use it.
if ! python3 -c 'import ml_dtypes' >/dev/null 2>&1; then
  python3 -m pip install -q ml_dtypes 2>/dev/null || python3 -m pip install -q --break-system-packages ml_dtypes
fi
