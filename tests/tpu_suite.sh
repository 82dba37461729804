#!/usr/bin/env bash
# The test suite on a TPU host, in parts of at most 5 minutes each (one device run
# may last 10): docs/accelerators.md, "Running the tests on an accelerator".
#
#   bash tests/tpu_suite.sh K [N]      # part K of N (N = 10 unless given), K = 1 .. N
#
# Part K runs, at the same time:
#   - in one pytest process on the TPU (one process at a time may hold it), the
#     K-th of N parts of the tests not marked `children`;
#   - in a CPU-only pytest process beside it, the K-th of N parts of the tests
#     marked `children` (their work runs in child processes on the CPU anyway).
# tests/conftest.py (--part K/N) deals each file's tests to the parts in turn, so a
# slow file is spread over all of them: renamed or new files need no list here.
# Logs: $OUT (the folder a device run sends back) or /tmp.
set -u
K=${1:?usage: bash tests/tpu_suite.sh K [N]}
N=${2:-10}
LOGS=${OUT:-/tmp}
SITE=/tmp/tpu-suite-site
# What the TPU image lacks of the package's dependencies and the test extra, from
# the machine's own package index (it reaches no network), one at a time: a
# missing one only skips the tests that need it.
for pkg in threadpoolctl pytest-timeout tqdm; do
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps \
    --only-binary=:all: --index-url file:///opt/pypi/simple --target "$SITE" "$pkg" \
    || echo "tpu_suite: could not install $pkg"
done
# This checkout first, the machine's JAX next, the additions last.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}:$SITE"
export PYTHONUNBUFFERED=1
JAX_PLATFORMS=cpu python3 -m pytest -q -p no:xdist -m children --part "$K/$N" tests \
  >"$LOGS/cpu-part$K.log" 2>&1 &
cpu=$!
python3 -m pytest -q -p no:xdist -m "not children" --part "$K/$N" --durations=10 tests \
  2>&1 | tee "$LOGS/tpu-part$K.log"
tpu_rc=${PIPESTATUS[0]}
wait "$cpu"
cpu_rc=$?
[ "$cpu_rc" = 5 ] && cpu_rc=0 # no `children` test in this part
echo "tpu_suite part $K/$N: TPU process exit $tpu_rc, CPU process exit $cpu_rc" \
  "(its log: $LOGS/cpu-part$K.log; its end:)"
tail -n 12 "$LOGS/cpu-part$K.log"
[ "$tpu_rc" = 0 ] && [ "$cpu_rc" = 0 ]
