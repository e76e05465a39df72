"""Exact probabilities of outputs under the LM, masked decoding and SHIM, by teacher forcing.

A decoding method is a per-step distribution: the LM's (``masker=None``), the LM renormalised
over the masker's allowed set (masking), or that set re-weighted by an adjuster's log γ̂
(SHIM). The probability of a token sequence under a method is the product of its per-step
probabilities, computed here by teacher forcing through the method's *own* distribution
(DESIGN.md section 3), batched over sequences.

For a finite language (binary5) :func:`enumerate_language` walks every token path the masker
allows, so the exact distribution of each method over the whole language, the exact target
p(x)·1[x in L] / Σ and the exact KL(target || method) are computable, per token sequence and per
output string (a string's probability sums over its tokenisations).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from .generation import LogitAdjuster
from .protocol import Masker, MaskerState
from .reference import reference_acceptor


def _model_and_tokenizer(model, tokenizer=None, masker: Masker | None = None):
    """Accept a LoadedLM or a bare model (the tokenizer then comes from masker/kwarg)."""
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        return model.model, tokenizer or model.tokenizer
    return model, tokenizer or (masker.tokenizer if masker is not None else None)


def _prompt_ids(prompt, tokenizer) -> list[int]:
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer: pass a LoadedLM, a masker or "
                             "tokenizer=")
        ids = tokenizer(prompt)["input_ids"]
    else:
        ids = [int(t) for t in prompt]
    if not ids:
        raise ValueError("the prompt has no tokens; the LM needs at least one token of context")
    return list(ids)


def _step_logprobs(model, prompt_ids: Sequence[int], sequences: Sequence[Sequence[int]]
                   ) -> list[np.ndarray]:
    """LM next-token log-probs (len(seq), vocab) for every position of each sequence."""
    lengths = [len(s) for s in sequences]
    width = len(prompt_ids) + max(lengths) - 1
    ids = torch.zeros((len(sequences), max(width, len(prompt_ids))), dtype=torch.long)
    att = torch.zeros_like(ids)
    for i, s in enumerate(sequences):
        row = list(prompt_ids) + list(s[:-1])
        ids[i, : len(row)] = torch.tensor(row)
        att[i, : len(row)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=att).logits.float()
    logp = torch.log_softmax(logits, dim=-1).double().numpy()
    p0 = len(prompt_ids) - 1
    return [logp[i, p0: p0 + n] for i, n in enumerate(lengths)]


def _method_step(logp: np.ndarray, state: MaskerState, adjuster: LogitAdjuster | None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(allowed ids, log q over them) of the masked (and adjusted) per-step distribution."""
    allowed = state.allowed_token_ids()
    v = logp[allowed].astype(np.float64)
    if adjuster is not None and len(allowed):
        v = v + np.asarray(adjuster.log_gamma([state], [allowed])[0], dtype=np.float64)
    if len(allowed):
        v = v - np.logaddexp.reduce(v)
    return allowed, v


def sequence_logprobs(model, prompt, sequences: Sequence[Sequence[int]], masker: Masker | None
                      = None, adjuster: LogitAdjuster | None = None, *, tokenizer=None,
                      batch_size: int = 64) -> np.ndarray:
    """log q(sequence) for each token sequence under the LM / masking / masking + adjuster.

    A sequence the method cannot produce (a token the masker forbids) gets -inf. Include the
    EOS token in a sequence to score a finished output.
    """
    if adjuster is not None and masker is None:
        raise ValueError("an adjuster re-weights a masker's allowed set: pass the masker too")
    model, tokenizer = _model_and_tokenizer(model, tokenizer, masker)
    prompt_ids = _prompt_ids(prompt, tokenizer)
    out = np.zeros(len(sequences))
    for start in range(0, len(sequences), batch_size):
        chunk = sequences[start: start + batch_size]
        nonempty = [j for j, s in enumerate(chunk) if len(s)]
        steps = _step_logprobs(model, prompt_ids, [chunk[j] for j in nonempty]) if nonempty \
            else []
        for j, logp in zip(nonempty, steps):
            seq = chunk[j]
            if masker is None:
                out[start + j] = float(logp[np.arange(len(seq)), list(seq)].sum())
                continue
            state = masker.new_state()
            total = 0.0
            for i, t in enumerate(seq):
                allowed, lq = _method_step(logp[i], state, adjuster)
                where = np.searchsorted(allowed, t)
                if where >= len(allowed) or allowed[where] != t:
                    total = -math.inf
                    break
                total += float(lq[where])
                state.advance(int(t))
            out[start + j] = total
    return out


def sequence_logprob(model, prompt, token_ids: Sequence[int], masker: Masker | None = None,
                     adjuster: LogitAdjuster | None = None, *, tokenizer=None) -> float:
    """log q(token_ids) under one method (see :func:`sequence_logprobs`)."""
    return float(sequence_logprobs(model, prompt, [token_ids], masker, adjuster,
                                   tokenizer=tokenizer)[0])


@dataclass
class ExactLanguageDistribution:
    """Every token sequence of a finite language with its exact probability per method."""

    sequences: list[tuple[int, ...]]  #: EOS included
    strings: list[str]
    lm_logprob: np.ndarray  #: log p(sequence) under the unconstrained LM
    method_logprob: dict[str, np.ndarray] = field(default_factory=dict)
    reference_rejects: list[str] = field(default_factory=list)  #: should be empty

    def target(self) -> np.ndarray:
        """p(x)·1[x in L] / Σ over the language's token sequences."""
        w = np.exp(self.lm_logprob - self.lm_logprob.max())
        return w / w.sum()

    def method(self, name: str) -> np.ndarray:
        return np.exp(self.method_logprob[name])

    def by_string(self, probs: np.ndarray) -> dict[str, float]:
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


def enumerate_language(lm, masker: Masker, prompt, adjusters: Mapping[str, LogitAdjuster | None]
                       | None = None, *, max_sequences: int = 20_000, max_length: int = 64,
                       tokenizer=None, batch_size: int = 256) -> ExactLanguageDistribution:
    """Walk every token path the masker allows from ``prompt`` to EOS.

    ``adjusters`` maps a method name to an adjuster (None: plain masking); ``"masking"`` is
    always included. Fails if the language has more than ``max_sequences`` token sequences or a
    path longer than ``max_length`` tokens (the language is not finite enough to enumerate).
    """
    model, tokenizer = _model_and_tokenizer(lm, tokenizer, masker)
    prompt_ids = _prompt_ids(prompt, tokenizer)
    methods = {"masking": None, **dict(adjusters or {})}
    eos = set(int(e) for e in masker.eos_token_ids)
    frontier: list[tuple[tuple[int, ...], MaskerState, float, dict[str, float]]] = [
        ((), masker.new_state(), 0.0, {m: 0.0 for m in methods})]
    leaves: list[tuple[tuple[int, ...], float, dict[str, float]]] = []
    depth = 0
    while frontier:
        if depth > max_length:
            raise ValueError(f"a path is longer than max_length={max_length} tokens: the "
                             f"language is too large to enumerate")
        nxt = []
        for start in range(0, len(frontier), batch_size):
            chunk = frontier[start: start + batch_size]
            ids = torch.tensor([list(prompt_ids) + list(p) for p, *_ in chunk])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, -1, :].float()
            logp = torch.log_softmax(logits, dim=-1).double().numpy()
            for (prefix, state, lm_lp, lps), row in zip(chunk, logp):
                allowed = state.allowed_token_ids()
                steps = {}
                for name, adj in methods.items():
                    a, lq = _method_step(row, state, adj)
                    steps[name] = lq
                for k, t in enumerate(allowed.tolist()):
                    new_lps = {m: lps[m] + float(steps[m][k]) for m in methods}
                    new_lm = lm_lp + float(row[t])
                    if t in eos:
                        leaves.append((prefix + (t,), new_lm, new_lps))
                    else:
                        child = state.fork()
                        child.advance(t)
                        nxt.append((prefix + (t,), child, new_lm, new_lps))
                if len(leaves) + len(nxt) > max_sequences:
                    raise ValueError(f"more than max_sequences={max_sequences} token paths: the "
                                     f"language is too large to enumerate")
        frontier = nxt
        depth += 1
    acceptor = reference_acceptor(masker.grammar)
    strings = [masker.decode([t for t in seq if t not in eos]) for seq, *_ in leaves]
    return ExactLanguageDistribution(
        sequences=[seq for seq, *_ in leaves], strings=strings,
        lm_logprob=np.array([lm for _, lm, _ in leaves]),
        method_logprob={m: np.array([lps[m] for *_, lps in leaves]) for m in methods},
        reference_rejects=sorted({s for s in strings if not acceptor.accepts(s)}))
