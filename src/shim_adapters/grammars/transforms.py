"""Explicit, reported transforms of a user's or a benchmark's grammar text.

A transform never runs silently: it returns what it changed, and callers record it (the CP
benchmark's suite lists it in its notes). For a user's own grammar an undefined rule stays an
error that names it (the backends raise); this module is for data known to need it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_RULE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_\-.]*)\s*::=\s*(.*)$")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_\-.]*")


@dataclass
class PruneReport:
    """What :func:`prune_undefined_rules` removed."""

    undefined: list[str] = field(default_factory=list)  #: names used but never defined
    removed_alternatives: int = 0
    emptied_rules: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return bool(self.removed_alternatives or self.emptied_rules)

    def summary(self) -> str:
        return (f"pruned {self.removed_alternatives} alternative(s) that use undefined rule(s) "
                f"{', '.join(self.undefined)}" + (f"; rules left empty and removed: "
                                                  f"{', '.join(self.emptied_rules)}"
                                                  if self.emptied_rules else ""))


def _split_top(body: str, sep: str = "|") -> list[str]:
    """Split a rule body at top-level ``|`` (outside quotes, brackets and parentheses)."""
    parts, depth, cur, quote, i = [], 0, [], None, 0
    while i < len(body):
        c = body[i]
        if quote:
            cur.append(c)
            if c == "\\" and i + 1 < len(body):
                cur.append(body[i + 1])
                i += 1
            elif c == quote:
                quote = None
        elif c in "\"'":
            quote = c
            cur.append(c)
        elif c in "([":
            depth += 1
            cur.append(c)
        elif c in ")]":
            depth -= 1
            cur.append(c)
        elif c == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur))
    return parts


def _references(alternative: str) -> set[str]:
    """Rule names an alternative uses (outside string literals and character classes)."""
    out, i, quote = [], 0, None
    text = alternative
    buf = []
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = None
            buf.append(" ")
        elif c in "\"'":
            quote = c
            buf.append(" ")
        elif c == "[":
            j = text.find("]", i + 1)
            i = j if j > 0 else len(text)
            buf.append(" ")
        else:
            buf.append(c)
        i += 1
    out = _IDENT.findall("".join(buf))
    return set(out)


def prune_undefined_rules(text: str, source: str = "<grammar>") -> tuple[str, PruneReport]:
    """Drop every alternative that uses a rule the grammar never defines (such an alternative
    can never complete), repeating until no rule is left empty. One rule per line (GBNF /
    XGrammar EBNF as the benchmarks write it); other lines are kept as they are."""
    lines = text.splitlines()
    rules: dict[str, list[str]] = {}
    order: list[tuple[str | None, str]] = []
    for line in lines:
        m = _RULE.match(line)
        if m:
            rules[m.group(1)] = _split_top(m.group(2))
            order.append((m.group(1), line))
        else:
            order.append((None, line))
    report = PruneReport()
    defined = set(rules)
    while True:
        undefined = set()
        for name, alts in rules.items():
            keep = []
            for alt in alts:
                missing = _references(alt) - defined
                if missing:
                    undefined |= missing
                    report.removed_alternatives += 1
                else:
                    keep.append(alt)
            rules[name] = keep
        if not report.undefined:  # the grammar's own undefined names (later: emptied rules)
            report.undefined = sorted(undefined)
        empty = [n for n, alts in rules.items() if not alts and n in defined]
        if not empty:
            break
        for n in empty:
            report.emptied_rules.append(n)
            defined.discard(n)
            del rules[n]
    if "root" not in rules and any(n == "root" for n, _ in order):
        raise ValueError(f"{source}: pruning undefined rules left the root rule empty: the "
                         f"grammar's language is empty ({report.summary()})")
    out = []
    for name, line in order:
        if name is None:
            out.append(line)
        elif name in rules:
            out.append(f"{name} ::= " + " | ".join(a.strip() for a in rules[name]))
    return "\n".join(out) + ("\n" if text.endswith("\n") else ""), report
