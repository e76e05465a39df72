"""Exact-target mode: the corrected sampler as an importance-sampling proposal.

Both the LM's probability p(x) and the probability q(x) with which masking (or SHIM) produced x
are computable exactly by teacher forcing (docs/design.md). So a sample x of q carries
the importance weight w(x) = p(x)·1[x in L] / q(x), and weighted samples are samples of the
exact target p(x | G) ∝ p(x)·1[x in L], however rough γ̂ is:

- SIR (sampling-importance-resampling): draw M proposals, resample n of them ∝ w;
- IMH (independence Metropolis-Hastings): a chain that moves to the next proposal x' with
  probability min(1, w(x')/w(x)); the chain's stationary distribution is the target.

The spread of w measures how good γ̂ is: the effective sample size (Σw)²/Σw² is M for a perfect
γ̂ (then q = target and w is constant) and falls as q departs from the target. The mean weight
estimates P(x in L) under the LM. Cost per exact sample is seconds per effective sample.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.sampling import prefill, sample
from shim_adapters.mask.protocol import Masker
from shim_adapters.shim.correction import ShimAdjuster

SIR, IMH = "sir", "imh"


def log_importance_weights(lm_logprob: np.ndarray, proposal_logprob: np.ndarray,
                           valid: np.ndarray) -> np.ndarray:
    """log w = log p(x) - log q(x) where x is valid, -inf elsewhere."""
    lp = np.asarray(lm_logprob, dtype=np.float64)
    lq = np.asarray(proposal_logprob, dtype=np.float64)
    ok = np.asarray(valid, dtype=bool) & np.isfinite(lp) & np.isfinite(lq)
    out = np.full(lp.shape, -np.inf)
    out[ok] = lp[ok] - lq[ok]
    return out


def effective_sample_size(log_weights: np.ndarray) -> float:
    """(Σw)² / Σw² computed stably from log-weights (0 when every weight is 0)."""
    lw = np.asarray(log_weights, dtype=np.float64)
    if lw.size == 0 or not np.isfinite(lw).any():
        return 0.0
    return float(np.exp(2 * np.logaddexp.reduce(lw) - np.logaddexp.reduce(2 * lw)))


def normalised_weights(log_weights: np.ndarray) -> np.ndarray:
    lw = np.asarray(log_weights, dtype=np.float64)
    if not np.isfinite(lw).any():
        raise ValueError("every proposal has weight 0 (none is a valid string): nothing to "
                         "resample")
    w = np.exp(lw - lw.max())
    return w / w.sum()


def sir_indices(log_weights: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` proposal indices drawn with replacement ∝ w (multinomial resampling)."""
    return rng.choice(len(log_weights), size=n, replace=True, p=normalised_weights(log_weights))


def imh_chain(log_weights: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Independence Metropolis-Hastings over proposals in order: (state index per step,
    acceptance rate). Starts at the first proposal with w > 0; the chain has one state per
    proposal from there on."""
    lw = np.asarray(log_weights, dtype=np.float64)
    finite = np.flatnonzero(np.isfinite(lw))
    if len(finite) == 0:
        raise ValueError("every proposal has weight 0 (none is a valid string): the chain "
                         "cannot start")
    current = int(finite[0])
    states, accepted, tried = [current], 0, 0
    u = np.log(rng.random(len(lw)))
    for j in range(current + 1, len(lw)):
        tried += 1
        if u[j] < lw[j] - lw[current]:  # -inf proposals are never accepted
            current = j
            accepted += 1
        states.append(current)
    return np.array(states, dtype=np.int64), accepted / max(tried, 1)


@dataclass
class ExactSamples:
    """Samples of the exact target p(x | G) and what they cost."""

    method: str
    token_ids: list[list[int]]  #: the n output samples (EOS included)
    texts: list[str]
    proposal_token_ids: list[list[int]]
    proposal_texts: list[str]
    log_weights: np.ndarray  #: per proposal
    ess: float  #: effective sample size of the proposals' weights
    acceptance_rate: float | None  #: IMH only
    seconds: float  #: proposals + exact scoring + validity checks + resampling
    sample_seconds: float
    score_seconds: float

    @property
    def n_proposals(self) -> int:
        return len(self.proposal_token_ids)

    @property
    def relative_ess(self) -> float:
        return self.ess / max(self.n_proposals, 1)

    @property
    def seconds_per_effective_sample(self) -> float:
        return self.seconds / self.ess if self.ess > 0 else float("inf")

    @property
    def log_evidence(self) -> float:
        """log of the mean weight: an unbiased-in-w estimate of log P(x in L) under the LM."""
        lw = self.log_weights
        return float(np.logaddexp.reduce(lw) - np.log(len(lw))) if len(lw) else float("nan")


def exact_samples(lm, masker: Masker, controller, prompt: str, n: int, method: str = SIR, *,
                  n_proposals: int | None = None, seed: int = 0, max_new_tokens: int = 128,
                  batch_size: int = 64, damped: bool = True) -> ExactSamples:
    """``n`` samples of the exact target, using masking (``controller=None``) or SHIM as the
    proposal. ``method="sir"`` resamples ``n`` of ``n_proposals`` (default ``n``) proposals;
    ``method="imh"`` runs an independence Metropolis-Hastings chain over ``n_proposals``
    (default ``n``) proposals and returns its last ``n`` states."""
    if method not in (SIR, IMH):
        raise ValueError(f"method must be {SIR!r} or {IMH!r}, not {method!r}")
    m = n if n_proposals is None else int(n_proposals)
    if n < 1 or m < 1 or (method == IMH and m < n):
        raise ValueError(f"need n >= 1 and n_proposals >= 1 (>= n for IMH); got n={n}, "
                         f"n_proposals={m}")
    adjuster = None if controller is None else ShimAdjuster(controller, damped=damped)
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    prefilled = prefill(lm, prompt)
    proposals: list[list[int]] = []
    while len(proposals) < m:
        b = min(batch_size, m - len(proposals))
        batch = sample(prefilled, b, masker=masker, adjuster=adjuster, batch_size=b,
                       max_new_tokens=max_new_tokens, generator=gen)
        proposals.extend(batch.token_ids)
    sample_seconds = time.perf_counter() - start
    t0 = time.perf_counter()
    scores = score_sequences(prefilled, proposals, masker, {"q": adjuster})
    eos = set(int(e) for e in masker.eos_token_ids) | set(int(e) for e in lm.eos_token_ids)
    texts = [masker.decode([t for t in s if t not in eos]) for s in proposals]
    acceptor = reference_acceptor(masker.grammar)
    valid = np.array([bool(s) and s[-1] in eos and acceptor.accepts(x)
                      for s, x in zip(proposals, texts)], dtype=bool) & scores.masker_accepts
    log_w = log_importance_weights(scores.lm, scores.methods["q"], valid)
    score_seconds = time.perf_counter() - t0
    acceptance = None
    if method == SIR:
        idx = sir_indices(log_w, n, rng)
    else:
        chain, acceptance = imh_chain(log_w, rng)
        idx = chain[-n:]
    seconds = time.perf_counter() - start
    return ExactSamples(method=method, token_ids=[proposals[i] for i in idx],
                        texts=[texts[i] for i in idx], proposal_token_ids=proposals,
                        proposal_texts=texts, log_weights=log_w,
                        ess=effective_sample_size(log_w), acceptance_rate=acceptance,
                        seconds=seconds, sample_seconds=sample_seconds,
                        score_seconds=score_seconds)
