"""Top-ups: a fit not trusted only because its held-out evidence is thin draws more, up to a cap.

Shipped LM, XGrammar, the built-in bv4 grammar. The thin-evidence regime is forced with a high
``min_target_samples`` (the floor on the held-out target ESS), as a rarely-valid LM forces it
with the default floor; the pooled set's target weights are checked against the proposals the
completions were really drawn from.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.shim.artefact import load_controller
from shim_adapters.shim.fitting import (
    FitRecipe,
    fit_controller,
    fit_with_recipe,
    topup_stalled,
)
from shim_adapters.shim.targets import (
    effective_sample_size,
    masked_row_logprob,
    mixture_target_weights,
    shim_row_logprob,
    target_weights,
)
from shim_adapters.shim.training_data import concat_training_data, sample_training_data

torch.set_num_threads(1)
FAST = dict(n_splits=3, reg_grid=(1.0,))


@pytest.fixture(scope="module")
def bv4(shipped_lm):
    return get_backend("xgrammar").compile(builtin_grammar("bv4"), shipped_lm.tokenizer,
                                           shipped_lm.vocab_size)


@pytest.fixture(scope="module")
def thin_fit(shipped_lm, bv4, tmp_path_factory):
    """A floor no pool can reach, with the stall rule off: the fit tops up until the cap is
    spent."""
    out = tmp_path_factory.mktemp("thin")
    recipe = FitRecipe(n_samples=40, max_samples=100, progress=False, topup_stall_margin=None,
                       controller_params=dict(min_target_samples=1e9, **FAST))
    c, manifest = fit_with_recipe(shipped_lm, bv4, recipe, output_dir=out)
    return c, manifest, out


def test_thin_evidence_tops_up_from_the_untrusted_fit_until_the_cap(thin_fit):
    c, manifest, _ = thin_fit
    t = manifest["training"]
    rounds = t["rounds"]
    assert [r["kind"] for r in rounds] == ["first draw", "top-up", "top-up"]
    assert [r["lm_samples"] for r in rounds] == [40, 40, 20]  # the last one fills the cap
    assert t["lm_samples_total"] == 100 == t["max_samples"] == t["data_n_samples"]
    for before, after in zip(rounds, rounds[1:]):
        # each top-up draws from masking mixed with the previous fit at its best held-out β
        assert after["proposal"] == "shim" and after["proposal_defensive"] == 0.5
        assert after["proposal_beta"] == before["heldout_best_beta"] > 0
        assert after["heldout_ess_before"] == before["heldout_effective_samples"]
        assert after["heldout_ess_after"] == after["heldout_effective_samples"]
        assert after["forward_tokens"] > 0 and "below the floor" in after["reason"]
        assert 0 < after["heldout_ess_own_ratio"] <= after["lm_samples_total"]
    # more evidence: the pooled held-out ESS grew with every top-up
    ess = [r["heldout_effective_samples"] for r in rounds]
    assert all(b > a for a, b in zip(ess, ess[1:])), ess
    # never worse than masking: still untrusted at the end, so β = 0 and it says why
    assert c.falls_back_to_masking_ and c.beta_ == 0.0
    assert c.fallback_reason_ == "low_target_samples"
    assert t["fallback_reason"] == "low_target_samples"
    assert t["data_sampling"]["proposal"] == "masked+shim"
    # P(L) from all 100 samples agrees with round 1's masked estimate (the LM is valid ~half
    # the time on this prompt)
    assert abs(t["p_valid_estimate_pooled"] - t["p_valid_estimate"]) < 0.15
    assert 0.3 < t["p_valid_estimate_pooled"] < 0.8


def test_top_ups_that_cannot_reach_the_floor_stop_after_the_first(shipped_lm, bv4):
    # the same unreachable floor with the stall rule on (the default): the first top-up shows
    # how fast the evidence grows, and at twice that rate the cap is nowhere near the floor
    c, manifest = fit_controller(shipped_lm, bv4, n_samples=40, max_samples=100,
                                 progress=False, min_target_samples=1e9, **FAST)
    t = manifest["training"]
    assert [r["kind"] for r in t["rounds"]] == ["first draw", "top-up"]
    assert t["lm_samples_total"] == 80 < t["max_samples"] == 100
    assert t["rounds"][-1]["stalled"].startswith("stalled: held-out ESS")
    assert "short of 1e+09" in t["rounds"][-1]["stalled"]
    assert c.falls_back_to_masking_ and c.fallback_reason_ == "low_target_samples"


def _topup(before: float, after: float, drawn: int, total: int) -> dict:
    return {"heldout_ess_before": before, "heldout_ess_after": after, "lm_samples": drawn,
            "lm_samples_total": total}


@pytest.mark.parametrize("before, after, floor, band, stalled", [
    (1.98, 1.91, 10, 1.0, True),    # no growth: SLIA name-combine-2-long-repeat's first top-up
    (3.43, 6.69, 10, 1.0, False),   # 3.3 per 300 samples, doubled over 400 more: reaches 10
    (3.43, 5.00, 10, 1.0, True),    # 1.6 per 300, doubled over 400: 9.2, short of 10
    (12.0, 13.0, 10, 2.0, True),    # inside the band: the band's top (20) is what is sought
    (12.0, 16.0, 10, 2.0, False),
])
def test_a_top_up_stalls_when_twice_its_growth_cannot_reach_what_is_sought(
        before, after, floor, band, stalled):
    recipe = FitRecipe(evidence_band=band)
    reason = topup_stalled(_topup(before, after, 300, 600), floor, recipe, cap=1000)
    assert (reason is not None) == stalled, reason
    # without the rule nothing stalls
    off = FitRecipe(evidence_band=band, topup_stall_margin=None)
    assert topup_stalled(_topup(before, after, 300, 600), floor, off, cap=1000) is None


def test_a_stall_margin_must_be_positive():
    with pytest.raises(ValueError, match="topup_stall_margin must be > 0"):
        FitRecipe(topup_stall_margin=0.0)


def test_the_top_up_record_round_trips_through_the_artefact(thin_fit, bv4, shipped_lm):
    c, manifest, out = thin_fit
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["training"]["rounds"] == json.loads(json.dumps(manifest["training"]["rounds"]))
    loaded, loaded_manifest = load_controller(out, bv4, shipped_lm)
    assert loaded_manifest["training"]["lm_samples_total"] == 100
    assert loaded.beta_ == c.beta_ == 0.0


def test_top_ups_stop_as_soon_as_the_criterion_can_decide(shipped_lm, bv4):
    # round 1's 40 masked rollouts give a held-out ESS of ~30: below 50, one top-up lifts it
    c, manifest = fit_controller(shipped_lm, bv4, n_samples=40, max_samples=400,
                                 progress=False, min_target_samples=50, **FAST)
    rounds = manifest["training"]["rounds"]
    assert rounds[0]["fallback_reason"] == "low_target_samples"
    assert rounds[-1]["heldout_effective_samples"] >= 50
    assert rounds[-1]["fallback_reason"] != "low_target_samples"
    assert manifest["training"]["lm_samples_total"] < 400
    assert c.fallback_reason_ != "low_target_samples"
    assert c.falls_back_to_masking_ == (c.beta_ == 0.0)


def test_no_gain_is_a_decision_and_spends_nothing_more(shipped_lm, bv4):
    # enough evidence, but a gain threshold no fit can pass: the fit falls back for want of
    # gain, which more samples would not change
    c, manifest = fit_controller(shipped_lm, bv4, n_samples=40, max_samples=400,
                                 progress=False, min_gain_se=1e6, **FAST)
    assert c.fallback_reason_ == "no_gain" and c.beta_ == 0.0
    assert [r["kind"] for r in manifest["training"]["rounds"]] == ["first draw"]
    assert manifest["training"]["lm_samples_total"] == 40


def test_untrusted_candidate_scores_at_the_best_beta_and_leaves_the_fit_alone(thin_fit,
                                                                           pooled):
    from shim_adapters.shim.correction import ShimAdjuster

    c, _, _ = thin_fit
    cand = c.untrusted_candidate()
    assert cand.beta_ == c.heldout_best_beta_ > 0 and c.beta_ == 0.0
    assert c.falls_back_to_masking_ and not cand.falls_back_to_masking_
    assert "untrusted" in cand.decision_ and "not trusted" in c.decision_
    assert ShimAdjuster(cand).cache is not ShimAdjuster(c).cache  # no shared β=0 values
    masked = pooled[0]
    states = [masked.states[masked.row_state[r]] for r in range(masked.n_rows)]
    served = [c.state_log_gamma(s)[1] for s in states]
    drawn = [cand.state_log_gamma(s)[1] for s in states]
    assert all(np.all(v == 0.0) for v in served)  # the fit itself still serves masking
    assert any(np.any(v != 0.0) for v in drawn)


@pytest.fixture(scope="module")
def pooled(shipped_lm, bv4):
    """40 masked rollouts, a fit on them, 40 completions from its defensive SHIM proposal."""
    from shim_adapters.shim.controller import make_controller
    from shim_adapters.shim.targets import make_targets

    prompt = bv4.grammar.default_prompt
    masked = sample_training_data(shipped_lm, bv4, prompt, 40, seed=1, progress=False,
                                  proposal="masked", max_new_tokens=64)
    t = make_targets("rollout", masked)
    c = make_controller("LR_FULL", beta_grid=(0.0, 1.0), **FAST).fit(
        masked, y=t.y, completion_weight=t.completion_weight)
    proposer = c.untrusted_candidate() if c.beta_ == 0 else c
    shim = sample_training_data(shipped_lm, bv4, prompt, 40, seed=2, progress=False,
                                proposal="shim", controller=proposer, defensive=0.5,
                                max_new_tokens=64)
    return masked, shim, proposer


def test_row_proposal_logprobs_are_recomputed_exactly_from_the_stored_rows(pooled):
    masked, shim, proposer = pooled
    np.testing.assert_allclose(masked_row_logprob(masked), masked.row_proposal_logprob,
                               atol=1e-5)
    # the SHIM proposal, rescored from the stored allowed sets, is what the sampler drew from
    np.testing.assert_allclose(shim_row_logprob(shim, proposer, 0.5), shim.row_proposal_logprob,
                               atol=1e-3)
    # ... and differs from masking where the correction moved mass
    assert np.max(np.abs(shim_row_logprob(shim, proposer, 0.5) - masked_row_logprob(shim))) > 0.01


def test_pooled_target_weights_use_every_proposal(pooled):
    masked, shim, proposer = pooled
    pool = concat_training_data([masked, shim])
    lq_mask = masked_row_logprob(pool)
    lq_shim = np.concatenate([shim_row_logprob(masked, proposer, 0.5),
                              shim_row_logprob(shim, proposer, 0.5)])
    w = mixture_target_weights(pool, [lq_mask, lq_shim], [40, 40])
    # by hand: p(x) / (q_mask(x)/2 + q_shim(x)/2), per completion
    per = lambda v: np.bincount(pool.row_completion, weights=v, minlength=80)  # noqa: E731
    lw = per(pool.row_lm_logprob.astype(np.float64)) - np.logaddexp(
        per(lq_mask), per(lq_shim)) + np.log(2)
    lw[~pool.valid] = -np.inf
    np.testing.assert_allclose(w, np.exp(lw - lw.max()), rtol=1e-9)
    unscaled = mixture_target_weights(pool, [lq_mask, lq_shim], [40, 40], scaled=False)
    np.testing.assert_allclose(unscaled, np.where(pool.valid, np.exp(lw), 0.0), rtol=1e-9)
    # one proposal: the balance heuristic is each completion's own ratio
    np.testing.assert_allclose(mixture_target_weights(masked, [masked_row_logprob(masked)],
                                                      [40]), target_weights(masked), rtol=1e-6)
    # own-ratio weights of the pool are the other consistent choice; the balance heuristic's
    # are bounded by the better proposal's ratio, so the pooled ESS is at least as large here
    assert effective_sample_size(w) >= effective_sample_size(target_weights(pool))
    with pytest.raises(ValueError, match="add up to 70 completions but the pool holds 80"):
        mixture_target_weights(pool, [lq_mask, lq_shim], [40, 30])


def test_a_masking_only_source_tops_up_with_masked_rollouts(shipped_lm, bv4):
    """An engine samples masking only (``draws_controllers`` False): the top-ups still run,
    drawing masked rollouts, and the controller is never asked to propose."""
    from shim_adapters.shim.fitting import InProcessRollouts, prepare_prompt, run_recipe

    recipe = FitRecipe(n_samples=30, max_samples=70, target="rollout", progress=False,
                       stop_at_newline=False, seed=4, topup_stall_margin=None,
                       controller_params=dict(FAST, min_target_samples=1e9))
    prepared = prepare_prompt(shipped_lm, bv4, bv4.grammar.default_prompt, recipe)
    source = InProcessRollouts(prepared.lm, bv4, prepared.prefilled, progress=False)
    asked = []

    class MaskingOnly:
        draws_controllers = False

        def draw(self, n, proposal, seed, controller=None, defensive=0.0):
            asked.append((proposal, controller, defensive))
            return source.draw(n, proposal, seed, controller, defensive)

    training: dict = {}
    c = run_recipe(MaskingOnly(), recipe, training)
    assert [r["kind"] for r in training["rounds"]] == ["first draw", "top-up", "top-up"]
    assert [r["lm_samples"] for r in training["rounds"]] == [30, 30, 10]
    assert asked == [("masked", None, 0.0)] * 3
    assert all(r["proposal"] == "masked" for r in training["rounds"])
    assert all(r["proposal_beta"] is None for r in training["rounds"][1:])
    assert training["lm_samples_total"] == 70 and c.falls_back_to_masking_
