"""Every selection method on the bundled model."""

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.methods import METHODS


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_runs_on_the_bundled_model(real_model, method):
    model, tok = real_model
    ids = tok("The pass key is 12345. " * 20 + "What is the pass key? The pass key is", return_tensors="pt").input_ids
    with torch.no_grad():
        cache = PQCache(model, PQCacheConfig(token_budget=0.3), method=method)
        out = model.generate(ids, max_new_tokens=3, do_sample=False, cache=cache)
    assert out.shape[1] == ids.shape[1] + 3
    assert all(layer.stats["steps"] == 2 for layer in cache.pq_layers)
