"""Mask and correct logits rows from masker states: one batched step, failures per row.

:func:`score_rows` writes, for each :class:`Target`, the row ``logits[target.row]`` masked to
the state's allowed tokens (``masked_fill`` to -inf, so a token the engine already set to -inf
stays -inf: the row keeps the intersection) plus β·log γ̂ on the allowed tokens, with the
arithmetic of :class:`shim_adapters.shim.correction.ShimLogitsProcessor` and one controller
call per controller per step. It never raises for one row's problem: it returns the rows that
failed (a dead end, a width mismatch, a controller error) and leaves them unwritten, so the
caller decides whether that fails the step (:func:`shim_vllm.rows.apply_rows`) or only that
request (:mod:`shim_vllm.faults`). Rows not in the targets are never read or written.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shim_adapters.errors import DeadEndError, ShimError, VocabMismatchError
from shim_adapters.mask.protocol import MaskerState

from .binding import BoundController


class ControllerOutputError(ShimError):
    """The controller returned something other than one finite value per allowed token."""


@dataclass(frozen=True)
class Target:
    """One logits row to mask and correct."""

    row: int
    #: The state before the row's token; None: the row allows nothing (a draft prefix that left
    #: the grammar: the row is masked entirely).
    state: MaskerState | None
    bound: BoundController
    #: Factor on log γ̂ (the temperature mode's, see :mod:`shim_vllm.request_args`).
    gamma_scale: float = 1.0


def row_mask(state: MaskerState, row: int) -> np.ndarray:
    """The row's allowed tokens; finished rows allow only EOS; an empty live row is a dead end."""
    if state.is_finished:
        mask = np.zeros(state.masker.vocab_size, dtype=bool)
        mask[min(state.masker.eos_token_ids)] = True
        return mask
    mask = state.allowed_mask()
    if not mask.any():
        raise DeadEndError(state.step, state.describe(), row=row)
    return mask


def score_rows(logits: torch.Tensor, targets: list[Target]) -> dict[int, Exception]:
    """Mask and correct every target's row in place; returns {position in targets: error} for
    the targets that failed. A row that failed before scoring is left as it was; a row whose
    intersection with the engine's own masks is empty is written (all -inf) and reported."""
    failures: dict[int, Exception] = {}
    if not targets:
        return failures
    width = int(logits.shape[-1])
    masks = np.zeros((len(targets), width), dtype=bool)
    live: list[int] = []
    for pos, target in enumerate(targets):
        state = target.state
        if state is None:
            continue
        try:
            if state.masker.vocab_size != width:
                raise VocabMismatchError(
                    f"batch row {target.row}: the engine's logits have width {width} but the "
                    f"controller's masker was compiled for {state.masker.vocab_size}")
            masks[pos] = row_mask(state, target.row)
        except Exception as exc:  # this row's problem, reported to the caller
            failures[pos] = exc
            continue
        if not state.is_finished:
            live.append(pos)
    gammas = _log_gammas(targets, live, masks, failures)
    kept = [pos for pos in range(len(targets)) if pos not in failures]
    if not kept:
        return failures
    device = logits.device
    index_t = torch.as_tensor([targets[pos].row for pos in kept], device=device)
    mask_t = torch.from_numpy(masks[kept]).to(device)
    sub = logits.index_select(0, index_t).masked_fill_(~mask_t, float("-inf"))
    flat, values = [], []
    for sub_pos, pos in enumerate(kept):
        found = gammas.get(pos)
        if found is not None:
            flat.append(found[0] + sub_pos * width)
            values.append(found[1])
    if flat:
        sub.view(-1).index_add_(0, torch.from_numpy(np.concatenate(flat)).to(device),
                                torch.from_numpy(np.concatenate(values)).to(device=device,
                                                                             dtype=sub.dtype))
    emptied = torch.isneginf(sub).all(dim=-1).tolist()
    for sub_pos, pos in enumerate(kept):
        state = targets[pos].state
        if emptied[sub_pos] and state is not None:
            failures[pos] = DeadEndError(
                state.step, state.describe() + " (every token the grammar allows was already "
                "-inf in the engine's logits: its structured-output bitmask, allowed_token_ids, "
                "bad_words or logit_bias disagree with the controller's grammar)",
                row=targets[pos].row)
    logits.index_copy_(0, index_t, sub)
    return failures


def _log_gammas(targets: list[Target], live: list[int], masks: np.ndarray,
                failures: dict[int, Exception]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{position: (allowed token ids, β·log γ̂ scaled)} for the live targets; one controller
    call per controller, and, if that call fails, one call per row to find the failing rows."""
    groups: dict[int, list[int]] = {}
    for pos in live:
        groups.setdefault(id(targets[pos].bound), []).append(pos)
    out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for positions in groups.values():
        try:
            out.update(_group_log_gammas(targets, positions, masks))
        except Exception:  # find which rows fail; the others are scored alone
            for pos in positions:
                try:
                    out.update(_group_log_gammas(targets, [pos], masks))
                except Exception as exc:
                    failures[pos] = exc
    return out


def _group_log_gammas(targets: list[Target], positions: list[int], masks: np.ndarray
                      ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    adjuster = targets[positions[0]].bound.adjuster
    allowed = [np.flatnonzero(masks[pos]) for pos in positions]
    log_gammas = adjuster.log_gamma([targets[pos].state for pos in positions], allowed)
    out = {}
    for pos, ids, lg in zip(positions, allowed, log_gammas):
        lg = np.asarray(lg, dtype=np.float32)
        if lg.shape != ids.shape or not np.isfinite(lg).all():
            raise ControllerOutputError(
                f"batch row {targets[pos].row}: the controller returned {lg.shape} values "
                f"(finite required) for {len(ids)} allowed tokens")
        scale = targets[pos].gamma_scale
        out[pos] = (ids, lg if scale == 1.0 else lg * np.float32(scale))
    return out
