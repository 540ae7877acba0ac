#!/usr/bin/env bash
# tools/setup.sh decides by what the build links and imports, not by files other packages also
# provide. Each case runs the real setup.sh with dpkg-query, apt-get, sudo and python3 replaced
# by stubs on PATH that keep a fake machine's state in files, then asserts what was installed.
# The first case is the fresh Debian 12 image that broke the README's commands: libblas-dev is
# installed (its cblas.h sits in /usr/include/x86_64-linux-gnu through alternatives) and
# libopenblas-dev is not; the old probe (`[ -e .../cblas.h ]`) installed nothing there.
set -u
JUNIT_SUITE=twin_setup
. "$(dirname "$0")/junit.sh"
SETUP=$(realpath "${1:?usage: setup_test.sh path/to/setup.sh}")
T=$(mktemp -d "${TEST_TMPDIR:-/tmp}/setup.XXXXXX")
STUBS=$T/stubs
mkdir -p "$STUBS"

# dpkg-query -W -f=FMT PKG: "install ok installed" for packages listed in $T/debs
cat >"$STUBS/dpkg-query" <<EOF
#!/usr/bin/env bash
p=\${@: -1}
if grep -qx "\$p" "$T/debs"; then echo "install ok installed"; exit 0; fi
echo "dpkg-query: no packages found matching \$p" >&2; exit 1
EOF
# apt-get update | install -y -qq PKGS: logs, then marks PKGS installed unless listed in $T/apt_fails
cat >"$STUBS/apt-get" <<EOF
#!/usr/bin/env bash
echo "apt-get \$*" >>"$T/log"
[ "\$1" = install ] || exit 0
rc=0
for p in "\$@"; do
  case "\$p" in -*|install) continue ;; esac
  if grep -qx "\$p" "$T/apt_fails"; then rc=100; else echo "\$p" >>"$T/debs"; fi
done
exit \$rc
EOF
cat >"$STUBS/sudo" <<'EOF'
#!/usr/bin/env bash
exec "$@"
EOF
# python3 -c 'import M' succeeds for modules listed in $T/mods; -m pip install installs them
cat >"$STUBS/python3" <<EOF
#!/usr/bin/env bash
if [ "\$1" = -c ]; then m=\${2#import }; grep -qx "\$m" "$T/mods"; exit \$?; fi
if [ "\$1 \$2" = "-m pip" ]; then
  [ "\$3" = --version ] && { echo "pip 23"; exit 0; }
  echo "pip \${*:3}" >>"$T/log"
  rc=0
  for p in "\${@:4}"; do
    case "\$p" in -*) continue ;; esac
    if grep -qx "\$p" "$T/pip_fails"; then rc=1; else echo "\$p" >>"$T/mods"; fi
  done
  exit \$rc
fi
exit 2
EOF
chmod +x "$STUBS"/*

ALL_DEBS="bazel-bootstrap gcc libc6-dev libopenblas-dev libcriterion-dev python3 xz-utils"
# machine DEBS MODS APT_FAILS PIP_FAILS: set up the fake machine's state
machine() {
  : >"$T/log"
  printf '%s\n' $1 >"$T/debs"
  printf '%s\n' $2 >"$T/mods"
  printf '%s\n' $3 >"$T/apt_fails"
  printf '%s\n' $4 >"$T/pip_fails"
}
run_setup() { PATH="$STUBS:$PATH" bash "$SETUP" "$@" >"$T/out" 2>"$T/err"; echo $? >"$T/rc"; }
installed_by_apt() { grep '^apt-get install' "$T/log" | tr ' ' '\n' | grep -qx "$1"; }
installed_by_pip() { grep '^pip install' "$T/log" | tr ' ' '\n' | grep -qx "$1"; }

# 1. libblas-dev (and its cblas.h) present, OpenBLAS absent: libopenblas-dev must be installed.
machine "libblas-dev bazel-bootstrap gcc libc6-dev libcriterion-dev python3 xz-utils" "numpy ml_dtypes jax" "" ""
run_setup
if [ "$(cat "$T/rc")" = 0 ] && installed_by_apt libopenblas-dev; then pass reference_blas_does_not_count_as_openblas
else fail reference_blas_does_not_count_as_openblas "rc $(cat "$T/rc"); log: $(tr '\n' ';' <"$T/log"); err: $(head -c 300 "$T/err")"; fi
if ! installed_by_apt libblas-dev && ! installed_by_apt libcriterion-dev && ! installed_by_pip numpy; then pass installs_only_what_is_missing
else fail installs_only_what_is_missing "log: $(tr '\n' ';' <"$T/log")"; fi

# 2. A fresh machine with nothing: every Debian package and both Python modules.
machine "" "" "" ""
run_setup
ok=1
for p in bazel-bootstrap gcc libc6-dev libopenblas-dev libcriterion-dev xz-utils; do installed_by_apt "$p" || ok=0; done
installed_by_pip numpy && installed_by_pip ml_dtypes && installed_by_pip jax || ok=0
if [ $ok = 1 ] && [ "$(cat "$T/rc")" = 0 ]; then pass fresh_machine_gets_everything
else fail fresh_machine_gets_everything "rc $(cat "$T/rc"); log: $(tr '\n' ';' <"$T/log"); err: $(head -c 300 "$T/err")"; fi

# 3. A bazel on PATH that is not Debian's 4.2.3 does not count: bazel-bootstrap is the package.
machine "gcc libc6-dev libopenblas-dev libcriterion-dev python3 xz-utils" "numpy ml_dtypes jax" "" ""
printf '#!/bin/sh\necho bazel 7\n' >"$STUBS/bazel"; chmod +x "$STUBS/bazel"
run_setup
rm -f "$STUBS/bazel"
if installed_by_apt bazel-bootstrap; then pass another_bazel_on_path_does_not_count
else fail another_bazel_on_path_does_not_count "log: $(tr '\n' ';' <"$T/log")"; fi

# 4. Everything present: nothing runs, exit 0.
machine "$ALL_DEBS" "numpy ml_dtypes jax" "" ""
run_setup
if [ "$(cat "$T/rc")" = 0 ] && [ ! -s "$T/log" ]; then pass complete_machine_installs_nothing
else fail complete_machine_installs_nothing "rc $(cat "$T/rc"); log: $(tr '\n' ';' <"$T/log")"; fi

# 5. A failed apt install stops at once with one line naming the package and the command.
machine "libblas-dev bazel-bootstrap gcc libc6-dev libcriterion-dev python3 xz-utils" "numpy ml_dtypes jax" "libopenblas-dev" ""
run_setup
if [ "$(cat "$T/rc")" != 0 ] && [ "$(wc -l <"$T/err")" -le 2 ] &&
   tail -1 "$T/err" | grep -q "could not install libopenblas-dev; run by hand: .*apt-get install -y libopenblas-dev"; then
  pass failed_apt_install_names_the_package
else fail failed_apt_install_names_the_package "rc $(cat "$T/rc"); err: $(head -c 400 "$T/err")"; fi

# 6. A failed pip install likewise, naming the module and the python it was for.
machine "$ALL_DEBS" "numpy jax" "" "ml_dtypes"
run_setup
if [ "$(cat "$T/rc")" != 0 ] && tail -1 "$T/err" | grep -q "could not install the Python modules ml_dtypes .*run by hand: python3 -m pip install ml_dtypes"; then
  pass failed_pip_install_names_the_module
else fail failed_pip_install_names_the_module "rc $(cat "$T/rc"); err: $(head -c 400 "$T/err")"; fi

# 7. --dry-run lists what is missing and installs nothing.
machine "libblas-dev bazel-bootstrap gcc libc6-dev libcriterion-dev python3 xz-utils" "numpy jax" "" ""
run_setup --dry-run
if [ "$(cat "$T/rc")" = 0 ] && [ ! -s "$T/log" ] && grep -qx "debian: libopenblas-dev" "$T/out" && grep -qx "python: ml_dtypes" "$T/out"; then
  pass dry_run_lists_and_installs_nothing
else fail dry_run_lists_and_installs_nothing "rc $(cat "$T/rc"); out: $(tr '\n' ';' <"$T/out"); log: $(tr '\n' ';' <"$T/log")"; fi

finish
