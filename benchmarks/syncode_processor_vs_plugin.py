"""SynCode's own ``grammar_strict`` processor and the shim-syncode plugin, side by side.

Feeds a prefix token by token and prints, per step, how many tokens each allows and how many
both allow (2026-12-01, commit 43aaf84, SmolLM2: after '(def' (bv4), 'SELECT iredry FROM'
(sql) and '-0\\n' (json) SynCode allows only EOS tokens, the plugin allows the
continuations)::

    python benchmarks/syncode_processor_vs_plugin.py bv4 '(def' --lm smollm2
"""

from __future__ import annotations

import argparse
import tempfile


def main() -> int:
    import numpy as np
    import torch
    from shim_syncode._syncode_import import syncode_modules

    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.loading import load_lm

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("grammar", help="built-in grammar name")
    p.add_argument("prefix", help="text to feed (its plain tokenization)")
    p.add_argument("--lm", default="smollm2")
    a = p.parse_args()
    lm = load_lm(a.lm)
    tok = lm.tokenizer
    grammar = builtin_grammar(a.grammar)
    masker = get_backend("syncode").compile(grammar, tok, lm.vocab_size)
    syncode_modules()
    import syncode.common as common

    common.SYNCODE_CACHE = tempfile.mkdtemp() + "/"
    from syncode.grammar_mask.logits_processor import SyncodeLogitsProcessor
    from syncode.parsers.grammars import Grammar as SyncodeGrammar

    proc = SyncodeLogitsProcessor(SyncodeGrammar(grammar.text), tok, use_cache=False,
                                  mode="grammar_strict", num_samples=1)
    proc.reset()
    prompt = tok(grammar.default_prompt, return_tensors="pt")["input_ids"]
    ids = tok.encode(a.prefix, add_special_tokens=False)
    state = masker.new_state()
    for k in range(len(ids) + 1):
        inp = torch.cat([prompt, torch.tensor([ids[:k]], dtype=torch.long)], dim=1)
        out = proc(inp, torch.zeros(1, lm.vocab_size))[0].numpy()
        theirs = np.isfinite(out) & (out > -1e30)
        ours = state.allowed_mask()
        both = theirs[:len(ours)] & ours
        show = lambda m: [tok.convert_ids_to_tokens(int(i)) for i in np.flatnonzero(m)[:6]]  # noqa: E731
        print(f"{k} {tok.decode(ids[:k])!r}: SynCode {int(theirs.sum())} {show(theirs)}; "
              f"plugin {int(ours.sum())} {show(ours)}; both {int(both.sum())}", flush=True)
        if k < len(ids):
            state.advance(ids[k])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
