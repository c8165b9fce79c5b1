"""Fuzzing with hypothesis: any settings, shapes and bytes give a result or a documented error.

CI runs a fixed sample (profile "ci"); `HYPOTHESIS_PROFILE=explore python -m pytest tests/unit/test_fuzz.py`
searches with fresh random examples, many more of them.
"""

import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pqcache import METHODS, PQCache, PQCacheConfig
from pqcache.engine.errors import DocumentError, PQCacheConfigError
from pqcache.serving.documents import read_document
from tests.tiny import tiny_model

settings.register_profile(
    "ci", max_examples=40, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("explore", max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-10, 5000),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)
FIELDS = [f for f in PQCacheConfig.__dataclass_fields__]


@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=4))
def test_any_config_values_are_accepted_or_refused_with_a_config_error(values):
    try:
        config = PQCacheConfig(**values)
    except PQCacheConfigError as exc:
        assert str(exc).startswith("invalid PQCacheConfig: ")
        return
    for n in (1, 2, 7, 100, 4096):  # an accepted config splits every context sensibly
        n_init, n_topk, n_local = config.split(n)
        assert n_init >= 0 and n_topk >= 0 and n_local >= 1
        assert config.budget_tokens(n) >= 1


@st.composite
def engine_cases(draw):
    budget = draw(st.one_of(st.floats(0.01, 1.0), st.integers(1, 80)))
    n_local = draw(st.one_of(st.none(), st.integers(1, 24)))
    return {
        "arch": draw(st.sampled_from(["llama", "gemma3"])),
        "method": draw(st.sampled_from(list(METHODS))),
        "batch": draw(st.integers(1, 2)),
        "seq": draw(st.integers(1, 70)),
        "pad": draw(st.integers(0, 20)),
        "chunks": draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)),  # tokens per later forward
        "config": dict(
            m=draw(st.sampled_from([1, 2, 3, 4, 8, 16])),
            bits=draw(st.integers(1, 8)),
            token_budget=budget,
            n_init=draw(st.integers(0, 8)),
            n_local=n_local,
            kmeans_iters=draw(st.integers(1, 4)),
            block_size=draw(st.sampled_from([4, 16, 128])),
            block_cache_tokens=0,
            metric=draw(st.sampled_from(["l2", "ip"])),
            gqa_combine=draw(st.sampled_from(["softmax_sum", "sum"])),
            rebuild_every=draw(st.one_of(st.none(), st.integers(1, 3))),
        ),
    }


MODELS = {}


def model_for(arch):
    if arch not in MODELS:
        MODELS[arch] = tiny_model(arch)
    return MODELS[arch]


@given(engine_cases())
@torch.no_grad()
def test_engine_runs_any_valid_setting_and_shape(case):
    model = model_for(case["arch"])
    try:
        config = PQCacheConfig(**case["config"])
        cache = PQCache(model, config, method=case["method"], keep_queries=True)
    except PQCacheConfigError as exc:  # e.g. m=3 does not divide head_dim=16, or a budget too small
        assert "m=3" in str(exc) or "cannot hold" in str(exc), exc
        return
    B, S, pad = case["batch"], case["seq"], min(case["pad"], case["seq"] - 1)
    gen = torch.Generator().manual_seed(S * 31 + B)
    ids = torch.randint(1, 96, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.long)
    if B > 1 and pad:
        ids[1, :pad], mask[1, :pad] = 0, 0  # left padding on the second row
    try:
        logits = model(ids, attention_mask=mask, cache=cache).logits
        assert torch.isfinite(logits[mask.bool()]).all()
        for n in case["chunks"]:
            step = torch.randint(1, 96, (B, n), generator=gen)
            mask = torch.cat([mask, torch.ones(B, n, dtype=torch.long)], dim=1)
            out = model(step, attention_mask=mask, cache=cache).logits
            assert out.shape == (B, n, 96) and torch.isfinite(out).all()
        stats = cache.stats()
        assert stats["notices"] == [] and stats["host_kv_bytes"] >= 0
    finally:
        cache.close()


EXTENSIONS = [".txt", ".md", ".pdf", ".docx", ""]


@given(st.binary(max_size=3000), st.sampled_from(EXTENSIONS), st.sampled_from([None, "utf-8", "cp1252", "utf-16"]))
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_any_uploaded_bytes_give_text_or_a_document_error(tmp_path, data, ext, encoding):
    path = tmp_path / f"upload{ext}"
    path.write_bytes(data)
    try:
        text = read_document(str(path), encoding=encoding)
    except DocumentError as exc:
        assert str(exc)
        return
    assert isinstance(text, str) and text.strip()


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.0, True, "0.2", [0.2]])
def test_budget_values_that_are_not_numbers_or_not_finite_are_refused(value):
    with pytest.raises(PQCacheConfigError, match="token_budget"):
        PQCacheConfig(token_budget=value)
