"""ASAp / grammar-aligned decoding (Park et al., 2024) on the MaskerState protocol.

ASAp keeps a prefix trie of expected future grammaticality EFG(h) = P(G | h). Every allowed
token starts optimistic (EFG = 1, which is plain masking); after each sample, each node on its
path is set to the LM mass its allowed children carry, weighted by their EFG (the mass the mask
removed is lost), from the leaf back to the root. Sampling uses p(t|h)·EFG(h·t) over the
allowed set, so the sampler converges to the exact target as samples accumulate -- at a cost
that recurs per sample and a trie that grows with every token sampled.

:class:`AsapTrie` is a :class:`~shim_adapters.lm.generation.LogitAdjuster` (log EFG of each
allowed child), so it samples and scores through the same code as SHIM.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from shim_adapters.evaluation.timing import NullTimer, PhaseTimer
from shim_adapters.lm.sampling import PrefilledPrompt, eos_ids, sample
from shim_adapters.mask.protocol import Masker, MaskerState

#: Floor for log EFG so the weights stay finite (a node whose every child failed).
_LOG_FLOOR = -700.0


class _Node:
    __slots__ = ("children", "child_p", "allowed_mass", "efg")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        #: LM probability of each visited child token at this node.
        self.child_p: dict[int, float] = {}
        #: LM mass of the tokens the mask allowed here (None until visited).
        self.allowed_mass: float | None = None
        self.efg = 1.0

    def recompute(self) -> None:
        """EFG(h) = Σ_allowed p(t|h)·EFG(h·t), unvisited children counting 1."""
        visited = sum(self.child_p.values())
        unvisited = max(self.allowed_mass - visited, 0.0)
        seen = 0.0
        for tok, p in self.child_p.items():
            child = self.children.get(tok)
            seen += p * (1.0 if child is None else child.efg)
        self.efg = min(1.0, unvisited + seen)


class AsapTrie:
    """The EFG trie; ``update`` it with each finished sample, ``log_gamma`` to re-weight."""

    def __init__(self, eos_token_ids: Sequence[int]):
        self.eos = frozenset(int(e) for e in eos_token_ids)
        self.root = _Node()
        self.n_samples = 0
        self.n_tokens = 0
        self.n_nodes = 1

    def node(self, prefix: Sequence[int]) -> _Node | None:
        node = self.root
        for tok in prefix:
            node = node.children.get(int(tok))
            if node is None:
                return None
        return node

    def efg(self, prefix: Sequence[int]) -> float:
        """Current estimate of P(G | prefix) (1 where the trie knows nothing yet)."""
        node = self.node(prefix)
        return 1.0 if node is None else node.efg

    def update(self, tokens: Sequence[int], lm_logprobs: Sequence[float],
               log_allowed_mass: Sequence[float]) -> None:
        """Add one sample: per step, its token, log p_LM(token | prefix) and the log LM mass the
        mask allowed there. A sample cut before EOS still teaches the masses on its path."""
        if not (len(tokens) == len(lm_logprobs) == len(log_allowed_mass)):
            raise ValueError("tokens, lm_logprobs and log_allowed_mass must align per step")
        path = [self.root]
        for step, tok in enumerate(tokens):
            tok = int(tok)
            node = path[-1]
            node.allowed_mass = math.exp(log_allowed_mass[step])
            node.child_p[tok] = math.exp(lm_logprobs[step])
            if tok in self.eos:
                break  # the empty continuation after EOS is grammatical: EFG = 1, no node
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node()
                self.n_nodes += 1
            path.append(child)
        for node in reversed(path):
            if node.allowed_mass is not None:
                node.recompute()
        self.n_samples += 1
        self.n_tokens += len(tokens)

    def log_gamma(self, states: Sequence[MaskerState],
                  allowed: Sequence[np.ndarray]) -> list[np.ndarray]:
        """log EFG of each allowed child (0 for children the trie has not visited)."""
        out = []
        for state, ids in zip(states, allowed):
            lg = np.zeros(len(ids), dtype=np.float64)
            node = self.node(state.token_ids)
            if node is not None and node.children:
                for tok, child in node.children.items():
                    pos = int(np.searchsorted(ids, tok))
                    if pos < len(ids) and ids[pos] == tok:
                        lg[pos] = max(math.log(child.efg), _LOG_FLOOR) if child.efg > 0 \
                            else _LOG_FLOOR
            out.append(lg)
        return out

    def snapshot(self) -> "AsapTrie":
        """A frozen copy (for scoring ASAp as it stood after k samples)."""
        return copy.deepcopy(self)

    def nbytes(self) -> int:
        """Python memory held by the trie (nodes, their dicts, keys and floats)."""
        total = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            total += sys.getsizeof(node) + sys.getsizeof(node.children) + \
                sys.getsizeof(node.child_p) + 24 * (len(node.child_p) + 1)
            total += 28 * len(node.child_p)  # int keys
            stack.extend(node.children.values())
        return total


@dataclass
class AsapRun:
    """ASAp after ``n_samples`` samples, with snapshots and its cost as it grew."""

    trie: AsapTrie
    snapshots: dict[int, AsapTrie]
    #: One entry per batch: samples so far, tokens so far, trie nodes and bytes, seconds.
    growth: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    samples: list[list[int]] = field(default_factory=list)
    #: Samples dropped because the masker refused a token its mask allowed (backend bug).
    masker_errors: list[str] = field(default_factory=list)

    @property
    def seconds_per_sample(self) -> float:
        return self.seconds / max(1, self.trie.n_samples)


def run_asap(prefilled: PrefilledPrompt, masker: Masker, n_samples: int, *,
             checkpoints: Sequence[int] = (), batch_size: int = 1, max_new_tokens: int = 128,
             generator: torch.Generator | None = None, timer: PhaseTimer | None = None,
             trie: AsapTrie | None = None) -> AsapRun:
    """Draw ``n_samples`` ASAp samples; the trie is updated after every batch (``batch_size``
    1 is the sequential algorithm; larger batches trade exactness of the schedule for speed)."""
    timer = timer or NullTimer()
    trie = trie or AsapTrie(eos_ids(prefilled.lm, masker))
    run = AsapRun(trie=trie, snapshots={})
    wanted = sorted(set(int(c) for c in checkpoints if 0 <= c <= n_samples))
    if 0 in wanted:
        run.snapshots[0] = trie.snapshot()
    start = time.perf_counter()
    done = 0
    while done < n_samples:
        b = min(batch_size, n_samples - done)
        if wanted:  # never step over a checkpoint
            nxt = [c for c in wanted if c > done]
            if nxt:
                b = min(b, nxt[0] - done)
        batch = sample(prefilled, b, masker=masker, adjuster=trie, max_new_tokens=max_new_tokens,
                       batch_size=b,
                       generator=generator, timer=timer)
        t0 = time.perf_counter()
        for toks, lps, logz, bad in zip(batch.token_ids, batch.lm_logprobs,
                                        batch.log_allowed_mass, batch.failed):
            if bad:  # the masker broke down on this sample: its path teaches nothing reliable
                run.masker_errors.append(batch.errors[0] if batch.errors else "")
                continue
            trie.update(toks, lps, logz)
        timer.add("asap_update", time.perf_counter() - t0)
        run.samples.extend(batch.token_ids)
        done += b
        run.growth.append({"samples": trie.n_samples, "tokens": trie.n_tokens,
                           "nodes": trie.n_nodes, "bytes": trie.nbytes(),
                           "seconds": time.perf_counter() - start})
        if done in wanted:
            run.snapshots[done] = trie.snapshot()
    run.seconds = time.perf_counter() - start
    return run
