"""The one prompt builder: the plain frame for base models, the chat template when the tokenizer has one, and the
document / question split a session caches."""

import pytest
import torch

from pqcache import PQCacheConfig
from pqcache.serving.generate import generate
from pqcache.serving.prompt import END_OF_ANSWER, INSTRUCTION, PromptBuilder, build_prompt
from pqcache.serving.session import DocumentSession
from tests.tiny import WordTokenizer, byte_tokenizer, tiny_chat_model

DOC = "The lighthouse keeper's dog is named Biscuit. The storm lasted three days.\n"
QUESTIONS = ("What is the name of the lighthouse keeper's dog?", "How long did the storm last?")
PLAIN, CHAT = byte_tokenizer(), tiny_chat_model()[1]


def test_a_base_model_gets_the_document_question_answer_frame():
    prompt = build_prompt(PLAIN, DOC, QUESTIONS[0])
    assert not prompt.chat
    assert prompt.text == (
        "The lighthouse keeper's dog is named Biscuit. The storm lasted three days.\n\n"
        "Answer the question from the text above. The answer is in the text.\n"
        "Question: What is the name of the lighthouse keeper's dog?\n"
        "Answer:"
    )
    doc_ids, q_ids = prompt.encode(PLAIN)
    assert doc_ids[0, 0] == PLAIN.bos_token_id and PLAIN.bos_token_id not in q_ids[0].tolist()
    assert PLAIN.decode(torch.cat([doc_ids, q_ids], 1)[0], skip_special_tokens=True) == prompt.text
    assert prompt.stop_rule(PLAIN).stop_texts == END_OF_ANSWER
    assert build_prompt(PLAIN, "", " Who are you? ").text == "Question: Who are you?\nAnswer:"  # no document


def test_a_chat_template_is_used_when_the_tokenizer_has_one():
    prompt = build_prompt(CHAT, DOC, QUESTIONS[0])
    content = f"{DOC.strip()}\n\n{INSTRUCTION}\nQuestion: {QUESTIONS[0]}"
    expected = CHAT.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.chat and prompt.text == expected
    doc_ids, q_ids = prompt.encode(CHAT)
    whole = CHAT.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, return_dict=False
    )
    assert torch.cat([doc_ids, q_ids], 1)[0].tolist() == whole  # one BOS, from the template
    assert prompt.stop_rule(CHAT).stop_texts == ()  # the end of turn is EOS
    bare = build_prompt(CHAT, "", "Who are you?")
    assert bare.text == CHAT.apply_chat_template(
        [{"role": "user", "content": "Who are you?"}], tokenize=False, add_generation_prompt=True
    )


class RefusingTemplate:
    """A tokenizer whose chat template cannot render a lone user turn."""

    chat_template = "{{ raise_exception('a system message first') }}"

    def __call__(self, *args, **kwargs):
        return WordTokenizer()(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("a system message first")


def test_a_template_that_cannot_render_the_turn_falls_back_to_the_plain_frame():
    assert not PromptBuilder(RefusingTemplate()).chat
    assert build_prompt(RefusingTemplate(), "doc", "q?").text.endswith("Question: q?\nAnswer:")


@pytest.mark.parametrize("tok", [PLAIN, CHAT, WordTokenizer()], ids=["plain", "chat", "words"])
def test_the_document_part_does_not_depend_on_the_question(tok):
    builder = PromptBuilder(tok)
    first, second = (builder.build(DOC, q) for q in QUESTIONS)
    assert first.document == second.document and first.question != second.question
    assert torch.equal(first.encode(tok)[0], second.encode(tok)[0])
    assert torch.equal(builder.document_ids(DOC), first.encode(tok)[0])
    assert torch.equal(builder.question_ids(QUESTIONS[1]), second.encode(tok)[1])
    assert QUESTIONS[0] in first.question  # the question stays in the user's words


def test_a_session_caches_the_document_part_once_and_asks_each_question_after_it():
    model, tok = tiny_chat_model()
    lengths = []
    model.model.register_forward_pre_hook(lambda m, a, kw: lengths.append(kw["input_ids"].shape[1]), with_kwargs=True)
    session = DocumentSession(model, tok, PQCacheConfig(token_budget=0.5, n_init=4, bits=4, kmeans_iters=3))
    session.load(DOC * 6)
    builder = PromptBuilder(tok)
    assert session.doc_ids == builder.document_ids(DOC * 6)[0].tolist()
    for question in QUESTIONS:
        answer = session.ask(question, method="full", max_new_tokens=3)
        assert answer.ended in ("eos", "repetition", "max_new_tokens") and answer.done
    n_doc = len(session.doc_ids)
    assert lengths.count(n_doc) == 1  # the document was prefilled once
    chunks = [n for n in lengths if 1 < n < n_doc]
    assert chunks == [builder.question_ids(q).shape[1] for q in QUESTIONS]
    session.close()


def test_generate_reads_a_prompt_and_says_why_the_answer_ended():
    model, tok = tiny_chat_model()
    prompt = build_prompt(tok, DOC, QUESTIONS[0])
    out = generate(model, tok, prompt, method="full", max_new_tokens=4)
    assert out.stats["prompt_tokens"] == len(tok(prompt.text, add_special_tokens=False).input_ids)
    assert out.ended in ("eos", "repetition", "max_new_tokens") and out.stats["ended"] == out.ended
