"""SHIM at decoding time: add β·log γ̂ to the masked logits of the allowed tokens.

:class:`ShimAdjuster` is a :class:`~shim_adapters.generation.LogitAdjuster`: per step and row
it reads the masker state's features once, computes the state part of the controller once,
and scores every allowed token with one vectorised gather (all rows share one call of the
controller's head). :class:`~shim_adapters.generation.MaskedLogitsProcessor` adds the values
to the allowed tokens only, after masking, so a forbidden token stays at -inf: the masker's
guarantee is untouched.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .controller import Controller
from .generation import MaskedGeneration, MaskedLogitsProcessor, masked_generation
from .protocol import Masker, MaskerState


class ShimAdjuster:
    """log γ̂ (damped by the controller's β) for the allowed tokens of each row."""

    def __init__(self, controller: Controller, damped: bool = True):
        if not hasattr(controller, "weights_"):
            raise ValueError(f"{type(controller).__name__} is not fitted: call fit() or load "
                             f"an artefact first")
        self.controller = controller
        self.damped = damped

    def log_gamma(self, states: Sequence[MaskerState],
                  allowed: Sequence[np.ndarray]) -> list[np.ndarray]:
        return self.controller.predict_log_gamma_batch([s.features() for s in states], allowed,
                                                       damped=self.damped)


class ShimLogitsProcessor(MaskedLogitsProcessor):
    """A :class:`MaskedLogitsProcessor` that applies SHIM's correction."""

    def __init__(self, states: Sequence[MaskerState], controller: Controller):
        super().__init__(states, adjuster=ShimAdjuster(controller))


def sample_with_shim(lm, masker: Masker, controller: Controller | None, prompt: str,
                     num_samples: int, *, max_new_tokens: int = 128, seed: int | None = None,
                     chat: bool | None = None, stop_at_newline: bool | None = None,
                     batch_size: int = 64) -> MaskedGeneration:
    """Sample ``num_samples`` constrained completions, SHIM-corrected (plain masking when
    ``controller`` is None). ``lm`` is a :class:`shim_adapters.lm.LoadedLM`. ``chat`` and
    ``stop_at_newline`` default to what the controller was fitted with (its manifest's
    ``training.prompting``), else False: the controller is only valid for the same LM view."""
    import torch

    from .evaluation.lm_views import stop_folded
    from .prompting import prefill_prompt
    from .sampling import sample

    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    fitted = getattr(controller, "prompting_", {}) or {}
    chat = bool(fitted.get("chat", False)) if chat is None else chat
    fold = bool(fitted.get("stop_at_newline", False)) if stop_at_newline is None \
        else stop_at_newline
    if fold:
        lm = stop_folded(lm, masker.eos_token_ids)
    adjuster = ShimAdjuster(controller) if controller is not None else None
    drawn = sample(prefill_prompt(lm, prompt, chat), num_samples, masker=masker,
                   adjuster=adjuster, max_new_tokens=max_new_tokens, batch_size=batch_size,
                   generator=None if seed is None else torch.Generator().manual_seed(seed))
    return masked_generation(drawn)
