"""ASAp: the trie update by hand, and convergence toward the target on binary5."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shim_adapters.evaluation.asap import AsapTrie, run_asap

EOS = 0


@pytest.fixture(scope="module")
def binary5(shipped_lm):
    from shim_adapters.backends.registry import get_backend
    from shim_adapters.grammars.grammar import builtin_grammar
    from shim_adapters.lm.sampling import prefill

    grammar = builtin_grammar("binary5")
    masker = get_backend("xgrammar").compile(grammar, shipped_lm.tokenizer, shipped_lm.vocab_size)
    return masker, prefill(shipped_lm, grammar.default_prompt)


def test_trie_update_matches_hand_computation():
    trie = AsapTrie([EOS])
    # one sample "a b EOS": at the root the mask allowed mass 0.9, p(a) = 0.5;
    # after a: allowed 0.6, p(b) = 0.4; after a b: allowed 0.7 (EOS only), p(EOS) = 0.7
    trie.update([5, 6, EOS], np.log([0.5, 0.4, 0.7]), np.log([0.9, 0.6, 0.7]))
    efg_ab = 0.7  # only EOS allowed, and after EOS the output is complete
    efg_a = (0.6 - 0.4) + 0.4 * efg_ab
    efg_root = (0.9 - 0.5) + 0.5 * efg_a
    assert trie.efg([5, 6]) == pytest.approx(efg_ab)
    assert trie.efg([5]) == pytest.approx(efg_a)
    assert trie.efg([]) == pytest.approx(efg_root)
    assert trie.efg([7]) == 1.0  # unvisited: optimistic
    assert trie.n_nodes == 3 and trie.n_samples == 1 and trie.n_tokens == 3


def test_log_gamma_weights_only_visited_children():
    trie = AsapTrie([EOS])
    trie.update([5, EOS], np.log([0.5, 0.2]), np.log([0.8, 0.2]))

    class Root:  # a state at the empty prefix; only token_ids is read
        token_ids: list[int] = []

    (lg,) = trie.log_gamma([Root()], [np.array([3, 5, 9])])
    assert lg[0] == 0.0 and lg[2] == 0.0
    assert lg[1] == pytest.approx(math.log(0.2))
    snap = trie.snapshot()
    trie.update([3, EOS], np.log([0.3, 0.1]), np.log([0.8, 0.5]))
    assert snap.efg([3]) == 1.0 and trie.efg([3]) == pytest.approx(0.5)


def test_asap_converges_toward_the_target(binary5):
    """On binary5, ASAp's exact KL falls far below masking's as samples accumulate."""
    from shim_adapters.evaluation.exact_language import enumerate_language

    binary5_masker, binary5_prefilled = binary5
    run = run_asap(binary5_prefilled, binary5_masker, 150, checkpoints=(0, 20, 150),
                   max_new_tokens=8, generator=torch.Generator().manual_seed(0))
    lang = enumerate_language(binary5_prefilled, binary5_masker,
                              {f"asap@{k}": t for k, t in run.snapshots.items()})
    target = lang.target()
    from shim_adapters.evaluation.metrics import exact_kl

    kl = {k: exact_kl(target, lang.methods[f"asap@{k}"]) for k in (0, 20, 150)}
    masking = exact_kl(target, lang.methods["asap@0"])
    assert kl[0] == pytest.approx(masking)  # an empty trie is plain masking
    assert kl[150] < 0.3 * kl[0], kl
    assert kl[150] < kl[20], kl
    assert run.trie.n_samples == 150
    growth = [g["bytes"] for g in run.growth]
    assert growth == sorted(growth) and growth[-1] > growth[0]
