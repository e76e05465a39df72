"""Fidelity at any P(L): KL(p(·|G) ‖ q) by self-normalised importance sampling from a mixture.

Rejection needs valid unconstrained draws, which a rarely-valid LM does not give (0 valid in
1,000 draws is common at P(L) < 0.1%). Every masked method, though, is a proposal that only emits
strings of L and whose probability q_m(x) is exact by teacher forcing. Pool the draws of all
methods (and the unconstrained draws, whose q is p itself) and weight each draw by the balance
heuristic (Veach and Guibas): w(x) = 1[x in L]·p(x) / Σ_m (n_m / N)·q_m(x). Then, with w̃ the
self-normalised weights,

- P(L) ≈ mean of w over all N draws;
- KL(p(·|G) ‖ q_m) ≈ Σ_j w̃_j·(log p(x_j) − log P(L) − log q_m(x_j)), every method on the
  *same* weighted samples, so differences between methods are paired;
- the paired difference to masking, Σ_j w̃_j·(log q_mask − log q_m), needs no P(L).

The effective sample size (Σw)²/Σw² says whether a number means anything: below
:data:`MIN_ESS` the estimate is reported as not measurable, never as a number. Intervals are a
stratified bootstrap (each method's draws resampled within that method).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.special import logsumexp

#: Below this effective sample size a KL estimate is "not measurable".
MIN_ESS = 10.0


@dataclass
class MixtureDraws:
    """The pooled draws: which proposal drew each one, and each draw's sequence index."""

    proposal: np.ndarray  #: int, index into ``proposals`` per draw
    sequence: np.ndarray  #: int, index of the draw's distinct valid sequence, -1 if invalid
    proposals: list[str]  #: names; "lm" is the unconstrained LM (q = p)


@dataclass
class MixtureEstimate:
    """KL of every method to p(·|G) on one set of weighted samples."""

    ess: float
    n_draws: int
    p_valid: float
    p_valid_ci: tuple[float, float]
    kl: dict[str, float]
    kl_ci: dict[str, tuple[float, float]]
    diff_to_masking: dict[str, float]
    diff_ci: dict[str, tuple[float, float]]
    #: Per proposal: ESS of its own draws weighted by p/q (how close q is to the target).
    own_ess: dict[str, float] = field(default_factory=dict)
    draws_per_proposal: dict[str, int] = field(default_factory=dict)
    #: "a − b" -> KL(a) − KL(b) with its 95% CI, for the pairs asked for (paired draws).
    paired: dict[str, dict] = field(default_factory=dict)

    @property
    def measurable(self) -> bool:
        return self.ess >= MIN_ESS

    def as_dict(self) -> dict:
        return {"ess": self.ess, "n_draws": self.n_draws, "measurable": self.measurable,
                "p_valid": self.p_valid, "p_valid_ci": list(self.p_valid_ci),
                "kl": self.kl, "kl_ci": {k: list(v) for k, v in self.kl_ci.items()},
                "diff_to_masking": self.diff_to_masking,
                "diff_ci": {k: list(v) for k, v in self.diff_ci.items()},
                "own_ess": self.own_ess, "draws_per_proposal": self.draws_per_proposal,
                "paired": self.paired}


def _ess(log_w: np.ndarray) -> float:
    lw = log_w[np.isfinite(log_w)]
    if lw.size == 0:
        return 0.0
    return float(np.exp(2 * logsumexp(lw) - logsumexp(2 * lw)))


def mixture_log_weights(draws: MixtureDraws, lm_logprob: np.ndarray,
                        method_logprob: dict[str, np.ndarray]) -> np.ndarray:
    """Per draw: log w = log p(x) − log Σ_m (n_m/N)·q_m(x) (−inf for invalid draws).

    ``lm_logprob`` and ``method_logprob[name]`` are per distinct valid sequence; a proposal
    named ``"lm"`` has q = p."""
    n = len(draws.proposal)
    counts = np.bincount(draws.proposal, minlength=len(draws.proposals)).astype(np.float64)
    log_share = np.log(counts / n, where=counts > 0, out=np.full(len(counts), -np.inf))
    q = np.stack([lm_logprob if name == "lm" else method_logprob[name]
                  for name in draws.proposals])  # (M, S)
    log_mix = logsumexp(q + log_share[:, None], axis=0)  # (S,)
    out = np.full(n, -np.inf)
    ok = draws.sequence >= 0
    seq = draws.sequence[ok]
    out[ok] = lm_logprob[seq] - log_mix[seq]
    return out


def mixture_kl(draws: MixtureDraws, lm_logprob: np.ndarray, method_logprob: dict[str, np.ndarray],
               *, masking: str = "masking", n_bootstrap: int = 200, seed: int = 0,
               pairs: Sequence[tuple[str, str]] = ()) -> MixtureEstimate:
    """Every method's KL(p(·|G) ‖ q_m) on the pooled, balance-heuristic-weighted draws;
    for each ``(a, b)`` of ``pairs`` also KL(a) − KL(b) on the same draws (the target's
    terms cancel: Σ w·(log q_b − log q_a)), with a bootstrap CI."""
    log_w = mixture_log_weights(draws, lm_logprob, method_logprob)
    n = len(log_w)
    ok = np.isfinite(log_w)
    seq = np.where(ok, draws.sequence, 0)
    lp = np.where(ok, lm_logprob[seq], 0.0)
    names = list(method_logprob)
    lq = {m: np.where(ok, method_logprob[m][seq], 0.0) for m in names}
    pairs = [(a, b) for a, b in pairs if a in lq and b in lq]
    pair_names = [f"{a} − {b}" for a, b in pairs]

    def estimate(idx: np.ndarray):
        lw = log_w[idx]
        fin = np.isfinite(lw)
        if not fin.any():
            nan = float("nan")
            return (nan, {m: nan for m in names}, {m: nan for m in names},
                    {p: nan for p in pair_names})
        top = lw[fin].max()
        w = np.where(fin, np.exp(lw - top), 0.0)
        p_valid = float(np.exp(top) * w.mean())
        wt = w / w.sum()
        kl, diff = {}, {}
        for m in names:
            terms = lp[idx] - np.log(p_valid) - lq[m][idx]
            with np.errstate(invalid="ignore"):
                kl[m] = float(np.sum(np.where(wt > 0, wt * terms, 0.0)))
            if masking in lq:
                d = lq[masking][idx] - lq[m][idx]
                with np.errstate(invalid="ignore"):
                    diff[m] = float(np.sum(np.where(wt > 0, wt * d, 0.0)))
        between = {}
        for (a, b), label in zip(pairs, pair_names):
            with np.errstate(invalid="ignore"):
                between[label] = float(np.sum(np.where(wt > 0, wt * (lq[b][idx] - lq[a][idx]),
                                                       0.0)))
        return p_valid, kl, diff, between

    p_valid, kl, diff, between = estimate(np.arange(n))
    rng = np.random.default_rng(seed)
    strata = [np.flatnonzero(draws.proposal == k) for k in range(len(draws.proposals))]
    boot_p, boot_kl, boot_diff = [], {m: [] for m in names}, {m: [] for m in names}
    boot_between: dict[str, list[float]] = {p: [] for p in pair_names}
    for _ in range(n_bootstrap):
        idx = np.concatenate([rng.choice(s, size=len(s), replace=True) for s in strata if len(s)])
        bp, bk, bd, bb = estimate(idx)
        boot_p.append(bp)
        for p in pair_names:
            boot_between[p].append(bb[p])
        for m in names:
            boot_kl[m].append(bk[m])
            if m in bd:
                boot_diff[m].append(bd[m])

    def interval(values) -> tuple[float, float]:
        v = np.asarray(values, dtype=np.float64)
        v = v[np.isfinite(v)]
        if v.size == 0:
            return float("nan"), float("nan")
        return float(np.percentile(v, 2.5)), float(np.percentile(v, 97.5))

    own = {}
    for k, name in enumerate(draws.proposals):
        sel = (draws.proposal == k) & ok
        if name == "lm":
            own[name] = float(sel.sum())  # valid unconstrained draws are exact target samples
            continue
        q_own = method_logprob.get(name)
        if q_own is None:
            continue
        own[name] = _ess(lm_logprob[draws.sequence[sel]] - q_own[draws.sequence[sel]])
    return MixtureEstimate(
        ess=_ess(log_w), n_draws=n, p_valid=p_valid, p_valid_ci=interval(boot_p), kl=kl,
        kl_ci={m: interval(boot_kl[m]) for m in names}, diff_to_masking=diff,
        diff_ci={m: interval(boot_diff[m]) for m in names if boot_diff[m]}, own_ess=own,
        draws_per_proposal={name: int(np.sum(draws.proposal == k))
                            for k, name in enumerate(draws.proposals)},
        paired={p: {"diff": between[p], "ci": list(interval(boot_between[p]))}
                for p in pair_names})


def format_kl(value: float, ci: tuple[float, float] | None, ess: float) -> str:
    """A KL cell: the number with its interval, or "not measurable (ESS x)"."""
    if not ess >= MIN_ESS:
        return f"not measurable (ESS {ess:.3g})"
    if not np.isfinite(value):
        return "∞" if value == np.inf else "n/a"
    if ci is None or not np.all(np.isfinite(ci)):
        return f"{value:.3f}"
    return f"{value:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]"
