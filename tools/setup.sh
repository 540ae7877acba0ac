#!/usr/bin/env bash
# Installs what twin needs on a fresh Debian 12 machine (idempotent): Bazel 4.2.3
# (bazel-bootstrap), gcc and the C library headers, OpenBLAS, Criterion, and NumPy + ml_dtypes
# and JAX (CPU) for the golden generators, in the python3 that the build runs. The CUDA toolkit is expected
# at /usr/local/cuda (or $CUDA_PATH).
#
# Each probe asks for exactly what the build uses, never for a file another package may also
# provide: a Debian package by its dpkg status (`libblas-dev` puts a cblas.h in place through
# alternatives, yet the build links -lopenblas, which only libopenblas-dev provides), a Python
# module by importing it with the python3 on PATH (the one golden/run_py.sh runs). After
# installing, every probe runs again; whatever is still missing stops the script with one line
# naming the package and the command to run by hand.
#
#   tools/setup.sh             install what is missing
#   tools/setup.sh --dry-run   print what would be installed, install nothing (exit 0)
#
# tools/setup_test.sh runs this script with dpkg-query, apt-get, sudo and python3 replaced by
# stubs on PATH. TW_SETUP_PYTHON names another python3 to install the modules into.
set -uo pipefail
dry=0
[ "${1:-}" = --dry-run ] && dry=1
DPKG_QUERY=dpkg-query
PY=${TW_SETUP_PYTHON:-python3}

# Debian packages the build links or runs (the probe is the package's own status).
debs=(
  bazel-bootstrap   # /usr/bin/bazel 4.2.3: the only Bazel the WORKSPACE is written for
  gcc               # the C compiler Bazel's autodetected toolchain uses
  libc6-dev         # crt1.o, libc headers
  libopenblas-dev   # -lopenblas (ref/ GEMMs); also openblas_set_num_threads
  libcriterion-dev  # -lcriterion (every tests/*_test.c)
  python3           # golden generators, cross-checks (if no other python3 is on PATH)
  xz-utils          # tools/pack_gpu_bundle.sh
)
# Python modules, imported by the python3 on PATH: module=pip package. JAX (CPU) computes the
# pipeline's goldens (golden/gen_pipeline.py, jax.grad in f64), which CI regenerates.
pymods=(numpy=numpy ml_dtypes=ml_dtypes jax=jax)

deb_installed() { "$DPKG_QUERY" -W -f='${Status}\n' "$1" 2>/dev/null | grep -q '^install ok installed$'; }
py_has() { "$PY" -c "import $1" >/dev/null 2>&1; }

missing_debs() {
  local p out=()
  for p in "${debs[@]}"; do
    # python3 from Debian is needed only where no python3 is on PATH at all
    if [ "$p" = python3 ] && command -v "$PY" >/dev/null 2>&1; then continue; fi
    deb_installed "$p" || out+=("$p")
  done
  echo "${out[@]}"
}
missing_py() {
  local m out=()
  for m in "${pymods[@]}"; do py_has "${m%%=*}" || out+=("${m#*=}"); done
  echo "${out[@]}"
}

SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo

read -r -a need <<<"$(missing_debs)"
if [ $dry = 1 ]; then
  read -r -a needpy <<<"$(missing_py)"
  echo "debian: ${need[*]:-}"
  echo "python: ${needpy[*]:-}"
  exit 0
fi

if [ ${#need[@]} -gt 0 ]; then
  echo "setup: installing ${need[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null 2>&1 || true
  $SUDO apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 || true
  read -r -a still <<<"$(missing_debs)"
  if [ ${#still[@]} -gt 0 ]; then
    echo "setup: could not install ${still[*]}; run by hand: ${SUDO:+sudo }apt-get update && ${SUDO:+sudo }apt-get install -y ${still[*]}" >&2
    exit 1
  fi
fi

# Python modules go into the python3 the build runs. pip first (a pyenv or venv python3 cannot
# see Debian's python3-numpy); a Debian python3 that refuses pip (PEP 668) gets
# --break-system-packages, the pip that Debian's python3-pip provides.
read -r -a needpy <<<"$(missing_py)"
if [ ${#needpy[@]} -gt 0 ]; then
  echo "setup: installing Python modules ${needpy[*]} for $(command -v "$PY")" >&2
  if ! "$PY" -m pip --version >/dev/null 2>&1 && ! deb_installed python3-pip; then
    $SUDO apt-get install -y -qq python3-pip >/dev/null 2>&1 || true
  fi
  "$PY" -m pip install -q "${needpy[@]}" >/dev/null 2>&1 ||
    "$PY" -m pip install -q --break-system-packages "${needpy[@]}" >/dev/null 2>&1 || true
  read -r -a still <<<"$(missing_py)"
  if [ ${#still[@]} -gt 0 ]; then
    echo "setup: could not install the Python modules ${still[*]} for $(command -v "$PY"); run by hand: $PY -m pip install ${still[*]}" >&2
    exit 1
  fi
fi
exit 0
