"""``fit_controller``: from an LM, a masker and a prompt to a fitted, checked SHIM controller.

The recipe depends on the regime, and the regime is measured, not guessed:

1. The prompt is rendered (``chat=True``: the LM's chat template) and prefilled once.
2. Where the answer ends: :func:`~shim_adapters.lm.prompting.detect_line_answers` probes a few
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
5. Top-ups (rollout target): a fit that is not trusted *only* because its held-out target ESS
   is below ``min_target_samples`` (where the LM is rarely valid, a few masked rollouts carry
   almost all the importance weight) says nothing about whether the correction helps. Then
   more LM samples are drawn, up to ``max_samples`` in all, from a defensive mixture of
   masking and that fit at its best held-out β (:meth:`Controller.untrusted_candidate`),
   pooled and refitted, until the usual criterion decides (trusted, or no gain) or the cap is
   spent; each top-up is a ``training.rounds`` entry (reason, ESS before/after, LM samples,
   forward tokens). A pool drawn from several proposals weights its completions as target
   samples by the balance heuristic, each scored under every proposal of the pool: the
   own-proposal ratio is exactly unbiased too, but keeps the few huge masked weights that made
   the evidence thin (both ESS are recorded). As the later proposals were fitted on the earlier
   draws, this is adaptive multiple importance sampling: consistent, not exactly unbiased.
   The fallback to masking is unchanged: an untrusted fit still serves β = 0.
Costs are counted as CARS does: LM positions evaluated (``forward_tokens``) per valid sample.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: Every target ``fit_controller`` accepts.
FIT_TARGETS = ("auto", "final", "rollout", "bootstrap")
#: Proposals for the rounds after the first.
ROUND_PROPOSALS = ("shim", "defensive")
#: The issue's cap on LM samples per problem: top-ups stop here.
DEFAULT_MAX_SAMPLES = 1000


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
                   defensive: float = 0.5, max_samples: int | None = DEFAULT_MAX_SAMPLES,
                   chat: bool = False,
                   stop_at_newline: bool | str = "auto", bootstrap_rounds: int = 1,
                   batch_size: int = 64, prefilled=None, **controller_params
                   ) -> tuple[Any, dict[str, Any]]:
    """Sample training data (unless ``data`` is given), fit a controller, build its manifest.

    ``lm`` is a :class:`shim_adapters.lm.loading.LoadedLM`; ``prompt`` defaults to the grammar's
    built-in prompt. ``target``: ``"auto"`` (see the module docstring), ``"final"``,
    ``"rollout"`` or ``"bootstrap"`` (:mod:`shim_adapters.shim.targets`). ``data`` (round 1's
    completions) and ``prefilled`` (the prompt's prefill, on the LM view to use) let a caller
    share one draw between controllers. ``rounds``: iterated refits within the same total
    budget of ``n_samples`` LM samples (rollout target only). ``max_samples``: the cap on LM
    samples for top-ups (module docstring, item 5); a first draw of ``n_samples`` or more
    leaves none; None: no top-ups.
    ``chat``: apply the tokenizer's chat template to the prompt. ``stop_at_newline``:
    ``"auto"`` (probe), True or False. With ``output_dir`` the artefact is also written there
    (and the returned manifest is the one on disk, checksums included). When the correction
    does not beat masking on held-out completions the controller falls back to β = 0 and says
    so (a warning, ``controller.decision_`` and the manifest's ``training.decision``).
    """
    from shim_adapters.lm.prompting import detect_line_answers, render_prompt
    from shim_adapters.lm.sampling import prefill
    from shim_adapters.lm.views import stop_folded
    from shim_adapters.shim.artefact import build_manifest, save_controller
    from shim_adapters.shim.controller import make_controller
    from shim_adapters.shim.targets import (
        completion_log_ratio,
        effective_sample_size,
        make_targets,
        target_weights,
    )
    from shim_adapters.shim.training_data import concat_training_data, sample_training_data

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
    if max_samples is not None and max_samples < 1:
        raise ValueError(f"max_samples must be >= 1 (or None: no top-ups), got {max_samples}")
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

    def draw(n, proposal, round_seed, controller=None, mix=0.0):
        return sample_training_data(lm, masker, pre.prompt, n, max_new_tokens=max_new_tokens,
                                    seed=round_seed, progress=progress, proposal=proposal,
                                    controller=controller, prefilled=pre,
                                    batch_size=batch_size, defensive=mix)

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
    history[0].update(kind="first draw", lm_samples=int(data.n_completions))
    pool = data

    # --- later rounds and top-ups -----------------------------------------------------------
    # Every pooled part remembers the proposal it was drawn from, so that the pool's target
    # weights can use the balance heuristic (each completion scored under every proposal).
    parts = [_Part(data, None, 0.0)]
    spent = topup_size = int(data.n_completions)
    cap = max(spent + sum(per_round[1:]), max_samples or 0)  # never below the planned rounds
    r = 1
    while True:
        r += 1
        regular = r <= rounds
        thin = (chosen == "rollout" and
                getattr(controller, "fallback_reason_", None) == "low_target_samples")
        if not regular and not (thin and spent < cap):
            if thin:
                log.warning("held-out evidence still thin (ESS %.3g) after %d LM samples: the "
                            "cap of %d is spent; %s", controller.heldout_effective_samples_,
                            spent, cap, controller.decision_)
            break
        if regular:
            n_draw = per_round[r - 1]
        else:
            n_draw = min(topup_size, cap - spent)
        if thin:  # not trusted only for want of evidence: draw where the candidate points
            proposer, mix = controller.untrusted_candidate(), defensive
        elif controller.falls_back_to_masking_:
            proposer, mix = None, 0.0
        else:
            proposer, mix = controller, (defensive if round_proposal == "defensive" else 0.0)
        fresh = draw(n_draw, "masked" if proposer is None else "shim", seed + 1000 * r,
                     proposer, mix)
        spent += n_draw
        parts.append(_Part(fresh, proposer, mix))
        pool = concat_training_data([p.data for p in parts])
        pooled = _pooled_targets(pool, parts)
        candidate = new().fit(pooled.data, y=pooled.y,
                              completion_weight=pooled.completion_weight)
        if regular and not thin:
            gain, se = _gain_on_fresh(candidate, controller, pool, fresh, pooled)
            keep = bool(np.isfinite(gain) and gain > controller.min_gain_se * se)
            entry = _round_entry(r, fresh, pooled, candidate, kept=keep,
                                 gain_over_previous=gain, gain_se=se)
            log.info("round %d: refit gains %.3g ± %.3g nats on fresh rollouts: %s", r, gain,
                     se, "kept" if keep else "previous controller kept")
        else:
            # the current fit fell back for want of evidence, so nothing trusted is replaced:
            # the refit on the larger pool decides by the usual criterion (and may fall back)
            keep = True
            entry = _round_entry(r, fresh, pooled, candidate, kept=True)
            entry.update({
                "kind": "round" if regular else "top-up",
                "reason": (f"thin evidence: held-out target ESS "
                           f"{controller.heldout_effective_samples_:.3g} below the floor "
                           f"{controller.min_target_samples:g}"),
                "proposal_beta": float(proposer.beta_), "proposal_defensive": float(mix),
                "heldout_ess_before": float(controller.heldout_effective_samples_),
                "heldout_ess_after": float(candidate.heldout_effective_samples_),
                "decision_after": candidate.decision_, "lm_samples_total": int(spent),
                # the same pool weighted by each completion's own proposal ratio, for contrast
                "heldout_ess_own_ratio": effective_sample_size(target_weights(pool))})
            log.warning("top-up %d: %d LM samples from the untrusted fit (β %.3g, defensive "
                        "%.2g): held-out ESS %.3g -> %.3g; %s", r, n_draw, proposer.beta_, mix,
                        controller.heldout_effective_samples_,
                        candidate.heldout_effective_samples_, candidate.decision_)
        entry["lm_samples"] = int(n_draw)
        entry.setdefault("kind", "round")
        history.append(entry)
        if keep:
            controller, targets = candidate, pooled
    if len(parts) > 1:  # every LM sample drawn, by the balance heuristic
        training["p_valid_estimate_pooled"] = pooled.p_valid_estimate
    training["max_samples"] = int(cap)
    training["lm_samples_total"] = int(spent)
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


@dataclass
class _Part:
    """One draw of a pooled fit and the proposal it came from (None: plain masking)."""

    data: Any
    proposer: Any
    defensive: float
    row_logprob: dict = field(default_factory=dict)  # per pooled proposal index: log q of rows


def _pooled_targets(pool, parts: list[_Part]):
    """Rollout targets of the pool; with several proposals, the completions' target weights
    by the balance heuristic (:func:`~shim_adapters.shim.targets.mixture_target_weights`): every
    completion is scored under every part's proposal (cached per part, so a top-up only
    scores the new part's rows and the new proposal)."""
    from shim_adapters.shim.targets import (
        make_targets,
        masked_row_logprob,
        mixture_target_weights,
        shim_row_logprob,
    )

    pooled = make_targets("rollout", pool)
    if len(parts) < 2:
        return pooled
    per_proposal = []
    for k, proposal in enumerate(parts):
        rows = []
        for part in parts:
            if k not in part.row_logprob:
                part.row_logprob[k] = (masked_row_logprob(part.data) if proposal.proposer is None
                                       else shim_row_logprob(part.data, proposal.proposer,
                                                             proposal.defensive))
            rows.append(part.row_logprob[k])
        per_proposal.append(np.concatenate(rows))
    counts = [p.data.n_completions for p in parts]
    pooled.completion_weight = mixture_target_weights(pool, per_proposal, counts)
    pooled.p_valid_estimate = float(np.mean(mixture_target_weights(pool, per_proposal, counts,
                                                                   scaled=False)))
    return pooled


def _round_entry(r: int, data, targets, controller, *, kept: bool,
                 gain_over_previous: float | None = None, gain_se: float | None = None) -> dict:
    return {"round": r, "proposal": data.manifest.get("sampling", {}).get("proposal"),
            "n_samples": int(data.n_completions), "valid_count": int(np.sum(data.valid)),
            "forward_tokens": data.manifest.get("forward_tokens"),
            "beta": float(controller.beta_), "reg": float(controller.reg_),
            "heldout_kl_gain": float(controller.heldout_kl_gain_),
            "heldout_kl_gain_se": float(controller.heldout_kl_gain_se_),
            "heldout_best_beta": float(controller.heldout_best_beta_),
            "heldout_effective_samples": float(controller.heldout_effective_samples_),
            "fallback_reason": getattr(controller, "fallback_reason_", None),
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
