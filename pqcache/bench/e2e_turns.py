"""`bench e2e`'s runners in turns: each in its own process as before (its peak memory its own), all of one length
alive at once, their decode steps taken a few at a time in alternation.

A runner's median step, timed alone, moved by 30% between two runs of the same code on a shared machine
(docs/benchmarks.md): the other tenants' load drifts over seconds to minutes, and runners measured a few minutes
apart met different loads. In turns, each round of TURN_TOKENS steps of every runner meets about the same load, so
the ratio of two runners' medians holds what they do, not when they ran. Prefills still run one at a time (the
others wait on their input), so they never share the machine. Protocol: e2e_runner.serve.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path

TURN_TOKENS = 8  # decode steps a runner takes in one turn
FAILURE_LINES = 6  # the last lines a failed runner printed, kept in its row


def failure(returncode: int, stdout: str, stderr: str) -> str:
    """How a runner's process ended, and the last lines it printed: "killed by SIGSEGV (signal 11); last output:
    ..." (a negative returncode is the signal that ended it)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "a signal"
        how = f"killed by {name} (signal {-returncode})"
    elif returncode > 0:
        how = f"exited with code {returncode}"
    else:
        how = "exited without printing its row"
    lines = [line for line in (stderr + "\n" + stdout).splitlines() if line.strip()][-FAILURE_LINES:]
    return how + ("; last output: " + " | ".join(lines) if lines else "; it printed nothing")


def spec_file(spec: dict) -> Path:
    """spec written to a temporary JSON file, the runner's argument (the caller deletes it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    return Path(f.name)


def runner_env() -> dict:
    """A runner's environment: this one's, its tokenizer's threads off (they would compete with the model's)."""
    return {**os.environ, "TOKENIZERS_PARALLELISM": "false"}


class Turn:
    """One runner's process, spoken to by lines of JSON (e2e_runner.py --turns)."""

    def __init__(self, command: tuple, spec: dict):
        self.spec_path = spec_file(spec)
        self.stderr = tempfile.TemporaryFile("w+")  # a file: a pipe nobody reads could fill and stop the runner
        self.printed: list[str] = []  # what it printed that was not a message (kept for a failure's report)
        self.proc = subprocess.Popen(
            [*command, str(self.spec_path), "--turns"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            env=runner_env(),
        )
        self.error: str | None = None

    def read(self) -> dict | None:
        """The runner's next message, or None when it ended without one (self.error then says how)."""
        for line in self.proc.stdout:
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if isinstance(message, dict):
                return message
            self.printed.append(line)
        self._ended()
        return None

    def ask(self, line: str) -> dict | None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._ended()
            return None
        return self.read()

    def _ended(self):
        code = self.proc.wait()
        self.stderr.seek(0)
        self.error = failure(code if code else 0, "".join(self.printed), self.stderr.read())
        self.close()

    def close(self):
        try:
            self.proc.wait(timeout=30)  # it ends after its row
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.stderr.close()
        self.spec_path.unlink(missing_ok=True)


def run_in_turns(command: tuple, specs: dict[str, dict], decode_tokens: int, progress=None) -> dict[str, dict]:
    """specs: runner -> its spec (one length) -> runner -> its row (e2e_runner's), or {"error": how it failed}.
    Each prefills alone, in order; then decode_tokens - 1 steps each, TURN_TOKENS at a time, who goes first
    rotating each round."""
    turns, rows = {}, {}
    for runner, spec in specs.items():
        if progress is not None:
            progress(f"{runner} at {len(spec['ids'])} tokens: prefill")
        turn = Turn(command, spec)
        if turn.read() is None:  # it did not get ready
            rows[runner] = {"error": turn.error}
        else:
            turns[runner] = turn
    try:
        left, round_ = decode_tokens - 1, 0
        while left > 0 and turns:
            take = min(TURN_TOKENS, left)
            names = list(turns)
            for runner in names[round_ % len(names) :] + names[: round_ % len(names)]:
                if turns[runner].ask(f"decode {take}") is None:
                    rows[runner] = {"error": turns.pop(runner).error}
            left, round_ = left - take, round_ + 1
        for runner, turn in turns.items():
            row = turn.ask("finish")
            rows[runner] = row if row is not None else {"error": turn.error}
    finally:
        for turn in turns.values():
            turn.close()
    return rows
