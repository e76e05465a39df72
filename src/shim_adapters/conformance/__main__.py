"""``python -m shim_adapters.conformance``: one cell, or a profile file's whole matrix.

    python -m shim_adapters.conformance --backend xgrammar --tokenizer gpt2 --grammar my.lark
    python -m shim_adapters.conformance --profile-file conformance/profiles/full.json \\
        --out conformance/reports

Writes ``<out>/<stem>.json`` and ``.md``; exits 1 on any soundness failure.
"""

from __future__ import annotations

import argparse
import sys

from .runner import run_conformance, run_profile_file


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shim_adapters.conformance",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--backend", help="registered backend name")
    ap.add_argument("--tokenizer", default="default",
                    help="default (shipped LM), an offline name or a tokenizer directory")
    ap.add_argument("--grammar", help="built-in name or grammar file")
    ap.add_argument("--profile", default="fast", help="fast or full")
    ap.add_argument("--logits-width", type=int, default=None)
    ap.add_argument("--controller", default=None, help="controller artefact dir for the γ check")
    ap.add_argument("--profile-file", help="run a matrix described by this JSON file")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--out", default=None, help="directory for the JSON + markdown report")
    ap.add_argument("--stem", default=None, help="report file name stem")
    args = ap.parse_args(argv)
    if args.profile_file:
        overrides = {} if args.seed is None else {"seed": args.seed}

        def checkpoint(partial):
            if args.out:  # a long matrix leaves a readable partial report behind
                partial.meta["partial"] = True
                partial.write(args.out, args.stem)

        report = run_profile_file(args.profile_file, checkpoint=checkpoint, **overrides)
        report.meta.pop("partial", None)
    else:
        if not (args.backend and args.grammar):
            ap.error("give --backend and --grammar, or --profile-file")
        report = run_conformance(args.backend, args.tokenizer, args.grammar, args.profile,
                                 logits_width=args.logits_width, seed=args.seed,
                                 controller_dir=args.controller)
    if args.out:
        json_path, md_path = report.write(args.out, args.stem)
        print(f"wrote {json_path} and {md_path}")
    else:
        print(report.to_markdown())
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())
