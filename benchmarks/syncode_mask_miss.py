"""Per-miss cost of the SynCode plugin's mask (memo off), at 1k and 50k vocabularies.

A miss is one ``SyncodeMaskerState._compute_mask`` call: SynCode's store lookup plus the
plugin's corrections, of which the per-candidate ``would_accept`` loop over tokens spanning
several lexemes dominates. States come from masked random walks over the built-in json
grammar; each state's mask is computed ``--repeats`` times and the median kept. One torch
thread. Usage: ``python benchmarks/syncode_mask_miss.py [--walks 4] [--steps 40]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def states_of_walks(masker, walks: int, steps: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(walks):
        state = masker.new_state()
        for _ in range(steps):
            mask = state.allowed_mask()
            mask[list(masker.eos_token_ids)] = False
            ids = np.flatnonzero(mask)
            if not len(ids):
                break
            out.append(state.fork())
            state.advance(int(rng.choice(ids)))
    return out


def per_miss(masker, states, repeats: int) -> tuple[float, float, float]:
    """Median and p90 ms per miss, and the mean number of span candidates checked."""
    times, spans = [], []
    for state in states:
        runs = []
        for _ in range(repeats):
            state._mask = None
            start = time.perf_counter()
            state._compute_mask()
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
        spans.append(_span_candidates(state))
    times.sort()
    return (1e3 * times[len(times) // 2], 1e3 * times[int(0.9 * (len(times) - 1))],
            float(np.mean(spans)))


def _span_candidates(state) -> int:
    parser, compiled = state._parser, state.masker.compiled
    if compiled.dynamic is not None:
        return 0
    firsts = {seq[0] for seq in parser.result.accept_sequences}
    total = np.zeros(len(compiled.token_bytes), dtype=np.bool_)
    for fsm_state in parser.remainder_fsm_states:
        if fsm_state.terminal in firsts:
            extra = compiled.span_candidates.get((fsm_state.terminal, fsm_state.state_id))
            if extra is not None:
                total |= extra
    return int(total.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from shim_adapters.grammar import builtin_grammar
    from shim_adapters.lm import load_lm
    from shim_adapters.tokenizers_offline import load_offline_tokenizer
    from shim_syncode.masker import compile_masker

    grammar = builtin_grammar("json")
    tokenizers = {"shipped (1k)": load_lm(None).tokenizer,
                  "gpt2 (50k)": load_offline_tokenizer("gpt2")}
    print("| tokenizer | vocab | compile s | states | miss p50 ms | miss p90 ms | "
          "span candidates / miss |")
    print("|---|---|---|---|---|---|---|")
    for name, tok in tokenizers.items():
        start = time.perf_counter()
        masker = compile_masker(grammar, tok, memoize_masks=False)
        compile_s = time.perf_counter() - start
        states = states_of_walks(masker, args.walks, args.steps)
        p50, p90, spans = per_miss(masker, states, args.repeats)
        print(f"| {name} | {len(tok)} | {compile_s:.1f} | {len(states)} | {p50:.2f} | "
              f"{p90:.2f} | {spans:.0f} |", flush=True)


if __name__ == "__main__":
    main()
