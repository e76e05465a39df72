"""Masked generation through ``transformers``: one MaskerState per batch row.

:class:`MaskedLogitsProcessor` is a plain ``LogitsProcessor`` (drop it into any
``LogitsProcessorList``). Each call it advances every row's state by the token the model just
emitted, masks the row's logits to the allowed set, and, when given a :class:`LogitAdjuster`
(SHIM's controller), adds log γ̂ to the allowed tokens only. A row with no allowed token before
the grammar accepts raises :class:`DeadEndError` with the state that led there: generation fails
closed and never continues unconstrained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import torch
from transformers import LogitsProcessor

from shim_adapters.errors import DeadEndError, VocabMismatchError
from shim_adapters.lm.loading import LoadedLM, eos_token_ids
from shim_adapters.lm.sampling import prefill, sample
from shim_adapters.mask.bitmask import EmptyRowCheck, allocate_token_bitmask, pack_mask
from shim_adapters.mask.protocol import Masker, MaskerState

#: Sampling that follows the LM: temperature 1, top-p 1, no top-k (transformers defaults top_k=50).
FAITHFUL_SAMPLING = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)


class LogitAdjuster(Protocol):
    """Re-weights the allowed tokens of each row; returns log γ̂ per allowed token."""

    def log_gamma(self, states: Sequence[MaskerState],
                  allowed: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """For row i: a float array aligned with ``allowed[i]`` (token ids), finite values."""


#: ``_apply_adjuster``'s default: the live rows are not known yet.
_UNKNOWN = object()


class MaskedLogitsProcessor(LogitsProcessor):
    """Constrains each row to its masker state; optionally applies SHIM's log γ̂.

    Per call: each live row's state fills its row of one preallocated packed bitmask
    (:meth:`~shim_adapters.mask.protocol.MaskerState.fill_next_token_bitmask`), an adjuster with
    ``add_log_gamma_`` (:class:`~shim_adapters.shim.correction.ShimAdjuster`) adds γ with one
    batched gather-add, and the batch is masked with one kernel call
    (:meth:`~shim_adapters.mask.protocol.Masker.apply_token_bitmask_`), which sets every forbidden
    token to -inf whatever was added; any other :class:`LogitAdjuster` goes through
    ``log_gamma`` with the allowed ids, after the mask. ``scores`` is modified in place and
    returned."""

    _words: np.ndarray | None = None  # numpy view of _bitmask
    _words_for: Masker | None = None  # the masker _bitmask and _eos_row were made for

    def __init__(self, states: Sequence[MaskerState], adjuster: LogitAdjuster | None = None):
        if not states:
            raise ValueError("MaskedLogitsProcessor needs one MaskerState per batch row")
        self.states = list(states)
        self.adjuster = adjuster
        self._prompt_length: int | None = None
        self._bitmask: torch.Tensor | None = None
        self._eos_row: np.ndarray | None = None  # packed words of an EOS-only row

    def reset(self, states: Sequence[MaskerState]) -> None:
        """Start over with fresh states (a new ``generate`` call)."""
        self.states = list(states)
        self._prompt_length = None

    def _sync(self, input_ids: torch.LongTensor) -> None:
        """Advance each unfinished row by the tokens generated since the last call."""
        if self._prompt_length is None:
            self._prompt_length = input_ids.shape[1]
            return
        generated = input_ids.shape[1] - self._prompt_length
        last = None
        stepping, tokens = [], []  # rows one token behind (the usual case): one batched step
        for row, state in enumerate(self.states):
            if state.is_finished:
                continue  # transformers pads finished rows; nothing more to consume
            step = state.step
            if step == generated - 1:
                if last is None:
                    last = input_ids[:, -1].tolist()
                stepping.append(state)
                tokens.append(last[row])
            elif step < generated:
                for token in input_ids[row, self._prompt_length + step:].tolist():
                    if state.is_finished:
                        break
                    state.advance(int(token))
        if stepping:
            stepping[0].masker.advance_states(stepping, tokens)

    def allowed_masks(self) -> np.ndarray:
        """(batch, vocab) bool masks; finished rows allow only EOS so sampling stays defined."""
        masks = []
        for row, state in enumerate(self.states):
            if state.is_finished:
                mask = np.zeros(state.masker.vocab_size, dtype=bool)
                mask[min(state.masker.eos_token_ids)] = True
            else:
                mask = state.allowed_mask()
                if not mask.any():
                    raise DeadEndError(state.step, state.describe(), row=row)
            masks.append(mask)
        return np.stack(masks)

    def fill_bitmask(self) -> torch.Tensor:
        """The batch's packed masks (int32, XGrammar's layout; see :mod:`shim_adapters.mask.bitmask`);
        finished rows allow only EOS. Raises DeadEndError for a live row with no token."""
        states = self.states
        masker = states[0].masker
        bitmask = self._bitmask
        if bitmask is None or self._words_for is not masker or len(self._words) != len(states):
            bitmask = self._allocate(masker, len(states))
        words = self._words
        live = self._live = self._live_rows()  # γ's add reuses it (same call)
        if live is None:  # the usual case: every row live, in order
            masker.fill_next_token_bitmasks(states, bitmask, range(len(states)))
        else:
            words[sorted(set(range(len(states))).difference(live))] = self._eos_row
            masker.fill_next_token_bitmasks([states[r] for r in live], bitmask, live)
        row = self._empty_row()
        if row is not None:
            state = states[row]
            raise DeadEndError(state.step, state.describe(), row=row)
        return bitmask

    def _allocate(self, masker: Masker, batch: int) -> torch.Tensor:
        """The preallocated bitmask for ``batch`` rows, its numpy view and the EOS-only row."""
        bitmask = self._bitmask = allocate_token_bitmask(batch, masker.vocab_size)
        self._words, self._words_for = bitmask.numpy(), masker
        self._empty_row = EmptyRowCheck(self._words, masker.vocab_size)
        only_eos = np.zeros(masker.vocab_size, dtype=bool)
        only_eos[min(masker.eos_token_ids)] = True
        self._eos_row = pack_mask(only_eos)
        return bitmask

    def _live_rows(self) -> list[int] | None:
        """The rows whose state is not finished, or None when every row is live (the usual
        case: no list is built)."""
        states = self.states
        if len(states) == 1:
            return [] if states[0].is_finished else None
        for state in states:
            if state.is_finished:
                return [row for row, s in enumerate(states) if not s.is_finished]
        return None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        states = self.states
        if input_ids.shape[0] != len(states):
            raise ValueError(f"batch has {input_ids.shape[0]} rows but the processor holds "
                             f"{len(states)} masker states (beam search and "
                             f"num_return_sequences>1 are not supported: use one state per row)")
        masker = states[0].masker
        width = masker.vocab_size
        if scores.shape[-1] != width:
            raise VocabMismatchError(f"model logits have width {scores.shape[-1]} but the masker "
                                     f"was compiled for {width}")
        self._sync(input_ids)
        bitmask = self.fill_bitmask()
        adjuster = self.adjuster
        if adjuster is None or getattr(adjuster, "inert", False):  # β = 0: the mask alone
            masker.apply_token_bitmask_(scores, bitmask)
        elif hasattr(adjuster, "add_masked_log_gamma_") and adjuster.add_masked_log_gamma_(
                scores, self._live_states(), self._live, bitmask):
            pass  # γ and the mask in one add (CPU, narrow vocabulary, finite logits)
        elif hasattr(adjuster, "add_log_gamma_"):
            # γ first, then the mask: the mask sets every forbidden token to -inf whatever was
            # added, and the γ add runs before the kernel has swept the logits through the
            # cache (benchmarks/gamma_mask_cost.md, 'γ before the mask')
            self._apply_adjuster(scores, live=self._live)
            masker.apply_token_bitmask_(scores, bitmask)
        else:
            masker.apply_token_bitmask_(scores, bitmask)
            self._apply_adjuster(scores, live=self._live)
        return scores

    def _live_states(self) -> Sequence[MaskerState]:
        """The states of :meth:`_live_rows` as the call's fill computed it."""
        live = self._live
        return self.states if live is None else [self.states[i] for i in live]

    def _apply_adjuster(self, scores: torch.FloatTensor, mask: torch.Tensor | None = None,
                        live: list[int] | None | object = _UNKNOWN) -> torch.FloatTensor:
        """γ for the live rows; ``live``: :meth:`_live_rows` as the call's fill computed it."""
        if live is _UNKNOWN:
            live = self._live_rows()
        if live is None:
            states, live = self.states, range(len(self.states))
        elif not live:
            return scores
        else:
            states = [self.states[i] for i in live]
        if hasattr(self.adjuster, "add_log_gamma_"):
            return self.adjuster.add_log_gamma_(scores, states, live)
        if mask is None:
            mask = ~torch.isneginf(scores)
        mask_np = mask.cpu().numpy()
        allowed = [np.flatnonzero(mask_np[i]) for i in live]
        log_gammas = self.adjuster.log_gamma(states, allowed)
        for i, ids, lg in zip(live, allowed, log_gammas):
            lg_t = torch.as_tensor(np.asarray(lg), dtype=scores.dtype, device=scores.device)
            if lg_t.shape != (len(ids),) or not torch.isfinite(lg_t).all():
                raise ValueError(f"adjuster returned {tuple(lg_t.shape)} values (finite required) "
                                 f"for {len(ids)} allowed tokens at row {i}")
            index = torch.as_tensor(ids, device=scores.device)
            scores[i, index] += lg_t
        return scores


@dataclass
class MaskedGeneration:
    """Outputs of :func:`generate_masked`, one entry per sample."""

    texts: list[str]
    token_ids: list[list[int]]
    #: True where the grammar accepted and EOS was emitted; False: the sample is *incomplete*
    #: (it hit max_new_tokens first) and is not a string of the language.
    complete: list[bool]
    states: list[MaskerState]


def generate_masked(model, tokenizer, masker: Masker, prompt: str, num_samples: int, *,
                    max_new_tokens: int = 128, adjuster: LogitAdjuster | None = None,
                    seed: int | None = None, batch_size: int = 64) -> MaskedGeneration:
    """Sample ``num_samples`` constrained completions of ``prompt`` with the sampling engine
    (:mod:`shim_adapters.lm.sampling`: one prefill, batched, the LM as it is otherwise)."""
    lm = LoadedLM(model=model, tokenizer=tokenizer,
                  identifier=str(getattr(model, "name_or_path", type(model).__name__)),
                  revision="", vocab_size=masker.vocab_size,
                  eos_token_ids=eos_token_ids(model, tokenizer))
    return masked_generation(sample(
        prefill(lm, prompt), num_samples, masker=masker, adjuster=adjuster,
        max_new_tokens=max_new_tokens, batch_size=batch_size,
        generator=None if seed is None else torch.Generator().manual_seed(seed)))


def masked_generation(samples) -> MaskedGeneration:
    """The user-facing view of a masked :class:`~shim_adapters.lm.sampling.Samples`."""
    return MaskedGeneration(texts=[s.text() for s in samples.states],
                            token_ids=[list(s.token_ids) for s in samples.states],
                            complete=[bool(f) for f in samples.finished],
                            states=list(samples.states))
