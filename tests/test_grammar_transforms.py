"""The undefined-rule pruning transform: explicit, reported, and language-preserving."""

from __future__ import annotations

import pytest

from shim_adapters.grammars.grammar import Grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.grammars.transforms import prune_undefined_rules

CP_LIKE = '''root ::= "[ " B_0 "]"
B_0 ::= "( " Tag " " B_1 | "( " Tag " x " E_0
B_1 ::= "( " Tag " " C_9
E_0 ::= ") " | ") " E_0
Tag ::= "NP" | "VP" | "(" "S|T" ")"
'''


def test_alternatives_that_use_undefined_rules_are_pruned_and_reported():
    text, report = prune_undefined_rules(CP_LIKE)
    assert report.undefined == ["C_9"] and report.changed
    assert report.emptied_rules == ["B_1"]  # its only alternative used C_9
    assert report.removed_alternatives == 2  # B_1's, then B_0's use of B_1
    assert "B_1" not in text and "C_9" not in text
    assert 'Tag ::= "NP" | "VP" | "(" "S|T" ")"' in text  # quoted '|' is not a separator
    acceptor = reference_acceptor(Grammar(text, "ebnf", name="cp-like"))
    assert acceptor.accepts("[ ( NP x ) ]") and not acceptor.accepts("[ ( NP ( VP ) ]")


def test_a_grammar_whose_root_empties_is_refused():
    with pytest.raises(ValueError, match="root rule empty"):
        prune_undefined_rules('root ::= A\nA ::= B\n', source="bad.ebnf")


def test_a_complete_grammar_is_left_alone():
    text, report = prune_undefined_rules('root ::= "a" | B\nB ::= "b"\n')
    assert not report.changed and text == 'root ::= "a" | B\nB ::= "b"\n'
