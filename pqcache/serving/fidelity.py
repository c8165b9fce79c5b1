"""How far each method's attention output is from full attention's, on the model's real keys, values and queries
(issue 64: "fidelity as a measured quantity"): `python -m pqcache eval fidelity`, and the Teaching tab's picture of
what the selection missed and what the estimate put back (serving/teaching.py).

One prefill (method "full", its queries kept; or a cache that kept them: cache_fidelity). Per full-attention layer,
the last n_queries prefill tokens are held out: a standalone layer is filled with the P = S - n_queries tokens before
them (PQ built once, completion's value codes with it), and each setting
runs on a fork of it (the codes shared, no second K-Means) that replays the held-out tokens as decode steps:
update(k_t, v_t), then attend(q_t) through PQLayer.attend, as a real decode step does, each step appending its
token. The reference of each step is full attention over what the fork then stores (every earlier token and the
new one, as the host tier holds them: the same rounding), in plain torch. Per (layer, setting, budget):
  rel_error   ||o - o_full|| / ||o_full|| over the layer's query heads, mean over the steps
  tokens      tokens attended per KV head (sinks, window, picks and the new token), mean over heads and steps
  mass        the exact share of full attention's weight on those tokens (mean over query heads and steps)
  est_share   the selection's own estimate of its share of the stored tokens (engine/mass.py), where it makes one
Softcapping is left out on both sides (a probe of the selection, as `eval recall`'s)."""

from __future__ import annotations

from dataclasses import replace

import torch

from pqcache.engine.cache import PQCache
from pqcache.engine.config import PQCacheConfig
from pqcache.serving.generate import prefill

BUDGETS = (0.1, 0.05, 0.02, 0.01, 0.005)
# setting -> (method name, config fields): the mass budgets keep the token budget as their ceiling and the default
# floor (mass_floor_tokens), so at each budget they attend at most what plain PQCache attends
SETTINGS = {
    "full": ("full", {}),
    "oracle": ("oracle", {}),
    "pqcache": ("pqcache", {}),
    "pqcache+mass0.9": ("pqcache", {"mass": 0.9}),
    "pqcache+mass0.95": ("pqcache", {"mass": 0.95}),
    "pqcache+completion": ("pqcache", {"completion": True}),
    # completion reading a mean value per key cell instead of the values' own PQ codes (value_codes' default:
    # sub-spaces of 16 dims, PQCacheConfig.for_head_dim), or 4 or 16 codes a token and KV head
    "pqcache+completion+cellmeans": ("pqcache", {"completion": True, "value_codes": 0}),
    "pqcache+completion+vcodes4": ("pqcache", {"completion": True, "value_codes": 4}),
    "pqcache+completion+vcodes16": ("pqcache", {"completion": True, "value_codes": 16}),
}
FIELDS = ("rel_error", "tokens", "mass", "est_share")


@torch.no_grad()
def fidelity_study(
    model,
    tokenizer,
    context: str,
    budgets=BUDGETS,
    methods=tuple(SETTINGS),
    n_queries: int = 8,
    iters: int = 20,
    config: PQCacheConfig | None = None,
) -> list[dict]:
    """Rows per (full-attention layer, setting, budget) of one prefill of `context` (see above); "full" once per
    layer (budget None: it attends every token). config: the PQ settings (m, bits, rerank, sinks, window) the
    settings start from; their token budget, mass and completion are each setting's own. A setting that fails is
    a row with "error" and the study goes on."""
    unknown = [m for m in methods if m not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown fidelity setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    base_config = config or PQCacheConfig()
    device = next(model.parameters()).device
    ids = tokenizer(context, return_tensors="pt").input_ids.to(device)
    base = PQCache(model, PQCacheConfig(kmeans_iters=1), method="full", keep_queries=True)
    prefill(model, ids, base)
    try:
        return cache_fidelity(base, budgets, methods, n_queries, iters, base_config)
    finally:
        base.close()


@torch.no_grad()
def cache_fidelity(cache, budgets, methods, n_queries: int, iters: int, config: PQCacheConfig) -> list[dict]:
    """fidelity_study's rows on a prefilled cache whose layers kept their prefill's queries (keep_queries=True);
    config: the settings each setting starts from (see fidelity_study)."""
    base_config = replace(config, kmeans_iters=iters, block_cache_tokens=0)
    rows = []
    for layer in cache.pq_layers:
        rows += _layer_rows(layer, base_config, budgets, methods, n_queries, iters, layer.device)
    return rows


def _layer_rows(layer, base_config, budgets, methods, n_queries, iters, device) -> list[dict]:
    from pqcache.engine.layer.standalone import filled_layer

    S = layer.S
    n = max(1, min(n_queries, S // 2))  # the held-out steps; at least half the tokens stay as the context
    P = S - n
    keys = layer.host.keys(0, S, device).float()  # (1, H, S, D): float32, the standalone layer's compute dtype
    values = layer.host.values(0, S, device).float()
    queries = layer.prefill_q[:, :, P:S].to(device).float()  # (1, Hq, n, D), unscaled: attend scales them
    cfg0 = replace(base_config, token_budget=1.0).for_head_dim(keys.shape[-1])
    try:  # built under completion: the values' codes trained once, with the keys', for every fork that reads them
        parent = filled_layer(keys[:, :, :P], values[:, :, :P], replace(cfg0, completion=True), iters=iters)
    except Exception as exc:  # noqa: BLE001 - the layer's rows say why; the study goes on
        return [_failed(layer.layer_idx, m, b, exc) for m in methods for b in _budgets_of(m, budgets)]
    rows = []
    for name in methods:
        for budget in _budgets_of(name, budgets):
            method, fields = SETTINGS[name]
            cfg = replace(cfg0, **{"mass": None, "completion": False, **fields}, token_budget=budget or 1.0)
            try:
                acc = _replay(parent, method, cfg, keys[:, :, P:], values[:, :, P:], queries, layer.scaling)
                rows.append(_row(layer.layer_idx, name, budget, P, acc))
            except Exception as exc:  # noqa: BLE001 - a bad case never aborts the study
                rows.append(_failed(layer.layer_idx, name, budget, exc))
    return rows


def _budgets_of(name: str, budgets) -> tuple:
    return (None,) if name == "full" else tuple(budgets)


def _replay(parent, method: str, cfg, k_new, v_new, queries, scaling: float) -> dict:
    """The held-out tokens k_new, v_new (1, H, n, D) and queries (1, Hq, n, D) as n decode steps on a fork of
    parent with `method` and cfg -> the steps' measures (lists per FIELDS)."""
    from pqcache.engine.layer.standalone import InlineExecutor
    from pqcache.engine.methods import METHODS

    layer = parent.fork(METHODS[method](), InlineExecutor(), cfg)
    seen = _capture_estimate(layer)
    acc = {f: [] for f in FIELDS}
    H = layer.host.H
    for t in range(queries.shape[2]):
        S0 = layer.S
        fixed = layer.host.valid[:, :S0] & ~layer.candidates()  # (1, S0): sinks and window, attended anyway
        seen.clear()
        layer.update(k_new[:, :, t : t + 1], v_new[:, :, t : t + 1])
        q = queries[:, :, t : t + 1]  # (1, Hq, 1, D)
        out = layer.attend(q, torch.ones((1, 1), dtype=torch.bool, device=q.device), scaling)  # (1, 1, Hq, D)
        stored_keys = layer.host.keys(0, layer.S, q.device).float()
        stored_values = layer.host.values(0, layer.S, q.device).float()
        ref, probs = full_attention(q, stored_keys, stored_values, scaling)
        top, top_valid = layer.last_selection  # (1, H, k) host positions
        attended = torch.zeros((1, H, layer.S), dtype=torch.bool, device=q.device)
        picks = torch.zeros((1, H, S0), dtype=torch.long, device=q.device)  # counts: a slot not valid adds 0
        picks.scatter_add_(2, top.to(q.device), top_valid.to(q.device).long())
        attended[:, :, :S0] = fixed[:, None, :].to(q.device) | (picks > 0)
        attended[:, :, S0:] = True  # the new token
        got = out[0, 0].float()  # (Hq, D)
        acc["rel_error"].append(float((got - ref).norm() / ref.norm().clamp(min=1e-30)))
        acc["tokens"].append(float(attended.sum(-1).float().mean()))
        acc["mass"].append(float((probs * attended[0, :, None, :]).sum(-1).mean()))
        estimate = seen.get("estimate")
        if estimate is not None:
            acc["est_share"].append(float(estimate.share.float().mean()))
    return acc


def full_attention(q, keys, values, scaling: float):
    """q (1, Hq, 1, D), keys, values (1, H, T, D) -> the output (Hq, D) of softmax(q K^T * scaling) V over all T
    tokens, query head h*G + g reading KV head h (PQLayer's GQA layout), and the weights (H, G, T)."""
    H, T, D = keys.shape[1:]
    qh = q[0, :, 0].view(H, -1, D)  # (H, G, D)
    probs = (qh @ keys[0].transpose(-1, -2) * scaling).softmax(-1)  # (H, G, T)
    return (probs @ values[0]).reshape(-1, D), probs


def _capture_estimate(layer) -> dict:
    """The step's MassEstimate, which the attention pops from method_state: read where select leaves it (this
    layer's select wrapped, nothing else changed). Plain PQCache makes none (est_share stays None)."""
    from pqcache.engine.mass import MASS_ESTIMATE

    seen, inner = {}, layer.select

    def select(q, scaling):
        out = inner(q, scaling)
        seen["estimate"] = layer.method_state.get(MASS_ESTIMATE)
        return out

    layer.select = select
    return seen


def _row(layer: int, method: str, budget, context: int, acc: dict) -> dict:
    means = {f: _mean(acc[f]) for f in FIELDS}
    steps = len(acc["rel_error"])
    return {"layer": layer, "method": method, "budget": budget, "context": context, **means, "steps": steps}


def _failed(layer: int, method: str, budget, exc: Exception) -> dict:
    return {"layer": layer, "method": method, "budget": budget, "error": f"{type(exc).__name__}: {exc}"}


def summarize(rows: list[dict]) -> list[dict]:
    """One row per (setting, budget): each measure's mean over the layers that have it; failed layers counted."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["method"], r["budget"]), []).append(r)
    out = []
    for (method, budget), group in groups.items():
        ok = [r for r in group if "error" not in r]
        means = {f: _mean([r[f] for r in ok if r.get(f) is not None]) for f in FIELDS}
        out.append({"method": method, "budget": budget, **means, "layers": len(ok), "failed": len(group) - len(ok)})
    return out


def _mean(xs: list[float]):
    """The mean to 4 significant digits (an error of full attention's rounding stays visible), None when empty."""
    return float(f"{sum(xs) / len(xs):.4g}") if xs else None
