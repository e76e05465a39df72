"""A SHIM request that fails inside the engine fails alone and closed: it is stopped, not let
loose.

Admission (``validate_params``) refuses everything that can be checked before a request runs.
What can still go wrong inside the engine (an artefact replaced between admission and the
engine's own binding, a token the state forbids, a dead end, a controller that raises) must
neither take the engine down (vLLM has no per-request error path for logits processors: an
exception there kills the engine and every request with it) nor let the request continue
unconstrained. So the request's rows allow only its stop token from then on (:func:`stop_row`):
the sampler emits EOS, the engine finishes the request (finish reason ``stop``; text up to the
failure), the error is logged once with the request's row and artefact, and every other row of
the batch is processed as usual. This is the one place a processor sets a token the engine
masked (-inf) back to a finite value: ending the request is what failing closed means.
A request with ``ignore_eos`` (or ``min_tokens`` not yet reached) keeps emitting EOS until its
length limit; its text stays what it was at the failure.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable

import torch

logger = logging.getLogger("shim_vllm")


@dataclass(frozen=True)
class RequestFault:
    """Why a request was failed closed."""

    error: str
    #: The artefact directory the request named.
    controller: str

    @classmethod
    def of(cls, exc: BaseException, controller: object) -> "RequestFault":
        return cls(error=f"{type(exc).__name__}: {exc}", controller=str(controller))


def report(fault: RequestFault, where: str) -> None:
    """Log a request's failure once (the engine log is where an operator looks)."""
    logger.error("SHIM request at %s failed closed (stopped with EOS; the engine and the other "
                 "requests continue). Artefact %s. %s", where, fault.controller, fault.error)


def stop_row(logits: torch.Tensor, row: int, stop_token_id: int | None) -> None:
    """Make ``stop_token_id`` the only token row ``row`` allows (none when it is unknown)."""
    logits[row].fill_(float("-inf"))
    if stop_token_id is not None:
        logits[row, stop_token_id] = 0.0


def stop_token_of(eos_candidates: Iterable[int | None], width: int) -> int | None:
    """The first candidate that is a valid token id: the request's EOS (None if none is)."""
    for token in eos_candidates:
        if token is not None and 0 <= int(token) < width:
            return int(token)
    return None
