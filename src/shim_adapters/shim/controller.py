"""SHIM controllers: estimate γ(t) = P(the LM's continuation ends in L | prefix·t).

Three controllers in scikit-learn's estimator shape (hyper-parameters in ``__init__``,
learning in ``fit``, learned attributes end in ``_``):

- :class:`LR_NT`: logistic regression over the candidate token alone (no parser access);
- :class:`LR_FULL`: logistic regression over state features, token and state x token crosses;
- :class:`MLP`: state + token one-hots -> 64 -> 32 -> 1, ReLU (torch), fitted on soft labels.

All three share one scoring path: a first layer that is a sum of embedding rows (width 1 for
the LRs, 64 for the MLP). The state's rows are summed once per step
(:meth:`Controller.encode_state`), the allowed tokens' rows are one gather, so
:meth:`Controller.predict_log_gamma` is vectorised over the allowed set, and tokens with no
feature of their own (unseen in training) share one value computed once.

Fitting follows docs/design.md: row-level log-loss picks the wrong controller, because only
the contrast between tokens within one step survives renormalisation. Regularisation and the
damping exponent β (SHIM adds β·log γ̂) are therefore chosen jointly on held-out completions
(GroupKFold by completion, never by row) by the held-out log-likelihood of the tokens actually
sampled in *valid* completions under the corrected per-step distribution
``q_β(t) ∝ p(t)·γ̂(t)^β`` over the allowed set. Valid unconstrained samples are samples of the
target, so this is KL(target || q_β) up to a constant; β = 0 is plain masking, so the gain over
masking is reported (``contrast_gain_per_step_``). Held-out row log-loss and a reliability table
are reported as well. γ̂(EOS) is exactly 1 wherever the masker allows EOS (the output is then
complete and in L), so EOS is never re-weighted.

Labels may be soft (in [0, 1]); identical (state, token) rows are aggregated with weights,
which keeps fitting 1,000 completions within seconds.
"""

from __future__ import annotations

import copy
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.exceptions import ConvergenceWarning

from shim_adapters.mask.protocol import StateFeatures
from shim_adapters.shim.features import EncodedState, FeatureEncoder
from shim_adapters.shim.targets import target_weights

log = logging.getLogger(__name__)

#: A held-out gain below this (nats per target sample) is noise whatever its SE says: the
#: controller falls back to masking (a gain of 1e-7 ± 6e-8 once "passed" 1 SE).
MIN_GAIN_NATS = 1e-3
#: β values tried when fitting the damping exponent (up to 4: token-only fits chose 3, the old
#: edge, on the shipped LM's bv4).
DEFAULT_BETA_GRID = tuple(float(b) for b in np.round(np.arange(0.0, 4.0001, 0.05), 4))


def log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


@dataclass
class _Rows:
    """Aggregated design: one row per distinct (state, token, fold-set) with weights."""

    X: sp.csr_matrix
    y: np.ndarray  # soft label (weighted mean)
    w: np.ndarray  # total weight


def _aggregate(X: sp.csr_matrix, key: np.ndarray, y: np.ndarray) -> _Rows:
    """Merge rows with the same (state, token) key: weight = count, label = mean label."""
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    w = np.bincount(inverse).astype(np.float64)
    ys = np.bincount(inverse, weights=y) / w
    return _Rows(X[first], ys, w)


def _segment_logsumexp(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    m = np.maximum.reduceat(values, starts)
    seg = np.repeat(np.arange(len(starts)), np.diff(np.append(starts, len(values))))
    return m + np.log(np.add.reduceat(np.exp(values - m[seg]), starts))


class Controller:
    """Shared fitting, selection and vectorised scoring; subclasses define the model."""

    #: Feature groups the encoder emits for this controller.
    feature_groups: tuple[str, ...] = ("state", "token", "cross")
    kind: str = "controller"

    def __init__(self, reg_grid: Sequence[float] = (0.01, 0.1, 1.0, 10.0, 100.0),
                 beta_grid: Sequence[float] = DEFAULT_BETA_GRID, n_splits: int = 3,
                 parser_top_k: int = 3, min_cross_count: int = 2, random_state: int = 0,
                 min_gain_se: float = 1.0, min_target_samples: float = 10.0,
                 text_ngrams: int = 0):
        self.reg_grid = tuple(reg_grid)
        self.beta_grid = tuple(beta_grid)
        self.n_splits = n_splits
        self.parser_top_k = parser_top_k
        self.min_cross_count = min_cross_count
        self.random_state = random_state
        self.min_gain_se = min_gain_se
        #: Below this effective number of held-out target samples the gain and its SE are
        #: not trusted (one valid completion has SE 0): the fit falls back to masking.
        self.min_target_samples = min_target_samples
        #: Text features of the tokens (:mod:`shim_adapters.shim.features`): longest byte
        #: n-gram; 0: token ids only.
        self.text_ngrams = int(text_ngrams)

    # ---- hyper-parameters -----------------------------------------------------------------
    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """Constructor parameters, as scikit-learn's ``clone`` expects: the very objects
        ``__init__`` stored (no nested estimators, so ``deep`` changes nothing)."""
        import inspect

        names = [n for n in inspect.signature(type(self).__init__).parameters if n != "self"]
        params = {name: getattr(self, name) for name in names}
        if not params.get("text_ngrams", 0):  # absent at 0: versions without text features
            params.pop("text_ngrams", None)   # still load artefacts that use none
        return params

    def set_params(self, **params: Any) -> "Controller":
        """Set constructor parameters (scikit-learn convention); unknown names are refused."""
        valid = self.get_params()
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise ValueError(f"{type(self).__name__} has no parameter(s) {unknown}; valid: "
                             f"{', '.join(valid)}")
        merged = {**valid, **params}
        fresh = type(self)(**merged)  # the constructor's own normalisation (grids -> tuples)
        for name in params:
            setattr(self, name, getattr(fresh, name))
        return self

    def _new_encoder(self) -> FeatureEncoder:
        return FeatureEncoder(groups=self.feature_groups, parser_top_k=self.parser_top_k,
                              min_cross_count=self.min_cross_count,
                              text_ngrams=self.text_ngrams)

    # ---- model hooks (subclasses) ---------------------------------------------------------
    def _fit_model(self, rows: _Rows, reg: float, n_features: int) -> dict[str, np.ndarray]:
        """Fit on aggregated rows; return the weights as numpy arrays."""
        raise NotImplementedError

    def _head(self, weights: dict[str, np.ndarray], pre: np.ndarray) -> np.ndarray:
        """Logits from first-layer pre-activations ``pre`` (n, width)."""
        raise NotImplementedError

    # ---- fitting --------------------------------------------------------------------------
    def fit(self, data, y: np.ndarray | None = None,
            completion_weight: np.ndarray | None = None,
            completion_group: np.ndarray | None = None) -> "Controller":
        """Fit on a :class:`~shim_adapters.shim.training_data.TrainingData` (soft ``y`` optional).

        ``y`` overrides ``data.row_label`` (one value in [0, 1] per row).
        ``completion_weight`` (one value >= 0 per completion) is each completion's weight as a
        sample of the target p(x | G) in the held-out criterion; the default, ``data.valid``, is
        right for unconstrained samples. Masked samples need importance weights
        (:func:`shim_adapters.shim.targets.target_weights`). ``completion_group`` (one label per
        completion, e.g. the prompt it answers): cross-validation holds out whole groups, so the
        held-out criterion and the fallback judge unseen groups (with >= 2 groups among the
        completions with rows; else completions are held out). Runs on one core
        (BLAS and torch pinned to one thread: more threads only contend on a busy machine).
        """
        import torch
        from threadpoolctl import threadpool_limits

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with threadpool_limits(limits=1), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", ConvergenceWarning)
                self._fit(data, y, completion_weight, completion_group)
        finally:
            torch.set_num_threads(threads)
        self.n_convergence_warnings_ = sum(issubclass(w.category, ConvergenceWarning)
                                           for w in caught)
        return self

    def _fit(self, data, y: np.ndarray | None, completion_weight: np.ndarray | None = None,
             completion_group: np.ndarray | None = None) -> None:
        from sklearn.model_selection import GroupKFold

        t0 = time.perf_counter()
        y = np.asarray(data.row_label if y is None else y, dtype=np.float64)
        if y.shape != (data.n_rows,):
            raise ValueError(f"y has shape {y.shape}; expected one label per row ({data.n_rows})")
        if np.any((y < 0) | (y > 1)) or not np.all(np.isfinite(y)):
            raise ValueError("labels must lie in [0, 1]")
        if data.n_rows == 0:
            raise ValueError("no training rows: every completion was rejected at its first token")
        cw = np.asarray(data.valid if completion_weight is None else completion_weight,
                        dtype=np.float64)
        if cw.shape != (data.n_completions,) or np.any(cw < 0) or not np.all(np.isfinite(cw)):
            raise ValueError(f"completion_weight must hold one finite value >= 0 per completion "
                             f"({data.n_completions}), got shape {cw.shape}")
        self.eos_token_ids_ = np.array(sorted(int(e) for e in data.manifest.get(
            "eos_token_ids", [])), dtype=np.int64)
        texts = data.manifest.get("token_texts")
        self.encoder_ = self._new_encoder().fit(
            data.states, data.row_state, data.row_token,
            token_texts=None if texts is None else {int(k): v for k, v in texts.items()})
        encoded = [self.encoder_.encode_state(s) for s in data.states]
        X = self.encoder_.transform_encoded(encoded, data.row_state, data.row_token)
        key = data.row_state.astype(np.int64) * (int(data.row_token.max()) + 1) + data.row_token
        groups = data.row_completion
        #: What cross-validation holds out: ``"completions"`` or ``"groups"`` (whole prompts).
        self.cv_groups_ = "completions"
        if completion_group is not None:
            cg = np.asarray(completion_group)
            if cg.shape != (data.n_completions,):
                raise ValueError(f"completion_group must hold one label per completion "
                                 f"({data.n_completions}), got shape {cg.shape}")
            if len(np.unique(cg[groups])) >= 2:
                groups = cg[groups]
                self.cv_groups_ = "groups"
        n_groups = len(np.unique(groups))
        n_splits = min(self.n_splits, n_groups)
        contrast = _ContrastSet.from_data(data, self.encoder_, encoded, self._eos_set(),
                                          completion_weight=cw)
        betas = np.asarray(self.beta_grid, dtype=np.float64)

        scores = np.zeros((len(self.reg_grid), len(betas)))
        # held-out log q_β(x) of each completion (each is held out exactly once)
        per_completion = np.zeros((len(self.reg_grid), len(betas), data.n_completions))
        oof = np.zeros((len(self.reg_grid), data.n_rows))
        if n_splits < 2:
            raise ValueError(f"cross-validation needs >= 2 completions with rows, got {n_groups}")
        splitter = GroupKFold(n_splits=n_splits, shuffle=True, random_state=self.random_state)
        for train, test in splitter.split(X, y, groups):
            rows = _aggregate(X[train], key[train], y[train])
            held_comp = np.unique(data.row_completion[test])
            for r, reg in enumerate(self.reg_grid):
                w = self._fit_model(rows, reg, X.shape[1])
                oof[r, test] = self._logits(w, X[test])
                ll = contrast.loglik_per_completion(lambda Xp: self._logits(w, Xp), betas,
                                                    completions=held_comp)
                per_completion[r][:, held_comp] = ll
                scores[r] += ll @ cw[held_comp]
        best_r, best_b = np.unravel_index(np.argmax(scores), scores.shape)
        self._record_heldout(per_completion, cw, betas, best_r, best_b)
        if self.falls_back_to_masking_:
            best_b = 0  # no (significant) held-out gain over masking: do not re-weight at all
            log.warning("%s: %s", self.kind, self.decision_)
        #: Per completion: held-out log q(x) under the chosen (reg, β) (cross-validated).
        self.heldout_per_completion_ = per_completion[best_r, best_b].copy()
        #: The chosen regularisation lies on an edge of ``reg_grid`` (widen it if it does).
        self.reg_on_grid_edge_ = bool(len(self.reg_grid) > 1 and
                                      best_r in (0, len(self.reg_grid) - 1))
        self.reg_ = float(self.reg_grid[best_r])
        self.beta_ = float(betas[best_b])
        self.cv_scores_ = scores
        # float32 is what the artefact stores: keep in memory exactly what a reload gives
        self.weights_ = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in
                         self._fit_model(_aggregate(X, key, y), self.reg_, X.shape[1]).items()}
        self.n_features_in_ = X.shape[1]
        p = 1.0 / (1.0 + np.exp(-oof[best_r]))
        self.cv_log_loss_ = _log_loss(y, p)
        self.cv_reliability_ = reliability_table(y, p)
        self.contrast_steps_ = contrast.n_steps()
        self.contrast_gain_per_step_ = float((scores[best_r, best_b] - scores[best_r, 0]) /
                                             max(self.contrast_steps_, 1)) if betas[0] == 0 else \
            float("nan")
        self.n_rows_ = int(data.n_rows)
        self.n_completions_ = int(data.n_completions)
        self.valid_fraction_ = float(np.mean(data.valid))
        self.fit_seconds_ = time.perf_counter() - t0
        self._prepare()

    def _eos_set(self) -> np.ndarray:
        return self.eos_token_ids_

    def heldout_loglik(self, data, completions: np.ndarray,
                       completion_weight: np.ndarray | None = None) -> np.ndarray:
        """Per completion in ``completions``: log q_β(x) under this fitted controller (its
        own β) over the steps of ``data`` that have a choice (forced steps add 0), the same
        quantity as the cross-validated ``heldout_per_completion_``, for data it never saw."""
        cw = target_weights(data) if completion_weight is None else completion_weight
        encoded = [self.encoder_.encode_state(s) for s in data.states]
        contrast = _ContrastSet.from_data(data, self.encoder_, encoded, self._eos_set(),
                                          completion_weight=cw)
        completions = np.asarray(completions)
        return contrast.loglik_per_completion(lambda X: self._logits(self.weights_, X),
                                              np.array([self.beta_]), completions)[0]

    def _record_heldout(self, per_completion: np.ndarray, cw: np.ndarray, betas: np.ndarray,
                        best_r: int, best_b: int) -> None:
        """Held-out score of masking vs the best (reg, β), and the decision to fall back.

        With target-weighted completions, E_target[log q_β(x) - log q_0(x)] is exactly
        KL(target || masking) - KL(target || q_β): the gain is an estimate of how much KL the
        correction removes. It must exceed ``min_gain_se`` standard errors (weighted, paired
        per completion) or the controller falls back to β = 0, i.e. plain masking."""
        total = float(cw.sum())
        ess = total ** 2 / float(np.sum(cw ** 2)) if total > 0 else 0.0
        self.heldout_effective_samples_ = ess
        has_masking = bool(len(betas) and betas[0] == 0)
        if total <= 0:
            mask_score = best_score = gain = se = float("nan")
        else:
            p = cw / total
            best_score = float(per_completion[best_r, best_b] @ p)
            mask_score = float(per_completion[best_r, 0] @ p) if has_masking else float("nan")
            d = per_completion[best_r, best_b] - per_completion[best_r, 0]
            gain = float(d @ p) if has_masking else float("nan")
            se = float(np.sqrt(np.sum(p ** 2 * (d - gain) ** 2))) if has_masking else float("nan")
        self.heldout_score_masking_ = mask_score
        self.heldout_score_best_ = best_score
        self.heldout_kl_gain_ = gain
        self.heldout_kl_gain_se_ = se
        self.heldout_weight_ = total
        self.heldout_best_beta_ = float(betas[best_b]) if len(betas) else float("nan")
        #: Why the fit fell back: ``"no_target_samples"``, ``"low_target_samples"`` (the
        #: evidence is too thin to judge: more samples may decide), ``"no_gain"``; None if not.
        self.fallback_reason_ = None
        # with a prompt set the folds hold out whole prompts (cv_groups_ "groups")
        held_out = "prompts" if getattr(self, "cv_groups_", "") == "groups" else "completions"
        if not has_masking:
            self.falls_back_to_masking_ = False
            self.decision_ = "β grid has no 0: masking was not a candidate"
        elif not total > 0:
            self.falls_back_to_masking_ = True
            self.fallback_reason_ = "no_target_samples"
            self.decision_ = ("correction does not help: no held-out completion is a sample of "
                              "the target; falling back to β=0 (plain masking)")
        elif ess < self.min_target_samples:
            self.falls_back_to_masking_ = True
            self.fallback_reason_ = "low_target_samples"
            self.decision_ = (f"correction not trusted: only {ess:.3g} effective held-out target "
                              f"samples (needs >= {self.min_target_samples:g}; best β "
                              f"{betas[best_b]:g} would gain {gain:.3g} ± {se:.3g} nats); "
                              f"falling back to β=0 (plain masking)")
        elif best_b == 0 or not gain > max(self.min_gain_se * se, MIN_GAIN_NATS):
            self.falls_back_to_masking_ = True
            self.fallback_reason_ = "no_gain"
            self.decision_ = (f"correction does not help on held-out {held_out} (best β "
                              f"{betas[best_b]:g} gains {gain:.3g} ± {se:.3g} nats per target "
                              f"sample, needs > {self.min_gain_se:g} SE and > "
                              f"{MIN_GAIN_NATS:g}); falling back to β=0 "
                              f"(plain masking)")
        else:
            self.falls_back_to_masking_ = False
            self.decision_ = (f"correction helps: β {betas[best_b]:g} gains {gain:.3g} ± "
                              f"{se:.3g} nats per target sample over masking on held-out "
                              f"{held_out}")

    def untrusted_candidate(self) -> "Controller":
        """A copy scoring at the best held-out β even where that β was not trusted.

        For drawing more evidence only (``fit_controller``'s top-ups when the held-out target
        ESS is too small): this controller keeps its own β and its fallback decision."""
        if not hasattr(self, "heldout_best_beta_"):
            raise ValueError(f"{type(self).__name__} is not fitted: call fit() first")
        candidate = copy.copy(self)
        candidate.__dict__.pop("_gamma_caches", None)  # the γ caches hold this β's values
        candidate._cross_rows = {}
        candidate.beta_ = float(self.heldout_best_beta_)
        candidate.falls_back_to_masking_ = False
        candidate.fallback_reason_ = None
        candidate.decision_ = (f"untrusted candidate at β {candidate.beta_:g} (the fit's own "
                               f"decision: {self.decision_})")
        return candidate

    # ---- scoring --------------------------------------------------------------------------
    def _prepare(self) -> None:
        """Split the first-layer weights into blocks for scoring (after fit or load)."""
        E = self.weights_["embed"]
        enc = self.encoder_
        self._E_state = E[: enc.n_state_]
        n_st = enc.n_state_ + enc.n_token_
        token_rows = E[enc.n_state_: n_st]
        if enc.n_text_:  # a token's text features are static: fold them into its row
            text = E[n_st + enc.n_cross_: n_st + enc.n_cross_ + enc.n_text_]
            token_rows = token_rows + np.asarray(enc.token_text_matrix_ @ text, dtype=E.dtype)
        # one extra zero row so that "no such feature" (-1) gathers zeros
        self._E_token = np.vstack([token_rows, np.zeros((1, E.shape[1]), dtype=E.dtype)])
        self._E_cross = np.vstack([E[n_st: n_st + enc.n_cross_],
                                   np.zeros((1, E.shape[1]), dtype=E.dtype)])
        self._E_text_cross = E[n_st + enc.n_cross_ + enc.n_text_:]
        self._text_cross_rows: dict[int, np.ndarray] = {}
        self._bias = self.weights_["embed_bias"]
        self._eos = set(int(e) for e in self.eos_token_ids_)
        self._eos_sorted = sorted(self._eos)
        # the tokens that can differ from the shared value: known tokens and EOS
        ids = np.union1d(enc.token_vocab_, np.asarray(self.eos_token_ids_, dtype=np.int64))
        self.scored_token_ids_ = ids.astype(np.int64)
        self._scored_token_columns = enc.token_columns(self.scored_token_ids_)
        self._scored_pre_token = self._E_token[self._scored_token_columns]
        self._scored_is_eos = np.isin(self.scored_token_ids_, self.eos_token_ids_)
        self._cross_rows: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # the γ caches adjusters share (gamma_cache.shared_gamma_cache) hold the previous
        # fit's values: new adjusters start a fresh one
        self.__dict__.pop("_gamma_caches", None)

    def _logits(self, weights: dict[str, np.ndarray], X: sp.csr_matrix) -> np.ndarray:
        pre = X @ weights["embed"] + weights["embed_bias"]
        return self._head(weights, np.asarray(pre))

    def encode_state(self, features: StateFeatures) -> tuple[EncodedState, np.ndarray]:
        """The per-step part: encoded state and its summed first-layer pre-activation."""
        enc = self.encoder_.encode_state(features)
        return enc, self._bias + self._E_state[enc.state_columns].sum(axis=0)

    def _row_parts(self, features: StateFeatures, allowed: np.ndarray):
        """(seen positions, their first-layer pre-activations, the state-only pre-activation).

        Only tokens with a column of their own can carry token or cross weight (the encoder
        keeps crosses of known tokens only), so every other allowed token shares one value."""
        enc, state_pre = self.encode_state(features)
        tok = self.encoder_.token_columns(allowed)
        seen = np.flatnonzero(tok >= 0)
        pre = self._E_token[tok[seen]]
        if self.encoder_.n_cross_ and len(enc.cross_keys) and len(seen):
            cc = self.encoder_.cross_columns(enc.cross_keys, allowed[seen])
            pre = pre + self._E_cross[cc].sum(axis=0)
        if self.encoder_.n_text_cross_ and len(seen):
            for key in enc.cross_keys.tolist():
                pre = pre + self._text_cross_of(key)[tok[seen]]
        return seen, state_pre[None, :] + pre, state_pre[None, :]

    def _text_cross_of(self, cross_key: int) -> np.ndarray:
        """Per token column (and a zero row for -1): the summed weight rows of its n-grams'
        pairs with one cross key (cached per key, as :meth:`_cross_rows_of`)."""
        hit = self._text_cross_rows.get(cross_key)
        if hit is None:
            enc = self.encoder_
            owner, cols = enc.text_cross_columns(cross_key, np.arange(enc.n_token_))
            hit = np.zeros((enc.n_token_ + 1, self._E_token.shape[1]), dtype=np.float64)
            np.add.at(hit, owner, self._E_text_cross[cols])
            if len(self._text_cross_rows) < 1 << 12:
                self._text_cross_rows[cross_key] = hit
        return hit

    def _cross_rows_of(self, cross_key: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions (in ``scored_token_ids_``) and weight rows of one cross key's pairs.

        Cross keys recur far more often than whole states, so this is cached per key."""
        hit = self._cross_rows.get(cross_key)
        if hit is None:
            cc = self.encoder_.cross_columns(np.array([cross_key], dtype=np.uint64),
                                             self.scored_token_ids_)[0]
            pos = np.flatnonzero(cc >= 0)
            hit = (pos, self._E_cross[cc[pos]])
            if len(self._cross_rows) < 1 << 16:
                self._cross_rows[cross_key] = hit
        return hit

    def state_log_gamma(self, features: StateFeatures, damped: bool = True
                        ) -> tuple[float, np.ndarray]:
        """The whole vocabulary's β·log γ̂ at one state, independent of the allowed set.

        Returns ``(shared, values)``: ``shared`` is the value of every token without a feature
        of its own, ``values[i]`` the value of ``scored_token_ids_[i]`` (EOS: exactly 0). For
        an allowed token it equals :meth:`predict_log_gamma`'s value, so one call serves every
        visit of the state whatever the mask (SHIM's γ cache stores it)."""
        enc, state_pre = self.encode_state(features)
        return self.encoded_log_gamma(enc, state_pre, damped)

    def encoded_log_gamma(self, enc: EncodedState, state_pre: np.ndarray, damped: bool = True
                          ) -> tuple[float, np.ndarray]:
        """:meth:`state_log_gamma` from :meth:`encode_state`'s output."""
        pre = np.empty((len(self.scored_token_ids_) + 1, state_pre.shape[0]),
                       dtype=np.float64)
        np.add(self._scored_pre_token, state_pre, out=pre[:-1])
        pre[-1] = state_pre
        if self.encoder_.n_cross_:
            for key in enc.cross_keys.tolist():
                pos, rows = self._cross_rows_of(key)
                if len(pos):
                    pre[pos] += rows  # positions are unique within one key
        if self.encoder_.n_text_cross_:
            for key in enc.cross_keys.tolist():
                pre[:-1] += self._text_cross_of(key)[self._scored_token_columns]
        lg = log_sigmoid(self._head(self.weights_, pre))
        if damped:
            lg *= self.beta_
        values = lg[:-1]
        values[self._scored_is_eos] = 0.0
        return float(lg[-1]), values

    def predict_log_gamma(self, state_features: StateFeatures, allowed_token_ids: np.ndarray,
                          damped: bool = True) -> np.ndarray:
        """β·log γ̂ (or raw log γ̂ with ``damped=False``) for each allowed token; EOS -> 0."""
        return self.predict_log_gamma_batch([state_features], [allowed_token_ids], damped)[0]

    def _zero_eos(self, allowed: np.ndarray, values: np.ndarray) -> None:
        """γ̂(EOS) = 1 exactly: where the masker allows EOS the output is complete and in L."""
        n = len(allowed)
        for e in self._eos_sorted:
            pos = int(np.searchsorted(allowed, e))
            if pos < n and allowed[pos] == e:
                values[pos] = 0.0
            elif (pos == n or allowed[pos] > e) and (pos == 0 or allowed[pos - 1] < e):
                continue  # consistent with a sorted allowed set: EOS is absent
            else:
                values[allowed == e] = 0.0  # unsorted input: fall back to a scan

    def predict_log_gamma_batch(self, features: Sequence[StateFeatures],
                                allowed: Sequence[np.ndarray], damped: bool = True
                                ) -> list[np.ndarray]:
        """:meth:`predict_log_gamma` for many rows with one call of the model head."""
        parts, blocks = [], []
        for f, a in zip(features, allowed):
            a = np.asarray(a, dtype=np.int64)
            seen, pre_seen, pre_shared = self._row_parts(f, a)
            parts.append((a, seen))
            blocks.extend((pre_seen, pre_shared))
        if not parts:
            return []
        lg_all = log_sigmoid(self._head(self.weights_, np.concatenate(blocks)))
        if damped:
            lg_all *= self.beta_
        out, pos = [], 0
        for a, seen in parts:
            lg = np.full(len(a), lg_all[pos + len(seen)], dtype=np.float64)
            lg[seen] = lg_all[pos: pos + len(seen)]
            pos += len(seen) + 1
            self._zero_eos(a, lg)
            out.append(lg)
        return out

    def predict_log_gamma_rowwise(self, state_features: StateFeatures,
                                  allowed_token_ids: np.ndarray, damped: bool = True) -> np.ndarray:
        """Reference path: one sparse row per token through the full design matrix."""
        allowed = np.asarray(allowed_token_ids, dtype=np.int64)
        X = self.encoder_.transform([state_features], np.zeros(len(allowed), dtype=np.int64),
                                    allowed)
        out = log_sigmoid(self._logits(self.weights_, X))
        if damped:
            out *= self.beta_
        out[np.isin(allowed, self.eos_token_ids_)] = 0.0
        return out

    def predict_proba(self, X) -> np.ndarray:
        """(n, 2) probabilities [1-γ̂, γ̂] (undamped) for rows of X.

        X: a TrainingData (its rows) or a sequence of (StateFeatures, token_id) pairs.
        """
        if hasattr(X, "row_state"):
            M = self.encoder_.transform(X.states, X.row_state, X.row_token)
        else:
            pairs = list(X)
            M = self.encoder_.transform([s for s, _ in pairs], np.arange(len(pairs)),
                                        np.array([t for _, t in pairs], dtype=np.int64))
        p = 1.0 / (1.0 + np.exp(-self._logits(self.weights_, M)))
        return np.column_stack([1.0 - p, p])

    def predict(self, X) -> np.ndarray:
        """Class labels in the scikit-learn sense: 1 where γ̂ >= 0.5 (the continuation is
        predicted to stay grammatical), else 0. X as for :meth:`predict_proba`."""
        return (self.predict_proba(X)[:, 1] >= 0.5).astype(np.int64)

    def score(self, X, y=None, sample_weight=None) -> float:
        """Mean accuracy of :meth:`predict` (scikit-learn's classifier score). ``y``: 0/1 or
        soft labels (rounded at 0.5); default ``X.row_label`` for a TrainingData."""
        if y is None:
            if not hasattr(X, "row_label"):
                raise ValueError("score(X) needs y unless X is a TrainingData")
            y = X.row_label
        labels = (np.asarray(y, dtype=np.float64) >= 0.5).astype(np.int64)
        return float(np.average(self.predict(X) == labels, weights=sample_weight))

    # ---- persistence hooks ----------------------------------------------------------------
    def learned_summary(self) -> dict[str, Any]:
        """Training statistics for the artefact manifest."""
        return {"reg": self.reg_, "beta": self.beta_, "cv_log_loss": self.cv_log_loss_,
                "cv_reliability": self.cv_reliability_,
                "contrast_gain_per_step": self.contrast_gain_per_step_,
                "contrast_steps": self.contrast_steps_, "cv_scores": self.cv_scores_.tolist(),
                "n_rows": self.n_rows_, "n_completions": self.n_completions_,
                "valid_fraction": self.valid_fraction_, "fit_seconds": self.fit_seconds_,
                "n_convergence_warnings": getattr(self, "n_convergence_warnings_", 0),
                "n_features": int(self.n_features_in_),
                "heldout_score_masking": getattr(self, "heldout_score_masking_", None),
                "heldout_score_chosen": (getattr(self, "heldout_score_masking_", None)
                                         if getattr(self, "falls_back_to_masking_", False)
                                         else getattr(self, "heldout_score_best_", None)),
                "heldout_kl_gain": getattr(self, "heldout_kl_gain_", None),
                "heldout_kl_gain_se": getattr(self, "heldout_kl_gain_se_", None),
                "heldout_best_beta": getattr(self, "heldout_best_beta_", None),
                "heldout_effective_samples": getattr(self, "heldout_effective_samples_", None),
                "falls_back_to_masking": getattr(self, "falls_back_to_masking_", None),
                "fallback_reason": getattr(self, "fallback_reason_", None),
                "decision": getattr(self, "decision_", None),
                "reg_on_grid_edge": getattr(self, "reg_on_grid_edge_", None)}


class _LogisticBase(Controller):
    """L2 logistic regression (scikit-learn, lbfgs); ``reg_grid`` holds values of C."""

    def _fit_model(self, rows: _Rows, reg: float, n_features: int) -> dict[str, np.ndarray]:
        from sklearn.linear_model import LogisticRegression

        # soft labels: each row once as a positive (weight w·y) and once as a negative (w·(1-y))
        pos, neg = rows.y > 0, rows.y < 1
        X = sp.vstack([rows.X[pos], rows.X[neg]]).tocsr()
        lab = np.concatenate([np.ones(pos.sum()), np.zeros(neg.sum())])
        w = np.concatenate([rows.w[pos] * rows.y[pos], rows.w[neg] * (1 - rows.y[neg])])
        if len(np.unique(lab)) < 2:
            # every label identical: the constant model (log γ = log of that label, clipped)
            p = float(np.clip(lab.mean(), 1e-6, 1 - 1e-6))
            return {"embed": np.zeros((n_features, 1)), "embed_bias": np.array(
                [math.log(p / (1 - p))])}
        model = LogisticRegression(C=reg, solver="lbfgs", max_iter=1000, tol=1e-5)
        model.fit(X, lab, sample_weight=w)
        return {"embed": model.coef_.reshape(-1, 1).astype(np.float64),
                "embed_bias": model.intercept_.astype(np.float64)}

    def _head(self, weights, pre):
        return pre[..., 0]


class LR_NT(_LogisticBase):
    """Logistic regression over the candidate token alone (needs no parser state)."""

    feature_groups = ("token",)
    kind = "LR_NT"


class LR_FULL(_LogisticBase):
    """Logistic regression over state features, token and state x token crosses."""

    feature_groups = ("state", "token", "cross")
    kind = "LR_FULL"


class MLP(Controller):
    """State + token one-hots -> 64 -> 32 -> 1 with ReLU (torch; weights stored as numpy).

    ``reg_grid`` holds weight-decay values; training is minibatch AdamW on
    the aggregated rows with soft-label binary cross-entropy.
    """

    feature_groups = ("state", "token")
    kind = "MLP"

    def __init__(self, reg_grid: Sequence[float] = (1e-4, 1e-3), hidden: Sequence[int] = (64, 32),
                 epochs: int = 40, batch_size: int = 256, learning_rate: float = 3e-3,
                 beta_grid: Sequence[float] = DEFAULT_BETA_GRID, n_splits: int = 3,
                 parser_top_k: int = 3, min_cross_count: int = 2, random_state: int = 0,
                 min_gain_se: float = 1.0, min_target_samples: float = 10.0,
                 text_ngrams: int = 0):
        super().__init__(reg_grid=reg_grid, beta_grid=beta_grid, n_splits=n_splits,
                         parser_top_k=parser_top_k, min_cross_count=min_cross_count,
                         random_state=random_state, min_gain_se=min_gain_se,
                         min_target_samples=min_target_samples, text_ngrams=text_ngrams)
        self.hidden = tuple(hidden)
        self.epochs = epochs
        self.batch_size = batch_size
        self.learning_rate = learning_rate

    def _fit_model(self, rows: _Rows, reg: float, n_features: int) -> dict[str, np.ndarray]:
        import torch

        torch.manual_seed(self.random_state)
        h1, h2 = self.hidden
        embed = torch.nn.EmbeddingBag(n_features + 1, h1, mode="sum", padding_idx=n_features)
        with torch.no_grad():
            embed.weight.normal_(0.0, 0.1)
            embed.weight[n_features].zero_()
        bias = torch.nn.Parameter(torch.zeros(h1))
        head = torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(h1, h2), torch.nn.ReLU(),
                                   torch.nn.Linear(h2, 1))
        params = [embed.weight, bias, *head.parameters()]
        opt = torch.optim.AdamW(params, lr=self.learning_rate, weight_decay=reg)
        X = rows.X.tocsr()
        lens = np.diff(X.indptr)
        width = max(int(lens.max(initial=0)), 1)
        dense = np.full((X.shape[0], width), n_features, dtype=np.int64)  # padding row
        dense[np.repeat(np.arange(X.shape[0]), lens),
              np.arange(len(X.indices)) - np.repeat(X.indptr[:-1], lens)] = X.indices
        index = torch.from_numpy(dense)
        y = torch.from_numpy(rows.y.astype(np.float32))
        w = torch.from_numpy(rows.w.astype(np.float32))
        n = X.shape[0]
        gen = torch.Generator().manual_seed(self.random_state)
        mean_w = float(w.mean())
        for _ in range(self.epochs):
            perm = torch.randperm(n, generator=gen)
            for s in range(0, n, self.batch_size):
                b = perm[s: s + self.batch_size]
                logit = head(embed(index[b]) + bias).squeeze(-1)
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    logit, y[b], weight=w[b] / mean_w)
                opt.zero_grad()
                loss.backward()
                opt.step()
        lin1, lin2 = head[1], head[3]
        return {"embed": embed.weight.detach().numpy()[:n_features].astype(np.float64),
                "embed_bias": bias.detach().numpy().astype(np.float64),
                "w2": lin1.weight.detach().numpy().T.astype(np.float64),
                "b2": lin1.bias.detach().numpy().astype(np.float64),
                "w3": lin2.weight.detach().numpy().T.astype(np.float64),
                "b3": lin2.bias.detach().numpy().astype(np.float64)}

    def _head(self, weights, pre):
        h = np.maximum(pre, 0.0) @ weights["w2"] + weights["b2"]
        return (np.maximum(h, 0.0) @ weights["w3"] + weights["b3"])[..., 0]


#: Controller kinds by name (the CLI's ``--kind``).
CONTROLLERS: dict[str, type[Controller]] = {"LR_NT": LR_NT, "LR_FULL": LR_FULL, "MLP": MLP}


def make_controller(kind: str, **params) -> Controller:
    try:
        cls = CONTROLLERS[kind]
    except KeyError:
        raise ValueError(f"unknown controller kind {kind!r}; choose one of "
                         f"{', '.join(CONTROLLERS)}") from None
    return cls(**params)


# ---- held-out contrast criterion ---------------------------------------------------------
class _ContrastSet:
    """Allowed-set pairs of every row of the valid completions, for the β criterion."""

    def __init__(self, X: sp.csr_matrix, lm_logprob: np.ndarray, starts: np.ndarray,
                 chosen: np.ndarray, row_completion: np.ndarray, is_eos: np.ndarray):
        self.X, self.lm_logprob, self.starts = X, lm_logprob, starts
        self.chosen, self.row_completion, self.is_eos = chosen, row_completion, is_eos
        self._held: np.ndarray | None = None

    @classmethod
    def from_data(cls, data, encoder: FeatureEncoder, encoded: Sequence[EncodedState],
                  eos: np.ndarray, max_pairs_per_row: int = 256,
                  completion_weight: np.ndarray | None = None) -> "_ContrastSet":
        """Pairs of the valid completions' rows. Large allowed sets keep their
        ``max_pairs_per_row`` most likely tokens (and the sampled one); the rest of the
        stored allowed mass becomes one pair scored like a token with no features of its own,
        which bounds memory for 50k-token vocabularies."""
        cw = data.valid if completion_weight is None else np.asarray(completion_weight) > 0
        rows = np.flatnonzero(cw[data.row_completion])
        rows = rows[np.diff(data.allowed_offsets)[rows] > 1]  # forced steps: no contrast
        tail_token = int(data.allowed_token_ids.max(initial=0)) + 1  # never a real token
        tokens, lps, owner, is_chosen = [], [], [], []
        for k, r in enumerate(rows.tolist()):
            ids, lp = data.allowed(r)
            ids, lp = ids.astype(np.int64), lp.astype(np.float64)
            chosen = ids == data.row_token[r]
            if len(ids) > max_pairs_per_row:
                top = np.argsort(-lp, kind="stable")[:max_pairs_per_row]
                keep = np.zeros(len(ids), dtype=bool)
                keep[top] = True
                keep |= chosen
                tail = np.logaddexp.reduce(lp[~keep])
                ids = np.append(ids[keep], tail_token)
                lp = np.append(lp[keep], tail)
                chosen = np.append(chosen[keep], False)
            tokens.append(ids)
            lps.append(lp)
            is_chosen.append(chosen)
            owner.append(np.full(len(ids), k))
        if not tokens:
            return cls(sp.csr_matrix((0, encoder.n_features_)), np.zeros(0), np.zeros(0, np.int64),
                       np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
        tokens, pair_row = np.concatenate(tokens), np.concatenate(owner)
        lens = np.bincount(pair_row, minlength=len(rows))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        X = encoder.transform_encoded(encoded, data.row_state[rows][pair_row], tokens)
        chosen = np.full(len(rows), -1, dtype=np.int64)
        hit = np.flatnonzero(np.concatenate(is_chosen))
        chosen[pair_row[hit]] = hit
        return cls(X, np.concatenate(lps), starts, chosen, data.row_completion[rows],
                   np.isin(tokens, eos))

    def n_steps(self) -> int:
        return len(self.starts)

    def loglik(self, logits_fn, betas: np.ndarray, completions: np.ndarray) -> np.ndarray:
        """Σ over held-out steps of log q_β(sampled token), for each β."""
        return self.loglik_per_completion(logits_fn, betas, completions).sum(axis=1)

    def loglik_per_completion(self, logits_fn, betas: np.ndarray, completions: np.ndarray
                              ) -> np.ndarray:
        """(β, completion): Σ over each held-out completion's steps of log q_β(sampled token)
        (forced steps contribute 0); columns follow ``completions``."""
        completions = np.asarray(completions)
        out = np.zeros((len(betas), len(completions)))
        sel = np.flatnonzero(np.isin(self.row_completion, completions))
        if len(sel) == 0:
            return out
        lens = np.diff(np.append(self.starts, self.X.shape[0]))[sel]
        src = np.repeat(self.starts[sel], lens) + (np.arange(lens.sum()) -
                                                   np.repeat(np.cumsum(lens) - lens, lens))
        lg = log_sigmoid(logits_fn(self.X[src]))
        lg[self.is_eos[src]] = 0.0
        lp = self.lm_logprob[src]
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        chosen = self.chosen[sel] - self.starts[sel] + starts
        col = np.searchsorted(completions, self.row_completion[sel]) if np.all(
            np.diff(completions) > 0) else np.array([int(np.flatnonzero(completions == c)[0])
                                                     for c in self.row_completion[sel]])
        for k, beta in enumerate(betas):
            v = lp + beta * lg
            out[k] = np.bincount(col, weights=v[chosen] - _segment_logsumexp(v, starts),
                                 minlength=len(completions))
        return out


def _log_loss(y: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def reliability_table(y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> list[dict[str, float]]:
    """Calibration: per predicted-probability bin, mean prediction vs observed frequency."""
    edges = np.linspace(0, 1, n_bins + 1)
    which = np.clip(np.digitize(p, edges[1:-1]), 0, n_bins - 1)
    out = []
    for b in range(n_bins):
        m = which == b
        if m.any():
            out.append({"bin": [float(edges[b]), float(edges[b + 1])], "count": int(m.sum()),
                        "mean_predicted": float(p[m].mean()), "observed": float(y[m].mean())})
    return out
