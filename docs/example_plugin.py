"""A complete masker plugin in one file: finite languages given as a regex of alternatives.

It shows everything a new backend needs: a ``Masker`` that compiles a grammar for a tokenizer,
a ``MaskerState`` per sequence, honest feature statuses, and the one pluggy hook. Publish it as
its own distribution with, in its pyproject.toml::

    [project.entry-points.shim_adapters]
    choices = "shim_choices"

or register it in-process with ``shim_adapters.backends.registry.register_plugin(module)``.
The grammar is a regex such as ``10111|10001|00100``: an alternation of literal strings.
"""

from __future__ import annotations

import re
from re import _parser as sre_parse  # the stdlib regex parser (re._parser since 3.11)

import numpy as np

from shim_adapters.backends.hookspecs import hookimpl
from shim_adapters.backends.spec import BackendSpec
from shim_adapters.errors import UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.mask.protocol import FeatureStatus, Masker, MaskerState, StateFeatures

FEATURES = {"parser_state": FeatureStatus.MISSING, "lexer_state": FeatureStatus.EXACT,
            "partial_lexeme": FeatureStatus.EXACT}


def literal_alternatives(grammar: Grammar) -> list[str]:
    """The strings of ``a|b|c``; anything else is refused, never approximated."""
    try:
        parsed = sre_parse.parse(grammar.text)
    except re.error as exc:
        raise UnsupportedGrammarError(f"invalid regex: {exc}", grammar_name=grammar.name) from exc
    items = list(parsed)
    branches = items[0][1][1] if len(items) == 1 and items[0][0] == sre_parse.BRANCH else [items]
    choices = []
    for branch in branches:
        if any(op != sre_parse.LITERAL for op, _ in branch):
            raise UnsupportedGrammarError("the choices backend takes only alternatives of plain "
                                          "literals, e.g. 'abc|abd'", grammar_name=grammar.name)
        choices.append("".join(chr(code) for _, code in branch))
    return choices


class ChoicesMasker(Masker):
    backend_name = "choices"
    backend_version = "1.0"
    grammar_formats = ("regex",)
    feature_status = FEATURES

    def __init__(self, grammar: Grammar, tokenizer, vocab_size: int | None = None):
        if grammar.format != "regex":
            raise UnsupportedGrammarError(f"choices takes regex, not {grammar.format}",
                                          grammar_name=grammar.name)
        self.grammar, self.tokenizer = grammar, tokenizer
        self.choices = literal_alternatives(grammar)
        self.vocab_size = vocab_size or len(tokenizer)
        self.eos_token_ids = frozenset({tokenizer.eos_token_id})
        # One decoded string per token id; specials never extend the text.
        specials = set(tokenizer.all_special_ids)
        self.token_strings = [None if i in specials else tokenizer.decode([i])
                              for i in range(len(tokenizer))]

    def new_state(self) -> "ChoicesState":
        return ChoicesState(self, "", [])


class ChoicesState(MaskerState):
    def __init__(self, masker: ChoicesMasker, text: str, token_ids: list[int]):
        self.masker, self._text, self._ids = masker, text, token_ids

    def allowed_mask(self) -> np.ndarray:
        mask = np.zeros(self.masker.vocab_size, dtype=bool)
        if self.is_finished:
            return mask
        for i, piece in enumerate(self.masker.token_strings):
            if piece and any(c.startswith(self._text + piece) for c in self.masker.choices):
                mask[i] = True
        if self.eos_allowed():
            mask[list(self.masker.eos_token_ids)] = True
        return mask

    def advance(self, token_id: int) -> None:
        if not (0 <= token_id < self.masker.vocab_size) or not self.allowed_mask()[token_id]:
            raise self._forbidden(token_id)
        if token_id not in self.masker.eos_token_ids:
            self._text += self.masker.token_strings[token_id]
        self._ids.append(token_id)

    def eos_allowed(self) -> bool:
        return not self.is_finished and self._text in self.masker.choices

    def fork(self) -> "ChoicesState":
        return ChoicesState(self.masker, self._text, list(self._ids))

    def features(self) -> StateFeatures:
        return StateFeatures(lexer_state=frozenset({("choice", len(self._text))}),
                             partial_lexeme=self._text)

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    @property
    def is_finished(self) -> bool:
        return bool(self._ids) and self._ids[-1] in self.masker.eos_token_ids


@hookimpl
def register_backends(register):
    register(BackendSpec(name="choices", version=ChoicesMasker.backend_version,
                         grammar_formats=ChoicesMasker.grammar_formats, feature_status=FEATURES,
                         create_masker=ChoicesMasker,
                         description="finite languages as literal alternatives (example)"))
