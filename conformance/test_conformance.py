"""Conformance suite, pytest entry point (the ``fast`` profile: CI).

Runs conformance/profiles/fast.json over every installed backend, then proves each check
catches a real masker with one injected defect (with a minimised repro). The ``full`` profile
is run by hand (see README.md) and its report is committed under conformance/reports/.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from shim_adapters.backends.registry import backends, get_backend
from shim_adapters.conformance import run_conformance, run_profile_file
from shim_adapters.conformance.checks import CellContext
from shim_adapters.conformance.differential import differential
from shim_adapters.conformance.faults import faulty_backend
from shim_adapters.conformance.generate import valid_strings
from shim_adapters.conformance.prefix import prefix_checker
from shim_adapters.conformance.profiles import get_profile
from shim_adapters.conformance.runner import resolve_tokenizer
from shim_adapters.mask.vocab import Vocabulary, decode_prefix
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor

HERE = Path(__file__).resolve().parent
CORE_CHECKS = ("soundness", "completeness", "no_dead_ends", "tokenizer_edges")
#: Every cell's exhaustive mask check must have judged at least this many (state, token) pairs.
MIN_EXHAUSTIVE_TOKENS = 1000


def _healthy_backend() -> str:
    installed = list(backends())
    assert installed, "no masker backend installed (pip install plugins/shim-xgrammar)"
    return next((n for n in ("xgrammar", "outlines", "syncode") if n in installed), installed[0])


@pytest.fixture(scope="module")
def fast_report(tmp_path_factory):
    report = run_profile_file(HERE / "profiles" / "fast.json", progress=None)
    report.write(tmp_path_factory.mktemp("conformance"), "fast")
    return report


def test_fast_profile_has_no_soundness_failures(fast_report):
    bad = [f"{c.backend}/{c.tokenizer}/{c.grammar}: {r.one_line()}"
           for c in fast_report.cells if "soundness" in c.checks
           for r in c.checks["soundness"].failures if not r.known_bug]
    assert fast_report.soundness_failures == 0, "\n".join(bad)
    assert fast_report.exit_code == 0


def test_fast_profile_every_cell_ran_every_check(fast_report):
    expected = {(b, t, g) for b in backends() for t in ("shipped", "gpt2")
                for g in ("bv4", "binary5", "json", "sql")}
    excluded = fast_report.meta.get("excluded_cells", [])
    ran = {(c.backend, c.tokenizer, c.grammar) for c in fast_report.cells}
    assert len(ran) + len(excluded) == len(expected)
    for cell in fast_report.cells:
        assert cell.error is None, f"{cell.backend}/{cell.tokenizer}/{cell.grammar}: {cell.error}"
        for name in CORE_CHECKS:
            assert cell.checks[name].passed > 0, (cell.backend, cell.grammar, name)


def test_fast_profile_exit_status_is_zero_and_every_cell_was_checked_exhaustively(fast_report):
    assert fast_report.exit_code == 0, fast_report.failing_classes()
    for cell in fast_report.cells:
        ex = cell.checks["soundness"].info["exhaustive"]
        assert ex["states"] >= 1 and ex["tokens_checked"] >= MIN_EXHAUSTIVE_TOKENS, cell.label


def test_fast_profile_failures_are_only_known_upstream_bugs(fast_report):
    unknown = [f"{c.backend}/{c.tokenizer}/{c.grammar}/{name}: {r.one_line()}"
               for c in fast_report.cells for name, check in c.checks.items()
               for r in check.failures if not r.known_bug]
    assert not unknown, "\n".join(unknown)


def test_gamma_check_runs_on_the_shipped_tokenizer(fast_report):
    gamma = [c.checks["gamma"] for c in fast_report.cells if c.tokenizer == "shipped"]
    ran = [g for g in gamma if g.not_run is None]
    assert ran, [g.not_run for g in gamma]
    assert all(g.failed == 0 and g.passed > 0 for g in ran)
    other = [c.checks["gamma"] for c in fast_report.cells if c.tokenizer == "gpt2"]
    assert all(g.not_run for g in other)  # no controller for GPT-2: n/a with a reason


def test_differential_compares_every_grammar_when_two_backends_exist(fast_report):
    if len(backends()) < 2:
        pytest.fail("the differential check needs two installed backends")
    compared = {(d.tokenizer, d.grammar) for d in fast_report.differential}
    assert {("shipped", g) for g in ("bv4", "binary5", "json", "sql")} <= compared
    assert all(d.steps > 0 for d in fast_report.differential)


def test_report_renders_as_markdown_and_json(fast_report):
    md = fast_report.to_markdown()
    assert "| backend | tokenizer | grammar | soundness |" in md
    for cell in fast_report.cells:
        assert f"| {cell.backend} | {cell.tokenizer} | {cell.grammar} |" in md
    data = json.loads(fast_report.to_json())
    assert data["soundness_failures"] == 0 and len(data["cells"]) == len(fast_report.cells)


# ---- the checks catch injected defects ----------------------------------------------------
def _faulty_report(fault: str, grammar: str = "bv4"):
    spec = faulty_backend(get_backend(_healthy_backend()), fault)
    return run_conformance(spec, "default", grammar, "fast", gamma=False, uniform_walks=2,
                           rare_walks=0)


def test_unsound_token_is_caught_with_a_minimised_repro():
    report = _faulty_report("unsound_token")
    cell = report.cells[0]
    assert report.exit_code == 1 and cell.checks["soundness"].failed >= 1
    repro = next(r for r in cell.checks["soundness"].failures if r.kind == "unsound_token")
    assert repro.grammar == "bv4" and repro.prefix_token_ids == [] and repro.prefix_text == ""
    assert repro.token_id is not None and repro.token_text
    assert "bv4" in report.to_markdown() and str(repro.token_id) in report.to_markdown()


def test_eos_where_not_accepting_is_caught_at_the_shortest_prefix():
    report = _faulty_report("eos_always")
    repros = [r for r in report.cells[0].checks["soundness"].failures
              if r.kind == "eos_not_accepting"]
    assert report.exit_code == 1 and repros
    assert min(len(r.prefix_token_ids) for r in repros) == 0


def test_padding_allowed_is_caught():
    report = _faulty_report("padding_allowed", "binary5")
    kinds = {r.kind for r in report.cells[0].checks["soundness"].failures}
    assert "padding_allowed" in kinds and report.exit_code == 1


def test_refused_valid_token_is_a_minimised_completeness_failure():
    report = _faulty_report("refuse_token", "json")
    comp = report.cells[0].checks["completeness"]
    assert comp.failed >= 1
    repro = comp.failures[0]
    assert repro.kind == "valid_token_refused" and repro.token_id is not None
    assert "valid string" in repro.detail
    # The refused token really extends a viable prefix (the reference agrees it is valid).
    assert prefix_checker(builtin_grammar("json")).viable(repro.prefix_text + repro.token_text)
    # Completeness fails the run with its own exit bit (2), not the soundness bit (1).
    assert report.cells[0].checks["soundness"].failed == 0
    assert report.exit_code & 2 and not report.exit_code & 1


def test_differential_adjudicates_an_unsound_backend():
    tok = resolve_tokenizer("default")
    grammar = builtin_grammar("bv4")
    profile = get_profile("fast", differential_walks=2)
    contexts = []
    for spec in (get_backend(_healthy_backend()),
                 faulty_backend(get_backend(_healthy_backend()), "unsound_token")):
        masker = spec.compile(grammar, tok.tokenizer, tok.logits_width)
        contexts.append(CellContext(masker=masker, grammar=grammar,
                                    vocab=Vocabulary(tok.tokenizer, tok.logits_width),
                                    tokenizer_name="shipped", profile=profile,
                                    prefix=prefix_checker(grammar), rng=random.Random(0)))
    result = differential(contexts)
    faulty = contexts[1].masker.backend_name
    assert result.verdicts[faulty]["unsound"] >= 1
    assert result.verdicts[contexts[0].masker.backend_name]["unsound"] == 0
    assert any(r["verdict"] == "not viable" and r["prefix_text"] == "" for r in result.repros)


# ---- the references the checks rely on ----------------------------------------------------
@pytest.mark.parametrize("grammar,viable,dead", [
    ("bv4", ["(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) (bvl"],
     ["(define-fun inv ((s (BitVec 4)) (t (BitVec 4))) (BitVec 4) (bvx", " ("]),
    ("json", ['{"a\\u00', "[1, 2.5e", " \n{} "], ['{"a\\q', "[01", "[1,]", "{} x"]),
    ("sql", ["SELECT a, COUNT(*) FROM t WHERE x >= 1"], ["SELECT a,b", "SELECT * FROM t;;"]),
    ("binary5", ["00", "1011"], ["01", "101111"]),
])
def test_prefix_reference(grammar, viable, dead):
    checker = prefix_checker(builtin_grammar(grammar))
    assert all(checker.viable(t) for t in viable)
    assert not any(checker.viable(t) for t in dead)


def test_prefix_reference_for_regex_and_schema():
    regex = Grammar((HERE / "grammars" / "email.regex").read_text(), "regex", "email")
    assert prefix_checker(regex).viable("ab.c@exa")
    assert not prefix_checker(regex).viable("ab@@")
    schema = Grammar((HERE / "grammars" / "person.json").read_text(), "json_schema", "person")
    assert prefix_checker(schema).viable('{"name": "x", "age": 1')
    assert not prefix_checker(schema).viable('{"name": }')


@pytest.mark.parametrize("name", ["bv4", "json", "sql", "binary5"])
def test_generator_yields_reference_accepted_hard_cases(name):
    grammar = builtin_grammar(name)
    strings, _ = valid_strings(grammar, 20, seed=3)
    assert len(strings) >= 5
    assert all(reference_acceptor(grammar).accepts(s) for _, s in strings)
    if name == "json":
        texts = [s for _, s in strings]
        assert any(any(ord(c) > 127 for c in s) or "\\u" in s for s in texts)
        assert any(("\n" in s or "\t" in s or "  " in s) for s in texts)
    if name == "bv4":
        assert max(s.count("(") for _, s in strings) >= 6  # nesting beyond the header


def test_decode_prefix_splits_incomplete_utf8():
    assert decode_prefix("aé".encode()[:-1]) == ("a", b"\xc3")
    assert decode_prefix("a😀".encode()[:-2]) == ("a", "😀".encode()[:2])
    with pytest.raises(UnicodeDecodeError):
        decode_prefix(b"a\x80")


def test_vocabulary_token_bytes_match_the_tokenizer_on_real_tokenizers():
    for name in ("default", "gpt2", "mistral-v1"):
        tok = resolve_tokenizer(name)
        vocab = Vocabulary(tok.tokenizer, tok.logits_width)
        text = "SELECT né 😀 {\"k\": [1]}\n\t(bvand s t)"
        ids, how = vocab.canonical(text)
        assert vocab.to_bytes(ids) == text.encode(), (name, how)
        assert vocab.to_bytes(vocab.char_by_char(text)) == text.encode()
        assert vocab.to_bytes(vocab.bytewise("é😀")) == "é😀".encode() or vocab.scheme == "text"
