"""A KV-cached sampling loop shared by every method, so their costs are measured alike.

The prompt is run through the LM once (:func:`prefill`) and its cache is copied per batch.
Each step: LM forward, the masker's mask per row, the method's log-weights (SHIM's γ̂, ASAp's
expected future grammaticality), renormalisation, sampling, advance. With no masker the loop
samples the LM as it is (temperature 1, top-p 1, no top-k), as ``FAITHFUL_SAMPLING`` does.
A row with no allowed token before the grammar accepts raises :class:`DeadEndError`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from ..errors import DeadEndError, ForbiddenTokenError, VocabMismatchError
from ..generation import LogitAdjuster
from ..protocol import Masker, MaskerState
from .timing import NullTimer, PhaseTimer


@dataclass
class PrefilledPrompt:
    """A prompt run through the LM once: its token ids, KV cache and next-token logits."""

    lm: object
    prompt: str
    ids: torch.Tensor  # (1, P)
    past: tuple  # legacy (key, value) per layer, batch 1
    last_logits: torch.Tensor  # (V,)

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])

    def cache(self, batch: int):
        """A fresh cache for ``batch`` rows that all continue this prompt (one shared copy of
        the prompt's KV where the model's attention supports it)."""
        from transformers import DynamicCache

        from .lm_views import shared_prefix_cache, uses_split_attention

        if uses_split_attention(self.lm.model):
            return shared_prefix_cache(self.past, batch)
        return DynamicCache.from_legacy_cache(tuple(
            tuple(t.expand(batch, *t.shape[1:]).contiguous() for t in layer)
            for layer in self.past))


def prefill(lm, prompt: str) -> PrefilledPrompt:
    """Run ``prompt`` through ``lm`` (a LoadedLM) once."""
    ids = lm.tokenizer(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens; the LM needs at least one token of "
                         "context")
    with torch.no_grad():
        out = lm.model(input_ids=ids, use_cache=True)
    past = out.past_key_values
    legacy = past.to_legacy_cache() if hasattr(past, "to_legacy_cache") else past
    return PrefilledPrompt(lm=lm, prompt=prompt, ids=ids, past=legacy,
                           last_logits=out.logits[0, -1, :].float())


def eos_ids(lm, masker: Masker | None = None) -> frozenset[int]:
    ids = set(int(e) for e in lm.eos_token_ids)
    if masker is not None:
        ids |= set(int(e) for e in masker.eos_token_ids)
    return frozenset(ids)


@dataclass
class DecodeBatch:
    """Samples of one :func:`decode` call, one entry per row."""

    token_ids: list[list[int]]
    #: True where EOS was emitted (False: max_new_tokens was reached first).
    finished: list[bool]
    #: Per row and step: log p_LM(token | prefix) of the sampled token.
    lm_logprobs: list[list[float]]
    #: Per row and step: log of the LM mass the masker allowed (empty without a masker).
    log_allowed_mass: list[list[float]]
    seconds: float
    states: list[MaskerState] = field(default_factory=list)
    #: True where ``cut_by`` refused a token and the row was stopped there.
    cut: list[bool] = field(default_factory=list)
    #: True where the masker refused a token its own mask allowed (a backend bug); the row
    #: stopped there. ``errors`` holds the messages.
    failed: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def decode(prefilled: PrefilledPrompt, n: int, *, masker: Masker | None = None,
           adjuster: LogitAdjuster | None = None, max_new_tokens: int = 128,
           generator: torch.Generator | None = None,
           timer: PhaseTimer | None = None, cut_by: Masker | None = None) -> DecodeBatch:
    """Sample ``n`` continuations in one batch (masked if ``masker``, re-weighted if
    ``adjuster``). Unmasked with ``cut_by``: a row stops at the first token that masker
    refuses (it can no longer be valid if the masker is sound), which saves the steps of
    hopeless rows; ``DecodeBatch.cut`` marks them."""
    lm = prefilled.lm
    timer = timer or NullTimer()
    if adjuster is not None and masker is None:
        raise ValueError("an adjuster re-weights the masker's allowed tokens: pass a masker")
    if masker is not None and masker.vocab_size != lm.vocab_size:
        raise VocabMismatchError(f"masker compiled for logits of width {masker.vocab_size}, "
                                 f"but {lm.identifier} has {lm.vocab_size}")
    eos = eos_ids(lm, masker)
    pad = min(eos)
    start = time.perf_counter()
    if cut_by is not None and masker is not None:
        raise ValueError("cut_by watches unconstrained sampling; a masked row is never refused")
    states = [masker.new_state() for _ in range(n)] if masker is not None else []
    watched = [cut_by.new_state() for _ in range(n)] if cut_by is not None else []
    cut = [False] * n
    failed = [False] * n
    errors: list[str] = []
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    logz: list[list[float]] = [[] for _ in range(n)]
    finished = np.zeros(n, dtype=bool)
    with torch.no_grad():
        cache = prefilled.cache(n)
        logits = prefilled.last_logits.expand(n, -1)
        for step in range(max_new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            live = np.flatnonzero(~finished)
            scores = logp
            if masker is not None:
                scores, row_logz = _constrain(logp, states, live, step, adjuster, timer)
            t0 = time.perf_counter()
            nxt = torch.multinomial(scores.exp(), 1, generator=generator).squeeze(1)
            timer.add("sample", time.perf_counter() - t0)
            nxt_np = nxt.numpy()
            logp_np = logp.numpy()
            for k, i in enumerate(live):
                t = int(nxt_np[i])
                tokens[i].append(t)
                lps[i].append(float(logp_np[i, t]))
                if masker is not None:
                    logz[i].append(float(row_logz[k]))
                    t0 = time.perf_counter()
                    try:
                        states[i].advance(t)
                    except ForbiddenTokenError as exc:
                        # the mask allowed t but the masker's own parser refuses it: a backend
                        # inconsistency. The row stops here (never continues unconstrained).
                        failed[i] = True
                        finished[i] = True
                        errors.append(str(exc))
                    timer.add("advance", time.perf_counter() - t0)
                if watched:
                    if watched[i].allowed_mask()[t]:
                        watched[i].advance(t)
                    else:
                        cut[i] = True
                        finished[i] = True
                if t in eos:
                    finished[i] = True
            if finished.all():
                break
            nxt[torch.from_numpy(finished)] = pad
            t0 = time.perf_counter()
            out = lm.model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[:, -1, :]
            timer.add("lm_forward", time.perf_counter() - t0)
    ended = [bool(f) and not c and not e for f, c, e in zip(finished, cut, failed)]
    return DecodeBatch(token_ids=tokens, finished=ended, lm_logprobs=lps,
                       log_allowed_mass=logz, seconds=time.perf_counter() - start,
                       states=states, cut=cut, failed=failed, errors=errors)


def _constrain(logp: torch.Tensor, states: Sequence[MaskerState], live: np.ndarray, step: int,
               adjuster: LogitAdjuster | None, timer: PhaseTimer):
    """Masked (and re-weighted) log-probabilities for the live rows; finished rows keep the
    LM's so that sampling stays defined (their tokens are ignored)."""
    n, width = logp.shape
    mask = np.ones((n, width), dtype=bool)
    phase = "first_mask" if step == 0 else "mask"
    for i in live:
        t0 = time.perf_counter()
        m = states[i].allowed_mask()
        timer.add(phase, time.perf_counter() - t0)
        if not m.any():
            raise DeadEndError(states[i].step, states[i].describe(), row=int(i))
        mask[i] = m
    log_gamma = None
    if adjuster is not None:
        allowed = [np.flatnonzero(mask[i]) for i in live]
        t0 = time.perf_counter()
        log_gamma = adjuster.log_gamma([states[i] for i in live], allowed)
        timer.add("gamma", time.perf_counter() - t0)
    t0 = time.perf_counter()
    masked = logp.masked_fill(~torch.from_numpy(mask), float("-inf"))
    live_t = torch.as_tensor(live, dtype=torch.long)
    row_logz = torch.logsumexp(masked[live_t], dim=-1).numpy()
    scores = masked
    if log_gamma is not None:
        scores = masked.clone()
        for i, ids, lg in zip(live, allowed, log_gamma):
            lg_t = torch.as_tensor(np.asarray(lg, dtype=np.float32))
            if lg_t.shape != (len(ids),) or not torch.isfinite(lg_t).all():
                raise ValueError(f"adjuster returned {tuple(lg_t.shape)} values (finite "
                                 f"required) for {len(ids)} allowed tokens at step {step}")
            scores[i, torch.as_tensor(ids)] += lg_t
    scores = torch.log_softmax(scores, dim=-1)
    timer.add("apply", time.perf_counter() - t0)
    return scores, row_logz
