"""A backend's tokenizations declaration is judged against its mask: llguidance declares
canonical tokens where the grammar forces text and passes by it, the same backend declaring
``any`` fails completeness, and a declaration excuses only splits of forced text."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np

from shim_adapters.backends.registry import get_backend
from shim_adapters.conformance import run_conformance
from shim_adapters.conformance.checks import CellContext
from shim_adapters.conformance.faults import faulty_backend
from shim_adapters.conformance.prefix import prefix_checker
from shim_adapters.conformance.profiles import get_profile
from shim_adapters.conformance.report import FAILURE_CLASSES
from shim_adapters.conformance.runner import resolve_tokenizer
from shim_adapters.conformance.tokenizations import excused_split
from shim_adapters.mask.vocab import Vocabulary
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.mask.protocol import Tokenizations

SMALL = dict(gamma=False, uniform_walks=1, rare_walks=1, valid_strings=4, exhaustive_states=8)


def _run(spec, grammar="bv4"):
    return run_conformance(spec, "default", grammar, "fast", **SMALL)


def _context(backend: str, grammar: str) -> CellContext:
    tok = resolve_tokenizer("default")
    g = builtin_grammar(grammar)
    masker = get_backend(backend).compile(g, tok.tokenizer, tok.logits_width)
    return CellContext(masker=masker, grammar=g, vocab=Vocabulary(tok.tokenizer,
                                                                  masker.vocab_size),
                       tokenizer_name="default", profile=get_profile("fast"),
                       prefix=prefix_checker(g), rng=random.Random(0))


def test_canonical_in_forced_text_passes_by_its_declaration():
    report = _run("outlines")
    cell = report.cells[0]
    comp = cell.checks["completeness"]
    ex = cell.checks["soundness"].info["exhaustive"]
    assert report.exit_code == 0, report.to_markdown()
    assert comp.info["tokenizations_declared"] == "canonical_in_forced_text"
    assert ex["refused_as_declared"] > 0 and ex["wrongly_blocked"] == 0
    assert any("as the backend declares" in n for n in comp.notes)
    assert sum(e for _, _, e in comp.info["non_canonical_accepted_refused_excused"].values())


def test_a_wrong_declaration_is_a_completeness_failure_with_the_forced_split():
    spec = faulty_backend(get_backend("outlines"), "declares_any_tokenization")
    report = _run(spec)
    comp = report.cells[0].checks["completeness"]
    assert report.exit_code == FAILURE_CLASSES["completeness"][0], report.to_markdown()
    kinds = {r.kind for r in comp.failures}
    assert {"valid_token_refused", "non_canonical_refused"} <= kinds
    refused = next(r for r in comp.failures if r.kind == "valid_token_refused")
    assert "forced text" in refused.detail and not refused.known_bug
    assert "declares tokenizations=any" in next(
        r.detail for r in comp.failures if r.kind == "non_canonical_refused")


def test_only_splits_of_forced_text_are_excused():
    ctx = _context("outlines", "bv4")
    state = ctx.masker.new_state()
    paren = ctx.vocab.canonical("(")[0]
    state.advance(paren[0])
    mask = np.asarray(state.allowed_mask())
    data = ctx.data(paren)
    ids = {ctx.vocab.text_of(i): i for i in np.flatnonzero(ctx.is_text)}
    d = ids["'d'"] if "'d'" in ids else next(i for t, i in ids.items() if t.strip("'") == "d")
    assert not mask[d] and excused_split(ctx, ctx.forced, data, d, mask)
    # JSON at the start forces nothing: a refused viable token there is never excused.
    jctx = _context("xgrammar", "json")
    jmask = np.asarray(jctx.masker.new_state().allowed_mask()).copy()
    bracket = int(jctx.vocab.canonical("[")[0][0])
    jmask[bracket] = False
    assert not excused_split(jctx, jctx.forced, b"", bracket, jmask)


def test_a_canonical_only_declaration_is_judged_on_canonical_strings_only():
    base = get_backend("outlines")

    def create(grammar, tokenizer, vocab_size=None, **options):
        masker = base.create_masker(grammar, tokenizer, vocab_size, **options)
        masker.tokenizations = Tokenizations.CANONICAL
        return masker

    report = _run(replace(base, name="outlines-canonical", create_masker=create))
    cell = report.cells[0]
    comp = cell.checks["completeness"]
    assert report.exit_code == 0, report.to_markdown()
    assert "canonical" in cell.checks["soundness"].info["exhaustive"]["blocked_not_judged"]
    assert any("recorded, not judged" in n for n in comp.notes)
    assert comp.passed > 0  # canonical tokenizations of valid strings are still judged


def test_the_differential_counts_declared_refusals_apart():
    from shim_adapters.conformance.differential import differential

    ctxs = [_context(b, "bv4") for b in ("xgrammar", "outlines")]
    for c in ctxs:
        c.profile = get_profile("fast", differential_walks=2)
    result = differential(ctxs)
    outlines = result.verdicts["outlines"]
    assert outlines["incomplete"] == 0 and outlines["refused_as_declared"] > 0, result.verdicts
    assert all(r["refused_by"] != ["outlines"] for r in result.repros if r["verdict"] == "viable")
