"""SHIM on a batch whose rows are not requests (vLLM's V2 runner): per-slot states and drafts.

The V2 runner keeps each request in a *slot* (recycled through a free list) and hands
processors logits *rows*: one per request, or under speculative decoding one per draft
position (row j of a request predicts the token after its committed output plus its first j
draft tokens). :class:`SlotState` is one slot's SHIM state: the masker state at the request's
committed output, advanced by the engine's committed token ids (:meth:`SlotState.commit`), and
the states along this step's draft prefix (:meth:`SlotState.draft_states`), each a fork of the
one before advanced by one draft token. A draft the grammar forbids ends the chain: every row
after it allows nothing. When the engine commits tokens that were drafts, the committed state
adopts the draft state already advanced along them instead of advancing again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from shim_adapters.mask.protocol import MaskerState

from .binding import BoundController
from .faults import RequestFault
from .request_state import ShimRequestState


@dataclass
class SlotState(ShimRequestState):
    """One request's SHIM state in a V2 slot.

    ``state`` and ``bound`` are None only for a request that failed before it was bound."""

    state: MaskerState | None
    bound: BoundController | None
    temperature: float = 1.0
    temperature_mode: str = "corrected"
    stop_token_id: int | None = None
    controller: str = ""
    fault: RequestFault | None = None
    #: Committed output tokens consumed (past EOS the state stops; this count goes on).
    consumed: int = 0
    #: The draft tokens of the last chain and the state after each (None past the dead point).
    chain_tokens: tuple[int, ...] = ()
    chain_states: list[MaskerState | None] = field(default_factory=list)



    def restart(self) -> None:
        """Start over from an empty output (the engine restarted the request's output)."""
        self.state = self.bound.masker.new_state()
        self.consumed = 0
        self._drop_chain()

    def commit(self, new: Sequence[int]) -> None:
        """Advance the committed state by ``new``, the output tokens the engine committed since
        the last call. Raises ForbiddenTokenError if one of them is forbidden."""
        if not new:
            return
        start = self._adopt_accepted_drafts(new)
        state = self.state
        for token in new[start:]:
            if state.is_finished:
                break  # the engine went on past EOS (ignore_eos): EOS-only from here on
            state.advance(int(token))
        self.consumed += len(new)
        self._drop_chain()

    def _adopt_accepted_drafts(self, new: Sequence[int]) -> int:
        """Take the last chain's state after the longest draft prefix the engine committed;
        returns how many of ``new`` it covers."""
        accepted = 0
        for token, state in zip(self.chain_tokens, self.chain_states):
            if state is None or int(new[accepted]) != token:
                break
            accepted += 1
            if accepted == len(new):
                break
        if accepted:
            self.state = self.chain_states[accepted - 1]
        return accepted

    def _drop_chain(self) -> None:
        self.chain_tokens = ()
        self.chain_states = []

    def draft_states(self, drafts: Sequence[int]) -> list[MaskerState | None]:
        """The state after each prefix of ``drafts`` (the committed state forked, advanced one
        draft at a time); None from the first draft the grammar forbids on. A chain already
        built along the same drafts (same committed state) is reused."""
        drafts = tuple(int(t) for t in drafts)
        common = 0
        for a, b in zip(drafts, self.chain_tokens):
            if a != b:
                break
            common += 1
        states = self.chain_states[:common]
        previous = states[-1] if states else self.state
        for token in drafts[common:]:
            if previous is None or previous.is_finished:
                # past the dead point nothing is allowed; past EOS only EOS is
                states.append(previous)
                continue
            following = previous.fork()
            try:
                following.advance(token)
            except Exception:  # a forbidden draft (or a placeholder id): the chain dies here
                following = None
            states.append(following)
            previous = following
        self.chain_tokens, self.chain_states = drafts, states
        return states
