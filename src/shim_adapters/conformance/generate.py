"""Valid strings drawn from the grammar itself, for the completeness check.

Random derivations over the grammar's rules as Lark compiles them (EBNF operators already
lowered to plain alternatives), terminals drawn from their regexes with a character palette
that covers the hard cases: escapes, non-ASCII (accents, CJK, emoji, combining marks),
whitespace variants, long repeats and deep nesting. Regex grammars use the regex generator
directly; JSON schemas a small schema-driven generator. Every string is confirmed by the
independent reference acceptor before use; rejects are counted, never used.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass

try:  # Python 3.11+: the regex parser moved
    import re._constants as sre_c  # type: ignore[import-not-found]
    import re._parser as sre_parse  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as sre_c  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from shim_adapters.conformance.grammar_analysis import analyse_lark
from shim_adapters.grammars.convert import ebnf_to_lark
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.grammars.reference import reference_acceptor

ASCII = [chr(c) for c in range(32, 127)]
#: Non-ASCII characters of several UTF-8 lengths, a combining mark and an emoji sequence.
UNICODE = ["é", "ß", "Ω", "ж", "中", "文", "日", "한", "😀", "👍", "\u0301", "€", "…", "ñ", "\u00a0"]
WHITESPACE = [" ", "\t", "\n", "\r"]
#: DEL and C1 control characters: JSON strings may hold them raw (only U+0000-U+001F must be
#: escaped), and some backends wrongly refuse them.
JSON_RAW_CONTROLS = ["\u007f", "\u0080", "\u0085", "\u009f"]


@dataclass(frozen=True)
class GenerationMode:
    """How a derivation is drawn: name, recursion depth budget, repeat counts, palette."""

    name: str
    max_depth: int = 6
    repeat_mean: float = 1.5
    max_repeat: int = 6
    unicode_weight: float = 0.15
    whitespace_runs: bool = False


MODES = {
    "plain": GenerationMode("plain"),
    "unicode": GenerationMode("unicode", unicode_weight=0.7),
    "whitespace": GenerationMode("whitespace", whitespace_runs=True),
    "long": GenerationMode("long", max_depth=8, repeat_mean=6, max_repeat=40),
    "deep": GenerationMode("deep", max_depth=14, repeat_mean=1.0, max_repeat=3),
}


class RegexGenerator:
    """Random strings of one regex (Python syntax), drawn from its parse tree."""

    def __init__(self, pattern: str, flags: int = 0):
        self.pattern = pattern
        self._tree = sre_parse.parse(pattern, flags)
        self._check = re.compile(pattern, flags)

    def sample(self, rng: random.Random, mode: GenerationMode, tries: int = 20) -> str | None:
        for _ in range(tries):
            groups: dict[int, str] = {}
            out = self._gen(self._tree, rng, mode, groups)
            if self._check.fullmatch(out):
                return out
        return None

    # --- tree walk ----------------------------------------------------------------------
    def _gen(self, items, rng, mode, groups) -> str:
        parts = []
        for op, av in items:
            parts.append(self._one(op, av, rng, mode, groups))
        return "".join(parts)

    def _one(self, op, av, rng, mode, groups) -> str:
        if op is sre_c.LITERAL:
            return chr(av)
        if op is sre_c.NOT_LITERAL:
            return self._pick(rng, mode, lambda c: ord(c) != av)
        if op is sre_c.ANY:
            return self._pick(rng, mode, lambda c: c != "\n")
        if op is sre_c.IN:
            return self._pick(rng, mode, lambda c: _in_class(c, av), ranges=av)
        if op is sre_c.CATEGORY:
            return self._pick(rng, mode, lambda c: _in_category(c, av))
        if op is sre_c.BRANCH:
            return self._gen(rng.choice(av[1]), rng, mode, groups)
        if op is sre_c.SUBPATTERN:
            group, _add, _del, sub = av
            text = self._gen(sub, rng, mode, groups)
            if group is not None:
                groups[group] = text
            return text
        if op in (sre_c.MAX_REPEAT, sre_c.MIN_REPEAT) or op is getattr(
                sre_c, "POSSESSIVE_REPEAT", None):
            lo, hi, sub = av
            hi = lo + mode.max_repeat if hi is sre_c.MAXREPEAT else min(hi, lo + mode.max_repeat)
            n = min(hi, lo + int(rng.expovariate(1 / mode.repeat_mean)))
            if mode.whitespace_runs and _is_whitespace_item(sub):
                n = min(hi, max(n, rng.randint(lo, min(hi, lo + 8))))
            return "".join(self._gen(sub, rng, mode, groups) for _ in range(n))
        if op is sre_c.GROUPREF:
            return groups.get(av, "")
        if op is getattr(sre_c, "ATOMIC_GROUP", None):
            return self._gen(av, rng, mode, groups)
        # AT (anchors), ASSERT, ASSERT_NOT: zero-width; the final fullmatch filters misses.
        return ""

    @staticmethod
    def _pick(rng, mode, ok, ranges=None) -> str:
        if mode.whitespace_runs:
            ws = [c for c in WHITESPACE if ok(c)]
            if ws and rng.random() < 0.5:
                return rng.choice(ws)
        if rng.random() < mode.unicode_weight:
            uni = [c for c in UNICODE if ok(c)]
            if uni:
                return rng.choice(uni)
        pool = [c for c in ASCII if ok(c)] or [c for c in UNICODE + WHITESPACE if ok(c)]
        if pool:
            return rng.choice(pool)
        for _, av in ranges or ():  # a class of only exotic characters: take from its ranges
            if isinstance(av, tuple):
                return chr(rng.randint(*av))
        raise ValueError("regex class matches no sampled character")


def _in_category(c: str, cat) -> bool:
    name = str(cat).lower()
    neg = "not_" in name
    if "digit" in name:
        hit = c.isdigit()
    elif "space" in name:
        hit = c.isspace()
    elif "word" in name:
        hit = c.isalnum() or c == "_"
    elif "linebreak" in name:
        hit = c == "\n"
    else:
        hit = False
    return hit != neg


def _in_class(c: str, items) -> bool:
    negate = False
    hit = False
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            hit |= ord(c) == av
        elif op is sre_c.RANGE:
            hit |= av[0] <= ord(c) <= av[1]
        elif op is sre_c.CATEGORY:
            hit |= _in_category(c, av)
    return hit != negate


def _is_whitespace_item(sub) -> bool:
    try:
        return all(_in_class(" ", av) for op, av in sub if op is sre_c.IN) and any(
            op is sre_c.IN for op, av in sub)
    except Exception:  # noqa: BLE001
        return False


class LarkGenerator:
    """Random derivations of a Lark grammar over its rules that can finish.

    Rules that can never finish (:mod:`.grammar_analysis`) are left out, so every derivation
    ends; expansion uses an explicit stack, never Python recursion, and stops (returning
    None) after a fixed number of expansions. A grammar whose start can never finish yields
    no string; :attr:`diagnostics` says why.
    """

    #: Most rule expansions in one derivation.
    MAX_EXPANSIONS = 4000

    def __init__(self, lark_text: str):
        analysis = analyse_lark(lark_text)
        self.diagnostics = list(analysis.diagnostics)
        self._rules: dict[str, list[list]] = {}
        for rule in analysis.productive_rules:
            self._rules.setdefault(rule.origin.name, []).append(list(rule.expansion))
        self._terminals = {}
        for t in analysis.terminals:
            if t.pattern.type == "str":
                self._terminals[t.name] = t.pattern.value
            else:
                self._terminals[t.name] = RegexGenerator(t.pattern.to_regexp())
        self._height = self._heights()

    def _heights(self) -> dict[str, float]:
        inf = float("inf")
        height = {name: inf for name in self._rules}

        def h_exp(exp) -> float:
            return max((0 if s.is_term else height.get(s.name, inf) + 1 for s in exp),
                       default=0)

        changed = True
        while changed:
            changed = False
            for name, exps in self._rules.items():
                best = min(h_exp(e) for e in exps)
                if best < height[name]:
                    height[name] = best
                    changed = True
        self._h_exp = h_exp
        return height

    def sample(self, rng: random.Random, mode: GenerationMode) -> str | None:
        if "start" not in self._rules:
            return None  # the start rule can never finish: the language is empty
        out: list[str] = []
        todo: list[tuple[object, int]] = [("start", 0)]  # (rule name or terminal, depth)
        expansions = 0
        while todo:
            item, depth = todo.pop()
            if not isinstance(item, str):  # a terminal symbol
                gen = self._terminals[item.name]
                if isinstance(gen, str):
                    out.append(gen)
                    continue
                text = gen.sample(rng, mode)
                if text is None:
                    return None
                out.append(text)
                continue
            expansions += 1
            if expansions > self.MAX_EXPANSIONS:
                return None
            exps = self._choices(item, depth, rng, mode)
            for sym in reversed(rng.choice(exps)):
                todo.append((sym if sym.is_term else sym.name, depth + 1))
        return "".join(out)

    def _choices(self, name: str, depth: int, rng, mode) -> list:
        exps = self._rules[name]
        if depth >= mode.max_depth:
            best = min(self._h_exp(e) for e in exps)
            return [e for e in exps if self._h_exp(e) == best]
        if mode.name == "deep":
            # Prefer recursive alternatives until the depth budget is spent.
            top = max(self._h_exp(e) for e in exps)
            if rng.random() < 0.8:
                return [e for e in exps if self._h_exp(e) == top]
        return exps


class _TooLong(Exception):
    pass


class JsonSchemaGenerator:
    """Instances of a JSON schema (types, properties/required, items, enum/const, lengths),
    serialised with varied whitespace."""

    def __init__(self, schema_text: str):
        self.schema = json.loads(schema_text)

    def sample(self, rng: random.Random, mode: GenerationMode) -> str | None:
        value = self._value(self.schema, rng, mode, 0)
        if mode.whitespace_runs:
            return json.dumps(value, indent=rng.choice([1, 2, 4]), ensure_ascii=False)
        ensure_ascii = mode.name not in ("unicode",) and rng.random() < 0.5
        return json.dumps(value, ensure_ascii=ensure_ascii,
                          separators=rng.choice([(",", ":"), (", ", ": ")]))

    def _value(self, s: dict, rng, mode, depth):
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return rng.choice(s["enum"])
        for key in ("anyOf", "oneOf"):
            if key in s:
                return self._value(rng.choice(s[key]), rng, mode, depth + 1)
        kind = s.get("type", "object" if "properties" in s else "string")
        if isinstance(kind, list):
            kind = rng.choice(kind)
        if kind == "object":
            props = s.get("properties", {})
            required = set(s.get("required", []))
            out = {}
            for name, sub in props.items():
                if name in required or rng.random() < 0.6:
                    out[name] = self._value(sub, rng, mode, depth + 1)
            return out
        if kind == "array":
            lo = s.get("minItems", 0)
            hi = s.get("maxItems", lo + (mode.max_repeat if depth < 4 else 1))
            n = rng.randint(lo, max(lo, min(hi, lo + int(mode.repeat_mean * 2))))
            return [self._value(s.get("items", {"type": "integer"}), rng, mode, depth + 1)
                    for _ in range(n)]
        if kind == "integer":
            return rng.randint(s.get("minimum", -1000), s.get("maximum", 1000))
        if kind == "number":
            return round(rng.uniform(s.get("minimum", -1e3), s.get("maximum", 1e3)), 3)
        if kind == "boolean":
            return rng.random() < 0.5
        if kind == "null":
            return None
        if "pattern" in s:
            return RegexGenerator(s["pattern"]).sample(rng, mode) or ""
        lo = s.get("minLength", 0)
        hi = s.get("maxLength", lo + mode.max_repeat * 2)
        n = rng.randint(lo, max(lo, hi))
        unicode = mode.unicode_weight > 0.5
        # C0 controls are written as \\uXXXX escapes by json.dumps: every mode has them.
        pool = ASCII + (UNICODE + JSON_RAW_CONTROLS if unicode else []) + ['"', "\\", "\n",
                                                                            "\x01", "\x1f"]
        chars = [rng.choice(pool) for _ in range(n)]
        if unicode and chars:
            # Raw DEL and C1 controls are valid unescaped JSON string characters (RFC 8259
            # only forbids U+0000-U+001F): every unicode-mode string carries one.
            chars[rng.randrange(n)] = rng.choice(JSON_RAW_CONTROLS)
        elif mode.name == "long" and chars:
            chars[rng.randrange(n)] = rng.choice(["\x01", "\x1f"])  # a \\u00XX escape
        return "".join(chars)


def grammar_generator(grammar: Grammar):
    """A generator with ``sample(rng, mode) -> str | None`` for ``grammar``."""
    if grammar.format == "regex":
        return RegexGenerator(grammar.text)
    if grammar.format == "json_schema":
        return JsonSchemaGenerator(grammar.text)
    if grammar.format == "lark":
        return LarkGenerator(grammar.text)

    return LarkGenerator(ebnf_to_lark(grammar.text, grammar_name=grammar.name))


def valid_strings(grammar: Grammar, n: int, seed: int, modes=None,
                  max_chars: int = 600) -> tuple[list[tuple[str, str]], int]:
    """``n`` distinct strings (mode, text) the reference accepts, and how many drawn strings it
    rejected (a generator/lexing mismatch, reported as such)."""
    gen = grammar_generator(grammar)
    ref = reference_acceptor(grammar)
    rng = random.Random(seed)
    modes = list(modes or MODES)
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    rejected = 0
    attempts = 0
    while len(out) < n and attempts < n * 20:
        mode = MODES[modes[attempts % len(modes)]]
        attempts += 1
        text = gen.sample(rng, mode)
        if text is None or text in seen or len(text) > max_chars:
            continue
        seen.add(text)
        if ref.accepts(text):
            out.append((mode.name, text))
        else:
            rejected += 1
    return out, rejected
