"""Issue 64's first slice: the attention mass estimated from every token's PQ score, a budget in mass, and the
unselected tokens' attention completed from their codes; exact wherever the selection covers every token."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine import completion
from pqcache.engine.errors import PQCacheConfigError
from pqcache.engine.full_attention import full_attention_cache
from pqcache.engine.layer import onerow
from pqcache.engine.layer.standalone import filled_layer
from pqcache.engine.mass import MASS_ESTIMATE, calibration_offset, mass_cut
from pqcache.engine.methods import pqcache as pq_method
from tests.tiny import greedy_generate, tiny_model

SMALL = dict(n_init=4, n_local=8, kmeans_iters=5, bits=4)


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(1, 96, (1, n), generator=torch.Generator().manual_seed(seed))


def _general_path(monkeypatch):
    """Every step through PQLayer.attend's general step (the path completion and the budget in mass take)."""
    monkeypatch.setattr(onerow, "ready", lambda layer, query: False)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "settings",
    [
        dict(completion=True),
        dict(completion=True, value_codes=0),
        dict(completion=True, value_codes=2),
        dict(mass=0.9),
        dict(mass=1.0, completion=True),
    ],
)
def test_a_budget_covering_every_token_is_full_attention(arch, settings, monkeypatch):
    """Completion adds nothing when nothing is unselected, and a budget in mass keeps every pick at a target of 1 or
    a floor past the budget: full attention's tokens, and bit for bit the plain step's scores."""
    model, ids = tiny_model(arch), _ids(120)
    _general_path(monkeypatch)
    with torch.no_grad():
        ref_seq, ref_scores = greedy_generate(model, ids, full_attention_cache(model))
        plain_seq, plain_scores = greedy_generate(model, ids, PQCache(model, PQCacheConfig(token_budget=1.0, **SMALL)))
        config = PQCacheConfig(token_budget=1.0, mass_floor_tokens=10_000, **SMALL, **settings)
        seq, scores = greedy_generate(model, ids, PQCache(model, config))
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert torch.equal(scores, plain_scores) and torch.equal(seq, plain_seq)


@pytest.mark.parametrize("value_codes", [0, 2])
def test_completion_brings_a_small_budget_closer_to_full_attention(value_codes):
    """At 1/10 of the tokens the completed logits are nearer full attention's than the selection's alone, whichever
    summary of the values completion reads."""
    model, ids = tiny_model("llama"), _ids(300)
    config = PQCacheConfig(token_budget=0.1, completion=True, value_codes=value_codes, **SMALL)
    with torch.no_grad():
        _, ref = greedy_generate(model, ids, full_attention_cache(model))
        _, plain = greedy_generate(model, ids, PQCache(model, PQCacheConfig(token_budget=0.1, **SMALL)))
        _, done = greedy_generate(model, ids, PQCache(model, config))
    assert (done - ref).nan_to_num(0, 0, 0).abs().max() < (plain - ref).nan_to_num(0, 0, 0).abs().max()


def _reference_completion(scores, values, codes, split, picked, unselected, est):
    """The completed attention written out: scores (H, S, R) exact, values (H, S, D), codes (H, m, S) of two codebook
    segments ([0, split), [split, S)), picked and unselected (H, S) bool, est (H, S, R) estimated scores."""
    H, S, R = scores.shape
    m = codes.shape[1]
    out = torch.zeros(H, R, values.shape[-1])
    for h in range(H):
        guess = torch.zeros(S, values.shape[-1])
        for t in range(S):
            segment = range(0, split) if t < split else range(split, S)
            for j in range(m):
                same = [u for u in segment if codes[h, j, u] == codes[h, j, t]]
                guess[t] += values[h, same].mean(0) / m
        for r in range(R):
            weights = torch.cat([scores[h, picked[h], r].exp(), est[h, unselected[h], r].exp()])
            rows = torch.cat([values[h, picked[h]], guess[unselected[h]]])
            out[h, r] = (weights[:, None] * rows).sum(0) / weights.sum()
    return out


def test_completion_equals_a_torch_reference_on_random_data():
    g = torch.Generator().manual_seed(0)
    H, S, R, D, m, C, split = 2, 40, 3, 5, 2, 4, 25
    scores, est = torch.randn(H, S, R, generator=g), torch.randn(H, S, R, generator=g)
    values = torch.randn(H, S, D, generator=g)
    codes = torch.randint(0, C, (1, H, m, S), generator=g, dtype=torch.uint8)
    picked = torch.rand(H, S, generator=g) < 0.3
    unselected = ~picked & (torch.rand(H, S, generator=g) < 0.8)
    index = SimpleNamespace(segments=[(0, None), (split, None)], codes=codes, C=C, device=torch.device("cpu"))
    host = SimpleNamespace(
        B=1,
        H=H,
        D=D,
        S=S,
        valid=torch.ones(1, S, dtype=torch.bool),
        values=lambda a, b, device, dtype: values[None, :, a:b],
    )
    summary = completion.value_means({}, index, host)
    lse, part = completion.unselected_part(est[None], unselected[None], summary)
    masked = scores.masked_fill(~picked[..., None], float("-inf")).transpose(1, 2)  # (H, R, S)
    exact_out = masked.softmax(-1) @ values  # (H, R, D)
    got = completion.merge(exact_out[None], masked.logsumexp(-1)[None], part, lse)[0]
    want = _reference_completion(scores, values, codes[0], split, picked, unselected, est)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _values_host(values: torch.Tensor, S: int) -> SimpleNamespace:
    """A host tier holding values (B, H, S', D)'s first S positions, every one real."""
    B, H, _, D = values.shape
    return SimpleNamespace(
        B=B,
        H=H,
        D=D,
        S=S,
        device=torch.device("cpu"),
        valid=torch.ones(B, S, dtype=torch.bool),
        values=lambda a, b, device, dtype: values[..., a:b, :].to(device, dtype),
    )


def test_value_codes_give_each_token_its_own_coded_value():
    """Completion's output from the values' PQ codes is the weights times the values as the codes give them: each
    token's own value where the values take fewer distinct sub-vectors than there are centroids (coded exactly),
    tokens appended after the codebook included."""
    g = torch.Generator().manual_seed(2)
    B, H, S, R, D, n = 1, 2, 300, 3, 8, 2
    distinct = torch.randn(H, 5, D, generator=g)  # five values per head, each token one of them
    values = distinct.gather(1, torch.randint(0, 5, (H, S, 1), generator=g).expand(-1, -1, D))[None]
    unselected = torch.rand(B, H, S, generator=g) < 0.7
    scores = torch.randn(B, H, S, R, generator=g)
    config = PQCacheConfig(value_codes=n, kmeans_iters=5)
    index = SimpleNamespace(iters_for=lambda s: 5, value_codes=None)
    state = {}
    first = completion.value_summary(state, index, _values_host(values, 200), config)  # trained on the first 200
    summary = completion.value_summary(state, index, _values_host(values, S), config)
    assert summary is first is index.value_codes and not state  # kept by the index
    assert summary.done == S and summary.codes.shape[:3] == (B, H, n)
    lse, part = completion.unselected_part(scores, unselected, summary)
    weights = scores.masked_fill(~unselected[..., None], float("-inf")).softmax(2)  # (B, H, S, R)
    torch.testing.assert_close(part, weights.transpose(-1, -2) @ values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, scores.masked_fill(~unselected[..., None], float("-inf")).logsumexp(2))


def test_value_codes_equal_a_reconstruction_of_their_codes_on_random_values():
    """On values PQ cannot code exactly, the output is the weights times pq.reconstruct's values."""
    from pqcache.engine import pq

    g = torch.Generator().manual_seed(3)
    values = torch.randn(1, 1, 400, 8, generator=g)
    weights = torch.rand(1, 1, 400, 2, generator=g)
    summary = completion.ValueCodes(_values_host(values, 400), 4, iters=5, seed=0)
    want = weights.transpose(-1, -2) @ pq.reconstruct(summary.codes, summary.centroids)
    torch.testing.assert_close(summary.output(weights), want, rtol=1e-5, atol=1e-5)
    assert summary.nbytes == 400 * 4 + completion.VALUE_CENTROIDS * 8 * 4


def test_value_means_follow_appended_tokens_and_new_codebooks():
    """Sums kept as tokens arrive equal sums made at once; a new codebook (install replaces the list) starts anew."""
    g = torch.Generator().manual_seed(1)
    values = torch.randn(1, 1, 30, 4, generator=g)
    codes = torch.randint(0, 4, (1, 1, 1, 30), generator=g, dtype=torch.uint8)
    index = SimpleNamespace(segments=[(0, None)], codes=codes, C=4, device=torch.device("cpu"))

    def host(S):
        return SimpleNamespace(
            B=1,
            H=1,
            D=4,
            S=S,
            valid=torch.ones(1, S, dtype=torch.bool),
            values=lambda a, b, device, dtype: values[..., a:b, :],
        )

    state = {}
    completion.value_means(state, index, host(20))
    grown = completion.value_means(state, index, host(30))
    torch.testing.assert_close(grown.means(), completion.value_means({}, index, host(30)).means())
    index.segments = [(0, None)]  # a rebuild's new list
    assert completion.value_means(state, index, host(30)) is not grown


def _peaked_layer(config: PQCacheConfig, n_peaks: int = 3, seed: int = 4):
    """One KV head of 400 keys, small noise but n_peaks keys along the query: (layer, q (1, 1, 1, D), peaks)."""
    g = torch.Generator().manual_seed(seed)
    D = 16
    keys = torch.randn(1, 1, 400, D, generator=g) * 0.1
    q = torch.randn(1, 1, 1, D, generator=g)
    peaks = [60, 170, 290][:n_peaks]
    for p in peaks:
        keys[0, 0, p] = 3 * q[0, 0, 0]
    return filled_layer(keys, torch.randn(keys.shape, generator=g), config), q, peaks


def _picked(layer, q) -> set[int]:
    top, valid = layer.select(q, 1.0)
    return set(top[0, 0][valid[0, 0]].tolist())


def test_the_mass_estimate_is_the_exact_share_when_the_scores_are_exact(monkeypatch):
    """With PQ scores replaced by the exact ones, the estimated share is the softmax share of the attended tokens."""
    layer, q, _ = _peaked_layer(PQCacheConfig(token_budget=40, completion=True, **SMALL))
    monkeypatch.setattr(pq_method, "approx_scores", lambda index, q: layer.view().keys() @ q.float().transpose(-1, -2))
    top, valid = layer.select(q, 1.0)
    estimate = layer.method_state[MASS_ESTIMATE]
    probs = (q[0, 0] @ layer.view().keys()[0, 0].T).softmax(-1)[0]  # (S,) exact attention over every token
    attended = ~layer.candidates()[0]
    attended[top[0, 0][valid[0, 0]]] = True
    torch.testing.assert_close(estimate.share[0, 0], probs[attended].sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(estimate.mass[0, 0], probs, rtol=1e-5, atol=1e-7)


def test_a_mass_target_of_one_selects_every_candidate():
    layer, q, _ = _peaked_layer(PQCacheConfig(token_budget=1.0, mass=1.0, mass_floor_tokens=0, **SMALL))
    assert _picked(layer, q) == set(layer.candidates()[0].nonzero()[:, 0].tolist())


def test_a_low_mass_target_selects_fewer_tokens_on_a_peaked_head():
    """Three keys hold most of the attention: a target of 0.8 is reached with them and a few more, where the fixed
    budget fetches its whole top-k; the peaks are among the picks either way."""
    fixed, q, peaks = _peaked_layer(PQCacheConfig(token_budget=80, **SMALL))
    by_mass, _, _ = _peaked_layer(PQCacheConfig(token_budget=80, mass=0.8, mass_floor_tokens=2, **SMALL))
    all_k, few = _picked(fixed, q), _picked(by_mass, q)
    assert set(peaks) <= few and set(peaks) <= all_k
    assert len(few) < len(all_k) // 2
    estimate = by_mass.method_state[MASS_ESTIMATE]
    assert float(estimate.share[0, 0]) >= 0.8 and int(estimate.tokens[0, 0]) == len(few) + 4 + 8


def test_the_calibration_offset_undoes_a_shift_of_the_known_scores():
    g = torch.Generator().manual_seed(2)
    exact = torch.randn(1, 2, 30, 3, generator=g)
    known = torch.rand(1, 2, 30, generator=g) < 0.5
    known[0, 1] = False  # a head with no token known: no shift
    approx = (exact + 0.7).masked_fill(~known[..., None], 9.0)  # the tokens not known must not count
    offset = calibration_offset(exact, approx, known)
    torch.testing.assert_close(offset[0, 0], torch.full((1, 3), -0.7))
    assert torch.equal(offset[0, 1], torch.zeros(1, 3))


def test_mass_cut_keeps_the_fewest_picks_that_reach_the_target_and_the_floor():
    shares = torch.tensor([[[0.05, 0.4, 0.1, 0.3, 0.0]]])
    valid = torch.tensor([[[True, True, True, True, False]]])
    base = torch.tensor([[0.1]])
    kept = mass_cut(shares, valid, base, target=0.75, floor=0)  # 0.1 + 0.4 + 0.3 = 0.8: two picks
    assert kept.tolist() == [[[False, True, False, True, False]]]
    kept = mass_cut(shares, valid, base, target=0.75, floor=3)
    assert kept.tolist() == [[[False, True, True, True, False]]]
    assert torch.equal(mass_cut(shares, valid, base, target=1.0, floor=0), valid)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"mass": 0}, "mass must be None or a share of the attention in \\(0, 1\\], got 0"),
        ({"mass": 1.5}, "mass must be None or a share"),
        ({"mass": True}, "mass must be None or a share"),
        ({"mass_floor_tokens": -1}, "mass_floor_tokens must be an int >= 0"),
        ({"mass_window_tokens": 0}, "mass_window_tokens must be an int >= 1"),
        ({"completion": "yes"}, "completion must be True or False, got 'yes'"),
        ({"value_codes": -1}, "value_codes must be None or an int >= 0"),
    ],
)
def test_bad_mass_and_completion_settings_are_refused(kwargs, match):
    with pytest.raises(PQCacheConfigError, match=match):
        PQCacheConfig(**kwargs)


@pytest.mark.parametrize("context", [1500, 3000, 6000])
def test_a_small_budget_retrieves_instead_of_going_to_the_sinks(context):
    """At 1/100 of 1.5K-6K tokens (15-60) the sinks take at most a quarter and the top-k gets a part."""
    config = PQCacheConfig(token_budget=0.01)
    n_init, n_topk, n_local = config.split(context)
    budget = config.budget_tokens(context)
    assert n_init <= budget // 4 and n_topk >= budget // 4 and n_init + n_topk + n_local == budget


def test_budgets_of_four_times_the_sinks_split_as_before():
    for context in (1280, 4000, 32_000):
        n_init, n_topk, n_local = PQCacheConfig(token_budget=0.1).split(context)
        assert n_init == PQCacheConfig().n_init and n_topk + n_local == context // 10 - n_init


def test_a_budget_in_mass_gives_an_unset_window_a_few_tokens_and_the_picks_the_rest():
    """Under a budget in mass an unset window is at most mass_window_tokens and the picks get the rest of the
    ceiling (the mass then decides how many are attended); a set window is kept, and a small budget's window is
    the fixed split's (already smaller)."""
    few = PQCacheConfig.mass_window_tokens
    for context in (1500, 4000, 32_000):
        fixed = PQCacheConfig(token_budget=0.1).split(context)
        n_init, n_topk, n_local = PQCacheConfig(token_budget=0.1, mass=0.9).split(context)
        assert n_local == min(fixed[2], few) and n_init == fixed[0] and n_init + n_topk + n_local == sum(fixed)
        assert PQCacheConfig(token_budget=0.1, mass=0.9, n_local=200).split(context)[2] == 200
    assert PQCacheConfig(token_budget=0.005, mass=0.9).split(1500) == PQCacheConfig(token_budget=0.005).split(1500)


def test_a_budget_in_mass_attends_fewer_tokens_than_the_fixed_splits_window():
    """With the window left unset, a flat random model's mass budget attends fewer tokens a step than the fixed
    budget's sinks and window alone: the window no longer takes half of the ceiling whatever the mass says."""
    model, ids = tiny_model("llama"), _ids(300)
    settings = dict(token_budget=0.5, n_init=4, kmeans_iters=5, bits=4)
    with torch.no_grad():
        cache = PQCache(model, PQCacheConfig(**settings, mass=0.05))
        greedy_generate(model, ids, cache, n=4)
    n_init, _, n_local = PQCacheConfig(**settings).split(300)
    assert cache.attended_per_step() < n_init + n_local
    cache.close()


def test_the_command_line_sets_mass_and_completion():
    from pqcache.cli.args import build_parser
    from pqcache.cli.common import config_of

    base = ["generate", "--context-file", "f", "--question", "q"]
    config = config_of(build_parser().parse_args([*base, "--mass", "0.95", "--completion"]))
    assert config.mass == 0.95 and config.completion is True
    config = config_of(build_parser().parse_args(base))
    assert config.mass is None and config.completion is False


def test_the_tokens_attended_a_step_are_counted_on_every_path():
    """attended_per_step: with the budget covering every token, every stored token (each step's context, the new
    token aside); with a fixed budget, the sinks, the window and the k picks a step; with a budget in mass, fewer
    than the fixed budget and at least its floor. The one-row step counts what the general step counts."""
    model, ids = tiny_model("llama"), _ids(300)
    runs = {}
    # a random model's attention is flat: 5% of its mass is a few picks past the sinks and the window
    for name, settings in {"all": dict(token_budget=1.0), "fixed": {}, "mass": dict(mass=0.05)}.items():
        with torch.no_grad():
            cache = PQCache(model, PQCacheConfig(**{"token_budget": 0.2, **SMALL, **settings}))
            greedy_generate(model, ids, cache, n=8)
        runs[name] = cache
    steps = runs["all"].pq_layers[0].counters["decode_steps"]  # the one-token steps after the prompt
    contexts = [300 + i for i in range(steps)]  # the tokens stored before each step
    assert steps == 7 and runs["all"].attended_per_step() == pytest.approx(sum(contexts) / steps, abs=1.0)
    budget = PQCacheConfig(token_budget=0.2, **SMALL).budget_tokens(300)
    assert runs["fixed"].attended_per_step() == pytest.approx(budget, abs=2.0)
    floor = SMALL["n_init"] + SMALL["n_local"] + PQCacheConfig.mass_floor_tokens
    assert floor <= runs["mass"].attended_per_step() < runs["fixed"].attended_per_step()


def _greedy_on_a_fork(model, parent, token, n: int, picked: list | None = None, check=None):
    """n greedy one-token steps on a fork of the prefilled `parent` from token (1, 1): (tokens (1, n), logits (n,
    1, V)); `picked`, where given, gets each PQ layer's picks attended over the steps. Both paths compared decode
    forks of one prefill: two prefills of the same text can differ in the last bit of some keys (in about 1 process
    of 12 here, the keys from about position 200 of 400 on, MKL_DYNAMIC=FALSE or not; the cause is not found), and
    the K-Means with them. check(fork), where given, runs before the fork closes."""
    fork, tokens, scores = parent.fork("pqcache"), [], []
    for _ in range(n):
        logits = model(token, cache=fork).logits[:, -1]
        token = logits.argmax(-1, keepdim=True)
        tokens.append(token)
        scores.append(logits)
    if picked is not None:
        picked.extend(layer.counters["picked"] for layer in fork.pq_layers)
    if check is not None:
        check(fork)
    fork.close()
    return torch.cat(tokens, 1), torch.stack(scores)


def test_value_codes_are_trained_with_the_prefills_codebooks_as_at_first_use():
    """Under completion the prefill's PQ build trains the values' codes too (a PQ layer holds them before its first
    step); a fork of a cache built without completion trains them where completion first needs them, on the same
    values: the same codes and the same decode."""
    model, ids = tiny_model("llama"), _ids(300)
    config = PQCacheConfig(token_budget=0.1, completion=True, **SMALL)
    with torch.no_grad():
        built, plain = PQCache(model, config), PQCache(model, replace(config, completion=False))
        for cache in (built, plain):
            model(ids[:, :-1], cache=cache)
            cache.wait()
        assert all(layer.method_state["index"].value_codes.done == 299 for layer in built.pq_layers)
        assert all(layer.method_state["index"].value_codes is None for layer in plain.pq_layers)
        runs = []
        for parent in (built, plain):
            fork, token, logits = parent.fork("pqcache", config), ids[:, -1:], []
            for _ in range(4):
                logits.append(model(token, cache=fork).logits[:, -1])
                token = logits[-1].argmax(-1, keepdim=True)
            runs.append((torch.stack(logits), [layer.method_state["index"].value_codes for layer in fork.pq_layers]))
            fork.close()
            parent.close()
    (scores, codes), (ref_scores, ref_codes) = runs
    for mine, theirs in zip(codes, ref_codes, strict=True):
        assert mine.done == theirs.done == 303
        assert torch.equal(mine.centroids, theirs.centroids) and torch.equal(mine.codes, theirs.codes)
    assert torch.equal(scores, ref_scores)


def _values_coded_as_the_general_step(cache):
    """Each PQ layer's value codes, where it keeps them, cover every value it stores (the fused step codes the value
    of each token it files), each a nearest centroid: pq.encode's code, or one as near within float rounding (a
    codebook of 256 centroids over a few hundred values holds near-copies, whose order float32 sums decide)."""
    from pqcache.engine import pq

    for layer in cache.pq_layers:
        summary = layer.method_state["index"].value_codes
        if summary is None:
            continue
        assert summary.done == layer.host.S
        values = layer.host.values(0, summary.done, dtype=torch.float32)
        codes, want = summary.codes[..., : summary.done], pq.encode(values, summary.centroids, "l2")
        n, d = codes.shape[2], values.shape[-1] // codes.shape[2]
        parts = values.double().unflatten(-1, (n, d)).transpose(2, 3)  # (B, H, n, S, d)
        dist = torch.cdist(parts, summary.centroids.double()) ** 2  # (B, H, n, S, C)
        got, best = dist.gather(-1, codes.long()[..., None]), dist.gather(-1, want.long()[..., None])
        assert float((codes != want).float().mean()) < 0.05
        torch.testing.assert_close(got, best, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("value_codes", [0, 2], ids=["mean per key cell", "value codes"])
def test_completion_in_the_fused_step_estimates_what_the_general_step_does(arch, value_codes, monkeypatch):
    """With completion the one-row decode step stays one C call (native/pq_complete.c estimates the candidates left out
    in the same pass, by key cell or by value code): the general step's tokens, its logits within float rounding
    (another summation order), every decode step through the fused call with the values' summary, the filed
    tokens' values coded as the general step codes them; an observer's steps and a single-stage search (no re-rank
    to calibrate on in the call) take the general step."""
    from pqcache.native import pq_step as native_step

    model, ids = tiny_model(arch), _ids(400, seed=7)
    config = PQCacheConfig(token_budget=0.1, rerank_min_tokens=0, completion=True, value_codes=value_codes, **SMALL)
    calls, real = [], native_step.pq_step

    def counted(*args, **kwargs):
        calls.append(_summarised(kwargs) and (kwargs.get("cells") is None) == bool(value_codes))
        return real(*args, **kwargs)

    with torch.no_grad():
        parent = PQCache(model, config)
        model(ids[:, :-1], cache=parent)
        parent.wait()
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(native_step, "pq_step", counted)
        seq, scores = _greedy_on_a_fork(model, parent, ids[:, -1:], n=10, check=_values_coded_as_the_general_step)
        observed = PQCache(model, config)
        observed.instrument(attention_every=0, recall_every=0)
        greedy_generate(model, ids, observed, n=3)
        observed.close()  # its hooks off the model
        greedy_generate(model, ids, PQCache(model, PQCacheConfig(**{**config.to_dict(), "rerank": 1})), n=3)
    assert len(calls) == 10 * len(parent.pq_layers) and all(calls)  # every one-token step of the fork
    _general_path(monkeypatch)
    with torch.no_grad():
        ref_seq, ref_scores = _greedy_on_a_fork(model, parent, ids[:, -1:], n=10)
    parent.close()
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores.nan_to_num(0, 0, 0), ref_scores.nan_to_num(0, 0, 0), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize(
    "settings",
    [
        {},
        dict(completion=True),
        dict(completion=True, value_codes=2),
        dict(search_margin=0.0),
        dict(search_margin=0.0, gqa_combine="sum"),
    ],
    ids=["mass", "mass and completion", "mass and completion by value code", "the search's exponentials", "raw-sum"],
)
def test_a_budget_in_mass_in_the_fused_step_keeps_what_the_general_step_keeps(arch, settings, monkeypatch):
    """A budget in mass is one C call too (native/pq_complete.c's cut_by_mass, from the scores the search and the
    re-rank already made): every decode step through it, each layer keeping the general step's number of picks,
    fewer than the token budget's, and the same tokens, logits within float rounding (another summation order)."""
    from pqcache.native import pq_step as native_step

    model, ids = tiny_model(arch), _ids(400, seed=7)
    # a random model's attention is flat: a tenth of its mass is a few picks past the sinks and the window
    config = PQCacheConfig(token_budget=0.2, rerank_min_tokens=0, mass=0.1, mass_floor_tokens=2, **SMALL, **settings)
    calls, real = [], native_step.pq_step

    def counted(*args, **kwargs):
        calls.append(kwargs["mass"])
        return real(*args, **kwargs)

    with torch.no_grad():
        parent = PQCache(model, config)
        model(ids[:, :-1], cache=parent)
        parent.wait()
    picked, ref_picked = [], []
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(native_step, "pq_step", counted)
        seq, scores = _greedy_on_a_fork(model, parent, ids[:, -1:], n=10, picked=picked)
    assert calls == [(0.1, 2)] * (10 * len(parent.pq_layers))  # every one-token step of the fork
    _general_path(monkeypatch)
    with torch.no_grad():
        ref_seq, ref_scores = _greedy_on_a_fork(model, parent, ids[:, -1:], n=10, picked=ref_picked)
    k = config.split(400)[1]
    parent.close()
    assert picked == ref_picked and all(2 * 10 <= p < k * 10 for p in picked), (picked, ref_picked, k)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(scores.nan_to_num(0, 0, 0), ref_scores.nan_to_num(0, 0, 0), rtol=1e-4, atol=1e-4)


def _summarised(kwargs) -> bool:
    """Whether a pq_step call was given the values' summary (completion): cells or value codes."""
    return kwargs.get("cells") is not None or kwargs.get("value_codes") is not None


@pytest.mark.parametrize(
    "m, combine, value_codes",
    [(1, "softmax_sum", 0), (2, "softmax_sum", 0), (2, "sum", 0), (2, "softmax_sum", 8)],
    ids=[
        "one sub-space, per code",
        "two sub-spaces, the search's exponentials",
        "two sub-spaces, raw sum",
        "by value code",
    ],
)
def test_completion_over_thousands_of_candidates_is_split_between_threads_and_stays_the_same(m, combine, value_codes):
    """From 4,096 candidates on the fused call's passes over them are split between the threads (each its own
    cells, added in order): on 6,000 random keys with one KV head and four query rows (Gemma 3's shape), eight decode
    steps give the general step's outputs within float rounding, with one thread and with two. Each way the weights
    are found: from the codes (one sub-space, searched per code; the raw-sum combine) and from the exponentials the
    search's softmax combine already took; and with the weights summed by the values' own codes (value_codes)."""
    from pqcache.engine.layer.standalone import InlineExecutor, filled_layer
    from pqcache.engine.methods.pqcache import PQCacheMethod

    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(1, 1, 6000, 64, generator=g), torch.randn(1, 1, 6000, 64, generator=g)
    config = PQCacheConfig(
        token_budget=0.05,
        rerank_min_tokens=0,
        completion=True,
        n_init=4,
        bits=6,
        m=m,
        gqa_combine=combine,
        value_codes=value_codes,
    )
    parent = filled_layer(keys, values, replace(config, completion=False), iters=5)
    steps = [(torch.randn(1, 4, 1, 64, generator=g), torch.randn(1, 1, 1, 64, generator=g)) for _ in range(8)]

    def run(one_row: bool, threads: int):
        layer = parent.fork(PQCacheMethod(), InlineExecutor(), config)
        outs, before = [], torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for q, kv in steps:
                layer.update(kv, -kv)
                if not one_row:
                    with pytest.MonkeyPatch.context() as m:
                        m.setattr(onerow, "ready", lambda layer, query: False)
                        outs.append(layer.attend(q, torch.ones(1, 1, dtype=torch.bool), 0.125))
                else:
                    outs.append(layer.attend(q, torch.ones(1, 1, dtype=torch.bool), 0.125))
        finally:
            torch.set_num_threads(before)
        return torch.cat(outs)

    from pqcache.native import pq_step as native_step

    reference, calls, real = run(False, 1), [], native_step.pq_step
    with pytest.MonkeyPatch.context() as m:
        m.setattr(native_step, "pq_step", lambda *a, **kw: calls.append(_summarised(kw)) or real(*a, **kw))
        for threads in (1, 2):
            torch.testing.assert_close(run(True, threads), reference, rtol=1e-4, atol=1e-5)
    assert calls == [True] * 16  # every step of both runs in the fused call, with the values' summary
