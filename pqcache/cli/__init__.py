"""The command line: flags in args.py, dispatch in main.py, handlers by subcommand; for pqcache/__main__ and app.py."""
