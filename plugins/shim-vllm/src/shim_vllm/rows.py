"""SHIM on an engine's batch: per-request masker states and one batched correction step.

Engines keep a persistent batch whose rows come, go and move; what they hand a processor each
step is the logits of every row plus, per request, a live reference to its output token list.
:class:`RequestRow` is one request's SHIM state (its own :class:`MaskerState`, advanced from
that list), and :func:`apply_rows` masks and corrects the SHIM rows of a logits tensor in place,
with the same arithmetic as :class:`shim_adapters.correction.ShimLogitsProcessor` (masked_fill
to -inf, then + β·log γ̂ on the allowed tokens), one controller call per controller per step.
Rows not in the mapping are never read or written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from shim_adapters.errors import DeadEndError, ShimError, VocabMismatchError
from shim_adapters.protocol import MaskerState

from .binding import BoundController

#: Engines treat temperatures below this as greedy and do not divide by them (vLLM's value).
GREEDY_TEMPERATURE = 1e-5


class EngineTokenError(ShimError):
    """The engine's output token list holds something the processor cannot consume."""


@dataclass
class RequestRow:
    """One request's SHIM state inside the engine's batch."""

    state: MaskerState
    bound: BoundController
    #: The engine's own, growing list of the request's output tokens (a live reference).
    output_ids: Sequence[int]
    temperature: float = 1.0
    temperature_mode: str = "corrected"

    def sync(self) -> None:
        """Consume the tokens the engine appended since the last step."""
        state = self.state
        consumed = len(state.token_ids)
        new = self.output_ids[consumed:]
        for token in new:
            if state.is_finished:
                return  # the engine went on past EOS (ignore_eos): EOS-only from here on
            token = int(token)
            if token < 0:
                raise EngineTokenError(
                    f"output token {token} at position {state.step} is a placeholder (async "
                    f"scheduling has not filled it in before logits processing); state: "
                    f"{state.describe()}")
            state.advance(token)  # ForbiddenTokenError names the token and the state

    @property
    def gamma_scale(self) -> float:
        """Factor on log γ̂ so that the engine's later division by T leaves what the mode asks."""
        if self.temperature_mode == "lm_only" and self.temperature >= GREEDY_TEMPERATURE:
            return float(self.temperature)
        return 1.0


def row_mask(state: MaskerState, row: int) -> np.ndarray:
    """The row's allowed tokens; finished rows allow only EOS; an empty live row fails closed."""
    if state.is_finished:
        mask = np.zeros(state.masker.vocab_size, dtype=bool)
        mask[min(state.masker.eos_token_ids)] = True
        return mask
    mask = state.allowed_mask()
    if not mask.any():
        raise DeadEndError(state.step, state.describe(), row=row)
    return mask


def apply_rows(logits: torch.Tensor, rows: Mapping[int, RequestRow]) -> torch.Tensor:
    """Mask and correct ``logits[i]`` for every ``i`` in ``rows``; returns ``logits``."""
    if not rows:
        return logits
    index = sorted(rows)
    for i in index:
        rows[i].sync()
    width = int(logits.shape[-1])
    for i in index:
        if rows[i].state.masker.vocab_size != width:
            raise VocabMismatchError(
                f"batch row {i}: the engine's logits have width {width} but the controller's "
                f"masker was compiled for {rows[i].state.masker.vocab_size}")
    masks = np.stack([row_mask(rows[i].state, i) for i in index])
    index_t = torch.as_tensor(index, device=logits.device)
    mask_t = torch.from_numpy(masks).to(logits.device)
    sub = logits.index_select(0, index_t).masked_fill_(~mask_t, float("-inf"))

    flat_ids, values = _log_gammas(rows, index, masks, width)
    if flat_ids is not None:
        sub.view(-1).index_add_(0, torch.from_numpy(flat_ids).to(logits.device),
                                torch.from_numpy(values).to(device=logits.device,
                                                            dtype=sub.dtype))
    _refuse_emptied_rows(sub, rows, index)
    logits.index_copy_(0, index_t, sub)
    return logits


def _log_gammas(rows: Mapping[int, RequestRow], index: list[int], masks: np.ndarray,
                width: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Flat (row-major in the selected rows) token positions and their β·log γ̂ values."""
    groups: dict[int, list[int]] = {}
    for pos, i in enumerate(index):
        if not rows[i].state.is_finished:
            groups.setdefault(id(rows[i].bound), []).append(pos)
    if not groups:
        return None, None
    flat: list[np.ndarray] = []
    vals: list[np.ndarray] = []
    for positions in groups.values():
        members = [rows[index[p]] for p in positions]
        allowed = [np.flatnonzero(masks[p]) for p in positions]
        log_gammas = members[0].bound.adjuster.log_gamma([m.state for m in members], allowed)
        for pos, member, ids, lg in zip(positions, members, allowed, log_gammas):
            lg = np.asarray(lg, dtype=np.float32)
            if lg.shape != ids.shape or not np.isfinite(lg).all():
                raise ValueError(f"batch row {index[pos]}: the controller returned "
                                 f"{lg.shape} values (finite required) for {len(ids)} allowed "
                                 f"tokens")
            scale = member.gamma_scale
            flat.append(ids + pos * width)
            vals.append(lg if scale == 1.0 else lg * np.float32(scale))
    return np.concatenate(flat), np.concatenate(vals)


def _refuse_emptied_rows(sub: torch.Tensor, rows: Mapping[int, RequestRow],
                         index: list[int]) -> None:
    """The engine's own masks (its grammar bitmask, allowed_token_ids, bad words) ran first; a
    row they leave with no token that SHIM's grammar allows is a dead end too."""
    empty = torch.isneginf(sub).all(dim=-1)
    if bool(empty.any()):
        pos = int(torch.nonzero(empty)[0, 0])
        state = rows[index[pos]].state
        raise DeadEndError(state.step, state.describe() + " (every token the grammar allows "
                           "was already -inf in the engine's logits: its structured-output "
                           "bitmask, allowed_token_ids or bad_words disagree with the "
                           "controller's grammar)", row=index[pos])
