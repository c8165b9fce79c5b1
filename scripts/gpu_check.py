"""The CUDA path in one go (a few minutes on one GPU): exactness, the bundled model, benchmarks.

Run on a machine with CUDA: `bash scripts/gpu_check.sh [OUT_DIR]`. Prints one JSON object and
writes it to OUT_DIR/gpu_check.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pqcache import PQCache, PQCacheConfig, load_model  # noqa: E402
from pqcache.bench import attention as bench  # noqa: E402
from pqcache.eval.passkey import passkey_prompt  # noqa: E402


def check_exact(device):
    """Budget covering the context: logits equal full attention on CUDA (fp32, batch 2, left padding)."""
    torch.manual_seed(0)
    model = (
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=96,
                hidden_size=64,
                intermediate_size=96,
                num_hidden_layers=3,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
            )
        )
        .to(device)
        .eval()
    )
    ids = torch.randint(1, 96, (2, 300), device=device)
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    kw = dict(
        attention_mask=mask,
        max_new_tokens=8,
        do_sample=False,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    with torch.no_grad():
        ref = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
        cache = PQCache(
            model, PQCacheConfig(token_budget=1.0, n_init=4, n_local=8, bits=4, block_size=16, block_cache_tokens=64)
        )
        out = model.generate(ids, cache=cache, **kw)
    diff = (torch.stack(ref.scores) - torch.stack(out.scores)).abs().max().item()
    layer = cache.pq_layers[0]
    return {
        "max_logit_diff": diff,
        "same_tokens": bool(torch.equal(ref.sequences, out.sequences)),
        "host_pinned": bool(layer.host.own_k.is_pinned()),
        "device_tier": str(layer.window.k.device),
    }


def check_passkey(device):
    model, tok = load_model("default", device=device)
    ids = tok(passkey_prompt("68422"), return_tensors="pt").input_ids.to(device)
    rows = {}
    with torch.no_grad():
        for name, cache in (
            ("full", DynamicCache(config=model.config)),
            ("pqcache", PQCache(model, PQCacheConfig(token_budget=0.2))),
        ):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(ids, max_new_tokens=8, do_sample=False, cache=cache)
            torch.cuda.synchronize()
            rows[name] = {"text": tok.decode(out[0, ids.shape[1] :]), "seconds": round(time.perf_counter() - t0, 3)}
    return rows


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    device = "cuda"
    assert torch.cuda.is_available(), "no CUDA device"
    report = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    report["exact"] = check_exact(device)
    report["passkey"] = check_passkey(device)
    report["bench_attention"] = bench.bench_attention(
        seq_lens=(4096, 16384, 65536, 131072), device=device, dtype=torch.bfloat16, repeats=20
    )
    report["bench_decode"] = bench.bench_decode(
        seq_lens=(4096, 32768, 131072), device=device, dtype=torch.bfloat16, repeats=20
    )
    print(json.dumps(report, indent=1))
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
