"""Training targets for γ̂: the paper's 0/1 final validity, and two lower-variance soft targets.

With V(h) = P(the LM's continuation of prefix h ends in L) and Z(h) = the LM mass of the tokens
the masker allows at h, SHIM's controller estimates γ(t | h) = V(h·t). Three targets:

- ``"final"`` (paper): unconstrained completions, every row labelled 1 if the finished output is
  in L, else 0. Unbiased for V(h·t), but a single Bernoulli outcome of the whole future.
- ``"rollout"``: *masked* completions. Along a masked path the probability is p(x)/∏ Z, so
  V(h·t) = E_masked[∏_{j>i} Z(x<j)] (DESIGN.md section 2): each row's soft label is the product of
  the allowed masses at the later steps of its own completion, in (0, 1]. Masked samples are
  always valid, and the rows are exactly the states masked decoding visits.
- ``"bootstrap"``: fitted value iteration on the same masked rows. V(h·t) = Σ_{t'} p(t'|h·t)·
  V(h·t·t') over the allowed t' at the next step, so the controller is regressed onto the
  allowed-mass-weighted γ̂ of the next step (its own estimate), starting from the rollout fit.
  The target no longer depends on which next token was sampled.

Masked completions are not samples of the target p(x | G); as samples of it their importance
weight is p(x)·1[x in L] / q_mask(x) ∝ ∏_i Z(x<i) (:func:`target_weights`), which the held-out
β criterion uses so that it stays an estimate of KL(target || q_β).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

#: The target kinds :func:`make_targets` (and ``fit_controller(target=...)``) accept.
TARGET_KINDS = ("final", "rollout", "bootstrap")


def proposal_of(data) -> str:
    """``"lm"`` (unconstrained) or ``"masked"``: how the data's completions were sampled."""
    return str(data.manifest.get("sampling", {}).get("proposal", "lm"))


def _row_order(data) -> np.ndarray:
    """Rows sorted by (completion, step): each completion's rows become one ordered run."""
    return np.lexsort((data.row_step, data.row_completion))


def completion_log_z(data) -> np.ndarray:
    """Σ log Z over each completion's replayed rows (log ∏ Z along the completion)."""
    return np.bincount(data.row_completion, weights=data.row_log_z.astype(np.float64),
                       minlength=data.n_completions)


def rollout_labels(data) -> np.ndarray:
    """Per row: ∏ Z over the *later* rows of its completion (1 at the last row, EOS).

    An unbiased estimate of V(h·t) when the completions are masked samples that reached EOS;
    rows of a truncated completion (no EOS) get NaN -- their future is unknown."""
    order = _row_order(data)
    comp = data.row_completion[order]
    logz = data.row_log_z[order].astype(np.float64)
    # suffix sums within each completion, excluding the row itself
    total = np.bincount(comp, weights=logz, minlength=data.n_completions)
    inclusive = np.cumsum(logz)
    start = np.searchsorted(comp, comp, side="left")
    before = inclusive - logz - np.where(start > 0, inclusive[start - 1], 0.0)
    later = total[comp] - before - logz
    y = np.empty(data.n_rows)
    y[order] = np.exp(np.minimum(later, 0.0))
    y[data.truncated[data.row_completion]] = np.nan
    return y


def target_weights(data) -> np.ndarray:
    """Per completion: its weight as a sample of the target p(x | G) (held-out criterion).

    Unconstrained samples: 1 if valid, else 0. Masked samples: ∏ Z (p(x)/q_mask(x) up to the
    constant V(root)), scaled so the largest weight is 1; 0 if not valid."""
    valid = np.asarray(data.valid, dtype=bool)
    if proposal_of(data) != "masked":
        return valid.astype(np.float64)
    lz = completion_log_z(data)
    if not valid.any():
        return np.zeros(data.n_completions)
    w = np.exp(lz - lz[valid].max())
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
    data: object  #: TrainingData (truncated masked completions dropped)
    y: np.ndarray  #: one label in [0, 1] per row
    completion_weight: np.ndarray  #: per completion, for the held-out criterion

    @property
    def effective_target_samples(self) -> float:
        return effective_sample_size(self.completion_weight)


def make_targets(kind: str, data, make_controller: Callable[[], object] | None = None, *,
                 rounds: int = 1) -> Targets:
    """Labels of ``kind`` (``"final"``, ``"rollout"``, ``"bootstrap"``) for ``data``.

    ``final`` needs unconstrained data; ``rollout`` and ``bootstrap`` need masked data
    (``sample_training_data(..., proposal="masked")``). ``bootstrap`` fits
    ``make_controller()`` ``rounds`` times, each on the previous round's next-step values.
    """
    if kind not in TARGET_KINDS:
        raise ValueError(f"unknown target {kind!r}; choose one of {', '.join(TARGET_KINDS)}")
    proposal = proposal_of(data)
    if kind == "final":
        if proposal != "lm":
            raise ValueError("the 'final' target labels unconstrained completions by their "
                             f"validity; this data was sampled with proposal={proposal!r}")
        return Targets(kind, data, np.asarray(data.row_label, dtype=np.float64),
                       target_weights(data))
    if proposal != "masked":
        raise ValueError(f"the {kind!r} target needs masked completions "
                         f"(sample_training_data(..., proposal='masked')); this data was sampled "
                         f"with proposal={proposal!r}")
    keep = np.flatnonzero(~np.asarray(data.truncated, dtype=bool))
    if len(keep) < data.n_completions:
        data = data.subset(keep)
    y = rollout_labels(data)
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
    return Targets(kind, data, y, weights)
