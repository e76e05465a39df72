"""The SynCode masker's mask computed token by token: the specification of the fast path.

:meth:`SyncodeMaskerState._compute_mask` rules out span candidates in bulk
(:mod:`shim_syncode.span_filter`) and applies UTF-8 rules as array operations
(:mod:`shim_syncode.utf8_table`). This module keeps the direct definition they must equal:
every multi-lexeme candidate checked with the parser, every mid-character token with
:func:`utf8_prefix_ok`. Tests compare the two on every state of many walks; the benchmark
times both. Not used in decoding.
"""

from __future__ import annotations

import numpy as np

from shim_adapters.mask.utf8 import utf8_prefix_ok


def reference_mask(state) -> np.ndarray:
    """The mask of a :class:`SyncodeMaskerState`, each span candidate checked by the parser."""
    masker = state.masker
    compiled = masker.compiled
    parser = state._parser
    out = np.zeros(masker.vocab_size, dtype=np.bool_)
    if state._finished or state._broken is not None:
        return out
    n = len(compiled.token_bytes)
    token_bytes = compiled.token_bytes
    spans = np.zeros(n, dtype=np.bool_)
    if state._dynamic:
        out[:n] = parser.mask()
    else:
        result = parser.result
        allowed = compiled.mask_store._lookup_next_tokens(
            parser.remainder_fsm_states, result.remainder_state, result.accept_sequences)
        out[:n] = allowed.numpy() & ~compiled.tab_tokens
        firsts = {seq[0] for seq in result.accept_sequences}
        for fsm_state in parser.remainder_fsm_states:
            if fsm_state.terminal in firsts:
                key = (fsm_state.terminal, fsm_state.state_id)
                extra = compiled.inside_lexeme.get(key)
                if extra is not None:
                    out[:n] |= extra
                extra = compiled.span_candidates.get(key)
                if extra is not None:
                    spans |= extra
    out[masker._always_off] = False
    pending = parser.pending_bytes
    if not pending:
        out[:n] &= compiled.utf8_clean
    else:  # mid-character: keep the tokens that continue it validly
        for i in np.flatnonzero(out[:n]):
            out[i] = utf8_prefix_ok(pending + token_bytes[i])
    # Tokens spanning several lexemes, which SynCode's store never allows: check each one.
    spans &= ~out[:n]
    spans &= ~masker._always_off[:n]
    for i in np.flatnonzero(spans):
        if utf8_prefix_ok(pending + token_bytes[i]) and parser.would_accept(token_bytes[i]):
            out[i] = True
    eos = parser.accepts_end
    for i in masker.eos_token_ids:
        out[i] = eos
    return out
