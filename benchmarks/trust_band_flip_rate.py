"""How often the trust decision flips with the seed, deciding at the floor vs drawing more
evidence inside a band above it (``FitRecipe.evidence_band``).

One problem, several seeds, each rule: the fit's decision (trusted / fell back and why), its
held-out target ESS and the LM samples it spent. Flip rate: the fraction of seeds whose
decision differs from the majority decision of that rule. Shipped LM unless ``--lm``; torch on
one thread.

    python benchmarks/trust_band_flip_rate.py --grammar sql --prompt-of json --n 100 \\
        --max-samples 400 --seeds 0,1,2,3,4 --bands 1,2 --out reports/trust-band/sql-json.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.loading import load_lm
from shim_adapters.shim.fitting import FitRecipe, fit_with_recipe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grammar", default="sql")
    ap.add_argument("--prompt-of", default="json", help="built-in grammar whose prompt is used")
    ap.add_argument("--backend", default="xgrammar")
    ap.add_argument("--lm", default=None)
    ap.add_argument("--n", type=int, default=100, help="first draw (LM samples)")
    ap.add_argument("--max-samples", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--bands", default="1,2")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    lm = load_lm(a.lm)
    grammar = builtin_grammar(a.grammar)
    masker = get_backend(a.backend).compile(grammar, lm.tokenizer, lm.vocab_size)
    prompt = builtin_grammar(a.prompt_of).default_prompt
    base = FitRecipe(n_samples=a.n, max_samples=a.max_samples, max_new_tokens=a.max_new_tokens,
                     stop_at_newline=False, progress=False)
    rows = []
    for band in [float(b) for b in a.bands.split(",")]:
        for seed in [int(s) for s in a.seeds.split(",")]:
            t0 = time.perf_counter()
            c, manifest = fit_with_recipe(lm, masker, replace(base, seed=seed,
                                                              evidence_band=band), prompt)
            t = manifest["training"]
            rows.append({"band": band, "seed": seed,
                         "decision": "trusted" if not c.falls_back_to_masking_ else
                         f"fallback:{c.fallback_reason_}",
                         "beta": c.beta_, "heldout_ess": c.heldout_effective_samples_,
                         "heldout_kl_gain": c.heldout_kl_gain_,
                         "heldout_kl_gain_se": c.heldout_kl_gain_se_,
                         "lm_samples": t["lm_samples_total"],
                         "p_valid_estimate": t.get("p_valid_estimate_pooled",
                                                   t["p_valid_estimate"]),
                         "rounds": [r.get("kind") for r in t["rounds"]],
                         "seconds": time.perf_counter() - t0})
            print(json.dumps(rows[-1]), flush=True)
    summary = {}
    for band in sorted({r["band"] for r in rows}):
        ds = [r["decision"] for r in rows if r["band"] == band]
        trusted = [r["decision"] == "trusted" for r in rows if r["band"] == band]
        majority = Counter(trusted).most_common(1)[0][0]
        summary[str(band)] = {
            "decisions": ds,
            "flip_rate": sum(t != majority for t in trusted) / len(trusted),
            "mean_lm_samples": sum(r["lm_samples"] for r in rows if r["band"] == band) / len(ds)}
    out = {"grammar": a.grammar, "prompt_of": a.prompt_of, "backend": a.backend,
           "lm": lm.identifier, "n": a.n, "max_samples": a.max_samples, "rows": rows,
           "summary": summary}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
