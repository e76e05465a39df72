"""Fidelity metrics: KL(p(·|G) ‖ q) over a sampled support, its bootstrap CI, and its curve.

The paper's protocol (docs/design.md): draw N unconstrained LM samples, keep the valid ones
as the support S, renormalise the LM's and the method's exact sequence probabilities over S and
take the KL. Both inputs are log-probabilities over the same sequences; renormalising makes any
constant offset (the prompt, the LM's invalid mass) irrelevant. KL is in nats.

Renormalising over S also hides the mass a method puts *outside* S, which is where masking's
error mostly goes (towards strings the LM rarely finishes). :func:`language_kl` estimates the
KL to p(·|G) over the whole language instead: the valid draws are samples of p(·|G) and the
valid fraction estimates P(L), so no renormalisation is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.special import logsumexp


def kl_over_support(target_logprob: np.ndarray, method_logprob: np.ndarray) -> float:
    """KL(p̃ ‖ q̃) where p̃, q̃ renormalise ``exp(target_logprob)``, ``exp(method_logprob)``
    over the given sequences. ``inf`` when q puts no mass where p does."""
    p_log = np.asarray(target_logprob, dtype=np.float64)
    q_log = np.asarray(method_logprob, dtype=np.float64)
    if p_log.shape != q_log.shape or p_log.ndim != 1:
        raise ValueError(f"need two 1-d arrays of equal length, got {p_log.shape} and "
                         f"{q_log.shape}")
    if p_log.size == 0:
        return float("nan")
    p_log = p_log - logsumexp(p_log)
    if not np.isfinite(q_log).all():
        if np.any(~np.isfinite(q_log) & (p_log > -np.inf)):
            return float("inf")
    q_log = q_log - logsumexp(q_log)
    p = np.exp(p_log)
    terms = np.where(p > 0, p * (p_log - q_log), 0.0)
    return float(max(terms.sum(), 0.0))


def support_of(draw_ids: np.ndarray) -> np.ndarray:
    """The distinct valid sequences among draws (``draw_ids``: index of each draw's sequence,
    -1 for an invalid draw)."""
    ids = np.asarray(draw_ids)
    return np.unique(ids[ids >= 0])


def support_kl(draw_ids: np.ndarray, target_logprob: np.ndarray,
               method_logprob: np.ndarray) -> float:
    """KL over the support formed by ``draw_ids`` (indices into the logprob arrays)."""
    s = support_of(draw_ids)
    return kl_over_support(target_logprob[s], method_logprob[s])


@dataclass(frozen=True)
class KLEstimate:
    """A KL point estimate with a percentile bootstrap interval."""

    kl: float
    ci_low: float
    ci_high: float
    support_size: int
    n_draws: int
    n_bootstrap: int

    def as_dict(self) -> dict:
        return {"kl": self.kl, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "support_size": self.support_size, "n_draws": self.n_draws,
                "n_bootstrap": self.n_bootstrap}


def bootstrap_kl(draw_ids: np.ndarray, target_logprob: np.ndarray, method_logprob: np.ndarray,
                 *, n_bootstrap: int = 200, confidence: float = 0.95,
                 seed: int = 0) -> KLEstimate:
    """KL over the support S of the draws, with a percentile CI from resampling S: |S| members
    drawn with replacement, duplicates kept as separate terms of the KL sum. (Resampling the
    raw draws instead would shrink the number of distinct members and bias the KL down.)"""
    ids = np.asarray(draw_ids)
    support = support_of(ids)
    point = support_kl(ids, target_logprob, method_logprob)
    rng = np.random.default_rng(seed)
    values = []
    if support.size:
        for _ in range(n_bootstrap):
            members = support[rng.integers(0, support.size, size=support.size)]
            values.append(kl_over_support(target_logprob[members], method_logprob[members]))
    arr = np.asarray(values, dtype=np.float64)
    alpha = (1.0 - confidence) / 2.0
    if arr.size == 0:
        lo = hi = float("nan")
    else:
        # inverted_cdf never interpolates, so an infinite replicate cannot produce nan
        method = "inverted_cdf" if np.isinf(arr).any() else "linear"
        lo, hi = (float(x) for x in np.quantile(arr, [alpha, 1.0 - alpha], method=method))
    return KLEstimate(point, lo, hi, int(support.size), int(len(ids)), int(arr.size))


def stability_curve(draw_ids: np.ndarray, target_logprob: np.ndarray,
                    method_logprob: np.ndarray,
                    sizes: list[int] | None = None) -> list[dict]:
    """KL computed on the first n draws, for growing n: does the estimate settle as |S| grows?"""
    ids = np.asarray(draw_ids)
    if sizes is None:
        sizes = sorted({int(x) for x in np.unique(np.geomspace(
            min(25, len(ids)), len(ids), num=8).round())})
    curve = []
    for size in sizes:
        head = ids[:size]
        if not (head >= 0).any():
            continue
        curve.append({"n_draws": int(size), "support_size": int(support_of(head).size),
                      "kl": support_kl(head, target_logprob, method_logprob)})
    return curve


def exact_kl(target_logprob: np.ndarray, method_logprob: np.ndarray) -> float:
    """KL(p(·|G) ‖ q) over a whole finite language (every sequence enumerated): the method's
    probabilities should already sum to one there, the target is renormalised."""
    return kl_over_support(target_logprob, method_logprob)


def grouped_probabilities(keys: list[str], logprob: np.ndarray) -> dict[str, float]:
    """Total (renormalised) probability per key, e.g. per string over its tokenisations."""
    lp = np.asarray(logprob, dtype=np.float64)
    p = np.exp(lp - logsumexp(lp))
    out: dict[str, float] = {}
    for key, value in zip(keys, p):
        out[key] = out.get(key, 0.0) + float(value)
    return out


@dataclass(frozen=True)
class LanguageKLEstimate:
    """Monte-Carlo KL(p(·|G) ‖ q) over the whole language, with percentile bootstrap CIs.

    ``diff*`` is KL(method) − KL(reference) (paired per draw; negative: the method is closer
    to the target); nan when no reference was given."""

    kl: float
    ci_low: float
    ci_high: float
    diff: float
    diff_ci_low: float
    diff_ci_high: float
    n_valid: int
    n_draws: int
    n_bootstrap: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _language_kl_terms(ids: np.ndarray, target_logprob: np.ndarray, method_logprob: np.ndarray,
                       reference_logprob: np.ndarray | None) -> tuple[float, float]:
    valid = ids[ids >= 0]
    if valid.size == 0:
        return float("nan"), float("nan")
    log_pl = np.log(valid.size / ids.size)
    lq = method_logprob[valid]
    if not np.isfinite(lq).all():
        kl = float("inf")
    else:
        kl = float(np.mean(target_logprob[valid] - lq) - log_pl)
    if reference_logprob is None:
        return kl, float("nan")
    with np.errstate(invalid="ignore"):
        diff = float(np.mean(reference_logprob[valid] - lq))
    return kl, diff


def language_kl(draw_ids: np.ndarray, target_logprob: np.ndarray, method_logprob: np.ndarray,
                reference_logprob: np.ndarray | None = None, *, n_bootstrap: int = 200,
                confidence: float = 0.95, seed: int = 0) -> LanguageKLEstimate:
    """KL(p(·|G) ‖ q) = E_{x~p(·|G)}[log p(x) − log P(L) − log q(x)], estimated from N
    unconstrained draws (``draw_ids``: index of each draw's sequence, -1 when invalid).

    The valid draws are exact samples of p(·|G) and P(L) is estimated by their fraction, so
    this is a consistent estimate of the KL over the *whole* language, not only over the
    sequences that were drawn. ``target_logprob`` must be the LM's full sequence log-probability
    (EOS included). The difference to ``reference_logprob`` (e.g. masking) needs no P(L) at
    all: E[log q_ref(x) − log q(x)] = KL(q) − KL(ref). CIs resample all N draws (valid and
    invalid), so the uncertainty of P(L) is included.
    """
    ids = np.asarray(draw_ids)
    lp = np.asarray(target_logprob, dtype=np.float64)
    lq = np.asarray(method_logprob, dtype=np.float64)
    ref = None if reference_logprob is None else np.asarray(reference_logprob, dtype=np.float64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"need a non-empty 1-d array of draw ids, got shape {ids.shape}")
    if lp.shape != lq.shape or (ref is not None and ref.shape != lp.shape):
        raise ValueError(f"log-probability arrays differ in shape: {lp.shape}, {lq.shape}"
                         + ("" if ref is None else f", {ref.shape}"))
    kl, diff = _language_kl_terms(ids, lp, lq, ref)
    rng = np.random.default_rng(seed)
    reps = np.array([_language_kl_terms(ids[rng.integers(0, ids.size, size=ids.size)], lp, lq,
                                        ref) for _ in range(n_bootstrap)]).reshape(-1, 2)
    alpha = (1.0 - confidence) / 2.0

    def interval(values: np.ndarray) -> tuple[float, float]:
        values = values[~np.isnan(values)]
        if values.size == 0:
            return float("nan"), float("nan")
        method = "inverted_cdf" if np.isinf(values).any() else "linear"
        lo, hi = np.quantile(values, [alpha, 1.0 - alpha], method=method)
        return float(lo), float(hi)

    lo, hi = interval(reps[:, 0])
    dlo, dhi = interval(reps[:, 1])
    return LanguageKLEstimate(kl, lo, hi, diff, dlo, dhi, int((ids >= 0).sum()), int(ids.size),
                              int(len(reps)))
