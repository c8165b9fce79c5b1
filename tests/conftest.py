import os

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

COMMON = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0)


def tiny_model(arch: str, seed: int = 0):
    """A random-weight causal LM built in-process (no download)."""
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**COMMON))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**COMMON, sliding_window=None))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**COMMON, use_sliding_window=False))
    elif arch == "gemma3":
        cfg = Gemma3TextConfig(**COMMON, sliding_window=24, query_pre_attn_scalar=16,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
        model = Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(arch)
    return model.eval()


ARCHS = ["llama", "mistral", "qwen2", "gemma3"]


@pytest.fixture(params=ARCHS)
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def real_model():
    """The bundled Gemma 3 270M (converted once into PQCACHE_HOME)."""
    from pqcache import load_model

    return load_model("default", device="cpu")


@pytest.fixture(scope="session")
def app_url():
    """`python app.py` launched as a user launches it, on a free localhost port."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port)], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while True:  # wait until the server accepts connections
        if proc.poll() is not None:
            raise RuntimeError(proc.stdout.read())
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            if time.time() > deadline:
                proc.kill()
                raise RuntimeError("app did not start within 300 s")
            time.sleep(0.5)
    yield f"http://127.0.0.1:{port}/"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
