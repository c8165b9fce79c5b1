"""`python -m pqcache chat --context-file F`: a conversation about a document in the terminal. The document is read
once; then each line of standard input is a question (follow-ups see the earlier turns), its answer streamed to
standard output with the top sources under it; an empty line or the end of input ends it. With --store DIR the
document is read back from the store when it is there, and the conversation is kept beside it after each answer;
--resume continues the last kept one. Plain stdin/stdout, so
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
    from pqcache.serving.store import DocumentStore
    from pqcache.serving.stored_conversations import keep, resume

    if args.resume and args.store is None:
        raise InputError("--resume continues a conversation kept in a document store: give --store DIR too")
    text = read_document(str(args.context_file), encoding=args.encoding)  # bad files: one line, exit 2
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
    )
    store = None if args.store is None else DocumentStore(args.store)
    session = DocumentSession(model, tok, config_of(args), method=args.method, store=store)
    info = session.load(text, progress=lambda fraction, step: None)
    how = "from the store, no prefill" if info["from"] == "store" else "prefilled"
    stderr(f"[{args.method}] read {info['tokens']} tokens in {info['read_s']:.1f} s ({how}); ask (an empty line ends)")
    resumed = resume(store, session, args.method) if args.resume else None
    talk = resumed or Conversation(session, args.method)
    if args.resume:
        stderr(f"[resumed: {len(talk.turns)} earlier turns]" if resumed else "[no kept conversation: a new one]")
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
            kept = keep(store, talk)
            stderr(f"[turn {len(talk.turns)}: {talk.n_tokens:,} tokens in the conversation, {answer.seconds:.1f} s]")
            if kept:
                stderr(f"[{kept}]")
    finally:
        talk.close()
        session.close()
    return 0
