"""The benchmark matrix on a real LM: every problem of BV4, SLIA, CP and Spider, resumable.

One report folder per suite under ``--out`` (default ``reports/smollm2-matrix``); each problem is
one ``run_eval`` case written as soon as it completes, and a rerun skips the problems already
in the folder's ``report.json``, so the matrix is filled over several sessions. Problems are
taken round-robin across the suites (problem 1 of each suite, then problem 2, ...) so that every
suite is covered early. Fidelity is the importance-sampled KL over a mixture of the methods'
own proposals (valid at any P(L)), beside the rejection-based one where valid draws exist.

    python benchmarks/real_lm_matrix.py --data /work/shared/benchmarks --hours 1.5

``--redo NAMES`` recomputes the named problems (e.g. after a change to the fit): their stored
entries (the case in ``report.json``, its scores and controllers) are dropped first, every
other problem is kept.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import torch

SUITES = {  # suite -> (data folder, backend)
    "bv4": ("BV4", "xgrammar"),
    "slia": ("SLIA", "xgrammar"),
    "cp": ("CP", "xgrammar"),
    "spider": ("spider", "syncode"),
}


def drop_cases(out: Path, names: set[str]) -> list[str]:
    """Remove the named problems' stored results from one suite folder; returns those found."""
    from shim_adapters.evaluation.report import write_report
    from shim_adapters.evaluation.runner import EvalReport

    if not (out / "report.json").is_file():
        return []
    report = EvalReport.from_json(out / "report.json")
    found = [c["name"] for c in report.cases if c["name"] in names]
    if not found:
        return []
    report.cases = [c for c in report.cases if c["name"] not in names]
    for name in found:
        (out / "scores" / f"{name}.safetensors").unlink(missing_ok=True)
        shutil.rmtree(out / "controllers" / name, ignore_errors=True)
    write_report(report, out, plots=False)
    return found


def main(argv: list[str] | None = None) -> int:
    from shim_adapters.evaluation import run_eval
    from shim_adapters.evaluation.runner import EvalReport
    from shim_adapters.evaluation.suites import load_suite
    from shim_adapters.shim.fitting import CLI_EVIDENCE_BAND, FitRecipe

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the benchmarks folder (BV4/, SLIA/, ...)")
    p.add_argument("--out", default="reports/smollm2-matrix")
    p.add_argument("--lm", default="smollm2")
    p.add_argument("--suites", default=",".join(SUITES))
    p.add_argument("--hours", type=float, default=2.0, help="stop starting problems after this")
    p.add_argument("--n-samples", type=int, default=500, help="unconstrained draws (cut)")
    p.add_argument("--n-train", type=int, default=400, help="SHIM's LM samples (<= 1000)")
    p.add_argument("--max-train", type=int, default=1000,
                   help="cap on SHIM's LM samples: a fit not trusted only for thin held-out "
                        "evidence tops up to it (the issue's 1,000; 0: no top-ups)")
    p.add_argument("--mixture-samples", type=int, default=64)
    p.add_argument("--asap-samples", type=int, default=100)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--target", default="auto")
    p.add_argument("--evidence-band", type=float, default=None,
                   help="the fit's evidence band (default: the shim commands' own)")
    p.add_argument("--text-features", choices=("off", "on", "auto"), default="off")
    p.add_argument("--spider-limit", type=int, default=4)
    p.add_argument("--first", default="",
                   help="comma-separated problem names to run before the others of their suite")
    p.add_argument("--only", default="",
                   help="comma-separated problem names: run only these (e.g. to split one "
                        "suite over two processes with different --out; merge with "
                        "benchmarks/matrix_merge.py)")
    p.add_argument("--redo", default="",
                   help="comma-separated problem names to recompute: their stored results are "
                        "dropped, the other problems are kept")
    a = p.parse_args(argv)
    if a.n_train > a.max_train > 0:
        p.error(f"--n-train {a.n_train} exceeds --max-train {a.max_train}")
    torch.set_num_threads(1)
    # the recipe `shim fit` and `shim eval` run (their evidence band), per case its kind, seed
    # and max_new_tokens are set by the evaluation
    recipe = FitRecipe(n_samples=a.n_train, target=a.target, rounds=a.rounds,
                       max_samples=a.max_train or None, batch_size=64,
                       evidence_band=(CLI_EVIDENCE_BAND if a.evidence_band is None
                                      else a.evidence_band),
                       text_features=a.text_features)
    redo = {n for n in a.redo.split(",") if n}
    only = {n for n in a.only.split(",") if n}
    if redo:
        known = set()
        for suite in a.suites.split(","):
            known |= {c.name for c in load_suite(suite, Path(a.data) / SUITES[suite][0]).cases}
        unknown = sorted(redo - known)
        if unknown:
            p.error(f"--redo: no problem named {', '.join(unknown)} in suites {a.suites}")
        for suite in a.suites.split(","):
            dropped = drop_cases(Path(a.out) / suite, redo)
            if dropped:
                print(f"{suite}: dropped the stored results of {', '.join(dropped)}", flush=True)
    start = time.time()
    queues = {}
    for suite in a.suites.split(","):
        folder, backend = SUITES[suite]
        cases = [c.name for c in load_suite(suite, Path(a.data) / folder).cases]
        if suite == "spider":
            cases = cases[: a.spider_limit]
        if only:
            cases = [c for c in cases if c in only]
        out = Path(a.out) / suite
        done = set()
        if (out / "report.json").is_file():
            done = {c["name"] for c in EvalReport.from_json(out / "report.json").cases}
        first = [c for c in a.first.split(",") + sorted(redo) if c in cases]
        cases = first + [c for c in cases if c not in first]
        queues[suite] = (backend, [c for c in cases if c not in done], out)
    while any(q[1] for q in queues.values()):
        for suite, (backend, todo, out) in queues.items():
            if not todo:
                continue
            if time.time() - start > a.hours * 3600:
                print(f"time budget of {a.hours} h spent; rerun to resume", flush=True)
                return 0
            case = todo.pop(0)
            run_eval(suite, a.lm, backend, n_samples=a.n_samples, out_dir=out, progress=True,
                     data_dir=str(Path(a.data) / SUITES[suite][0]), cases=(case,),
                     n_train=a.n_train, cut_draws=True, asap_samples=a.asap_samples,
                     asap_batch_size=20, asap_checkpoints=(0, 20, 100), timing_samples=0,
                     n_bootstrap=200, batch_size=64, target=a.target, rounds=a.rounds,
                     max_train=a.max_train or None, mixture_samples=a.mixture_samples,
                     recipe=recipe, resume=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
