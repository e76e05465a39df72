"""Prefix references: is a text the start of *some* string of the grammar?

Soundness is a per-step property: a masker may only allow a token when the text so far plus
that token can still be completed. :func:`reference_acceptor` decides whole strings only, so
this module adds viable-prefix checkers that share no code with any backend under test:

- Lark grammars: LALR tables (Lark's analyser) over the rules that can *finish* (see
  :mod:`.grammar_analysis`: a rule that never finishes is dropped, so a prefix is viable iff
  a finite completion exists), driven directly by our own lexing
  that tries every terminal at every length (a character-level reading of the grammar, as
  XGrammar and llguidance read it), with the unfinished last lexeme checked by the ``regex``
  package's partial matching.
- Regexes: ``regex`` partial matching.
- JSON schemas: the schema itself as Lark grammars (:mod:`.schema_reference`), in two readings:
  an over-approximation that judges allowed tokens (:func:`prefix_checker`) and an
  under-approximation that judges refused ones (:func:`refusal_checker`), so neither raises a
  false alarm. A schema the over-approximation cannot take falls back to JSON syntax.

A grammar whose LALR tables have conflicts gets no prefix checker (``None``); the report says
so and the per-step checks fall back to finished strings.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

from shim_adapters.conformance.grammar_analysis import analyse_lark, lark_text_of
from shim_adapters.conformance.schema_reference import schema_lark
from shim_adapters.errors import GrammarError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar, builtin_grammar


class PrefixChecker(Protocol):
    def viable(self, text: str) -> bool: ...


class PrefixUndecided(Exception):
    """The prefix search exceeded its budget (a highly ambiguous lexing)."""


class RegexPrefixChecker:
    def __init__(self, pattern: str):
        import regex

        self._rx = regex.compile(pattern)

    def viable(self, text: str) -> bool:
        return self._rx.fullmatch(text, partial=True) is not None


class LarkPrefixChecker:
    """Viable-prefix check for a Lark grammar by LALR tables + all-lengths lexing.

    Parser configurations are LALR state stacks (tuples) driven directly by Lark's parse
    table, so branching over lexings copies nothing but a tuple.
    """

    #: Most lexing configurations kept for one prefix before giving up.
    MAX_CONFIGS = 4000

    def __init__(self, lark_text: str, name: str = "<grammar>", cache_size: int = 512,
                 finite: bool = True, leading_ignore: bool = True):
        """``finite``: tables from the rules that can finish only (exact viability: a prefix
        is viable iff a finite completion exists); False: every rule (syntactic viability,
        used to tell a dead end from an unsound token)."""
        import lark
        import regex
        from lark.common import ParserConf
        from lark.parsers.lalr_analysis import LALR_Analyzer, Shift

        analysis = analyse_lark(lark_text, name)
        self.analysis = analysis
        self._lark_text = lark_text
        self._name = name
        rules = analysis.productive_rules if finite else (analysis.productive_rules
                                                          + analysis.dropped_rules)
        #: The language is empty (start can never finish): nothing is viable.
        self.empty = finite and analysis.empty_language
        self._shift = Shift
        if self.empty:
            self._states, self._root = {}, ()
        else:
            try:
                analyzer = LALR_Analyzer(ParserConf(rules, {}, ["start"]))
                analyzer.compute_lalr()
            except lark.exceptions.GrammarError as exc:
                raise UnsupportedGrammarError(f"no LALR prefix reference: {exc}",
                                              grammar_name=name) from exc
            table = analyzer.parse_table
            self._states = table.states
            self._root = (table.start_states["start"],)
        self._rx = {t.name: regex.compile(t.pattern.to_regexp()) for t in analysis.terminals}
        self._ignore = tuple(analysis.ignore)
        #: False: no %ignore text before the first token (the schema's ordered reading).
        self._leading_ignore = leading_ignore
        self._accepts: dict[tuple, tuple[str, ...]] = {}
        self._feeds: dict[tuple, tuple | None] = {}
        self._cache: OrderedDict[str, list] = OrderedDict()
        self._cache_size = cache_size
        self._cache[""] = [] if self.empty else [(self._root, 0)]
        self._lalr_lark = None

    def _feed(self, stack: tuple, terminal: str) -> tuple | None:
        """The LALR stack after shifting ``terminal`` (with its reductions), or None."""
        key = (stack, terminal)
        if key in self._feeds:
            return self._feeds[key]
        states = self._states
        work = list(stack)
        result = None
        while True:
            entry = states[work[-1]].get(terminal)
            if entry is None:
                break
            action, arg = entry
            if action is self._shift:
                work.append(arg)
                result = tuple(work)
                break
            size = len(arg.expansion)
            if size:
                del work[-size:]
            work.append(states[work[-1]][arg.origin.name][1])
        if len(self._feeds) > 200_000:
            self._feeds.clear()
        self._feeds[key] = result
        return result

    def _acceptable(self, stack: tuple) -> tuple[str, ...]:
        found = self._accepts.get(stack)
        if found is None:
            names = [t for t in self._states[stack[-1]] if t in self._rx and t != "$END"]
            found = tuple(sorted(t for t in names if self._feed(stack, t) is not None))
            found += self._ignore
            self._accepts[stack] = found
        return found

    def _configs(self, text: str) -> list:
        cache = self._cache
        if text in cache:
            cache.move_to_end(text)
            return cache[text]
        base = None
        for cut in range(len(text) - 1, max(-1, len(text) - 65), -1):
            if text[:cut] in cache:
                base = text[:cut]
                break
        if base is None:
            base = max((k for k in cache if text.startswith(k)), key=len)
        configs = self._extend(cache[base], len(base), text)
        cache[text] = configs
        if len(cache) > self._cache_size:
            cache.popitem(last=False)
        if "" not in cache:
            cache[""] = [] if self.empty else [(self._root, 0)]
        return configs

    def _extend(self, configs: list, old_len: int, text: str) -> list:
        end_all = len(text)
        seen: set = set()
        kept: list = []
        todo = list(configs)
        while todo:
            config = todo.pop()
            if config in seen:
                continue
            seen.add(config)
            if len(seen) > self.MAX_CONFIGS:
                raise PrefixUndecided(f"more than {self.MAX_CONFIGS} lexings of {text[-40:]!r}")
            stack, start = config
            alive = start == end_all
            for name in self._acceptable(stack):
                if start == 0 and not self._leading_ignore and name in self._ignore:
                    continue
                rx = self._rx[name]
                if start < end_all and not alive and rx.fullmatch(text, start, end_all,
                                                                  partial=True):
                    alive = True
                for end in range(max(start, old_len) + 1, end_all + 1):
                    if rx.fullmatch(text, start, end) is None:
                        continue
                    if name in self._ignore:
                        todo.append((stack, end))
                        continue
                    nxt = self._feed(stack, name)
                    if nxt is not None:
                        todo.append((nxt, end))
            if alive:
                kept.append(config)
        return kept

    def viable(self, text: str) -> bool:
        return bool(self._configs(text))

    def terminal_spans(self, text: str) -> list[tuple[str, int, int]] | None:
        """(terminal, start, end) of a complete string as Lark's contextual lexer splits it;
        None when that lexer cannot split it (the grammar needs a character-level reading)."""
        import lark

        try:
            if self._lalr_lark is None:
                self._lalr_lark = lark.Lark(self._lark_text, parser="lalr", lexer="contextual",
                                            start="start")
            ip = self._lalr_lark.parse_interactive(text)
            return [(t.type, t.start_pos, t.end_pos) for t in ip.iter_parse()]
        except Exception:  # noqa: BLE001 - lark raises several kinds
            return None


def prefix_checker(grammar: Grammar, finite: bool = True) -> PrefixChecker:
    """The prefix reference for ``grammar``; raises UnsupportedGrammarError if there is none.

    ``finite=False``: the syntactic reference (rules that can never finish kept), to tell a
    dead end (viable syntactically, no finite completion) from an unsound token."""
    if grammar.format == "regex":
        return RegexPrefixChecker(grammar.text)
    if grammar.format == "json_schema":
        try:
            text, dropped = schema_lark(grammar.text, ordered=False)
            checker = LarkPrefixChecker(text, name=f"{grammar.name} (schema, relaxed)")
            checker.notes = [f"schema reference for allowed tokens drops {', '.join(dropped)}"
                             ] if dropped else []
        except (UnsupportedGrammarError, GrammarError) as exc:
            checker = LarkPrefixChecker(builtin_grammar("json").text,
                                        name=f"{grammar.name} (JSON syntax)")
            checker.notes = [f"allowed tokens judged by JSON syntax only: {exc}"]
        return checker
    text = lark_text_of(grammar)
    if text is not None:
        return LarkPrefixChecker(text, name=grammar.name, finite=finite)
    raise UnsupportedGrammarError(f"no prefix reference for format {grammar.format}",
                                  grammar_name=grammar.name)


def refusal_checker(grammar: Grammar) -> PrefixChecker | None:
    """The reference that judges *refused* tokens, where it is not :func:`prefix_checker`'s:
    for a JSON schema, the schema's ordered reading (an under-approximation: what it calls
    viable is). None for other formats (their prefix reference is exact); raises
    UnsupportedGrammarError when the schema has a construct that reading cannot express."""
    if grammar.format != "json_schema":
        return None

    text, _ = schema_lark(grammar.text, ordered=True)
    return LarkPrefixChecker(text, name=f"{grammar.name} (schema, ordered)",
                             leading_ignore=False)
