"""Where a CPU decode step of the bundled model goes: the probes behind docs/benchmarks.md.

python scripts/decode_probe.py hooks --seq-len 1024 --method pqcache   # ms per step by module kind (forward hooks)
python scripts/decode_probe.py ops --seq-len 4096                      # profiler events in the PQ layers' functions
python scripts/decode_probe.py ab --seq-len 8192 --what threads        # one-process A/B: 2 threads vs 1
python scripts/decode_probe.py ab --seq-len 4096 --what fused          # stacked q/k/v, gate/up vs separate
python scripts/decode_probe.py ab --seq-len 8192 --what layer          # the short decode forward vs transformers'
python scripts/decode_probe.py ab --seq-len 8192 --what int4           # int8 vs int4 decode weights
python scripts/decode_probe.py ab --seq-len 8192 --what int8           # auto decode weights vs int8 everywhere
python scripts/decode_probe.py ab --seq-len 32768 --what native        # the native kernels vs torch's operators
python scripts/decode_probe.py ab --seq-len 32768 --what lmhead        # the LM head: native int8 vs torch's int4+int8
python scripts/decode_probe.py ab --seq-len 32768 --what step          # layers' step in C (layer_step.c) vs in torch
python scripts/decode_probe.py ab --seq-len 32768 --what values        # picks' values summed in place vs copied
python scripts/decode_probe.py ab --seq-len 32768 --what select        # PQ search and re-rank's top-k in C vs torch
python scripts/decode_probe.py ab --seq-len 32768 --what pqstep        # PQ selection, attention: one C call vs several
python scripts/decode_probe.py ab --seq-len 32768 --what window        # sliding layer's step: one C call vs three
python scripts/decode_probe.py ab --seq-len 32768 --what file          # new token filed in pq_step or alone
python scripts/decode_probe.py ab --seq-len 32768 --what attention     # PQ layers' attention in one C call vs torch
python scripts/decode_probe.py ab --seq-len 32768 --what scores        # re-rank scores for the picks vs their keys
python scripts/decode_probe.py ab --seq-len 8192 --what blocks         # a 1024-token block cache vs none (CPU default)
python scripts/decode_probe.py ab --seq-len 32768 --what budget        # default budget (1/10) vs 1/5 (two forks)
python scripts/decode_probe.py ab --seq-len 8192 --what onerow         # PQ layers' one-row step vs the general one
python scripts/decode_probe.py head                                    # LM head kernels and exact-argmax bounds
python scripts/decode_probe.py parts --seq-len 8192                    # wall-clock ms of the PQ layers' parts
python scripts/decode_probe.py omp --seq-len 1024                      # decode beside a thread with OpenMP helpers
python scripts/decode_probe.py app                                     # the app's own answer rate (gradio_client)
python scripts/decode_probe.py app --document-tokens 8192             # the same on a passkey document of ~8K tokens
python scripts/decode_probe.py panels --document-tokens 8192          # the app's answers in process; panels' draws

Each prefills one prompt (the passkey filler) and decodes greedily. A/B runs alternate bursts of 5 timed decode
steps between settings A and B after one prefill, so the machine's drifts hit both; they print the median,
lower quartile and minimum step. Timings on a shared machine are noisy: compare within one run only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout: the repo's pqcache
# the probes (scripts/probe/) import from this folder, on sys.path when this file runs as a script
from probe.ab import ab, head  # noqa: E402
from probe.app import app, panels  # noqa: E402
from probe.timing import hooks, omp, ops, parts  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["hooks", "ops", "ab", "head", "parts", "omp", "app", "panels"])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--method", default="pqcache", help="hooks, ab: full or pqcache")
    p.add_argument(
        "--what",
        choices=["threads", "fused", "layer", "int4", "scores", "blocks", "budget", "onerow", "int8", "native"]
        + ["lmhead", "step", "values", "select", "attention", "pqstep", "window", "file"],
        default="threads",
        help="ab: what A and B differ in",
    )
    p.add_argument("--steps", type=int, default=10, help="hooks, parts, omp: decode steps timed")
    p.add_argument(
        "--document-tokens", type=int, default=0, help="app, panels: a passkey document of about this many tokens"
    )
    args = p.parse_args()
    torch.set_num_threads(2)
    modes = {"hooks": hooks, "ops": ops, "ab": ab, "head": head, "parts": parts, "omp": omp, "app": app}
    modes["panels"] = panels
    modes[args.mode](args)


if __name__ == "__main__":
    main()
