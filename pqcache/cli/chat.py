"""`python -m pqcache chat --context-file F`: a conversation about a document in the terminal. The document is read
once; then each line of standard input is a question (follow-ups see the earlier turns), its answer streamed to
standard output with the top sources under it; an empty line or the end of input ends it. With --store DIR the
document is read back from the store when it is there, and the conversation is kept beside it after each answer;
--resume continues the last kept one. With --ray ADDRESS|local the document and the conversation live on a Ray Serve
replica, as the app's do with --ray. Plain stdin/stdout, so it can be scripted:
`printf 'What is the pass key?\\nAnd the day it was set?\\n' | python -m pqcache chat ...`.

It talks to the documents service (pqcache/serving/service.py) as the page does: the worker in this process, or the
cluster's client."""

from __future__ import annotations

import sys

from pqcache.cli.common import config_of, stderr
from pqcache.engine.errors import InputError

USER = "chat"  # the terminal's one user of the service
CHAT_APP = "pqcache-chat"  # its Serve application (an app.py --ray on the same cluster keeps its own)


def cmd_chat(args) -> int:
    from pqcache.serving.documents import read_document
    from pqcache.serving.settings import EngineSettings

    if args.resume and args.store is None:
        raise InputError("--resume continues a conversation kept in a document store: give --store DIR too")
    text = read_document(str(args.context_file), encoding=args.encoding)  # bad files: one line, exit 2
    settings = EngineSettings(args.method, config_of(args))
    service, close = _service(args)
    try:
        document = service.load(USER, args.context_file.name, text, settings)
        info = document.info
        how = "from the store, no prefill" if info["from"] == "store" else "prefilled"
        where = "" if args.ray is None else " on a Ray replica"
        stderr(f"[{args.method}] read {info['tokens']} tokens in {info['read_s']:.1f} s ({how}){where}")
        if args.resume:
            state = service.resume_conversation(USER, args.method)
            stderr(f"[resumed: {len(state['turns'])} earlier turns]" if state else "[no kept conversation: a new one]")
        stderr("ask (an empty line ends)")
        for line in sys.stdin:
            question = line.strip()
            if not question:
                break
            _answer(service, args, question)
    finally:
        close()
    return 0


def _answer(service, args, question: str):
    """One question asked in the conversation: the answer streamed, its top sources, the conversation's size."""
    printed = [0]

    def stream(answer):
        print(answer.text[printed[0] :], end="", flush=True)
        printed[0] = len(answer.text)

    try:
        answer = service.ask(USER, question, args.method, args.max_new_tokens, on_token=stream)
    except InputError as exc:  # a question past the context: said, and the chat goes on
        print(f"\n(error: {exc})", flush=True)
        return
    print(answer.text[printed[0] :], flush=True)
    for i, src in enumerate((answer.sources or [])[:3], 1):
        quote = " ".join(src["text"].split())
        print(f'  source {i} ({100 * src["share"]:.0f}%): "{quote}"', flush=True)
    state = service.conversation_state(USER)
    stderr(f"[turn {len(state['turns'])}: {state['tokens']:,} tokens in the conversation, {answer.seconds:.1f} s]")
    if answer.note:
        stderr(f"[{answer.note}]")


def _service(args):
    """The documents service `chat` talks to, and how to close it: a worker in this process, or (--ray) one replica
    on a Ray cluster, with the command's model, weights and store."""
    from pqcache.serving.server_settings import ServerSettings

    server = ServerSettings(
        model=args.model,
        dtype=args.dtype,
        decode_weights=args.decode_weights,
        kv_dtype=args.kv_dtype,
        max_cache_bytes=sys.maxsize,  # one user, one document: no cap but the machine's
        idle_s=None,
        store_dir=None if args.store is None else str(args.store),
    )
    if args.ray is None:
        from pqcache.serving.loading import load_model
        from pqcache.serving.worker import DocumentWorker

        model, tok = load_model(
            args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
        )
        pool = server.make_pool()
        service = DocumentWorker(model, tok, pool, server, server.open_store())
        return service, lambda: (service.end(USER), pool.close())

    import ray

    from pqcache.cluster import launch

    stderr(f"[starting a replica on the Ray cluster {args.ray!r}]")
    connected = ray.is_initialized()  # (a caller's own connection, as the tests', stays theirs)
    init = {"include_dashboard": False} if args.ray == "local" else {}  # a private cluster: no dashboard to serve
    launch.connect(args.ray, **init)
    service = launch.start_workers(1, server, app=CHAT_APP)

    def close():
        service.end(USER)
        launch.stop_workers(CHAT_APP)
        if not connected:
            ray.shutdown()

    return service, close
