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
from .generation import MaskedGeneration, MaskedLogitsProcessor, generate_masked
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
                     **generate_kwargs) -> MaskedGeneration:
    """Sample ``num_samples`` constrained completions, SHIM-corrected (plain masking when
    ``controller`` is None). ``lm`` is a :class:`shim_adapters.lm.LoadedLM`."""
    adjuster = ShimAdjuster(controller) if controller is not None else None
    return generate_masked(lm.model, lm.tokenizer, masker, prompt, num_samples,
                           max_new_tokens=max_new_tokens, adjuster=adjuster, seed=seed,
                           **generate_kwargs)
