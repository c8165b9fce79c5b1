#!/usr/bin/env bash
# The engine's CUDA path in one go: tests that matter on a GPU, then the benchmarks, within a few minutes.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (needs a CUDA build of torch on the machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/gpu.txt"
timeout 480 python scripts/gpu_check.py "$out"
