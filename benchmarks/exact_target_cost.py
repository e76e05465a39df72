"""Cost of exact samples of p(x | G) where the LM is rarely valid: rejection sampling against
importance resampling (SIR) with masking and with a fitted SHIM controller as the proposal.

Rejection pays 1/P(L) LM samples per accepted one; SIR pays the proposals divided by the
effective sample size of their weights p(x)·1[x in L]/q(x). Reads the evaluation report of an
earlier ``run_eval`` (its rejection cost, and the controllers it fitted under
``controllers/<case>/<method>``), draws ``--n-proposals`` proposals per method through the
same LM view the evaluation used (newline folded into EOS for the few-shot suites) and writes
``exact_target.json`` and ``exact_target.md`` into ``--out``. Torch is pinned to one thread.

    python benchmarks/exact_target_cost.py --report reports/full-smollm2-bv4-shim \\
        --suite bv4 --data-dir ../shared/benchmarks/BV4 --lm smollm2 --backend xgrammar \\
        --n-proposals 100 --out reports/exact-target-smollm2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation import EvalReport, load_suite
from shim_adapters.lm.loading import load_lm
from shim_adapters.lm.views import stop_folded
from shim_adapters.shim.artefact import load_controller
from shim_adapters.evaluation.importance import exact_samples


def _log(msg: str) -> None:
    print(f"[exact {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_case(case, lm, spec, report_dir: Path, report_case: dict, kinds: list[str],
             n_proposals: int, seed: int, max_new: int) -> dict:
    masker = spec.compile(case.grammar, lm.tokenizer, lm.vocab_size)
    view = stop_folded(lm, masker.eos_token_ids) if case.stop_at_newline else lm
    rejection = report_case["methods"].get("rejection", {})
    out = {"case": case.name, "n_proposals": n_proposals, "seed": seed,
           "rejection": {"acceptance_rate": rejection.get("acceptance_rate"),
                         "seconds_per_accepted": rejection.get("batched_seconds_per_accepted"),
                         "cut_draws": bool(report_case.get("support", {}).get("cut_draws"))},
           "proposals": {}}
    for kind in ["masking"] + kinds:
        controller, beta = None, 0.0
        if kind != "masking":
            controller, manifest = load_controller(report_dir / "controllers" / case.name / kind,
                                                   masker)
            beta = float(controller.beta_)
        _log(f"{case.name}: {n_proposals} proposals from {kind} (β={beta:g})")
        res = exact_samples(view, masker, controller, case.prompt, n_proposals,
                            n_proposals=n_proposals, seed=seed, max_new_tokens=max_new,
                            batch_size=32)
        valid = np.isfinite(res.log_weights)
        out["proposals"][kind] = {
            "beta": beta, "ess": res.ess, "relative_ess": res.relative_ess,
            "valid_proposals": int(valid.sum()), "seconds": res.seconds,
            "sample_seconds": res.sample_seconds, "score_seconds": res.score_seconds,
            "seconds_per_effective_sample": res.seconds_per_effective_sample,
            "log_evidence": res.log_evidence,
            "distinct_proposals": len({tuple(t) for t in res.proposal_token_ids})}
        _log(f"  ESS {res.ess:.1f}/{n_proposals}, {res.seconds_per_effective_sample:.2f} s per "
             f"effective sample, log P(L) estimate {res.log_evidence:.3f}")
    return out


def markdown(results: list[dict], command: str) -> str:
    kinds = list(results[0]["proposals"]) if results else []
    lines = ["# Exact samples of p(x | G): rejection vs importance resampling", "",
             f"- command: `{command}`",
             "- rejection: seconds per accepted sample over the evaluation's N batched LM draws"
             " (cut at the first token the masker refuses when the report says so);"
             " SIR: seconds per effective sample (proposals + exact teacher-forced scoring)"
             " with the ESS of the importance weights; P(L): the evaluation's valid fraction"
             " vs exp(mean weight) of each proposal", "",
             "| case | P(L) valid fraction | rejection s/accepted | " + " | ".join(
                 f"{k}: ESS / n, s per eff. sample, P̂(L)" for k in kinds) + " |",
             "|---|---:|---:|" + "---:|" * len(kinds)]
    for r in results:
        cells = []
        for k in kinds:
            p = r["proposals"][k]
            cells.append(f"{p['ess']:.1f} / {r['n_proposals']}, "
                         f"{p['seconds_per_effective_sample']:.2f}, "
                         f"{np.exp(p['log_evidence']):.3f}" + (" (β=0)" if k != "masking" and
                                                              p["beta"] == 0 else ""))
        rej = r["rejection"]
        lines.append(f"| {r['case']} | {rej['acceptance_rate']:.3f} | "
                     f"{rej['seconds_per_accepted']:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", required=True, type=Path, help="a run_eval output directory")
    p.add_argument("--suite", required=True)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--lm", default=None)
    p.add_argument("--backend", default="xgrammar")
    p.add_argument("--cases", default=None, help="default: every case of the report")
    p.add_argument("--controllers", default="lr_full")
    p.add_argument("--n-proposals", type=int, default=100)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    report = EvalReport.from_json(a.report / "report.json")
    by_name = {c["name"]: c for c in report.cases}
    names = a.cases.split(",") if a.cases else list(by_name)
    suite = load_suite(a.suite, a.data_dir).select(names, None)
    lm = load_lm(a.lm)
    spec = get_backend(a.backend)
    kinds = [k for k in a.controllers.split(",") if k]
    results = []
    a.out.mkdir(parents=True, exist_ok=True)
    for case in suite.cases:
        results.append(run_case(case, lm, spec, a.report, by_name[case.name], kinds,
                                a.n_proposals, a.seed, a.max_new_tokens or case.max_new_tokens))
        (a.out / "exact_target.json").write_text(json.dumps(results, indent=1))
    command = "python " + " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    (a.out / "exact_target.md").write_text(markdown(results, command))
    print(markdown(results, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
