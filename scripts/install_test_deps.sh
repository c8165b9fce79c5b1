#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian machine: the Python packages, Debian's chromium for the
# browser test (Playwright drives /usr/bin/chromium; it never downloads a browser), and a C compiler for the
# native decode kernels (pqcache/native; tests/unit/test_native.py fails without one).
# llama.cpp (requirements-bench.txt, only for `python -m pqcache bench e2e`) is not installed here: the tests do not
# need it. To add it, build it with explicit CPU flags, not -DGGML_NATIVE=ON (that build crashed on a Xeon with AMX),
# and with --no-cache-dir; the commands for AVX2 and AVX-512 CPUs are in requirements-bench.txt and docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
MISSING=""
[ -x /usr/bin/chromium ] || MISSING="$MISSING chromium"
command -v cc >/dev/null || MISSING="$MISSING gcc"
if [ -n "$MISSING" ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $MISSING
fi
bash scripts/install.sh
pip install -r requirements-test.txt
