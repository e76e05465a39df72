"""Exact probabilities of outputs under the LM, masked decoding and SHIM, by teacher forcing.

A decoding method is a per-step distribution: the LM's (``masker=None``), the LM renormalised
over the masker's allowed set (masking), or that set re-weighted by an adjuster's log γ̂
(SHIM). The probability of a token sequence under a method is the product of its per-step
probabilities along the sequence (docs/design.md).

This module is the user-facing face of that computation; the work is done by the same code
the evaluation harness uses (:mod:`.evaluation.scoring` for teacher forcing,
:mod:`.evaluation.exact_language` for walking a finite language), on a prompt prefilled once
(:func:`.sampling.prefill`), so an exact number here and a harness number can never disagree
by construction.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from shim_adapters.evaluation import exact_language
from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.lm.generation import LogitAdjuster
from shim_adapters.lm.sampling import prefill
from shim_adapters.mask.protocol import Masker


def sequence_logprobs(lm, prompt: str, sequences: Sequence[Sequence[int]],
                      masker: Masker | None = None, adjuster: LogitAdjuster | None = None, *,
                      batch_size: int | None = None) -> np.ndarray:
    """log q(sequence) for each token sequence (after the prompt) under one method.

    Without a masker: the LM's log-probability of the tokens, finished or not. With a masker:
    the masked (and, with ``adjuster``, SHIM-corrected) decoder's probability of producing the
    sequence *as a whole output*, so a sequence must end in EOS where the grammar accepts; one
    the method cannot produce (a forbidden token, or no EOS at the end) gets -inf.
    """
    if adjuster is not None and masker is None:
        raise ValueError("an adjuster re-weights a masker's allowed set: pass the masker too")
    if not len(sequences):
        return np.zeros(0)
    methods = {"q": adjuster} if masker is not None else None
    scores = score_sequences(prefill(lm, prompt), [list(s) for s in sequences], masker,
                             methods, batch_size=batch_size)
    return scores.methods["q"] if masker is not None else scores.lm


def sequence_logprob(lm, prompt: str, token_ids: Sequence[int], masker: Masker | None = None,
                     adjuster: LogitAdjuster | None = None) -> float:
    """log q(token_ids) under one method (see :func:`sequence_logprobs`)."""
    return float(sequence_logprobs(lm, prompt, [token_ids], masker, adjuster)[0])


@dataclass
class ExactLanguageDistribution:
    """Every token sequence of a finite language with its exact probability per method."""

    sequences: list[tuple[int, ...]]  #: EOS included
    strings: list[str]  #: each checked by the reference acceptor during the walk
    lm_logprob: np.ndarray  #: log p(sequence) under the unconstrained LM
    method_logprob: dict[str, np.ndarray] = field(default_factory=dict)

    def target(self) -> np.ndarray:
        """p(x)·1[x in L] / Σ over the language's token sequences."""
        w = np.exp(self.lm_logprob - self.lm_logprob.max())
        return w / w.sum()

    def method(self, name: str) -> np.ndarray:
        return np.exp(self.method_logprob[name])

    def by_string(self, probs: np.ndarray) -> dict[str, float]:
        """Probabilities summed over each output string's tokenisations."""
        out: dict[str, float] = {}
        for s, p in zip(self.strings, probs):
            out[s] = out.get(s, 0.0) + float(p)
        return dict(sorted(out.items()))

    def kl(self, name: str, level: str = "string") -> float:
        """Exact KL(target || method), over output strings or token sequences."""
        p, q = self.target(), self.method(name)
        if level == "string":
            ps, qs = self.by_string(p), self.by_string(q)
            p = np.array(list(ps.values()))
            q = np.array([qs[k] for k in ps])
        elif level != "sequence":
            raise ValueError(f"level must be 'string' or 'sequence', not {level!r}")
        m = p > 0
        return float(np.sum(p[m] * (np.log(p[m]) - np.log(np.maximum(q[m], 1e-300)))))


def enumerate_language(lm, masker: Masker, prompt: str,
                       adjusters: Mapping[str, LogitAdjuster | None] | None = None, *,
                       max_sequences: int = 20_000, max_length: int = 64
                       ) -> ExactLanguageDistribution:
    """Walk every token path the masker allows from ``prompt`` to EOS.

    ``adjusters`` maps a method name to an adjuster (None: plain masking); ``"masking"`` is
    always included. Raises :class:`.evaluation.exact_language.LanguageTooLargeError` past
    ``max_sequences`` token sequences or ``max_length`` tokens, and ValueError if the masker
    lets through a string the reference parser rejects.
    """
    methods = {"masking": None, **dict(adjusters or {})}
    lang = exact_language.enumerate_language(prefill(lm, prompt), masker, methods,
                                             max_sequences=max_sequences, max_length=max_length)
    return ExactLanguageDistribution(
        sequences=[tuple(s) for s in lang.sequences], strings=list(lang.texts),
        lm_logprob=lang.lm, method_logprob=dict(lang.methods))
