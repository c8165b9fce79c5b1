"""`python -m pqcache chat --context-file F`: a conversation about a document in the terminal. The document is read
once; then each line of standard input is a question (follow-ups see the earlier turns), its answer streamed to
standard output with the top sources under it; an empty line or the end of input ends it. Plain stdin/stdout, so
it can be scripted: `printf 'What is the pass key?\\nAnd the day it was set?\\n' | python -m pqcache chat ...`."""

from __future__ import annotations

import sys

from pqcache.cli.common import config_of, stderr
from pqcache.engine.errors import InputError


def cmd_chat(args) -> int:
    from pqcache.serving.conversation import Conversation
    from pqcache.serving.documents import read_document
    from pqcache.serving.loading import load_model
    from pqcache.serving.session import DocumentSession

    text = read_document(str(args.context_file), encoding=args.encoding)  # bad files: one line, exit 2
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
    )
    session = DocumentSession(model, tok, config_of(args), method=args.method)
    info = session.load(text, progress=lambda fraction, step: None)
    stderr(f"[{args.method}] read {info['tokens']} tokens in {info['prefill_s']:.1f} s; ask (an empty line ends)")
    talk = Conversation(session, args.method)
    try:
        for line in sys.stdin:
            question = line.strip()
            if not question:
                break
            printed = [0]

            def stream(answer, printed=printed):
                print(answer.text[printed[0] :], end="", flush=True)
                printed[0] = len(answer.text)

            try:
                answer = talk.ask(question, max_new_tokens=args.max_new_tokens, on_token=stream)
            except InputError as exc:  # a question past the context: said, and the chat goes on
                print(f"\n(error: {exc})", flush=True)
                continue
            print(answer.text[printed[0] :], flush=True)
            for i, src in enumerate(answer.sources[:3], 1):
                quote = " ".join(src["text"].split())
                print(f'  source {i} ({100 * src["share"]:.0f}%): "{quote}"', flush=True)
            stderr(f"[turn {len(talk.turns)}: {talk.n_tokens:,} tokens in the conversation, {answer.seconds:.1f} s]")
    finally:
        talk.close()
        session.close()
    return 0
