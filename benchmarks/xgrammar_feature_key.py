"""Does a position-free XGrammar feature key cost held-out KL? (and what it buys in γ hits)

Two feature sets for the XGrammar plugin, on the same unconstrained samples of the shipped LM
(same seed): ``absolute`` (Earley items with absolute start offsets + the byte position: the
default) and ``position-free`` (``start_positions="none"``, ``position_feature=False``). For
each, LR_FULL is fitted with the default grids and its held-out KL gain over masking
(``heldout_kl_gain_`` ± SE, nats per target sample; higher is better) is reported, then the γ
cache's hit rate while sampling 32 masked completions with that controller.

    python benchmarks/xgrammar_feature_key.py [--n 300] [--grammars json,bv4]
"""

from __future__ import annotations

import argparse

import torch

torch.set_num_threads(1)

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.grammars.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm.generation import generate_masked  # noqa: E402
from shim_adapters.lm.loading import load_lm  # noqa: E402
from shim_adapters.shim.controller import LR_FULL  # noqa: E402
from shim_adapters.shim.correction import ShimAdjuster  # noqa: E402
from shim_adapters.shim.training_data import sample_training_data  # noqa: E402

VARIANTS = {"absolute": dict(start_positions="absolute", position_feature=True),
            "position-free": dict(start_positions="none", position_feature=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=300)
    parser.add_argument("--grammars", default="json,bv4")
    args = parser.parse_args()
    lm = load_lm(None)
    backend = get_backend("xgrammar")
    print("| grammar | features | valid | KL gain vs masking (nats) | SE | β | decision | "
          "γ hit rate | head-skip rate | cache KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for gname in args.grammars.split(","):
        grammar = builtin_grammar(gname)
        for vname, opts in VARIANTS.items():
            masker = backend.compile(grammar, lm.tokenizer, lm.vocab_size, **opts)
            data = sample_training_data(lm, masker, grammar.default_prompt, args.n,
                                        max_new_tokens=96, seed=0, progress=False)
            ctrl = LR_FULL().fit(data)
            adj = ShimAdjuster(ctrl)
            generate_masked(lm.model, lm.tokenizer, masker, grammar.default_prompt, 32,
                            max_new_tokens=96, adjuster=adj, seed=1)
            info = adj.cache_info()
            print(f"| {gname} | {vname} | {data.valid.mean():.2f} | "
                  f"{ctrl.heldout_kl_gain_:.4f} | {ctrl.heldout_kl_gain_se_:.4f} | "
                  f"{ctrl.beta_:g} | {'masking' if ctrl.falls_back_to_masking_ else 'SHIM'} | "
                  f"{info['hit_rate']:.2f} | {info['head_skip_rate']:.2f} | "
                  f"{info['bytes'] / 1024:.0f} |", flush=True)


if __name__ == "__main__":
    main()
