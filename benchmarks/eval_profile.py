"""Run an evaluation profile by hand and print its summary (torch pinned to one thread).

Fast profile (shipped tiny LM, built-in grammars, a few minutes)::

    python benchmarks/eval_profile.py --suite fast --out reports/fast-xgrammar

Full profile (SmolLM2-135M-Instruct; BV4 and Spider read from the shared benchmark data)::

    python benchmarks/eval_profile.py --suite bv4 --data-dir /work/shared/benchmarks/BV4 \
        --lm smollm2 --cases find_inv_eq_bvand_4bit ... --n-samples 300 --out reports/full-bv4

Timings are measured side by side in one run, so compare the ratios, not absolute seconds.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    from shim_adapters.evaluation import METHODS, run_eval

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", default="fast", help="built-in suite name or a .json/.toml file")
    p.add_argument("--data-dir", default=None, help="benchmark directory for bv4 / spider")
    p.add_argument("--lm", default=None, help="LM spec (default: the shipped tiny LM)")
    p.add_argument("--backend", default="xgrammar")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--cases", default=None, help="comma-separated case names")
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--n-samples", type=int, default=1000)
    p.add_argument("--n-train", type=int, default=None)
    p.add_argument("--asap-samples", type=int, default=100)
    p.add_argument("--asap-batch-size", type=int, default=1)
    p.add_argument("--asap-checkpoints", default="0,10,30,100")
    p.add_argument("--timing-samples", type=int, default=20)
    p.add_argument("--n-bootstrap", type=int, default=200)
    p.add_argument("--max-new-tokens", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--cut-draws", action="store_true",
                   help="stop an unconstrained draw at the first token the masker refuses")
    p.add_argument("--target", default="auto",
                   choices=("auto", "final", "rollout", "bootstrap"), help="SHIM training labels")
    p.add_argument("--rounds", type=int, default=1,
                   help="iterated refits on the controller's own rollouts (same budget)")
    p.add_argument("--max-train", type=int, default=1000,
                   help="cap on SHIM's LM samples: a fit not trusted only because its held-out "
                        "evidence is thin tops up to it (0: no top-ups)")
    p.add_argument("--mixture-samples", type=int, default=0,
                   help="samples per masked method for the importance-sampled KL")
    p.add_argument("--resume", action="store_true",
                   help="keep the cases already in OUT/report.json, run the others")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    report = run_eval(
        a.suite, a.lm, a.backend, methods=a.methods.split(","), n_samples=a.n_samples,
        seed=a.seed, out_dir=a.out, progress=True, data_dir=a.data_dir,
        cases=tuple(a.cases.split(",")) if a.cases else None, limit=a.limit, n_train=a.n_train,
        asap_samples=a.asap_samples, asap_batch_size=a.asap_batch_size,
        asap_checkpoints=tuple(int(x) for x in a.asap_checkpoints.split(",")),
        timing_samples=a.timing_samples, n_bootstrap=a.n_bootstrap,
        max_new_tokens=a.max_new_tokens, batch_size=a.batch_size, cut_draws=a.cut_draws,
        target=a.target, rounds=a.rounds, max_train=a.max_train or None,
        mixture_samples=a.mixture_samples,
        resume=a.resume)
    methods = [m for m in report.methods if m != "rejection"]
    print(f"{'case':32s} {'|S|':>5s} " + " ".join(f"{m:>10s}" for m in methods))
    for case in report.cases:
        kls = [case["methods"].get(m, {}).get("kl", {}).get("kl", math.nan) for m in methods]
        print(f"{case['name'][:32]:32s} {case['support']['size']:5d} "
              + " ".join(f"{k:10.4f}" for k in kls))
    print("KL over the whole language (Monte-Carlo):")
    for case in report.cases:
        kls = [case["methods"].get(m, {}).get("language_kl", {}).get("kl", math.nan)
               for m in methods]
        print(f"{case['name'][:32]:32s} {'':5s} " + " ".join(f"{k:10.4f}" for k in kls))
    print("seconds per sample relative to masking:")
    for case in report.cases:
        t = case.get("timing", {})
        base = t.get("masking", {}).get("seconds_per_sample")
        if base:
            print(f"{case['name'][:32]:32s} " + " ".join(
                f"{m}={t[m]['seconds_per_sample'] / base:.2f}" for m in report.methods if m in t))
    print(f"report: {a.out}/report.md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
