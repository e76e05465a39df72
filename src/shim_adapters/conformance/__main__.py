"""``python -m shim_adapters.conformance``: one cell, or a profile file's whole matrix.

    python -m shim_adapters.conformance --backend xgrammar --tokenizer gpt2 --grammar my.lark
    python -m shim_adapters.conformance --backend xgrammar --tokenizer ./tokenizer.json \\
        --eos '<|im_end|>' --grammar a.lark --grammar b.regex --junit-xml conformance.xml
    python -m shim_adapters.conformance --profile-file conformance/profiles/full.json \\
        --out conformance/reports
    # a killed matrix run continues where it stopped (cells in <out>/<stem>.cells.jsonl):
    python -m shim_adapters.conformance --profile-file conformance/profiles/full.json \\
        --out conformance/reports --resume

Fails closed: the exit status is the OR of the failing classes selected by ``--fail-on``
(default soundness, completeness, dead-ends, errors, control-tokens): 1 soundness, 2
completeness, 4 dead ends, 8 errors (a crashed or misconfigured cell, a check that checked
nothing), 16 control tokens allowed in output, 32 stale known bugs (only when selected).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shim_adapters.backends.registry import backends as installed_backends
from shim_adapters.conformance.corpus import corpus_files, read_rows, run_corpus
from shim_adapters.conformance.corpus import to_markdown as corpus_markdown
from shim_adapters.conformance.known_bugs import UnknownKnownBugError, check_known_ids
from shim_adapters.conformance.profiles import PROFILES
from shim_adapters.conformance.report import FAILURE_CLASSES, Report, parse_fail_on
from shim_adapters.conformance.runner import (SHIPPED_TOKENIZER_NAMES, run_conformance,
                                              run_profile_file)
from shim_adapters.grammars import BUILTIN_GRAMMARS
from shim_adapters.lm.loading import SMOLLM2_SPEC
from shim_adapters.mask.tokenizers_offline import OFFLINE_TOKENIZERS

_CLASSES = FAILURE_CLASSES

#: Exit status of a usage error: the command cannot run as asked (an unknown backend, a
#: grammar or tokenizer file that does not exist, an unknown known-bug id), as argparse exits.
#: Nothing is checked and no report is written; stderr says ``usage error``.
USAGE_ERROR = 2
#: Exit status when an input exists but does not load (a tokenizer or grammar file that is
#: broken): the errors class.
LOAD_ERROR = FAILURE_CLASSES["errors"][0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shim_adapters.conformance",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--backend", help="registered backend name")
    ap.add_argument("--tokenizer", default="default",
                    help="default (shipped LM), an offline name, a tokenizer.json file, a "
                         "tokenizer directory or a SentencePiece .model file")
    ap.add_argument("--eos", default=None,
                    help="EOS token (text or id) when the tokenizer files name none")
    ap.add_argument("--grammar", action="append",
                    help="built-in name or grammar file (repeat for several)")
    ap.add_argument("--profile", default="fast", help="fast or full")
    ap.add_argument("--logits-width", type=int, default=None)
    ap.add_argument("--controller", default=None, help="controller artefact dir for the γ check")
    ap.add_argument("--profile-file", help="run a matrix described by this JSON file")
    ap.add_argument("--corpus", metavar="DIR",
                    help="run a MaskBench-format corpus (JSON schemas with valid and invalid "
                         "instances) through --backend (a comma list; default every schema "
                         "backend); with --out: resumable log and report there")
    ap.add_argument("--corpus-every", type=int, default=1, metavar="N",
                    help="with --corpus: one file in N, in name order (a documented subset)")
    ap.add_argument("--corpus-limit", type=int, default=None, metavar="N",
                    help="with --corpus: at most N files")
    ap.add_argument("--corpus-jobs", type=int, default=1, metavar="N",
                    help="with --corpus: N worker processes side by side (budgets are CPU "
                         "time per worker, so the counts do not depend on N)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--fail-on", default=None,
                    help="comma list of failure classes that fail the run: "
                         f"{', '.join(_CLASSES)}, all, default, none (default: default)")
    ap.add_argument("--accept-known", action="append", default=[], metavar="ID",
                    help="acknowledge this known bug (repeat, or a comma list): met, it is "
                         "listed but does not fail its class; any other known bug met fails")
    ap.add_argument("--junit-xml", default=None, help="also write a JUnit XML report here")
    ap.add_argument("--out", default=None, help="directory for the JSON + markdown report")
    ap.add_argument("--stem", default=None, help="report file name stem")
    ap.add_argument("--resume", action="store_true",
                    help="with --profile-file and --out: keep the cells already in "
                         "<out>/<stem>.cells.jsonl and run only the rest (refused when that "
                         "log ran under other settings)")
    ap.add_argument("--fresh", action="store_true",
                    help="with --profile-file and --out: discard an existing cell log")
    ap.add_argument("--assemble", action="store_true",
                    help="with --profile-file and --out: only write the report of the cells in "
                         "the cell log (run nothing; safe while the run goes on)")
    ap.add_argument("--rerun", action="append", default=[], metavar="BACKEND/TOKENIZER/GRAMMAR",
                    help="with --resume: run logged cells matching this glob again (e.g. "
                         "'*/*/person.json' after a change to the schema reference)")
    ap.add_argument("--import-replace", action="append", default=[], metavar="REPORT.json",
                    help="like --import-cells, but its cells replace the logged ones (a rerun "
                         "done in another process or checkout; each cell keeps its commit)")
    ap.add_argument("--import-cells", action="append", default=[], metavar="REPORT.json[=PROVENANCE]",
                    help="before a resumable run: take the cells of an earlier report run "
                         "under the same settings (PROVENANCE, e.g. the commit holding it, "
                         "is recorded as their commit)")
    args = ap.parse_args(argv)
    try:
        fail_on = parse_fail_on(args.fail_on)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        args.accept_known = check_known_ids(",".join(args.accept_known))
        _check_usage(args)
    except (UsageError, UnknownKnownBugError) as exc:
        print(f"conformance: usage error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if args.corpus:
        return _corpus(args)
    try:
        report = _run(ap, args, fail_on)
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - fail closed: an input that does not load
        print(f"conformance could not run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return LOAD_ERROR
    if args.out:
        json_path, md_path = report.write(args.out, args.stem)
        print(f"wrote {json_path} and {md_path}")
    else:
        print(report.to_markdown())
    if args.junit_xml:
        print(f"wrote {report.write_junit(args.junit_xml)}")
    failing = report.failing_classes()
    for name, cells in failing.items():
        mark = "FAIL" if name in fail_on else "note"
        print(f"[{mark}] {name}: {', '.join(cells[:8])}" + (" ..." if len(cells) > 8 else ""),
              file=sys.stderr)
    return report.exit_code


def _run(ap, args, fail_on) -> Report:
    if args.profile_file:
        overrides = {} if args.seed is None else {"seed": args.seed}
        log_path = None
        if args.out:
            log_path = Path(args.out) / f"{args.stem or _default_stem(args.profile_file)}.cells.jsonl"
            if args.fresh and log_path.exists():
                log_path.unlink()
        elif args.resume or args.import_cells or args.import_replace or args.assemble:
            ap.error("--resume, --assemble and --import-cells need --out (the cell log lives "
                     "there)")
        if args.assemble and not log_path.exists():
            ap.error(f"--assemble: no cell log {log_path}")
        stem = args.stem or _default_stem(args.profile_file)
        resume_command = (f"python -m shim_adapters.conformance --profile-file "
                          f"{args.profile_file} --out {args.out} --resume"
                          + (f" --stem {args.stem}" if args.stem else ""))
        imports = [tuple(item.split("=", 1)) if "=" in item else (item, f"imported from {item}")
                   for item in args.import_cells]
        imports += [(item, f"imported from {item}", True) for item in args.import_replace]

        def checkpoint(partial):
            if args.out:  # a long matrix leaves a readable partial report behind
                partial.meta["partial"] = True
                if partial.meta.get("remaining_cells"):
                    partial.meta["resume_command"] = resume_command
                partial.write(args.out, stem)

        report = run_profile_file(args.profile_file, checkpoint=checkpoint,
                                  fail_on=fail_on if args.fail_on else None, log_path=log_path,
                                  resume=args.resume or args.assemble, import_reports=imports,
                                  rerun=args.rerun, run_missing=not args.assemble,
                                  accept_known=args.accept_known, **overrides)
        report.meta.pop("partial", None)
        report.meta.pop("resume_command", None)
        if report.meta.get("remaining_cells"):
            report.meta["partial"] = True
            report.meta["resume_command"] = resume_command
        args.stem = stem
        return report
    if not (args.backend and args.grammar):
        ap.error("give --backend and --grammar, or --profile-file")
    report = None
    for grammar in args.grammar:
        one = run_conformance(args.backend, args.tokenizer, grammar, args.profile,
                              logits_width=args.logits_width, seed=args.seed,
                              controller_dir=args.controller, eos=args.eos, fail_on=fail_on,
                              accept_known=args.accept_known)
        if report is None:
            report = one
        else:
            report.merge(one)
    return report


def _corpus(args) -> int:
    """``--corpus DIR``: the MaskBench protocol through each backend plugin; exit 1 when an
    invalid instance was accepted while the capability report claimed every construct
    enforced (a silent invalidation error: a defect of our declarations)."""
    names = [n for n in (args.backend or "").split(",") if n] or \
        [n for n, spec in installed_backends().items() if "json_schema" in spec.grammar_formats]
    files = corpus_files(args.corpus, args.corpus_limit, args.corpus_every)
    log = Path(args.out) / f"{args.stem or 'corpus'}.rows.jsonl" if args.out else None
    if args.assemble:  # the report of the rows logged so far (safe while the run goes on)
        if log is None or not log.exists():
            print("conformance: usage error: --assemble needs --out with a corpus log",
                  file=sys.stderr)
            return USAGE_ERROR
        rows = read_rows(log)
        keys = {(f.name, n) for f in files for n in names}
        rows = [r for r in rows if (r.file, r.backend) in keys]
    else:
        rows = run_corpus(files, names, args.tokenizer, log, jobs=args.corpus_jobs)
    command = ("shim conformance --corpus " + args.corpus
               + (f" --backend {','.join(names)}" if args.backend else "")
               + f" --tokenizer {args.tokenizer}"
               + (f" --corpus-every {args.corpus_every}" if args.corpus_every > 1 else "")
               + (f" --corpus-limit {args.corpus_limit}" if args.corpus_limit else "")
               + (f" --out {args.out}" if args.out else "")
               + (f" --stem {args.stem}" if args.stem else ""))
    done = len({r.file for r in rows})
    note = (f"{done} of {len(files)} planned files done (the rest: rerun the command, it "
            "resumes)" if done < len(files) else "")
    text = corpus_markdown(rows, command, note)
    if args.out:
        path = Path(args.out) / f"{args.stem or 'corpus'}.md"
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    else:
        print(text)
    return 1 if any(r.silent_invalidation_errors for r in rows) else 0


class UsageError(ValueError):
    """The command cannot run as asked (exit 2)."""


def _check_usage(args) -> None:
    """What can be checked before anything loads: the backend is installed, each grammar is
    a built-in or an existing file, the tokenizer a known name or an existing path, the
    profile (file) exists."""
    if args.corpus:
        if not Path(args.corpus).is_dir():
            raise UsageError(f"--corpus: no directory {args.corpus}")
        for flag in ("corpus_every", "corpus_jobs"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got "
                                 f"{getattr(args, flag)}")
        for name in (args.backend or "").split(","):
            if name and name not in installed_backends():
                raise UsageError(f"no backend named {name!r} is installed; installed: "
                                 f"{', '.join(installed_backends()) or 'none'}")
        return
    if args.profile_file:
        if not Path(args.profile_file).is_file():
            raise UsageError(f"no profile file {args.profile_file}")
        return
    if args.profile not in PROFILES:
        raise UsageError(f"unknown profile {args.profile!r}; choose from {', '.join(PROFILES)}")
    if args.backend and args.backend not in installed_backends():
        raise UsageError(f"no backend named {args.backend!r} is installed; installed: "
                         f"{', '.join(installed_backends()) or 'none'}")
    for grammar in args.grammar or ():
        if grammar not in BUILTIN_GRAMMARS and not Path(grammar).is_file():
            raise UsageError(f"grammar {grammar!r} is neither a built-in "
                             f"({', '.join(BUILTIN_GRAMMARS)}) nor an existing file")
    tok = args.tokenizer
    if tok not in SHIPPED_TOKENIZER_NAMES + (SMOLLM2_SPEC,) and tok not in OFFLINE_TOKENIZERS \
            and not Path(tok).exists():
        raise UsageError(f"tokenizer {tok!r} is neither {', '.join(SHIPPED_TOKENIZER_NAMES)}, "
                         f"an offline name ({', '.join(OFFLINE_TOKENIZERS)}) nor an existing "
                         "file or directory")


def _default_stem(profile_file: str) -> str:
    """``conformance-<profile file name>``: one report and cell log per profile file."""
    return f"conformance-{Path(profile_file).stem}"


if __name__ == "__main__":
    sys.exit(main())
