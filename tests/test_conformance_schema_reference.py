"""The JSON-schema reference is the schema itself: an over-approximation judges allowed
tokens, an under-approximation (members in schema order) judges refused ones, so a backend
that drops a schema's constraints is caught token by token, and the two real schema backends
raise no alarm that is not one of their known bugs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shim_adapters.backends.registry import get_backend
from shim_adapters.conformance import known_bugs, run_conformance
from shim_adapters.conformance.checks import CellContext
from shim_adapters.conformance.differential import differential
from shim_adapters.conformance.faults import faulty_backend
from shim_adapters.conformance.prefix import LarkPrefixChecker, prefix_checker, refusal_checker
from shim_adapters.conformance.profiles import get_profile
from shim_adapters.conformance.report import FAILURE_CLASSES
from shim_adapters.conformance.runner import resolve_tokenizer
from shim_adapters.conformance.schema_reference import schema_lark
from shim_adapters.mask.vocab import Vocabulary
from shim_adapters.errors import UnsupportedGrammarError
from shim_adapters.grammars.grammar import Grammar, builtin_grammar, load_grammar

PERSON = Path(__file__).resolve().parents[1] / "conformance" / "grammars" / "person.json"
#: Small work budgets: the verdicts must not depend on the machine's load.
SMALL = dict(gamma=False, uniform_walks=1, rare_walks=1, valid_strings=6, exhaustive_states=8)
OK = '{"name":"a","age":1,"role":'


@pytest.fixture(scope="module")
def person():
    return load_grammar(PERSON)


@pytest.mark.parametrize("text,relaxed,ordered", [
    ('{"name":"', True, True),
    ('{"name":"abcdefghijkl', True, True),
    ('{"name":"abcdefghijklm', False, False),             # maxLength 12
    ('{"name":"a\\n', True, True),                        # an escape is one character
    ('{"name":"\\ud83d\\ude00', True, False),             # surrogate pair: relaxed only
    ('{"name":"\x85', True, True),                        # raw C1 control: valid JSON
    ('{"name":"\x1f', False, False),                      # raw U+001F: not
    ('{"age":1', True, False),                            # another member order
    ('{"n\\u0061me":"x"', True, False),                   # another spelling of the key
    ('{"nick', False, False),                             # additionalProperties false
    ('{"name":"a","age":12', True, True),
    ('{"name":"a","age":121', True, False),               # maximum 120: 121.0e-1 is viable
    ('{"name":"a","age":121,', False, False),             # a plain 121 that ended: dead
    ('{"name":"a","age":120.0,', True, False),            # 120.0 is an integer
    ('{"name":"a","age":1.2e2,', True, False),
    ('{"name":"a","age":-0,', True, False),               # -0 is the integer 0
    ('{"name":"a","age":-1,', False, False),              # minimum 0
    ('{"name":"a","age":1.0', True, False),               # 1.0 is an integer
    ('{"name":"a","age":"1"', False, False),              # wrong type
    (OK + '"us', True, True),
    (OK + '"\\u0075ser"', True, False),                   # an enum value spelled otherwise
    (OK + '"root"', False, False),                        # not in the enum
    (OK + '"user","tags":["a","b","c"', True, True),
    (OK + '"user","tags":["a","b","c",', False, False),  # maxItems 3
    (OK + '"user","tags":["1234567"', False, False),     # items maxLength 6
    ('{}', False, False),                                 # required
    ('\t{', True, False),                                 # leading whitespace: relaxed only
    (OK + '"user" ,\n "active" : true }', True, True),
])
def test_the_two_readings_of_a_schema(person, text, relaxed, ordered):
    assert prefix_checker(person).viable(text) is relaxed
    assert refusal_checker(person).viable(text) is ordered
    assert not ordered or relaxed  # the ordered reading is inside the relaxed one


def test_a_construct_the_ordered_reading_cannot_express_is_named_not_guessed():
    schema = json.dumps({"type": "object", "properties": {"id": {"type": "string",
                                                                  "pattern": "^[a-z]+$"}}})
    with pytest.raises(UnsupportedGrammarError, match="string pattern"):
        schema_lark(schema, ordered=True)
    text, dropped = schema_lark(schema, ordered=False)
    assert dropped == ["string pattern"]
    assert LarkPrefixChecker(text).viable('{"id":"ABC"')  # over-approximated, never dead


def test_refs_and_anyof_are_followed():
    schema = json.dumps({"$defs": {"node": {"type": "object", "properties": {
        "v": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "next": {"$ref": "#/$defs/node"}}, "required": ["v"], "additionalProperties": False}},
        "$ref": "#/$defs/node"})
    ordered = LarkPrefixChecker(schema_lark(schema, ordered=True)[0])
    assert ordered.viable('{"v":null,"next":{"v":3,"next":{"v":')
    assert not ordered.viable('{"v":true')


def test_a_backend_that_drops_the_schema_is_caught_token_by_token(person):
    report = run_conformance(faulty_backend(get_backend("xgrammar"), "drops_schema"), "default",
                             PERSON, "fast", **{**SMALL, "keep_failures": 200})
    sound = report.cells[0].checks["soundness"]
    assert report.exit_code & FAILURE_CLASSES["soundness"][0]
    assert sound.info["exhaustive"]["wrongly_allowed"] > 0
    json_syntax = LarkPrefixChecker(builtin_grammar("json").text)
    # Failures JSON syntax alone would have passed: the schema's constraints are judged.
    inside = [r for r in sound.failures if "exhaustive" in r.detail and r.prefix_text
              and json_syntax.viable(r.prefix_text + (r.added_text or ""))]
    assert inside, [r.one_line() for r in sound.failures]
    assert not prefix_checker(person).viable(inside[0].prefix_text + inside[0].added_text)


def test_a_backend_that_drops_the_schema_bounds_is_caught_on_a_bound(person):
    report = run_conformance(faulty_backend(get_backend("xgrammar"), "drops_schema_bounds"),
                             "default", PERSON, "fast", **SMALL)
    sound = report.cells[0].checks["soundness"]
    assert report.exit_code & FAILURE_CLASSES["soundness"][0]
    unbounded = json.loads(person.text)
    for node in (unbounded["properties"]["name"], unbounded["properties"]["tags"],
                 unbounded["properties"]["tags"]["items"]):
        for kw in ("minLength", "maxLength", "maxItems"):
            node.pop(kw, None)
    without = prefix_checker(Grammar(json.dumps(unbounded), "json_schema", "unbounded"))
    # The repros are texts the schema without its bounds takes and the schema refuses.
    on_bound = [r for r in sound.failures if not r.known_bug and r.added_text is not None
                and without.viable(r.prefix_text + r.added_text)
                and not prefix_checker(person).viable(r.prefix_text + r.added_text)]
    assert on_bound, [r.one_line() for r in sound.failures]


@pytest.mark.parametrize("backend", ["xgrammar", "outlines"])
def test_schema_backends_raise_only_their_known_bugs_and_fail_until_they_are_accepted(backend):
    report = run_conformance(backend, "default", PERSON, "fast", **SMALL)
    cell = report.cells[0]
    ex = cell.checks["soundness"].info["exhaustive"]
    assert not any(c.failed for c in cell.checks.values()), report.to_markdown()
    met = report.known_bugs_met()
    assert met and "refusals_judged_by" in ex and ex["states"] >= 4
    # a known bug on the user's grammar fails its class until the user accepts it by id
    assert report.exit_code != 0 and "Known bugs met" in report.to_markdown()
    accepted = run_conformance(backend, "default", PERSON, "fast", accept_known=list(met),
                               **SMALL)
    assert accepted.exit_code == 0, accepted.to_markdown()
    assert "| yes |" in accepted.to_markdown()  # listed either way


def _contexts(grammar, names, tokenizer="default"):
    tok = resolve_tokenizer(tokenizer)
    profile = get_profile("fast", differential_walks=4, keep_failures=500)
    out = []
    for spec in names:
        spec = get_backend(spec) if isinstance(spec, str) else spec
        masker = spec.compile(grammar, tok.tokenizer, tok.logits_width)
        out.append(CellContext(masker=masker, grammar=grammar,
                               vocab=Vocabulary(tok.tokenizer, tok.logits_width),
                               tokenizer_name=tokenizer, profile=profile,
                               prefix=prefix_checker(grammar), rng=random.Random(0)))
    return out


def _known_construct(ctx: CellContext, repro: dict) -> bool:
    """Disagreements that are instances of the two backends' known schema bugs."""
    data = ctx.vocab.token_bytes[repro["token_id"]]
    before = ctx.data(repro["prefix_token_ids"])[-1:]
    if repro["refused_by"] == ["outlines"]:  # whitespace beyond one space; DEL/C1 controls
        return (any(c in data for c in b"\t\n\r") or b"  " in before + data or 0x7F in data
                or (0x80 <= data[0] <= 0x9F and ctx.data(repro["prefix_token_ids"])[-1:]
                    == b"\xc2"))
    return repro["refused_by"] == ["xgrammar"] and b"\\" in data  # escapes, maxLength


def test_differential_adjudicates_schema_disagreements_without_false_alarms(person):
    contexts = _contexts(person, ["xgrammar", "outlines"])
    result = differential(contexts)
    assert result.verdicts["outlines"]["unsound"] == 0
    incomplete = [r for r in result.repros if r["verdict"] == "viable"]
    wrong = [r for r in incomplete if not _known_construct(contexts[0], r)]
    assert incomplete and not wrong, wrong
    # XGrammar 0.2.9 lets raw control characters into schema strings; shim-xgrammar's byte
    # guard refuses them, so the differential finds none allowed by xgrammar alone
    assert result.verdicts["xgrammar"]["unsound"] == 0
    assert not any(r["verdict"] == "not viable" and r["allowed_by"] == ["xgrammar"]
                   and "\\x" in r["token"] for r in result.repros)
    faulty = _contexts(person, ["xgrammar", faulty_backend(get_backend("xgrammar"),
                                                           "drops_schema")])
    result = differential(faulty)
    assert result.verdicts[faulty[1].masker.backend_name]["unsound"] > 0
    assert all(b"\\" in faulty[0].vocab.token_bytes[r["token_id"]] for r in result.repros
               if r["verdict"] == "viable")  # xgrammar's refusals: only its escape bug


def test_c1_controls_refused_in_schema_strings_are_caught_and_known_narrowly(monkeypatch):
    report = run_conformance("outlines", "default", PERSON, "fast", **SMALL)
    comp = report.cells[0].checks["completeness"]
    seen = [r for r in comp.failures if r.known_bug == "outlines-core-schema-del-c1-refused"]
    assert seen and any(0x80 <= ord(c) <= 0x9F for r in seen for c in r.added_text or "")
    # Without the entry the same run fails completeness (exit bit 2) on it.
    monkeypatch.setattr(known_bugs, "KNOWN_BUGS", tuple(
        b for b in known_bugs.KNOWN_BUGS if "del-c1" not in b.id))
    report = run_conformance("outlines", "default", PERSON, "fast", **SMALL)
    comp = report.cells[0].checks["completeness"]
    assert report.exit_code & FAILURE_CLASSES["completeness"][0]
    assert any(not r.known_bug and any(0x7F <= ord(c) <= 0x9F for c in r.added_text or "")
               for r in comp.failures)
    # The entry is narrow: the same token outside a string, or on another version, is not it.
    r = seen[0]
    assert known_bugs.match_known_bug(r, "outlines_core 0.2.15") is None
