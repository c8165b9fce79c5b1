"""PQCacheConfig: every knob of the engine in one validated dataclass."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

from pqcache.engine.errors import PQCacheConfigError
from pqcache.engine.kernels import Kernels

DEVICE_BLOCK_CACHE_TOKENS = 1024  # the block cache's capacity where block_cache_tokens is None, on an accelerator
MASS_WINDOW_TOKENS = 32  # mass_window_tokens' default: an unset window's most tokens under a budget in mass
# completion's value codes where value_codes is unset: sub-spaces of VALUE_SUB_DIMS dimensions, at most VALUE_CODES
# (16 for Gemma 3's 256-dim heads, 4 for SmolLM2's 64). Narrower sub-spaces code better, but faiss's K-Means over
# a few dimensions is several times slower per dimension, and it runs in the prefill's build.
VALUE_CODES, VALUE_SUB_DIMS = 16, 16
KV_DTYPES = ("auto", "model", "float32", "float16", "bfloat16")  # kv_dtype's choices


def setting(default, help: str, label: str | None = None, choices: tuple | None = None):
    """A field of PQCacheConfig with what a person reads about it: `help` (what it is, its unit and range: the command
    line's flag help), `label` (its name on the app's load form, where the form shows it) and `choices` (the values
    it takes, also what config_errors checks)."""
    return field(default=default, metadata={"help": help, "label": label, "choices": choices})


def described() -> dict:
    """PQCacheConfig's fields that a person sets by name (a flag, a form field): name -> the field."""
    return {f.name: f for f in fields(PQCacheConfig) if f.metadata.get("help")}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, not to a user


@dataclass
class PQCacheConfig:
    # Product quantization: each key of head_dim d_h is split into `m` sub-vectors of d_h/m dims,
    # each sub-space clustered into 2**bits centroids; codes are uint8, so bits <= 8.
    # None (default) chooses from the model and the context (see for_head_dim and bits_for):
    #   m: sub-spaces of at most 64 dimensions (the paper's Llama setting: m=2 for 128-dim heads);
    #   bits: the most (<= 8) whose codes and float32 centroids stay within 1/16 of the fp16 keys.
    m: int | None = setting(None, "PQ sub-spaces per key (default: from the head size, sub-spaces of at most 64 dims)")
    bits: int | None = setting(None, "bits per PQ code, 1 to 8 (default: from the document's length)")
    # Tokens attended per decode step (sinks + top-k + local window), either a fraction of the
    # context in (0, 1] or an absolute count >= 1. The paper evaluates 1/5 and 1/10; 1/10 is the product's promise
    # and what the quality guard measures (docs/results.md), and half the bytes a decode step reads at 1/5.
    token_budget: float | int = setting(
        0.1, "tokens attended per step: a fraction of the context (default 0.1) or a count (1024)", "token budget"
    )
    n_init: int = setting(32, "attention-sink tokens, always attended (kept on the device)", "sink tokens")
    # Recent window kept exactly on the device. None: `local_ratio` of what the budget leaves after
    # the sinks (official code: half local, half top-k), at most `mass_window_tokens` under a budget in mass.
    n_local: int | None = setting(
        None,
        "recent tokens always attended (default: half of what the budget leaves after the sinks; "
        f"at most {MASS_WINDOW_TOKENS} with --mass)",
        "window",
    )
    local_ratio: float = 0.5
    # K-Means iterations: an int, or "auto" for the adaptive count of the calibration fit.
    kmeans_iters: int | str = setting("auto", "K-Means iterations: a number, or auto (this machine's calibrated rule)")
    # "l2": Lloyd K-Means + nearest-centroid codes (minimises reconstruction error, the paper's choice);
    # "ip": spherical K-Means + max-inner-product codes.
    metric: str = setting(
        "l2", "K-Means and codes: l2 (Lloyd, nearest centroid) or ip (spherical)", choices=("l2", "ip")
    )
    # How the query heads sharing one KV head combine their approximate scores:
    # "softmax_sum" (official code: softmax per query head, then sum), or "sum" (raw scores summed).
    gqa_combine: str = setting(
        "softmax_sum", "how a KV head's query heads combine their scores", choices=("softmax_sum", "sum")
    )
    # Two-stage search: PQ scores pick rerank x k candidates, their exact scores (computed on the host
    # tier, where the keys are) pick the k attended. 1: the paper's single-stage search.
    rerank: int = setting(4, "exact re-rank of rerank x k PQ candidates (1: PQ scores alone)")
    # With a re-rank, the first stage ranks a token by its PQ score plus search_margin x the spread of that score,
    # ||q|| ||k - k_hat|| / sqrt(D) (k_hat: the key as its codes give it): the keys PQ represents worst, often the
    # rare tokens a question asks about, reach the exact re-rank instead of being ranked below it (docs/results.md,
    # "The first stage's margin": a needle's digits ranked past the re-rank's 1,024 candidates). 0: the paper's
    # ranking.
    search_margin: float = setting(
        0.5, "first-stage candidates ranked by PQ score + this many spreads of it (0: PQ score alone)"
    )
    # A budget in attention mass (engine/mass.py): per KV head and step, the fewest of the top-k picks whose
    # estimated share of the attention mass (every token's PQ score, exact where known) reaches `mass`; the token
    # budget's top-k is the ceiling, `mass_floor_tokens` picks the floor (an estimate from noisy scores can be
    # overconfident). 1.0 keeps every pick. None: the fixed top-k.
    mass: float | None = setting(
        None,
        "attention mass to hold, in (0, 1]: the fewest top-k picks reaching it (the token budget is the ceiling)",
        "attention share to hold",
    )
    mass_floor_tokens: int = 16
    # Under a budget in mass an unset window takes at most this many tokens, and the picks the rest of the ceiling:
    # the window is attended whatever the mass says, so a window of half the budget kept every step's tokens above
    # 60% of the fixed budget's; the mass decides how many of the picks are attended (docs/results.md, the budget
    # sweep: at 1/10, mass 0.85 held the needles' score with a third of the tokens).
    mass_window_tokens: int = MASS_WINDOW_TOKENS
    # Completion (engine/completion.py): the unselected middle tokens' share of the softmax estimated from their
    # PQ scores and a mean value per code, merged with the exact attention over the selection by log-sum-exp.
    completion: bool = setting(
        False,
        "estimate the unselected tokens' attention from their PQ codes and add it to the selection's",
        "estimate the tokens not attended",
    )
    # Completion's value of an unselected token: n > 0, the value's own PQ codes in n sub-spaces (n bytes a token and
    # KV head, trained with the prefill's codebooks); 0, the mean value of its key's PQ cells (no bytes a token).
    # None: the most sub-spaces of at least VALUE_SUB_DIMS dimensions, at most VALUE_CODES, that divide the head size
    # (for_head_dim). The completed output's error at 1/100 was 40% (Gemma 3, 16 codes) and 40% (SmolLM2, 4) below
    # the cell means' (docs/results.md).
    value_codes: int | None = None
    # OPQ: learn an orthogonal rotation of each (row, KV head)'s keys before PQ (faiss OPQMatrix);
    # queries are rotated too, on the host where the rotations are kept.
    opq: bool = False
    # ...and at least this many candidates (all of them when fewer): at short contexts the re-rank is
    # cheap in absolute terms (no more than attending to that many tokens) and the codes are coarsest.
    rerank_min_tokens: int = 1024
    # A chunk of several tokens after the prefill (a question asked about a cached document):
    # "exact" attends to every cached token, as a prefill of document + question would (the official
    # pipeline's way); "selected" uses the method's selection, as decoding does.
    chunk_attention: str = setting(
        "exact",
        "a question after a cached document attends to every cached token (exact) or to the selection (selected)",
        choices=("exact", "selected"),
    )
    seed: int = 1234
    # Device block cache (per layer): blocks of `block_size` tokens, `block_cache_tokens` capacity
    # (0 = off), up to `block_admit` blocks admitted per step, "lfu" (official) or "lru" eviction.
    # None: DEVICE_BLOCK_CACHE_TOKENS on an accelerator, off on a CPU, where the device and host tiers are the
    # same memory: there the cache saves no transfer and its bookkeeping cost 3-5% of a decode step.
    # The app sets it explicitly: its panel shows what the cache does on a GPU.
    block_size: int = 128
    block_cache_tokens: int | None = setting(
        None,
        "device block cache per layer, in tokens (0: off; default: 1024 on a GPU, off on a CPU, where the device "
        "and host tiers are the same memory)",
        "block cache (tokens)",
    )
    block_admit: int = 2
    cache_policy: str = setting("lfu", "block-cache eviction", "block-cache policy", choices=("lfu", "lru"))
    # Re-cluster all keys every N generated tokens (None = never, codes of new tokens come from the
    # existing centroids). A multi-token chunk of at least `turn_min_tokens` after the prefill (a new
    # user turn) gets K-Means of its own, its codes appended under its own centroids.
    rebuild_every: int | None = None
    turn_min_tokens: int = 256
    # A K-Means build that raises, or is not done `pq_timeout_s` seconds after it was submitted (None:
    # wait forever), is a fault: "exact" makes the layer attend to every token from then on and
    # reports it in stats()["notices"]; "raise" raises PQBuildError.
    pq_timeout_s: float | None = 300.0
    on_pq_failure: str = setting(
        "exact", "a failed K-Means build: attend to every token (exact) or raise", choices=("exact", "raise")
    )
    # The full-attention layers' keys and values in the host tier. "auto": float16 where the model computes in
    # float32 on a CPU (half the bytes a token of float32, which a decode step reads; the native kernels widen each
    # row to float32 as they read it), the model's own dtype elsewhere. "model": the model's dtype (float32 on a
    # CPU: the behaviour before this setting). Or "float32", "float16", "bfloat16". Each key and value is rounded to
    # it as it is stored, so every tier (host, window, block cache) and the prefill's own attention read the same
    # numbers; the window and block cache keep them in the model's dtype (a step's working buffers).
    kv_dtype: str = setting(
        "auto",
        "the host tier's keys and values (default auto: float16 on a CPU running float32, half the bytes; model: "
        "the model's own dtype)",
        choices=KV_DTYPES,
    )
    # Which of the decode step's faster implementations run (engine/kernels.py): the defaults are the fastest; a
    # test switches one to compare it with the general path. Results are the same either way, so no store key has it.
    kernels: Kernels = field(default_factory=Kernels)

    def __post_init__(self):
        if isinstance(self.kernels, dict):  # as to_dict() (and a replica's view of a document) wrote it
            self.kernels = Kernels(**self.kernels)
        errors = config_errors(self)
        if errors:
            raise PQCacheConfigError("invalid PQCacheConfig: " + "; ".join(errors))

    def kv_dtype_for(self, compute_dtype, device):
        """The host tier's torch dtype for a model computing in compute_dtype on device (a torch.device)."""
        import torch

        if self.kv_dtype == "auto":
            cpu_float32 = getattr(device, "type", device) == "cpu" and compute_dtype == torch.float32
            return torch.float16 if cpu_float32 else compute_dtype
        return compute_dtype if self.kv_dtype == "model" else getattr(torch, self.kv_dtype)

    @property
    def n_centroids(self) -> int:
        if self.bits is None:
            raise PQCacheConfigError("bits=None is chosen per cache from its length: use bits_for(n_tokens, head_dim)")
        return 1 << self.bits

    def for_head_dim(self, head_dim: int) -> PQCacheConfig:
        """A copy with m chosen for the model (when None): the fewest sub-spaces of at most 64
        dimensions that divide head_dim; and value_codes (when None): the most sub-spaces of at least
        VALUE_SUB_DIMS dimensions, up to VALUE_CODES, that divide it."""
        m = self.m
        if m is None:
            m = next(d for d in range(max(1, -(-head_dim // 64)), head_dim + 1) if head_dim % d == 0)
        value_codes = self.value_codes
        if value_codes is None:
            fits = [n for n in range(1, VALUE_CODES + 1) if head_dim % n == 0 and head_dim // n >= VALUE_SUB_DIMS]
            value_codes = max(fits, default=1)
        config = replace(self, m=m, value_codes=value_codes)
        config.check_head_dim(head_dim)
        return config

    def bits_for(self, n_tokens: int, head_dim: int) -> int:
        """Bits per code for a codebook over n_tokens keys: the setting, or (None) the most, from 4 to
        8, whose codes (m bytes a token) and float32 centroids (2**bits x head_dim x 4 bytes) stay
        within 1/16 of the fp16 keys (2 x head_dim bytes a token)."""
        if self.bits is not None:
            return self.bits
        m = self.m or 1
        room = n_tokens * 2 * head_dim / 16 - m * n_tokens
        fits = [b for b in range(4, 9) if (1 << b) * head_dim * 4 <= room]
        return max(fits, default=4)

    @property
    def is_absolute_budget(self) -> bool:
        return self.token_budget > 1 or _is_int(self.token_budget)

    def budget_tokens(self, context_len: int) -> int:
        """Total tokens attended per step for a context of `context_len` tokens."""
        if self.is_absolute_budget:
            return int(self.token_budget)
        return max(1, math.ceil(self.token_budget * context_len))

    def split(self, context_len: int) -> tuple[int, int, int]:
        """(n_init, n_topk, n_local) for a context of `context_len` tokens. The sinks take at most a quarter of the
        budget, unless they cover the whole context (a sink count past the document reads all of it); a set window
        is kept as asked, past the budget if need be; an unset one is local_ratio of what the sinks leave, at most
        mass_window_tokens under a budget in mass; the top-k part gets the rest."""
        budget = self.budget_tokens(context_len)
        n_init = self.sinks(budget, context_len)
        if self.n_local is not None:
            n_local = self.n_local
        else:
            n_local = max(1, round((budget - n_init) * self.local_ratio))
            if self.mass is not None:
                n_local = min(n_local, self.mass_window_tokens)
        n_topk = max(0, budget - n_init - n_local)
        return n_init, n_topk, n_local

    def sinks(self, budget: int, context_len: int) -> int:
        """The sinks of a split. Below 4 x n_init tokens (128 by default) the sinks would otherwise eat the budget:
        at 1/100 of 1.5K-3K tokens (15-30 tokens) all of it went to the 32 sinks and a one-token window, and
        nothing was retrieved. Capped at a quarter, the sinks keep the first few tokens (the attention-sink effect
        needs only a handful) and the window and the top-k share the remaining three quarters. Budgets of
        4 x n_init tokens and more split as before."""
        if self.n_init >= context_len:
            return self.n_init
        return min(self.n_init, budget // 4)

    def check_head_dim(self, head_dim: int) -> None:
        divisors = [d for d in (1, 2, 4, 8, 16, 32) if head_dim % d == 0]
        if self.m is not None and head_dim % self.m:
            raise PQCacheConfigError(f"m={self.m} must divide the model's head_dim={head_dim} (try one of {divisors})")
        if self.value_codes and head_dim % self.value_codes:
            raise PQCacheConfigError(
                f"value_codes={self.value_codes} must divide the model's head_dim={head_dim} (try one of {divisors})"
            )

    def block_cache_for(self, device) -> int:
        """Block-cache capacity (tokens per layer) on `device` (a torch.device or its type, "cpu", "cuda")."""
        if self.block_cache_tokens is not None:
            return self.block_cache_tokens
        return 0 if getattr(device, "type", device) == "cpu" else DEVICE_BLOCK_CACHE_TOKENS

    def to_dict(self) -> dict:
        return asdict(self)


def config_errors(config: PQCacheConfig) -> list[str]:
    """Every problem of a config, in words (PQCacheConfig raises them together)."""
    errors = []
    if config.m is not None and (not _is_int(config.m) or config.m < 1):
        errors.append(f"m (number of sub-spaces) must be None or a positive int, got {config.m!r}")
    if config.bits is not None and (not _is_int(config.bits) or not 1 <= config.bits <= 8):
        errors.append(f"bits must be None or an int in 1..8 so that codes fit in uint8, got {config.bits!r}")
    b = config.token_budget
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
        errors.append(f"token_budget must be > 0 (a fraction in (0, 1] or a token count), got {b!r}")
    elif isinstance(b, float) and b > 1 and not b.is_integer():
        errors.append(f"token_budget {b} is neither a fraction in (0, 1] nor a whole token count")
    if not _is_int(config.n_init) or config.n_init < 0:
        errors.append(f"n_init must be an int >= 0, got {config.n_init!r}")
    if config.n_local is not None and (not _is_int(config.n_local) or config.n_local < 1):
        errors.append(
            f"n_local must be None or an int >= 1 (the current token is always local), got {config.n_local!r}"
        )
    if not _is_int(config.seed):
        errors.append(f"seed must be an int, got {config.seed!r}")
    if (
        isinstance(config.local_ratio, bool)
        or not isinstance(config.local_ratio, (int, float))
        or not 0 < config.local_ratio < 1
    ):
        errors.append(f"local_ratio must be in (0, 1), got {config.local_ratio!r}")
    k = config.kmeans_iters
    if not (k == "auto" or (_is_int(k) and k >= 1)):
        errors.append(f"kmeans_iters must be 'auto' or an int >= 1, got {k!r}")
    for name in ("metric", "gqa_combine", "chunk_attention", "cache_policy", "on_pq_failure", "kv_dtype"):
        choices, value = described()[name].metadata["choices"], getattr(config, name)
        if value not in choices:
            errors.append(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    if not _is_int(config.rerank_min_tokens) or config.rerank_min_tokens < 0:
        errors.append(f"rerank_min_tokens must be an int >= 0, got {config.rerank_min_tokens!r}")
    if not isinstance(config.opq, bool):
        errors.append(f"opq must be True or False, got {config.opq!r}")
    m = config.mass
    if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 1):
        errors.append(f"mass must be None or a share of the attention in (0, 1], got {m!r}")
    if not _is_int(config.mass_floor_tokens) or config.mass_floor_tokens < 0:
        errors.append(f"mass_floor_tokens must be an int >= 0, got {config.mass_floor_tokens!r}")
    if not _is_int(config.mass_window_tokens) or config.mass_window_tokens < 1:
        errors.append(f"mass_window_tokens must be an int >= 1, got {config.mass_window_tokens!r}")
    vc = config.value_codes
    if vc is not None and (not _is_int(vc) or vc < 0):
        errors.append(f"value_codes must be None or an int >= 0 (0: a mean value per key cell), got {vc!r}")
    if not isinstance(config.completion, bool):
        errors.append(f"completion must be True or False, got {config.completion!r}")
    sm = config.search_margin
    if isinstance(sm, bool) or not isinstance(sm, (int, float)) or not math.isfinite(sm) or sm < 0:
        errors.append(f"search_margin must be a number >= 0, got {sm!r}")
    if not _is_int(config.rerank) or config.rerank < 1:
        errors.append(f"rerank must be an int >= 1 (1: PQ scores alone), got {config.rerank!r}")
    if not _is_int(config.block_size) or config.block_size < 1:
        errors.append(f"block_size must be an int >= 1, got {config.block_size!r}")
    elif config.block_cache_tokens is not None and (
        not _is_int(config.block_cache_tokens)
        or config.block_cache_tokens < 0
        or config.block_cache_tokens % config.block_size
    ):
        errors.append(
            f"block_cache_tokens must be None, 0 or a multiple of block_size={config.block_size}, "
            f"got {config.block_cache_tokens!r}"
        )
    if not _is_int(config.block_admit) or config.block_admit < 1:
        errors.append(f"block_admit must be an int >= 1, got {config.block_admit!r}")
    if config.rebuild_every is not None and (not _is_int(config.rebuild_every) or config.rebuild_every < 1):
        errors.append(f"rebuild_every must be None or an int >= 1, got {config.rebuild_every!r}")
    if not _is_int(config.turn_min_tokens) or config.turn_min_tokens < 1:
        errors.append(f"turn_min_tokens must be an int >= 1, got {config.turn_min_tokens!r}")
    if not errors and config.is_absolute_budget and config.n_local is not None:
        if config.n_init + config.n_local > int(b):
            errors.append(
                f"token_budget={int(b)} tokens cannot hold n_init={config.n_init} sinks plus "
                f"n_local={config.n_local} recent tokens"
            )
    t = config.pq_timeout_s
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0):
        errors.append(f"pq_timeout_s must be None or a number of seconds > 0, got {t!r}")
    return errors
