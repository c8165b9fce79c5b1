"""SCBench-style shared-context sets made here, offline (`python -m pqcache datasets scbench`): SCBench's synthetic
tasks, each a context of about `n_tokens` tokens asked about in `turns` turns, and the project's real-document
questions as conversations (one per licence text). Questions are in plain words, as people type them; the layout is
SCBench's (pqcache/eval/scbench.py reads it).

  kv             a JSON object of random keys and values; each turn asks for one key's value
  passkey        pass keys of differently named doors hidden in the essays; each turn asks for one
  vt             variable-assignment chains in noise; each turn asks which variables hold one chain's value
  prefix_suffix  a list of random strings; each turn asks for the one with a given start and end
"""

from __future__ import annotations

import json
import random
import string

from pqcache.eval.datasets import RULER_NOISE, haystack
from pqcache.eval.realdocs import realdocs

TASKS = ("kv", "passkey", "vt", "prefix_suffix")
DOORS = ("red", "blue", "green", "yellow", "black", "white", "silver", "golden", "wooden", "iron")


def _hex(rng, n: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(n))


def _fill(tokenizer, n_tokens: int, make) -> list:
    """As many items `make(i)` (strings) as fit in n_tokens tokens."""
    items, total, i = [], 0, 0
    while True:
        item = make(i)
        n = len(tokenizer(item, add_special_tokens=False).input_ids)
        if total + n > n_tokens:
            return items
        items.append(item)
        total, i = total + n, i + 1


def kv(tokenizer, n_tokens: int, turns: int, rng) -> dict:
    pairs = _fill(tokenizer, n_tokens - 40, lambda i: f'"{_hex(rng, 8)}": "{_hex(rng, 8)}", ')
    chosen = rng.sample(range(len(pairs)), turns)
    entries = [p.rstrip(", ").split(": ") for p in pairs]
    context = "JSON data:\n{" + ", ".join(f"{k}: {v}" for k, v in entries) + "}"
    multi = [
        {"input": f"What is the value of the key {entries[i][0]} in the JSON data?", "answer": entries[i][1].strip('"')}
        for i in chosen
    ]
    return {"context": context, "multi_turns": multi}


def passkey(tokenizer, n_tokens: int, turns: int, rng) -> dict:
    doors = rng.sample(DOORS, turns)
    keys = {door: str(rng.randint(10_000, 99_999)) for door in doors}
    sents = haystack(tokenizer, n_tokens - 20 * turns)
    for door in doors:
        sents.insert(rng.randint(0, len(sents)), f"The pass key for the {door} door is {keys[door]}.")
    multi = [{"input": f"What is the pass key for the {door} door?", "answer": keys[door]} for door in doors]
    return {"context": " ".join(sents), "multi_turns": multi}


def vt(tokenizer, n_tokens: int, turns: int, rng) -> dict:
    sents = haystack(tokenizer, n_tokens - 60 * turns, filler=RULER_NOISE)
    multi = []
    for _ in range(turns):
        value = str(rng.randint(10_000, 99_999))
        names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(3)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 3)]
        for pos, stmt in zip(sorted(rng.sample(range(len(sents) + 1), len(chain))), chain):
            sents.insert(pos, stmt)
        multi.append({"input": f"Which variables are assigned the value {value}?", "answer": names})
    return {"context": " ".join(sents), "multi_turns": multi}


def prefix_suffix(tokenizer, n_tokens: int, turns: int, rng) -> dict:
    letters = string.ascii_lowercase
    words = _fill(tokenizer, n_tokens - 40, lambda i: "".join(rng.choice(letters) for _ in range(12)) + "\n")
    words = [w.strip() for w in words]
    chosen = rng.sample(words, turns)
    multi = [
        {"input": f"Which string in the list starts with {w[:3]} and ends with {w[-3:]}?", "answer": w} for w in chosen
    ]
    return {"context": "A list of strings:\n" + "\n".join(words), "multi_turns": multi}


GENERATORS = {"kv": kv, "passkey": passkey, "vt": vt, "prefix_suffix": prefix_suffix}


def synthetic(tokenizer, tasks, lengths, n: int, turns: int, seed: int = 0) -> list[dict]:
    """n cases of each task at each length, `turns` turns each."""
    cases = []
    for task in tasks:
        if task not in GENERATORS:
            raise ValueError(f"unknown SCBench task {task!r}; choose from {', '.join(TASKS)}")
        for length in lengths:
            for i in range(n):
                rng = random.Random(f"{seed}-{task}-{length}-{i}")
                case = GENERATORS[task](tokenizer, length, turns, rng)
                cases.append({"id": f"{task}-{length}-{i}", "task": task, "length": length, **case})
    return cases


def realdoc_conversations() -> list[dict]:
    """The real-document questions (assets/realdocs) as one conversation per document, in their order."""
    by_doc: dict[str, dict] = {}
    for case in realdocs():
        conv = by_doc.setdefault(
            case["document"],
            {"id": case["document"], "task": "realdocs", "context": case["context"], "multi_turns": []},
        )
        groups = case["answers"]
        conv["multi_turns"].append({"input": case["question"], "answer": groups[0] if len(groups) == 1 else groups})
    return list(by_doc.values())


def write(cases: list[dict], path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for case in cases:
            f.write(json.dumps(case, ensure_ascii=False) + "\n")
