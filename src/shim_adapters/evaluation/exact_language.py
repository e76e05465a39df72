"""Enumerate a finite language token by token, with every sequence's exact probability.

For a finite language (the binary5 example) the whole token trie the masker allows can be
walked: at each node one LM forward gives the next-token distribution, the masker gives the
allowed set, each method gives its weights. Every leaf (EOS) is a token sequence of the
language with its LM probability and each method's probability, so KL(p(·|G) ‖ q) is exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.generation import LogitAdjuster
from shim_adapters.lm.kv_cache import forward_with_cache
from shim_adapters.lm.sampling import PrefilledPrompt, eos_ids
from shim_adapters.mask.protocol import Masker, MaskerState


class LanguageTooLargeError(ValueError):
    """The language has more token sequences than the enumeration budget allows."""


@dataclass
class EnumeratedLanguage:
    """Every token sequence the masker allows (EOS included), with exact log-probabilities."""

    sequences: list[list[int]]
    texts: list[str]
    lm: np.ndarray
    methods: dict[str, np.ndarray]

    def target(self) -> np.ndarray:
        """log p(x | G): the LM renormalised over the language."""
        return self.lm - np.logaddexp.reduce(self.lm)


@dataclass
class _Node:
    state: MaskerState
    tokens: list[int]
    lm: float
    methods: dict[str, float]


def enumerate_language(prefilled: PrefilledPrompt, masker: Masker,
                       adjusters: Mapping[str, LogitAdjuster | None], *,
                       max_sequences: int = 20000, max_length: int = 64) -> EnumeratedLanguage:
    """Walk the allowed token trie breadth-first; raise LanguageTooLargeError past the budget.

    Each leaf's text is checked with the reference acceptor: a masker that lets an invalid
    string through would otherwise silently enter the "exact" target.
    """
    lm = prefilled.lm
    eos = eos_ids(lm, masker)
    acceptor = reference_acceptor(masker.grammar)
    frontier = [_Node(masker.new_state(), [], 0.0, {name: 0.0 for name in adjusters})]
    leaves: list[_Node] = []
    for depth in range(max_length + 1):
        if not frontier:
            break
        if depth == max_length:
            raise LanguageTooLargeError(f"{masker.grammar.name}: sequences longer than "
                                        f"{max_length} tokens; not a small finite language")
        logp = _next_logprobs(prefilled, [node.tokens for node in frontier])
        masks = [node.state.allowed_mask() for node in frontier]
        allowed = [np.flatnonzero(m) for m in masks]
        weights = {}
        for name, adjuster in adjusters.items():
            gammas = (adjuster.log_gamma([n.state for n in frontier], allowed)
                      if adjuster is not None else [np.zeros(len(a)) for a in allowed])
            weights[name] = gammas
        nxt: list[_Node] = []
        for j, node in enumerate(frontier):
            ids = allowed[j]
            la = logp[j, torch.as_tensor(ids)].double().numpy()
            norm = {}
            for name in adjusters:
                w = la + np.asarray(weights[name][j], dtype=np.float64)
                norm[name] = w - np.logaddexp.reduce(w)
            for pos, tok in enumerate(ids):
                tok = int(tok)
                child_methods = {name: node.methods[name] + float(norm[name][pos])
                                 for name in adjusters}
                child_lm = node.lm + float(la[pos])
                if tok in eos:
                    leaves.append(_Node(node.state, node.tokens + [tok], child_lm, child_methods))
                else:
                    state = node.state.fork()
                    state.advance(tok)
                    nxt.append(_Node(state, node.tokens + [tok], child_lm, child_methods))
            if len(leaves) + len(nxt) > max_sequences:
                raise LanguageTooLargeError(f"{masker.grammar.name}: more than {max_sequences} "
                                            f"token sequences; not a small finite language")
        frontier = nxt
    texts = [masker.decode([t for t in leaf.tokens if t not in eos]) for leaf in leaves]
    rejected = [t for t in texts if not acceptor.accepts(t)]
    if rejected:
        raise ValueError(f"{masker.backend_name} allows strings the reference rejects for "
                         f"{masker.grammar.name}: {sorted(set(rejected))[:5]}")
    return EnumeratedLanguage(
        sequences=[leaf.tokens for leaf in leaves], texts=texts,
        lm=np.array([leaf.lm for leaf in leaves]),
        methods={name: np.array([leaf.methods[name] for leaf in leaves]) for name in adjusters})


def _next_logprobs(prefilled: PrefilledPrompt, prefixes: list[list[int]],
                   batch: int = 256) -> torch.Tensor:
    """(B, V) next-token log-probabilities after each prefix (all of equal length)."""
    width = prefilled.last_logits.shape[-1]
    if not prefixes[0]:
        return torch.log_softmax(prefilled.last_logits, -1).expand(len(prefixes), width)
    out = []
    for start in range(0, len(prefixes), batch):
        chunk = torch.as_tensor(prefixes[start:start + batch], dtype=torch.long)
        with torch.no_grad():
            logits, _ = forward_with_cache(prefilled.lm.model, chunk, prefilled.cache(len(chunk)))
        out.append(torch.log_softmax(logits[:, -1, :].float(), dim=-1))
    return torch.cat(out)
