"""Training targets for γ̂: labels for every row, from any proposal, and weights as target samples.

With V(h) = P(the LM's continuation of prefix h ends in L), SHIM's controller estimates
γ(t | h) = V(h·t). For a completion x drawn from any proposal q (the LM itself, masking, SHIM,
a mixture), the row at step i gets the label 1[x in L]·∏_{j>i} p(x_j | x<j) / q(x_j | x<j): an
unbiased estimate of V(x<i·x_i) (docs/design.md). The ratio is read off the rows
(``row_lm_logprob`` against ``row_proposal_logprob``), so nothing is re-scored. Three kinds:

- ``"final"`` (paper): unconstrained completions (q = p): the label is 0/1 final validity. It
  needs valid unconstrained draws, which a rarely-valid LM does not produce.
- ``"rollout"``: valid-only proposals (masked or SHIM completions: always in L). For masking
  p/q = Z, the allowed mass, so the label is ∏ Z over the later steps, in (0, 1]; for SHIM the
  ratio can exceed 1 and the label is clipped at 1 (V ≤ 1; ``Targets.clipped_fraction``).
  Every row carries a soft label and no valid unconstrained completion is needed.
- ``"bootstrap"``: fitted value iteration on the rows of masked data. V(h·t) = Σ_{t'}
  p(t'|h·t)·V(h·t·t') over the allowed t' at the next step, so the controller is regressed onto
  the allowed-mass-weighted γ̂ of the next step, starting from the rollout fit.

Completions that hit ``max_new_tokens`` are not in the (length-bounded) language: label 0.
As samples of the target p(x | G) a completion's importance weight is 1[x in L]·p(x)/q(x)
(:func:`target_weights`), the same scale for every proposal (it estimates P(L)), so data pooled
from several proposals (:func:`~shim_adapters.shim.training_data.concat_training_data`) keeps one
consistent held-out criterion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

#: The target kinds :func:`make_targets` (and ``fit_controller(target=...)``) accept.
TARGET_KINDS = ("final", "rollout", "bootstrap")
#: Proposals that only emit strings of L (a masker's guarantee).
VALID_ONLY_PROPOSALS = ("masked", "shim")


def proposal_of(data) -> str:
    """How the data's completions were sampled (``lm``, ``masked``, ``shim`` or a mix)."""
    return str(data.manifest.get("sampling", {}).get("proposal", "lm"))


def _proposal_parts(data) -> set[str]:
    return set(proposal_of(data).split("+"))


def _row_order(data) -> np.ndarray:
    """Rows sorted by (completion, step): each completion's rows become one ordered run."""
    return np.lexsort((data.row_step, data.row_completion))


def _row_log_ratio(data) -> np.ndarray:
    return data.row_lm_logprob.astype(np.float64) - data.row_proposal_logprob.astype(np.float64)


def completion_log_ratio(data) -> np.ndarray:
    """Σ log p/q over each completion's replayed rows (for masking: log ∏ Z)."""
    return np.bincount(data.row_completion, weights=_row_log_ratio(data),
                       minlength=data.n_completions)


def suffix_log_ratio(data) -> np.ndarray:
    """Per row: Σ log p/q over the *later* rows of its completion (0 at the last row)."""
    order = _row_order(data)
    comp = data.row_completion[order]
    r = _row_log_ratio(data)[order]
    total = np.bincount(comp, weights=r, minlength=data.n_completions)
    inclusive = np.cumsum(r)
    start = np.searchsorted(comp, comp, side="left")
    before = inclusive - r - np.where(start > 0, inclusive[start - 1], 0.0)
    out = np.empty(data.n_rows)
    out[order] = total[comp] - before - r
    return out


def importance_labels(data) -> tuple[np.ndarray, float]:
    """Per row: 1[x in L]·∏_{later steps} p/q, clipped at 1; and the fraction clipped."""
    raw = np.exp(np.minimum(suffix_log_ratio(data), 50.0))
    raw = np.where(np.asarray(data.valid, dtype=bool)[data.row_completion], raw, 0.0)
    clipped = float(np.mean(raw > 1.0 + 1e-6)) if raw.size else 0.0
    return np.minimum(raw, 1.0), clipped


def rollout_labels(data) -> np.ndarray:
    """Per row of valid-only data: the importance label (∏ Z of the later steps for masking)."""
    return importance_labels(data)[0]


def target_weights(data) -> np.ndarray:
    """Per completion: its weight as a sample of the target p(x | G) (held-out criterion):
    1[x in L]·p(x)/q(x), scaled so that the largest weight is 1 (1/0 for unconstrained data)."""
    valid = np.asarray(data.valid, dtype=bool)
    if not valid.any():
        return np.zeros(data.n_completions)
    lw = completion_log_ratio(data)
    w = np.exp(lw - lw[valid].max())
    return np.where(valid, w, 0.0)


def masked_row_logprob(data) -> np.ndarray:
    """Per row: log q(token) under plain masking, log p(t) - log Z (exact: Z is stored)."""
    return data.row_lm_logprob.astype(np.float64) - data.row_log_z.astype(np.float64)


#: A token id no controller has a feature for: it scores like every unseen token.
_NO_FEATURE_TOKEN = np.int64(2 ** 31 - 1)


def shim_row_logprob(data, controller, defensive: float = 0.0, chunk: int = 2048
                     ) -> np.ndarray:
    """Per row: log q(token) under the SHIM proposal of ``controller`` (at its own β), mixed
    per step with masking by ``defensive``, recomputed from the stored rows.

    The normaliser Σ p·γ̂^β runs over the row's stored allowed set; the allowed mass the row
    did not store (``row_log_z`` is exact) is scored like a token without features. This is
    what the sampler computed for completions drawn from that proposal (checked against
    ``row_proposal_logprob``) and what it *would* have computed for the others, which the
    balance heuristic (:func:`mixture_target_weights`) needs."""
    if not 0.0 <= defensive <= 1.0:
        raise ValueError(f"defensive must lie in [0, 1], got {defensive}")
    lq0 = masked_row_logprob(data)
    if defensive == 1.0:
        return lq0
    out = np.empty(data.n_rows)
    log_z = data.row_log_z.astype(np.float64)
    for a in range(0, data.n_rows, chunk):
        rows = range(a, min(a + chunk, data.n_rows))
        allowed = [data.allowed(r) for r in rows]
        ids = [np.append(i.astype(np.int64), _NO_FEATURE_TOKEN) for i, _ in allowed]
        feats = [data.states[data.row_state[r]] for r in rows]
        lgs = controller.predict_log_gamma_batch(feats, ids, damped=True)
        for r, (tok_ids, lp), lg in zip(rows, allowed, lgs):
            lp = lp.astype(np.float64)
            stored = np.logaddexp.reduce(lp) if len(lp) else -np.inf
            rest = log_z[r] + np.log1p(-min(np.exp(stored - log_z[r]), 1.0)) \
                if stored < log_z[r] - 1e-7 else -np.inf
            norm = np.logaddexp(np.logaddexp.reduce(lp + lg[:-1]), rest + lg[-1])
            hit = np.flatnonzero(tok_ids == data.row_token[r])
            own = lg[hit[0]] if len(hit) else lg[-1]
            out[r] = float(data.row_lm_logprob[r]) + own - norm
    if defensive > 0.0:
        out = np.logaddexp(out + np.log1p(-defensive), lq0 + np.log(defensive))
    return out


def mixture_target_weights(data, row_logprobs, counts, scaled: bool = True) -> np.ndarray:
    """Per completion of a pool drawn from several proposals: its weight as a target sample
    by the balance heuristic, 1[x in L]·p(x) / Σ_k (n_k/N)·q_k(x), scaled to a largest weight
    of 1 (:func:`target_weights`' scale); ``scaled=False``: unscaled, so that their mean is an
    unbiased estimate of P(L).

    ``row_logprobs[k]``: per row, log q_k(token) under proposal k (for *every* completion of
    the pool, not only k's own); ``counts[k]``: how many completions proposal k drew. Each
    completion's own-proposal ratio p/q_own is unbiased too, but one completion that masking
    drew where SHIM would have put far more mass then carries a huge weight and the pool's
    ESS stays that of the worst proposal; the balance heuristic bounds every weight by the
    best proposal's ratio (Veach & Guibas 1995)."""
    counts = np.asarray(counts, dtype=np.float64)
    if len(row_logprobs) != len(counts) or not len(counts) or np.any(counts <= 0):
        raise ValueError(f"one positive count per proposal is needed, got {len(row_logprobs)} "
                         f"proposals and counts {counts.tolist()}")
    if counts.sum() != data.n_completions:
        raise ValueError(f"the counts add up to {int(counts.sum())} completions but the pool "
                         f"holds {data.n_completions}")
    valid = np.asarray(data.valid, dtype=bool)
    if not valid.any():
        return np.zeros(data.n_completions)
    per = [np.bincount(data.row_completion, weights=np.asarray(lq, dtype=np.float64),
                       minlength=data.n_completions) for lq in row_logprobs]
    log_mix = np.logaddexp.reduce(np.stack(per) + np.log(counts / counts.sum())[:, None],
                                  axis=0)
    log_p = np.bincount(data.row_completion, weights=data.row_lm_logprob.astype(np.float64),
                        minlength=data.n_completions)
    lw = log_p - log_mix
    w = np.exp(lw - lw[valid].max()) if scaled else np.exp(np.minimum(lw, 50.0))
    return np.where(valid, w, 0.0)


def effective_sample_size(weights: np.ndarray) -> float:
    """(Σw)² / Σw²: how many target samples the weighted completions are worth."""
    w = np.asarray(weights, dtype=np.float64)
    s2 = float(np.sum(w * w))
    return float(w.sum() ** 2 / s2) if s2 > 0 else 0.0


def next_value(controller, data, fallback: np.ndarray) -> np.ndarray:
    """Per row (h, t): Σ_{t' allowed at h·t} p(t' | h·t)·γ̂(h·t·t') from the controller's raw
    (undamped) γ̂, read off the next row of the same completion (its stored allowed set; γ̂ of
    EOS is 1). Rows whose token is EOS get 1; rows with no next row get ``fallback``."""
    eos = set(int(e) for e in data.manifest.get("eos_token_ids", []))
    order = _row_order(data)
    comp = data.row_completion[order]
    has_next = np.zeros(data.n_rows, dtype=bool)
    has_next[:-1] = (comp[1:] == comp[:-1]) & (data.row_step[order][1:] ==
                                              data.row_step[order][:-1] + 1)
    out = np.asarray(fallback, dtype=np.float64).copy()
    rows, nexts = order[has_next], order[np.flatnonzero(has_next) + 1]
    feats = [data.states[s] for s in data.row_state[nexts]]
    allowed = [data.allowed(r) for r in nexts]
    chunk = 4096
    for a in range(0, len(rows), chunk):
        lg = controller.predict_log_gamma_batch(feats[a:a + chunk],
                                                [ids for ids, _ in allowed[a:a + chunk]],
                                                damped=False)
        for k, (g, (_, lp)) in enumerate(zip(lg, allowed[a:a + chunk])):
            out[rows[a + k]] = float(np.exp(np.logaddexp.reduce(lp.astype(np.float64) + g)))
    out[np.isin(data.row_token, list(eos))] = 1.0
    return np.clip(out, 0.0, 1.0)


@dataclass
class Targets:
    """What a controller is fitted on: the rows, their labels and completion weights."""

    kind: str
    data: object  #: TrainingData
    y: np.ndarray  #: one label in [0, 1] per row
    completion_weight: np.ndarray  #: per completion, for the held-out criterion
    #: Fraction of rows whose importance label exceeded 1 and was clipped (SHIM proposals).
    clipped_fraction: float = 0.0
    #: P(L) from every completion (the balance heuristic's mean weight), for pooled draws.
    p_valid_estimate: float | None = None

    @property
    def effective_target_samples(self) -> float:
        return effective_sample_size(self.completion_weight)


def make_targets(kind: str, data, make_controller: Callable[[], object] | None = None, *,
                 rounds: int = 1) -> Targets:
    """Labels of ``kind`` (``"final"``, ``"rollout"``, ``"bootstrap"``) for ``data``.

    ``final`` needs unconstrained data; ``rollout`` needs data from valid-only proposals
    (masked or SHIM completions, or a pool of them); ``bootstrap`` needs masked data and fits
    ``make_controller()`` ``rounds`` times, each on the previous round's next-step values.
    """
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target {kind!r}; choose one of {', '.join(TARGET_KINDS)}")
    parts = _proposal_parts(data)
    if kind == "final":
        if parts != {"lm"}:
            raise ValueError("the 'final' target labels unconstrained completions by their "
                             f"validity; this data was sampled with proposal={proposal_of(data)!r}")
        return Targets(kind, data, np.asarray(data.row_label, dtype=np.float64),
                       target_weights(data))
    if not parts <= set(VALID_ONLY_PROPOSALS):
        raise ValueError(f"the {kind!r} target needs masked or SHIM completions "
                         f"(sample_training_data(..., proposal='masked')); this data was sampled "
                         f"with proposal={proposal_of(data)!r}")
    if kind == "bootstrap" and parts != {"masked"}:
        raise ValueError("the 'bootstrap' target regresses on masked completions only "
                         f"(proposal='masked'); this data is {proposal_of(data)!r}")
    y, clipped = importance_labels(data)
    weights = target_weights(data)
    if kind == "bootstrap":
        if make_controller is None:
            raise ValueError("the 'bootstrap' target needs make_controller (a factory of "
                             "unfitted controllers) to fit its value estimates")
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        for _ in range(rounds):
            current = make_controller().fit(data, y=y, completion_weight=weights)
            y = next_value(current, data, fallback=y)
    return Targets(kind, data, y, weights, clipped)
