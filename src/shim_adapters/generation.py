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

from .errors import DeadEndError, VocabMismatchError
from .protocol import Masker, MaskerState

#: Sampling that follows the LM: temperature 1, top-p 1, no top-k (transformers defaults top_k=50).
FAITHFUL_SAMPLING = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)


class LogitAdjuster(Protocol):
    """Re-weights the allowed tokens of each row; returns log γ̂ per allowed token."""

    def log_gamma(self, states: Sequence[MaskerState],
                  allowed: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
        """For row i: a float array aligned with ``allowed[i]`` (token ids), finite values."""


class MaskedLogitsProcessor(LogitsProcessor):
    """Constrains each row to its masker state; optionally applies SHIM's log γ̂."""

    def __init__(self, states: Sequence[MaskerState], adjuster: LogitAdjuster | None = None):
        if not states:
            raise ValueError("MaskedLogitsProcessor needs one MaskerState per batch row")
        self.states = list(states)
        self.adjuster = adjuster
        self._prompt_length: int | None = None

    def reset(self, states: Sequence[MaskerState]) -> None:
        """Start over with fresh states (a new ``generate`` call)."""
        self.states = list(states)
        self._prompt_length = None

    def _sync(self, input_ids: torch.LongTensor) -> None:
        """Advance each unfinished row by the tokens generated since the last call."""
        if self._prompt_length is None:
            self._prompt_length = input_ids.shape[1]
            return
        new = input_ids[:, self._prompt_length:].tolist()
        for state, row in zip(self.states, new):
            for token in row[state.step:]:
                if state.is_finished:
                    break  # transformers pads finished rows; nothing more to consume
                state.advance(int(token))

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

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[0] != len(self.states):
            raise ValueError(f"batch has {input_ids.shape[0]} rows but the processor holds "
                             f"{len(self.states)} masker states (beam search and "
                             f"num_return_sequences>1 are not supported: use one state per row)")
        width = self.states[0].masker.vocab_size
        if scores.shape[-1] != width:
            raise VocabMismatchError(f"model logits have width {scores.shape[-1]} but the masker "
                                     f"was compiled for {width}")
        self._sync(input_ids)
        mask = torch.from_numpy(self.allowed_masks()).to(scores.device)
        scores = scores.masked_fill(~mask, float("-inf"))
        if self.adjuster is not None:
            scores = self._apply_adjuster(scores, mask)
        return scores

    def _apply_adjuster(self, scores: torch.FloatTensor, mask: torch.Tensor) -> torch.FloatTensor:
        live = [i for i, s in enumerate(self.states) if not s.is_finished]
        if not live:
            return scores
        allowed = [np.flatnonzero(mask[i].cpu().numpy()) for i in live]
        log_gammas = self.adjuster.log_gamma([self.states[i] for i in live], allowed)
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
    (:mod:`shim_adapters.sampling`: one prefill, batched, the LM as it is otherwise)."""
    from .lm import LoadedLM, eos_token_ids
    from .sampling import prefill, sample

    lm = LoadedLM(model=model, tokenizer=tokenizer,
                  identifier=str(getattr(model, "name_or_path", type(model).__name__)),
                  revision="", vocab_size=masker.vocab_size,
                  eos_token_ids=eos_token_ids(model, tokenizer))
    return masked_generation(sample(
        prefill(lm, prompt), num_samples, masker=masker, adjuster=adjuster,
        max_new_tokens=max_new_tokens, batch_size=batch_size,
        generator=None if seed is None else torch.Generator().manual_seed(seed)))


def masked_generation(samples) -> MaskedGeneration:
    """The user-facing view of a masked :class:`~shim_adapters.sampling.Samples`."""
    return MaskedGeneration(texts=[s.text() for s in samples.states],
                            token_ids=[list(s.token_ids) for s in samples.states],
                            complete=[bool(f) for f in samples.finished],
                            states=list(samples.states))
