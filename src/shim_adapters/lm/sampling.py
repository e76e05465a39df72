"""One batched sampling engine: every path that draws from the LM (fitting, evaluation, ASAp,
``shim sample``, exact-target mode) goes through :func:`sample`.

The prompt is run through the LM once (:func:`prefill`) and its KV cache is shared by every row
(one copy where the model's attention reads it in place, see :mod:`.views`). Per
step and live row the engine records what every consumer needs, so no one re-derives it:

- ``lm_logprobs``: the LM's exact log-probability of the sampled token;
- ``log_allowed_mass``: log Z, the LM mass of the tokens the masker allows (masked runs);
- ``proposal_logprobs``: the log-probability of the token under the distribution it was
  actually drawn from (the LM itself, masking, SHIM, a defensive mixture). Their difference
  along a suffix is the importance ratio p/q that turns any valid-only proposal into training
  labels and fidelity estimates (docs/design.md).

Masked runs: optional ``adjuster`` (SHIM's γ̂, ASAp's trie) adds log-weights to the allowed
tokens; ``defensive`` mixes the adjusted proposal with plain masking per step,
q = α·q_mask + (1 − α)·q_adjusted, which keeps every ratio p/q ≤ Z/α. A row with no allowed
token before the grammar accepts raises :class:`~shim_adapters.errors.DeadEndError` with its
state: the constraint is never dropped. Unconstrained runs: optional ``watch`` masker stops a row
at the first token it refuses (the row can no longer be valid if the masker is sound), which is
most of the cost saved when the LM is rarely valid. Finished rows leave the batch (their KV is
dropped), so the forward passes counted in ``forward_tokens`` are the work actually done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch
from transformers import Cache

from shim_adapters.errors import DeadEndError, ForbiddenTokenError, VocabMismatchError
from shim_adapters.lm.kv_cache import forward_with_cache, prompt_kv, widened
from shim_adapters.lm.views import shared_prefix_cache, uses_split_attention
from shim_adapters.mask.bitmask import allocate_token_bitmask, bitmask_to_bool, rows_with_any
from shim_adapters.mask.protocol import Masker, MaskerState


class _Timer(Protocol):
    def add(self, phase: str, seconds: float) -> None: ...


class _NoTimer:
    def add(self, phase: str, seconds: float) -> None:
        pass


@dataclass
class PrefilledPrompt:
    """A prompt run through the LM once: its token ids, KV cache and next-token logits."""

    lm: object
    prompt: str
    ids: torch.Tensor  # (1, P)
    #: The model's own cache of the prompt (batch 1), as the forward pass returned it. Never
    #: handed to the model again: every batch gets a copy (:meth:`cache`).
    past: Cache
    last_logits: torch.Tensor  # (V,)

    @property
    def length(self) -> int:
        return int(self.ids.shape[1])

    def cache(self, batch: int):
        """A fresh cache for ``batch`` rows that all continue this prompt (one shared copy of
        the prompt's KV where the model's attention supports it)."""
        if uses_split_attention(self.lm.model):
            return shared_prefix_cache(prompt_kv(self.past), batch)
        return widened(self.past, batch)


def prefill(lm, prompt: str, *, add_special_tokens: bool = True) -> PrefilledPrompt:
    """Run ``prompt`` through ``lm`` once. A prompt rendered by a chat template already holds
    its special tokens: pass ``add_special_tokens=False`` (see :mod:`.prompting`)."""
    ids = lm.tokenizer(prompt, return_tensors="pt",
                       add_special_tokens=add_special_tokens)["input_ids"]
    if ids.shape[1] == 0:
        raise ValueError("the prompt encodes to no tokens; the LM needs at least one token of "
                         "context (give a non-empty prompt)")
    with torch.no_grad():
        logits, past = forward_with_cache(lm.model, ids)
    return PrefilledPrompt(lm=lm, prompt=prompt, ids=ids, past=past,
                           last_logits=logits[0, -1, :].float())


def eos_ids(lm, masker: Masker | None = None) -> frozenset[int]:
    """Every id that ends an output: the LM's EOS ids and the masker's."""
    ids = set(int(e) for e in lm.eos_token_ids)
    if masker is not None:
        ids |= set(int(e) for e in masker.eos_token_ids)
    return frozenset(ids)


class StepRecorder(Protocol):
    """Sees every (row, step) before its token is consumed (training data records rows)."""

    def record(self, row: int, step: int, state: MaskerState, token: int, logp: np.ndarray,
               mask: np.ndarray, log_z: float) -> None:
        """``state``: the row's masker (or watcher) state before ``token``; ``logp``: the LM's
        log-probabilities over the logit width; ``mask``: the state's allowed set."""


@dataclass
class Samples:
    """Rows of one :func:`sample` call, in row order."""

    token_ids: list[list[int]]
    #: True where EOS was emitted (not cut, not failed, not truncated by max_new_tokens).
    finished: list[bool]
    #: Per row and step: log p_LM(token | prefix).
    lm_logprobs: list[list[float]]
    #: Per row and step: log Z of the masker's (or watcher's) allowed set; empty if neither.
    log_allowed_mass: list[list[float]]
    #: Per row and step: log q(token | prefix) under the distribution it was drawn from.
    proposal_logprobs: list[list[float]]
    seconds: float
    #: LM positions evaluated (one per live row per step): the CARS-style cost unit.
    forward_tokens: int
    states: list[MaskerState] = field(default_factory=list)
    #: True where the watching masker refused a token and the row stopped there.
    cut: list[bool] = field(default_factory=list)
    #: True where the masker refused a token its own mask allowed (a backend bug).
    failed: list[bool] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.token_ids)

    def total_lm_logprob(self) -> np.ndarray:
        return np.array([float(np.sum(r)) for r in self.lm_logprobs])

    def total_proposal_logprob(self) -> np.ndarray:
        return np.array([float(np.sum(r)) for r in self.proposal_logprobs])

    def extend(self, other: "Samples") -> None:
        for name in ("token_ids", "finished", "lm_logprobs", "log_allowed_mass",
                     "proposal_logprobs", "states", "cut", "failed", "errors"):
            getattr(self, name).extend(getattr(other, name))
        self.seconds += other.seconds
        self.forward_tokens += other.forward_tokens


def _empty_samples() -> Samples:
    return Samples([], [], [], [], [], 0.0, 0)


def sample(prefilled: PrefilledPrompt, n: int, *, masker: Masker | None = None,
           adjuster=None, defensive: float = 0.0, watch: Masker | None = None,
           max_new_tokens: int = 128, batch_size: int = 64,
           generator: torch.Generator | None = None, timer: _Timer | None = None,
           recorder: StepRecorder | None = None, progress: bool = False,
           progress_label: str = "sampling") -> Samples:
    """Draw ``n`` continuations of the prefilled prompt in batches of ``batch_size``.

    No masker: the LM as it is (temperature 1, top-p 1, no top-k), optionally ``watch``-ed.
    With a masker: masked, re-weighted by ``adjuster`` (a
    :class:`~shim_adapters.lm.generation.LogitAdjuster`) and mixed with masking by ``defensive``.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if adjuster is not None and masker is None:
        raise ValueError("an adjuster re-weights the masker's allowed tokens: pass a masker")
    if watch is not None and masker is not None:
        raise ValueError("watch observes unconstrained sampling; a masked row is never refused")
    if not 0.0 <= defensive <= 1.0:
        raise ValueError(f"defensive must lie in [0, 1], got {defensive}")
    lm = prefilled.lm
    for m in (masker, watch):
        if m is not None and m.vocab_size != lm.vocab_size:
            raise VocabMismatchError(f"masker compiled for logits of width {m.vocab_size}, "
                                     f"but {lm.identifier} has {lm.vocab_size}")
    from tqdm.auto import tqdm

    out = _empty_samples()
    with tqdm(total=n, desc=progress_label, unit="seq", disable=not progress,
              leave=False) as bar:
        while out.n < n:
            b = min(batch_size, n - out.n)
            batch = _sample_batch(prefilled, b, masker, adjuster, defensive, watch,
                                  max_new_tokens, generator, timer or _NoTimer(), recorder,
                                  offset=out.n)
            out.extend(batch)
            bar.update(b)
    return out


def _sample_batch(prefilled, n, masker, adjuster, defensive, watch, max_new_tokens, generator,
                  timer, recorder, offset: int) -> Samples:
    lm = prefilled.lm
    eos = eos_ids(lm, masker if masker is not None else watch)
    start = time.perf_counter()
    constraint = masker if masker is not None else watch
    states = [constraint.new_state() for _ in range(n)] if constraint is not None else []
    tokens: list[list[int]] = [[] for _ in range(n)]
    lps: list[list[float]] = [[] for _ in range(n)]
    logz: list[list[float]] = [[] for _ in range(n)]
    lqs: list[list[float]] = [[] for _ in range(n)]
    finished = np.zeros(n, dtype=bool)
    ended = np.zeros(n, dtype=bool)
    cut = [False] * n
    failed = [False] * n
    errors: list[str] = []
    forward = 0
    rows = np.arange(n)  # batch position -> row, for the rows still in the batch
    width = constraint.vocab_size if constraint is not None else 0
    bitmask = allocate_token_bitmask(n, width) if constraint is not None else None
    with torch.no_grad():
        cache = prefilled.cache(n)
        logits = prefilled.last_logits.expand(n, -1)
        for step in range(max_new_tokens):
            logp = torch.log_softmax(logits.float(), dim=-1)
            masks = row_logz = None
            if constraint is not None:
                bits = _fill(bitmask, states, rows, step, timer, dead_end=masker is not None)
                if recorder is not None or (masker is not None and adjuster is not None
                                            and not hasattr(adjuster, "add_log_gamma_")):
                    masks = bitmask_to_bool(bits, width).numpy()
                t0 = time.perf_counter()
                allowed_logp = logp.clone()
                constraint.apply_token_bitmask_(allowed_logp, bits)
                row_logz = torch.logsumexp(allowed_logp, dim=-1).numpy()
                timer.add("apply", time.perf_counter() - t0)
            if masker is not None:
                q = _proposal(allowed_logp, masks, rows, states, adjuster, defensive, step,
                              timer)
            else:
                q = logp
            t0 = time.perf_counter()
            # one uniform per row of the batch as drawn, whether or not the row is still live:
            # a row's path depends on its own draws only (cutting or dropping other rows, or
            # which rows finished first, never changes it)
            u = torch.rand(n, generator=generator, dtype=torch.float64)[torch.as_tensor(rows)]
            nxt = _inverse_cdf(q, u)
            timer.add("sample", time.perf_counter() - t0)
            nxt_np = nxt.numpy()
            logp_np = logp.numpy()
            q_np = q.numpy() if masker is not None else logp_np
            bits_np = bits.numpy() if constraint is not None else None
            for k, i in enumerate(rows):
                t = int(nxt_np[k])
                tokens[i].append(t)
                lps[i].append(float(logp_np[k, t]))
                lqs[i].append(float(q_np[k, t]))
                if constraint is not None:
                    if not (int(bits_np[k, t >> 5]) >> (t & 31)) & 1:
                        # only a watcher can see a refused token: this row can no longer be
                        # valid, it stops here
                        cut[i] = True
                        finished[i] = True
                        continue
                    logz[i].append(float(row_logz[k]))
                    if recorder is not None:
                        recorder.record(offset + int(i), step, states[i], t, logp_np[k],
                                        masks[k], float(row_logz[k]))
                    t0 = time.perf_counter()
                    try:
                        states[i].advance(t)
                    except ForbiddenTokenError as exc:
                        # the mask allowed t but the masker's own parser refuses it: a backend
                        # inconsistency. The row stops here (never continues unconstrained).
                        failed[i] = True
                        finished[i] = True
                        errors.append(str(exc))
                        if recorder is not None and hasattr(recorder, "retract"):
                            recorder.retract(offset + int(i))
                        continue
                    finally:
                        timer.add("advance", time.perf_counter() - t0)
                if t in eos:
                    finished[i] = True
                    ended[i] = True
            forward += len(rows)
            live = np.flatnonzero(~finished[rows])
            if len(live) == 0:
                break
            if step + 1 == max_new_tokens:
                break
            if len(live) < len(rows):  # finished rows leave the batch and its KV cache
                index = torch.as_tensor(live, dtype=torch.long)
                cache.batch_select_indices(index)
                nxt = nxt[index]
                rows = rows[live]
            t0 = time.perf_counter()
            logits, cache = forward_with_cache(lm.model, nxt[:, None], cache)
            logits = logits[:, -1, :]
            timer.add("lm_forward", time.perf_counter() - t0)
    done = [bool(e) and not c and not f for e, c, f in zip(ended, cut, failed)]
    return Samples(token_ids=tokens, finished=done, lm_logprobs=lps, log_allowed_mass=logz,
                   proposal_logprobs=lqs, seconds=time.perf_counter() - start,
                   forward_tokens=forward, states=states,
                   cut=cut, failed=failed, errors=errors)


def _inverse_cdf(log_q: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the token whose cumulative probability first exceeds ``u`` times the row's
    total (a token of probability 0 is never drawn)."""
    cdf = torch.cumsum(log_q.exp().double(), dim=-1)
    # strictly below the total, so some cdf entry exceeds x: the index is a token of
    # positive probability (never one past the end or a forbidden token behind the last one)
    x = (u * cdf[:, -1] * (1.0 - 1e-12)).unsqueeze(1)
    return torch.searchsorted(cdf, x, right=True).squeeze(1)


def _fill(bitmask: torch.Tensor, states: Sequence[MaskerState], rows: np.ndarray, step: int,
          timer, dead_end: bool) -> torch.Tensor:
    """Each live row's allowed set, packed (XGrammar's layout) into the first rows of
    ``bitmask``; a row with no allowed token raises :class:`DeadEndError` (masked runs)."""
    phase = "first_mask" if step == 0 else "mask"
    bits = bitmask[: len(rows)]
    t0 = time.perf_counter()
    if len(rows):
        states[rows[0]].masker.fill_next_token_bitmasks([states[i] for i in rows], bits,
                                                        range(len(rows)))
    timer.add(phase, time.perf_counter() - t0)
    if dead_end:
        alive = rows_with_any(bits, states[rows[0]].masker.vocab_size)
        if not bool(alive.all()):
            k = int(np.flatnonzero(~alive.numpy())[0])
            i = rows[k]
            raise DeadEndError(states[i].step, states[i].describe(), row=int(i))
    return bits


def _proposal(allowed_logp: torch.Tensor, masks: np.ndarray | None, rows: np.ndarray,
              states: Sequence[MaskerState], adjuster, defensive: float, step: int,
              timer) -> torch.Tensor:
    """Log-probabilities of the masked (re-weighted, mixed) per-step proposal.

    ``allowed_logp``: the LM's log-probabilities with forbidden tokens at -inf. A SHIM adjuster
    adds its cached β·log γ̂ in place (one ``index_add_``); other adjusters (ASAp's trie) give
    values per allowed token."""
    t0 = time.perf_counter()
    masked = torch.log_softmax(allowed_logp, dim=-1)
    timer.add("apply", time.perf_counter() - t0)
    if adjuster is None:
        return masked
    t0 = time.perf_counter()
    scores = masked.clone()
    live = [states[i] for i in rows]
    if hasattr(adjuster, "add_log_gamma_"):
        adjuster.add_log_gamma_(scores, live)
    else:
        allowed_ids = [np.flatnonzero(m) for m in masks]
        log_gamma = adjuster.log_gamma(live, allowed_ids)
        for k, (ids, lg) in enumerate(zip(allowed_ids, log_gamma)):
            lg_t = torch.as_tensor(np.asarray(lg, dtype=np.float32))
            if lg_t.shape != (len(ids),) or not torch.isfinite(lg_t).all():
                raise ValueError(f"adjuster returned {tuple(lg_t.shape)} values (finite "
                                 f"required) for {len(ids)} allowed tokens at step {step}")
            scores[k, torch.as_tensor(ids)] += lg_t
    timer.add("gamma", time.perf_counter() - t0)
    t0 = time.perf_counter()
    adjusted = torch.log_softmax(scores, dim=-1)
    if 0.0 < defensive < 1.0:
        adjusted = torch.logaddexp(masked + float(np.log(defensive)),
                                   adjusted + float(np.log1p(-defensive)))
    elif defensive == 1.0:
        adjusted = masked
    timer.add("apply", time.perf_counter() - t0)
    return adjusted
