"""The answer metrics of LongBench and RULER, each scoring one prediction against one reference (0..1).

LongBench's (THUDM/LongBench `metrics.py`, the v1 scorer): QA F1 over normalized words (English) or jieba words
(Chinese), ROUGE-L F, classification against `all_classes`, passage retrieval ("Paragraph N" / "段落N"), passage
count and code edit similarity. They are rewritten here rule for rule, LongBench's quirks included (each says
where). Two use maintained packages instead of LongBench's:

- ROUGE-L: LongBench calls the `rouge` package (`Rouge().get_scores(...)["rouge-l"]["f"]`), here `rouge-score`'s
  `RougeScorer(["rougeL"])` F-measure. They can differ: `rouge` splits the texts into sentences at every "." and
  takes the summary-level union LCS, counts each distinct word once (its `exclusive` n-gram sets), keeps case and
  punctuation attached to words; `rouge-score` takes one LCS over all tokens, counts repeated words, lowercases and
  drops everything but [a-z0-9] (for Chinese the jieba words are split on spaces as they are, see below). Figures
  of summaries (gov_report, qmsum, multi_news, samsum, dureader, vcsum) are comparable, not digit for digit.
- code similarity: LongBench calls fuzzywuzzy's `fuzz.ratio`, here rapidfuzz's (maintained, the same normalized
  Indel similarity as fuzzywuzzy with python-Levenshtein), rounded to a whole percent as fuzzywuzzy rounds it.
  fuzzywuzzy without python-Levenshtein falls back to difflib's SequenceMatcher, whose ratio can differ slightly.

RULER's (NVIDIA/RULER `scripts/eval/synthetic/constants.py`): string_match_all (the share of the references found
in the prediction, case-insensitive) and string_match_part (1 if any is found).
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from functools import cache

# LongBench's normalize_zh_answer: Chinese punctuation, removed with the ASCII one
CN_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［"
    "＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔"
    "〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…"
    "‧﹏."
)
_PUNCT, _ZH_PUNCT = set(string.punctuation), set(string.punctuation + CN_PUNCTUATION)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (LongBench, SQuAD's rule)."""
    s = "".join(ch for ch in s.lower() if ch not in _PUNCT)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation and every whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ZH_PUNCT).split())


@cache
def _jieba():
    import jieba

    jieba.setLogLevel(logging.WARNING)  # it logs its dictionary loading at INFO
    return jieba


def jieba_words(text: str) -> list[str]:
    """jieba's precise mode (cut_all=False), as LongBench cuts."""
    return list(_jieba().cut(text, cut_all=False))


def f1_score(prediction: list, ground_truth: list) -> float:
    """Token-multiset F1 of two token lists."""
    same = sum((Counter(prediction) & Counter(ground_truth)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_) -> float:
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **_) -> float:
    def words(text):
        return [w for w in (normalize_zh_answer(t) for t in jieba_words(text)) if w]

    return f1_score(words(prediction), words(ground_truth))


class _SpaceTokenizer:
    """rouge-score tokenizer for text already cut into words: split on whitespace, keep every character (its
    default tokenizer would drop the Chinese ones)."""

    def tokenize(self, text):
        return text.split()


@cache
def _scorer(spaces: bool):
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], tokenizer=_SpaceTokenizer() if spaces else None)


def rouge_score(prediction: str, ground_truth: str, _spaces: bool = False, **_) -> float:
    """ROUGE-L F of the prediction against the reference (0 when either has no token, where LongBench's `rouge`
    raises and LongBench returns 0)."""
    return float(_scorer(_spaces).score(ground_truth, prediction)["rougeL"].fmeasure)


def rouge_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """ROUGE-L F of the jieba words joined by spaces (LongBench's rouge_zh_score)."""
    return rouge_score(" ".join(jieba_words(prediction)), " ".join(jieba_words(ground_truth)), _spaces=True)


def classification_score(prediction: str, ground_truth: str, all_classes=(), **_) -> float:
    """1 / (classes named) when the right class is among the class names found in the prediction, else 0.

    LongBench's rule, kept as written: the names found are scanned once and a name that is a part of the right
    class (but not it) is removed during the scan, so the name after a removed one is not looked at; and its
    fallback for no name found (difflib's closest class) never runs (its guard `em_match_list != 0` is always
    true), so no name found scores 0."""
    matched = [c for c in all_classes or () if c in prediction]
    i = 0
    while i < len(matched):  # `for term in matched: ... matched.remove(term)`, written out
        term = matched[i]
        if term in ground_truth and term != ground_truth:
            matched.remove(term)
        i += 1
    return 1.0 / len(matched) if ground_truth in matched else 0.0


def _share_of_numbers(prediction: str, right: str) -> float:
    """The share of the numbers in the prediction that are `right` (0 without numbers)."""
    numbers = re.findall(r"\d+", prediction)
    return sum(n == str(right) for n in numbers) / len(numbers) if numbers else 0.0


def count_score(prediction: str, ground_truth: str, **_) -> float:
    return _share_of_numbers(prediction, ground_truth)


def retrieval_score(prediction: str, ground_truth: str, **_) -> float:
    """The reference is "Paragraph N"; the share of the prediction's numbers that are N."""
    return _share_of_numbers(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **_) -> float:
    """The reference is "段落N"; the share of the prediction's numbers that are N."""
    return _share_of_numbers(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def code_sim_score(prediction: str, ground_truth: str, **_) -> float:
    """Edit similarity of the first line of code in the prediction to the reference line: the first line (after
    leading newlines) with no "`", "#" or "//" anywhere in it (LongBench's test), "" when none."""
    from rapidfuzz import fuzz

    lines = prediction.lstrip("\n").split("\n")
    line = next((x for x in lines if "`" not in x and "#" not in x and "//" not in x), "")
    return round(fuzz.ratio(line, ground_truth)) / 100


def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER: the share of the references contained in the prediction, case-insensitive (0 without references,
    where RULER would divide by zero)."""
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references) if references else 0.0


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER: 1 when any reference is contained in the prediction, case-insensitive (0 without references)."""
    pred = prediction.lower()
    return float(any(r.lower() in pred for r in references))
