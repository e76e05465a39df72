"""SHIM's correction at decoding time never weakens the masker's guarantee."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shim_adapters.backends.registry import get_backend
from shim_adapters.grammars.grammar import builtin_grammar
from shim_adapters.grammars.reference import reference_acceptor
from shim_adapters.lm.generation import MaskedLogitsProcessor
from shim_adapters.mask.bitmask import allocate_token_bitmask, apply_token_bitmask_
from shim_adapters.shim.controller import LR_FULL, MLP
from shim_adapters.shim.correction import ShimAdjuster, ShimLogitsProcessor, sample_with_shim
from shim_adapters.shim.gamma_cache import GammaCache
from shim_adapters.shim.masked_gamma import MaskedGammaRows
from shim_adapters.shim.training_data import sample_training_data

torch.set_num_threads(1)
#: Two grammars through two backends.
CASES = {"bv4": "syncode", "binary5": "xgrammar"}


@pytest.fixture(scope="module")
def setups(lm):
    out = {}
    for grammar, backend in CASES.items():
        masker = get_backend(backend).compile(builtin_grammar(grammar), lm.tokenizer,
                                              lm.vocab_size)
        data = sample_training_data(lm, masker, masker.grammar.default_prompt, 120,
                                    max_new_tokens=96, seed=5, progress=False)
        ctrl = {"LR_FULL": LR_FULL(n_splits=2).fit(data),
                # β fixed at 1: a fit may choose β = 0 (inert: nothing added), which would
                # leave the add paths below adding zeros for this controller
                "MLP": MLP(n_splits=2, epochs=5, reg_grid=(1e-3,), beta_grid=(1.0,)).fit(data)}
        out[grammar] = (masker, data, ctrl)
    return out


def _walk(masker, choices):
    """A real masker state reached by taking allowed tokens chosen by index (EOS avoided)."""
    state = masker.new_state()
    for c in choices:
        allowed = [t for t in state.allowed_token_ids() if t not in masker.eos_token_ids]
        if not allowed:
            break
        state.advance(int(allowed[c % len(allowed)]))
    return state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(grammar=st.sampled_from(sorted(CASES)), kind=st.sampled_from(["LR_FULL", "MLP"]),
       choices=st.lists(st.integers(0, 10_000), max_size=30), seed=st.integers(0, 2**31 - 1))
def test_correction_never_enables_a_forbidden_token(setups, grammar, kind, choices, seed):
    masker, _, ctrl = setups[grammar]
    state = _walk(masker, choices)
    mask = state.allowed_mask()
    scores = torch.randn((1, masker.vocab_size), generator=torch.Generator().manual_seed(seed))
    prompt = torch.zeros((1, 3), dtype=torch.long)
    plain = MaskedLogitsProcessor([state.fork()])(prompt, scores.clone())[0]
    shim = ShimLogitsProcessor([state.fork()], ctrl[kind])(prompt, scores.clone())[0]
    allowed = torch.from_numpy(mask)
    # forbidden stays -inf, allowed stays finite
    assert torch.isneginf(shim[~allowed]).all() and torch.isfinite(shim[allowed]).all()
    # the correction is exactly β·log γ̂ on the allowed set (up to one per-row constant, which
    # the softmax removes), and never positive
    lg = ctrl[kind].predict_log_gamma(state.features(), np.flatnonzero(mask))
    expected = plain.clone().double()
    expected[allowed] += torch.from_numpy(lg)
    np.testing.assert_allclose(torch.log_softmax(shim.double(), -1)[allowed].numpy(),
                               torch.log_softmax(expected, -1)[allowed].numpy(),
                               rtol=1e-4, atol=1e-4)
    assert (lg <= 0).all()
    # the corrected distribution sums to one over the allowed set
    probs = torch.softmax(shim.double(), dim=-1)
    assert float(probs[allowed].sum()) == pytest.approx(1.0, abs=1e-9)
    # EOS is allowed exactly where the grammar accepts
    for e in masker.eos_token_ids:
        assert bool(torch.isfinite(shim[e])) == state.eos_allowed()


def test_adjuster_batches_rows_like_single_rows(setups):
    masker, data, ctrl = setups["bv4"]
    states = [_walk(masker, [i, 2 * i, 3 * i]) for i in range(6)]
    adj = ShimAdjuster(ctrl["MLP"])
    allowed = [s.allowed_token_ids() for s in states]
    batched = adj.log_gamma(states, allowed)
    for s, a, b in zip(states, allowed, batched):
        np.testing.assert_allclose(b, ctrl["MLP"].predict_log_gamma(s.features(), a), atol=1e-6)


@pytest.mark.parametrize("grammar", sorted(CASES))
def test_shim_samples_are_in_the_language(lm, setups, grammar):
    masker, _, ctrl = setups[grammar]
    out = sample_with_shim(lm, masker, ctrl["LR_FULL"], masker.grammar.default_prompt, 8,
                           max_new_tokens=96, seed=0)
    acceptor = reference_acceptor(masker.grammar)
    finished = [t for t, done in zip(out.texts, out.complete) if done]
    assert finished, "no sample finished within max_new_tokens"
    assert all(acceptor.accepts(t) for t in finished), finished


def test_unfitted_controller_is_refused():
    with pytest.raises(ValueError, match="not fitted"):
        ShimAdjuster(LR_FULL())


def test_cached_gamma_add_equals_log_gamma(setups):
    """add_log_gamma_ (the γ cache's path) adds exactly log_gamma's values to allowed tokens,
    on hits as well as misses, for rows given in any order."""
    for grammar in sorted(CASES):
        masker, _, ctrl = setups[grammar]
        for kind in ("LR_FULL", "MLP"):
            adj = ShimAdjuster(ctrl[kind])
            assert ShimAdjuster(ctrl[kind]).cache is adj.cache  # one cache per controller
            adj.cache.clear()
            states = [_walk(masker, [i, 3 * i, 7 * i, 11 * i]) for i in range(8)] * 2
            allowed = [s.allowed_token_ids() for s in states]
            expected = adj.log_gamma(states, allowed)
            rows = list(reversed(range(len(states))))
            scores = torch.zeros((len(states), masker.vocab_size), dtype=torch.float64)
            adj.add_log_gamma_(scores, states, rows, exact=True)
            for s, r, a, e in zip(states, rows, allowed, expected):
                np.testing.assert_allclose(scores[r, a].numpy(), e, atol=1e-5)
            info = adj.cache_info()
            assert info["lookups"] == len(states)
            assert info["hits"] >= len(states) // 2  # the second copy of each state hits
            assert 0 < info["bytes"] <= info["max_bytes"]


def test_gamma_cache_respects_its_memory_bound(setups):
    masker, _, ctrl = setups["bv4"]
    per_entry = ShimAdjuster(ctrl["LR_FULL"]).cache.entry_bytes
    adj = ShimAdjuster(ctrl["LR_FULL"], cache_bytes=3 * (per_entry + 400))
    adj.cache.clear()
    states = [_walk(masker, [i, 5 * i, 9 * i, 2 * i, i + 1]) for i in range(30)]
    scores = torch.zeros((1, masker.vocab_size))
    for s in states:
        adj.add_log_gamma_(scores, [s])
    info = adj.cache_info()
    assert info["entries"] <= 3 and info["bytes"] <= info["max_bytes"]
    assert info["misses"] >= 4  # evicted states are recomputed, not served stale
    with pytest.raises(ValueError, match="max_bytes"):
        ShimAdjuster(ctrl["LR_FULL"], cache_bytes=0)


def test_gamma_cache_keys_are_shared_by_maskers_with_one_fingerprint(setups, lm):
    """A wrapper builds its masker afresh per generate call: a masker with the same
    fingerprint finds the keys warm; one with another feature readout does not."""
    masker, _, ctrl = setups["binary5"]
    adj = ShimAdjuster(ctrl["LR_FULL"])
    adj.cache.clear()
    scores = torch.zeros((1, masker.vocab_size))
    states = [_walk(masker, [i, 2 * i]) for i in range(4)]
    for s in states:
        adj.add_log_gamma_(scores, [s])
    backend = get_backend("xgrammar")
    twin = backend.compile(masker.grammar, lm.tokenizer, lm.vocab_size)
    assert twin is not masker and twin.fingerprint() == masker.fingerprint()
    before = adj.cache_info()
    for i in range(4):
        adj.add_log_gamma_(scores, [_walk(twin, [i, 2 * i])])
    after = adj.cache_info()
    assert after["hits"] - before["hits"] == 4 and after["keys"] == before["keys"]
    other = backend.compile(masker.grammar, lm.tokenizer, lm.vocab_size,
                            start_positions="absolute", position_feature=True)
    adj.add_log_gamma_(scores, [_walk(other, [1, 2])])
    assert adj.cache_info()["keys"] == after["keys"] + 1  # its own key table


def test_batch_one_gamma_add_is_log_gamma_up_to_a_constant(setups):
    """The batch-1 fast path (one state, exact=False) adds log_gamma's values up to one
    constant per row, on a miss and on a hit, into the row it is given and no other."""
    masker, _, ctrl = setups["bv4"]
    adj = ShimAdjuster(ctrl["LR_FULL"])
    adj.cache.clear()
    for i in range(6):
        state = _walk(masker, [i, 3 * i, 5 * i])
        allowed = state.allowed_token_ids()
        (expected,) = adj.log_gamma([state], [allowed])
        for attempt in ("miss", "hit"):
            scores = torch.zeros((4, masker.vocab_size))
            adj.add_log_gamma_(scores, [state], [2])
            got = scores[2, allowed].numpy()
            np.testing.assert_allclose(got - got[0], expected - expected[0], atol=1e-5)
            assert not scores[[0, 1, 3]].any()
    info = adj.cache_info()
    assert info["lookups"] == 12 and info["hits"] >= 6
    with pytest.raises(ValueError, match="1 state but 2 rows"):
        adj.add_log_gamma_(torch.zeros((2, masker.vocab_size)), [state], [0, 1])


def test_batch_one_gather_layout_adds_log_gamma_into_its_row(setups):
    """The table layout of 50k+ vocabularies (one column per scored token, forced here on the
    shipped vocabulary) at batch 1: log_gamma's values up to one constant, on a miss and a hit,
    into the given row only."""
    masker, _, ctrl = setups["bv4"]
    adj = ShimAdjuster(ctrl["LR_FULL"])
    adj.cache = GammaCache(ctrl["LR_FULL"], dense=False)
    assert not adj.cache.dense and len(adj.cache.columns) < masker.vocab_size
    for i in range(5):
        state = _walk(masker, [i, 2 * i + 1, 4 * i])
        allowed = state.allowed_token_ids()
        (expected,) = adj.log_gamma([state], [allowed])
        for rows, shape, strided in ((None, (1, masker.vocab_size), False),
                                     ([1], (3, masker.vocab_size), False),
                                     ([1], (3, masker.vocab_size), True)):
            # strided: the last position's logits as a view, as logits[:, -1, :] gives them
            scores = torch.zeros((shape[0], 2, shape[1]))[:, 1] if strided \
                else torch.zeros(shape)
            assert scores.is_contiguous() is not strided
            adj.add_log_gamma_(scores, [state], rows)
            r = 0 if rows is None else rows[0]
            got = scores[r, allowed].numpy()
            np.testing.assert_allclose(got - got[0], expected - expected[0], atol=1e-5)
            assert not scores[[k for k in range(shape[0]) if k != r]].any()
            assert scores[r, adj.cache.columns].any() or not expected.any()
    assert adj.cache_info()["hits"] >= 5


def test_beta_zero_adjuster_is_inert_and_samples_as_masking(setups):
    """A controller damped by β = 0 adds nothing: the adjuster leaves the logits untouched
    without computing or caching a γ (no lookups), the summed path declines, and the processor
    gives exactly plain masking; undamped it still adds the raw log γ̂."""
    masker, _, ctrl = setups["bv4"]
    zero = copy.copy(ctrl["LR_FULL"])
    zero.__dict__.pop("_gamma_caches", None)
    zero.beta_ = 0.0
    adj = ShimAdjuster(zero)
    assert adj.inert and not ShimAdjuster(zero, damped=False).inert
    assert not ShimAdjuster(ctrl["LR_FULL"]).inert or ctrl["LR_FULL"].beta_ == 0.0
    states = [_walk(masker, [i, 3 * i + 2]) for i in range(3)]
    for lg in adj.log_gamma(states, [s.allowed_token_ids() for s in states]):
        assert not lg.any()  # what the inert path skips adding is zero
    scores = torch.randn((3, masker.vocab_size), generator=torch.Generator().manual_seed(3))
    for batch in (states[:1], states):
        out = scores[:len(batch)].clone()
        assert adj.add_log_gamma_(out, batch) is out
        assert torch.equal(out, scores[:len(batch)])
        bitmask = allocate_token_bitmask(len(batch), masker.vocab_size)
        masker.fill_next_token_bitmasks(batch, bitmask, range(len(batch)))
        assert not adj.add_masked_log_gamma_(out, batch, None, bitmask)
        prompt = torch.zeros((len(batch), 2), dtype=torch.long)
        logits = scores[:len(batch)]
        plain = MaskedLogitsProcessor([s.fork() for s in batch])(prompt, logits.clone())
        shim = ShimLogitsProcessor([s.fork() for s in batch], zero)(prompt, logits.clone())
        assert torch.equal(plain, shim)
    assert adj.cache_info()["lookups"] == 0
    with pytest.raises(ValueError, match="1 states but 2 rows"):
        adj.add_log_gamma_(scores[:2].clone(), states[:1], [0, 1])
    raw = torch.zeros((1, masker.vocab_size))
    ShimAdjuster(zero, damped=False).add_log_gamma_(raw, states[:1])
    assert raw.any()  # undamped: log γ̂ itself


def test_batch_one_torch_add_follows_the_table_as_it_grows_and_shrinks(setups):
    """Batch 1 adds each entry's row view with one torch call; the views follow the table when
    it is reallocated (growth past 4 slots, compaction after eviction) and when it is widened
    to the logits' width, so every add still equals log_gamma up to one constant."""
    masker, _, ctrl = setups["bv4"]
    per_entry = ShimAdjuster(ctrl["LR_FULL"]).cache.entry_bytes
    for bound in (None, 6 * (per_entry + 400)):  # growth only; growth, eviction, compaction
        adj = (ShimAdjuster(ctrl["LR_FULL"]) if bound is None
               else ShimAdjuster(ctrl["LR_FULL"], cache_bytes=bound))
        adj.cache.clear()
        states = [_walk(masker, [i, 5 * i, 9 * i, 2 * i, i + 1]) for i in range(24)]
        for state in states + states[::3]:
            allowed = state.allowed_token_ids()
            (expected,) = adj.log_gamma([state], [allowed])
            scores = torch.zeros((1, masker.vocab_size))
            adj.add_log_gamma_(scores, [state])
            got = scores[0, allowed].numpy()
            np.testing.assert_allclose(got - got[0], expected - expected[0], atol=1e-5)
        cache = adj.cache
        assert len(cache.table) > 4  # it grew (and shrank, with the bound) along the way
        if cache.dense and masker.vocab_size <= 2 * len(cache.columns):
            assert cache.width == masker.vocab_size  # widened: one add of a whole row
        for entry in cache._by_encoding.values():
            assert entry.row.data_ptr() == cache.table_tensor[entry.slot].data_ptr()


def test_widened_cache_keeps_the_torch_path_in_step(setups):
    """Widening the table (batch 1, float32) after the torch path (bfloat16 logits) built its
    column index leaves that path correct: the index follows the table's columns."""
    masker, _, ctrl = setups["bv4"]
    adj = ShimAdjuster(ctrl["LR_FULL"])
    adj.cache.clear()
    states = [_walk(masker, [i, 2 * i + 1]) for i in range(2)]
    allowed = [s.allowed_token_ids() for s in states]
    expected = adj.log_gamma(states, allowed)

    def check():
        scores = torch.zeros((2, masker.vocab_size), dtype=torch.bfloat16)
        adj.add_log_gamma_(scores, states)
        for r in range(2):
            got = scores[r, allowed[r]].float().numpy()
            np.testing.assert_allclose(got - got[0], expected[r] - expected[r][0], atol=0.05)

    check()  # builds the column index at the table's first width
    adj.add_log_gamma_(torch.zeros((1, masker.vocab_size)), [states[0]])
    if adj.cache.dense:
        assert adj.cache.width == masker.vocab_size
    check()


def _two_pass(adj, states, rows, scores, bitmask):
    """The reference for the summed rows: γ's add, then the core's mask kernel."""
    adj.add_log_gamma_(scores, states, rows)
    return apply_token_bitmask_(scores, bitmask)


@pytest.mark.parametrize("grammar", sorted(CASES))
def test_summed_gamma_and_mask_equal_the_two_passes(setups, grammar):
    """One add of the cached (γ entry, mask) rows gives exactly γ's add followed by the mask,
    for a batch with rows left out (masked only) and for all rows, on misses and on hits;
    batch 1 is left to the two passes (cheaper there)."""
    masker, _, ctrl = setups[grammar]
    states = [_walk(masker, [i, 3 * i + 1, 7 * i]) for i in range(6)]
    rows = [0, 2, 3, 5]  # rows 1 and 4: masked only (as finished rows are)
    bitmask = allocate_token_bitmask(len(states), masker.vocab_size)
    masker.fill_next_token_bitmasks(states, bitmask, range(len(states)))
    generator = torch.Generator().manual_seed(7)
    # the default bound, and one that keeps only the current step's γ entries (an evicted
    # entry's summed rows are found again by its encoded state, and must still be its values)
    others = [_walk(masker, [i + 40, 2 * i + 9, 5 * i]) for i in range(8)]
    distinct = len({e.ekey for e in ShimAdjuster(ctrl["LR_FULL"]).cache.entries(states)})
    for bound in (None, 1):
        adj = (ShimAdjuster(ctrl["LR_FULL"]) if bound is None
               else ShimAdjuster(ctrl["LR_FULL"], cache_bytes=bound))
        adj.cache.clear()
        for attempt in ("miss", "hit"):
            assert not adj.add_masked_log_gamma_(torch.zeros((1, masker.vocab_size)),
                                                 states[:1], None, bitmask[:1])
            for batch_rows, batch_states, mask in (
                    (rows, [states[r] for r in rows], bitmask),
                    (None, states[:2], bitmask[:2])):
                scores = torch.randn((len(mask), masker.vocab_size), generator=generator)
                expected = _two_pass(adj, batch_states, batch_rows, scores.clone(), mask)
                for other in others:  # other states in between (evictions)
                    adj.cache.entries([other])
                assert adj.add_masked_log_gamma_(scores, batch_states, batch_rows, mask)
                assert torch.equal(torch.isneginf(scores), torch.isneginf(expected))
                finite = ~torch.isneginf(expected)
                torch.testing.assert_close(scores[finite], expected[finite], atol=1e-5,
                                           rtol=0)
        info = adj.cache_info()
        assert info["masked_rows"] > 0 and info["masked_rows_bytes"] > 0
        if bound is not None:
            assert info["misses"] > distinct  # entries were evicted and computed again


def test_non_finite_logits_take_the_two_pass_path(setups):
    """+inf or NaN at a forbidden token would become NaN in the summed add (and greedy's
    argmax picks a NaN): such a batch is left to the two passes, which write -inf there."""
    masker, _, ctrl = setups["binary5"]
    states = [_walk(masker, [1, 2]), _walk(masker, [2, 1])]
    forbidden = np.flatnonzero(~states[1].allowed_mask())
    prompt = torch.zeros((2, 3), dtype=torch.long)
    adj = ShimAdjuster(ctrl["LR_FULL"])
    bitmask = allocate_token_bitmask(2, masker.vocab_size)
    masker.fill_next_token_bitmasks(states, bitmask, [0, 1])
    assert adj.add_masked_log_gamma_(torch.randn((2, masker.vocab_size)), states, None, bitmask)
    for bad in (float("inf"), float("nan")):
        scores = torch.randn((2, masker.vocab_size))
        scores[1, forbidden[:3]] = bad
        assert not adj.add_masked_log_gamma_(scores.clone(), states, None, bitmask)
        out = ShimLogitsProcessor([s.fork() for s in states], ctrl["LR_FULL"])(prompt, scores)
        assert torch.isneginf(out[1, forbidden]).all()
        assert not torch.isnan(out).any()


def test_summed_rows_respect_their_memory_bound(setups):
    """Past the bound the summed rows start over (and are rebuilt, still exact)."""
    masker, _, ctrl = setups["bv4"]
    adj = ShimAdjuster(ctrl["LR_FULL"])
    states = [_walk(masker, [i, 5 * i, 9 * i, 2 * i, i + 1]) for i in range(12)]
    bitmask = allocate_token_bitmask(1, masker.vocab_size)
    cache = adj.cache
    small = MaskedGammaRows(masker.vocab_size, bitmask.shape[1],
                            max_bytes=3 * (4 * masker.vocab_size + 4 * bitmask.shape[1] + 150))
    for state in states + states:
        masker.fill_next_token_bitmasks([state], bitmask, [0])
        (entry,) = cache.entries([state])
        scores = torch.randn((1, masker.vocab_size))
        expected = _two_pass(adj, [state], None, scores.clone(), bitmask)
        small.add_(scores, bitmask.numpy(), [entry], cache.table)
        assert torch.equal(torch.isneginf(scores), torch.isneginf(expected))
        finite = ~torch.isneginf(expected)
        torch.testing.assert_close(scores[finite], expected[finite], atol=1e-5, rtol=0)
    info = small.info()
    assert info["resets"] >= 1 and info["rows"] <= 3 and info["bytes"] <= small.max_bytes
    with pytest.raises(ValueError, match="cannot hold"):
        MaskedGammaRows(masker.vocab_size, 1)


def test_summed_rows_start_over_between_batches_not_inside_one(setups):
    """A batch whose new rows cross the bound: the rows start over before its lookups, so
    every row gets its own (γ, mask) sum. (Starting over inside the lookup loop left the slots
    already collected pointing into the dropped table: an IndexError at json batch 32 with the
    default 32 MiB bound, or another row's mask where the stale slot was still in range.)"""
    masker, _, ctrl = setups["bv4"]
    adj = ShimAdjuster(ctrl["LR_FULL"])
    states = [_walk(masker, [i, 5 * i, 9 * i, 2 * i, i + 1]) for i in range(12)]
    bitmask = allocate_token_bitmask(len(states), masker.vocab_size)
    masker.fill_next_token_bitmasks(states, bitmask, range(len(states)))
    words = bitmask.numpy()
    distinct = len({(e.ekey, words[r].tobytes())
                    for r, e in enumerate(adj.cache.entries(states))})
    assert distinct >= 5  # more new rows in one batch than the bound holds
    row_bytes = 4 * masker.vocab_size + 4 * bitmask.shape[1] + 150
    small = MaskedGammaRows(masker.vocab_size, bitmask.shape[1], max_bytes=3 * row_bytes)
    generator = torch.Generator().manual_seed(11)
    for order in (range(3), range(12), range(11, -1, -1), range(12)):
        rows = list(order)
        entries = adj.cache.entries([states[r] for r in rows])
        scores = torch.randn((len(rows), masker.vocab_size), generator=generator)
        expected = _two_pass(adj, [states[r] for r in rows], None, scores.clone(),
                             bitmask[rows])
        small.add_(scores, words[rows], entries, adj.cache.table)
        assert torch.equal(torch.isneginf(scores), torch.isneginf(expected))
        finite = ~torch.isneginf(expected)
        torch.testing.assert_close(scores[finite], expected[finite], atol=1e-5, rtol=0)
    info = small.info()
    assert info["resets"] >= 2 and info["rows"] <= distinct


def test_refit_gives_new_adjusters_a_fresh_gamma_cache(setups):
    """The γ cache is shared through the controller; refitting the controller in place (other
    data, another β) must not hand new adjusters the old fit's values."""
    masker, data, _ = setups["bv4"]
    ctrl = LR_FULL(n_splits=2, beta_grid=(1.0,)).fit(data)
    state = _walk(masker, [1, 3])
    allowed = state.allowed_token_ids()
    old = ShimAdjuster(ctrl)
    old.add_log_gamma_(torch.zeros((1, masker.vocab_size)), [state])  # fills the old cache
    ctrl.set_params(beta_grid=(0.5,)).fit(data)
    new = ShimAdjuster(ctrl)
    assert new.cache is not old.cache and new.cache.info()["lookups"] == 0
    scores = torch.zeros((1, masker.vocab_size))
    new.add_log_gamma_(scores, [state])
    (expected,) = new.log_gamma([state], [allowed])
    got = scores[0, allowed].numpy()
    np.testing.assert_allclose(got - got[0], expected - expected[0], atol=1e-5)
