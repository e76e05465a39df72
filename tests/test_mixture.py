"""The importance-sampled KL agrees with the exact KL, and refuses to print noise as a number."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shim_adapters.backends.registry import get_backend
from shim_adapters.evaluation.exact_distribution import enumerate_language
from shim_adapters.evaluation.mixture import MixtureDraws, format_kl, mixture_kl
from shim_adapters.evaluation.scoring import score_sequences
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.lm.sampling import prefill, sample
from shim_adapters.shim.controller import LR_FULL
from shim_adapters.shim.correction import ShimAdjuster
from shim_adapters.shim.targets import make_targets
from shim_adapters.shim.training_data import sample_training_data

torch.set_num_threads(1)


def test_mixture_kl_matches_the_exact_kl_on_binary5(shipped_lm):
    masker = get_backend("xgrammar").compile(builtin_grammar("binary5"), shipped_lm.tokenizer,
                                             shipped_lm.vocab_size)
    prompt = masker.grammar.default_prompt
    data = sample_training_data(shipped_lm, masker, prompt, 300, seed=3, progress=False,
                                proposal="masked")
    t = make_targets("rollout", data)
    shim = ShimAdjuster(LR_FULL(n_splits=3, reg_grid=(1.0,)).fit(
        t.data, y=t.y, completion_weight=t.completion_weight))
    pre = prefill(shipped_lm, prompt)
    adjusters = {"masking": None, "lr_full": shim}
    ids, proposal, sequence = {}, [], []
    for k, name in enumerate(adjusters, start=0):
        got = sample(pre, 400, masker=masker, adjuster=adjusters[name], max_new_tokens=12,
                     generator=torch.Generator().manual_seed(10 + k))
        for toks in got.token_ids:
            proposal.append(k)
            sequence.append(ids.setdefault(tuple(toks), len(ids)))
    seqs = [list(s) for s in ids]
    scored = score_sequences(pre, seqs, masker, adjusters)
    est = mixture_kl(MixtureDraws(np.array(proposal), np.array(sequence), list(adjusters)),
                     scored.lm, scored.methods, n_bootstrap=100)
    lang = enumerate_language(shipped_lm, masker, prompt, {"lr_full": shim})
    for name in adjusters:
        exact = lang.kl(name, level="sequence")
        lo, hi = est.kl_ci[name]
        assert lo - 0.02 <= exact <= hi + 0.02, (name, exact, est.kl[name], (lo, hi))
    assert est.measurable and est.ess > 200
    exact_p = float(np.exp(np.logaddexp.reduce(lang.lm_logprob)))
    assert est.p_valid == pytest.approx(exact_p, rel=0.1)
    assert est.diff_to_masking["masking"] == 0.0


def test_a_number_with_too_few_effective_samples_is_not_printed():
    assert format_kl(0.5, (0.4, 0.6), ess=3.2) == "not measurable (ESS 3.2)"
    assert format_kl(0.5, (0.4, 0.6), ess=50) == "0.500 [0.400, 0.600]"
