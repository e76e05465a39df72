"""Can a γ-cache hit skip XGrammar's state dump? Two memos, measured on masked samples.

A hit needs the state's feature key, which costs XGrammar's state dump (about 1.3 µs of a
~2 µs XGrammar step on bv4). Two ways to get the next key without the dump:

- a transition memo, (key, accepted token) -> next key: only right if the position-free key
  determines the next key. It does not: after ``)`` or a closing quote the next items come
  from the enclosing rule, which the key leaves out. Counted here: the (key, token) pairs seen
  with more than one next key, and the share of steps on such pairs;
- a token-prefix trie (what the XGrammar plugin does): a matcher's state is a function of the
  tokens it accepted, so a prefix seen before gives its key exactly. Counted here: the share of
  steps of 32 fresh samples whose prefix is among those of 32 earlier samples or of the fresh
  samples before them (the trie fills as decoding goes).

    python benchmarks/gamma_mask_cost_transitions.py [--grammars bv4,json,sql] [--samples 32]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

torch.set_num_threads(1)

from shim_adapters.backends.registry import get_backend  # noqa: E402
from shim_adapters.grammars.grammar import builtin_grammar  # noqa: E402
from shim_adapters.lm.generation import generate_masked  # noqa: E402
from shim_adapters.lm.loading import load_lm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grammars", default="bv4,json,sql")
    parser.add_argument("--samples", type=int, default=32)
    args = parser.parse_args()
    lm = load_lm(None)
    print("| grammar | steps | (key, token) pairs | pairs with >1 next key | steps on those "
          "pairs | trie: prefix known, fresh samples |")
    print("|---|---|---|---|---|---|")
    for name in args.grammars.split(","):
        grammar = builtin_grammar(name)
        masker = get_backend("xgrammar").compile(grammar, lm.tokenizer, lm.vocab_size)
        out = generate_masked(lm.model, lm.tokenizer, masker, grammar.default_prompt,
                              2 * args.samples, max_new_tokens=96, seed=3)
        nexts, pairs = defaultdict(set), []
        prefixes, known, fresh = set(), 0, 0
        for i, seq in enumerate(out.token_ids):
            state, prefix = masker.new_state(), ()
            for token in seq:
                if state.is_finished:
                    break
                key = state.dumped_feature_key()
                if i >= args.samples:
                    fresh += 1
                    known += prefix in prefixes
                prefixes.add(prefix)
                state.advance(token)
                nexts[(key, token)].add(state.dumped_feature_key())
                pairs.append((key, token))
                prefix += (token,)
        ambiguous = {p for p, n in nexts.items() if len(n) > 1}
        on = sum(p in ambiguous for p in pairs)
        print(f"| {name} | {len(pairs)} | {len(nexts)} | {len(ambiguous)} | "
              f"{on / len(pairs):.3f} | {known / max(1, fresh):.2f} |", flush=True)
    print(f"\n{2 * args.samples} masked samples of the shipped LM per grammar (seed 3), "
          f"position-free keys")


if __name__ == "__main__":
    main()
