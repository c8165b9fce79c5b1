"""`python -m pqcache eval` (cases, or `eval recall`) and `datasets` (generated and bundled case sets):
the runners of pqcache/eval/, a summary table or --json."""

from __future__ import annotations

import json
import sys

from pqcache.cli.common import config_of, stderr, table

EVAL_MAX_NEW = 24  # answer tokens at most, unless --max-new-tokens (scbench: each task's own length)


def cmd_eval(args) -> int:
    from pqcache.engine.methods import METHODS
    from pqcache.eval import evaluate
    from pqcache.serving.loading import load_model

    if args.mode is None and args.cases is None:
        raise ValueError("give --cases FILE.jsonl (or `eval recall`, `eval fidelity`)")
    if args.mode == "fidelity":
        return _fidelity(args)
    methods = [m.strip() for m in (args.methods or "full,pqcache").split(",") if m.strip()]
    unknown = [m for m in methods if m.split("/")[0] not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    scbench = args.format == "scbench"
    if scbench:
        from pqcache.eval import scbench as sc

        cases = sc.load_cases(args.cases) if args.mode is None else None
        if args.scbench_mode == sc.ADDED and cases is not None and len(cases) < 2:
            raise ValueError(
                f"--scbench-mode {sc.ADDED} adds each case's context to a conversation over the "
                "previous case's: give at least two cases"
            )
    else:
        cases = evaluate.load_cases(args.cases, args.format) if args.mode is None else None
    config = config_of(args)
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
    )
    if args.mode == "recall":
        from pqcache.eval.datasets import essays_text

        text = tok.decode(tok(essays_text()).input_ids[1 : args.context_tokens])
        from pqcache.eval.recall import recall_study

        rows = recall_study(
            model,
            tok,
            text,
            ms=args.ms,
            bits_list=args.bits_list,
            reranks=args.reranks,
            margins=args.margins,
            opqs=args.opq_list,
            budgets=args.budgets or (0.1,),
        )
        print(json.dumps({"rows": rows}) if args.json else table(rows))
        return 0
    from tqdm import tqdm

    rows = []
    store = None
    if args.store is not None:  # off by default, so that figures stay comparable
        from pqcache.serving.store import DocumentStore

        store = DocumentStore(args.store)
    out = open(args.out, "w", encoding="utf-8") if args.out else None
    cut = args.too_long == "cut"
    try:
        for i, case in enumerate(tqdm(cases, desc="cases", file=sys.stderr)):

            def answered(i=i, case=case):
                if scbench:  # a row per turn (--max-new-tokens: the task's own length unless given)
                    first = cases[i - 1] if args.scbench_mode == sc.ADDED else None  # added to the previous case
                    return sc.run_case(
                        model,
                        tok,
                        case,
                        methods,
                        config,
                        args.scbench_mode,
                        args.max_new_tokens,
                        first=first,
                        store=store,
                        truncate="middle" if cut else "refuse",
                    )
                n_new = args.max_new_tokens or EVAL_MAX_NEW
                return evaluate.run_case(model, tok, case, methods, config, n_new, args.max_length, store, cut)

            for row in _marked_on_failure(answered, case, methods):
                rows.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
    finally:
        if out:
            out.close()
    scored = [r for r in rows if "score" in r]
    if scbench:
        summary = sc.summarize(scored)
    else:
        group = [g for g in args.group_by.split(",") if g] or (["task"] if args.format == "ruler" else [])
        summary = evaluate.summarize(scored, group, by_dataset=args.format == "longbench")  # LongBench: per dataset
    skipped, failed = evaluate.marked_count(rows, "skipped"), evaluate.marked_count(rows, "failed")
    if args.json:
        print(json.dumps({"rows": summary, "skipped": skipped, "failed": failed}))
        return 0
    print(table(summary) if summary else "no case was answered")
    if skipped:
        print(f"{skipped} case(s) skipped: {evaluate.SKIPPED} (--too-long cut cuts their middle instead)")
    if failed:
        print(f"{failed} case(s) failed" + (f": their rows in {args.out} say why" if args.out else ""))
    return 0


def _fidelity(args) -> int:
    """`eval fidelity`: a row per (setting, budget), averaged over the layers, printed (--json: the layers' rows and
    that summary as one object); --out: the same object written to a file (the figure's input: viz.studies)."""
    from pqcache.eval.datasets import essays_text
    from pqcache.serving.documents import read_document
    from pqcache.serving.fidelity import BUDGETS, SETTINGS, fidelity_study, summarize
    from pqcache.serving.loading import load_model

    settings = [m.strip() for m in (args.methods or ",".join(SETTINGS)).split(",") if m.strip()]
    unknown = [m for m in settings if m not in SETTINGS]
    if unknown:
        raise ValueError(f"unknown fidelity setting(s) {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    if args.n_queries < 1:
        raise ValueError(f"--n-queries must be >= 1, got {args.n_queries}")
    text = read_document(str(args.context_file)) if args.context_file is not None else essays_text()
    config = config_of(args)  # m, bits, rerank, sinks, window; each setting sets its budget, mass and completion
    model, tok = load_model(
        args.model, device=args.device, dtype=args.dtype, progress=stderr, decode_weights=args.decode_weights
    )
    text = tok.decode(tok(text).input_ids[1 : args.context_tokens])
    rows = fidelity_study(model, tok, text, args.budgets or BUDGETS, settings, args.n_queries, config=config)
    result = {"rows": rows, "summary": summarize(rows)}
    if args.out:
        args.out.write_text(json.dumps(result), encoding="utf-8")
    failed = sum("error" in r for r in rows)
    if args.json:
        print(json.dumps(result))
        return 0
    print(table(result["summary"]) if rows else "no full-attention layer")
    if failed:
        print(f"{failed} row(s) failed" + (f": their error in {args.out}" if args.out else ""))
    return 0


def _marked_on_failure(answered, case: dict, methods: list[str]) -> list[dict]:
    """The case's rows; a case longer than the model reads, or one that fails, as rows that say so (the run goes
    on: one bad case never costs the others' results or the summary)."""
    from pqcache.engine.errors import DocumentTooLongError
    from pqcache.eval import evaluate

    try:
        return answered()
    except DocumentTooLongError as exc:
        stderr(f"case {case.get('id')!r}: skipped, {exc}")
        return evaluate.marked_rows(
            case, methods, skipped=evaluate.SKIPPED, prompt_tokens=exc.n_tokens, limit=exc.limit
        )
    except Exception as exc:  # noqa: BLE001 - marked, and the run goes on
        stderr(f"case {case.get('id')!r}: failed, {type(exc).__name__}: {exc}")
        return evaluate.marked_rows(case, methods, failed=f"{type(exc).__name__}: {exc}")


def cmd_datasets(args) -> int:
    from transformers import AutoTokenizer

    from pqcache.eval import datasets
    from pqcache.serving.loading import prepare_default_model

    if args.kind == "realdocs":  # fixed questions on real texts: no tokenizer needed
        from pqcache.eval.realdocs import as_longbench, realdocs

        cases = realdocs() if args.format == "pqcache" else [as_longbench(c) for c in realdocs()]
        datasets.write_jsonl(cases, args.out)
        print(f"wrote {len(cases)} cases to {args.out}")
        return 0
    tok = AutoTokenizer.from_pretrained(prepare_default_model(lambda msg: print(msg, file=sys.stderr)))
    if args.kind == "scbench":
        from pqcache.eval import scbench_data

        tasks = args.tasks.split(",") if args.tasks else [*scbench_data.TASKS, "realdocs"]
        cases = scbench_data.synthetic(
            tok, [t for t in tasks if t != "realdocs"], args.lengths, args.n, args.turns, args.seed
        )
        cases += scbench_data.realdoc_conversations() if "realdocs" in tasks else []
        scbench_data.write(cases, args.out)
        print(f"wrote {len(cases)} conversations ({sum(len(c['multi_turns']) for c in cases)} turns) to {args.out}")
        return 0
    if args.kind == "niah":
        cases = datasets.niah(tok, args.lengths, args.depths, args.query_aware, natural=args.natural, seed=args.seed)
    else:
        tasks = args.tasks.split(",") if args.tasks else datasets.RULER_TASKS
        cases = [c for n in args.lengths for c in datasets.ruler(tok, tasks, n, args.n, args.seed, args.query_aware)]
    datasets.write_jsonl(cases, args.out)
    print(f"wrote {len(cases)} cases to {args.out}")
    return 0
