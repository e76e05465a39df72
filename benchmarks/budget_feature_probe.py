"""Does the remaining token budget, seen by the controller, move Spider's held-out criterion?

Spider's masked rollouts under SmolLM2 run out of tokens often (94 of 300 on spider-0000 reach
max_new_tokens = 64 without ending: an invalid string, label 0), and the controller's features
(parser state, lexer state, partial lexeme, token) do not see how many tokens are left. This
probe draws masked rollouts of one case with the fit's recipe, then fits LR_FULL three ways on
the same rows: token ids as shipped; with a bucket of the remaining budget as a state feature;
and with that bucket also crossed with the candidate token (what would let it prefer closing
tokens late). Reported: the held-out KL gain over masking ± SE (the trust decision's quantity).
Exploratory: it adds the bucket as a backend extra and patches the encoder's crossing in this
process only.

    python benchmarks/budget_feature_probe.py --data ../shared/benchmarks/spider --case spider-0000 --n 300
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from shim_adapters.shim import features as feats_mod
from shim_adapters.shim.training_data import TrainingData


def bucket(r: int) -> str:
    """Tokens left before max_new_tokens, bucketed on a log scale."""
    for bound, name in ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (16, "9-16"), (32, "17-32")):
        if r <= bound:
            return name
    return "33+"


def with_budget(data: TrainingData, max_new: int) -> TrainingData:
    """The same rows, each state split by the budget bucket of its step (a backend extra)."""
    keys, states, row_state = {}, [], np.empty_like(data.row_state)
    for i, (s, step) in enumerate(zip(data.row_state, data.row_step)):
        b = bucket(max_new - int(step))
        k = (int(s), b)
        sid = keys.get(k)
        if sid is None:
            st = data.states[int(s)]
            sid = keys[k] = len(states)
            states.append(replace(st, extra={**dict(st.extra), "budget": b}))
        row_state[i] = sid
    return replace(data, states=states, row_state=row_state)


orig_cross = feats_mod.FeatureEncoder.cross_strings


def cross_with_budget(self, f):
    """The encoder's crossed strings plus the budget bucket (crossed with the token)."""
    out = orig_cross(self, f)
    if f.extra and "budget" in f.extra and "cross" in self.groups:
        out.append(f"bud:{f.extra['budget']}")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True, help="the Spider folder of the shared benchmarks")
    p.add_argument("--case", default="spider-0000")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default=None, help="folder to keep the drawn rollouts in (reused when present)")
    a = p.parse_args()
    torch.set_num_threads(1)
    from shim_adapters.evaluation.suites import load_suite
    from shim_adapters.shim.controller import make_controller
    from shim_adapters.shim.targets import make_targets
    case = load_suite("spider", a.data).select([a.case]).cases[0]
    cache = Path(a.cache) / f"{a.case}-n{a.n}-s{a.seed}" if a.cache else None
    if cache is not None and cache.is_dir() and any(cache.iterdir()):
        data = TrainingData.load(cache)
    else:
        from shim_adapters.backends.registry import get_backend
        from shim_adapters.lm.loading import load_lm
        from shim_adapters.shim.fitting import FitRecipe, prepare_prompt
        from shim_adapters.shim.training_data import sample_training_data
        lm = load_lm("smollm2")
        masker = get_backend("syncode").compile(case.grammar, lm.tokenizer, lm.vocab_size)
        recipe = FitRecipe(max_new_tokens=case.max_new_tokens, stop_at_newline=case.stop_at_newline,
                           seed=a.seed, progress=False)
        prepared = prepare_prompt(lm, masker, case.prompt, recipe)
        t0 = time.time()
        data = sample_training_data(prepared.lm, masker, case.prompt, a.n,
                                    max_new_tokens=case.max_new_tokens, proposal="masked",
                                    prefilled=prepared.prefilled, seed=a.seed, progress=False)
        print("sampled in", time.time() - t0, file=sys.stderr)
        if cache is not None:
            data.save(cache)
    print("rows", data.n_rows, "valid", int(data.valid.sum()), "truncated", int(data.truncated.sum()),
          "max_new", case.max_new_tokens, file=sys.stderr)
    out = {}
    for name, d, patch in (("ids", data, False), ("budget_state", with_budget(data, case.max_new_tokens), False),
                           ("budget_cross", with_budget(data, case.max_new_tokens), True)):
        feats_mod.FeatureEncoder.cross_strings = cross_with_budget if patch else orig_cross
        t = make_targets("rollout", d)
        t0 = time.time()
        c = make_controller("LR_FULL").fit(t.data, y=t.y, completion_weight=t.completion_weight)
        w = t.completion_weight
        scores = c.cv_scores_ / w.sum()
        out[name] = {"gain": float(c.heldout_kl_gain_), "se": float(c.heldout_kl_gain_se_),
                     "beta": float(c.beta_), "ess": float(c.heldout_effective_samples_),
                     "best_score": float(scores.max()), "masking_score": float(scores[:, 0].max()),
                     "n_features": int(c.n_features_in_), "fit_s": time.time() - t0}
        print(name, out[name], file=sys.stderr, flush=True)
    print(json.dumps({"case": a.case, "n": a.n, "seed": a.seed, "truncated": int(data.truncated.sum()),
                      "valid": int(data.valid.sum()), "fits": out}, indent=1))

if __name__ == "__main__":
    main()
