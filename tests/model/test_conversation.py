"""README's conversation example, run as written on the bundled model."""


def test_the_readme_conversation_runs_as_written_on_the_bundled_model(real_model, monkeypatch, capsys):
    """The README's conversation example, executed as written on the bundled model (loaded once per run): the
    follow-up repeats the first answer, the added document is answered from, and each printed line is what its
    comment says."""
    import re
    from pathlib import Path

    import pqcache

    root = Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", readme[readme.index("### Conversations") :], re.S).group(1)
    monkeypatch.setattr(pqcache, "load_model", lambda *a, **k: real_model)
    monkeypatch.chdir(root)
    exec(compile(code, "README.md", "exec"), {})
    printed = capsys.readouterr().out.splitlines()
    said = [c.split("#", 1)[1].strip() for c in code.splitlines() if c.startswith("print(") and "#" in c]
    assert len(printed) == len(said) == 4
    for line, comment in zip(printed, said):
        assert comment.startswith(f'"{line}"') or comment == line, (line, comment)
