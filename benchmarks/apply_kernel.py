"""Masking a batch of logits with a packed bitmask: three CPU kernels side by side, on real masks.

The masks are those XGrammar's fill gives along masked samples of the shipped LM (bv4: a
handful of tokens allowed; json: about half), re-tokenised for GPT-2 (50k) and Qwen2.5 (152k).
Each batch of ``B`` rows is drawn from them and masked by:

- ``xgrammar``: ``xgrammar.apply_token_bitmask_inplace`` (XGrammar's CPU kernel, used by its
  HF processor);
- ``core``: :func:`shim_adapters.mask.bitmask.apply_token_bitmask_` (numpy: the forbidden bits
  unpacked, one ``copyto``), which shim-xgrammar uses on CPU;
- ``torch bit ops``: the core's device path, run on CPU
  (:func:`shim_adapters.mask.bitmask.apply_token_bitmask_torch_`: shifts and ``masked_fill_``).

Every kernel's result is checked equal to the core's. XGrammar's kernel runs on a view of a
buffer one row longer than the batch: at widths that are not a multiple of 32 it can write one
float past a row (docs/upstream-reports.md), and the spare row keeps that write off the heap.
Medians in µs per batch, torch on one thread.

    python benchmarks/apply_kernel.py [--batches 1,16,32] [--samples 24]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)

import xgrammar as xgr  # noqa: E402

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.grammars.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm.generation import generate_masked  # noqa: E402
from shim_adapters.lm.loading import load_lm  # noqa: E402
from shim_adapters.mask.bitmask import (  # noqa: E402
    allocate_token_bitmask,
    apply_token_bitmask_,
    apply_token_bitmask_torch_,
)
from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer, offline_logits_width  # noqa: E402,E501

_here = Path(__file__).resolve().parent
_spec = importlib.util.spec_from_file_location("gamma_mask_cost", _here / "gamma_mask_cost.py")
_gmc = importlib.util.module_from_spec(_spec)
sys.modules["gamma_mask_cost"] = _gmc
_spec.loader.exec_module(_gmc)


def real_rows(masker, seqs) -> np.ndarray:
    """The bitmask row of every state along ``seqs`` (EOS step excluded)."""
    rows = []
    for seq in seqs:
        state = masker.new_state()
        for token in seq[:-1]:
            bitmask = allocate_token_bitmask(1, masker.vocab_size)
            state.fill_next_token_bitmask(bitmask, 0)
            rows.append(bitmask.numpy()[0].copy())
            state.advance(token)
    return np.array(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,16,32")
    parser.add_argument("--samples", type=int, default=24)
    parser.add_argument("--grammars", default="bv4,json")
    args = parser.parse_args()
    lm = load_lm(None)
    backend = get_backend("xgrammar")
    print("| grammar | tokenizer | vocab | batch | allowed share | xgrammar µs | core µs | "
          "torch bit ops µs | xgrammar / core | torch bit ops / core |")
    print("|" + "---|" * 10)
    for gname in args.grammars.split(","):
        grammar = builtin_grammar(gname)
        own = backend.compile(grammar, lm.tokenizer, lm.vocab_size)
        masked = generate_masked(lm.model, lm.tokenizer, own, grammar.default_prompt,
                                 args.samples, max_new_tokens=96, seed=2)
        texts = [t for t, c in zip(masked.texts, masked.complete) if c]
        for tname in ("shipped", "gpt2", "qwen2.5"):
            if tname == "shipped":
                masker, width = own, lm.vocab_size
            else:
                width = offline_logits_width(tname)
                masker = backend.compile(grammar, load_offline_tokenizer(tname), width)
            rows = real_rows(masker, _gmc.replayable(masker, texts))
            share = np.unpackbits(rows.view(np.uint8), axis=1, count=width,
                                  bitorder="little").mean()
            for batch in (int(b) for b in args.batches.split(",")):
                rng = np.random.default_rng(batch)
                times = {"xgrammar": [], "core": [], "torch": []}
                for _ in range(20 if width > 100_000 else 60):
                    bitmask = torch.from_numpy(rows[rng.integers(0, len(rows), batch)].copy())
                    base = torch.randn(batch, width)
                    spare = torch.empty((batch + 1) * width)
                    for name in times:
                        if name == "xgrammar":
                            logits = spare[:batch * width].view(batch, width)
                            logits.copy_(base)
                        else:
                            logits = base.clone()
                        t0 = time.perf_counter()
                        if name == "xgrammar":
                            xgr.apply_token_bitmask_inplace(logits, bitmask)
                        elif name == "core":
                            apply_token_bitmask_(logits, bitmask)
                        else:
                            apply_token_bitmask_torch_(logits, bitmask)
                        times[name].append(time.perf_counter() - t0)
                        if name == "xgrammar":
                            reference = logits.clone()
                        elif not torch.equal(logits, reference):
                            raise RuntimeError(f"{name} differs from XGrammar's kernel at "
                                               f"{gname}/{tname}/batch {batch}")
                med = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
                print(f"| {gname} | {tname} | {width} | {batch} | {share:.3f} | "
                      f"{med['xgrammar']:.1f} | {med['core']:.1f} | {med['torch']:.1f} | "
                      f"{med['xgrammar'] / med['core']:.2f} | {med['torch'] / med['core']:.2f} |",
                      flush=True)
    print(f"\nmedians over batches of real masks; torch threads = {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
