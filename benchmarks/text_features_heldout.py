"""Token ids alone vs features that see the token's text (``FitRecipe.text_features``), on one
shared draw per case: the held-out KL gain over masking (nats per target sample, cross-
validated, as the fit's trust decision reads it), fit time and artefact size of each, and the
paired difference on (text features - token ids) with its SE (same completions and weights).

    python benchmarks/text_features_heldout.py --cases json,sql --n 300 \\
        --out reports/text-features/shipped-lm.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.loading import load_lm
from shim_adapters.shim.fitting import (
    FitRecipe,
    InProcessRollouts,
    draw_first,
    fit_with_recipe,
    prepare_prompt,
)
from shim_adapters.shim.targets import target_weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="json,sql", help="built-in grammars (their prompts)")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--lm", default=None)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_lm(a.lm)
    rows = []
    for name in a.cases.split(","):
        grammar = builtin_grammar(name)
        masker = get_backend(a.backend).compile(grammar, lm.tokenizer, lm.vocab_size)
        recipe = FitRecipe(n_samples=a.n, max_samples=None, max_new_tokens=a.max_new_tokens,
                           seed=a.seed, stop_at_newline=False, progress=False)
        prepared = prepare_prompt(lm, masker, grammar.default_prompt, recipe)
        rollouts = InProcessRollouts(prepared.lm, masker, prepared.prefilled,
                                     max_new_tokens=a.max_new_tokens, progress=False)
        t0 = time.perf_counter()
        first = draw_first(rollouts, recipe)
        sample_seconds = time.perf_counter() - t0
        heldout = {}
        for text in ("off", "on"):
            with tempfile.TemporaryDirectory() as out:
                t0 = time.perf_counter()
                c, manifest = fit_with_recipe(lm, masker, replace(recipe, text_features=text),
                                              grammar.default_prompt, prepared=prepared,
                                              first=first, output_dir=out)
                seconds = time.perf_counter() - t0
                size = sum(f.stat().st_size for f in Path(out).iterdir())
            heldout[text] = c.heldout_per_completion_
            rows.append({"case": name, "text_features": text, "n": a.n,
                         "heldout_kl_gain": c.heldout_kl_gain_,
                         "heldout_kl_gain_se": c.heldout_kl_gain_se_,
                         "heldout_ess": c.heldout_effective_samples_, "beta": c.beta_,
                         "decision": c.decision_, "n_features": int(c.n_features_in_),
                         "fit_seconds": seconds, "sample_seconds": sample_seconds,
                         "artefact_bytes": size,
                         "p_valid_estimate": manifest["training"]["p_valid_estimate"]})
            print(json.dumps(rows[-1]), flush=True)
        w = target_weights(first.data)
        p = w / w.sum()
        d = heldout["on"] - heldout["off"]
        diff = float(d @ p)
        rows.append({"case": name, "paired_difference_on_minus_off": diff,
                     "paired_difference_se": float(np.sqrt(np.sum(p ** 2 * (d - diff) ** 2)))})
        print(json.dumps(rows[-1]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"lm": lm.identifier, "backend": a.backend,
                                       "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
