"""``fit_controller``: from an LM, a masker and a prompt to a fitted, checked SHIM controller.

The recipe depends on the regime, and the regime is measured, not guessed:

1. The prompt is rendered (``chat=True``: the LM's chat template) and prefilled once.
2. Where the answer ends: :func:`~shim_adapters.prompting.detect_line_answers` probes a few
   masked completions; one-line answers to few-shot prompts end at a newline (folded into EOS
   for every method alike). Recorded with its numbers.
3. The target (``target="auto"``): soft labels from masked rollouts, measured at least as
   good as the paper's final-validity labels where valid unconstrained draws are plentiful
   and far better where they are rare (see :func:`choose_target`). P(L), the LM's chance of
   producing a valid string unconstrained, is estimated from the rollouts (mean ∏ Z) and
   recorded with the reason.
4. Rounds (``rounds=K``, rollout target): the budget of ``n_samples`` LM samples is split over
   K rounds. Round 1 draws masked rollouts; each later round draws from the current controller
   (a defensive per-step mixture with masking by default), pools the rows of all rounds (every
   row keeps the importance ratio of its own proposal) and refits. A round is kept only when
   the refit beats the current controller on that round's fresh completions (importance-
   weighted held-out log-likelihood, > ``min_gain_se`` standard errors); else the current one
   stays. The never-worse-than-masking fallback of each fit is unchanged. Measured on the
   shipped LM (``reports/fast-rounds-*``, 600 samples): 3 rounds of 200 did not beat one round
   of 600 masked rollouts (bv4 −0.19 vs −0.22, json −0.10 vs −0.12, sql −0.03 vs −0.04 nats
   against masking), as in the SmolLM2 trial of issue 11: the default is one round.
Costs are counted as CARS does: LM positions evaluated (``forward_tokens``) per valid sample.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: Every target ``fit_controller`` accepts.
FIT_TARGETS = ("auto", "final", "rollout", "bootstrap")
#: Proposals for the rounds after the first.
ROUND_PROPOSALS = ("shim", "defensive")


def _p_valid_estimate(log_ratio_totals: np.ndarray, valid: np.ndarray) -> float:
    """Mean of 1[x in L]·p(x)/q(x): an unbiased estimate of P(L) from any proposal."""
    w = np.where(valid, np.exp(np.minimum(log_ratio_totals, 50.0)), 0.0)
    return float(w.mean()) if len(w) else float("nan")


def choose_target() -> tuple[str, dict[str, Any]]:
    """``target="auto"``: soft rollout labels in every regime measured so far.

    The evidence (``reports/fast-targets-*``, shipped LM, N = 1,000, language KL of LR_FULL):
    where valid draws are plentiful (P(L) 0.5-0.67) rollout labels match the paper's final
    labels (binary5 0.044 vs 0.044, bv4 0.058 vs 0.060, json 0.080 vs 0.094, sql 0.075 vs
    0.081 nats); where they are rare (SmolLM2, P(L) 0.5-9%) final labels fall back to masking
    and rollout labels cut the KL several-fold (``reports/smollm2-matrix``). So no probe is
    spent on the choice; P(L) is estimated afterwards from the rollouts themselves (mean of
    ∏ Z, unbiased) and recorded. ``target="final"`` stays available."""
    return "rollout", {"target_reason": (
        "auto: rollout labels (every row of a masked rollout labelled by ∏ Z of its suffix); "
        "measured at least as good as final-validity labels where valid draws are plentiful "
        "and far better where they are rare (reports/fast-targets-*, reports/smollm2-matrix)")}


def fit_controller(lm, masker, prompt: str | None = None, kind: str = "LR_FULL",
                   n_samples: int = 1000, *, output_dir=None, data=None,
                   max_new_tokens: int = 128, seed: int = 0, progress: bool = True,
                   target: str = "auto", rounds: int = 1, round_proposal: str = "defensive",
                   defensive: float = 0.5, chat: bool = False,
                   stop_at_newline: bool | str = "auto", bootstrap_rounds: int = 1,
                   batch_size: int = 64, prefilled=None, **controller_params
                   ) -> tuple[Any, dict[str, Any]]:
    """Sample training data (unless ``data`` is given), fit a controller, build its manifest.

    ``lm`` is a :class:`shim_adapters.lm.LoadedLM`; ``prompt`` defaults to the grammar's
    built-in prompt. ``target``: ``"auto"`` (see the module docstring), ``"final"``,
    ``"rollout"`` or ``"bootstrap"`` (:mod:`shim_adapters.targets`). ``data`` (round 1's
    completions) and ``prefilled`` (the prompt's prefill, on the LM view to use) let a caller
    share one draw between controllers. ``rounds``: iterated refits within the same total
    budget of ``n_samples`` LM samples (rollout target only).
    ``chat``: apply the tokenizer's chat template to the prompt. ``stop_at_newline``:
    ``"auto"`` (probe), True or False. With ``output_dir`` the artefact is also written there
    (and the returned manifest is the one on disk, checksums included). When the correction
    does not beat masking on held-out completions the controller falls back to β = 0 and says
    so (a warning, ``controller.decision_`` and the manifest's ``training.decision``).
    """
    from .artefact import build_manifest, save_controller
    from .controller import make_controller
    from .evaluation.lm_views import stop_folded
    from .prompting import detect_line_answers, render_prompt
    from .sampling import prefill
    from .targets import completion_log_ratio, make_targets
    from .training_data import concat_training_data, sample_training_data

    if target not in FIT_TARGETS:
        raise ValueError(f"unknown target {target!r}; choose one of {', '.join(FIT_TARGETS)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if round_proposal not in ROUND_PROPOSALS:
        raise ValueError(f"round_proposal must be one of {', '.join(ROUND_PROPOSALS)}")
    if rounds > 1 and target in ("final", "bootstrap"):
        raise ValueError(f"rounds > 1 refits on the controller's own rollouts; the {target!r} "
                         f"target cannot use them (use target='rollout' or 'auto')")
    if n_samples < rounds * 2:
        raise ValueError(f"n_samples={n_samples} is too small for {rounds} round(s)")
    if prompt is None:
        prompt = masker.grammar.default_prompt
        if prompt is None:
            raise ValueError(f"grammar {masker.grammar.name!r} has no default prompt: give a "
                             f"prompt")
    base_lm = lm
    training: dict[str, Any] = {"prompting": {"chat": bool(chat)}}
    if prefilled is not None:  # the caller rendered (chat) and prefilled the prompt already
        pre = prefilled
    else:
        rendered = render_prompt(lm.tokenizer, prompt, chat)
        pre = prefill(lm, rendered.text, add_special_tokens=rendered.add_special_tokens)

    if data is None and prefilled is None:
        if stop_at_newline == "auto":
            probe = detect_line_answers(pre, masker, max_new_tokens=max_new_tokens, seed=seed)
            fold = probe.fold
            training["prompting"]["line_answer_probe"] = probe.as_dict()
            if fold:
                log.warning("answers end at a newline: %s", probe.reason)
        else:
            fold = bool(stop_at_newline)
        training["prompting"]["stop_at_newline"] = fold
        if fold:
            lm = stop_folded(lm, masker.eos_token_ids)
            pre = prefill(lm, pre.prompt, add_special_tokens=rendered.add_special_tokens)
    else:  # the caller's data / prefilled prompt already fixed the LM view
        training["prompting"]["stop_at_newline"] = bool(stop_at_newline is True)

    def draw(n, proposal, round_seed, controller=None):
        return sample_training_data(lm, masker, pre.prompt, n, max_new_tokens=max_new_tokens,
                                    seed=round_seed, progress=progress, proposal=proposal,
                                    controller=controller, prefilled=pre,
                                    batch_size=batch_size,
                                    defensive=defensive if round_proposal == "defensive"
                                    else 0.0)

    def new():
        return make_controller(kind, **controller_params)

    # --- the target --------------------------------------------------------------------
    if data is not None:
        chosen = target if target != "auto" else (
            "final" if data.manifest.get("sampling", {}).get("proposal", "lm") == "lm"
            else "rollout")
        training["target_reason"] = "given data" if target == "auto" else "asked for"
    elif target == "auto":
        chosen, info = choose_target()
        training.update(info)
    else:
        chosen = target
        training["target_reason"] = "asked for"
    training["target"] = chosen

    # --- round 1 -------------------------------------------------------------------------
    per_round = [n_samples // rounds] * rounds
    per_round[0] += n_samples - sum(per_round)
    if data is None:
        data = draw(per_round[0], "lm" if chosen == "final" else "masked", seed)
    elif rounds > 1 and data.n_completions != per_round[0]:
        per_round[0] = data.n_completions
    training["p_valid_estimate"] = _p_valid_estimate(completion_log_ratio(data), data.valid)
    targets = make_targets(chosen, data, new, rounds=bootstrap_rounds)
    if targets.data.n_rows == 0:
        raise ValueError(
            f"no training rows: all {data.n_completions} unconstrained completions were refused "
            f"by the masker at their first token (valid fraction {np.mean(data.valid):.3g}); "
            f"the final-validity target needs valid draws: use target='rollout' (or 'auto')")
    controller = new().fit(targets.data, y=targets.y, completion_weight=targets.completion_weight)
    history = [_round_entry(1, data, targets, controller, kept=True)]
    pool = data

    # --- later rounds: refit on the controller's own (defensive) rollouts ----------------
    for r in range(2, rounds + 1):
        if controller.falls_back_to_masking_:
            proposal, proposer = "masked", None
        else:
            proposal, proposer = "shim", controller
        fresh = draw(per_round[r - 1], proposal, seed + 1000 * r, proposer)
        pool = concat_training_data([pool, fresh])
        pooled = make_targets("rollout", pool)
        candidate = new().fit(pooled.data, y=pooled.y,
                              completion_weight=pooled.completion_weight)
        gain, se = _gain_on_fresh(candidate, controller, pool, fresh, pooled)
        keep = bool(np.isfinite(gain) and gain > controller.min_gain_se * se)
        history.append(_round_entry(r, fresh, pooled, candidate, kept=keep,
                                    gain_over_previous=gain, gain_se=se))
        if keep:
            controller, targets = candidate, pooled
        log.info("round %d: refit gains %.3g ± %.3g nats on fresh rollouts: %s", r, gain, se,
                 "kept" if keep else "previous controller kept")
    controller.target_ = chosen
    controller.prompting_ = dict(training["prompting"])
    keys = ("n_samples", "n_rows", "n_states", "valid_fraction", "truncated", "cut",
            "masker_rejected_valid", "masker_accepted_invalid", "sampling", "sample_seconds",
            "forward_tokens")
    training.update({f"data_{k}": pool.manifest[k] for k in keys if k in pool.manifest})
    training["target_effective_samples"] = targets.effective_target_samples
    training["target_clipped_fraction"] = targets.clipped_fraction
    training["rounds"] = history
    valid_total = int(np.sum(pool.valid))
    training["forward_tokens_per_valid_sample"] = (
        float(pool.manifest.get("forward_tokens", 0)) / valid_total if valid_total else None)
    if chosen == "bootstrap":
        training["bootstrap_rounds"] = bootstrap_rounds
    if output_dir is not None:
        manifest = save_controller(output_dir, controller, masker, base_lm, prompt=prompt,
                                   training=training)
    else:
        manifest = build_manifest(controller, masker, base_lm, prompt=prompt, training=training)
    return controller, manifest


def _round_entry(r: int, data, targets, controller, *, kept: bool,
                 gain_over_previous: float | None = None, gain_se: float | None = None) -> dict:
    return {"round": r, "proposal": data.manifest.get("sampling", {}).get("proposal"),
            "n_samples": int(data.n_completions), "valid_count": int(np.sum(data.valid)),
            "forward_tokens": data.manifest.get("forward_tokens"),
            "beta": float(controller.beta_), "reg": float(controller.reg_),
            "heldout_kl_gain": float(controller.heldout_kl_gain_),
            "heldout_kl_gain_se": float(controller.heldout_kl_gain_se_),
            "falls_back_to_masking": bool(controller.falls_back_to_masking_),
            "target_effective_samples": float(targets.effective_target_samples),
            "gain_over_previous": gain_over_previous, "gain_over_previous_se": gain_se,
            "kept": kept}


def _gain_on_fresh(candidate, current, pool, fresh, pooled) -> tuple[float, float]:
    """Importance-weighted held-out gain of ``candidate`` over ``current`` on the fresh round's
    completions (the last ``fresh.n_completions`` of ``pool``): ``current`` never saw them;
    ``candidate`` is scored by its own cross-validation (out-of-fold) predictions."""
    n_fresh = fresh.n_completions
    idx = np.arange(pool.n_completions - n_fresh, pool.n_completions)
    w = pooled.completion_weight[idx]
    if not w.sum() > 0:
        return float("nan"), float("nan")
    cand = candidate.heldout_per_completion_[idx]
    cur = current.heldout_loglik(pool, idx)
    p = w / w.sum()
    d = cand - cur
    gain = float(d @ p)
    se = float(np.sqrt(np.sum(p ** 2 * (d - gain) ** 2)))
    return gain, se
