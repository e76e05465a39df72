"""Soft training targets (masked rollouts, bootstrapping) and the never-worse-than-masking rule."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.exact_distribution import enumerate_language, sequence_logprobs
from shim_adapters.grammars.grammar import Grammar, builtin_grammar
from shim_adapters.shim.controller import LR_FULL, LR_NT
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.fitting import fit_controller
from shim_adapters.shim.targets import make_targets, next_value, rollout_labels, target_weights
from shim_adapters.shim.training_data import sample_training_data

torch.set_num_threads(1)
BACKEND = "xgrammar"
FAST = dict(n_splits=3, reg_grid=(0.1, 1.0, 10.0))


@pytest.fixture(scope="module")
def binary5(shipped_lm):
    return get_backend(BACKEND).compile(builtin_grammar("binary5"), shipped_lm.tokenizer,
                                        shipped_lm.vocab_size)


@pytest.fixture(scope="module")
def masked(shipped_lm, binary5):
    return sample_training_data(shipped_lm, binary5, binary5.grammar.default_prompt, 400,
                                seed=5, progress=False, proposal="masked")


@pytest.fixture(scope="module")
def exact(shipped_lm, binary5):
    return enumerate_language(shipped_lm, binary5, binary5.grammar.default_prompt)


def test_masked_samples_are_valid_and_every_row_gets_a_soft_label(masked):
    assert masked.manifest["sampling"]["proposal"] == "masked"
    assert masked.valid.all() and masked.cut_step.max() == -1
    y = rollout_labels(masked)
    assert np.all((y > 0) & (y <= 1))
    eos = np.isin(masked.row_token, masked.manifest["eos_token_ids"])
    assert np.all(y[eos] == 1.0) and eos.sum() == masked.n_completions
    # against a plain loop: product of Z over the later steps of the same completion
    for r in range(0, masked.n_rows, 97):
        same = (masked.row_completion == masked.row_completion[r]) & \
               (masked.row_step > masked.row_step[r])
        assert y[r] == pytest.approx(np.exp(masked.row_log_z[same].astype(float).sum()),
                                     rel=1e-5)


def test_rollout_label_is_unbiased_for_future_validity(masked, exact):
    """Mean soft label of the first step's token equals V(t) = P(valid | t) computed exactly."""
    y = rollout_labels(masked)
    first = masked.row_step == 0
    lm_p = np.exp(exact.lm_logprob)
    for tok in np.unique(masked.row_token[first]):
        rows = first & (masked.row_token == tok)
        if rows.sum() < 60:
            continue
        starts = np.array([s[0] == tok for s in exact.sequences])
        p_tok = np.exp(masked.row_lm_logprob[rows][0])
        v_exact = lm_p[starts].sum() / p_tok
        se = y[rows].std() / np.sqrt(rows.sum())
        assert abs(y[rows].mean() - v_exact) < 4 * se + 1e-3, (tok, y[rows].mean(), v_exact)


def test_importance_weights_of_masked_samples_recover_the_target(masked, exact):
    w = target_weights(masked)
    assert w.max() == pytest.approx(1.0) and np.all(w > 0)
    est: dict[str, float] = {}
    for text, wi in zip(masked.texts, w / w.sum()):
        est[text] = est.get(text, 0.0) + wi
    target = exact.by_string(exact.target())
    masking = exact.by_string(exact.method("masking"))
    tv = 0.5 * sum(abs(target[s] - est.get(s, 0.0)) for s in target)
    tv_masking = 0.5 * sum(abs(target[s] - masking[s]) for s in target)
    assert tv < 0.15 < 0.3 < tv_masking


def test_bootstrap_targets_regress_on_the_next_step(masked):
    t = make_targets("bootstrap", masked, lambda: LR_NT(reg_grid=(1.0,), n_splits=2))
    y0 = rollout_labels(masked)
    assert np.all((t.y >= 0) & (t.y <= 1))
    eos = np.isin(masked.row_token, masked.manifest["eos_token_ids"])
    assert np.all(t.y[eos] == 1.0)
    assert not np.allclose(t.y[~eos], y0[~eos])
    # a controller that says γ̂ = 1 everywhere turns the target into the next step's Z
    one = LR_NT(reg_grid=(1.0,), n_splits=2).fit(masked, y=np.ones(masked.n_rows))
    v = next_value(one, masked, fallback=y0)
    order = np.lexsort((masked.row_step, masked.row_completion))
    r, nxt = order[0], order[1]
    assert masked.row_completion[r] == masked.row_completion[nxt]
    assert v[r] == pytest.approx(np.exp(masked.row_log_z[nxt]), rel=1e-3)


def test_targets_refuse_the_wrong_kind_of_data(shipped_lm, binary5, masked):
    lm_data = sample_training_data(shipped_lm, binary5, binary5.grammar.default_prompt, 20,
                                   seed=1, progress=False)
    with pytest.raises(ValueError, match="masked or SHIM completions"):
        make_targets("rollout", lm_data)
    with pytest.raises(ValueError, match="unconstrained"):
        make_targets("final", masked)
    with pytest.raises(ValueError, match="make_controller"):
        make_targets("bootstrap", masked)
    with pytest.raises(ValueError, match="final, rollout, bootstrap"):
        make_targets("td", masked)


def test_rollout_target_beats_masking_on_binary5(shipped_lm, binary5, masked, exact):
    c, manifest = fit_controller(shipped_lm, binary5, kind="LR_FULL", data=masked,
                                 target="rollout", **FAST)
    assert not c.falls_back_to_masking_ and c.beta_ > 0
    train = manifest["training"]
    assert train["target"] == "rollout"
    assert train["heldout_score_chosen"] > train["heldout_score_masking"]
    assert train["heldout_kl_gain"] > train["heldout_kl_gain_se"] > 0
    kl = enumerate_language(shipped_lm, binary5, binary5.grammar.default_prompt,
                            {"shim": ShimAdjuster(c)})
    assert kl.kl("shim") < 0.2 * kl.kl("masking")


def test_falls_back_to_masking_where_masking_is_already_exact(shipped_lm, caplog):
    """Only the first token decides validity (it must be '1'); after it every continuation is
    in L, so Z = 1 at every later step and masking samples the target exactly."""
    grammar = Grammar(r"1[\s\S]*", "regex", name="first-token-decides")
    masker = get_backend(BACKEND).compile(grammar, shipped_lm.tokenizer, shipped_lm.vocab_size)
    prompt = builtin_grammar("binary5").default_prompt
    data = sample_training_data(shipped_lm, masker, prompt, 200, seed=2, progress=False)
    assert 0.05 < data.valid.mean() < 0.95  # the LM does make mistakes here
    valid = [list(data.completion_tokens(i)) for i in np.flatnonzero(data.valid)[:20]]
    gap = sequence_logprobs(shipped_lm, prompt, valid, masker) - \
        sequence_logprobs(shipped_lm, prompt, valid)
    assert np.ptp(gap) < 1e-4  # q_mask(x) = p(x)/Z(root) for every x: masking is exact
    with caplog.at_level(logging.WARNING, logger="shim_adapters.shim.controller"):
        c, manifest = fit_controller(shipped_lm, masker, prompt, kind="LR_FULL", data=data,
                                     **FAST)
    assert c.beta_ == 0.0 and c.falls_back_to_masking_
    assert "correction does not help" in c.decision_ and "falling back to β=0" in c.decision_
    assert any("falling back to β=0" in r.getMessage() for r in caplog.records)
    train = manifest["training"]
    assert train["falls_back_to_masking"] is True
    assert train["heldout_score_chosen"] == train["heldout_score_masking"]
    assert np.isfinite(train["heldout_score_masking"])
    state = masker.new_state()
    state.advance(int(data.completion_tokens(int(np.flatnonzero(data.valid)[0]))[0]))
    assert np.all(c.predict_log_gamma(state.features(), state.allowed_token_ids()) == 0.0)


def test_too_few_target_samples_fall_back_to_masking(shipped_lm, binary5):
    """With three valid completions the held-out gain and its SE mean nothing (one valid
    completion has SE 0): the fit must not trust them."""
    data = sample_training_data(shipped_lm, binary5, binary5.grammar.default_prompt, 120,
                                seed=7, progress=False)
    keep = np.concatenate([np.flatnonzero(~data.valid), np.flatnonzero(data.valid)[:3]])
    few = data.subset(np.sort(keep))
    assert int(few.valid.sum()) == 3
    c = LR_FULL(**FAST).fit(few)
    assert c.falls_back_to_masking_ and c.beta_ == 0.0
    assert c.heldout_effective_samples_ == pytest.approx(3.0)
    assert "only 3 effective held-out target samples" in c.decision_
    trusting = LR_FULL(**FAST, min_target_samples=1).fit(few)
    assert "effective held-out target samples" not in trusting.decision_
