"""Exact sequence scoring by teacher forcing: log p(x) under the LM and under each method.

A method's probability of an output is the product of its own per-step distributions along the
output: masking renormalises the LM over the allowed tokens; SHIM and ASAp first add their
log-weights (log γ̂, log EFG) to the allowed tokens. All methods share one LM forward pass and
one masker replay per batch; each adjuster is asked once per step for all live rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from shim_adapters.errors import ForbiddenTokenError, VocabMismatchError
from shim_adapters.evaluation.timing import NullTimer, PhaseTimer
from shim_adapters.lm.generation import LogitAdjuster
from shim_adapters.lm.kv_cache import forward_with_cache
from shim_adapters.lm.sampling import PrefilledPrompt
from shim_adapters.mask.protocol import Masker

#: The method name of plain masking (no adjuster).
MASKING = "masking"


@dataclass
class SequenceScores:
    """Per sequence: log-probabilities under the LM and each method (-inf: impossible)."""

    lm: np.ndarray
    methods: dict[str, np.ndarray]
    #: True where the masker allowed every token and accepted the sequence (ends with EOS).
    masker_accepts: np.ndarray
    #: The step at which the masker first refused a token (-1: never).
    forbidden_step: np.ndarray


def _batch_size(length: int, width: int, budget_bytes: float = 2.5e8) -> int:
    return int(max(1, min(64, budget_bytes // max(1, length * width * 4))))


def step_logprobs(prefilled: PrefilledPrompt, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """(B, L, V) next-token log-probabilities at every step of each (right-padded) sequence.

    Right padding never changes a real position's logits: attention is causal.
    """
    lm = prefilled.lm
    b = len(sequences)
    length = max(len(s) for s in sequences)
    width = prefilled.last_logits.shape[-1]
    first = torch.log_softmax(prefilled.last_logits, dim=-1).expand(b, 1, width)
    if length == 1:
        return first.clone()
    pad = min(int(e) for e in lm.eos_token_ids) if lm.eos_token_ids else 0
    inputs = torch.full((b, length - 1), pad, dtype=torch.long)
    for i, seq in enumerate(sequences):
        body = list(seq[:length - 1])
        inputs[i, :len(body)] = torch.as_tensor(body, dtype=torch.long)
    with torch.no_grad():
        logits, _ = forward_with_cache(lm.model, inputs, prefilled.cache(b))
    rest = torch.log_softmax(logits.float(), dim=-1)
    return torch.cat([first, rest], dim=1)


def score_sequences(prefilled: PrefilledPrompt, sequences: Sequence[Sequence[int]],
                    masker: Masker | None = None,
                    adjusters: Mapping[str, LogitAdjuster | None] | None = None, *,
                    batch_size: int | None = None,
                    timer: PhaseTimer | None = None) -> SequenceScores:
    """Teacher-force every sequence (token ids after the prompt, EOS included) and return
    its exact log-probability under the LM and under each method in ``adjusters`` (a name ->
    adjuster map; ``None`` is plain masking). Methods need ``masker``."""
    adjusters = dict(adjusters or {})
    if adjusters and masker is None:
        raise ValueError("scoring a constrained method needs the masker it decodes with")
    if masker is not None and masker.vocab_size != prefilled.lm.vocab_size:
        raise VocabMismatchError(f"masker compiled for logits of width {masker.vocab_size}, "
                                 f"but {prefilled.lm.identifier} has {prefilled.lm.vocab_size}")
    timer = timer or NullTimer()
    n = len(sequences)
    lm_lp = np.zeros(n)
    method_lp = {name: np.zeros(n) for name in adjusters}
    accepts = np.zeros(n, dtype=bool)
    forbidden = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return SequenceScores(lm_lp, method_lp, accepts, forbidden)
    order = np.argsort([len(s) for s in sequences], kind="stable")  # similar lengths together
    width = prefilled.last_logits.shape[-1]
    pos = 0
    while pos < n:
        size = batch_size or _batch_size(len(sequences[order[min(n - 1, pos + 63)]]), width)
        idx = order[pos:pos + size]
        pos += len(idx)
        batch = [list(map(int, sequences[i])) for i in idx]
        logp = step_logprobs(prefilled, batch)
        for k, i in enumerate(idx):
            seq = batch[k]
            lm_lp[i] = float(logp[k, torch.arange(len(seq)), torch.as_tensor(seq)].sum())
        if masker is None:
            continue
        _score_methods(logp, batch, idx, masker, adjusters, method_lp, accepts, forbidden, timer)
    return SequenceScores(lm_lp, method_lp, accepts, forbidden)


def _score_methods(logp, batch, idx, masker, adjusters, method_lp, accepts, forbidden, timer):
    states = [masker.new_state() for _ in batch]
    alive = np.ones(len(batch), dtype=bool)
    length = max(len(s) for s in batch)
    for step in range(length):
        live = [k for k in range(len(batch)) if alive[k] and step < len(batch[k])]
        if not live:
            break
        allowed, tok_pos, la_rows = [], [], []
        keep = []
        for k in live:
            mask = states[k].allowed_mask()
            tok = batch[k][step]
            if not mask[tok]:
                alive[k] = False
                forbidden[idx[k]] = step
                for name in adjusters:
                    method_lp[name][idx[k]] = -np.inf
                continue
            ids = np.flatnonzero(mask)
            keep.append(k)
            allowed.append(ids)
            tok_pos.append(int(np.searchsorted(ids, tok)))
            la_rows.append(logp[k, step, torch.as_tensor(ids)].double().numpy())
        if not keep:
            continue
        for name, adjuster in adjusters.items():
            if adjuster is None:
                weights = la_rows
            else:
                t0 = time.perf_counter()
                gammas = adjuster.log_gamma([states[k] for k in keep], allowed)
                timer.add("gamma", time.perf_counter() - t0)
                weights = [la + np.asarray(lg, dtype=np.float64)
                           for la, lg in zip(la_rows, gammas)]
            for k, w, p in zip(keep, weights, tok_pos):
                method_lp[name][idx[k]] += w[p] - np.logaddexp.reduce(w)
        for k in keep:
            try:
                states[k].advance(batch[k][step])
            except ForbiddenTokenError:
                # the mask allowed the token but the masker's parser refuses it (a backend
                # inconsistency): no masked method can produce this sequence
                alive[k] = False
                forbidden[idx[k]] = step
                for name in adjusters:
                    method_lp[name][idx[k]] = -np.inf
    for k in range(len(batch)):
        accepts[idx[k]] = bool(alive[k] and states[k].is_finished)
        if alive[k] and not states[k].is_finished:
            # ran out of tokens before EOS: no method ends here, so no finite probability
            for name in adjusters:
                method_lp[name][idx[k]] = -np.inf

