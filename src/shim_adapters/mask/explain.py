"""Why a token is allowed or refused at a state, and what γ̂ the controller gives it.

Answers the question users ask when an output looks wrong: is it the mask (which terminals
the state expects, what the token would turn the partial lexeme into) or the correction (the
controller's γ̂ and the features that produced it)?
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from shim_adapters.mask.protocol import MaskerState


@dataclass(frozen=True)
class FeatureContribution:
    name: str
    #: First-layer weight of the feature (the logit contribution for the logistic controllers).
    weight: float


@dataclass(frozen=True)
class Explanation:
    token_id: int
    token_text: str
    allowed: bool
    is_eos: bool
    reason: str
    state: dict[str, Any]
    #: Features after taking the token (only when it is allowed).
    next_state: dict[str, Any] | None = None
    log_gamma: float | None = None
    log_gamma_damped: float | None = None
    beta: float | None = None
    contributions: tuple[FeatureContribution, ...] = field(default=())

    def lines(self) -> list[str]:
        out = [f"token {self.token_id} {self.token_text!r}: "
               + ("allowed" if self.allowed else "refused") + f" ({self.reason})"]
        out += [f"  state {k}: {v}" for k, v in self.state.items()]
        if self.next_state is not None:
            out += [f"  after it {k}: {v}" for k, v in self.next_state.items()]
        if self.log_gamma is not None:
            out.append(f"  gamma-hat {np.exp(self.log_gamma):.4g} (log {self.log_gamma:.4g}); "
                       f"beta {self.beta:g} adds {self.log_gamma_damped:.4g} to the logit")
            out += [f"    {c.weight:+.4g}  {c.name}" for c in self.contributions]
        return out


def _features_dict(state: MaskerState) -> dict[str, Any]:
    f = state.features()
    out: dict[str, Any] = {"text": state.text(), "eos_allowed": bool(state.eos_allowed())}
    if f.parser_state is not None:
        out["parser_state"] = list(f.parser_state[:4])
    if f.lexer_state is not None:
        out["terminals"] = sorted({t for t, _ in f.lexer_state})
    if f.partial_lexeme is not None:
        out["partial_lexeme"] = f.partial_lexeme
    return out


def _contributions(controller, state: MaskerState, token_id: int, top: int):
    """Active features of (state, token) with their first-layer weights, largest first."""
    enc = controller.encoder_
    X = enc.transform([state.features()], np.zeros(1, dtype=np.int64),
                      np.array([token_id], dtype=np.int64))
    embed = controller.weights_["embed"]
    names = []
    for col in X.indices:
        if col < enc.n_state_:
            names.append(f"state {enc.state_vocab_[col]}")
        elif col < enc.n_state_ + enc.n_token_:
            names.append(f"token {int(enc.token_vocab_[col - enc.n_state_])}")
        else:
            names.append(f"state x token cross #{col - enc.n_state_ - enc.n_token_}")
    weights = [float(embed[col].sum()) if embed.shape[1] > 1 else float(embed[col, 0])
               for col in X.indices]
    pairs = sorted(zip(names, weights), key=lambda p: -abs(p[1]))[:top]
    label = "" if embed.shape[1] == 1 else " (sum over the first layer's units)"
    return tuple(FeatureContribution(n + label, w) for n, w in pairs)


def explain(state: MaskerState, token_id: int, controller=None, top: int = 8) -> Explanation:
    """Why ``token_id`` is allowed or refused at ``state``; with a fitted controller, its γ̂
    and the ``top`` features that produced it. The state is not changed (a fork is advanced)."""
    masker = state.masker
    token_id = int(token_id)
    text = masker.token_text(token_id) if 0 <= token_id < masker.vocab_size else "<out of range>"
    is_eos = token_id in masker.eos_token_ids
    mask = state.allowed_mask()
    allowed = bool(0 <= token_id < len(mask) and mask[token_id])
    info = _features_dict(state)
    if not 0 <= token_id < masker.vocab_size:
        reason = f"not a token id: the logits have {masker.vocab_size} entries"
    elif is_eos:
        reason = ("EOS: the grammar accepts the text so far" if allowed else
                  "EOS: the grammar does not accept the text so far")
    elif allowed:
        reason = "the text stays a prefix of the language"
    else:
        expected = info.get("terminals")
        reason = ("no terminal the state expects can continue with this text"
                  + (f" (expected: {', '.join(expected[:8])})" if expected else ""))
    next_info = None
    if allowed and not is_eos:
        fork = state.fork()
        fork.advance(token_id)
        next_info = _features_dict(fork)
    lg = lgd = beta = None
    contributions: tuple[FeatureContribution, ...] = ()
    if controller is not None and allowed:
        ids = np.array([token_id], dtype=np.int64)
        lg = float(controller.predict_log_gamma(state.features(), ids, damped=False)[0])
        lgd = float(controller.predict_log_gamma(state.features(), ids, damped=True)[0])
        beta = float(controller.beta_)
        if not is_eos:
            contributions = _contributions(controller, state, token_id, top)
    return Explanation(token_id, text, allowed, is_eos, reason, info, next_info, lg, lgd, beta,
                       contributions)
