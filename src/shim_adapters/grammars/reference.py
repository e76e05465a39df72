"""Independent reference acceptors: decide membership in L(G) without any masker.

Labels for training data and every soundness check go through these, never through the
backend under test. Lark grammars are parsed with Lark's Earley parser (dynamic lexer), which
shares no code with SynCode's LALR, XGrammar's or llguidance's engines; JSON is cross-checked
with the standard library; regexes use ``re.fullmatch``; JSON schemas need ``jsonschema``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Protocol

from shim_adapters.errors import GrammarError, UnsupportedGrammarError
from shim_adapters.grammars.convert import ebnf_to_lark
from shim_adapters.grammars.grammar import Grammar


class ReferenceAcceptor(Protocol):
    def accepts(self, text: str) -> bool: ...


class LarkAcceptor:
    """Membership by Lark's Earley parser over the grammar text."""

    def __init__(self, grammar: Grammar):
        import lark

        if grammar.format == "lark":
            text = grammar.text
        elif grammar.format == "ebnf":
            text = ebnf_to_lark(grammar.text, grammar_name=grammar.name)
        else:
            raise UnsupportedGrammarError(f"LarkAcceptor takes lark or ebnf, not {grammar.format}",
                                          grammar_name=grammar.name)
        try:
            self._parser = lark.Lark(text, parser="earley", lexer="dynamic", start="start")
        except lark.exceptions.GrammarError as exc:
            raise GrammarError(str(exc), grammar_name=grammar.name,
                               line=_line_of(str(exc), text)) from exc
        except lark.exceptions.UnexpectedInput as exc:
            raise GrammarError(f"syntax error in grammar: {exc}", grammar_name=grammar.name,
                               line=getattr(exc, "line", None),
                               column=getattr(exc, "column", None)) from exc
        self._is_json = grammar.name.startswith("json")

    def accepts(self, text: str) -> bool:
        import lark

        try:
            self._parser.parse(text)
        except lark.exceptions.LarkError:
            return False
        if self._is_json:
            # Second opinion from the standard library for the JSON built-in.
            try:
                json.loads(text)
            except ValueError:
                return False
        return True


class RegexAcceptor:
    def __init__(self, grammar: Grammar):
        try:
            self._pattern = re.compile(grammar.text)
        except re.error as exc:
            raise GrammarError(f"invalid regex: {exc}", grammar_name=grammar.name,
                               column=exc.pos) from exc

    def accepts(self, text: str) -> bool:
        return self._pattern.fullmatch(text) is not None


class JsonSchemaAcceptor:
    def __init__(self, grammar: Grammar):
        import jsonschema

        self._schema = json.loads(grammar.text)
        self._validator = jsonschema.Draft202012Validator(self._schema)

    def accepts(self, text: str) -> bool:
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return self._validator.is_valid(value)


def _line_of(message: str, text: str) -> int | None:
    """The grammar line an error is about: stated by Lark, or where the named rule is defined."""
    match = re.search(r"line (\d+)", message)
    if match:
        return int(match.group(1))
    rule = re.search(r"\(in rule (\w+)\)", message) or re.search(r"[Rr]ule '?(\w+)'?", message)
    if rule:
        name = rule.group(1)
        for number, line in enumerate(text.splitlines(), start=1):
            if re.match(rf"\s*[?!]?{re.escape(name)}\s*(\.\d+)?\s*:", line):
                return number
    return None


@functools.lru_cache(maxsize=64)
def reference_acceptor(grammar: Grammar) -> ReferenceAcceptor:
    """The reference acceptor for a grammar (cached per grammar)."""
    if grammar.format in ("lark", "ebnf"):
        return LarkAcceptor(grammar)
    if grammar.format == "regex":
        return RegexAcceptor(grammar)
    if grammar.format == "json_schema":
        return JsonSchemaAcceptor(grammar)
    raise UnsupportedGrammarError(f"no reference acceptor for format {grammar.format}",
                                  grammar_name=grammar.name)
