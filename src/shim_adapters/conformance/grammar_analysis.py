"""Which rules of a grammar can finish: productive-rule analysis, for exact viability.

A prefix is viable only if a *finite* completion exists. A rule all of whose alternatives
need itself (``b: "x" b``) derives no finite string, yet LALR tables, backends and naive
generators happily enter it. This module finds such rules by the classic fixpoint (a rule is
productive when one alternative has only terminals and productive rules), names them in a
diagnostic ("rule b can never finish"), and returns the grammar's rules without them: the
prefix reference builds its tables from those, the generator derives from those, so neither
ever enters a branch that cannot end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from shim_adapters.errors import GrammarError
from shim_adapters.grammars.convert import ebnf_to_lark


@dataclass
class RuleAnalysis:
    """A Lark grammar's compiled rules, split into the ones that can finish and the rest."""

    #: Rules (Lark ``Rule`` objects) whose expansion has only terminals and productive rules.
    productive_rules: list
    #: Rules dropped because their expansion needs an unproductive rule.
    dropped_rules: list
    #: Nonterminals that derive no finite string.
    unproductive: tuple[str, ...]
    #: One line per problem, e.g. ``rule b can never finish (every alternative needs b)``.
    diagnostics: list[str] = field(default_factory=list)
    terminals: list = field(default_factory=list)
    ignore: tuple[str, ...] = ()
    start: str = "start"

    @property
    def empty_language(self) -> bool:
        return self.start in self.unproductive


def _display(name: str) -> str:
    """Lark's names for EBNF helpers (``__b_star_0``) shown as what the user wrote."""
    if name.startswith("__") and ("_star_" in name or "_plus_" in name):
        return f"{name} (a repetition Lark generated)"
    return name


def analyse_rules(rules, start: str = "start") -> tuple[list, list, tuple[str, ...], list[str]]:
    """Productive fixpoint over Lark rules: (kept, dropped, unproductive names, diagnostics)."""
    names = {str(r.origin.name) for r in rules}
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for r in rules:
            if r.origin.name in productive:
                continue
            if all(s.is_term or s.name in productive for s in r.expansion):
                productive.add(r.origin.name)
                changed = True
    unproductive = tuple(sorted(str(n) for n in names - productive))
    kept = [r for r in rules if r.origin.name in productive
            and all(s.is_term or s.name in productive for s in r.expansion)]
    dropped = [r for r in rules if r not in kept]
    reachable = _reachable(rules, start)
    diagnostics = []
    for name in unproductive:
        if name not in reachable:
            continue
        needs = sorted({s.name for r in rules if r.origin.name == name for s in r.expansion
                        if not s.is_term and s.name in unproductive})
        diagnostics.append(f"rule {_display(name)} can never finish: every alternative needs "
                           f"{', '.join(_display(n) for n in needs)}, which never finishes")
    if start in unproductive:
        diagnostics.insert(0, f"the grammar accepts no string: {start} can never finish")
    return kept, dropped, unproductive, diagnostics


def _reachable(rules, start: str) -> set[str]:
    seen = {start}
    todo = [start]
    by_origin: dict[str, list] = {}
    for r in rules:
        by_origin.setdefault(r.origin.name, []).append(r)
    while todo:
        name = todo.pop()
        for r in by_origin.get(name, ()):
            for s in r.expansion:
                if not s.is_term and s.name not in seen:
                    seen.add(s.name)
                    todo.append(s.name)
    return seen


@lru_cache(maxsize=32)
def analyse_lark(lark_text: str, name: str = "<grammar>") -> RuleAnalysis:
    """Compile ``lark_text`` with Lark (no parser tables) and split its rules."""
    import lark

    try:
        parser = lark.Lark(lark_text, parser="earley", lexer="dynamic", start="start")
    except lark.exceptions.LarkError as exc:
        raise GrammarError(f"Lark cannot compile the grammar: {exc}", grammar_name=name) from exc
    kept, dropped, unproductive, diagnostics = analyse_rules(parser.rules, "start")
    return RuleAnalysis(productive_rules=kept, dropped_rules=dropped, unproductive=unproductive,
                        diagnostics=diagnostics, terminals=list(parser.terminals),
                        ignore=tuple(parser.ignore_tokens))


def lark_text_of(grammar) -> str | None:
    """The Lark text of a lark/ebnf grammar (None for regex and JSON schema)."""
    if grammar.format == "lark":
        return grammar.text
    if grammar.format == "ebnf":
        return ebnf_to_lark(grammar.text, grammar_name=grammar.name)
    return None


def grammar_diagnostics(grammar) -> list[str]:
    """Problems of the grammar itself (rules that can never finish); [] for other formats."""
    text = lark_text_of(grammar)
    return [] if text is None else list(analyse_lark(text, grammar.name).diagnostics)
