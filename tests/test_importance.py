"""Exact-target mode: importance weights, ESS, SIR and IMH against the exact binary5 target."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.exact_distribution import enumerate_language
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.evaluation.importance import (
    effective_sample_size,
    exact_samples,
    imh_chain,
    log_importance_weights,
    sir_indices,
)

torch.set_num_threads(1)


def test_effective_sample_size_hand_cases():
    assert effective_sample_size(np.log([1.0, 1.0, 2.0])) == pytest.approx(16 / 6)
    assert effective_sample_size(np.array([0.0, 0.0, np.log(2.0), -np.inf])) == pytest.approx(16 / 6)
    assert effective_sample_size(np.full(7, -3.2)) == pytest.approx(7.0)
    assert effective_sample_size(np.array([-np.inf, -np.inf])) == 0.0
    # scale-free: huge log-weights do not overflow
    assert effective_sample_size(np.log([1.0, 3.0]) + 5000.0) == pytest.approx(16 / 10)


def test_weights_are_zero_off_the_language():
    lw = log_importance_weights(np.array([-1.0, -2.0, -3.0]), np.array([-2.0, -2.0, -np.inf]),
                                np.array([True, False, True]))
    assert lw[0] == pytest.approx(1.0) and lw[1] == -np.inf and lw[2] == -np.inf


def test_resampling_and_chain_hand_cases():
    rng = np.random.default_rng(0)
    assert set(sir_indices(np.array([-np.inf, 0.0, -np.inf]), 50, rng)) == {1}
    chain, rate = imh_chain(np.zeros(5), rng)  # equal weights: every move is accepted
    assert chain.tolist() == [0, 1, 2, 3, 4] and rate == 1.0
    chain, rate = imh_chain(np.array([-np.inf, 0.0, -np.inf, 0.0]), rng)
    assert chain.tolist() == [1, 1, 3] and rate == 0.5
    with pytest.raises(ValueError, match="weight 0"):
        imh_chain(np.array([-np.inf]), rng)


@pytest.fixture(scope="module")
def binary5(shipped_lm):
    masker = get_backend("xgrammar").compile(builtin_grammar("binary5"), shipped_lm.tokenizer,
                                             shipped_lm.vocab_size)
    return masker, enumerate_language(shipped_lm, masker, masker.grammar.default_prompt)


def _tv(target: dict[str, float], texts: list[str]) -> float:
    counts: dict[str, float] = {}
    for t in texts:
        counts[t] = counts.get(t, 0.0) + 1.0 / len(texts)
    assert set(counts) <= set(target)
    return 0.5 * sum(abs(p - counts.get(s, 0.0)) for s, p in target.items())


@pytest.mark.parametrize("method", ["sir", "imh"])
def test_exact_samples_approach_the_exact_target(shipped_lm, binary5, method):
    masker, exact = binary5
    target = exact.by_string(exact.target())
    masking = exact.by_string(exact.method("masking"))
    tv_masking = 0.5 * sum(abs(target[s] - masking[s]) for s in target)
    out = exact_samples(shipped_lm, masker, None, masker.grammar.default_prompt, 1500, method,
                        seed=0)
    assert len(out.texts) == 1500 and out.n_proposals == 1500
    assert _tv(target, out.texts) < 0.1 < tv_masking  # masking alone is off by ~0.37
    # masking is a poor proposal here: the weights spread, ESS < number of proposals
    assert 0.3 * out.n_proposals < out.ess < 0.95 * out.n_proposals
    # the mean weight estimates the LM's probability of the language
    assert out.log_evidence == pytest.approx(np.logaddexp.reduce(exact.lm_logprob), abs=0.05)
    if method == "imh":
        assert 0.2 < out.acceptance_rate < 1.0


def test_bad_method_is_refused(shipped_lm, binary5):
    masker, _ = binary5
    with pytest.raises(ValueError, match="'sir' or 'imh'"):
        exact_samples(shipped_lm, masker, None, "x", 3, method="mcmc")
