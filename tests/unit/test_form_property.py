"""A property of the load form: any settings a person can type, with any document length from a few tokens to past
the model's context, either load and answer or are refused at load with one line in the page's own words; no draw
raises during a question; and whenever the selection covers every token, the answer is full attention's.

Both paths the project answers by: the document first (the app: DocumentWorker.load, then DocumentSession.ask on a
fork) and the question in the prompt (one prefill of the whole text: `generate` with a plain prompt). A tiny random
model and the whitespace tokenizer keep an example to a fraction of a second; CI runs a fixed sample of 300.
"""

import os

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pqcache import METHODS
from pqcache.engine.errors import PQCacheError
from pqcache.serving.generate import generate
from pqcache.serving.pool import SessionPool
from pqcache.serving.server_settings import ServerSettings
from pqcache.serving.settings import FORM_WORDS, LoadSettings
from pqcache.serving.worker import DocumentWorker
from tests.tiny import WordTokenizer, tiny_model

settings.register_profile(
    "form-ci", max_examples=300, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck)
)
settings.register_profile("form-explore", max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
PROFILE = "form-explore" if os.environ.get("HYPOTHESIS_PROFILE") == "explore" else "form-ci"

CONTEXT = 1024 // 2  # the tiny models' 1024 positions, less the room a session keeps for the answer
MAX_NEW = 3
QUESTION = "what is w3"
# methods whose split is the config's (the others keep their own rule: H2O's heavy hitters, StreamingLLM's four
# sinks, PyramidKV's per-layer budgets): for them "the selection covers every token" is read off config.split
CONFIG_SPLIT = {"pqcache", "oracle", "sparq", "snapkv", "infllm"}
CODE_NAMES = [name for name in FORM_WORDS if name.strip(": =")] + ["PQCacheConfig", "Traceback", "None or an int"]


VALID = dict(
    method=st.sampled_from(list(METHODS)),
    m=st.sampled_from([0, 0, 0, 1, 2, 4, 8, 16, 3]),  # 3 does not divide the head size: refused at load
    bits=st.sampled_from([0, 0, 1, 2, 4, 8]),
    budget=st.one_of(st.floats(0.005, 1.0), st.integers(1, 1500), st.just(1.0)),
    n_init=st.one_of(st.integers(0, 40), st.integers(400, 3000)),
    n_local=st.one_of(st.just(0), st.integers(1, 40), st.integers(400, 5000)),
    policy=st.sampled_from(["lfu", "lru"]),
    capacity=st.sampled_from([0, 64, 128, 256, 4096, 100]),
    too_long=st.sampled_from(["refuse", "cut the middle"]),
    mass=st.sampled_from([0, 0, 0, 0.5, 0.95, 1.0]),
    completion=st.booleans(),
)
WRONG = dict(  # what a person may type into one field
    method=st.just("nonsense"),
    m=st.sampled_from([-1, "x", 2.5, None]),
    bits=st.sampled_from([9, 20, -1]),
    budget=st.sampled_from([0, -1, 1.5, 2.5, "a lot", "", None, float("inf")]),
    n_init=st.sampled_from([-1, "four", 1.5]),
    n_local=st.sampled_from([-1, "x", 3.5]),
    policy=st.just("mru"),
    capacity=st.sampled_from([-128, "lots"]),
    mass=st.sampled_from([-0.1, 1.5, "most", None]),
)


@st.composite
def forms(draw):
    """The form as typed: every field valid, or (a quarter of the draws) one of them wrong."""
    values = {name: draw(strategy, label=name) for name, strategy in VALID.items()}
    if draw(st.integers(0, 3), label="one wrong field") == 0:
        name = draw(st.sampled_from(sorted(WRONG)), label="wrong field")
        values[name] = draw(WRONG[name], label=f"wrong {name}")
    return LoadSettings(**values)


@pytest.fixture(scope="module")
def models():
    return {arch: tiny_model(arch) for arch in ("llama", "gemma3")}


def document(n_words: int) -> str:
    return " ".join(f"w{(7 * i) % 53}" for i in range(n_words))


def covers(config, method: str, first: int, last: int) -> bool:
    """Every context length from first to last tokens has its whole self in the selection."""
    if method == "full":
        return True
    if method not in CONFIG_SPLIT or (config.mass or 1) < 1:  # a budget in mass may leave picks out
        return False
    return all(sum(config.split(n)) >= n for n in range(first, last + 1))


def one_line_in_form_words(message: str) -> bool:
    return "\n" not in message and message.strip() == message and not any(name in message for name in CODE_NAMES)


@settings(settings.get_profile(PROFILE))
@given(form=forms(), n_words=st.one_of(st.integers(1, 12), st.integers(13, 300), st.integers(480, 700)), data=st.data())
def test_every_form_setting_loads_and_answers_or_is_refused_in_the_forms_words(models, form, n_words, data):
    arch = data.draw(st.sampled_from(sorted(models)), label="arch")
    model, tok = models[arch], WordTokenizer()
    worker = DocumentWorker(model, tok, SessionPool(max_bytes=2**30, idle_s=None), ServerSettings(pq_timeout_s=60))
    text = document(n_words)
    try:
        session = worker.load("ann", "doc", text, form)
    except PQCacheError as exc:  # refused at load: one line, the form's words
        assert one_line_in_form_words(str(exc)), str(exc)
        event(f"refused: {type(exc).__name__}")
        return
    try:
        answer = session.ask(QUESTION, max_new_tokens=MAX_NEW)  # no draw raises here
        assert answer.done and 1 <= len(answer.tokens) <= MAX_NEW
        event("answered, document first")
        n_cached = session.n_tokens + int(session.prompt.question_ids(QUESTION).shape[1])
        if covers(session.config, form.method, session.n_tokens, n_cached + MAX_NEW):
            # the same document, loaded for full attention, answers the same tokens
            reference = DocumentWorker(
                model, tok, SessionPool(max_bytes=2**30, idle_s=None), ServerSettings(pq_timeout_s=60)
            )
            exact = reference.load("ann", "doc", text, LoadSettings(method="full", too_long=form.too_long))
            assert answer.tokens == exact.ask(QUESTION, max_new_tokens=MAX_NEW).tokens, (form, n_words)
            event("equal to full attention, document first")
            reference.pool.close()
        # the question in the prompt: one prefill of everything (within the context: generate has no length rule)
        if session.n_tokens + 8 < CONTEXT:
            prompt = f"{text} Question: {QUESTION} Answer:"
            got = generate(model, tok, prompt, method=form.method, config=session.config, max_new_tokens=MAX_NEW)
            n_prompt = len(tok(prompt).input_ids)
            if covers(session.config, form.method, n_prompt, n_prompt + MAX_NEW):
                exact = generate(model, tok, prompt, method="full", max_new_tokens=MAX_NEW)
                assert got.tokens == exact.tokens, (form, n_words)
                event("equal to full attention, question in the prompt")
    finally:
        worker.pool.close()
