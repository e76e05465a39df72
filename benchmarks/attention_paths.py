"""Masked rollouts per second with the loaded LM's attention against transformers' stock SDPA.

``load_lm`` switches a grouped-query model (SmolLM2) to attention that reads the KV cache in
place and shares one copy of the prompt's KV across a batch (``shim_adapters.lm.views``); the
stock path (transformers 4.x ``sdpa``) repeats every cached key and value per query head and per
row at every step. Both paths draw the same masked rollouts (the rows ``shim fit`` trains on)
in one process, alternating, torch on one thread; the log-probabilities of the drawn tokens are
compared too (same arithmetic: they agree to float rounding).

    python benchmarks/attention_paths.py --data ../shared/benchmarks --suite spider --case spider-0000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

SUITE_FOLDERS = {"bv4": ("BV4", "xgrammar"), "slia": ("SLIA", "xgrammar"),
                 "cp": ("CP", "xgrammar"), "spider": ("spider", "syncode")}


def shared_prefix_difference(a, b) -> tuple[float, int, int]:
    """Largest |Δ log p| between two draws with the same seed, over each completion's tokens up
    to where the two first differ (a rounding difference may flip a later draw); returns it
    with the number of tokens compared and the number drawn."""
    diff, compared, total = 0.0, 0, 0
    for i in range(min(a.n_completions, b.n_completions)):
        ta, tb = a.completion_tokens(i), b.completion_tokens(i)
        la = a.completion_token_logprobs[a.completion_offsets[i]:a.completion_offsets[i + 1]]
        lb = b.completion_token_logprobs[b.completion_offsets[i]:b.completion_offsets[i + 1]]
        n = min(len(ta), len(tb))
        k = int(np.argmax(ta[:n] != tb[:n])) if np.any(ta[:n] != tb[:n]) else n
        if k:
            diff = max(diff, float(np.max(np.abs(la[:k].astype(np.float64) - lb[:k]))))
        compared, total = compared + k, total + len(ta)
    return diff, compared, total


def main(argv: list[str] | None = None) -> int:
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.evaluation.suites import load_suite
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.lm.views import GQA_ATTENTION, stop_folded, uses_split_attention
    from shim_adapters.shim.training_data import sample_training_data

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="the benchmarks folder (BV4/, spider/, ...)")
    p.add_argument("--suite", default="spider", choices=sorted(SUITE_FOLDERS))
    p.add_argument("--case", default="spider-0000")
    p.add_argument("--lm", default="smollm2")
    p.add_argument("--n", type=int, default=32, help="rollouts per timed run (one batch)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    folder, backend = SUITE_FOLDERS[a.suite]
    case = load_suite(a.suite, Path(a.data) / folder).select([a.case]).cases[0]
    lm = load_lm(a.lm)
    if not uses_split_attention(lm.model):
        raise SystemExit(f"{a.lm}: no grouped-query attention to compare (nothing switched)")
    masker = get_backend(backend).compile(case.grammar, lm.tokenizer, lm.vocab_size)
    view = stop_folded(lm, masker.eos_token_ids) if case.stop_at_newline is True else lm
    prompt_tokens = int(lm.tokenizer(case.prompt, return_tensors="pt").input_ids.shape[1])
    paths = {"in place, shared prompt KV (load_lm)": GQA_ATTENTION, "stock sdpa": "sdpa"}
    seconds: dict[str, list[float]] = {k: [] for k in paths}
    drawn: dict[str, object] = {}
    for r in range(a.repeats):
        for name, implementation in paths.items():
            lm.model.config._attn_implementation = implementation
            t0 = time.perf_counter()
            data = sample_training_data(view, masker, case.prompt, a.n, batch_size=a.n,
                                        max_new_tokens=a.max_new_tokens, proposal="masked",
                                        seed=r, progress=False)
            seconds[name].append(time.perf_counter() - t0)
            drawn[name] = data
        diff, compared, total = shared_prefix_difference(*drawn.values())
        print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.1f} s" for k, v in seconds.items()) +
              f"; max |Δ log p| {diff:.2e} over the {compared} of {total} drawn tokens before "
              f"the two draws first differ", flush=True)
    lm.model.config._attn_implementation = GQA_ATTENTION
    median = {k: float(np.median(v)) for k, v in seconds.items()}
    fast, stock = median.values()
    out = {"suite": a.suite, "case": a.case, "lm": lm.identifier, "prompt_tokens": prompt_tokens,
           "rollouts": a.n, "max_new_tokens": a.max_new_tokens, "seconds": seconds,
           "rollouts_per_second": {k: a.n / v for k, v in median.items()},
           "speedup": stock / fast, "max_abs_logprob_difference": diff,
           "tokens_compared": compared, "tokens_drawn": total}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
