"""Context-free grammars (Lark, or EBNF lowered to Lark) through llguidance, as outlines does.

llguidance computes the mask (its Earley parser + lexer over token tries) and exposes no parser
state. SHIM's features are therefore *derived* by a shadow LALR parser
(:mod:`shim_outlines.shadow_parser`) fed the same accepted text: parser state = canonical LALR
stack, lexer state = terminals consistent with the unfinished lexeme and their FSM states,
partial lexeme = that text. If Lark cannot build an LALR table for the grammar, the three
features are declared missing for that masker (``shadow_unavailable`` says why) rather than
guessed.

llguidance only allows the canonical tokenisation where the grammar forces text (e.g. the fixed
``(define-fun inv ...`` header): the mask is sound, but an LM sample that spells forced text
with other tokens is rejected (docs/design.md). This is llguidance's documented design
(its ``no_forcing`` grammar option: "when a sequence of bytes is forced by grammar, it is
tokenized canonically and forced as tokens"; turning that off is meant for testing only), so
the masker declares ``Tokenizations.CANONICAL_IN_FORCED_TEXT`` and the conformance suite
judges it by that declaration.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from shim_adapters.errors import GrammarError, ShimError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.protocol import (
    FeatureStatus,
    Masker,
    MaskerState,
    StateFeatures,
    Tokenizations,
)

from .masks import bit_is_set, bitmask_to_bool, resolve_eos, resolve_width
from .shadow_parser import ShadowGrammar, ShadowParser
from .vocabulary import llguidance_tokenizer, token_bytes_table

BACKEND_NAME = "outlines"

DERIVED_STATUS = {
    "parser_state": FeatureStatus.DERIVED,
    "lexer_state": FeatureStatus.DERIVED,
    "partial_lexeme": FeatureStatus.DERIVED,
}
MISSING_STATUS = {name: FeatureStatus.MISSING for name in DERIVED_STATUS}


def lark_text_of(grammar: Grammar) -> str:
    """The Lark text llguidance and the shadow parser read (EBNF lowered by shim_adapters)."""
    if grammar.format == "lark":
        return grammar.text
    if grammar.format == "ebnf":
        try:
            from shim_adapters.grammars.convert import ebnf_to_lark
        except ImportError as exc:
            raise UnsupportedGrammarError(
                "EBNF grammars need shim_adapters.grammars.convert.ebnf_to_lark, which this "
                f"installation lacks ({exc})", grammar_name=grammar.name) from exc
        return ebnf_to_lark(grammar.text, grammar_name=grammar.name)
    raise UnsupportedGrammarError(f"llguidance path takes lark or ebnf, not {grammar.format!r}",
                                  grammar_name=grammar.name)


class LLGuidanceMasker(Masker):
    """One Lark/EBNF grammar compiled by llguidance for one tokenizer, plus a shadow parser."""

    backend_name = BACKEND_NAME
    grammar_formats = ("lark", "ebnf")
    #: llguidance tokenizes forced text canonically (see the module docstring).
    tokenizations = Tokenizations.CANONICAL_IN_FORCED_TEXT

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int | None = None, *,
                 eos_token_ids: Sequence[int] | None = None, shadow_parser: bool = True):
        import llguidance

        if grammar.format not in self.grammar_formats:
            raise UnsupportedGrammarError(f"llguidance path takes {self.grammar_formats}, not "
                                          f"{grammar.format!r}", grammar_name=grammar.name)
        self.grammar = grammar
        self.tokenizer = tokenizer
        self.vocab_size = resolve_width(tokenizer, vocab_size)
        self.eos_token_ids = resolve_eos(tokenizer, eos_token_ids)
        self.backend_version = f"llguidance {llguidance.__version__}"
        self.lark_text = lark_text_of(grammar)
        self.ll_tokenizer = llguidance_tokenizer(tokenizer, self.eos_token_ids)
        self.grammar_spec = llguidance.grammar_from("lark", self.lark_text)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            self.grammar_spec, self.ll_tokenizer)
        if is_error:
            raise GrammarError(f"llguidance rejects the grammar: {messages[0]}",
                               grammar_name=grammar.name, line=_line_of(messages[0]))
        self.grammar_warnings = tuple(messages)
        self._template = llguidance.LLMatcher(self.ll_tokenizer, self.grammar_spec, log_level=0)
        if self._template.is_error():
            raise GrammarError(f"llguidance: {self._template.get_error()}",
                               grammar_name=grammar.name)
        self._n_tokens = len(tokenizer)
        self._n_bitmask_words = (max(self.ll_tokenizer.vocab_size, self._n_tokens) + 31) // 32
        self._eos_array = np.fromiter(sorted(self.eos_token_ids), dtype=np.int64)
        self.token_bytes = token_bytes_table(tokenizer)
        self.shadow: ShadowGrammar | None = None
        self.shadow_unavailable: str | None = None
        if shadow_parser:
            try:
                self.shadow = ShadowGrammar(self.lark_text, grammar.name)
            except GrammarError as exc:
                self.shadow_unavailable = str(exc)
        else:
            self.shadow_unavailable = "shadow parser disabled (shadow_parser=False)"
        self.feature_status = dict(DERIVED_STATUS if self.shadow else MISSING_STATUS)

    def new_state(self) -> "LLGuidanceState":
        return LLGuidanceState(self, self._template.deep_copy(),
                               self.shadow.new_parser() if self.shadow else None, [], False)


def _line_of(message: str) -> int | None:
    import re

    match = re.search(r"line (\d+)|\((\d+):\d+\)|at (\d+):\d+", message)
    if not match:
        return None
    return int(next(g for g in match.groups() if g))


class LLGuidanceState(MaskerState):
    __slots__ = ("masker", "matcher", "shadow", "_tokens", "_finished", "_bitmask",
                 "_bitmask_step")

    def __init__(self, masker: LLGuidanceMasker, matcher, shadow: ShadowParser | None,
                 tokens: list[int], finished: bool):
        self.masker = masker
        self.matcher = matcher
        self.shadow = shadow
        self._tokens = tokens
        self._finished = finished
        self._bitmask = np.zeros((1, masker._n_bitmask_words), dtype=np.int32)
        self._bitmask_step = -1  # step the bitmask was filled at (-1: stale)

    def _fill(self) -> np.ndarray:
        import llguidance.numpy

        if self._bitmask_step != len(self._tokens):
            self._check_matcher()
            llguidance.numpy.fill_next_token_bitmask(self.matcher, self._bitmask)
            self._bitmask_step = len(self._tokens)
        return self._bitmask

    def _check_matcher(self) -> None:
        if self.matcher.is_error():
            raise ShimError(f"llguidance matcher error: {self.matcher.get_error()}; state: "
                            f"{self.describe()}")

    def allowed_mask(self) -> np.ndarray:
        m = self.masker
        if self._finished:
            return np.zeros(m.vocab_size, dtype=np.bool_)
        out = bitmask_to_bool(self._fill(), m._n_tokens, m.vocab_size)
        out[m._eos_array] = self.matcher.is_accepting()
        return out

    def eos_allowed(self) -> bool:
        return not self._finished and self.matcher.is_accepting()

    def advance(self, token_id: int) -> None:
        token_id = int(token_id)
        m = self.masker
        if self._finished:
            raise self._forbidden(token_id)
        if token_id in m.eos_token_ids:
            if not self.matcher.is_accepting():
                raise self._forbidden(token_id)
            self._tokens.append(token_id)
            self._finished = True
            return
        if not 0 <= token_id < m._n_tokens or m.token_bytes[token_id] is None:
            raise self._forbidden(token_id)
        if self._bitmask_step == len(self._tokens):
            allowed = bit_is_set(self._bitmask, token_id)
        else:
            allowed = self.matcher.validate_tokens([token_id]) == 1
        if not allowed:
            raise self._forbidden(token_id)
        if not self.matcher.consume_token(token_id):
            raise ShimError(f"llguidance refused token {token_id} it had allowed: "
                            f"{self.matcher.get_error()}; state: {self.describe()}")
        if self.shadow is not None:
            self.shadow.feed_bytes(m.token_bytes[token_id])
        self._tokens.append(token_id)

    def fork(self) -> "LLGuidanceState":
        return LLGuidanceState(self.masker, self.matcher.deep_copy(),
                               self.shadow.copy() if self.shadow is not None else None,
                               list(self._tokens), self._finished)

    def features(self) -> StateFeatures:
        if self.shadow is None:
            return StateFeatures()
        return StateFeatures(parser_state=self.shadow.parser_state(),
                             lexer_state=self.shadow.lexer_state(),
                             partial_lexeme=self.shadow.pending,
                             extra={"stack_depth": self.shadow.stack_depth})

    @property
    def token_ids(self) -> Sequence[int]:
        return tuple(self._tokens)

    @property
    def is_finished(self) -> bool:
        return self._finished
