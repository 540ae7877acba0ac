#!/usr/bin/env python3
"""Regenerates every stored golden: runs each golden/gen_<area>.py (NumPy + ml_dtypes only).

    python3 golden/gen_goldens.py            # rewrite golden/data/<area>/ from the generators
    python3 golden/gen_goldens.py --check    # regenerate into a temp dir, compare with golden/data

--check proves the stored goldens are exactly what the generators produce today (seeded, so
byte for byte): it copies the generators to a scratch directory, runs them there (each writes
under its own data/ folder), and compares the two trees file by file.
"""
import argparse
import filecmp
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def generators(where):
    return sorted(p for p in glob.glob(os.path.join(where, "gen_*.py"))
                  if os.path.basename(p) != "gen_goldens.py")


def run_all(where):
    failed = []
    for gen in generators(where):
        t0 = time.time()
        r = subprocess.run([sys.executable, gen], cwd=where, capture_output=True, text=True)
        tail = (r.stdout.strip().splitlines() or [""])[-1]
        print("%-20s %s (%.1f s)%s" % (os.path.basename(gen), "ok" if r.returncode == 0 else "FAILED",
                                      time.time() - t0, ": " + tail if tail else ""))
        if r.returncode != 0:
            sys.stderr.write(r.stderr)
            failed.append(gen)
    return failed


def tree(root):
    out = set()
    for d, _, fs in os.walk(root):
        for f in fs:
            out.add(os.path.relpath(os.path.join(d, f), root))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare a fresh generation with golden/data")
    args = ap.parse_args()
    if not generators(HERE):
        print("no golden/gen_*.py generators found")
        return 1
    if not args.check:
        return 1 if run_all(HERE) else 0
    with tempfile.TemporaryDirectory() as tmp:
        for gen in generators(HERE):
            shutil.copy(gen, tmp)
        if run_all(tmp):
            return 1
        fresh, stored = os.path.join(tmp, "data"), os.path.join(HERE, "data")
        a, b = tree(fresh), tree(stored)
        differ = [f for f in sorted(a & b)
                  if not filecmp.cmp(os.path.join(fresh, f), os.path.join(stored, f), shallow=False)]
        for label, files in (("only regenerated", sorted(a - b)), ("only stored", sorted(b - a)),
                             ("differ", differ)):
            for f in files[:20]:
                print("%s: %s" % (label, f))
            if len(files) > 20:
                print("%s: ... %d more" % (label, len(files) - 20))
        bad = len(a - b) + len(b - a) + len(differ)
        print("goldens %s (%d files compared)" % ("up to date" if not bad else "OUT OF DATE: %d files" % bad,
                                                 len(a & b)))
        return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
