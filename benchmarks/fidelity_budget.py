"""Fidelity at equal LM-sample budgets: 0/1 final-validity labels vs soft targets, and the cost
of exact samples (rejection, ASAp, importance sampling with the corrected sampler).

Per case (shipped LM, one backend) and budget B (every LM completion counts, masked or not):
  final     -- B unconstrained completions, 0/1 labels (the paper's SHIM);
  rollout   -- B masked completions, soft labels ∏ Z of the later steps;
  bootstrap -- the same B masked completions, one round of fitted value iteration;
each fitted with β chosen on held-out completions ("fit", may fall back to β=0 = masking) and
undamped ("b1", β = 1). Fidelity: exact KL over the whole language for binary5 prompts, else
KL over the support of valid unconstrained samples (the paper's protocol) plus a Monte-Carlo
estimate of KL(method) - KL(masking) with its standard error. Cost: seconds per accepted sample
(rejection), per sample (ASAp, one at a time), per effective sample (SIR with masking and with
controllers of growing training budget as the proposal).

    python benchmarks/fidelity_budget.py --out reports/fidelity [--cases binary5,bv4,...]
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
from shim_adapters.evaluation.asap import run_asap
from shim_adapters.evaluation.exact_distribution import enumerate_language
from shim_adapters.evaluation.metrics import kl_over_support
from shim_adapters.evaluation.rejection import draw_lm_samples, rejection_sample
from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.loading import DEFAULT_LM_CONTROL_PROMPTS, load_lm
from shim_adapters.lm.sampling import prefill
from shim_adapters.shim.controller import make_controller
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.evaluation.importance import exact_samples
from shim_adapters.shim.targets import make_targets
from shim_adapters.shim.training_data import sample_training_data

#: name -> (built-in grammar, prompt or None for the grammar's own, exact enumeration?)
CASES = {
    "binary5": ("binary5", None, True),
    "binary5-control": ("binary5", DEFAULT_LM_CONTROL_PROMPTS["binary5"], True),
    "bv4": ("bv4", None, False),
    "json": ("json", None, False),
    "sql": ("sql", None, False),
}
TARGETS = ("final", "rollout", "bootstrap")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def fit(kind: str, target: str, data, beta_fixed: bool, reg_grid):
    params = dict(reg_grid=reg_grid, n_splits=3)
    if beta_fixed:
        params["beta_grid"] = (1.0,)
    t0 = time.perf_counter()
    targets = make_targets(target, data, lambda: make_controller(kind, **params))
    c = make_controller(kind, **params).fit(targets.data, y=targets.y,
                                            completion_weight=targets.completion_weight)
    info = {"beta": c.beta_, "reg": c.reg_, "falls_back": bool(c.falls_back_to_masking_),
            "heldout_kl_gain": c.heldout_kl_gain_, "heldout_kl_gain_se": c.heldout_kl_gain_se_,
            "fit_seconds": time.perf_counter() - t0,
            "effective_target_samples": targets.effective_target_samples}
    return c, info


def run_case(name: str, lm, backend: str, budgets, kind: str, n_eval: int, seed: int,
             n_exact: int, asap_samples: int, reg_grid) -> dict:
    gname, prompt, finite = CASES[name]
    grammar = builtin_grammar(gname)
    prompt = prompt or grammar.default_prompt
    masker = get_backend(backend).compile(grammar, lm.tokenizer, lm.vocab_size)
    out: dict = {"case": name, "grammar": gname, "prompt": prompt, "finite": finite,
                 "budgets": list(budgets), "fits": {}, "kl": {}, "cost": {}}
    big = max(budgets)
    t0 = time.perf_counter()
    data = {"final": sample_training_data(lm, masker, prompt, big, seed=seed + 1,
                                          progress=False)}
    out["seconds_lm_samples"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    data["masked"] = sample_training_data(lm, masker, prompt, big, seed=seed + 2,
                                          progress=False, proposal="masked")
    out["seconds_masked_samples"] = time.perf_counter() - t0
    log(f"{name}: sampled {big} LM ({out['seconds_lm_samples']:.0f} s) + {big} masked "
        f"({out['seconds_masked_samples']:.0f} s); LM valid fraction "
        f"{data['final'].valid.mean():.3f}")
    adjusters: dict = {"masking": None}
    controllers: dict = {}
    for b in budgets:
        subsets = {"final": data["final"].subset(np.arange(b)),
                   "masked": data["masked"].subset(np.arange(b))}
        for target in TARGETS:
            d = subsets["final" if target == "final" else "masked"]
            for damping in ("fit", "b1"):
                key = f"{target}-{damping}@{b}"
                c, info = fit(kind, target, d, damping == "b1", reg_grid)
                out["fits"][key] = info
                adjusters[key] = ShimAdjuster(c)
                controllers[key] = c
        log(f"{name}: fitted budget {b}")
    # ---- fidelity
    t0 = time.perf_counter()
    if finite:
        ex = enumerate_language(lm, masker, prompt, {k: v for k, v in adjusters.items()
                                                     if v is not None})
        for k in adjusters:
            out["kl"][k] = {"kl": ex.kl(k)}
        out["kl_kind"] = "exact KL over the whole language (output strings)"
        out["language_size"] = len(ex.sequences)
    else:
        pf = prefill(lm, prompt)
        draws = draw_lm_samples(pf, grammar, n_eval, generator=torch.Generator().manual_seed(
            seed + 3))
        valid = [tuple(t) for t, ok in zip(draws.token_ids, draws.valid) if ok]
        support = sorted(set(valid))
        index = {s: i for i, s in enumerate(support)}
        sc = score_sequences(pf, [list(s) for s in support], masker, adjusters)
        mult = np.array([index[s] for s in valid])
        log_pl = np.log(len(valid) / n_eval)
        for k in adjusters:
            q = sc.methods[k]
            d = (sc.methods["masking"] - q)[mult]  # per valid draw: log q_mask - log q_method
            out["kl"][k] = {
                "kl": kl_over_support(sc.lm, q),
                "kl_mc": float(np.mean(sc.lm[mult] - log_pl - q[mult])),
                "minus_masking_mc": float(d.mean()),
                "minus_masking_se": float(d.std(ddof=1) / np.sqrt(len(d)))}
        out["kl_kind"] = (f"KL over the support of {len(valid)} valid of {n_eval} unconstrained "
                          f"draws ({len(support)} distinct)")
        out["support_size"] = len(support)
    out["seconds_kl"] = time.perf_counter() - t0
    log(f"{name}: KL done ({out['seconds_kl']:.0f} s)")
    # ---- cost of exact samples
    pf = prefill(lm, prompt)
    rej = rejection_sample(pf, grammar, n_exact, generator=torch.Generator().manual_seed(seed + 4))
    out["cost"]["rejection"] = {"seconds_per_exact_sample": rej.seconds_per_accepted,
                                "acceptance_rate": rej.acceptance_rate}
    asap = run_asap(pf, masker, asap_samples, batch_size=1,
                    generator=torch.Generator().manual_seed(seed + 5))
    out["cost"]["asap"] = {"seconds_per_sample": asap.seconds_per_sample,
                           "n_samples": asap_samples,
                           "note": "approximate: converges to the target as samples accumulate"}
    best = max(TARGETS, key=lambda t: -out["kl"][f"{t}-fit@{big}"]["kl"])
    proposals = {"masking": None, f"final-fit@{big}": controllers[f"final-fit@{big}"]}
    for b in budgets:
        proposals[f"{best}-fit@{b}"] = controllers[f"{best}-fit@{b}"]
    for key, c in proposals.items():
        r = exact_samples(lm, masker, c, prompt, n_exact, "sir", seed=seed + 6)
        out["cost"][f"sir[{key}]"] = {
            "seconds_per_exact_sample": r.seconds_per_effective_sample, "ess": r.ess,
            "relative_ess": r.relative_ess, "n_proposals": r.n_proposals,
            "sample_seconds": r.sample_seconds, "score_seconds": r.score_seconds,
            "log_evidence": r.log_evidence}
    log(f"{name}: cost done")
    return out


COLUMNS = [f"{t}-{d}" for t in TARGETS for d in ("fit", "b1")]


def _fmt(x: float) -> str:
    return "inf" if x == float("inf") else (f"{x:.4f}" if x >= 1e-4 else f"{x:.1e}")


def render(out_dir: Path) -> str:
    """Markdown tables from every ``<case>.json`` in ``out_dir``."""
    lines = []
    for path in sorted(out_dir.glob("*.json")):
        r = json.loads(path.read_text())
        if "kl" not in r:
            continue
        lines += [f"### {r['case']} (`{r['grammar']}`, prompt {json.dumps(r['prompt'])})", "",
                  f"{r['kl_kind']}; {r['kind']}, backend {r['backend']}, seed {r['seed']}. "
                  f"Masking KL: **{_fmt(r['kl']['masking']['kl'])}**. Cells: KL (β).", "",
                  "| budget | " + " | ".join(COLUMNS) + " |", "|---:|" + "---:|" * len(COLUMNS)]
        for b in r["budgets"]:
            cells = []
            for c in COLUMNS:
                k = f"{c}@{b}"
                kl, fit = r["kl"][k]["kl"], r["fits"][k]
                mark = "**" if kl < r["kl"]["masking"]["kl"] else ""
                fb = "=mask" if fit["falls_back"] else f"{fit['beta']:g}"
                cells.append(f"{mark}{_fmt(kl)}{mark} ({fb})")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        if not r["finite"]:
            lines += ["", "Monte-Carlo KL(method) - KL(masking) on the valid draws (± 1 SE; "
                      "negative = better than masking):", "",
                      "| budget | " + " | ".join(COLUMNS) + " |",
                      "|---:|" + "---:|" * len(COLUMNS)]
            for b in r["budgets"]:
                cells = [f"{r['kl'][f'{c}@{b}']['minus_masking_mc']:+.4f} ± "
                         f"{r['kl'][f'{c}@{b}']['minus_masking_se']:.4f}" for c in COLUMNS]
                lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines += ["", "Cost per exact sample (seconds; SIR = seconds per effective sample over "
                  f"{r['n_exact']} proposals):", "", "| method | s / exact sample | note |",
                  "|---|---:|---|"]
        for k, v in r["cost"].items():
            if k == "asap":
                lines.append(f"| ASAp (one at a time, {v['n_samples']} samples) | "
                             f"{v['seconds_per_sample']:.4f} | approximate, not exact |")
            elif k == "rejection":
                lines.append(f"| rejection | {v['seconds_per_exact_sample']:.4f} | acceptance "
                             f"{v['acceptance_rate']:.2f} |")
            else:
                lines.append(f"| {k} | {v['seconds_per_exact_sample']:.4f} | ESS "
                             f"{v['ess']:.0f}/{v['n_proposals']} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("reports/fidelity"))
    ap.add_argument("--cases", default="binary5,binary5-control,bv4,sql,json")
    ap.add_argument("--budgets", default="250,1000,4000")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--kind", default="LR_FULL")
    ap.add_argument("--n-eval", type=int, default=1000)
    ap.add_argument("--n-exact", type=int, default=300)
    ap.add_argument("--asap-samples", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--render-only", action="store_true",
                    help="only write tables.md from the JSON files already in --out")
    args = ap.parse_args()
    if args.render_only:
        (args.out / "tables.md").write_text(render(args.out))
        return
    torch.set_num_threads(1)
    budgets = [int(b) for b in args.budgets.split(",")]
    lm = load_lm(None)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.cases.split(","):
        t0 = time.perf_counter()
        res = run_case(name, lm, args.backend, budgets, args.kind, args.n_eval, args.seed,
                       args.n_exact, args.asap_samples, (0.1, 1.0, 10.0))
        res.update(seconds=time.perf_counter() - t0, backend=args.backend, kind=args.kind,
                   seed=args.seed, n_eval=args.n_eval, n_exact=args.n_exact,
                   command="python " + " ".join(sys.argv))
        (args.out / f"{name}.json").write_text(json.dumps(res, indent=1, default=float))
        log(f"{name}: {res['seconds']:.0f} s total")
        (args.out / "tables.md").write_text(render(args.out))


if __name__ == "__main__":
    main()
