"""The sampling engine: what it records is exactly what teacher forcing says, for every proposal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.exact_distribution import enumerate_language
from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.sampling import prefill, sample
from shim_adapters.shim.controller import LR_FULL
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.targets import importance_labels, make_targets, target_weights
from shim_adapters.shim.training_data import concat_training_data, sample_training_data

torch.set_num_threads(1)
FAST = dict(n_splits=3, reg_grid=(0.1, 1.0, 10.0))


@pytest.fixture(scope="module")
def binary5(shipped_lm):
    return get_backend("xgrammar").compile(builtin_grammar("binary5"), shipped_lm.tokenizer,
                                           shipped_lm.vocab_size)


@pytest.fixture(scope="module")
def pre(shipped_lm, binary5):
    return prefill(shipped_lm, binary5.grammar.default_prompt)


@pytest.fixture(scope="module")
def masked(shipped_lm, binary5):
    return sample_training_data(shipped_lm, binary5, binary5.grammar.default_prompt, 400,
                                seed=5, progress=False, proposal="masked")


@pytest.fixture(scope="module")
def controller(masked):
    t = make_targets("rollout", masked)
    return LR_FULL(**FAST).fit(t.data, y=t.y, completion_weight=t.completion_weight)


def test_recorded_proposal_logprobs_equal_teacher_forcing(pre, binary5, controller):
    adjuster = ShimAdjuster(controller)
    for adj in (None, adjuster):
        got = sample(pre, 24, masker=binary5, adjuster=adj, max_new_tokens=12,
                     generator=torch.Generator().manual_seed(1), batch_size=10)
        assert got.n == 24 and all(got.finished)
        scored = score_sequences(pre, got.token_ids, binary5, {"q": adj})
        np.testing.assert_allclose(got.total_proposal_logprob(), scored.methods["q"],
                                   atol=1e-4)
        np.testing.assert_allclose(got.total_lm_logprob(), scored.lm, atol=1e-4)
        # masking's proposal is the LM renormalised over the allowed set: log q = log p - log Z
        if adj is None:
            for lp, lq, lz in zip(got.lm_logprobs, got.proposal_logprobs,
                                  got.log_allowed_mass):
                np.testing.assert_allclose(np.array(lp) - np.array(lz), lq, atol=1e-5)


def test_forward_tokens_count_the_work_done(pre, binary5):
    got = sample(pre, 30, masker=binary5, max_new_tokens=12, batch_size=30,
                 generator=torch.Generator().manual_seed(2))
    # finished rows leave the batch: one LM position per generated token (the last token of a
    # row is sampled from the position before it, so it costs nothing more)
    assert got.forward_tokens == sum(len(t) for t in got.token_ids)


def test_defensive_mixture_bounds_every_importance_ratio(pre, binary5, controller):
    alpha = 0.3
    got = sample(pre, 40, masker=binary5, adjuster=ShimAdjuster(controller), defensive=alpha,
                 max_new_tokens=12, generator=torch.Generator().manual_seed(3))
    for lp, lq, lz in zip(got.lm_logprobs, got.proposal_logprobs, got.log_allowed_mass):
        # q >= alpha * p / Z, i.e. p / q <= Z / alpha, at every step
        assert np.all(np.array(lp) - np.array(lq) <= np.array(lz) - np.log(alpha) + 1e-5)


def test_watched_unconstrained_rows_stop_at_the_first_refusal(shipped_lm, binary5, pre):
    got = sample(pre, 64, watch=binary5, max_new_tokens=12,
                 generator=torch.Generator().manual_seed(4))
    assert any(got.cut) and not any(f and c for f, c in zip(got.finished, got.cut))
    for toks, was_cut in zip(got.token_ids, got.cut):
        state = binary5.new_state()
        for t in toks[:-1]:
            state.advance(t)  # every token before the last was allowed
        if was_cut:  # ... and the last one is the refusal the row stopped at
            assert not state.allowed_mask()[toks[-1]]


def test_importance_labels_of_shim_rollouts_are_unbiased(shipped_lm, binary5, controller):
    """Rows drawn from SHIM carry ∏ p/q of their suffix: the mean label of the first token
    equals V(t) = P(valid | t) computed exactly over the whole language."""
    data = sample_training_data(shipped_lm, binary5, binary5.grammar.default_prompt, 600,
                                seed=9, progress=False, proposal="shim", controller=controller,
                                defensive=0.5)
    assert data.valid.all() and data.manifest["sampling"]["proposal"] == "shim"
    exact = enumerate_language(shipped_lm, binary5, binary5.grammar.default_prompt)
    y, clipped = importance_labels(data)
    first = data.row_step == 0
    lm_p = np.exp(exact.lm_logprob)
    checked = 0
    for tok in np.unique(data.row_token[first]):
        rows = first & (data.row_token == tok)
        if rows.sum() < 80:
            continue
        starts = np.array([s[0] == tok for s in exact.sequences])
        v_exact = lm_p[starts].sum() / np.exp(data.row_lm_logprob[rows][0])
        se = y[rows].std() / np.sqrt(rows.sum())
        assert abs(y[rows].mean() - v_exact) < 4 * se + 0.02 + clipped, (tok, v_exact)
        checked += 1
    assert checked >= 1


def test_pooled_rounds_keep_each_proposals_weights(shipped_lm, binary5, masked, controller):
    shim = sample_training_data(shipped_lm, binary5, binary5.grammar.default_prompt, 50,
                                seed=11, progress=False, proposal="shim", controller=controller)
    pool = concat_training_data([masked, shim])
    assert pool.n_completions == masked.n_completions + shim.n_completions
    assert pool.n_rows == masked.n_rows + shim.n_rows
    assert pool.manifest["sampling"]["proposal"] == "masked+shim"
    # labels and raw weights are per completion: pooling changes none of them
    y_pool, _ = importance_labels(pool)
    np.testing.assert_allclose(y_pool[:masked.n_rows], importance_labels(masked)[0])
    # raw weights p/q share one scale across proposals: their ratios survive pooling
    w, wm = target_weights(pool), target_weights(masked)
    np.testing.assert_allclose(w[:masked.n_completions] / w[0], wm / wm[0], rtol=1e-6)
    for i in (0, masked.n_completions - 1, pool.n_completions - 1):
        assert pool.completion_tokens(i).tolist() == (
            masked.completion_tokens(i) if i < masked.n_completions
            else shim.completion_tokens(i - masked.n_completions)).tolist()
    # rows point at the right states after the state tables were merged
    r = masked.n_rows + 3
    assert pool.states[pool.row_state[r]] == shim.states[shim.row_state[3]]
