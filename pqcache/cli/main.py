"""python -m pqcache {generate,chat,bench,eval,datasets,calibrate,loadtest} ...: parse (args.py), dispatch to the
subcommand's handler, and turn a bad input into one line on stderr and exit status 2."""

from __future__ import annotations

import sys

from pqcache.cli.args import build_parser
from pqcache.engine.errors import PQCacheError
from pqcache.serving.loading import ModelNotFoundError


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        if args.command == "generate":
            from pqcache.cli.generate import cmd_generate

            return cmd_generate(args)
        if args.command == "chat":
            from pqcache.cli.chat import cmd_chat

            return cmd_chat(args)
        if args.command in ("eval", "datasets"):
            from pqcache.cli.eval import cmd_datasets, cmd_eval

            return cmd_eval(args) if args.command == "eval" else cmd_datasets(args)
        if args.command == "loadtest":
            from pqcache.bench import loadtest

            return loadtest.main(args)
        from pqcache.cli.bench import cmd_bench, cmd_calibrate

        return cmd_calibrate(args) if args.command == "calibrate" else cmd_bench(args)
    except (PQCacheError, ModelNotFoundError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
