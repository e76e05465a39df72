"""KL metrics on known answers: no LM needed, every number is computed by hand here."""

from __future__ import annotations

import math

import numpy as np
import pytest

from shim_adapters.evaluation.metrics import (bootstrap_kl, exact_kl, grouped_probabilities,
                                              kl_over_support, stability_curve, support_kl)

BINARY5 = ("10111", "10001", "10010", "11001", "10011", "11110", "10101", "11111", "11101",
           "00100", "11100", "11010", "10110", "00010", "11011", "10100", "11000")


def test_identical_distributions_have_zero_kl():
    lp = np.log([0.1, 0.2, 0.3, 0.4])
    assert kl_over_support(lp, lp) == pytest.approx(0.0, abs=1e-12)
    # renormalisation: constant offsets (the prompt, the invalid mass) do not matter
    assert kl_over_support(lp - 3.0, lp + 7.0) == pytest.approx(0.0, abs=1e-12)


def test_small_case_by_hand():
    # p = (1/2, 1/2), q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3)
    expected = 0.5 * math.log(2.0) + 0.5 * math.log(2.0 / 3.0)
    assert kl_over_support(np.log([0.5, 0.5]), np.log([0.25, 0.75])) == pytest.approx(expected)
    # q only known up to a constant: still the same after renormalisation over S
    assert kl_over_support(np.log([1.0, 1.0]), np.log([0.01, 0.03])) == pytest.approx(expected)
    # asymmetric: KL(q || p) differs
    assert kl_over_support(np.log([0.25, 0.75]), np.log([0.5, 0.5])) != pytest.approx(expected)


def test_method_with_no_mass_on_support_is_infinite():
    assert math.isinf(kl_over_support(np.log([0.5, 0.5]), np.array([0.0, -np.inf])))


def _masked_uniform_bits(language: tuple[str, ...]) -> dict[str, float]:
    """Masking a uniform-bit LM: at each prefix, the allowed next bits share the mass."""
    out = {}
    for s in language:
        q = 1.0
        for i in range(len(s)):
            allowed = {w[i] for w in language if w.startswith(s[:i])}
            q /= len(allowed)
        out[s] = q
    return out


def test_binary5_masking_distortion_closed_form():
    """docs/design.md: uniform bits, the 17-string language; masking gives each of the two
    strings that start with 0 probability 1/4 (first bit 0 w.p. 1/2, then one free choice)."""
    q = _masked_uniform_bits(BINARY5)
    assert q["00100"] == pytest.approx(0.25) and q["00010"] == pytest.approx(0.25)
    assert sum(q.values()) == pytest.approx(1.0)
    # the 15 strings starting with 1 share the other half: 10xxx has 8 strings, 11xxx has 7
    assert sum(v for s, v in q.items() if s.startswith("10")) == pytest.approx(0.25)
    target = np.full(len(BINARY5), -5 * math.log(2.0))  # every string has p = 1/32
    q_log = np.log([q[s] for s in BINARY5])
    by_hand = sum((1 / 17) * math.log((1 / 17) / q[s]) for s in BINARY5)
    assert exact_kl(target, q_log) == pytest.approx(by_hand, rel=1e-12)
    assert by_hand > 0.3  # a visible distortion, not a rounding error
    # the exact sampler (uniform over the language) has zero KL
    assert exact_kl(target, np.full(17, -math.log(17))) == pytest.approx(0.0, abs=1e-12)


def test_grouped_probabilities_sum_tokenisations():
    probs = grouped_probabilities(["ab", "ab", "c"], np.log([0.2, 0.3, 0.5]))
    assert probs == pytest.approx({"ab": 0.5, "c": 0.5})


def test_support_is_the_distinct_valid_draws():
    target = np.log([0.5, 0.3, 0.2])
    method = np.log([0.2, 0.3, 0.5])
    draws = np.array([0, -1, 0, 1, -1])  # sequence 2 never drawn: not in S
    expected = kl_over_support(target[:2], method[:2])
    assert support_kl(draws, target, method) == pytest.approx(expected)


def test_bootstrap_ci_contains_the_point_estimate():
    rng = np.random.default_rng(1)
    n_seq = 40
    target = np.log(rng.dirichlet(np.ones(n_seq)))
    method = target + rng.normal(0, 0.5, n_seq)
    draws = rng.choice(n_seq, size=300, p=np.exp(target))
    draws[rng.random(300) < 0.3] = -1  # invalid draws
    est = bootstrap_kl(draws, target, method, n_bootstrap=200, seed=0)
    assert est.ci_low <= est.kl <= est.ci_high
    assert est.ci_low < est.ci_high
    assert est.support_size == len(np.unique(draws[draws >= 0]))
    assert est.n_bootstrap == 200


def test_stability_curve_settles_to_the_full_support():
    rng = np.random.default_rng(2)
    target = np.log(rng.dirichlet(np.ones(30)))
    method = target + rng.normal(0, 0.3, 30)
    draws = rng.choice(30, size=500, p=np.exp(target))
    curve = stability_curve(draws, target, method, sizes=[20, 100, 500])
    assert [p["n_draws"] for p in curve] == [20, 100, 500]
    sizes = [p["support_size"] for p in curve]
    assert sizes == sorted(sizes)
    assert curve[-1]["kl"] == pytest.approx(support_kl(draws, target, method))


# ---- KL over the whole language (Monte-Carlo, unrenormalised) ------------------------------
from shim_adapters.evaluation.metrics import language_kl  # noqa: E402


def test_language_kl_is_zero_for_the_target_itself():
    lp = np.log([0.3, 0.2])  # P(L) = 0.5, p(·|G) = (0.6, 0.4)
    ids = np.array([0, 0, 0, 1, 1, -1, -1, -1, -1, -1])  # valid fraction 0.5, proportions 3:2
    est = language_kl(ids, lp, lp - math.log(0.5), reference_logprob=lp - math.log(0.5))
    assert est.kl == pytest.approx(0.0, abs=1e-12)
    assert est.diff == pytest.approx(0.0, abs=1e-12)
    assert (est.n_valid, est.n_draws) == (5, 10)


def test_language_kl_small_case_by_hand():
    # p(x1) = p(x2) = 1/4, P(L) = 1/2 (two of four draws valid): p(·|G) = (1/2, 1/2);
    # q = (3/4, 1/4): KL = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
    ids = np.array([0, 1, -1, -1])
    lp = np.log([0.25, 0.25])
    est = language_kl(ids, lp, np.log([0.75, 0.25]), n_bootstrap=50)
    assert est.kl == pytest.approx(0.5 * math.log(4.0 / 3.0))
    assert math.isnan(est.diff)
    # unlike the support KL, mass that q puts outside the sampled strings counts:
    # q = (0.1, 0.1) renormalises to the target over S, but loses 0.8 elsewhere
    assert kl_over_support(lp, np.log([0.1, 0.1])) == pytest.approx(0.0, abs=1e-12)
    assert language_kl(ids, lp, np.log([0.1, 0.1])).kl == pytest.approx(math.log(5.0))


def test_language_kl_estimates_the_exact_kl_and_its_difference():
    rng = np.random.default_rng(0)
    p = np.array([0.30, 0.15, 0.05])  # LM mass of three valid strings; the rest (0.5) invalid
    q_a = np.array([0.20, 0.30, 0.50])  # two methods' distributions over the language
    q_b = np.array([0.55, 0.30, 0.15])
    target = p / p.sum()
    exact_a = float(np.sum(target * np.log(target / q_a)))
    exact_b = float(np.sum(target * np.log(target / q_b)))
    draws = rng.choice(4, size=20000, p=np.append(p, 0.5))
    ids = np.where(draws == 3, -1, draws)
    est = language_kl(ids, np.log(p), np.log(q_a), reference_logprob=np.log(q_b),
                      n_bootstrap=200)
    assert est.kl == pytest.approx(exact_a, abs=0.02)
    # the 95% intervals are ~4 standard errors wide: the truth lies within one width
    assert abs(est.kl - exact_a) <= est.ci_high - est.ci_low
    assert est.diff == pytest.approx(exact_a - exact_b, abs=0.02)
    assert abs(est.diff - (exact_a - exact_b)) <= est.diff_ci_high - est.diff_ci_low
    assert est.diff_ci_high < 0 or est.diff_ci_low > 0  # the methods differ by 0.49 nats


def test_language_kl_is_infinite_when_the_method_refuses_a_valid_draw():
    est = language_kl(np.array([0, 1, -1]), np.log([0.3, 0.3]), np.array([0.0, -np.inf]))
    assert math.isinf(est.kl)
    with pytest.raises(ValueError, match="shape"):
        language_kl(np.array([0, 1]), np.log([0.3, 0.3]), np.log([0.5]))
