"""Capability reports: each backend's declared JSON-schema support matches what it does, strict
mode refuses what it cannot enforce, and outputs are validated against the full schema."""

from __future__ import annotations

import json

import pytest

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.mask.capability import (
    SCHEMA_PROBES,
    StrictModeError,
    Support,
    capability_report,
    check_strict,
    probe_schema_support,
    schema_constructs,
    validate_output,
)

#: One schema using every keyword the issue names (and a few every backend enforces).
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "multipleOf": 3, "not": {"const": 0}},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "code": {"type": "string", "pattern": "^(?!x)[a-z]{3}$"},
        "kind": {"enum": ["a", "b"]},
        "extra": {"type": "string"},
    },
    "required": ["id"],
    "minProperties": 2,
    "dependentRequired": {"extra": ["kind"]},
    "if": {"properties": {"kind": {"const": "a"}}, "required": ["kind"]},
    "then": {"required": ["tags"]},
    "additionalProperties": False,
}
GRAMMAR = Grammar(text=json.dumps(SCHEMA), format="json_schema", name="constraints")
IGNORED = {  # measured (probe_schema_support) and stated in the issue
    "xgrammar": {"not", "dependentRequired", "uniqueItems", "if", "then", "pattern:lookaround"},
    "outlines": {"multipleOf", "minProperties", "dependentRequired", "uniqueItems", "if", "then",
                 "not"},
}


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_declared_schema_support_is_what_the_backend_does(backend, lm):
    spec = get_backend(backend)
    measured = probe_schema_support(spec, lm.tokenizer, lm.vocab_size)
    assert set(measured) == {p[0] for p in SCHEMA_PROBES}
    declared = {k: spec.schema_support.get(k) for k in measured}
    assert declared == measured


@pytest.mark.parametrize("backend", sorted(IGNORED))
def test_report_names_every_construct_the_backend_does_not_enforce(backend):
    report = capability_report(GRAMMAR, get_backend(backend))
    weak = {e.construct for e in report.entries if e.support is not Support.EXACT}
    assert IGNORED[backend] <= weak
    assert not report.enforced
    by = report.by_construct()
    assert by["type"] is Support.EXACT and by["enum"] is Support.EXACT
    if backend == "outlines":
        assert by["pattern:lookaround"] is Support.REJECTED
    where = {(e.where, e.construct) for e in report.entries}
    assert ("/properties/tags", "uniqueItems") in where
    assert "uniqueItems" in report.markdown() and report.as_dict()["enforced"] is False
    inner = {(e.where, e.construct): e for e in report.entries}
    assert inner[("/properties/id/not", "const")].support is Support.POST_CHECK  # inside `not`
    assert inner[("/if/properties/kind", "const")].note == "inside if at /"


def test_syncode_rejects_the_schema_format():
    report = capability_report(GRAMMAR, get_backend("syncode"))
    assert [e.support for e in report.entries] == [Support.REJECTED]
    assert "lark" in report.entries[0].note


def test_converted_grammar_is_reported_lowered():
    report = capability_report(builtin_grammar("binary5"), get_backend("xgrammar"))
    assert report.entries[0].support is Support.LOWERED and report.enforced
    native = capability_report(builtin_grammar("binary5"), get_backend("syncode"))
    assert native.entries[0].support is Support.EXACT


def test_schema_constructs_walk_subschemas_and_split_patterns():
    found = set(schema_constructs(SCHEMA))
    assert ("/properties/id", "multipleOf") in found
    assert ("/properties/code", "pattern:lookaround") in found
    assert ("/if", "const") not in found and ("/if/properties/kind", "const") in found
    assert ("/", "if") in found and ("/", "then") in found


def test_strict_mode_refuses_and_default_compiles_with_the_report(lm):
    spec = get_backend("xgrammar")
    with pytest.raises(StrictModeError, match="uniqueItems at /properties/tags"):
        spec.compile(GRAMMAR, lm.tokenizer, lm.vocab_size, strict=True)
    masker = spec.compile(GRAMMAR, lm.tokenizer, lm.vocab_size)
    assert masker.capability.backend == "xgrammar" and not masker.capability.enforced
    strict_ok = Grammar(text=json.dumps({"type": "array", "items": {"type": "integer"}}),
                        format="json_schema", name="ints")
    assert spec.compile(strict_ok, lm.tokenizer, lm.vocab_size, strict=True).capability.enforced


def test_validate_output_marks_what_the_mask_let_through():
    ok = validate_output(GRAMMAR, json.dumps({"id": 3, "kind": "b"}))
    assert ok.valid and ok.problems == ()
    bad = validate_output(GRAMMAR, json.dumps({"id": 3, "kind": "a", "tags": ["x", "x"]}))
    assert not bad.valid and any("uniqueItems" in p for p in bad.problems)
    assert not validate_output(GRAMMAR, '{"id": 3,').valid
    lark = validate_output(builtin_grammar("binary5"), "zzzzz")
    assert not lark.valid and "binary5" in lark.problems[0]


def test_the_post_check_checks_format_and_lists_the_formats_it_can():
    from shim_adapters.mask.capability import checked_formats, validate_output

    assert {"date", "date-time", "email", "uuid"} <= set(checked_formats())
    date = Grammar('{"type": "string", "format": "date"}', "json_schema", "date")
    assert not validate_output(date, '"2022-02-31"').valid
    assert validate_output(date, '"2022-02-28"').valid
    stamp = Grammar('{"type": "string", "format": "date-time"}', "json_schema", "stamp")
    assert not validate_output(stamp, '"2022-02-01T10:00:00"').valid  # no offset
    # jsonschema[format-nongpl] is a core requirement: uri and hostname are checked too
    uri = Grammar('{"type": "string", "format": "uri"}', "json_schema", "uri")
    assert not validate_output(uri, '"not a uri"').valid
    assert validate_output(uri, '"https://example.com/a?b=c"').valid
    # a format a schema's older draft did not name is checked too: a draft-04 schema's "date"
    # means a date (MaskBench Github_easy---o44373 labels "2022-02-31" invalid)
    old = Grammar('{"$schema": "http://json-schema.org/draft-04/schema#", "type": "string", '
                  '"format": "date"}', "json_schema", "draft4-date")
    assert not validate_output(old, '"2022-02-31"').valid
    assert validate_output(old, '"2022-02-28"').valid


def test_a_format_no_checker_covers_is_reported_unchecked_not_post_checked():
    from shim_adapters.mask.capability import checked_formats

    assert "no-such-format" not in checked_formats()
    schema = {"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                               "x": {"type": "string",
                                                     "format": "no-such-format"}}}
    grammar = Grammar(json.dumps(schema), "json_schema", "formats")
    report = capability_report(grammar, get_backend("xgrammar"))
    by = report.by_construct()
    assert by["format"] is Support.POST_CHECK
    assert by["format:unchecked:no-such-format"] is Support.UNCHECKED
    [entry] = report.unchecked
    assert entry.where == "/properties/x" and "date" in entry.note
    assert not report.enforced and "1 not checked at all" in report.markdown()
    with pytest.raises(StrictModeError, match="no-such-format"):
        check_strict(report)


def test_non_integer_multiple_of_and_unlisted_members_are_their_own_constructs():
    schema = {"type": "object", "properties": {"p": {"type": "number", "multipleOf": 0.01}}}
    grammar = Grammar(json.dumps(schema), "json_schema", "price")
    xgr = capability_report(grammar, get_backend("xgrammar")).by_construct()
    assert xgr["multipleOf:non-integer"] is Support.POST_CHECK
    assert xgr["additionalProperties:absent"] is Support.STRICTER
    assert not validate_output(grammar, '{"p": 10000.001}').valid


def test_the_post_check_reads_the_draft_the_schema_declares():
    from shim_adapters.mask.capability import validate_output

    schema = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
              "dependencies": {"shipTo": ["shipAddress"]}}
    grammar = Grammar(json.dumps(schema), "json_schema", "order")
    assert not validate_output(grammar, '{"shipTo": "x"}').valid  # draft-04 `dependencies`
    assert validate_output(grammar, '{"shipTo": "x", "shipAddress": "y"}').valid


@pytest.mark.parametrize("pattern, construct", [
    ("^[a-z]+$", "pattern"),
    ("^(a|b)$", "pattern"),
    ("^[^$]+$", "pattern"),          # a $ inside a class is a character
    ("^\\$a$", "pattern"),          # an escaped $ is a character
    ("^[a|b]$", "pattern"),          # a | inside a class is a character
    ("[^a]+", "pattern:unanchored"),  # a negated class is no anchor
    ("abc", "pattern:unanchored"),
    ("^abc", "pattern:unanchored"),
    ("^a|b$", "pattern:unanchored"),  # each anchor holds for one branch only
    ("^a$b?", "pattern:inner-anchor"),
    ("x?^b$", "pattern:inner-anchor"),
    ("^(a($|/))*$", "pattern:inner-anchor"),
])
def test_a_pattern_is_named_by_its_anchors(pattern, construct):
    from shim_adapters.mask.capability import construct_name

    assert construct_name("pattern", pattern) == construct
