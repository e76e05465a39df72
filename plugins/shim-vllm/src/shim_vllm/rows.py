"""SHIM on a batch whose rows are requests (vLLM's V1 runner, SGLang): one state per request.

Such engines keep a persistent batch whose rows come, go and move; what they hand a processor
each step is the logits of every row plus, per request, a live reference to its output token
list. :class:`RequestRow` is one request's SHIM state (its own :class:`MaskerState`, advanced
from that list). :func:`apply_rows` masks and corrects the SHIM rows of a logits tensor in place
(:func:`shim_vllm.scoring.score_rows`) and raises on the first failing row;
:func:`apply_rows_failing_closed` instead stops each failing request alone
(:mod:`shim_vllm.faults`) and processes the others. Rows not in the mapping are never read or
written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from shim_adapters.errors import ShimError
from shim_adapters.mask.protocol import MaskerState

from .binding import BoundController
from .faults import RequestFault, stop_row
from .request_state import GREEDY_TEMPERATURE, ShimRequestState
from .scoring import Target, row_mask, score_rows

__all__ = ["GREEDY_TEMPERATURE", "EngineTokenError", "RequestRow", "apply_rows",
           "apply_rows_failing_closed", "row_mask"]

class EngineTokenError(ShimError):
    """The engine's output token list holds something the processor cannot consume."""


@dataclass
class RequestRow(ShimRequestState):
    """One request's SHIM state inside the engine's batch.

    ``state`` and ``bound`` are None only for a request that failed before it was bound
    (``fault`` says why)."""

    state: MaskerState | None
    bound: BoundController | None
    #: The engine's own, growing list of the request's output tokens (a live reference).
    output_ids: Sequence[int]
    temperature: float = 1.0
    temperature_mode: str = "corrected"
    #: The token that ends the request, used to stop it if it fails.
    stop_token_id: int | None = None
    fault: RequestFault | None = None
    controller: str = ""

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




def apply_rows(logits: torch.Tensor, rows: Mapping[int, RequestRow]) -> torch.Tensor:
    """Mask and correct ``logits[i]`` for every ``i`` in ``rows``; returns ``logits``.

    Raises the first failing row's error (a forbidden token, a dead end, a width mismatch)."""
    if not rows:
        return logits
    index = sorted(rows)
    for i in index:
        rows[i].sync()
    targets = [Target(i, rows[i].state, rows[i].bound, rows[i].gamma_scale) for i in index]
    failures = score_rows(logits, targets)
    if failures:
        raise failures[min(failures)]
    return logits


def apply_rows_failing_closed(logits: torch.Tensor, rows: Mapping[int, RequestRow]
                              ) -> torch.Tensor:
    """As :func:`apply_rows`, but a failing request is stopped alone (see
    :mod:`shim_vllm.faults`) and the others are processed; never raises for one request."""
    if not rows:
        return logits
    index = sorted(rows)
    healthy: list[int] = []
    for i in index:
        row = rows[i]
        if row.fault is None:
            try:
                row.sync()
            except Exception as exc:  # the request's own failure: it alone is stopped
                row.fail(exc, f"batch row {i}")
            else:
                healthy.append(i)
    targets = [Target(i, rows[i].state, rows[i].bound, rows[i].gamma_scale) for i in healthy]
    for pos, exc in score_rows(logits, targets).items():
        rows[targets[pos].row].fail(exc, f"batch row {targets[pos].row}")
    for i in index:
        if rows[i].fault is not None:
            stop_row(logits, i, rows[i].stop_token_id)
    return logits
