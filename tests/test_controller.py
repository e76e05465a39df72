"""Controllers: estimator shape, vectorised scoring, soft labels, β selection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.shim.controller import CONTROLLERS, LR_FULL, LR_NT, MLP, make_controller
from shim_adapters.shim.fitting import fit_controller
from shim_adapters.shim.training_data import sample_training_data

torch.set_num_threads(1)
BV4_BACKEND = "syncode"
FAST = dict(n_splits=2)


@pytest.fixture(scope="module")
def masker(lm):
    return get_backend(BV4_BACKEND).compile(builtin_grammar("bv4"), lm.tokenizer, lm.vocab_size)


@pytest.fixture(scope="module")
def data(lm, masker):
    return sample_training_data(lm, masker, masker.grammar.default_prompt, 160,
                                max_new_tokens=96, seed=1, progress=False)


@pytest.fixture(scope="module")
def fitted(data):
    return {kind: make_controller(kind, **FAST, **({"epochs": 10} if kind == "MLP" else {}))
            .fit(data) for kind in CONTROLLERS}


def _visited_states(masker, data, n=12):
    """Masker states along a few sampled completions (real states, real allowed sets)."""
    out = []
    for i in np.flatnonzero(data.valid)[:3]:
        state = masker.new_state()
        for t in data.completion_tokens(i):
            out.append(state.fork())
            state.advance(int(t))
    return out[:n]


def test_estimator_shape(fitted):
    for kind, c in fitted.items():
        assert c.kind == kind
        params = c.get_params()
        assert "reg_grid" in params and "beta_grid" in params
        for attr in ("encoder_", "weights_", "beta_", "reg_", "cv_log_loss_", "fit_seconds_"):
            assert hasattr(c, attr), (kind, attr)
        assert c.beta_ in c.beta_grid and c.reg_ in c.reg_grid
        assert 0 < c.cv_log_loss_ < np.log(2) + 0.2
        assert sum(b["count"] for b in c.cv_reliability_) == c.n_rows_


def test_unfitted_controller_has_no_learned_attributes():
    c = LR_FULL(reg_grid=(0.5,))
    assert not hasattr(c, "weights_") and c.reg_grid == (0.5,)


@pytest.mark.parametrize("kind", list(CONTROLLERS))
def test_vectorised_scoring_equals_row_by_row(fitted, masker, data, kind):
    c = fitted[kind]
    states = _visited_states(masker, data)
    batch = c.predict_log_gamma_batch([s.features() for s in states],
                                      [s.allowed_token_ids() for s in states])
    for s, b in zip(states, batch):
        allowed = s.allowed_token_ids()
        vec = c.predict_log_gamma(s.features(), allowed)
        row = c.predict_log_gamma_rowwise(s.features(), allowed)
        np.testing.assert_allclose(vec, row, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(vec, b, rtol=1e-6, atol=1e-6)
        assert np.all(vec <= 0) and np.all(np.isfinite(vec))


def test_predict_proba_matches_log_gamma(fitted, masker, data):
    c = fitted["LR_FULL"]
    s = _visited_states(masker, data)[2]
    allowed = s.allowed_token_ids()
    proba = c.predict_proba([(s.features(), int(t)) for t in allowed])
    assert proba.shape == (len(allowed), 2)
    np.testing.assert_allclose(proba.sum(axis=1), 1.0)
    raw = c.predict_log_gamma(s.features(), allowed, damped=False)
    keep = ~np.isin(allowed, list(masker.eos_token_ids))
    np.testing.assert_allclose(np.log(proba[keep, 1]), raw[keep], rtol=1e-5, atol=1e-5)


def test_token_only_lr_ranks_tokens_the_same_in_every_state(fitted, masker, data):
    states = _visited_states(masker, data)
    candidates = np.unique(np.concatenate([s.allowed_token_ids() for s in states]))
    nt = [fitted["LR_NT"].predict_log_gamma(s.features(), candidates, damped=False)
          for s in states]
    assert all(np.allclose(nt[0], v) for v in nt)
    full = [fitted["LR_FULL"].predict_log_gamma(s.features(), candidates, damped=False)
            for s in states]
    # with state features + crosses the contrast between tokens changes with the state
    contrasts = [v - v.mean() for v in full]
    assert any(not np.allclose(contrasts[0], v, atol=1e-3) for v in contrasts)


def test_eos_is_never_reweighted(fitted, masker, data):
    i = int(np.flatnonzero(data.valid)[0])
    state = masker.new_state()
    for t in data.completion_tokens(i)[:-1]:
        state.advance(int(t))
    assert state.eos_allowed()
    allowed = state.allowed_token_ids()
    eos = np.isin(allowed, list(masker.eos_token_ids))
    for c in fitted.values():
        assert np.all(c.predict_log_gamma(state.features(), allowed)[eos] == 0.0)


def test_soft_labels_are_accepted_and_used(data):
    y = np.clip(data.row_label * 0.8 + 0.1, 0, 1)
    hard = LR_NT(reg_grid=(1.0,), n_splits=2).fit(data)
    soft = LR_NT(reg_grid=(1.0,), n_splits=2).fit(data, y=y)
    assert not np.allclose(hard.weights_["embed"], soft.weights_["embed"])
    mlp = MLP(reg_grid=(1e-3,), n_splits=2, epochs=2).fit(data, y=y)
    assert np.isfinite(mlp.cv_log_loss_)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        LR_NT().fit(data, y=y + 1)
    with pytest.raises(ValueError, match="one label per row"):
        LR_NT().fit(data, y=y[:-1])


def test_damping_beta_zero_is_plain_masking(data, masker):
    c = LR_FULL(reg_grid=(1.0,), beta_grid=(0.0,), n_splits=2).fit(data)
    s = _visited_states(masker, data)[3]
    assert np.all(c.predict_log_gamma(s.features(), s.allowed_token_ids()) == 0.0)


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="LR_NT, LR_FULL, MLP"):
        make_controller("SVM")


def test_fit_controller_returns_a_manifest(lm, masker, data):
    c, manifest = fit_controller(lm, masker, kind="LR_NT", data=data, reg_grid=(1.0,),
                                 n_splits=2)
    assert isinstance(c, LR_NT)
    assert manifest["grammar_sha256"] == masker.grammar.sha256
    assert manifest["controller"]["kind"] == "LR_NT"
    assert manifest["training"]["data_n_samples"] == data.n_completions
    assert manifest["prompt"] == masker.grammar.default_prompt
