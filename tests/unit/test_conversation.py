"""Conversations over a cached document (pqcache/serving/conversation.py): each turn continues the cache holding the
earlier ones; at a budget that covers every token a conversation is full attention over its text; an added document
gets its own codebook and is searched; forks, reset, every method, a conversation past the model's context."""

import pytest
import torch
from transformers import DynamicCache

from pqcache import METHODS, PQCacheConfig
from pqcache.serving.conversation import Conversation, ConversationFullError
from pqcache.serving.session import DocumentSession
from tests.tiny import WordTokenizer, byte_tokenizer, tiny_chat_model, tiny_model

TEXT = " ".join(f"w{(5 * i) % 43}" for i in range(300))
SECOND = " ".join(f"v{(3 * i) % 29}" for i in range(300))
CONFIG = dict(n_init=4, bits=4, kmeans_iters=3)


def loaded(model, tok=None, method="pqcache", text=TEXT, **config):
    session = DocumentSession(model, tok or WordTokenizer(), PQCacheConfig(**{**CONFIG, **config}), method=method)
    session.load(text)
    return session


def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens after one prefill of `ids` with full attention (transformers' own cache)."""
    cache, out = DynamicCache(config=model.config), []
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[:, -1]
        for _ in range(n):
            out.append(int(logits.argmax(-1)))
            logits = model(input_ids=torch.tensor([[out[-1]]]), cache=cache, use_cache=True).logits[:, -1]
    return out


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_at_a_full_budget_a_conversation_is_one_prefill_of_its_text(arch):
    """Turn 2 answers as full attention over the document, turn 1's question and answer, and turn 2's question."""
    model = tiny_model(arch)
    session = loaded(model, token_budget=1.0)
    doc_ids = session.doc_ids
    talk = Conversation(session, "pqcache")
    first = talk.ask("what is w3", max_new_tokens=4)
    after_first = list(talk.ids)
    second = talk.ask("and w7", max_new_tokens=4)
    n_question = len(talk.ids) - len(after_first) - len(second.tokens) + 1  # the answer's last token is not read
    assert greedy(model, doc_ids + after_first[: len(after_first) - 3], 4) == first.tokens
    assert greedy(model, doc_ids + talk.ids[: len(after_first) + n_question], 4) == second.tokens
    assert talk.n_tokens == session.n_tokens + len(talk.ids) == talk.cache.get_seq_length()
    assert [t.text for t in talk.turns] == ["what is w3", "and w7"]
    alone = session.ask("and w7", max_new_tokens=4)  # a question of its own reads the document alone
    assert greedy(model, doc_ids + session.prompt.question_ids("and w7")[0].tolist(), 4) == alone.tokens


def test_an_added_document_gets_its_own_codebook_and_is_searched():
    model = tiny_model("llama")
    session = loaded(model, token_budget=0.1)
    talk = Conversation(session, "pqcache")
    talk.ask("what is w3", max_new_tokens=2)
    start = talk.n_tokens
    n = talk.add_document(SECOND, "second.txt")
    assert n >= session.config.turn_min_tokens and [t.kind for t in talk.turns] == ["question", "document"]
    layers = talk.cache.pq_layers
    assert all(layer.method_state["index"].stats["turn_segments"] == 1 for layer in layers)  # K-Means of its own
    assert all(
        len(layer.method_state["index"].segments) == 2 and layer.method_state["index"].segments[1][0] == start
        for layer in layers
    )
    talk.ask("what is v7", max_new_tokens=3)
    top, valid = layers[0].last_selection
    picked = top[valid]
    assert ((picked >= start) & (picked < start + n)).any()  # the search reaches into the added document
    assert (picked < session.n_tokens).any()  # and into the first


def test_an_added_documents_tokens_map_to_its_text_and_its_sources_are_found_there():
    """Each token of an added document has its place in that document's text; an answer's sources are passages of
    the document they name (the added one, or the first), their shares of all the text's attention; a replayed
    conversation finds the same places."""
    tok = byte_tokenizer()  # a character a token, each with its place in the text
    model = tiny_model("llama", vocab_size=len(tok), bos_token_id=1, eos_token_id=2, max_position_embeddings=2048)
    session = loaded(model, tok, token_budget=0.1, text=TEXT[:400])
    talk = Conversation(session, "pqcache")
    talk.ask("what is w3", max_new_tokens=2)
    second = SECOND[:400]
    talk.add_document(second, "second.txt")
    added = talk.added[0]
    assert added.start == session.n_tokens + len(talk.ids) - len(added.spans)
    assert "".join(second[lo:hi] for lo, hi in added.spans if hi > lo) == second.strip()
    answer = talk.ask("what is v7", max_new_tokens=3)
    assert answer.sources and sum(s["share"] for s in answer.sources) <= 1 + 1e-6
    for src in answer.sources:
        text = added.text if src.get("document") == "second.txt" else session.doc_text
        assert text[src["start"] : src["end"]] == src["text"] and ("document" not in src or src["document"])
    replayed = Conversation.replay(session, talk.record())
    assert [(a.name, a.start, a.spans) for a in replayed.added] == [(a.name, a.start, a.spans) for a in talk.added]


def test_the_long_output_rebuild_keeps_working_in_a_conversation():
    """rebuild_every re-clusters every token so far (document, earlier turns, an added document) into one codebook
    while the conversation goes on; at a full budget the answers stay full attention's."""
    model = tiny_model("llama")
    session = loaded(model, token_budget=1.0, rebuild_every=3)
    talk = Conversation(session, "pqcache")
    talk.ask("what is w3", max_new_tokens=4)
    talk.add_document(SECOND, "second.txt")
    talk.ask("what is v7", max_new_tokens=4)
    talk.cache.wait()
    index = talk.cache.pq_layers[0].method_state["index"]
    assert index.stats["rebuilds"] >= 2 and len(index.segments) == 1  # the added document's segment folded in
    assert index.segments[0][0] == 0
    before = len(talk.ids)
    question = talk.question_ids("and w7")[0].tolist()
    third = talk.ask("and w7", max_new_tokens=4)
    assert talk.ids[before : before + len(question)] == question
    assert greedy(model, session.doc_ids + talk.ids[: before + len(question)], 4) == third.tokens


def test_fork_branches_and_reset_goes_back_to_the_document():
    model = tiny_model("llama")
    session = loaded(model, token_budget=0.2)
    talk = Conversation(session, "pqcache")
    talk.ask("what is w3", max_new_tokens=3)
    branch = talk.fork()
    a, b = talk.ask("and w9", max_new_tokens=3), branch.ask("and w9", max_new_tokens=3)
    assert a.tokens == b.tokens and talk.ids == branch.ids  # the same past, the same answer
    branch.ask("and w11", max_new_tokens=2)
    assert len(branch.turns) == 3 and len(talk.turns) == 2  # each goes its own way
    talk.reset()
    assert talk.turns == [] and talk.n_tokens == session.n_tokens == talk.cache.get_seq_length()
    fresh = Conversation(session, "pqcache")
    assert talk.ask("what is w3", max_new_tokens=3).tokens == fresh.ask("what is w3", max_new_tokens=3).tokens


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_holds_a_conversation(method):
    """Three turns and an added document on each method (SnapKV and PyramidKV keep what they picked at the
    prefill; H2O goes on accumulating), and another method is refused in it."""
    model = tiny_model("gemma3")
    session = loaded(model, method=method, token_budget=0.2)
    talk = Conversation(session, method)
    for question in ("what is w3", "and w7"):
        assert 1 <= len(talk.ask(question, max_new_tokens=3).tokens) <= 3
    talk.add_document(SECOND, "second.txt")
    assert talk.ask("what is v7", max_new_tokens=3).done
    other = "full" if method != "full" else "pqcache"
    with pytest.raises(ValueError, match=f"this conversation runs {method}; start a new one for {other}"):
        talk.ask("and w5", method=other)


def test_a_conversation_past_the_context_says_so_and_keeps_working():
    model = tiny_model("llama")  # 1024 positions: the 300-token document and two more of 300 fit, not three
    session = loaded(model)
    talk = Conversation(session, "pqcache")
    talk.add_document(SECOND, "two.txt")
    talk.add_document(SECOND, "three.txt")
    held = talk.n_tokens
    with pytest.raises(ConversationFullError, match="start a new conversation") as info:
        talk.add_document(SECOND, "four.txt")
    assert f"this conversation holds {held:,} tokens" in str(info.value) and "at most 1,024" in str(info.value)
    assert talk.n_tokens == held  # nothing was read
    assert talk.ask("what is v7", max_new_tokens=2).done
    with pytest.raises(ConversationFullError):
        talk.ask("what is v7 " * 200, max_new_tokens=2)


def test_a_chat_template_frames_each_turn_as_the_template_does():
    """A chat model's follow-up is its template's second user turn; an added document opens a user turn that the
    next question closes."""
    model, tok = tiny_chat_model()
    session = loaded(model, tok, text="The pass key is 68422. " * 8)
    prompt = session.prompt
    switch, tail = prompt._next
    turns = [{"role": "user", "content": "D"}, {"role": "assistant", "content": "A"}, {"role": "user", "content": "Q"}]
    rendered = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("A" + prompt.follow_up("Q"))
    assert prompt.follow_up("Q", after_document=True).endswith("Question: Q" + tail)
    talk = Conversation(session, "pqcache")
    talk.ask("what is w3", max_new_tokens=2)
    talk.add_document("one more text", "more.txt")
    assert talk.ask("and w4", max_new_tokens=2).done


def test_cli_chat_reads_the_document_once_and_answers_each_line(tmp_path, capsys, monkeypatch):
    """`python -m pqcache chat`, driven through standard input: one answer a line, sources under each, the turns
    counted on stderr; the empty line ends it; a bad file is one line and exit status 2."""
    import io
    import sys

    from pqcache.cli.main import main

    model, tok = tiny_chat_model()
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    doc = tmp_path / "notes.txt"
    doc.write_text("Notes from the meeting.\nThe secret code for the blue door is 4721.\n", encoding="utf-8")
    lines = "What is the code?\nAnd which door?\n\nnever asked\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    args = ["chat", "--model", str(tmp_path / "model"), "--context-file", str(doc), "--max-new-tokens", "3"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "[turn 1: " in err and "[turn 2: " in err and "[turn 3" not in err, err
    assert out.count("source 1 (") == 2, out  # the two answers, each with its sources
    assert "read " in err and "tokens in" in err
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 4)
    bad = ["chat", "--model", str(tmp_path / "model"), "--context-file", str(tmp_path / "bin.txt")]
    assert main(bad) == 2
    assert "error: bin.txt looks like a binary file" in capsys.readouterr().err
