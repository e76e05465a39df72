"""The top-up of ``find_inv_bvugt_bvurem1_4bit`` refitted under two weightings of one pool.

Reproduces the fit of ``bv4-bvurem1`` (same seeds: 300 masked rollouts, then 300 from the
defensive mixture of masking and the untrusted fit) and fits the pooled set twice: with each
completion weighted by its own proposal's ratio p/q_own, and by the balance heuristic
(``fit_controller``'s choice). Prints the held-out ESS, gain and β of each.

    nice -n 5 python reports/low-ess/ess_weighting.py /work/shared/benchmarks/BV4
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from shim_adapters.controller import make_controller
from shim_adapters.evaluation.lm_views import gqa_without_copies, stop_folded
from shim_adapters.evaluation.suites import load_suite
from shim_adapters.lm import load_lm
from shim_adapters.plugins import get_backend
from shim_adapters.prompting import prefill_prompt
from shim_adapters.targets import (make_targets, masked_row_logprob, mixture_target_weights,
                                   shim_row_logprob, target_weights)
from shim_adapters.training_data import concat_training_data, sample_training_data

CASE = "find_inv_bvugt_bvurem1_4bit"


def main(data_dir: str) -> None:
    torch.set_num_threads(1)
    case = next(c for c in load_suite("bv4", data_dir).cases if c.name == CASE)
    lm = load_lm("smollm2")
    gqa_without_copies(lm)  # as run_eval does: same arithmetic, no per-head KV copies
    masker = get_backend("xgrammar").compile(case.grammar, lm.tokenizer, lm.vocab_size)
    if case.stop_at_newline:
        lm = stop_folded(lm, masker.eos_token_ids)
    pre = prefill_prompt(lm, case.prompt)

    def draw(n, seed, **kw):
        return sample_training_data(lm, masker, pre.prompt, n, seed=seed, progress=False,
                                    prefilled=pre, max_new_tokens=case.max_new_tokens, **kw)

    masked = draw(300, 1, proposal="masked")  # the seeds fit_controller uses in run_eval
    t = make_targets("rollout", masked)
    first = make_controller("LR_FULL").fit(masked, y=t.y, completion_weight=t.completion_weight)
    print(f"round 1: {first.decision_}", flush=True)
    proposer = first.untrusted_candidate()
    shim = draw(300, 1 + 1000 * 2, proposal="shim", controller=proposer, defensive=0.5)
    pool = concat_training_data([masked, shim])
    pooled = make_targets("rollout", pool)
    balance = mixture_target_weights(pool, [
        masked_row_logprob(pool),
        np.concatenate([shim_row_logprob(d, proposer, 0.5) for d in (masked, shim)])],
        [300, 300])
    for name, w in (("own-proposal ratio", target_weights(pool)), ("balance heuristic", balance)):
        c = make_controller("LR_FULL").fit(pool, y=pooled.y, completion_weight=w)
        print(f"{name}: held-out ESS {c.heldout_effective_samples_:.3g}, best β "
              f"{c.heldout_best_beta_:g}, gain {c.heldout_kl_gain_:.3g} ± "
              f"{c.heldout_kl_gain_se_:.3g}; {c.decision_}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
