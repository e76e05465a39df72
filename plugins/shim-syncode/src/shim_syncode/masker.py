"""SynCode as a shim-adapters :class:`Masker`: LALR parser state + DFA mask store per step.

Each :class:`SyncodeMaskerState` owns one :class:`FrontierParser` (SynCode's incremental
parser, fed only the new text); masks come from SynCode's :class:`MaskStore` lookups in
``grammar_strict`` mode, shared read-only. Every accepted token is re-checked by the parser:
a token the mask allowed but the parser rejects raises instead of being accepted.
"""

from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from shim_adapters.errors import ForbiddenTokenError, VocabMismatchError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.protocol import Masker, MaskerState, StateFeatures
from shim_adapters.mask.utf8 import utf8_prefix_ok

from . import FEATURE_STATUS
from ._syncode_import import syncode_version
from .compiled import CompiledGrammar, compile_grammar
from .dynamic_lexing import DynamicLexParser
from .frontier_parser import FrontierParser, NonViableText


class SyncodeMasker(Masker):
    backend_name = "syncode"
    grammar_formats = ("lark",)
    feature_status = FEATURE_STATUS

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int | None = None,
                 memoize_masks: bool = True, lexing: str = "auto"):
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.backend_version = syncode_version()
        width = len(tokenizer) if vocab_size is None else int(vocab_size)
        if width < len(tokenizer):
            raise VocabMismatchError(
                f"logit width {width} is smaller than the tokenizer's {len(tokenizer)} tokens")
        self.vocab_size = width
        self.compiled: CompiledGrammar = compile_grammar(grammar, tokenizer, lexing)
        self.eos_token_ids = frozenset({int(tokenizer.eos_token_id)})
        n = len(self.compiled.token_bytes)
        self._always_off = np.zeros(width, dtype=np.bool_)
        self._always_off[n:] = True  # padding beyond the tokenizer
        self._always_off[list(self.compiled.special_ids)] = True
        # Masks are a pure function of FrontierParser.config_key(); sequences revisit the same
        # configurations constantly (each JSON record, each bv4 operator), so they are memoised
        # per masker: read-only arrays behind a lock, bounded to about 64 MiB.
        self._memo: dict | None = {} if memoize_masks else None
        self._memo_lock = threading.Lock()
        self._memo_limit = max(256, (64 << 20) // max(width, 1))

    def new_state(self) -> "SyncodeMaskerState":
        if self.compiled.dynamic is not None:
            return SyncodeMaskerState(self, DynamicLexParser(self.compiled.dynamic))
        return SyncodeMaskerState(self, FrontierParser(self.compiled.tables,
                                                       self.compiled.ignore_whitespace))


class SyncodeMaskerState(MaskerState):
    """One sequence: its own parser, token list and cached mask. Not thread-safe; fork instead."""

    def __init__(self, masker: SyncodeMasker, parser: FrontierParser | DynamicLexParser):
        self.masker = masker
        self._parser = parser
        self._token_ids: list[int] = []
        self._finished = False
        self._mask: np.ndarray | None = None
        self._broken: str | None = None

    # ---- protocol ---------------------------------------------------------------------
    def allowed_mask(self) -> np.ndarray:
        return self._current_mask().copy()

    def eos_allowed(self) -> bool:
        return not self._finished and self._broken is None and self._parser.accepts_end

    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        mask = self._current_mask()
        if not 0 <= token_id < len(mask) or not mask[token_id]:
            raise self._forbidden(token_id)
        if token_id in self.masker.eos_token_ids:
            self._token_ids.append(token_id)
            self._finished = True
            self._mask = None
            return
        try:
            result = self._parser.feed(self.masker.compiled.token_bytes[token_id])
            problem = None if self._dynamic or self._parser.is_valid_prefix() else (
                f"remainder {result.remainder!r} is no prefix of an acceptable terminal")
        except NonViableText as exc:
            problem = str(exc)
        if problem is not None:
            # SynCode's mask allowed a token its own parser rejects: fail closed, loudly.
            self._broken = (f"syncode's mask allowed token {token_id} but its parser rejects "
                            f"the text ({problem})")
            raise ForbiddenTokenError(token_id, self.masker.token_text(token_id), self.step,
                                      f"{self._broken}; after it: {self.describe()}")
        self._token_ids.append(token_id)
        self._mask = None

    def fork(self) -> "SyncodeMaskerState":
        other = SyncodeMaskerState(self.masker, self._parser.fork())
        other._token_ids = list(self._token_ids)
        other._finished = self._finished
        other._mask = self._mask
        other._broken = self._broken
        return other

    @property
    def _dynamic(self) -> bool:
        return isinstance(self._parser, DynamicLexParser)

    def features(self) -> StateFeatures:
        parser = self._parser
        if self._dynamic:
            codes = self.masker.compiled.state_codes
            names = self.masker.compiled.tables.state_names
            stack = parser.main_stack()
            return StateFeatures(
                parser_state=tuple(str(names[s]) for s in reversed(stack)),
                lexer_state=frozenset((item[1], codes[item[1]][item[2]])
                                      for item in parser.items),
                partial_lexeme=parser.partial_lexeme().decode("utf-8", errors="replace"),
                extra={"stack_depth": len(stack), "readings": len(parser.items),
                       "lexing": "dynamic"},
            )
        stack = parser.current_stack
        codes = self.masker.compiled.state_codes
        names = self.masker.compiled.tables.state_names
        result = parser.result
        return StateFeatures(
            parser_state=tuple(str(names[s]) for s in reversed(stack)),
            lexer_state=frozenset((s.terminal, codes[s.terminal][s.state_id])
                                  for s in parser.remainder_fsm_states),
            partial_lexeme=result.remainder.decode("utf-8", errors="replace"),
            extra={"stack_depth": len(stack), "remainder_state": result.remainder_state.name},
        )

    @property
    def token_ids(self) -> Sequence[int]:
        return tuple(self._token_ids)

    @property
    def is_finished(self) -> bool:
        return self._finished

    # ---- internals --------------------------------------------------------------------
    def _current_mask(self) -> np.ndarray:
        if self._mask is None:
            memo = self.masker._memo
            if memo is None or self._finished or self._broken is not None:
                self._mask = self._compute_mask()
            else:
                key = self._parser.config_key()
                with self.masker._memo_lock:
                    mask = memo.get(key)
                if mask is None:
                    mask = self._compute_mask()
                    mask.flags.writeable = False
                    with self.masker._memo_lock:
                        if len(memo) >= self.masker._memo_limit:
                            memo.clear()
                        memo[key] = mask
                self._mask = mask
        return self._mask

    def _compute_mask(self) -> np.ndarray:
        """SynCode's store answer, corrected where grammar_strict is wrong (see compiled.py).

        Everything is array work over precomputed token tables except the parser check of
        multi-lexeme tokens, which runs only on those the span filter cannot rule out (the
        per-token specification is :func:`shim_syncode.reference_mask.reference_mask`)."""
        masker = self.masker
        out = np.zeros(masker.vocab_size, dtype=np.bool_)
        if self._finished or self._broken is not None:
            return out
        parser = self._parser
        compiled = masker.compiled
        n = len(compiled.token_bytes)
        if self._dynamic:
            out[:n] = parser.mask()
            spans = None
        else:
            out[:n], spans = _store_mask(compiled, parser)
        out[masker._always_off] = False
        pending = parser.pending_bytes
        utf8_ok = compiled.utf8_continuations.after(pending)
        if utf8_ok is None:  # pending bytes that start no character: unreachable, but exact
            utf8_ok = np.array([utf8_prefix_ok(pending + b) for b in compiled.token_bytes],
                               dtype=np.bool_)
        out[:n] &= utf8_ok
        if spans is not None:
            # Tokens spanning several lexemes, which SynCode's store never allows: rule out in
            # bulk those whose inner lexemes the parser cannot take, then check the rest.
            spans &= ~out[:n] & ~masker._always_off[:n] & utf8_ok
            possible = compiled.span_filter.possible(parser)
            if possible is not None:
                spans &= possible
            token_bytes = compiled.token_bytes
            for i in np.flatnonzero(spans):
                out[i] = parser.would_accept(token_bytes[i])
        eos = parser.accepts_end
        for i in masker.eos_token_ids:
            out[i] = eos
        return out


def _store_mask(compiled: CompiledGrammar, parser: FrontierParser
                ) -> tuple[np.ndarray, np.ndarray]:
    """SynCode's grammar_strict lookup plus tokens that stay inside the lexeme, and the span
    candidates (tokens that may close it and go on), before UTF-8 and special-token rules."""
    result = parser.result
    allowed = compiled.mask_store._lookup_next_tokens(
        parser.remainder_fsm_states, result.remainder_state, result.accept_sequences)
    out = allowed.numpy() & ~compiled.tab_tokens
    firsts = {seq[0] for seq in result.accept_sequences}
    spans = np.zeros(len(out), dtype=np.bool_)
    for fsm_state in parser.remainder_fsm_states:
        if fsm_state.terminal in firsts:
            key = (fsm_state.terminal, fsm_state.state_id)
            extra = compiled.inside_lexeme.get(key)
            if extra is not None:
                out |= extra
            extra = compiled.span_candidates.get(key)
            if extra is not None:
                spans |= extra
    return out, spans


def compile_masker(grammar: Grammar, tokenizer, vocab_size: int | None = None,
                   **options) -> SyncodeMasker:
    """The backend's ``create_masker``. SynCode's ``grammar_mask`` mode is refused (unsound)."""
    mode = options.pop("mode", "grammar_strict")
    memoize = bool(options.pop("memoize_masks", True))
    lexing = options.pop("lexing", "auto")
    if mode != "grammar_strict":
        raise ValueError(f"syncode mode {mode!r} is not supported: grammar_mask allows invalid "
                         "tokens and then stops constraining; only grammar_strict is sound")
    if options:
        raise TypeError(f"unknown syncode options: {sorted(options)}")
    return SyncodeMasker(grammar, tokenizer, vocab_size, memoize_masks=memoize, lexing=lexing)
