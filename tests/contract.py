"""The documents service's contract, written once: tests/unit/test_documents_contract.py runs it against the worker
in this process, tests/cluster/test_documents_contract.py against Ray Serve replicas on a real local cluster. Both
pass the same assertions: load, ask, a follow-up answered within the conversation (token for token as the engine's
own Conversation answers it), add a document, new conversation, fork, Stop during a load and during an answer, bad
input, unload, a document read back from the store, and its conversation with it.

A module that imports these tests gives two fixtures: `service` (the implementation, each test a fresh user) and
`reference` ((model, tokenizer): the same weights in this process, for the engine's own answers)."""

import inspect
import itertools

import pytest

from pqcache import Cancelled, NoDocumentError, PQCacheError
from pqcache.serving.conversation import Conversation
from pqcache.serving.service import DocumentsService
from pqcache.serving.session import DocumentSession
from pqcache.serving.settings import LoadSettings

DOCUMENT = " ".join(f"w{i % 41}" for i in range(60))  # ~240 byte tokens: loads in a blink
SECOND = "The blue door opens with the code 4721. " * 4
LONG = " ".join(f"w{i % 97}" for i in range(1800))  # ~7000 tokens: seconds of prefill, time to press Stop
SETTINGS = LoadSettings(budget=0.5)
NEW_TOKENS = 6
_users = itertools.count()


@pytest.fixture
def user(service):
    name = f"user-{next(_users)}"
    yield name
    service.end(name)


def test_keeps_the_interface(service):
    """Every call of the documents interface (serving/service.py), taking at least its parameters, by name and in
    order, with the same defaults (an implementation may add optional parameters of its own after them)."""
    assert isinstance(service, DocumentsService)
    for name, declared in vars(DocumentsService).items():
        if name.startswith("_") or not callable(declared):
            continue
        wanted = list(inspect.signature(declared).parameters.values())[1:]  # without self
        given = list(inspect.signature(getattr(service, name)).parameters.values())
        assert [p.name for p in given[: len(wanted)]] == [p.name for p in wanted], name
        assert [p.default for p in given[: len(wanted)]] == [p.default for p in wanted], name
        assert all(p.default is not p.empty for p in given[len(wanted) :]), name


def load(service, user, text=DOCUMENT, settings=SETTINGS, **kw):
    return service.load(user, "doc.txt", text, settings, **kw)


def ask(service, user, question, **kw):
    return service.ask(user, question, "pqcache", NEW_TOKENS, **kw)


def engine_answers(reference, questions, added=None, document=DOCUMENT):
    """The engine's own conversation on the same document and settings: each answer's tokens (a None question: the
    `added` document read into the conversation there)."""
    model, tok = reference
    session = DocumentSession(model, tok, SETTINGS.to_config(), method="pqcache")
    session.load(document)
    talk = Conversation(session, "pqcache")
    try:
        answers = []
        for question in questions:
            if question is None:
                talk.add_document(added, "second.txt")
                continue
            answers.append(talk.ask(question, max_new_tokens=NEW_TOKENS).tokens)
        return answers
    finally:
        talk.close()
        session.close()


def test_load_then_ask(service, user):
    document = load(service, user)
    assert document.n_tokens > 100 and service.session(user).n_tokens == document.n_tokens
    answer = ask(service, user, "What is w3?")
    assert answer.ended and len(answer.tokens) >= 1 and answer.note == ""
    assert service.conversation_state(user)["asked"] == [1]


def test_a_follow_up_is_answered_within_the_conversation(service, user, reference):
    load(service, user)
    first = ask(service, user, "What is w3?")
    follow_up = ask(service, user, "And the word after it?")
    state = service.conversation_state(user)
    assert state["asked"] == [1, 2] and [t["text"] for t in state["turns"]] == ["What is w3?", "And the word after it?"]
    assert state["tokens"] > service.session(user).n_tokens + len(first.tokens) + len(follow_up.tokens)
    assert [first.tokens, follow_up.tokens] == engine_answers(reference, ["What is w3?", "And the word after it?"])


def test_a_document_added_to_the_conversation_is_read_once_and_asked_about(service, user, reference):
    load(service, user)
    ask(service, user, "What is w3?")
    n = service.add_document(user, "second.txt", SECOND, "pqcache")
    assert n > 40 and service.conversation_state(user)["added"] == ["second.txt"]
    answer = ask(service, user, "Which code opens the blue door?")
    expected = engine_answers(reference, ["What is w3?", None, "Which code opens the blue door?"], SECOND)
    assert answer.tokens == expected[-1]


def test_a_new_conversation_goes_back_to_the_document(service, user):
    load(service, user)
    alone = ask(service, user, "What is w3?")
    ask(service, user, "And the word after it?")
    service.new_conversation(user)
    assert service.conversation_state(user) is None
    again = ask(service, user, "What is w3?")
    assert again.tokens == alone.tokens and service.conversation_state(user)["asked"] == [1]


def test_a_fork_goes_its_own_way(service, user):
    load(service, user)
    ask(service, user, "What is w3?")
    forked = service.fork_conversation(user, into="branch")
    assert forked["asked"] == [1] and forked["tokens"] == service.conversation_state(user)["tokens"]
    service.ask(user, "And the word after it?", "pqcache", NEW_TOKENS, conversation="branch")
    assert service.conversation_state(user, "branch")["asked"] == [1, 2]
    assert service.conversation_state(user)["asked"] == [1]  # the original kept its one turn


def test_another_method_starts_a_new_conversation_and_says_so(service, user):
    load(service, user)
    ask(service, user, "What is w3?")
    answer = service.ask(user, "What is w3?", "streaming", NEW_TOKENS)
    assert "new conversation" in answer.note and service.conversation_state(user)["asked"] == [1]


def test_another_document_starts_a_new_conversation_and_says_so(service, user, reference):
    load(service, user)
    ask(service, user, "What is w3?")
    service.load(user, "second.txt", SECOND, SETTINGS)
    answer = ask(service, user, "Which code opens the blue door?")
    assert "A new document, **second.txt**: a new conversation starts" in answer.note and "doc.txt" in answer.note
    assert service.conversation_state(user)["asked"] == [1]  # the earlier document's turn is not in it
    assert answer.tokens == engine_answers(reference, ["Which code opens the blue door?"], document=SECOND)[0]


def test_stop_during_a_load_keeps_the_document_before_it(service, user):
    load(service, user)
    stop = service.entry(user).stop
    stop.clear()

    def progress(fraction, step):
        if "prefill" in step:
            stop.set()

    with pytest.raises(Cancelled):
        load(service, user, LONG, progress=progress, stop=stop)
    stop.clear()
    assert service.session(user).n_tokens < 1000  # the first document, still there
    assert ask(service, user, "What is w3?").tokens


def test_stop_while_a_document_is_added_keeps_the_conversation_as_it_was(service, user, reference):
    """Adding streams a load's progress; a Stop ends it at the next layer and the conversation is as before it: the
    follow-up is answered token for token as without the attempt."""
    load(service, user)
    ask(service, user, "What is w3?")
    stop, seen = service.entry(user).stop, []
    stop.clear()

    def progress(fraction, step):
        seen.append((fraction, step))
        if "prefill" in step:
            stop.set()

    with pytest.raises(Cancelled):
        service.add_document(user, "long.txt", LONG, "pqcache", stop=stop, progress=progress)
    stop.clear()
    assert seen and all(0 <= f <= 1 for f, _ in seen)
    state = service.conversation_state(user)
    assert state["added"] == [] and state["asked"] == [1]
    follow_up = ask(service, user, "And the word after it?")
    assert follow_up.tokens == engine_answers(reference, ["What is w3?", "And the word after it?"])[1]
    seen.clear()
    service.add_document(user, "second.txt", SECOND, "pqcache", progress=lambda f, s: seen.append((f, s)))
    assert [f for f, _ in seen] == sorted(f for f, _ in seen) and any("layer" in s for _, s in seen)


def test_stop_during_an_answer_ends_it_and_the_next_question_works(service, user):
    load(service, user)
    stop = service.entry(user).stop
    stop.clear()
    answer = service.ask(user, "What is w3?", "pqcache", 200, stop=stop, on_token=lambda a: stop.set())
    stop.clear()
    assert answer.stopped and len(answer.tokens) < 200
    assert ask(service, user, "What is w3?").tokens


def test_bad_input_is_said_and_the_conversation_is_kept(service, user):
    load(service, user)
    ask(service, user, "What is w3?")
    with pytest.raises(PQCacheError, match="the question is empty"):
        ask(service, user, "   ")
    with pytest.raises(PQCacheError, match="budget"):
        load(service, user, settings=LoadSettings(budget=-1))
    with pytest.raises(PQCacheError, match="empty"):
        service.add_document(user, "blank.txt", "   ", "pqcache")
    assert service.conversation_state(user)["asked"] == [1]
    assert ask(service, user, "And the word after it?").tokens


def test_unload_ends_the_document_and_its_conversation(service, user):
    load(service, user)
    ask(service, user, "What is w3?")
    service.free(user)
    assert service.session(user) is None and service.conversation_state(user) is None
    with pytest.raises(NoDocumentError):
        ask(service, user, "What is w3?")


def test_a_document_loaded_again_is_read_from_the_store(service, user):
    text = f"{DOCUMENT} {user}"  # a text no other test loaded
    first = load(service, user, text)
    again = load(service, user, text)
    assert first.info["from"] == "prefill" and again.info["from"] == "store"
    assert ask(service, user, "What is w3?").tokens


def test_a_document_reopened_from_the_store_brings_its_conversation_back(service, user, reference):
    """As after a restart: the document is read back from the store, its kept conversation replayed, and the
    follow-up is answered token for token as the engine's own conversation answers it."""
    text = f"{DOCUMENT} {user}"  # a text no other test loaded
    load(service, user, text)  # prefilled, and kept in the store
    ask(service, user, "What is w3?")  # the conversation kept beside it, turn by turn
    service.free(user)  # nothing of either left in memory
    assert load(service, user, text).info["from"] == "store"
    state = service.resume_conversation(user, "pqcache")
    assert state["asked"] == [1] and state["turns"][0]["text"] == "What is w3?"
    follow_up = ask(service, user, "And the word after it?")
    expected = engine_answers(reference, ["What is w3?", "And the word after it?"], document=text)
    assert follow_up.tokens == expected[-1]
    assert service.resume_conversation(user, "streaming") is None  # none kept for another method


def test_two_users_keep_their_own_conversations(service, user):
    other = f"{user}-other"
    try:
        load(service, user)
        load(service, other)
        ask(service, user, "What is w3?")
        ask(service, user, "And the word after it?")
        ask(service, other, "What is w3?")
        assert service.conversation_state(user)["asked"] == [1, 2]
        assert service.conversation_state(other)["asked"] == [1]
    finally:
        service.end(other)


def test_the_teaching_run_happens_where_the_model_is(service, user):
    """The Teaching tab's run through the service: one prefill of its document beside the user's (which stays),
    each method's row, the walkthrough's data and the spotlight's token texts, as plain data the page needs no
    model for; the model line and device from where the model is."""
    from pqcache.serving.service import TeachingCase

    load(service, user)
    ask(service, user, "What is w3?")
    text = " ".join([DOCUMENT, "the code to open the blue door is 4721 .", DOCUMENT])
    case = TeachingCase(text, "the code to open the blue door", "What is the code?", "4721")
    seen = []
    lesson = service.teach(user, case, ["pqcache", "streaming"], 0.3, lambda f, words: seen.append(f))
    assert [row[0] for row in lesson["rows"]] == ["pqcache", "streaming"] and lesson["walk"]["k"] > 0
    assert lesson["fact_pos"] is not None and lesson["n_tokens"] > lesson["fact_pos"]
    first, texts = lesson["spotlight"]
    assert "".join(texts[lesson["fact_pos"] - first :]).lstrip().startswith("the code")  # the fact's own tokens
    assert seen and seen == sorted(seen) and seen[-1] <= 1
    # the picture of what the selection missed: each full-attention layer, each setting at the run's budget and below
    missed = lesson["fidelity"]
    assert {(r["method"], r["budget"]) for r in missed} == {
        (m, b) for m in ("oracle", "pqcache", "pqcache+completion") for b in (0.3, 0.02, 0.005)
    }
    assert all(r.get("error") is None and 0 <= r["rel_error"] and 0 < r["mass"] <= 1 + 1e-6 for r in missed)
    assert service.conversation_state(user)["asked"] == [1]  # the user's document and conversation stay
    assert service.about()["model"] and service.about()["device"] == "cpu"
