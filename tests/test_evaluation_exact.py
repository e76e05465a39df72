"""Exact scoring on the shipped LM: enumeration and teacher forcing agree, masking distorts
binary5 as docs/design.md says, rejection sampling returns only valid strings."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import backends, get_backend
from shim_adapters.evaluation.exact_language import enumerate_language
from shim_adapters.evaluation.metrics import exact_kl, grouped_probabilities
from shim_adapters.evaluation.rejection import draw_lm_samples, rejection_sample
from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.sampling import prefill, sample


@pytest.fixture(scope="module")
def binary5(shipped_lm):
    grammar = builtin_grammar("binary5")
    masker = get_backend("xgrammar").compile(grammar, shipped_lm.tokenizer, shipped_lm.vocab_size)
    return masker, prefill(shipped_lm, grammar.default_prompt)


@pytest.fixture(scope="module")
def language(binary5):
    masker, pre = binary5
    return enumerate_language(pre, masker, {"masking": None})


def test_enumeration_is_the_language_and_masking_is_a_distribution(language):
    assert set(language.texts) == {
        "10111", "10001", "10010", "11001", "10011", "11110", "10101", "11111", "11101",
        "00100", "11100", "11010", "10110", "00010", "11011", "10100", "11000"}
    # masking's per-step distributions multiply to a distribution over the language
    assert np.exp(np.logaddexp.reduce(language.methods["masking"])) == pytest.approx(1.0, 1e-6)


def test_masking_distorts_binary5_as_in_the_design(language):
    """The shipped LM emits near-uniform bits: masking puts about 1/4 on each string starting
    with 0 where the target puts about 1/17 (docs/design.md)."""
    target = grouped_probabilities(language.texts, language.target())
    masked = grouped_probabilities(language.texts, language.methods["masking"])
    for s in ("00100", "00010"):
        assert target[s] == pytest.approx(1 / 17, abs=0.03)
        assert masked[s] == pytest.approx(1 / 4, abs=0.08)
    assert exact_kl(language.target(), language.methods["masking"]) > 0.15


def test_teacher_forcing_matches_enumeration(binary5, language):
    masker, pre = binary5
    scores = score_sequences(pre, language.sequences, masker, {"masking": None}, batch_size=5)
    np.testing.assert_allclose(scores.lm, language.lm, atol=1e-4)
    np.testing.assert_allclose(scores.methods["masking"], language.methods["masking"], atol=1e-4)
    assert scores.masker_accepts.all()


def test_scoring_marks_forbidden_sequences(binary5):
    masker, pre = binary5
    tok = pre.lm.tokenizer
    eos = pre.lm.eos_token_ids[0]
    bad = tok("01111")["input_ids"] + [eos]
    good = tok("10111")["input_ids"] + [eos]
    scores = score_sequences(pre, [bad, good], masker, {"masking": None})
    assert scores.masker_accepts.tolist() == [False, True]
    assert scores.methods["masking"][0] == -np.inf and np.isfinite(scores.methods["masking"][1])
    assert scores.forbidden_step[0] >= 0 and scores.forbidden_step[1] == -1
    assert np.isfinite(scores.lm).all()  # the LM itself gives both a probability


def test_rejection_sampler_returns_only_valid_strings(shipped_lm):
    grammar = builtin_grammar("bv4")
    pre = prefill(shipped_lm, grammar.default_prompt)
    out = rejection_sample(pre, grammar, 20, max_draws=400, max_new_tokens=96,
                           generator=torch.Generator().manual_seed(0))
    acceptor = reference_acceptor(grammar)
    assert len(out.texts) == 20
    assert all(acceptor.accepts(t) for t in out.texts)
    assert out.n_draws >= 20 and 0 < out.acceptance_rate <= 1
    # the LM also produces invalid strings here, so rejection really rejects
    draws = draw_lm_samples(pre, grammar, 64, max_new_tokens=96,
                            generator=torch.Generator().manual_seed(1))
    assert 0 < draws.valid.sum() < draws.n


@pytest.mark.parametrize("backend", sorted(backends()))
def test_masked_sampling_and_asap_run_on_every_backend(shipped_lm, backend):
    """The baselines only use the MaskerState protocol, so every backend serves them."""
    from shim_adapters.evaluation.asap import run_asap

    grammar = builtin_grammar("binary5")
    spec = get_backend(backend)
    masker = spec.compile(grammar, shipped_lm.tokenizer, shipped_lm.vocab_size)
    pre = prefill(shipped_lm, grammar.default_prompt)
    batch = sample(pre, 8, masker=masker, max_new_tokens=8,
                   generator=torch.Generator().manual_seed(0))
    acceptor = reference_acceptor(grammar)
    assert all(batch.finished)
    assert all(acceptor.accepts(s.text()) for s in batch.states)
    run = run_asap(pre, masker, 5, max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    assert run.trie.n_samples == 5 and run.trie.efg([]) < 1.0


def test_cutting_hopeless_draws_keeps_the_valid_ones(shipped_lm):
    """Stopping a draw at the first token the masker refuses changes no valid draw."""
    grammar = builtin_grammar("bv4")
    masker = get_backend("xgrammar").compile(grammar, shipped_lm.tokenizer, shipped_lm.vocab_size)
    pre = prefill(shipped_lm, grammar.default_prompt)
    full = draw_lm_samples(pre, grammar, 48, max_new_tokens=96, batch_size=48,
                           generator=torch.Generator().manual_seed(5))
    cut = draw_lm_samples(pre, grammar, 48, max_new_tokens=96, batch_size=48,
                          generator=torch.Generator().manual_seed(5), cut_by=masker)
    assert cut.valid.tolist() == full.valid.tolist()
    assert [t for t, v in zip(cut.token_ids, cut.valid) if v] == \
        [t for t, v in zip(full.token_ids, full.valid) if v]
    assert cut.cut.any() and not (cut.cut & cut.valid).any()
    for toks, was_cut in zip(cut.token_ids, cut.cut):
        if was_cut:  # the last token is the one the masker refused
            state = masker.new_state()
            for t in toks[:-1]:
                state.advance(t)
            assert not state.allowed_mask()[toks[-1]]
