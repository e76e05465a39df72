"""Does a temperature on the LM's own probabilities move the held-out criterion? (Spider probe)

SHIM's per-step distribution is q(t) ∝ p(t)·γ̂(t)^β over the allowed set. A feature of the
candidate's own LM probability would let the controller re-temper p per state; this probe asks
the cheapest version first: one global exponent α, q(t) ∝ p(t)^α·γ̂(t)^β. It draws masked
rollouts of one case with the fit's recipe (its LM view and prompt preparation), then fits
LR_FULL with the held-out criterion's LM log-probabilities scaled by α (the held-out
log-likelihood of target samples, per target sample; α = 1, β = 0 is masking). Reported per α:
the criterion with β = 0 (temperature alone) and at the best β (with LR_FULL), both against
masking. Exploratory: it scales a private array of the criterion, nothing in the product.

    python benchmarks/temperature_probe.py --data ../shared/benchmarks/spider --case spider-0000 --n 400 --alphas 0.7,0.85,1,1.15,1.3
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch


def main(argv: list[str] | None = None) -> int:
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.evaluation.suites import load_suite
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.shim import controller as controllers
    from shim_adapters.shim.fitting import FitRecipe, prepare_prompt
    from shim_adapters.shim.targets import make_targets
    from shim_adapters.shim.training_data import sample_training_data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the Spider folder of the shared benchmarks")
    p.add_argument("--case", default="spider-0000")
    p.add_argument("--n", type=int, default=400, help="masked rollouts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--alphas", default="0.7,0.85,1,1.15,1.3")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    case = load_suite("spider", a.data).select([a.case]).cases[0]
    lm = load_lm("smollm2")
    masker = get_backend("syncode").compile(case.grammar, lm.tokenizer, lm.vocab_size)
    recipe = FitRecipe(max_new_tokens=case.max_new_tokens, stop_at_newline=case.stop_at_newline,
                       seed=a.seed, progress=False)
    prepared = prepare_prompt(lm, masker, case.prompt, recipe)
    data = sample_training_data(prepared.lm, masker, case.prompt, a.n,
                                max_new_tokens=case.max_new_tokens, proposal="masked",
                                prefilled=prepared.prefilled, seed=a.seed, progress=False)
    targets = make_targets("rollout", data)
    weight = targets.completion_weight
    scaled = controllers._ContrastSet.loglik_per_completion
    alpha = [1.0]

    def tempered(self, logits_fn, betas, completions):
        kept = self.lm_logprob
        self.lm_logprob = kept * alpha[0]
        try:
            return scaled(self, logits_fn, betas, completions)
        finally:
            self.lm_logprob = kept

    controllers._ContrastSet.loglik_per_completion = tempered
    rows, masking = [], None
    for value in sorted(float(x) for x in a.alphas.split(",")):
        alpha[0] = value
        fit = controllers.make_controller("LR_FULL").fit(
            targets.data, y=targets.y, completion_weight=weight)
        scores = fit.cv_scores_ / weight.sum()  # (reg, β): held-out log q per target sample
        rows.append({"alpha": value, "temperature_only": float(scores[:, 0].max()),
                     "with_lr_full": float(scores.max()),
                     "beta": float(fit.beta_grid[int(np.argmax(scores.max(axis=0)))])})
        if value == 1.0:
            masking = rows[-1]["temperature_only"]
    for row in rows:
        if masking is not None:
            row["temperature_only_vs_masking"] = row["temperature_only"] - masking
            row["with_lr_full_vs_masking"] = row["with_lr_full"] - masking
    ess = float(weight.sum() ** 2 / (weight ** 2).sum())
    print(json.dumps({"case": a.case, "rollouts": a.n, "valid": int(np.sum(data.valid)),
                      "target_ess": ess, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
