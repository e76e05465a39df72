"""Regex and JSON-schema masking through outlines_core's token index (a DFA over tokens).

outlines_core compiles a regex (a JSON schema is first lowered to a regex by its own
``build_regex_from_schema``) together with the vocabulary into an ``Index``: DFA states and, per
state, the tokens that keep the output a prefix of the language. The DFA state id is the whole
state, so it *is* the lexer-state feature, read exactly; there is no parser (parser state
missing) and no notion of a lexeme (partial lexeme missing).

A state here is just the DFA state id over the shared, immutable ``Index``: forks are free.
(``outlines_core.Guide`` is a cursor over the same index; copying one serialises the whole
index, so it is not used per row.) Masks are a pure function of the DFA
state and are memoised per masker as packed bits.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

from shim_adapters.errors import GrammarError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.protocol import FeatureStatus, Masker, MaskerState, StateFeatures

from .caching import LRUCache
from .masks import bit_is_set, bitmask_to_bool, resolve_eos, resolve_width
from .vocabulary import outlines_core_version, outlines_core_vocabulary

BACKEND_NAME = "outlines"

FEATURE_STATUS = {
    "parser_state": FeatureStatus.MISSING,
    "lexer_state": FeatureStatus.EXACT,
    "partial_lexeme": FeatureStatus.MISSING,
}

_INDEXES: LRUCache[object] = LRUCache(maxsize=16)


def schema_to_regex(schema_text: str, whitespace_pattern: str | None = None,
                    grammar_name: str = "<schema>") -> str:
    """outlines_core's own JSON-schema -> regex lowering, errors named."""
    import json

    from outlines_core.json_schema import build_regex_from_schema

    try:
        json.loads(schema_text)
    except ValueError as exc:
        raise GrammarError(f"JSON schema is not valid JSON: {exc}", grammar_name=grammar_name,
                           line=getattr(exc, "lineno", None)) from exc
    try:
        return build_regex_from_schema(schema_text, whitespace_pattern)
    except Exception as exc:  # outlines_core raises ValueError/TypeError for unsupported parts
        raise UnsupportedGrammarError(f"outlines_core cannot lower this JSON schema: {exc}",
                                      grammar_name=grammar_name) from exc


class OutlinesCoreMasker(Masker):
    """One regex / JSON schema compiled by outlines_core for one tokenizer."""

    backend_name = BACKEND_NAME
    grammar_formats = ("regex", "json_schema")
    feature_status = FEATURE_STATUS

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int | None = None, *,
                 eos_token_ids: Sequence[int] | None = None,
                 whitespace_pattern: str | None = None, mask_cache_size: int = 1024):
        import outlines_core

        if grammar.format not in self.grammar_formats:
            raise UnsupportedGrammarError(f"outlines_core takes {self.grammar_formats}, not "
                                          f"{grammar.format!r}", grammar_name=grammar.name)
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.vocab_size = resolve_width(tokenizer, vocab_size)
        self.eos_token_ids = resolve_eos(tokenizer, eos_token_ids)
        self.backend_version = f"outlines_core {outlines_core_version()}"
        self.regex = (grammar.text if grammar.format == "regex"
                      else schema_to_regex(grammar.text, whitespace_pattern, grammar.name))
        self._n_tokens = len(tokenizer)
        eos = min(self.eos_token_ids)
        key = (hashlib.sha256(self.regex.encode()).hexdigest(),
               self.tokenizer_identity.sha256, eos, outlines_core_version())

        def build():
            vocabulary = outlines_core_vocabulary(tokenizer, eos)
            try:
                return outlines_core.Index(self.regex, vocabulary)
            except Exception as exc:  # invalid regex, or no token path through it
                raise GrammarError(f"outlines_core cannot build an index: {exc}",
                                   grammar_name=grammar.name) from exc

        self.index = _INDEXES.get_or_build(key, build)
        self.initial_state: int = self.index.get_initial_state()
        self.final_states = frozenset(self.index.get_final_states())
        self._masks: LRUCache[np.ndarray] = LRUCache(maxsize=mask_cache_size)
        self._eos_array = np.fromiter(sorted(self.eos_token_ids), dtype=np.int64)

    def new_state(self) -> "OutlinesCoreState":
        return OutlinesCoreState(self, self.initial_state, [], False)

    def packed_mask(self, dfa_state: int) -> np.ndarray:
        """Packed allowed bits of a DFA state (EOS bits clear: EOS is decided by finality)."""
        def build() -> np.ndarray:
            allowed = np.asarray(self.index.get_allowed_tokens(dfa_state) or [], dtype=np.int64)
            allowed = allowed[(allowed >= 0) & (allowed < self._n_tokens)]
            bits = np.zeros(self._n_tokens, dtype=np.bool_)
            bits[allowed] = True
            bits[self._eos_array] = False
            packed = np.packbits(bits, bitorder="little")
            packed = np.concatenate([packed, np.zeros((-len(packed)) % 4, np.uint8)])
            return packed.view(np.int32)

        return self._masks.get_or_build(dfa_state, build)


class OutlinesCoreState(MaskerState):
    __slots__ = ("masker", "_dfa_state", "_tokens", "_finished")

    def __init__(self, masker: OutlinesCoreMasker, dfa_state: int, tokens: list[int],
                 finished: bool):
        self.masker = masker
        self._dfa_state = dfa_state
        self._tokens = tokens
        self._finished = finished

    @property
    def dfa_state(self) -> int:
        return self._dfa_state

    def allowed_mask(self) -> np.ndarray:
        m = self.masker
        if self._finished:
            return np.zeros(m.vocab_size, dtype=np.bool_)
        out = bitmask_to_bool(m.packed_mask(self._dfa_state), m._n_tokens, m.vocab_size)
        if self._dfa_state in m.final_states:
            out[m._eos_array] = True
        return out

    def eos_allowed(self) -> bool:
        return not self._finished and self._dfa_state in self.masker.final_states

    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        m = self.masker
        if self._finished:
            raise self._forbidden(token_id)
        if token_id in m.eos_token_ids:
            if not self.eos_allowed():
                raise self._forbidden(token_id)
            self._tokens.append(token_id)
            self._finished = True
            return
        if not (0 <= token_id < m._n_tokens) or not bit_is_set(m.packed_mask(self._dfa_state),
                                                                token_id):
            raise self._forbidden(token_id)
        nxt = m.index.get_next_state(self._dfa_state, token_id)
        if nxt is None:  # allowed by the index but no transition: an outlines_core bug
            raise self._forbidden(token_id)
        self._dfa_state = nxt
        self._tokens.append(token_id)

    def fork(self) -> "OutlinesCoreState":
        return OutlinesCoreState(self.masker, self._dfa_state, list(self._tokens),
                                 self._finished)

    def features(self) -> StateFeatures:
        return StateFeatures(lexer_state=frozenset({("dfa", self._dfa_state)}),
                             extra={"dfa_final": self._dfa_state in self.masker.final_states})

    @property
    def token_ids(self) -> Sequence[int]:
        return tuple(self._tokens)

    @property
    def is_finished(self) -> bool:
        return self._finished
