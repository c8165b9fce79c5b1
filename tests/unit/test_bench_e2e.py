"""`bench e2e` when a runner's process dies: its row says how (the signal or exit code, the last lines it printed),
and the other runners and lengths still run and print."""

import sys
import textwrap

import pytest

from pqcache.bench import e2e

# A stand-in for pqcache.bench.e2e_runner: llama.cpp segfaults as the AMX build did, pqcache exits with an error (in
# turns, during its first decode turn), full prints a row as the real runner does.
FAKE_RUNNER = textwrap.dedent(
    """
    import json, os, signal, sys
    spec = json.load(open(sys.argv[1]))
    if spec["runner"] == "llama.cpp":
        print("llama_model_loader: loaded meta data", flush=True)
        print("ggml_cpu: first eval", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSEGV)
    if spec["runner"] == "pqcache":
        if "--turns" in sys.argv:  # in turns it dies in its first decode turn, after its prefill
            print(json.dumps({"ready": True, "prefill_tok_s": 1.0}), flush=True)
            sys.stdin.readline()
        print("Traceback (most recent call last):", file=sys.stderr)
        print("RuntimeError: out of memory", file=sys.stderr)
        sys.exit(3)
    n = len(spec["ids"])
    row = {"prefill_tok_s": 100.0 + n, "decode_ms": 20.0, "peak_rss_bytes": 2**28, "tokens": [1, 2, 3]}
    if "--turns" in sys.argv:  # e2e_runner.serve's protocol: ready, each turn's times, the row at "finish"
        print(json.dumps({"ready": True, "prefill_tok_s": 100.0 + n}), flush=True)
        for line in sys.stdin:
            if line.startswith("finish"):
                break
            print(json.dumps({"times": [20.0] * int(line.split()[1])}), flush=True)
    print(json.dumps(row), flush=True)
    """
)


@pytest.mark.parametrize("turns", [True, False], ids=["in turns", "alone"])
def test_a_crashing_runner_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys, turns):
    """In turns (every runner's process alive, decoding in alternation) and alone (one after the other)."""
    runner = tmp_path / "fake_runner.py"
    runner.write_text(FAKE_RUNNER)
    monkeypatch.setattr(e2e, "RUNNER_COMMAND", (sys.executable, str(runner)))
    monkeypatch.setattr(e2e, "llama_cpp_installed", lambda: True)
    messages = []
    rows = e2e.bench_e2e(
        seq_lens=[64, 128],
        decode_tokens=20,  # three turns of up to 8 steps
        gguf=str(tmp_path / "model.gguf"),
        turns=turns,
        progress=messages.append,
    )

    assert [(r["seq_len"], r["runner"]) for r in rows] == [(s, r) for s in (64, 128) for r in e2e.RUNNERS]
    by = {(r["seq_len"], r["runner"]): r for r in rows}
    for s in (64, 128):
        crashed, failed, ran = by[s, "llama.cpp"], by[s, "pqcache"], by[s, "full"]
        assert crashed["error"].startswith("killed by SIGSEGV (signal 11)")
        assert "ggml_cpu: first eval" in crashed["error"] and "loaded meta data" in crashed["error"]
        assert failed["error"].startswith("exited with code 3") and "out of memory" in failed["error"]
        assert crashed["prefill_tok_s"] is None and failed["decode_ms"] is None
        assert ran["prefill_tok_s"] == 100.0 + s and ran["decode_ms"] == 20.0 and "error" not in ran
        assert "prefill_vs_llama" not in ran  # no llama.cpp figures to compare with
    assert sum("failed: killed by SIGSEGV" in m for m in messages) == 2

    e2e.print_table(rows)
    out = capsys.readouterr().out
    assert out.count("killed by SIGSEGV (signal 11)") == 2 and out.count("exited with code 3") == 2
    assert "164.0" in out and "228.0" in out  # full's rows at both lengths


def test_failure_says_how_a_process_ended():
    assert e2e.failure(-11, "", "").startswith("killed by SIGSEGV (signal 11); it printed nothing")
    assert e2e.failure(-9, "a\n", "b\n") == "killed by SIGKILL (signal 9); last output: b | a"
    assert e2e.failure(0, "not json", "").startswith("exited without printing its row")
    many = "\n".join(f"line {i}" for i in range(20))
    assert e2e.failure(1, "", many).endswith("line 14 | line 15 | line 16 | line 17 | line 18 | line 19")


def test_a_pqcache_variant_runs_beside_the_plain_one(tmp_path, capsys):
    """`bench e2e --completion` (or a runner named pqcache/completion=true): the variant's row beside plain PQCache's,
    its decode time against PQCache's in the same run, its tokens against full attention's; a bad variant is one
    line and exit code 2, before any runner starts."""
    from types import SimpleNamespace

    from tests.tiny import tiny_chat_model

    model, tok = tiny_chat_model()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    runners = ("full", "pqcache", "pqcache/completion=true/token_budget=0.5")
    rows = e2e.bench_e2e(model=str(tmp_path), seq_lens=[300], runners=runners, decode_tokens=4, isolate=False)
    by = {r["runner"]: r for r in rows}
    assert set(by) == set(runners) and not any("error" in r for r in rows)
    variant, plain = by[runners[2]], by["pqcache"]
    assert variant["decode_vs_pqcache"] == round(variant["decode_ms"] / plain["decode_ms"], 2)
    assert "decode_vs_pqcache" not in plain and variant["tokens_as_full"] <= len(by["full"]["tokens"])
    assert "completion=true" in variant["settings"]
    e2e.print_table(rows)
    assert "dec/pq" in capsys.readouterr().out

    args = SimpleNamespace(runners="full,pqcache/completion=maybe", mass=None, completion=False)
    assert e2e.cli_e2e(args) == 2
    assert "completion" in capsys.readouterr().err
