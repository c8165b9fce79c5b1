"""An answer's sources: the attention each document token received, added by the full-attention layers from the
weights their steps computed (every step path: the general step, the one-row step in torch and in C), equal to full
attention's exact weights when the budget covers every token; the passages cut from it; the character ranges of the
tokens; and what the page draws of them."""

import re
from html import unescape

import pytest
import torch

from pqcache import PQCache, PQCacheConfig
from pqcache.engine.kernels import Kernels
from pqcache.engine.layer import onerow
from pqcache.engine.sources import AttentionTally
from pqcache.serving.generate import decode_n_tokens, prefill
from pqcache.serving.prompt import PromptBuilder
from pqcache.serving.sources import MAX_CHARS, highlights, passages, segments
from tests.tiny import byte_tokenizer, tiny_chat_model, tiny_model

SMALL = dict(n_init=4, kmeans_iters=5, bits=4)


def _tally(model, ids, method: str, cfg: PQCacheConfig, n_doc: int, steps: int = 6, by_value=True) -> AttentionTally:
    """The document ids[:, :n_doc] prefilled, the rest as a question chunk, then `steps` greedy steps, tallied."""
    with torch.no_grad():
        base = PQCache(model, cfg, method="pqcache", keep_queries=True)
        prefill(model, ids[:, :n_doc], base)
        cache = base.fork(method)
        tally = cache.tally_sources(AttentionTally(n_doc, by_value=by_value))
        logits = prefill(model, ids[:, n_doc:], cache)
        decode_n_tokens(model, logits, cache, steps)
    return tally


@pytest.mark.parametrize("path", ["general", "one-row torch", "one-row C"])
def test_at_a_full_budget_pqcache_tallies_full_attentions_exact_weights(arch, path, monkeypatch):
    if path == "general":
        monkeypatch.setattr(onerow, "ready", lambda layer, query: False)
    model = tiny_model(arch)
    ids = torch.randint(1, 96, (1, 170), generator=torch.Generator().manual_seed(3))
    cfg = PQCacheConfig(token_budget=1.0, kernels=Kernels(native_attention=path != "one-row torch"), **SMALL)
    full = _tally(model, ids, "full", cfg, n_doc=160)
    pq = _tally(model, ids, "pqcache", cfg, n_doc=160)
    forwards = 1 + (6 - 1)  # the question chunk, then a step for each answer token but the last
    assert full.steps == pq.steps == forwards * sum(t == "full_attention" for t in _layer_types(model))
    torch.testing.assert_close(pq.received, full.received, atol=1e-5, rtol=1e-4)
    assert float(full.received.sum()) > 0 and int(pq.missed.sum()) == 0


def test_each_steps_weights_sum_to_its_query_heads():
    """Every query head's softmax sums to 1: a tally of one step's weights alone (not weighed by the values) that
    attended only to document tokens adds up to the number of query heads, on every path (what falls on the
    question and answer tokens is not counted)."""
    model = tiny_model("llama")
    ids = torch.randint(1, 96, (1, 161), generator=torch.Generator().manual_seed(4))
    for native in (True, False):
        cfg = PQCacheConfig(token_budget=0.3, kernels=Kernels(native_attention=native), **SMALL)
        tally = _tally(model, ids, "pqcache", cfg, n_doc=160, steps=1, by_value=False)
        heads = model.config.num_attention_heads
        layers = tally.steps
        assert 0.5 * heads * layers < float(tally.received.sum()) <= heads * layers + 1e-4


def test_the_weights_are_weighed_by_each_heads_value_norms():
    """A token's share is its attention times the norm of its value in that layer and head: a token that draws
    attention with a zero value adds nothing; a layer whose values were not read adds its weights alone."""
    tally = AttentionTally(3)
    values = torch.zeros(2, 3, 2)  # (H_kv, S_doc, D) with norms [[1, 2, 0], [3, 0, 1]]
    values[0, 0, 0], values[0, 1, 1], values[1, 0, 0], values[1, 2, 1] = 1.0, 2.0, 3.0, 1.0
    tally.read_values(0, values)
    tally.add(torch.tensor([[0, 1, 2], [0, 1, -1]]), torch.tensor([[0.5, 0.25, 0.25], [1.0, 0.5, 0.7]]), 0)
    torch.testing.assert_close(tally.received, torch.tensor([0.5 * 1 + 1.0 * 3, 0.25 * 2, 0.0], dtype=torch.float64))
    tally.add(torch.tensor([[2]]), torch.tensor([[0.75]]), layer_idx=1)
    assert float(tally.received[2]) == 0.75
    plain = AttentionTally(3, by_value=False)
    plain.read_values(0, values)
    plain.add(torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.25]]), 0)
    assert plain.received.tolist() == [0.5, 0.25, 0.0]


def test_a_smaller_budget_tallies_only_what_it_attended():
    model = tiny_model("qwen2")
    ids = torch.randint(1, 96, (1, 330), generator=torch.Generator().manual_seed(5))
    cfg = PQCacheConfig(token_budget=0.1, chunk_attention="selected", **SMALL)  # the question chunk selects too
    streaming = _tally(model, ids, "streaming", cfg, n_doc=320, steps=4)
    middle = streaming.received[SMALL["n_init"] : 320 - 40]  # neither sinks nor the recent window
    assert float(middle[: len(middle) // 2].abs().sum()) == 0.0  # streaming never reads the middle: no source there


def _layer_types(model):
    return getattr(model.config, "layer_types", None) or ["full_attention"] * model.config.num_hidden_layers


# ---- passages ----------------------------------------------------------------------------------------------------
TEXT = "Intro line.\nThe pass key is 68422. Remember it. 68422 is the pass key.\nA long line " + "x " * 200 + "\nEnd."


def test_segments_are_lines_and_sentences_of_at_most_max_chars():
    cuts = segments(TEXT)
    assert TEXT[cuts[0][0] : cuts[0][1]] == "Intro line."
    assert [TEXT[a:b] for a, b in cuts[1:4]] == ["The pass key is 68422.", "Remember it.", "68422 is the pass key."]
    assert all(b - a <= MAX_CHARS and not TEXT[a].isspace() and not TEXT[b - 1].isspace() for a, b in cuts)
    assert "".join(TEXT[a:b] for a, b in cuts).replace(" ", "") == TEXT.replace(" ", "").replace("\n", "")


def test_passages_rank_segments_by_their_attention_and_merge_neighbours():
    tok = byte_tokenizer()
    spans = PromptBuilder(tok).document_spans(TEXT)
    key = TEXT.index("68422")
    received = torch.zeros(len(spans), dtype=torch.float64)
    received[0] = 100.0  # BOS: an attention sink, no one's source
    for i, (lo, _) in enumerate(spans):
        if key <= lo < key + 5:
            received[i] = 3.0  # the key's digits
        elif TEXT.index("Remember") <= lo < TEXT.index("Remember") + 8:
            received[i] = 1.0
        elif TEXT.index("End.") <= lo:
            received[i] = 0.5
    found = passages(TEXT, spans, received)
    assert found[0].text == "The pass key is 68422. Remember it."  # two neighbours merged, within MAX_CHARS
    assert found[0].share == pytest.approx((15 + 8) / (15 + 8 + 2)) and found[1].text == "End."
    assert [f.share for f in found] == sorted((f.share for f in found), reverse=True)
    assert all(TEXT[f.start : f.end] == f.text for f in found)
    assert passages(TEXT, spans, torch.zeros(len(spans))) == []


def test_document_spans_point_into_the_users_text():
    tok = byte_tokenizer()
    text = "  \n Notes: the code is 4721.\n"
    spans = PromptBuilder(tok).document_spans(text)
    ids = PromptBuilder(tok).document_ids(text)[0]
    assert len(spans) == len(ids) and spans[0] == (0, 0)  # BOS
    assert "".join(text[a:b] for a, b in spans) == text.strip()
    _, chat_tok = tiny_chat_model()
    chat = PromptBuilder(chat_tok)
    spans = chat.document_spans(text)
    assert len(spans) == chat.document_ids(text).shape[1]
    assert "".join(text[a:b] for a, b in spans) == text.strip()  # the template's head is no one's text


def test_highlights_mark_the_most_attended_and_the_missed_tokens():
    spans = [(0, 0), (0, 3), (4, 9), (10, 12)]
    tally = AttentionTally(4)
    tally.add(torch.tensor([0, 1, 2, 3]), torch.tensor([5.0, 1.0, 2.0, 0.0]))
    tally.add_missed(torch.tensor([3, 3, 1]))
    attended, missed = highlights(spans, tally, most=2)
    assert attended == [[0, 3, 0.5], [4, 9, 1.0]] and missed == [[0, 3], [10, 12]]


# ---- on the page ---------------------------------------------------------------------------------------------------
def test_the_document_view_outlines_the_passage_and_escapes_the_text():
    from studio.sources import chat_quotes, choices, document_view

    text = "<b>Intro</b>. The pass key is 68422. Bye."
    answer = {
        "sources": [{"start": 14, "end": 36, "text": text[14:36], "share": 0.6}],
        "attended": [[14, 17, 1.0], [30, 36, 0.5]],
        "missed": [[0, 3]],
    }
    view = document_view(text, answer, 0, show_missed=False)
    assert "&lt;b&gt;Intro&lt;/b&gt;" in view and "<b>Intro" not in view
    assert view.count("src-passage") >= 2 and "missed'" not in view
    assert "class='missed'" in document_view(text, answer, 0, show_missed=True)
    assert "Click a source" in document_view(text, answer, None)
    assert chat_quotes(answer["sources"]) == "> \u201cThe pass key is 68422.\u201d (60% of the attention)"
    assert choices(answer["sources"]) == ["1. (60%) The pass key is 68422."]


def test_a_quoted_source_reads_as_its_text_once_rendered():
    """Markdown and HTML in a quoted passage come out as the passage's own characters, escaped once: a URL in angle
    brackets keeps no visible backslash (the chat turns the URL into a link, and a backslash before ">" stayed)."""
    from markdown_it import MarkdownIt

    from studio.sources import chat_quotes

    for text in ("See <https://json.org> and *this* [x](y) #tag a|b C:\\path &copy; R&D", "<b>bold</b> `code` _u_"):
        markdown = chat_quotes([{"text": text, "share": 0.5}])
        html = MarkdownIt("commonmark").render(markdown)
        shown = re.sub(r"<[^>]+>", "", html)  # the text a reader sees (the tags are the quote's own)
        assert unescape(shown).strip() == f"\u201c{text}\u201d (50% of the attention)", html
        # the chat's renderer links a bare URL (GFM's extended autolinks, which CommonMark has not): no backslash
        # may follow one, where it would not be read as an escape
        assert not re.search(r"https?://\S*\\", markdown), markdown


def test_passages_across_documents_name_the_added_one_and_share_all_the_attention():
    """The loaded document and one added to the conversation: the passages that got the most attention, wherever
    they are, each share of the attention all their text got; a passage of the added document names it."""
    from pqcache.serving.sources import passages_in

    first, added = "Alpha one.\nAlpha two.\n", "Zip one.\nZip two.\n"
    per_char = lambda text: [(i, i + 1) for i in range(len(text))]  # noqa: E731 - a token a character
    got_first = torch.tensor([1.0 if i < 10 else 0.0 for i in range(len(first))])  # "Alpha one." : 10
    got_added = torch.tensor([3.0 if 9 <= i < 17 else 0.0 for i in range(len(added))])  # "Zip two." : 24
    found = passages_in([(None, first, per_char(first), got_first), ("zip.txt", added, per_char(added), got_added)])
    assert [(s["text"], s.get("document"), s["share"]) for s in found] == [
        ("Zip two.", "zip.txt", round(24 / 34, 4)),
        ("Alpha one.", None, round(10 / 34, 4)),
    ]
    alone = passages_in([(None, first, per_char(first), got_first)])
    assert [(s["text"], s["share"]) for s in alone] == [("Alpha one.", 1.0)] and "document" not in alone[0]
