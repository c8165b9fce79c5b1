#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian machine: the Python packages, Debian's chromium for the
# browser test (Playwright drives /usr/bin/chromium; it never downloads a browser), and a C compiler for the
# native decode kernels (pqcache/native; tests/test_native.py fails without one).
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
