"""Lark <-> EBNF conversion: same language on samples and near misses, clear refusals."""

from __future__ import annotations

from pathlib import Path

import lark
import pytest
from grammar_sampling import GrammarSampler

from shim_adapters.errors import GrammarError, UnsupportedGrammarError
from shim_adapters.grammars.convert import convert, ebnf_to_lark, lark_to_ebnf
from shim_adapters.grammars.grammar import BUILTIN_GRAMMARS, Grammar, builtin_grammar, load_grammar

#: Benchmark EBNF files, relative to --benchmark-data / SHIM_BENCHMARK_DATA (see conftest.py).
EBNF_FILES = ["BV4/find_inv_eq_bvand_4bit.ebnf", "example/binary_len_5_new.ebnf"]


def earley(lark_text: str) -> lark.Lark:
    return lark.Lark(lark_text, parser="earley", lexer="dynamic")


def accepts(parser: lark.Lark, text: str) -> bool:
    try:
        parser.parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


def assert_same_language(original: lark.Lark, converted: lark.Lark, sampler: GrammarSampler,
                         n: int = 60) -> None:
    positives = [sampler.sample() for _ in range(n)]
    for text in positives:
        assert accepts(original, text), f"sampler produced a non-member {text!r}"
        assert accepts(converted, text), f"converted grammar rejects {text!r}"
    negatives = 0
    for text in positives:
        for _ in range(3):
            mutant = sampler.mutate(text)
            expected = accepts(original, mutant)
            negatives += not expected
            assert accepts(converted, mutant) == expected, f"disagree on {mutant!r}"
    assert negatives > 0  # the mutations did exercise rejection


@pytest.mark.parametrize("name", sorted(BUILTIN_GRAMMARS))
def test_builtin_lark_round_trip_keeps_language(name):
    grammar = builtin_grammar(name)
    result = convert(grammar, "ebnf")
    assert result.exact and result.notes == ("exact",)
    assert result.grammar.format == "ebnf" and result.grammar.text.startswith("root ::= ")
    back = ebnf_to_lark(result.grammar.text, grammar_name=name)
    assert_same_language(earley(grammar.text), earley(back), GrammarSampler(grammar, seed=1))


@pytest.mark.benchmark_data
@pytest.mark.parametrize("path", EBNF_FILES, ids=lambda p: Path(p).name)
def test_benchmark_ebnf_round_trip_keeps_language(path, benchmark_data):
    grammar = load_grammar(benchmark_data / path)
    as_lark = convert(grammar, "lark")
    assert as_lark.exact
    again = ebnf_to_lark(lark_to_ebnf(as_lark.grammar.text))
    assert_same_language(earley(as_lark.grammar.text), earley(again),
                         GrammarSampler(grammar, seed=2))


def test_case_insensitive_literal_becomes_case_classes():
    ebnf = lark_to_ebnf('start: "select"i " " /[a-b]/i\n')
    # Python's IGNORECASE also pairs 's' with U+017F (long s); the conversion keeps that.
    assert '[Ssſ] [Ee] [Ll] [Ee] [Cc] [Tt] " " [A-Ba-b]' in ebnf
    parser = earley(ebnf_to_lark(ebnf))
    for text in ("select a", "SeLeCt B", "SELECT b"):
        assert accepts(parser, text)
    assert not accepts(parser, "selec a")
    # Python's case folding also pairs 'k' with the Kelvin sign; the conversion keeps that.
    assert accepts(earley(ebnf_to_lark(lark_to_ebnf('start: "k"i\n'))), "\u212a")


def test_bounded_repeats_and_regex_quantifiers():
    source = 'start: "a" ~ 2..3 B\nB: /x{1,2}y?z*/\n'
    ebnf = lark_to_ebnf(source)
    assert "{2,3}" in ebnf and "{1,2}" in ebnf
    original, converted = earley(source), earley(ebnf_to_lark(ebnf))
    for text in ("aax", "aaaxxyzzz", "aaxy", "ax", "aaaax", "aaxxx", "aa"):
        assert accepts(converted, text) == accepts(original, text), text


def test_ebnf_repeat_forms_convert_to_lark():
    ebnf = 'root ::= "a"{2} "b"{0,2} "c"{1,} ("d" | "")\n'
    parser = earley(ebnf_to_lark(ebnf))
    assert accepts(parser, "aac") and accepts(parser, "aabbcccd")
    assert not accepts(parser, "ac") and not accepts(parser, "aabbbc")


def test_escapes_survive_both_directions():
    ebnf = r'root ::= "q\"\\\t\x01é😀" [\]\-^\\] [^a-z\n]' + "\n"
    text = 'q"\\\t\x01é😀]A'
    parser = earley(ebnf_to_lark(ebnf))
    assert accepts(parser, text)
    assert accepts(earley(ebnf_to_lark(lark_to_ebnf(ebnf_to_lark(ebnf)))), text)
    assert not accepts(parser, 'q"\\\t\x01é😀]a')


def test_unicode_digit_class_is_exact_not_ascii():
    ebnf = lark_to_ebnf(r"start: /\d/" + "\n")
    parser = earley(ebnf_to_lark(ebnf))
    assert accepts(parser, "7") and accepts(parser, "\u0663")  # ARABIC-INDIC DIGIT THREE
    assert not accepts(parser, "x")


def test_priority_is_reported_as_lowered():
    result = convert(Grammar('start: a\na.2: "x"\n', "lark"), "ebnf")
    assert not result.exact
    assert any("priority" in note for note in result.notes)


@pytest.mark.parametrize("source, line, words", [
    ('start: WORD+\nWORD: /[a-z]+/\n%import common.WS\n%ignore WS\n', 4, "%ignore"),
    ('start: A\n%declare A\n', 2, "%declare"),
    ('start: x{"a"}\nx{p}: p\n', 2, "template"),
    ('start: A\nA: /a(?=b)/\n', 2, "lookaround"),
    ('start: A\nA: /(a)\\1/\n', 2, "backreference"),
    ('start: A\n\nA: /^a/\n', 3, "anchor"),
])
def test_unfaithful_lark_constructs_are_refused_with_line(source, line, words):
    with pytest.raises(UnsupportedGrammarError) as info:
        lark_to_ebnf(source, grammar_name="g.lark")
    assert info.value.line == line
    assert words in str(info.value) and "g.lark" in str(info.value)


def test_ignore_refusal_suggests_explicit_whitespace():
    with pytest.raises(UnsupportedGrammarError, match="explicitly"):
        lark_to_ebnf('start: "a"\n%ignore " "\n')


@pytest.mark.parametrize("source, line", [
    ('root ::= "a"\nx ::= "b" (\n', 2),
    ('root ::= "a"\n\nx ::= "b" | [z-a]\n', 3),
    ('root ::= "a" missing\n', 1),
    ('root ::= "a"\nroot ::= "b"\n', 2),
    ('root ::= "a" {3}\nx ::= "unterminated\n', 2),
])
def test_malformed_ebnf_names_the_line(source, line):
    with pytest.raises(GrammarError) as info:
        ebnf_to_lark(source, grammar_name="bad.ebnf")
    assert info.value.line == line and "bad.ebnf" in str(info.value)


def test_ebnf_without_root_and_lookahead_are_refused():
    with pytest.raises(GrammarError, match="root"):
        ebnf_to_lark('start ::= "a"\n')
    with pytest.raises(UnsupportedGrammarError, match="lookahead") as info:
        ebnf_to_lark('root ::= "a" x\nx ::= "b" (= "c")\n')
    assert info.value.line == 2


def test_lark_import_of_common_terminals_is_converted():
    source = 'start: NUMBER "," WORD\n%import common.NUMBER\n%import common.WORD\n'
    result = convert(Grammar(source, "lark"), "ebnf")
    assert result.exact
    parser = earley(ebnf_to_lark(result.grammar.text))
    assert accepts(parser, "1.5e3,abc") and not accepts(parser, "1.5e3,ab1")


def test_same_format_is_identity_and_unknown_target_refused():
    grammar = builtin_grammar("bv4")
    assert convert(grammar, "lark").grammar is grammar
    with pytest.raises(UnsupportedGrammarError):
        convert(grammar, "regex")
