"""The bundled Gemma 3 270M: PQCache at 1/5 of the tokens answers a passkey question like full attention."""

import pytest
import torch
from transformers import DynamicCache

from pqcache import PQCache, PQCacheConfig, load_model
from pqcache.eval.passkey import passkey_prompt


@pytest.mark.parametrize("key,depth", [("68422", 0.4), ("31907", 0.8)])
def test_passkey_at_one_fifth_budget_matches_full(real_model, key, depth):
    model, tok = real_model
    ids = tok(passkey_prompt(key, n_filler=40, depth=depth), return_tensors="pt").input_ids
    assert 900 <= ids.shape[1] <= 1200  # ~1K tokens
    with torch.no_grad():
        full = model.generate(ids, max_new_tokens=7, do_sample=False, cache=DynamicCache(config=model.config))
        cache = PQCache(model, PQCacheConfig(token_budget=0.2))
        out = model.generate(ids, max_new_tokens=7, do_sample=False, cache=cache)
    full_text = tok.decode(full[0, ids.shape[1] :])
    pq_text = tok.decode(out[0, ids.shape[1] :])
    assert key in full_text
    assert key in pq_text
    assert out[0, ids.shape[1] : ids.shape[1] + 6].tolist() == full[0, ids.shape[1] : ids.shape[1] + 6].tolist()
    # PQ sits on Gemma 3's full-attention layers only (every 6th), sliding layers keep their window.
    assert [layer.layer_idx for layer in cache.pq_layers] == [5, 11, 17]
    layer = cache.pq_layers[0]
    n_init, n_topk, n_local = cache.pq_config.split(ids.shape[1])
    assert layer.last_selection[1].sum() <= n_topk + 2  # the budget really was 1/5


def test_load_model_from_local_folder(real_model, tmp_path):
    """Any local transformers folder loads: a tiny Llama saved to disk."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pqcache.serving.loading import default_model_dir

    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=262144,
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    ).save_pretrained(tmp_path)
    real_model[1].save_pretrained(tmp_path)  # any tokenizer will do
    model, tok = load_model(str(tmp_path), device="cpu")
    assert type(model).__name__ == "LlamaForCausalLM"
    assert (default_model_dir() / "model.safetensors").exists()


def test_a_question_in_plain_words_is_answered_and_the_answer_ends(real_model):
    """The prompt builder's frame: "What is the pass key?" (no answer cue) on the bundled sample document, with
    full attention and with PQCache at the app's defaults; each answer stops at its end, not at max_new_tokens."""
    from pathlib import Path

    from pqcache.serving.session import DocumentSession
    from pqcache.serving.settings import LoadSettings

    model, tok = real_model
    text = (Path(__file__).resolve().parents[2] / "assets" / "passkey_1k.txt").read_text(encoding="utf-8")
    session = DocumentSession(model, tok, LoadSettings().to_config(), method="pqcache")
    session.load(text)
    try:
        for method in ("full", "pqcache"):
            answer = session.ask("What is the pass key?", method=method, max_new_tokens=24)
            assert "68422" in answer.text, (method, answer.text)
            assert answer.ended == "end_of_answer" and len(answer.tokens) < 24, (method, answer.text)
    finally:
        session.close()


def test_the_bundled_tokenizer_is_its_auto_class_in_less_memory(real_model, tmp_path):
    """load_model gives a bundled model (named, or its folder's path as bench e2e's runners pass it) the
    PreTrainedTokenizerFast its tokenizer.json describes, not GemmaTokenizer's second copy of the vocabulary: the
    same ids, special tokens and chat template as AutoTokenizer's class; any other folder gets AutoTokenizer's."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from pqcache.serving.loading import _is_bundled, default_model_dir, smollm2_model_dir

    tok = real_model[1]
    assert type(tok) is PreTrainedTokenizerFast
    assert _is_bundled(default_model_dir()) and _is_bundled(smollm2_model_dir())
    assert _is_bundled(default_model_dir() / ".." / default_model_dir().name) and not _is_bundled(tmp_path)
    auto = AutoTokenizer.from_pretrained(str(default_model_dir()))
    assert type(auto) is not PreTrainedTokenizerFast
    text = "<start_of_turn>user\nWhat is the default bufsize of tarfile.open()? Ünïcödé 🙂\n\n  tabs\t<end_of_turn>"
    assert tok(text).input_ids == auto(text).input_ids
    assert tok.decode(tok(text).input_ids) == auto.decode(auto(text).input_ids)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    assert tok.chat_template == auto.chat_template  # the base model has none: questions are framed as plain text
