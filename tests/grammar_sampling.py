"""Random strings of a grammar and near-miss mutations, for differential acceptance tests."""

from __future__ import annotations

import random

from shim_adapters.grammars.convert import Alt, CharClass, Lit, Node, Ref, Repeat, Seq, rules_of
from shim_adapters.grammars.grammar import Grammar

_PRINTABLE = [chr(c) for c in range(32, 127)] + ["\n", "\t", "é"]


def _heights(rules: dict[str, Node]) -> dict[str, float]:
    """Minimal derivation depth per rule (fixpoint), so sampling can steer towards ends."""
    height = {name: float("inf") for name in rules}

    def h(node: Node) -> float:
        if isinstance(node, Ref):
            return height[node.name] + 1
        if isinstance(node, Seq):
            return max((h(i) for i in node.items), default=0)
        if isinstance(node, Alt):
            return min(h(o) for o in node.options)
        if isinstance(node, Repeat):
            return 0 if node.min == 0 else h(node.item)
        return 0

    changed = True
    while changed:
        changed = False
        for name, body in rules.items():
            value = h(body)
            if value < height[name]:
                height[name], changed = value, True
    return height


class GrammarSampler:
    def __init__(self, grammar: Grammar, seed: int = 0, max_depth: int = 6):
        self.rules = rules_of(grammar)
        self.entry = "start" if grammar.format == "lark" else "root"
        self.height = _heights(self.rules)
        self.rng = random.Random(seed)
        self.max_depth = max_depth

    def _h(self, node: Node) -> float:
        if isinstance(node, Ref):
            return self.height[node.name] + 1
        if isinstance(node, Seq):
            return max((self._h(i) for i in node.items), default=0)
        if isinstance(node, Alt):
            return min(self._h(o) for o in node.options)
        return 0

    def _char(self, cls: CharClass) -> str:
        inside = lambda c: any(lo <= ord(c) <= hi for lo, hi in cls.ranges)  # noqa: E731
        if cls.negated:
            return self.rng.choice([c for c in _PRINTABLE if not inside(c)])
        ascii_ok = [c for c in _PRINTABLE if inside(c)]
        if ascii_ok:
            return self.rng.choice(ascii_ok)
        lo, hi = self.rng.choice(cls.ranges)
        return chr(self.rng.randint(lo, hi))

    def _gen(self, node: Node, depth: int) -> str:
        if isinstance(node, Lit):
            return node.text
        if isinstance(node, CharClass):
            return self._char(node)
        if isinstance(node, Ref):
            return self._gen(self.rules[node.name], depth + 1)
        if isinstance(node, Seq):
            return "".join(self._gen(i, depth) for i in node.items)
        if isinstance(node, Alt):
            options = list(node.options)
            if depth >= self.max_depth:
                best = min(self._h(o) for o in options)
                options = [o for o in options if self._h(o) == best]
            return self._gen(self.rng.choice(options), depth)
        if isinstance(node, Repeat):
            high = node.max if node.max is not None else node.min + 3
            if depth >= self.max_depth:
                high = node.min
            return "".join(self._gen(node.item, depth + 1)
                           for _ in range(self.rng.randint(node.min, high)))
        raise TypeError(node)

    def sample(self) -> str:
        return self._gen(Ref(self.entry), 0)

    def mutate(self, text: str) -> str:
        """Delete, insert or replace one character (often still valid: compare, don't assume)."""
        pos = self.rng.randrange(len(text) + 1)
        op = self.rng.choice(["delete", "insert", "replace"]) if text else "insert"
        char = self.rng.choice(_PRINTABLE)
        if op == "delete" and pos < len(text):
            return text[:pos] + text[pos + 1:]
        if op == "replace" and pos < len(text):
            return text[:pos] + char + text[pos + 1:]
        return text[:pos] + char + text[pos:]
