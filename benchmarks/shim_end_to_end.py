"""End-to-end time per generated token: SHIM vs XGrammar's own HF processor, side by side.

The shipped LM samples ``max_new_tokens`` under three processors in one run, interleaved per
repeat: XGrammar's ``xgrammar.contrib.hf.LogitsProcessor`` (plain masking), the project's
``ShimLogitsProcessor`` over the XGrammar masker, and ``shim_xgrammar.wrap.with_shim`` around
XGrammar's processor. Time per token = generate wall time / tokens generated (all rows), best
of ``--repeats``. Torch pinned to one thread.

    python benchmarks/shim_end_to_end.py [--grammars bv4,json] [--batches 1,16,32]
"""

from __future__ import annotations

import argparse
import time

import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402

from shim_adapters.controller import fit_controller  # noqa: E402
from shim_adapters.correction import ShimLogitsProcessor  # noqa: E402
from shim_adapters.generation import FAITHFUL_SAMPLING  # noqa: E402
from shim_adapters.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm import load_lm  # noqa: E402
from shim_adapters.plugins import get_backend  # noqa: E402


def run(lm, processor, prompt, batch, max_new_tokens, eos, seed):
    enc = lm.tokenizer([prompt] * batch, return_tensors="pt")
    torch.manual_seed(seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = lm.model.generate(**enc, logits_processor=[processor],
                                max_new_tokens=max_new_tokens, eos_token_id=eos,
                                pad_token_id=eos[0], **FAITHFUL_SAMPLING)
    seconds = time.perf_counter() - t0
    gen = out[:, enc["input_ids"].shape[1]:]
    tokens = int((gen != eos[0]).sum()) + batch
    return seconds / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammars", default="bv4,json")
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--position-free", action="store_true",
                        help="XGrammar features without byte offsets (start_positions=none, "
                             "position_feature=False)")
    args = parser.parse_args()
    from shim_xgrammar.wrap import with_shim

    lm = load_lm(None)
    backend = get_backend("xgrammar")
    print("| grammar | batch | XGrammar HF µs/token | ShimLogitsProcessor µs/token | ratio | "
          "with_shim µs/token | ratio |")
    print("|---|---|---|---|---|---|---|")
    for gname in args.grammars.split(","):
        grammar = builtin_grammar(gname)
        options = dict(start_positions="none", position_feature=False) if \
            args.position_free else {}
        masker = backend.compile(grammar, lm.tokenizer, lm.vocab_size, **options)
        controller, manifest = fit_controller(lm, masker, kind="LR_FULL", n_samples=120,
                                              max_new_tokens=64, progress=False, n_splits=2,
                                              beta_grid=(1.0,), reg_grid=(1.0,), seed=0)
        eos = sorted(masker.eos_token_ids)
        for batch in (int(b) for b in args.batches.split(",")):
            best = {"xgr": float("inf"), "shim": float("inf"), "wrap": float("inf")}
            for rep in range(args.repeats):
                procs = {
                    "xgr": xgr.contrib.hf.LogitsProcessor(masker.compiled),
                    "shim": ShimLogitsProcessor([masker.new_state() for _ in range(batch)],
                                                controller),
                    "wrap": None if args.position_free else with_shim(xgr.contrib.hf.LogitsProcessor(masker.compiled),
                                      (controller, manifest), tokenizer=lm.tokenizer,
                                      grammar=grammar, batch_size=batch),
                }
                for name, proc in procs.items():
                    if proc is None:  # with_shim builds its masker with the default features
                        continue
                    best[name] = min(best[name], run(lm, proc, grammar.default_prompt, batch,
                                                     args.max_new_tokens, eos, seed=rep))
            x = best["xgr"]
            print(f"| {gname} | {batch} | {x * 1e6:.0f} | {best['shim'] * 1e6:.0f} | "
                  f"{best['shim'] / x:.2f} | {best['wrap'] * 1e6:.0f} | {best['wrap'] / x:.2f} |"
                  + (" (position-free features)" if args.position_free else ""),
                  flush=True)
    print(f"\nbest of {args.repeats} repeats; {args.max_new_tokens} new tokens; torch threads "
          f"= {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
