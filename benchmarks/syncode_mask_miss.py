"""Per-miss cost of the SynCode plugin's mask (memo off): the bulk path against the per-token
reference, side by side on the same states, at 1k / 50k / 152k vocabularies.

A miss is one mask computation with the memo off: SynCode's store lookup plus the plugin's
corrections. ``new`` is ``SyncodeMaskerState._compute_mask`` (span candidates ruled out in bulk
by :mod:`shim_syncode.span_filter`, UTF-8 rules as array operations); ``reference`` is
:func:`shim_syncode.reference_mask.reference_mask` (every span candidate checked by the parser,
the previous production path). States come from masked random walks over the built-in json
grammar; each state's mask is computed ``--repeats`` times by each path, interleaved, and the
medians kept; the two masks are compared on every state. The first pass (which builds the span
filter's per-(terminal, DFA state) groups) is timed apart. One torch thread.

    python benchmarks/syncode_mask_miss.py [--walks 4] [--steps 40] [--tokenizers 1k,gpt2,qwen2.5]
        [--json benchmarks/results/syncode_mask_miss.json]
"""

from __future__ import annotations

import argparse
import json
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


def _timed(fn, state) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    mask = fn(state)
    return time.perf_counter() - start, mask


def measure(masker, states, repeats: int) -> dict:
    from shim_syncode import frontier_parser
    from shim_syncode.reference_mask import reference_mask

    def new(state):
        return state._compute_mask()

    start = time.perf_counter()
    for state in states:  # first pass: builds the span filter's groups on first use
        new(state)
    first_pass = time.perf_counter() - start
    checks = [0]
    original = frontier_parser.FrontierParser.would_accept

    def counting(self, data):
        checks[0] += 1
        return original(self, data)

    new_t, ref_t, spans, new_checks, mismatches = [], [], [], [], 0
    for state in states:
        runs_new, runs_ref = [], []
        for _ in range(repeats):
            t_ref, ref_mask = _timed(reference_mask, state)
            t_new, new_mask = _timed(new, state)
            runs_ref.append(t_ref)
            runs_new.append(t_new)
        mismatches += int(not np.array_equal(new_mask, ref_mask))
        frontier_parser.FrontierParser.would_accept = counting
        checks[0] = 0
        new(state)
        new_checks.append(checks[0])
        frontier_parser.FrontierParser.would_accept = original
        new_t.append(statistics.median(runs_new))
        ref_t.append(statistics.median(runs_ref))
        spans.append(_span_candidates(state))

    def pct(values, q):
        values = sorted(values)
        return 1e3 * values[int(q * (len(values) - 1))]

    return {"states": len(states), "mismatching_masks": mismatches,
            "new_p50_ms": pct(new_t, 0.5), "new_p90_ms": pct(new_t, 0.9),
            "ref_p50_ms": pct(ref_t, 0.5), "ref_p90_ms": pct(ref_t, 0.9),
            "new_mean_ms": 1e3 * float(np.mean(new_t)), "ref_mean_ms": 1e3 * float(np.mean(ref_t)),
            "span_candidates_per_miss": float(np.mean(spans)),
            "parser_checks_per_miss_new": float(np.mean(new_checks)),
            "first_pass_s": first_pass}


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


def _table_build_seconds(compiled) -> float:
    """Seconds to build the tables this change added (span filter, UTF-8 table) again."""
    from shim_syncode.span_filter import SpanFilter
    from shim_syncode.utf8_table import Utf8Continuations

    pool = np.zeros(len(compiled.token_bytes), dtype=np.bool_)
    for mask in compiled.span_candidates.values():
        pool |= mask
    start = time.perf_counter()
    SpanFilter(compiled.tables, compiled.token_bytes, pool, compiled.inside_lexeme)
    Utf8Continuations(compiled.token_bytes)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--walks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokenizers", default="1k,gpt2,qwen2.5")
    parser.add_argument("--json", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from shim_syncode.masker import compile_masker

    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.loading import load_lm
    from shim_adapters.mask.tokenizers_offline import load_offline_tokenizer

    grammar = builtin_grammar("json")
    rows = []
    print("| tokenizer | vocab | compile s | + new tables s | states | span candidates / miss "
          "| parser checks / miss (new) | new p50 ms | new p90 ms | reference p50 ms "
          "| reference p90 ms | p50 speed-up | first pass s | masks differing |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.tokenizers.split(","):
        tok = load_lm(None).tokenizer if name == "1k" else load_offline_tokenizer(name)
        start = time.perf_counter()
        masker = compile_masker(grammar, tok, memoize_masks=False)
        compile_s = time.perf_counter() - start
        tables_s = _table_build_seconds(masker.compiled)
        states = states_of_walks(masker, args.walks, args.steps)
        row = {"tokenizer": name, "vocab": len(tok), "compile_s": compile_s,
               "new_tables_s": tables_s, **measure(masker, states, args.repeats)}
        rows.append(row)
        print(f"| {name} | {len(tok)} | {compile_s:.1f} | {tables_s:.2f} | {row['states']} | "
              f"{row['span_candidates_per_miss']:.0f} | {row['parser_checks_per_miss_new']:.1f} | "
              f"{row['new_p50_ms']:.3f} | {row['new_p90_ms']:.3f} | {row['ref_p50_ms']:.2f} | "
              f"{row['ref_p90_ms']:.2f} | {row['ref_p50_ms'] / row['new_p50_ms']:.0f}x | "
              f"{row['first_pass_s']:.2f} | {row['mismatching_masks']} |", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"grammar": "json", "walks": args.walks, "steps": args.steps,
                       "repeats": args.repeats, "torch_threads": 1, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
