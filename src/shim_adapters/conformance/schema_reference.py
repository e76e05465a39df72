"""A JSON schema as Lark grammars, so prefixes are judged by the schema, not JSON syntax.

A finished string is judged by ``jsonschema``; an unfinished one needs a grammar. No library
installed here turns a schema into a grammar without being one of the backends under test
(outlines_core, XGrammar, llguidance), so the translation is ours and comes in two readings
that make the verdicts one-sided on purpose:

- ``relaxed`` (an over-approximation, for allowed tokens): every instance of the schema
  in any serialisation (members in any order, escapes in keys and enum strings, ``1.0`` as an
  integer); constraints it cannot express are dropped and listed. A token it calls dead is
  unsound for certain.
- ``ordered`` (an under-approximation, for refused tokens): instances only, with members in
  the schema's property order (the order every schema backend here emits), enum values in
  their ``json.dumps`` spelling, no whitespace before the value (RFC 8259 allows it; no schema
backend here emits it). A token it calls viable starts a valid instance, so refusing
  it is incomplete for certain. A construct it cannot express exactly raises
  :class:`~shim_adapters.errors.UnsupportedGrammarError` naming it (refusals are then not
  judged token by token).

Both encode types, ``properties``/``required``/``additionalProperties``, ``items``,
``minItems``/``maxItems``, string ``minLength``/``maxLength`` (an escape is one character,
a surrogate-pair escape one code point), ``enum``/``const``, ``anyOf``, ``$ref`` to ``$defs``;
the ordered reading adds small integer ranges as enumerations.
"""

from __future__ import annotations

import json
import re
from typing import Any

from shim_adapters.errors import UnsupportedGrammarError

#: Keywords that never constrain an instance here (annotations; ``format`` is not asserted
#: by the reference acceptor, Draft 2020-12's default).
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "default",
                          "examples", "$defs", "definitions", "readOnly", "writeOnly",
                          "deprecated", "$anchor", "format", "contentMediaType",
                          "contentEncoding"})
_ESCAPE = r'\\["\\/bfnrt]'
_PLAIN = r'[^"\\\x00-\x1f]'
#: One character of a JSON string body. Ordered: no surrogate escapes (a pair is one code
#: point, so counting escapes would miscount); relaxed: a pair counts as one, or two.
_CHAR = {
    True: rf'(?:{_PLAIN}|{_ESCAPE}|\\u(?:[0-9a-cA-CefEF][0-9a-fA-F]{{3}}|[dD][0-7][0-9a-fA-F]{{2}}))',
    False: rf'(?:\\u[dD][89abAB][0-9a-fA-F]{{2}}\\u[dD][c-fC-F][0-9a-fA-F]{{2}}|{_PLAIN}|'
           rf'{_ESCAPE}|\\u[0-9a-fA-F]{{4}})',
}
_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
#: A number written with a fraction or an exponent (an integer value may be written so).
_NOT_PLAIN_NUMBER = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:[eE][+-]?[0-9]+)?|[eE][+-]?[0-9]+)"
_ANY_STRING = rf'"{_CHAR[False]}*"'
_SHORT_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "\b": "b", "\f": "f", "\n": "n",
                  "\r": "r", "\t": "t"}


def _hex_escape(code: int) -> str:
    return r"\\u" + "".join(d if d.isdigit() else f"[{d}{d.upper()}]" for d in f"{code:04x}")


def spellings(value: str) -> str:
    """A regex of every JSON spelling of the string ``value`` (each character raw where
    JSON allows it, as a short escape, or as a \\u escape in either hex case)."""
    parts = []
    for ch in value:
        code = ord(ch)
        options = []
        if code >= 0x20 and ch not in '"\\':
            options.append(re.escape(ch))
        if ch in _SHORT_ESCAPES:
            options.append(r"\\" + re.escape(_SHORT_ESCAPES[ch]))
        if code > 0xFFFF:
            hi, lo = 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF)
            options.append(_hex_escape(hi) + _hex_escape(lo))
        else:
            options.append(_hex_escape(code))
        parts.append("(?:" + "|".join(options) + ")")
    return '"' + "".join(parts) + '"'
#: Integer ranges up to this size are enumerated exactly in the ordered reading.
MAX_ENUMERATED_RANGE = 5000


class _Builder:
    def __init__(self, root: Any, ordered: bool):
        self.root = root
        self.ordered = ordered
        self.rules: dict[str, list[list[str]]] = {}
        self.terminals: dict[str, str] = {}
        self.memo: dict[str, str] = {}
        self.dropped: set[str] = set()

    # -- helpers -----------------------------------------------------------------------
    def term(self, pattern: str) -> str:
        for name, p in self.terminals.items():
            if p == pattern:
                return name
        name = f"T{len(self.terminals)}"
        self.terminals[name] = pattern
        return name

    def literal(self, text: str) -> str:
        return self.term(re.escape(text))

    def new_rule(self, alternatives: list[list[str]], hint: str = "r") -> str:
        name = f"{hint}{len(self.rules)}"
        self.rules[name] = alternatives
        return name

    def unsupported(self, construct: str, where: str):
        if self.ordered:
            raise UnsupportedGrammarError(
                f"the ordered schema reference cannot express {construct!r} at {where or '/'}"
                " exactly: refusals are not judged token by token")
        self.dropped.add(construct)

    def any_value(self) -> str:
        if "json_any" in self.rules:
            return "json_any"
        self.rules["json_any"] = []  # reserve (recursive)
        s, n = self.term(_ANY_STRING), self.term(_NUMBER)
        members = self.new_rule([[s, self.literal(":"), "json_any"]], "m")
        more_m = self.new_rule([[], [self.literal(","), members, "__SELF__"]], "mm")
        self.rules[more_m][1][2] = more_m
        obj = self.new_rule([[self.literal("{"), self.literal("}")],
                             [self.literal("{"), members, more_m, self.literal("}")]], "o")
        more_v = self.new_rule([[], [self.literal(","), "json_any", "__SELF__"]], "mv")
        self.rules[more_v][1][2] = more_v
        arr = self.new_rule([[self.literal("["), self.literal("]")],
                             [self.literal("["), "json_any", more_v, self.literal("]")]], "a")
        self.rules["json_any"] = [[s], [n], [self.literal("true")], [self.literal("false")],
                                  [self.literal("null")], [obj], [arr]]
        return "json_any"

    # -- schemas -------------------------------------------------------------------------
    def value(self, schema: Any, where: str = "") -> str:
        key = json.dumps(schema, sort_keys=True)
        if key in self.memo:
            return self.memo[key]
        name = f"v{len(self.rules)}"
        self.memo[key] = name
        self.rules[name] = []  # reserved for recursion through $ref
        self.rules[name] = self._alternatives(schema, where)
        if not self.rules[name]:
            raise UnsupportedGrammarError(f"the schema at {where or '/'} admits no value")
        return name

    def _alternatives(self, s: Any, where: str) -> list[list[str]]:
        if s is True or s == {}:
            return [[self.any_value()]]
        if s is False:
            return []
        if not isinstance(s, dict):
            raise UnsupportedGrammarError(f"not a schema at {where or '/'}: {s!r}")
        keys = set(s) - _ANNOTATIONS
        if "$ref" in s:
            target = self._resolve(s["$ref"], where)
            if keys - {"$ref"}:
                self.unsupported("$ref with sibling keywords", where)
            return [[self.value(target, s["$ref"])]]
        for comb in ("anyOf", "oneOf", "allOf"):
            if comb not in s:
                continue
            subs = s[comb]
            others = keys - {comb}
            if comb == "oneOf" and len(subs) > 1:
                self.unsupported("oneOf", where)  # relaxed: as anyOf
            if comb == "allOf" and len(subs) > 1:
                self.unsupported("allOf", where)  # relaxed: its first schema
                subs = subs[:1]
            if others:
                self.unsupported(f"{comb} with sibling keywords", where)
            return [[self.value(sub, f"{where}/{comb}/{i}")] for i, sub in enumerate(subs)]
        if "const" in s or "enum" in s:
            values = [s["const"]] if "const" in s else list(s["enum"])
            if keys - {"const", "enum", "type"}:
                self.unsupported("enum/const with other keywords", where)
            return self._enum(values, s.get("type"), where)
        types = s.get("type")
        if types is None:
            implied = {"object": {"properties", "required", "additionalProperties"},
                       "array": {"items", "minItems", "maxItems"},
                       "string": {"minLength", "maxLength", "pattern"},
                       "number": {"minimum", "maximum"}}
            found = [t for t, kws in implied.items() if kws & keys]
            if self.ordered and found:
                types = found[:1]  # a subset of the instances: the keyword's own type
            else:
                return [[self.any_value()]]
        types = types if isinstance(types, list) else [types]
        out = []
        for t in types:
            out.extend(self._typed(t, s, where))
        return out

    def _resolve(self, ref: str, where: str) -> Any:
        if ref == "#":
            return self.root
        for prefix in ("#/$defs/", "#/definitions/"):
            if ref.startswith(prefix):
                node = self.root.get(prefix[2:-1], {})
                name = ref[len(prefix):].replace("~1", "/").replace("~0", "~")
                if name in node:
                    return node[name]
        raise UnsupportedGrammarError(f"$ref {ref!r} at {where or '/'} is not a local $defs "
                                      "reference")

    def _enum(self, values: list, types, where: str) -> list[list[str]]:
        out = []
        for v in values:
            spelled = json.dumps(v, ensure_ascii=False)
            if self.ordered or isinstance(v, bool) or v is None:
                out.append([self.literal(spelled)])
            elif isinstance(v, str):
                out.append([self.term(spellings(v))])
            elif isinstance(v, (int, float)):
                out.append([self.term(_NUMBER)])
            else:
                out.append([self.any_value()])
        return out

    def _typed(self, t: str, s: dict, where: str) -> list[list[str]]:
        if t == "null":
            return [[self.literal("null")]]
        if t == "boolean":
            return [[self.literal("true")], [self.literal("false")]]
        if t == "number":
            for kw in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                       "multipleOf"):
                if kw in s:
                    self.unsupported(f"number {kw}", where)
            return [[self.term(_NUMBER)]]
        if t == "integer":
            return [[self._integer(s, where)]]
        if t == "string":
            return [[self._string(s, where)]]
        if t == "array":
            return self._array(s, where)
        if t == "object":
            return self._object(s, where)
        raise UnsupportedGrammarError(f"unknown type {t!r} at {where or '/'}")

    def _integer(self, s: dict, where: str) -> str:
        """The ordered reading: the range's plain integers. The relaxed one: those, or any
        number with a fraction or an exponent (``120.0`` and ``1.2e2`` are integers too, so a
        bound is judged once a plain integer ends: ``121,`` is dead for ``maximum`` 120)."""
        if "multipleOf" in s:
            self.unsupported("integer multipleOf", where)
        lo, hi = s.get("minimum"), s.get("maximum")
        if "exclusiveMinimum" in s:
            lo = max(lo if lo is not None else -10**18, s["exclusiveMinimum"] + 1)
        if "exclusiveMaximum" in s:
            hi = min(hi if hi is not None else 10**18, s["exclusiveMaximum"] - 1)
        plain = _plain_integers(lo, hi)
        if plain is None:
            self.unsupported("integer minimum/maximum (a wide range)", where)
            plain = r"-?(?:0|[1-9][0-9]*)"
        if self.ordered:
            return self.term(plain)
        if (lo is None or lo <= 0) and (hi is None or hi >= 0):
            plain = f"{plain}|-0"  # JSON's -0 is the integer 0
        return self.term(f"(?:{plain})|{_NOT_PLAIN_NUMBER}")

    def _string(self, s: dict, where: str) -> str:
        if "pattern" in s:
            self.unsupported("string pattern", where)
        lo, hi = int(s.get("minLength", 0)), s.get("maxLength")
        reps = f"{{{lo},}}" if hi is None else f"{{{lo},{int(hi)}}}"
        if lo == 0 and hi is None:
            reps = "*"
        return self.term(f'"{_CHAR[self.ordered]}{reps}"')

    def _array(self, s: dict, where: str) -> list[list[str]]:
        for kw in ("prefixItems", "contains", "uniqueItems", "unevaluatedItems",
                   "minContains", "maxContains"):
            if kw in s and not (kw == "uniqueItems" and s[kw] is False):
                self.unsupported(f"array {kw}", where)
        item = self.value(s.get("items", True), f"{where}/items")
        lo, hi = int(s.get("minItems", 0)), s.get("maxItems")
        comma, o, c = self.literal(","), self.literal("["), self.literal("]")
        out = [[o, c]] if lo == 0 else []
        if hi is not None and int(hi) < 1:
            return out
        more = self.new_rule([[comma, item]], "ai")
        need = max(lo - 1, 0)
        body = [o, item] + [more] * need
        if hi is None:
            star = self.new_rule([[], [more, "__SELF__"]], "as")
            self.rules[star][1][1] = star
            out.append(body + [star, c])
        else:
            for extra in range(0, int(hi) - 1 - need + 1):
                out.append(body + [more] * extra + [c])
        return out

    def _object(self, s: dict, where: str) -> list[list[str]]:
        props: dict = s.get("properties", {})
        required = list(s.get("required", []))
        extra = s.get("additionalProperties", True)
        for kw in ("minProperties", "maxProperties", "dependentRequired", "dependentSchemas",
                   "propertyNames", "unevaluatedProperties", "if", "then", "else", "not"):
            if kw in s:
                self.unsupported(f"object {kw}", where)
        if "patternProperties" in s:
            self.unsupported("object patternProperties", where)
            extra = True
        colon, comma = self.literal(":"), self.literal(",")
        o, c = self.literal("{"), self.literal("}")
        missing = [r for r in required if r not in props]
        if self.ordered:
            if missing:
                self.unsupported("required without properties", where)
            names = [n for n in props if props[n] is not False]
            members = [[self.literal(json.dumps(n, ensure_ascii=False)), colon,
                        self.value(props[n], f"{where}/properties/{n}")] for n in names]
            # first_i: nothing written yet; after_i: something written (a comma is due).
            first = ["" for _ in range(len(names) + 1)]
            after = ["" for _ in range(len(names) + 1)]
            first[-1] = self.new_rule([[]], "of")
            after[-1] = self.new_rule([[]], "oa")
            for i in range(len(names) - 1, -1, -1):
                optional = names[i] not in required
                a_alts = [[comma, *members[i], after[i + 1]]]
                f_alts = [[*members[i], after[i + 1]]]
                if optional:
                    a_alts.append([after[i + 1]])
                    f_alts.append([first[i + 1]])
                after[i] = self.new_rule(a_alts, "oa")
                first[i] = self.new_rule(f_alts, "of")
            return [[o, first[0], c]]
        alts = [[self.term(spellings(n)), colon, self.value(sub, f"{where}/properties/{n}")]
                for n, sub in props.items() if sub is not False]
        if extra is not False:
            alts.append([self.term(_ANY_STRING), colon,
                         self.value(extra, f"{where}/additionalProperties")])
        member = self.new_rule(alts, "om")
        more = self.new_rule([[], [comma, member, "__SELF__"]], "or")
        self.rules[more][1][2] = more
        out = [[o, member, more, c]]
        if not required:
            out.insert(0, [o, c])
        return out

    # -- output --------------------------------------------------------------------------
    def lark(self, start: str) -> str:
        lines = [f"start: {start}"]
        for name, alts in self.rules.items():
            body = " | ".join(" ".join(sym for sym in alt) for alt in alts)
            lines.append(f"{name}: {body}")
        for name, pattern in self.terminals.items():
            lines.append(f"{name}: /{pattern.replace('/', chr(92) + '/')}/")
        lines.append(r"%ignore /[ \t\n\r]+/")
        return "\n".join(lines) + "\n"


def schema_lark(schema_text: str, ordered: bool) -> tuple[str, list[str]]:
    """(Lark text, constructs the reading dropped) of a JSON schema; see the module doc."""
    schema = json.loads(schema_text)
    b = _Builder(schema, ordered)
    start = b.value(schema)
    return b.lark(start), sorted(b.dropped)


def _plain_integers(lo, hi) -> str | None:
    """A regex of the plain integers (no fraction, no exponent) within [lo, hi], or None when
    the range is too wide to enumerate and not a simple half line."""
    if lo is None and hi is None:
        return r"-?(?:0|[1-9][0-9]*)"
    if lo is not None and hi is not None and hi - lo <= MAX_ENUMERATED_RANGE:
        lo, hi = int(-(-lo // 1)), int(hi // 1)
        return "(?:" + "|".join(str(v) for v in range(lo, hi + 1)) + ")"
    if hi is None and lo in (0, 1):
        return r"(?:0|[1-9][0-9]*)" if lo == 0 else r"[1-9][0-9]*"
    return None


__all__ = ["schema_lark", "spellings", "MAX_ENUMERATED_RANGE"]
