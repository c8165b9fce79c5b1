#!/usr/bin/env bash
# Everything the test suite needs on a fresh Debian machine: the Python packages, and Debian's
# chromium for the browser test (Playwright drives /usr/bin/chromium; it never downloads a browser).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x /usr/bin/chromium ]; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium
fi
bash scripts/install.sh
pip install -r requirements-test.txt
