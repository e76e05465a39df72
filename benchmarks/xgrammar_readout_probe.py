"""XGrammar's readout on a real LM: held-out gain of LR_FULL with position-free vs absolute features.

Masked rollouts do not depend on the features (the masks are the same), so one seed draws the
same completions under both readouts; only the recorded states differ. Per case: 300 masked
rollouts (seed 0) with the default position-free readout and with the absolute one
(``start_positions="absolute", position_feature=True``), one LR_FULL fit each; printed: the
held-out KL gain over masking ± SE, the held-out target ESS and the feature count.

    python benchmarks/xgrammar_readout_probe.py bv4 ../shared/benchmarks/BV4 find_inv_bvsge_bvneg_4bit,find_inv_bvugt_bvneg_4bit
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.suites import load_suite
from shim_adapters.lm.loading import load_lm
from shim_adapters.shim.controller import make_controller
from shim_adapters.shim.fitting import FitRecipe, prepare_prompt
from shim_adapters.shim.targets import make_targets
from shim_adapters.shim.training_data import sample_training_data


def main() -> None:
    torch.set_num_threads(1)
    suite, folder, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    lm = load_lm("smollm2")
    for name in cases:
        case = load_suite(suite, folder).select([name]).cases[0]
        for label, opts in (
            ("position-free", {}),
            ("absolute", dict(start_positions="absolute", position_feature=True)),
        ):
            masker = get_backend("xgrammar").compile(
                case.grammar, lm.tokenizer, lm.vocab_size, **opts
            )
            recipe = FitRecipe(
                max_new_tokens=case.max_new_tokens,
                stop_at_newline=case.stop_at_newline,
                seed=0,
                progress=False,
            )
            prepared = prepare_prompt(lm, masker, case.prompt, recipe)
            t0 = time.time()
            data = sample_training_data(
                prepared.lm,
                masker,
                case.prompt,
                300,
                max_new_tokens=case.max_new_tokens,
                proposal="masked",
                prefilled=prepared.prefilled,
                seed=0,
                progress=False,
            )
            t = make_targets("rollout", data)
            c = make_controller("LR_FULL").fit(t.data, y=t.y, completion_weight=t.completion_weight)
            print(
                json.dumps(
                    {
                        "case": name,
                        "readout": label,
                        "tokens_sha": hashlib.sha256(
                            data.completion_token_ids.tobytes()
                        ).hexdigest()[:12],
                        "gain": round(float(c.heldout_kl_gain_), 4),
                        "se": round(float(c.heldout_kl_gain_se_), 4),
                        "ess": round(float(c.heldout_effective_samples_), 1),
                        "beta": c.beta_,
                        "n_features": int(c.n_features_in_),
                        "seconds": round(time.time() - t0),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
