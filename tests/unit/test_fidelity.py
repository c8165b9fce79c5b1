"""`eval fidelity` (issue 64) on a tiny random model: each setting's attention output against full attention's over
the same stored tokens, per layer and budget; its command line and its figure."""

import json
import math

import pytest

from pqcache.serving import fidelity
from pqcache.serving.fidelity import SETTINGS, fidelity_study, summarize
from tests.tiny import tiny_chat_model

TEXT = "".join(chr(97 + (i * 7) % 26) + (" " if i % 5 == 0 else "") for i in range(420))
BUDGETS = (1.0, 0.05)


@pytest.fixture(scope="module")
def model_tok():
    return tiny_chat_model()


@pytest.fixture(scope="module")
def rows(model_tok):
    model, tok = model_tok
    return fidelity_study(model, tok, TEXT, budgets=BUDGETS, n_queries=3, iters=5)


def _by(rows) -> dict:
    return {(r["layer"], r["method"], r["budget"]): r for r in rows}


def test_a_row_for_every_layer_setting_and_budget_none_failed(rows):
    by = _by(rows)
    layers = sorted({r["layer"] for r in rows})
    assert layers == [0, 1, 2]  # the tiny Llama's three layers, all full attention
    want = {(i, m, b) for i in layers for m in SETTINGS for b in ((None,) if m == "full" else BUDGETS)}
    assert set(by) == want and len(rows) == len(want)
    for r in rows:
        assert "error" not in r, r
        assert math.isfinite(r["rel_error"]) and 0 <= r["rel_error"] <= 2, r
        assert r["steps"] == 3 and 0 < r["mass"] <= 1 + 1e-6 and r["tokens"] >= 1


def test_full_attention_through_the_layer_is_the_torch_reference(rows):
    for r in rows:
        if r["method"] == "full":
            assert r["rel_error"] < 1e-5 and r["mass"] == pytest.approx(1.0, abs=1e-5)
            assert r["tokens"] == r["context"] + 2  # every stored token and the new one (mean over the 3 steps)


def test_a_budget_of_every_token_is_full_attention(rows):
    """Selection covering every token: Oracle, PQCache and completion are full attention; a budget in mass cuts
    the picks to its target, which its estimate then reaches, with at most the tokens the ceiling allows."""
    by = _by(rows)
    for (layer, method, budget), r in by.items():
        if budget != 1.0:
            continue
        full = by[(layer, "full", None)]
        mass = SETTINGS[method][1].get("mass")
        if mass is None:
            assert r["rel_error"] < 1e-5 and r["tokens"] == full["tokens"], r
        else:
            assert r["est_share"] >= mass - 1e-6 and r["tokens"] <= full["tokens"], r


def test_at_a_small_budget_completion_is_closer_and_oracle_holds_the_most_mass(rows):
    by = _by(rows)
    layers = sorted({r["layer"] for r in rows})
    for layer in layers:
        plain, oracle = by[(layer, "pqcache", 0.05)], by[(layer, "oracle", 0.05)]
        assert plain["tokens"] < by[(layer, "full", None)]["tokens"] / 5  # a small budget indeed
        assert oracle["mass"] >= plain["mass"] - 1e-6  # the exact top-k holds the most mass at the same k
        assert by[(layer, "pqcache+completion", 0.05)]["tokens"] == plain["tokens"]  # the same picks, completed
        for name in ("pqcache+mass0.9", "pqcache+mass0.95"):
            assert by[(layer, name, 0.05)]["tokens"] <= plain["tokens"]  # the token budget is the ceiling
    done = sum(by[(i, "pqcache+completion", 0.05)]["rel_error"] for i in layers)
    assert done < sum(by[(i, "pqcache", 0.05)]["rel_error"] for i in layers)
    summary = {(s["method"], s["budget"]): s for s in summarize(rows)}
    assert summary[("pqcache", 0.05)]["layers"] == 3 and summary[("pqcache", 0.05)]["failed"] == 0
    assert summary[("pqcache+completion", 0.05)]["rel_error"] < summary[("pqcache", 0.05)]["rel_error"]


def test_a_setting_that_fails_is_marked_and_the_study_goes_on(model_tok, monkeypatch):
    model, tok = model_tok
    replay = fidelity._replay

    def broken(parent, method, *args):
        if method == "oracle":
            raise RuntimeError("boom")
        return replay(parent, method, *args)

    monkeypatch.setattr(fidelity, "_replay", broken)
    rows = fidelity_study(model, tok, TEXT[:200], budgets=(0.1,), methods=("full", "oracle"), n_queries=1, iters=2)
    assert [r["error"] for r in rows if r["method"] == "oracle"] == ["RuntimeError: boom"] * 3
    assert all("error" not in r and r["rel_error"] < 1e-5 for r in rows if r["method"] == "full")
    assert {(s["method"], s["failed"]) for s in summarize(rows)} == {("full", 0), ("oracle", 3)}
    with pytest.raises(ValueError, match="unknown fidelity setting"):
        fidelity_study(model, tok, TEXT, methods=("pqcache+magic",))


def test_the_figure_has_a_line_per_setting_on_a_log_axis(rows):
    from viz.studies import fidelity_curve

    fig = fidelity_curve(rows)
    assert {t.name for t in fig.data} == set(SETTINGS) and fig.layout.xaxis.type == "log"
    plain = next(t for t in fig.data if t.name == "pqcache")
    assert list(plain.x) == sorted(plain.x) and len(plain.x) == len(BUDGETS)
    assert not fidelity_curve([{"method": "pqcache", "budget": 0.1, "error": "boom"}]).data


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model_tok):
    """The tiny model and its tokenizer as a local folder (`--model PATH`)."""
    path = tmp_path_factory.mktemp("fidelity-model")
    model, tok = model_tok
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_the_command_line_prints_the_summary_and_writes_the_rows(model_dir, tmp_path, capsys):
    from pqcache.cli.main import main

    doc, out = tmp_path / "doc.txt", tmp_path / "fidelity.json"
    doc.write_text(TEXT, encoding="utf-8")
    flags = ["--model", str(model_dir), "--device", "cpu", "--context-file", str(doc), "--context-tokens", "300"]
    settings = "full,pqcache,pqcache+completion"
    code = main(
        ["eval", "fidelity", *flags, "--budgets", "0.1", "--n-queries", "2", "--methods", settings, "--out", str(out)]
    )
    printed, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out.read_text(encoding="utf-8"))
    assert {(r["method"], r["budget"]) for r in result["rows"]} == {
        ("full", None),
        ("pqcache", 0.1),
        ("pqcache+completion", 0.1),
    }
    assert len(result["rows"]) == 9 and all(r["steps"] == 2 for r in result["rows"])
    assert [(s["method"], s["layers"]) for s in result["summary"]] == [(m, 3) for m in settings.split(",")]
    assert "rel_error" in printed and "pqcache+completion" in printed
    code = main(["eval", "fidelity", *flags, "--methods", "pqcache+magic"])
    assert code == 2 and "unknown fidelity setting(s) pqcache+magic" in capsys.readouterr().err
