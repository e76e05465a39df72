"""What a backend does with each construct of a grammar or JSON schema.

Silently ignoring a constraint is worse than refusing it: a masker that drops ``uniqueItems``
still produces outputs that parse, so nobody notices that they violate the schema. Compiling
therefore comes with a :class:`CapabilityReport` that says, per construct, whether it is

* ``exact``: enforced by the mask, token by token;
* ``lowered``: rewritten into an equivalent the backend enforces exactly (Lark -> EBNF ...);
* ``post-check``: not enforced while generating, checked against the full schema afterwards
  (:func:`validate_output`) so violators are marked, never passed off as valid;
* ``stricter``: enforced more strictly than JSON Schema: the mask refuses some valid
  instances (never accepts an invalid one), e.g. XGrammar's ``strict_mode`` refusing members a
  schema does not list where it says nothing about ``additionalProperties``;
* ``rejected``: the backend cannot take it at all;
* ``unchecked``: neither the mask nor the post-check checks it: a ``format`` the mask does
  not enforce and no checker installed here validates (:func:`checked_formats` lists the ones
  that are checked), so it is an annotation in fact, and reported as such.

Backends declare their JSON-schema support in their :class:`~shim_adapters.backends.spec.BackendSpec`
(``schema_support``); :func:`probe_schema_support` measures it on a real tokenizer, so a
declaration is checked against what the backend actually does (``tests/test_capability.py``).
Strict mode (:func:`check_strict`) refuses a grammar with any post-check or rejected construct.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterator, Mapping

from shim_adapters.errors import ShimError, UnsupportedGrammarError
from shim_adapters.grammars.convert import convert
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.grammars.reference import reference_acceptor


class Support(str, Enum):
    EXACT = "exact"
    LOWERED = "lowered"
    POST_CHECK = "post-check"
    REJECTED = "rejected"
    STRICTER = "stricter"
    UNCHECKED = "unchecked"


#: Keywords that describe but never constrain (JSON Schema 2020-12 annotations and containers).
ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "default",
                         "examples", "$defs", "definitions", "readOnly", "writeOnly",
                         "deprecated", "$anchor"})
#: Keywords whose value is a schema / a map of schemas / a list of schemas (walked into).
_SUBSCHEMA = {"not", "if", "then", "else", "items", "additionalProperties", "contains",
              "propertyNames", "unevaluatedItems", "unevaluatedProperties",
              "additionalItems"}
_SCHEMA_MAP = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LIST = {"anyOf", "oneOf", "allOf", "prefixItems"}
_NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_LOOKAROUND = re.compile(r"\(\?(=|!|<=|<!)")
_BACKREF = re.compile(r"\\[1-9]|\(\?P=")


def _anchors_and_alternation(pattern: str) -> tuple[list[tuple[int, str]], bool]:
    """(position, ``^`` or ``$``) of every anchor outside escapes and character classes, and
    whether the pattern has an alternation outside every group (``^a|b$``)."""
    found, i, in_class, depth, top_alternation = [], 0, False, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            if pattern[i + 1:i + 2] == "^":  # a negated class, not an anchor
                i += 1
        elif c in "^$":
            found.append((i, c))
        elif c == "(":
            depth += 1
        elif c == ")":
            depth = max(0, depth - 1)
        elif c == "|" and depth == 0:
            top_alternation = True
        i += 1
    return found, top_alternation


def construct_name(keyword: str, value: Any) -> str:
    """The construct a keyword stands for; a ``pattern`` is split by the regex features it
    uses, since backends differ on lookarounds and backreferences, not on ``pattern``."""
    if keyword in ("pattern", "patternProperties") and isinstance(value, str):
        if _LOOKAROUND.search(value):
            return f"{keyword}:lookaround"
        if _BACKREF.search(value):
            return f"{keyword}:backreference"
        anchors, top_alternation = _anchors_and_alternation(value)
        ends = {(0, "^"), (len(value) - 1, "$")}
        if any(anchor not in ends for anchor in anchors):
            # an anchor inside the pattern (``^a$b?``): a backend may drop it
            return f"{keyword}:inner-anchor"
        if keyword == "pattern" and (top_alternation or not ends <= set(anchors)):
            # JSON Schema searches a pattern anywhere in the string; backends match it whole
            return "pattern:unanchored"
    if keyword == "multipleOf" and isinstance(value, (int, float)) and \
            not float(value).is_integer():
        return "multipleOf:non-integer"  # backends enforce integer steps only, if at all
    if keyword == "format" and isinstance(value, str):
        # the post-check validates a format only where a checker is installed for it
        return "format" if value in checked_formats() else f"format:unchecked:{value}"
    return keyword


def schema_constructs(schema: Any, pointer: str = "") -> Iterator[tuple[str, str]]:
    """(JSON pointer, construct) for every keyword of ``schema`` and its subschemas."""
    if not isinstance(schema, dict):
        return
    if "properties" in schema and "additionalProperties" not in schema:
        # JSON Schema allows members the schema does not list; a strict backend refuses them
        yield pointer or "/", "additionalProperties:absent"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        # both must hold; a backend may enforce only one of them
        yield pointer or "/", "pattern:with-length"
        yield pointer or "/", "length:with-pattern"
    listed = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    if isinstance(schema.get("required"), list) and any(
            name not in listed for name in schema["required"]):
        # a required member the schema does not describe: backends build objects from the
        # listed members and drop the requirement
        yield pointer or "/", "required:unlisted"
    if "format" in schema:
        # a backend may build a format's own regex and drop the schema's other string bounds
        if "minLength" in schema or "maxLength" in schema:
            yield pointer or "/", "length:with-format"
        if "pattern" in schema:
            yield pointer or "/", "pattern:with-format"
    if "multipleOf" in schema and any(k in schema for k in _NUMERIC_BOUNDS):
        # a step inside a range: a backend may enumerate a short range only, or drop the step
        yield pointer or "/", "multipleOf:with-bound"
    if "anyOf" in schema and any(k not in ANNOTATIONS and k not in ("anyOf", "$defs",
                                                                    "definitions")
                                 for k in schema):
        # the instance must satisfy the siblings too: a backend may compile the branches alone
        yield pointer or "/", "anyOf:with-siblings"
    for keyword, value in schema.items():
        where = f"{pointer}/{keyword}"
        if keyword == "patternProperties" and isinstance(value, dict):
            for pattern, sub in value.items():
                yield where, construct_name("patternProperties", pattern)
                yield from schema_constructs(sub, f"{where}/{pattern}")
            continue
        if keyword == "multipleOf" and construct_name(keyword, value) == "multipleOf" and \
                schema.get("type") != "integer":
            # an integer step on a number (or untyped) value: backends enforce integers only
            yield pointer or "/", "multipleOf:number"
        elif keyword not in ("$defs", "definitions"):
            yield pointer or "/", construct_name(keyword, value)
        if keyword in _SUBSCHEMA:
            if keyword == "items" and (value == {} or value is True):
                yield where, "schema:any"
            yield from schema_constructs(value, where)
        elif keyword in _SCHEMA_MAP and isinstance(value, dict):
            for name, sub in value.items():
                if sub == {} or sub is True:
                    # "any JSON value": a construct of its own, since backends compile it
                    # differently (outlines_core splices an unbracketed alternation)
                    yield f"{where}/{name}", "schema:any"
                yield from schema_constructs(sub, f"{where}/{name}")
        elif keyword in _SCHEMA_LIST and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from schema_constructs(sub, f"{where}/{i}")


@dataclass(frozen=True)
class ConstructReport:
    where: str
    construct: str
    support: Support
    note: str = ""


@dataclass(frozen=True)
class CapabilityReport:
    """Per-construct support of one grammar on one backend."""

    grammar_name: str
    grammar_format: str
    backend: str
    entries: tuple[ConstructReport, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def enforced(self) -> bool:
        """Every construct is enforced by the mask (exactly, lowered, or more strictly: no
        invalid output gets through the mask)."""
        return all(e.support in (Support.EXACT, Support.LOWERED, Support.STRICTER)
                   for e in self.entries)

    @property
    def rejected(self) -> tuple[ConstructReport, ...]:
        return tuple(e for e in self.entries if e.support is Support.REJECTED)

    @property
    def post_checked(self) -> tuple[ConstructReport, ...]:
        return tuple(e for e in self.entries if e.support is Support.POST_CHECK)

    @property
    def unchecked(self) -> tuple[ConstructReport, ...]:
        return tuple(e for e in self.entries if e.support is Support.UNCHECKED)

    def by_construct(self) -> dict[str, Support]:
        """Each construct's weakest support over every place it is used."""
        order = list(Support)
        out: dict[str, Support] = {}
        for e in self.entries:
            prev = out.get(e.construct)
            if prev is None or order.index(e.support) > order.index(prev):
                out[e.construct] = e.support
        return out

    def as_dict(self) -> dict[str, Any]:
        return {"grammar": self.grammar_name, "format": self.grammar_format,
                "backend": self.backend, "enforced": self.enforced, "notes": list(self.notes),
                "constructs": [{"where": e.where, "construct": e.construct,
                                "support": e.support.value, "note": e.note}
                               for e in self.entries]}

    def markdown(self) -> str:
        lines = [f"capability of {self.grammar_name} ({self.grammar_format}) on {self.backend}: "
                 + ("every construct enforced" if self.enforced else
                    f"{len(self.post_checked)} checked only after generation, "
                    f"{len(self.unchecked)} not checked at all, "
                    f"{len(self.rejected)} rejected"), "",
                 "| where | construct | support | note |", "|---|---|---|---|"]
        lines += [f"| {e.where} | {e.construct} | {e.support.value} | {e.note} |"
                  for e in self.entries]
        lines += [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def _inherit_from_applicators(entries: list[ConstructReport]) -> list[ConstructReport]:
    """A construct inside an applicator the mask ignores (``not``, ``if``, ...) is not
    enforced either, whatever the backend does with it elsewhere."""
    weak = [(f"{e.where.rstrip('/')}/{e.construct}", e) for e in entries
            if e.support in (Support.POST_CHECK, Support.REJECTED) and e.construct in _SUBSCHEMA
            | _SCHEMA_MAP | _SCHEMA_LIST]
    out = []
    for e in entries:
        for prefix, outer in weak:
            if (e.where == prefix or e.where.startswith(prefix + "/")) and \
                    e.support in (Support.EXACT, Support.LOWERED):
                e = ConstructReport(e.where, e.construct, outer.support,
                                    f"inside {outer.construct} at {outer.where}")
                break
        out.append(e)
    return out


class StrictModeError(UnsupportedGrammarError):
    """Strict mode: the backend cannot enforce every construct of the grammar."""


def capability_report(grammar: Grammar, spec) -> CapabilityReport:
    """What ``spec`` (a BackendSpec) does with each construct of ``grammar``, before compiling."""
    entries: list[ConstructReport] = []
    notes: list[str] = []
    if grammar.format not in spec.grammar_formats:
        entries.append(ConstructReport("/", f"format:{grammar.format}", Support.REJECTED,
                                       f"{spec.name} takes {', '.join(spec.grammar_formats)}"))
    elif grammar.format == "json_schema":
        try:
            schema = json.loads(grammar.text)
        except ValueError as exc:
            raise UnsupportedGrammarError(f"JSON schema is not valid JSON: {exc}",
                                          grammar_name=grammar.name) from None
        declared: Mapping[str, str] = getattr(spec, "schema_support", None) or {}
        for where, construct in schema_constructs(schema):
            if construct in ANNOTATIONS:
                entries.append(ConstructReport(where, construct, Support.EXACT, "annotation"))
                continue
            status = declared.get(construct)
            if status is None and construct.startswith("format:unchecked:"):
                entries.append(ConstructReport(
                    where, construct, Support.UNCHECKED,
                    f"no checker for format {construct.split(':', 2)[2]!r} is installed and "
                    f"{spec.name} does not enforce it; checked formats: "
                    f"{', '.join(checked_formats())}"))
            elif status is None:
                entries.append(ConstructReport(where, construct, Support.POST_CHECK,
                                               f"{spec.name} does not declare this keyword"))
            else:
                entries.append(ConstructReport(where, construct, Support(status)))
    else:
        native = getattr(spec, "native_formats", None) or spec.grammar_formats
        if grammar.format in native:
            entries.append(ConstructReport("/", f"format:{grammar.format}", Support.EXACT))
        else:
            try:
                target = next(f for f in native if f in ("lark", "ebnf") and f != grammar.format)
                result = convert(grammar, target)
                entries.append(ConstructReport("/", f"format:{grammar.format}",
                                               Support.LOWERED if result.exact
                                               else Support.REJECTED,
                                               f"converted to {target}: "
                                               + "; ".join(result.notes)))
            except (StopIteration, ShimError) as exc:
                entries.append(ConstructReport("/", f"format:{grammar.format}",
                                               Support.REJECTED, str(exc)))
    entries = _inherit_from_applicators(entries)
    if any(e.support is Support.POST_CHECK for e in entries):
        notes.append("outputs are validated against the full schema after generation and "
                     "violators are marked (validate_output); --strict refuses instead")
    return CapabilityReport(grammar.name, grammar.format, spec.name, tuple(entries),
                            tuple(notes))


def check_strict(report: CapabilityReport) -> None:
    """Strict mode: refuse a grammar the backend cannot enforce completely."""
    weak = [e for e in report.entries
            if e.support in (Support.POST_CHECK, Support.REJECTED, Support.UNCHECKED)]
    if weak:
        listed = ", ".join(f"{e.construct} at {e.where} ({e.support.value})" for e in weak)
        raise StrictModeError(f"strict mode: {report.backend} cannot enforce {listed}; use "
                              f"another backend or drop --strict to check these after "
                              f"generation", grammar_name=report.grammar_name)


@dataclass(frozen=True)
class OutputCheck:
    """One output checked against the full grammar (the second line of defence)."""

    valid: bool
    problems: tuple[str, ...] = ()


@functools.lru_cache(maxsize=1)
def _format_checker():
    """Every format jsonschema can check here (each draft's, with the format libraries of
    ``jsonschema[format-nongpl]``), whatever draft a schema declares: a draft-04 schema that
    says ``"format": "date"`` means a date, though draft 4 did not name that format."""
    import jsonschema

    return jsonschema.FormatChecker()


def checked_formats() -> tuple[str, ...]:
    """The ``format`` values the post-check validates; any other format is reported
    ``unchecked``."""
    return tuple(sorted(_format_checker().checkers))


def validate_output(grammar: Grammar, text: str) -> OutputCheck:
    """Check ``text`` against the whole grammar/schema, not only what the mask enforced;
    ``format`` is checked for the formats :func:`checked_formats` lists."""
    if grammar.format == "json_schema":
        import jsonschema

        try:
            value = json.loads(text)
        except ValueError as exc:
            return OutputCheck(False, (f"not JSON: {exc}",))
        schema = json.loads(grammar.text)
        # the draft the schema declares ($schema: draft-04's `dependencies`, ...), else 2020-12
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        validator = cls(schema, format_checker=_format_checker())
        problems = tuple(f"{'/' + '/'.join(map(str, e.absolute_path))}: {e.message} "
                         f"({e.validator})" for e in validator.iter_errors(value))
        return OutputCheck(not problems, problems)

    ok = reference_acceptor(grammar).accepts(text)
    return OutputCheck(ok, () if ok else (f"not in the language of {grammar.name}",))


# ---- measuring what a backend enforces --------------------------------------------------------

#: (construct, schema, an instance that satisfies it, one that violates only that construct).
SCHEMA_PROBES: tuple[tuple[str, dict, Any, Any], ...] = (
    ("type", {"type": "integer"}, 3, "x"),
    ("enum", {"enum": ["a", "b"]}, "a", "c"),
    ("const", {"const": "a"}, "a", "b"),
    ("properties", {"type": "object", "properties": {"a": {"type": "integer"}},
                    "required": ["a"], "additionalProperties": False}, {"a": 1}, {"a": "x"}),
    ("required", {"type": "object", "properties": {"a": {"type": "integer"},
                                                   "b": {"type": "integer"}},
                  "required": ["a"], "additionalProperties": False}, {"a": 1}, {"b": 1}),
    ("additionalProperties", {"type": "object", "properties": {"a": {"type": "integer"}},
                              "additionalProperties": False}, {"a": 1}, {"a": 1, "z": 2}),
    ("items", {"type": "array", "items": {"type": "integer"}}, [1], ["x"]),
    ("minItems", {"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    ("maxItems", {"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1], [1, 2]),
    ("minLength", {"type": "string", "minLength": 2}, "ab", "a"),
    ("maxLength", {"type": "string", "maxLength": 1}, "a", "ab"),
    ("pattern", {"type": "string", "pattern": "^a+$"}, "aa", "ab"),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, 1, "x"),
    ("$ref", {"$defs": {"i": {"type": "integer"}}, "$ref": "#/$defs/i"}, 3, "x"),
    ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, -1, 5),
    ("maxProperties", {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "maxProperties": 1, "additionalProperties": False},
     {"a": 1}, {"a": 1, "b": 2}),
    ("minimum", {"type": "integer", "minimum": 5}, 7, 3),
    ("maximum", {"type": "integer", "maximum": 5}, 3, 7),
    ("not", {"type": "integer", "not": {"const": 3}}, 4, 3),
    ("dependentRequired", {"type": "object", "properties": {"a": {"type": "integer"},
                                                            "b": {"type": "integer"}},
                           "dependentRequired": {"a": ["b"]}, "additionalProperties": False},
     {"a": 1, "b": 2}, {"a": 1}),
    ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
     [1, 2], [1, 1]),
    ("if", {"type": "object", "properties": {"a": {"type": "integer"},
                                             "b": {"type": "integer"}},
            "if": {"properties": {"a": {"const": 1}}, "required": ["a"]},
            "then": {"required": ["b"]}, "additionalProperties": False},
     {"a": 1, "b": 2}, {"a": 1}),
    ("pattern:lookaround", {"type": "string", "pattern": "^(?!ab)[a-z]{2}$"}, "aa", "ab"),
    ("multipleOf", {"type": "integer", "multipleOf": 3}, 6, 4),
    ("multipleOf:non-integer", {"type": "number", "multipleOf": 0.01}, 0.05, 10000.001),
    # an integer step on a non-integer type: 1.5 is not a multiple of 1.0
    ("multipleOf:number", {"type": "number", "multipleOf": 1.0}, 3, 1.5),
    # a pattern together with a length bound: each must hold (backends drop one of the two)
    ("pattern:with-length", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abc",
     "ab1"),
    ("length:with-pattern", {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "abc",
     "abcd"),
    # a length bound or a pattern beside a format: each must hold
    ("length:with-format", {"type": "string", "format": "email", "maxLength": 7}, "a@b.com",
     "ab@cd.com"),
    ("pattern:with-format", {"type": "string", "format": "email", "pattern": "^a"}, "a@b.com",
     "b@c.com"),
    # a required member not among the properties: {"a": 1} lacks b
    ("required:unlisted", {"type": "object", "properties": {"a": {"type": "integer"}},
                           "required": ["a", "b"], "additionalProperties": {"type": "integer"}},
     {"a": 1, "b": 2}, {"a": 1}),
    # an anchor inside a pattern: "ab" does not match ^a$b? (the $ needs the end)
    ("pattern:inner-anchor", {"type": "string", "pattern": "^a$b?"}, "a", "ab"),
    # a pattern matches anywhere in the string (JSON Schema), a backend may match it whole
    ("pattern:unanchored", {"type": "string", "pattern": "b"}, "abc", "ac"),
    # a step beside a one-sided bound: 7 is at least 0 but no multiple of 5
    ("multipleOf:with-bound", {"type": "integer", "minimum": 0, "multipleOf": 5}, 10, 7),
    # anyOf next to other keywords of the same schema: the instance must satisfy both
    ("anyOf:with-siblings", {"type": "object", "properties": {"a": {"type": "integer"}},
                             "anyOf": [{"required": ["a"]}]}, {"a": 1}, {"a": "x"}),
    ("additionalProperties:absent", {"type": "object", "properties": {"a": {"type": "integer"}},
                                     "required": ["a"]}, {"a": 1, "z": 2}, {"a": "x"}),
    ("schema:any", {"type": "object", "properties": {"a": {}}, "required": ["a"],
                    "additionalProperties": False}, {"a": "x"}, "x"),
    ("minProperties", {"type": "object", "properties": {"a": {"type": "integer"},
                                                        "b": {"type": "integer"}},
                       "minProperties": 2, "additionalProperties": False},
     {"a": 1, "b": 2}, {"a": 1}),
)


def _accepts(masker, tokenizer, text: str) -> bool:
    state = masker.new_state()
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not state.allowed_mask()[token]:
            return False
        state.advance(token)
    return bool(state.eos_allowed())


def probe_schema_support(spec, tokenizer, vocab_size: int | None = None,
                         probes=SCHEMA_PROBES) -> dict[str, str]:
    """Measure, per construct, what ``spec`` does: compile a small schema using it and walk a
    satisfying and a violating instance through the mask. ``exact``: the valid one passes and
    the violating one is refused; ``post-check``: the violating one passes (ignored);
    ``rejected``: the schema does not compile; ``inconclusive: ...`` otherwise."""
    found: dict[str, str] = {}
    for construct, schema, good, bad in probes:
        grammar = Grammar(text=json.dumps(schema), format="json_schema", name=f"probe-{construct}")
        try:
            masker = spec.compile(grammar, tokenizer, vocab_size)
        except ShimError:
            found[construct] = Support.REJECTED.value
            continue
        good_ok = _accepts(masker, tokenizer, json.dumps(good, separators=(",", ":")))
        bad_ok = _accepts(masker, tokenizer, json.dumps(bad, separators=(",", ":")))
        if good_ok and not bad_ok:
            found[construct] = Support.EXACT.value
        elif bad_ok:  # a violation gets through the mask: only the post-check can flag it
            found[construct] = Support.POST_CHECK.value
        elif not bad_ok:
            found[construct] = Support.STRICTER.value  # a valid instance refused, no invalid one
        else:
            found[construct] = "inconclusive: the satisfying instance is refused"
    return found
