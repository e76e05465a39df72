"""Rejection sampling from the LM: the exact target p(x | G), and the support of the KL metric.

Unconstrained samples are drawn from the LM as it is; a sample is valid when it ended with EOS
and the reference acceptor (never the masker under test) accepts its text. Keeping the valid
ones samples the target exactly; its cost per accepted sample is the price of that exactness.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from shim_adapters.evaluation.timing import PhaseTimer
from shim_adapters.grammars.grammar import Grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.sampling import PrefilledPrompt, eos_ids, sample


@dataclass
class LMDraws:
    """Unconstrained LM samples, in draw order."""

    token_ids: list[list[int]]
    texts: list[str]
    #: Ended with EOS within max_new_tokens.
    complete: np.ndarray
    #: Complete and accepted by the reference acceptor.
    valid: np.ndarray
    seconds: float
    #: Stopped early at a token the watching masker refused (see ``cut_by``).
    cut: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    #: LM positions evaluated for these draws (cost in forward passes, CARS-style).
    forward_tokens: int = 0

    @property
    def n(self) -> int:
        return len(self.token_ids)

    @property
    def seconds_per_accepted(self) -> float:
        accepted = int(self.valid.sum())
        return self.seconds / accepted if accepted else float("inf")


def draw_lm_samples(prefilled: PrefilledPrompt, grammar: Grammar, n: int, *,
                    max_new_tokens: int = 128, batch_size: int = 64,
                    generator: torch.Generator | None = None, timer: PhaseTimer | None = None,
                    progress: bool = False, cut_by=None) -> LMDraws:
    """``n`` unconstrained samples, labelled by the reference acceptor. With ``cut_by`` (a
    masker), a draw stops at the first token that masker refuses and counts as invalid."""
    from tqdm.auto import tqdm

    lm = prefilled.lm
    eos = eos_ids(lm)
    acceptor = reference_acceptor(grammar)
    tokens: list[list[int]] = []
    cut: list[bool] = []
    seconds = 0.0
    forward = 0
    with tqdm(total=n, desc="LM samples", unit="seq", disable=not progress, leave=False) as bar:
        while len(tokens) < n:
            b = min(batch_size, n - len(tokens))
            batch = sample(prefilled, b, max_new_tokens=max_new_tokens, generator=generator,
                           batch_size=b, timer=timer, watch=cut_by)
            tokens.extend(batch.token_ids)
            cut.extend(batch.cut)
            seconds += batch.seconds
            forward += batch.forward_tokens
            bar.update(b)
    start = time.perf_counter()
    complete = np.array([bool(t) and t[-1] in eos and not c for t, c in zip(tokens, cut)],
                        dtype=bool)
    texts = [lm.tokenizer.decode([x for x in t if x not in eos], skip_special_tokens=False,
                                 clean_up_tokenization_spaces=False)  # the text as sampled
             for t in tokens]
    valid = np.array([c and acceptor.accepts(s) for c, s in zip(complete, texts)], dtype=bool)
    seconds += time.perf_counter() - start  # checking is part of rejection's cost
    return LMDraws(token_ids=tokens, texts=texts, complete=complete, valid=valid, seconds=seconds,
                   cut=np.array(cut, dtype=bool), forward_tokens=forward)


@dataclass
class RejectionSamples:
    """Valid samples of the exact target, and what they cost."""

    token_ids: list[list[int]]
    texts: list[str]
    n_draws: int
    seconds: float

    @property
    def seconds_per_accepted(self) -> float:
        return self.seconds / len(self.texts) if self.texts else float("inf")

    @property
    def acceptance_rate(self) -> float:
        return len(self.texts) / self.n_draws if self.n_draws else 0.0


def rejection_sample(prefilled: PrefilledPrompt, grammar: Grammar, n_accept: int, *,
                     max_draws: int = 10000, max_new_tokens: int = 128, batch_size: int = 64,
                     generator: torch.Generator | None = None) -> RejectionSamples:
    """Draw from the LM until ``n_accept`` valid samples (or ``max_draws`` draws); only valid
    strings are returned."""
    toks: list[list[int]] = []
    texts: list[str] = []
    draws, seconds = 0, 0.0
    while len(texts) < n_accept and draws < max_draws:
        b = min(batch_size, max_draws - draws)
        got = draw_lm_samples(prefilled, grammar, b, max_new_tokens=max_new_tokens,
                              batch_size=b, generator=generator)
        draws += b
        seconds += got.seconds
        for ok, t, s in zip(got.valid, got.token_ids, got.texts):
            if ok and len(texts) < n_accept:
                toks.append(t)
                texts.append(s)
    return RejectionSamples(token_ids=toks, texts=texts, n_draws=draws, seconds=seconds)
