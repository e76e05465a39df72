"""Faithful conversion between Lark grammars and EBNF (the GBNF dialect of llama.cpp / XGrammar).

Backends disagree on grammar formats: SynCode reads Lark, XGrammar reads EBNF. Converting lets
every backend serve every built-in grammar, but only where the language stays the same, so both
directions go through real parsers into one small tree (:class:`Lit`, :class:`CharClass`,
:class:`Ref`, :class:`Seq`, :class:`Alt`, :class:`Repeat`) and refuse what they cannot carry:

- Lark sources are read with Lark's own grammar parser (``lark.load_grammar``); Lark regex
  terminals with Python's regex parser (``re._parser``) and turned into character classes and
  repetitions; ``"select"i`` becomes one case class per character (Python's case rules).
- EBNF sources are read with a Lark grammar of GBNF (this module's ``_EBNF_GRAMMAR``).
- Refused with :class:`UnsupportedGrammarError` naming the line and the construct: ``%ignore``
  (a character-level CFG has no "skip between tokens"; write the whitespace explicitly),
  ``%declare``, ``%override``/``%extend``, templates, regex lookarounds, anchors,
  backreferences, possessive/atomic groups, EBNF lookahead assertions ``(= ...)``.
- Lowered with a note: rule/terminal priorities (they only choose between parses), lazy
  quantifiers (same strings, different match preference).

Caveat (not detected): Lark's lexers are greedy, one longest match per regex terminal, while a
character-level CFG may split text between adjacent terminals anywhere. When a terminal can be
followed by a terminal whose first characters could continue it (``/a+/ "a"``), Lark rejects
strings the converted CFG accepts, so the two languages differ. The built-in grammars avoid
this (explicit separators); converted EBNF->Lark output never has the problem because it uses
only fixed-length terminals (literals and one-character classes).
"""

from __future__ import annotations

import functools
import re
import sys
from dataclasses import dataclass, field
from typing import Iterable, Union

from shim_adapters.errors import GrammarError, UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar

MAX_CODEPOINT = 0x10FFFF
_SURROGATES = (0xD800, 0xDFFF)


# ---- the common tree ----------------------------------------------------------------------
@dataclass(frozen=True)
class Lit:
    text: str


@dataclass(frozen=True)
class CharClass:
    """Code-point ranges (inclusive); ``negated`` means every character outside them."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Seq:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Alt:
    options: tuple["Node", ...]


@dataclass(frozen=True)
class Repeat:
    item: "Node"
    min: int
    max: int | None  # None: unbounded


Node = Union[Lit, CharClass, Ref, Seq, Alt, Repeat]


@dataclass
class _Rules:
    """An ordered rule set: name -> body, plus the line each rule came from."""

    bodies: dict[str, Node] = field(default_factory=dict)
    lines: dict[str, int | None] = field(default_factory=dict)


@dataclass(frozen=True)
class ConversionResult:
    """A converted grammar and what the conversion did: ``("exact",)`` or the lowerings."""

    grammar: Grammar
    notes: tuple[str, ...]

    @property
    def exact(self) -> bool:
        return self.notes == ("exact",)


def convert(grammar: Grammar, to: str) -> ConversionResult:
    """Convert ``grammar`` to format ``to`` (``lark`` or ``ebnf``), with a capability report."""
    if grammar.format == to:
        return ConversionResult(grammar, ("exact",))
    notes: list[str] = []
    if grammar.format == "lark" and to == "ebnf":
        text = _lark_to_ebnf(grammar.text, grammar.name, notes)
    elif grammar.format == "ebnf" and to == "lark":
        text = _ebnf_to_lark(grammar.text, grammar.name, notes)
    else:
        raise UnsupportedGrammarError(f"no converter from {grammar.format} to {to}",
                                      grammar_name=grammar.name)
    converted = Grammar(text=text, format=to, name=grammar.name,
                        default_prompt=grammar.default_prompt)
    return ConversionResult(converted, tuple(dict.fromkeys(notes)) or ("exact",))


def lark_to_ebnf(text: str, grammar_name: str = "<grammar>") -> str:
    """A Lark grammar (start rule ``start``) as EBNF with root rule ``root``; see module doc."""
    return _lark_to_ebnf(text, grammar_name, [])


def ebnf_to_lark(text: str, grammar_name: str = "<grammar>") -> str:
    """An EBNF/GBNF grammar (root rule ``root``) as a Lark grammar with start rule ``start``."""
    return _ebnf_to_lark(text, grammar_name, [])


# ---- Lark -> tree ---------------------------------------------------------------------------
_UNSUPPORTED_STATEMENTS = {
    "ignore": "%ignore cannot be made faithful in a character-level grammar (it lets the "
              "ignored terminal appear between any two tokens); write the whitespace explicitly "
              "in the rules instead",
    "declare": "%declare (terminals supplied by a custom lexer) has no definition to convert",
    "override": "%override is not supported by the converter; edit the rule directly",
    "extend": "%extend is not supported by the converter; edit the rule directly",
}


def _first_line(tree) -> int | None:
    from lark import Token, Tree

    if isinstance(tree, Token):
        return tree.line
    if isinstance(tree, Tree):
        for child in tree.children:
            line = _first_line(child)
            if line is not None:
                return line
    return None


def _lark_error(exc: Exception, name: str) -> GrammarError:
    message = str(exc)
    match = re.search(r"line (\d+)(?: column (\d+))?", message)
    line = int(match.group(1)) if match else None
    column = int(match.group(2)) if match and match.group(2) else None
    return GrammarError(f"invalid Lark grammar: {message.splitlines()[0]}", grammar_name=name,
                        line=line, column=column)


class _LarkReader:
    """Turns Lark's parsed grammar statements into the common tree."""

    def __init__(self, text: str, name: str, notes: list[str]):
        import lark
        from lark.load_grammar import GrammarBuilder, _parse_grammar

        self.name = name
        self.notes = notes
        try:
            statements = _parse_grammar(text, name)
        except lark.exceptions.LarkError as exc:
            raise _lark_error(exc, name) from exc
        self.definitions: dict[str, tuple[object, bool, int | None]] = {}
        has_import = False
        for stmt in statements.children:
            kind = stmt.data
            if kind in _UNSUPPORTED_STATEMENTS:
                raise UnsupportedGrammarError(_UNSUPPORTED_STATEMENTS[kind], grammar_name=name,
                                              line=self._statement_line(stmt, text, kind))
            if kind == "import":
                has_import = True
            elif kind == "rule":
                modifiers, rname, params, priority, body = stmt.children
                if params.children:
                    raise UnsupportedGrammarError(
                        f"template rule {rname}{{...}} is not supported; write its instances out",
                        grammar_name=name, line=rname.line)
                if priority.children:
                    notes.append(f"rule priority on {rname} dropped (it only chooses between "
                                 "parses, the language is unchanged)")
                self._define(str(rname), body, False, rname.line)
            elif kind == "term":
                tname = stmt.children[0]
                if len(stmt.children) == 3:
                    notes.append(f"terminal priority on {tname} dropped (only disambiguates "
                                 "between lexings)")
                self._define(str(tname), stmt.children[-1], True, tname.line)
        self.imported: dict[str, object] = {}
        if has_import:
            builder = GrammarBuilder()
            try:
                builder.load_grammar(text, name)
            except lark.exceptions.LarkError as exc:
                raise _lark_error(exc, name) from exc
            for dname, definition in builder._definitions.items():
                if dname not in self.definitions and definition.tree is not None:
                    self.imported[dname] = definition

    @staticmethod
    def _statement_line(stmt, text: str, kind: str) -> int | None:
        line = _first_line(stmt)
        if line is not None:
            return line
        # Statements made only of symbols carry no token position: find the directive itself.
        for number, source_line in enumerate(text.splitlines(), start=1):
            if source_line.lstrip().startswith("%" + kind):
                return number
        return None

    def _define(self, name: str, body, is_term: bool, line: int | None) -> None:
        if name in self.definitions:
            raise GrammarError(f"{name} is defined more than once", grammar_name=self.name,
                               line=line)
        self.definitions[name] = (body, is_term, line)

    def rules(self) -> _Rules:
        if "start" not in self.definitions:
            raise GrammarError("a Lark grammar needs a 'start' rule", grammar_name=self.name)
        out = _Rules()
        pending = ["start"]
        while pending:
            sym = pending.pop()
            if sym in out.bodies:
                continue
            if sym in self.definitions:
                body, is_term, line = self.definitions[sym]
            elif sym in self.imported:
                body, is_term, line = self.imported[sym].tree, self.imported[sym].is_term, None
            else:
                raise GrammarError(f"symbol {sym} is used but not defined", grammar_name=self.name)
            out.bodies[sym] = self._node(body, line, sym, is_term)
            out.lines[sym] = line
            pending.extend(sorted(_refs(out.bodies[sym]) - set(out.bodies), reverse=True))
        return out

    def _node(self, tree, line: int | None, owner: str, is_term: bool) -> Node:
        from lark import Token, Tree
        from lark.grammar import NonTerminal, Terminal

        if isinstance(tree, (NonTerminal, Terminal)):
            return Ref(tree.name)
        assert isinstance(tree, Tree), tree
        kind = tree.data
        if kind == "expansions":
            return _alt(self._node(c, line, owner, is_term) for c in tree.children)
        if kind == "expansion":
            return _seq(self._node(c, line, owner, is_term) for c in tree.children)
        if kind == "alias":
            return self._node(tree.children[0], line, owner, is_term)
        if kind == "maybe":
            return Repeat(self._node(tree.children[0], line, owner, is_term), 0, 1)
        if kind == "value":
            return self._node(tree.children[0], line, owner, is_term)
        if kind == "expr":
            atom, op, *numbers = tree.children
            item = self._node(atom, line, owner, is_term)
            if op.type == "OP":
                return Repeat(item, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[str(op)])
            low = int(numbers[0])
            high = int(numbers[1]) if len(numbers) > 1 else low
            return Repeat(item, low, high)
        if kind == "literal":
            token: Token = tree.children[0]
            return self._literal(token, owner)
        if kind == "range":
            start, end = (self._pattern_of(t).value for t in tree.children)
            return CharClass(((ord(start), ord(end)),))
        if kind == "template_usage":
            raise UnsupportedGrammarError(f"template use in {owner} is not supported",
                                          grammar_name=self.name, line=line)
        raise UnsupportedGrammarError(f"construct {kind!r} in {owner} is not supported",
                                      grammar_name=self.name, line=line)

    def _pattern_of(self, token):
        import lark
        from lark.load_grammar import _literal_to_pattern

        try:
            return _literal_to_pattern(token)
        except lark.exceptions.GrammarError as exc:
            raise GrammarError(str(exc), grammar_name=self.name, line=token.line,
                               column=token.column) from exc

    def _literal(self, token, owner: str) -> Node:
        pattern = self._pattern_of(token)
        where = dict(grammar_name=self.name, line=token.line, column=token.column)
        flags = set(pattern.flags)
        unknown = flags - {"i", "s", "x", "u", "m"}
        if unknown:
            raise UnsupportedGrammarError(f"regex flags {sorted(unknown)} in {owner}", **where)
        if token.type == "STRING":
            if "i" in flags:
                return _seq(_case_node(ch) for ch in pattern.value)
            return Lit(pattern.value)
        re_flags = 0
        for letter, value in (("i", re.IGNORECASE), ("s", re.DOTALL), ("x", re.VERBOSE),
                              ("m", re.MULTILINE)):
            if letter in flags:
                re_flags |= value
        return _RegexReader(self.notes, owner, where).read(pattern.value, re_flags)


# ---- Python regex -> tree -------------------------------------------------------------------
if sys.version_info >= (3, 11):
    from re import _constants as _sre_c
    from re import _parser as _sre_parse
else:  # pragma: no cover - Python 3.10
    import sre_constants as _sre_c
    import sre_parse as _sre_parse


class _RegexReader:
    """Python regex (as ``re`` parses it) -> common tree, refusing non-regular constructs."""

    def __init__(self, notes: list[str], owner: str, where: dict):
        self.notes = notes
        self.owner = owner
        self.where = where

    def _refuse(self, what: str) -> UnsupportedGrammarError:
        return UnsupportedGrammarError(f"{what} in terminal/rule {self.owner} cannot be "
                                       "expressed in a context-free grammar", **self.where)

    def read(self, pattern: str, flags: int) -> Node:
        try:
            parsed = _sre_parse.parse(pattern, flags)
        except re.error as exc:
            raise GrammarError(f"invalid regex /{pattern}/: {exc}", **self.where) from exc
        return self._seq(parsed, parsed.state.flags)

    def _seq(self, items, flags: int) -> Node:
        return _seq(self._item(op, av, flags) for op, av in items)

    def _item(self, op, av, flags: int) -> Node:
        c = _sre_c
        ignore_case = bool(flags & re.IGNORECASE)
        if op is c.LITERAL:
            return _case_node(chr(av)) if ignore_case else Lit(chr(av))
        if op is c.NOT_LITERAL:
            chars = _case_variants(chr(av)) if ignore_case else {chr(av)}
            return CharClass(_ranges_of(ord(ch) for ch in chars), negated=True)
        if op is c.ANY:
            if flags & re.DOTALL:
                return CharClass(((0, MAX_CODEPOINT),))
            return CharClass(((10, 10),), negated=True)
        if op is c.IN:
            return self._class(av, flags)
        if op is c.BRANCH:
            return _alt(self._seq(branch, flags) for branch in av[1])
        if op is c.SUBPATTERN:
            _group, add_flags, del_flags, sub = av
            return self._seq(sub, (flags | add_flags) & ~del_flags)
        if op in (c.MAX_REPEAT, c.MIN_REPEAT):
            low, high, sub = av
            if op is c.MIN_REPEAT:
                self.notes.append(f"lazy quantifier in {self.owner} treated as greedy (same "
                                  "strings; only Lark's choice of match length differs)")
            return Repeat(self._seq(sub, flags), low, None if high == c.MAXREPEAT else high)
        if op is c.CATEGORY:
            return CharClass(_category_ranges(av, bool(flags & re.ASCII)))
        names = {c.AT: "an anchor (^, $, \\b, \\A, \\Z)", c.ASSERT: "a lookaround",
                 c.ASSERT_NOT: "a negative lookaround", c.GROUPREF: "a backreference",
                 c.GROUPREF_EXISTS: "a conditional backreference"}
        for extra in ("POSSESSIVE_REPEAT", "ATOMIC_GROUP"):
            if hasattr(c, extra):
                names[getattr(c, extra)] = "a possessive/atomic group (changes the language)"
        raise self._refuse(names.get(op, f"regex construct {op}"))

    def _class(self, items, flags: int) -> CharClass:
        c = _sre_c
        negated = False
        codes: list[tuple[int, int]] = []
        for op, av in items:
            if op is c.NEGATE:
                negated = True
            elif op is c.LITERAL:
                codes.append((av, av))
            elif op is c.RANGE:
                codes.append(av)
            elif op is c.CATEGORY:
                codes.extend(_category_ranges(av, bool(flags & re.ASCII)))
            else:
                raise self._refuse(f"class item {op}")
        if flags & re.IGNORECASE:
            widened: set[int] = set()
            for low, high in codes:
                if high - low > 4096:
                    raise self._refuse("a case-insensitive class with a range wider than 4096 "
                                       "characters")
                for code in range(low, high + 1):
                    widened.update(ord(ch) for ch in _case_variants(chr(code)))
            codes = list(_ranges_of(widened))
        return CharClass(_merge(codes), negated=negated)


@functools.lru_cache(maxsize=None)
def _all_text() -> str:
    """Every code point except surrogates (which UTF-8 text never contains)."""
    return "".join(chr(i) for i in range(MAX_CODEPOINT + 1)
                   if not _SURROGATES[0] <= i <= _SURROGATES[1])


@functools.lru_cache(maxsize=None)
def _category_ranges(category, ascii_only: bool) -> tuple[tuple[int, int], ...]:
    """Ranges of ``\\d \\w \\s`` and negations exactly as Python's ``re`` matches them."""
    c = _sre_c
    positive = {c.CATEGORY_DIGIT: r"\d", c.CATEGORY_NOT_DIGIT: r"\d", c.CATEGORY_SPACE: r"\s",
                c.CATEGORY_NOT_SPACE: r"\s", c.CATEGORY_WORD: r"\w", c.CATEGORY_NOT_WORD: r"\w"}
    if category not in positive:
        raise UnsupportedGrammarError(f"regex category {category} is not supported")
    flags = re.ASCII if ascii_only else 0
    text = _all_text()
    spans = [(ord(text[m.start()]), ord(text[m.end() - 1]))
             for m in re.finditer(positive[category] + "+", text, flags)]
    # finditer over the surrogate-free text may join ranges across the surrogate gap; split them.
    ranges = _merge(_split_surrogates(spans))
    if "NOT" in str(category):
        return _complement(ranges)
    return ranges


def _split_surrogates(spans):
    for low, high in spans:
        if low < _SURROGATES[0] <= high:
            yield (low, _SURROGATES[0] - 1)
            yield (_SURROGATES[1] + 1, high)
        else:
            yield (low, high)


def _complement(ranges) -> tuple[tuple[int, int], ...]:
    out, nxt = [], 0
    for low, high in ranges:
        if low > nxt:
            out.append((nxt, low - 1))
        nxt = high + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return _merge(_split_surrogates(out))


def _merge(ranges) -> tuple[tuple[int, int], ...]:
    out: list[list[int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], high)
        else:
            out.append([low, high])
    return tuple((low, high) for low, high in out)


def _ranges_of(codes: Iterable[int]) -> tuple[tuple[int, int], ...]:
    return _merge((code, code) for code in codes)


@functools.lru_cache(maxsize=None)
def _same_lower() -> dict[str, tuple[str, ...]]:
    """Characters grouped by ``str.lower()``: ``re.IGNORECASE`` compares lowered characters."""
    groups: dict[str, list[str]] = {}
    for ch in _all_text():
        low = ch.lower()
        if len(low) == 1 and low != ch:
            groups.setdefault(low, [low]).append(ch)
    return {low: tuple(chars) for low, chars in groups.items()}


@functools.lru_cache(maxsize=4096)
def _case_variants(ch: str) -> frozenset[str]:
    """Characters ``re.IGNORECASE`` treats as equal to ``ch`` (incl. its extra case pairs)."""
    candidates = {ch, ch.lower(), ch.upper(), ch.casefold(), ch.title(), ch.swapcase()}
    try:
        from re._casefix import _EXTRA_CASES
    except ImportError:  # pragma: no cover - Python 3.10
        _EXTRA_CASES = {}
    for base in list(candidates):
        if len(base) == 1:
            candidates.update(_same_lower().get(base.lower(), ()))
    for base in list(candidates):
        if len(base) == 1:
            candidates.update(chr(x) for x in _EXTRA_CASES.get(ord(base), ()))
    pattern = re.compile(re.escape(ch), re.IGNORECASE)
    return frozenset(x for x in candidates if len(x) == 1 and pattern.fullmatch(x))


def _case_node(ch: str) -> Node:
    variants = _case_variants(ch)
    return Lit(ch) if len(variants) == 1 else CharClass(_ranges_of(ord(x) for x in variants))


def _seq(items: Iterable[Node]) -> Node:
    flat: list[Node] = []
    for item in items:
        if isinstance(item, Seq):
            flat.extend(item.items)
        else:
            flat.append(item)
    merged: list[Node] = []
    for item in flat:  # adjacent literals read as one
        if isinstance(item, Lit) and merged and isinstance(merged[-1], Lit):
            merged[-1] = Lit(merged[-1].text + item.text)
        elif not (isinstance(item, Lit) and item.text == ""):
            merged.append(item)
    return merged[0] if len(merged) == 1 else Seq(tuple(merged))


def _alt(options: Iterable[Node]) -> Node:
    flat: list[Node] = []
    for option in options:
        flat.extend(option.options if isinstance(option, Alt) else (option,))
    return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def _refs(node: Node) -> set[str]:
    if isinstance(node, Ref):
        return {node.name}
    if isinstance(node, (Seq, Alt)):
        children = node.items if isinstance(node, Seq) else node.options
        return set().union(*(_refs(c) for c in children)) if children else set()
    if isinstance(node, Repeat):
        return _refs(node.item)
    return set()


# ---- tree -> EBNF ---------------------------------------------------------------------------
_EBNF_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\\": "\\\\"}


def _ebnf_char(code: int, specials: str) -> str:
    ch = chr(code)
    if ch in _EBNF_ESCAPES:
        return _EBNF_ESCAPES[ch]
    if ch in specials:
        return "\\" + ch
    if code < 0x20 or code == 0x7F or 0xD800 <= code <= 0xDFFF or not ch.isprintable():
        return f"\\x{code:02x}" if code < 0x100 else (
            f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return ch


def _ebnf(node: Node, names: dict[str, str], top: bool = False) -> str:
    if isinstance(node, Lit):
        return '"' + "".join(_ebnf_char(ord(ch), '"') for ch in node.text) + '"'
    if isinstance(node, CharClass):
        body = "".join(_ebnf_char(lo, "]-^") if lo == hi else
                       f"{_ebnf_char(lo, ']-^')}-{_ebnf_char(hi, ']-^')}"
                       for lo, hi in node.ranges)
        return "[" + ("^" if node.negated else "") + body + "]"
    if isinstance(node, Ref):
        return names[node.name]
    if isinstance(node, Seq):
        text = " ".join(_ebnf(item, names) for item in node.items) if node.items else '""'
        return text if top or len(node.items) <= 1 else f"({text})"
    if isinstance(node, Alt):
        text = " | ".join(_ebnf(option, names, top=True) for option in node.options)
        return text if top else f"({text})"
    if isinstance(node, Repeat):
        inner = _ebnf(node.item, names, top=True)
        if isinstance(node.item, (Seq, Alt, Repeat)):
            inner = f"({inner})"
        suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((node.min, node.max))
        if suffix is None:
            suffix = (f"{{{node.min}}}" if node.min == node.max else
                      f"{{{node.min},}}" if node.max is None else f"{{{node.min},{node.max}}}")
        return inner + suffix
    raise TypeError(node)


def _ebnf_name(name: str, taken: set[str]) -> str:
    candidate = name if name != "root" else "root_"
    while candidate in taken:
        candidate += "_"
    taken.add(candidate)
    return candidate


def _lark_to_ebnf(text: str, grammar_name: str, notes: list[str]) -> str:
    rules = _LarkReader(text, grammar_name, notes).rules()
    taken = {"root"}
    names = {name: _ebnf_name(name, taken) for name in rules.bodies}
    lines = [f"root ::= {names['start']}"]
    for name, body in rules.bodies.items():
        lines.append(f"{names[name]} ::= {_ebnf(body, names, top=True)}")
    return "\n".join(lines) + "\n"


# ---- EBNF -> tree ---------------------------------------------------------------------------
_EBNF_GRAMMAR = r"""
start: rule*
rule: RULE_HEAD alternatives
alternatives: sequence ("|" sequence)*
sequence: item*
item: atom QUANT?
?atom: STRING | CLASS | NAME | group | lookahead
group: "(" alternatives ")"
lookahead: LOOKAHEAD_OPEN alternatives ")"

RULE_HEAD.2: /[A-Za-z_][A-Za-z0-9_.\-]*[ \t]*::=/
NAME: /[A-Za-z_][A-Za-z0-9_.\-]*/
STRING: /"(\\.|[^"\\\n])*"/
CLASS: /\[(\\.|[^\]\\\n])*\]/
QUANT: /[*+?]/ | /\{[ \t]*[0-9]+[ \t]*(,[ \t]*[0-9]*[ \t]*)?\}/
LOOKAHEAD_OPEN: /\([ \t]*=/
COMMENT: /#[^\n]*/
%import common.WS
%ignore WS
%ignore COMMENT
"""


@functools.lru_cache(maxsize=1)
def _ebnf_parser():
    import lark

    return lark.Lark(_EBNF_GRAMMAR, parser="lalr", lexer="basic", propagate_positions=True)


_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t", "0": "\0", "f": "\f", "v": "\v",
                   "a": "\a", "b": "\b"}


def _unescape(body: str, where: dict) -> list[tuple[str, bool]]:
    """Decode a string/class body: (character, was_escaped) pairs."""
    out, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            out.append((ch, False))
            i += 1
            continue
        if i + 1 >= len(body):
            raise GrammarError("dangling backslash", **where)
        nxt = body[i + 1]
        width = {"x": 2, "u": 4, "U": 8}.get(nxt)
        if width:
            digits = body[i + 2:i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise GrammarError(f"bad escape \\{nxt}{digits}", **where)
            out.append((chr(int(digits, 16)), True))
            i += 2 + width
        else:
            out.append((_SIMPLE_ESCAPES.get(nxt, nxt), True))
            i += 2
    return out


class _EbnfReader:
    def __init__(self, text: str, name: str):
        import lark

        self.name = name
        try:
            self.tree = _ebnf_parser().parse(text)
        except lark.exceptions.UnexpectedInput as exc:
            raise GrammarError(f"EBNF syntax error: unexpected "
                               f"{_describe_unexpected(exc, text)}", grammar_name=name,
                               line=exc.line, column=exc.column) from exc

    def rules(self) -> _Rules:
        out = _Rules()
        for rule in self.tree.children:
            head, body = rule.children
            rname = head.value[:-3].strip()
            if rname in out.bodies:
                raise GrammarError(f"rule {rname} is defined more than once",
                                   grammar_name=self.name, line=head.line)
            out.bodies[rname] = self._node(body)
            out.lines[rname] = head.line
        if "root" not in out.bodies:
            raise GrammarError("an EBNF grammar needs a 'root' rule", grammar_name=self.name)
        for rname, body in out.bodies.items():
            for ref in self._refs_with_lines(_rule_tree_of(self.tree, rname)):
                if ref.value not in out.bodies:
                    raise GrammarError(f"rule {ref.value} is used in {rname} but never defined",
                                       grammar_name=self.name, line=ref.line, column=ref.column)
        return out

    @staticmethod
    def _refs_with_lines(tree):
        from lark import Token

        return [t for t in tree.scan_values(lambda v: isinstance(v, Token) and v.type == "NAME")]

    def _node(self, tree) -> Node:
        from lark import Token

        if isinstance(tree, Token):
            where = dict(grammar_name=self.name, line=tree.line, column=tree.column)
            if tree.type == "NAME":
                return Ref(tree.value)
            if tree.type == "STRING":
                return Lit("".join(ch for ch, _ in _unescape(tree.value[1:-1], where)))
            if tree.type == "CLASS":
                return self._class(tree.value[1:-1], where)
            raise GrammarError(f"unexpected {tree.value!r}", **where)
        kind = tree.data
        if kind == "alternatives":
            return _alt(self._node(c) for c in tree.children)
        if kind == "sequence":
            return _seq(self._node(c) for c in tree.children)
        if kind == "group":
            return self._node(tree.children[0])
        if kind == "lookahead":
            raise UnsupportedGrammarError(
                "lookahead assertion (= ...) is not supported by the converter",
                grammar_name=self.name, line=tree.meta.line, column=tree.meta.column)
        if kind == "item":
            atom = self._node(tree.children[0])
            if len(tree.children) == 1:
                return atom
            quant = tree.children[1]
            text = quant.value.replace(" ", "").replace("\t", "")
            if text in ("*", "+", "?"):
                return Repeat(atom, *{"*": (0, None), "+": (1, None), "?": (0, 1)}[text])
            low_text, comma, high_text = text[1:-1].partition(",")
            low = int(low_text)
            high = low if not comma else (int(high_text) if high_text else None)
            if high is not None and high < low:
                raise GrammarError(f"repetition {quant.value} has max < min",
                                   grammar_name=self.name, line=quant.line, column=quant.column)
            return Repeat(atom, low, high)
        raise GrammarError(f"unexpected construct {kind}", grammar_name=self.name)

    def _class(self, body: str, where: dict) -> CharClass:
        chars = _unescape(body, where)
        negated = bool(chars) and chars[0] == ("^", False)
        if negated:
            chars = chars[1:]
        ranges, i = [], 0
        while i < len(chars):
            ch, _ = chars[i]
            if i + 2 < len(chars) and chars[i + 1] == ("-", False):
                hi = chars[i + 2][0]
                if ord(hi) < ord(ch):
                    raise GrammarError(f"character range {ch!r}-{hi!r} is reversed", **where)
                ranges.append((ord(ch), ord(hi)))
                i += 3
            else:
                ranges.append((ord(ch), ord(ch)))
                i += 1
        if not ranges and not negated:
            raise GrammarError("empty character class []", **where)
        return CharClass(_merge(ranges), negated=negated)


def _rule_tree_of(tree, rule_name: str):
    for rule in tree.children:
        if rule.children[0].value[:-3].strip() == rule_name:
            return rule
    raise KeyError(rule_name)


def _describe_unexpected(exc, text: str) -> str:
    token = getattr(exc, "token", None)
    if token is not None:
        return f"{token.value!r}" if token.type != "$END" else "end of grammar"
    char = getattr(exc, "char", None)
    return repr(char) if char is not None else "input"


# ---- tree -> Lark ---------------------------------------------------------------------------
def _lark_string_char(ch: str) -> str:
    code = ord(ch)
    if ch == '"':
        return '\\"'
    if ch == "\\":
        return "\\\\"
    if code < 0x20 or code == 0x7F or not ch.isprintable():
        return f"\\x{code:02x}" if code < 0x100 else (
            f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return ch


def _regex_char(code: int) -> str:
    ch = chr(code)
    if ch in "\\]-^[/":
        return "\\" + ch
    if code < 0x20 or code == 0x7F or not ch.isprintable() or ch.isspace():
        return f"\\x{code:02x}" if code < 0x100 else (
            f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return ch


def _lark(node: Node, names: dict[str, str], top: bool = False) -> str:
    if isinstance(node, Lit):
        return '"' + "".join(_lark_string_char(ch) for ch in node.text) + '"'
    if isinstance(node, CharClass):
        body = "".join(_regex_char(lo) if lo == hi else f"{_regex_char(lo)}-{_regex_char(hi)}"
                       for lo, hi in node.ranges)
        if node.negated:
            return f"/[^{body}]/" if body else "/./s"
        return f"/[{body}]/"
    if isinstance(node, Ref):
        return names[node.name]
    if isinstance(node, Seq):
        text = " ".join(_lark(item, names) for item in node.items)
        return text if top else f"({text})"
    if isinstance(node, Alt):
        text = " | ".join(_lark(option, names, top=True) for option in node.options)
        return text if top else f"({text})"
    if isinstance(node, Repeat):
        if node.max == 0:
            return "()" if not top else ""
        inner = _lark(node.item, names, top=True)
        if isinstance(node.item, (Seq, Alt, Repeat)):
            inner = f"({inner})"
        suffix = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((node.min, node.max))
        if suffix is not None:
            return inner + suffix
        if node.max is None:  # {m,}: m copies then any number more
            return f"({inner} ~ {node.min} {inner}*)"
        if node.min == 0:  # Lark ranges start at 1: make the whole repeat optional
            return f"({inner} ~ 1..{node.max})?"
        return f"{inner} ~ {node.min}" + (f"..{node.max}" if node.max != node.min else "")
    raise TypeError(node)


def _lark_name(name: str, taken: set[str]) -> str:
    base = re.sub(r"[^a-z0-9_]", "_", name.lower())
    if not re.match(r"[a-z]", base):
        base = "r_" + base
    candidate = base
    n = 2
    while candidate in taken:
        candidate = f"{base}_{n}"
        n += 1
    taken.add(candidate)
    return candidate


def _ebnf_to_lark(text: str, grammar_name: str, notes: list[str]) -> str:
    rules = _EbnfReader(text, grammar_name).rules()
    taken = {"start"}
    names = {name: _lark_name(name, taken) for name in rules.bodies}
    lines = [f"start: {names['root']}"]
    for name, body in rules.bodies.items():
        rendered = _lark(body, names, top=True)
        lines.append(f"{names[name]}: {rendered}")
    return "\n".join(lines) + "\n"



def rules_of(grammar: Grammar) -> dict[str, Node]:
    """The grammar as the common tree: rule name -> body (``start``/``root`` is the entry)."""
    if grammar.format == "lark":
        return dict(_LarkReader(grammar.text, grammar.name, []).rules().bodies)
    if grammar.format == "ebnf":
        return dict(_EbnfReader(grammar.text, grammar.name).rules().bodies)
    raise UnsupportedGrammarError(f"{grammar.format} grammars have no rules to read",
                                  grammar_name=grammar.name)
